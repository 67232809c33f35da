"""The public training API: one `Trainer`, the same call in every process.

    import flodl_zmq as fz
    result = fz.Trainer(
        model=lambda: Net(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        train_step=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        dataset=train_set, batch_size=32, epochs=10,
        eval_dataset=test_set, eval_fn=accuracy, save_path="runs/digits",
    ).run()

`run()` reads the process's role from the environment (FLODL_ROLE and the
other FLODL_* variables, documented in flodl_zmq/environment.py, set by
`flodl-zmq launch`, an agent, or a compose file), unless the process hosts
the script under a role it hands over itself (`hosted`, used by
`flodl-zmq controller`):

- unset: trains alone in this process (the single-process baseline);
- controller: runs the coordinator and the reducer, shows progress, and
  returns a `TrainResult` with the consensus model and per-epoch metrics;
- relay / rank: serves its role and then ends the process (`SystemExit`
  with the role's exit status), so the code after `run()` (printing
  results, saving plots) only runs where a result exists.

Trainer is a user of the session machinery (flodl_zmq/session.py), whose
`Session` is the public API for a loop the user keeps: `run()` is
`for batch in s.batches(): s.step(stepper.step(batch))` on the replica
built from the job's factories, seeded alike in every process.
"""

from __future__ import annotations

from typing import Any

from flodl_zmq.job import Job, coordinator_config
from flodl_zmq.result import TrainResult
from flodl_zmq.session import Session, hosted


class Trainer:
    """A data-parallel training run (see the module docstring for how roles are chosen).

    The keywords are the fields of `flodl_zmq.job.Job`, documented there (one
    place): model, optimizer, train_step, dataset, batch_size and epochs are
    required; an unknown keyword is a TypeError naming it and its closest
    matches, a bad value a ConfigError naming the setting.
    """

    def __init__(self, *args: Any, **keywords: Any) -> None:
        self.job = Job.from_keywords(*args, **keywords)
        coordinator_config(self.job)  # every scheduling setting is checked now, in every process

    def run(self) -> TrainResult:
        """Run this process's role; returns the result on the controller and when alone."""
        return train(Session.of_job(self.job))


def train(session: Session) -> TrainResult:
    """The job's step on every batch `session` hands out; its result (ranks and relays exit instead)."""
    with session as s:
        for batch in s.batches():
            s.step(s.stepper.step(batch))
    assert s.result is not None
    return s.result


def train_alone(job: Job) -> TrainResult:
    """Train `job` in this process: the same data order, steps and callbacks, no cluster."""
    return train(Session.of_job(job, alone=True))


__all__ = ["Session", "TrainResult", "Trainer", "hosted", "train", "train_alone"]
