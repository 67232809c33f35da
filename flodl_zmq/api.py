"""The public training API: one `Trainer`, the same call in every process.

    import flodl_zmq as fz
    result = fz.Trainer(
        model=lambda: Net(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        train_step=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        dataset=train_set, batch_size=32, epochs=10, mode="cpu-cadence",
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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flodl_zmq import bundle, checkpoints
from flodl_zmq.environment import ProcessEnv, watch_lifeline
from flodl_zmq.job import Job, coordinator_config
from flodl_zmq.loader import BatchPipeline
from flodl_zmq.rank import RankRuntime
from flodl_zmq.rank_link import RankConfig
from flodl_zmq.report import RunReport
from flodl_zmq.result import TrainResult, epoch_row
from flodl_zmq.runlog import run_dir_for
from flodl_zmq.sampling import epoch_permutation
from flodl_zmq.settings import Settings
from flodl_zmq.training import ScalarLog, Stepper, recording

if TYPE_CHECKING:
    from flodl_zmq.membership_link import MembershipLink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hosted:
    """A role handed to the user's script by the process that runs it: the role, and the membership link."""

    penv: ProcessEnv
    link: MembershipLink | None = None


# The one hand-off from a process that runs the user's script itself (runpy) to that
# script's Trainer.run(): the script builds the Trainer, so no argument can carry the
# role there, and putting it in os.environ would leak it to everything the script
# starts and outlive the run. Set only through `hosted`.
_HOSTED: contextvars.ContextVar[Hosted | None] = contextvars.ContextVar("flodl_hosted", default=None)


@contextlib.contextmanager
def hosted(penv: ProcessEnv, link: MembershipLink | None = None) -> Iterator[None]:
    """Within the block, `Trainer.run()` plays `penv`'s role (with `link`) instead of reading the environment."""
    token = _HOSTED.set(Hosted(penv, link))
    try:
        yield
    finally:
        _HOSTED.reset(token)


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
        host = _HOSTED.get()
        penv = host.penv if host is not None else ProcessEnv.from_environ()
        if penv is None:
            return train_alone(self.job)
        if penv.lifeline_fd is not None:
            watch_lifeline(penv.lifeline_fd)
        job = self.job
        job.check_settings(penv.settings)  # the run's settings agree with the job (wire format, beats)
        # A relay's comings and goings (ranks joining, leaving) are what an operator reads
        # when a host misbehaves; ranks and the controller print progress, not chatter.
        level = logging.INFO if penv.role == "relay" else logging.WARNING
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        if penv.role == "controller":
            from flodl_zmq.controller_service import run_controller

            # A restart or re-form: only the controller reads the checkpoint (PROTOCOL.md 13).
            stem = checkpoints.resolve(penv.settings.resume, penv.settings.checkpoint_dir)
            if stem is not None:
                job = dataclasses.replace(job, resume_from=str(stem))
            return run_controller(job, penv, host.link if host is not None else None)
        if penv.role == "relay":
            from flodl_zmq.relay import run_relay

            raise SystemExit(run_relay(penv, job.wire))  # a script run as the relay knows the format
        raise SystemExit(run_rank(job, penv))


def run_rank(job: Job, penv: ProcessEnv) -> int:
    """The rank role: connect to this host's relay and train until told to stop."""
    from flodl_zmq.links import local_endpoints

    assert penv.host is not None and penv.rank is not None and penv.local_rank is not None
    control, data = local_endpoints(penv.key, penv.incarnation, penv.host)
    s = penv.settings
    cfg = RankConfig(
        # Resumed (the job's resume_from, or the checkpoint the controller ships, FLODL_RESUME): the rank
        # loads the starting consensus from the reducer before its first step and opens no file.
        resumed=bool(job.resume_from) or s.resume is not None,
        rank=penv.rank, local_rank=penv.local_rank, world_size=penv.world_size, host=penv.host,
        key=penv.key, incarnation=penv.incarnation, control_endpoint=control, data_endpoint=data,
        slowdown=s.slowdown, rank_heartbeat_period_s=s.rank_heartbeat_period_s,
        coordinator_silence_at_rank_s=s.coordinator_silence_at_rank_s,
        coordinator_first_contact_at_rank_s=s.coordinator_first_contact_at_rank_s,
        consensus_wait_at_relay_s=s.consensus_wait_at_relay_s,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return RankRuntime(job, cfg).run()


def alone_row(epoch: int, loss_sum: float, batches: int, samples: int, t0: float,
              scalars: ScalarLog) -> dict[str, Any]:
    """The row of `TrainResult.epochs` for the batches (`samples`) of `epoch` trained alone so far."""
    epoch_ms = (time.perf_counter() - t0) * 1000.0
    return epoch_row(epoch, loss_sum / max(batches, 1), epoch_ms, [1.0], [samples / max(epoch_ms, 1e-9)],
                     {k: scalars.sums[k] / scalars.counts[k] for k in sorted(scalars.sums)})


def train_alone(job: Job) -> TrainResult:
    """Train `job` in this process: the same data order, steps and callbacks, no cluster."""
    torch.set_num_threads(job.torch_threads)
    torch.manual_seed(job.seed)
    model = job.model()
    start_epoch = _resume_alone(job, model)
    optimizer = job.optimizer(model.parameters())
    device = torch.device("cpu")
    stepper = Stepper(job, model, optimizer, device)
    steps_per_epoch = math.ceil(job.total_samples / job.batch_size)
    pipeline = BatchPipeline(job.dataset, device, job.num_workers, job.prefetch_factor, job.pin_memory,
                             job.collate_fn)
    scalars = ScalarLog()
    result = TrainResult(model=model)
    report = RunReport(
        job, result, steps_per_epoch,
        run_dir_for(job.run_dir, Settings.from_environ(scopes=("process",)).run_dir), start_epoch,
    )
    report.events.write("start", mode="alone", epochs=job.epochs, world={"local": [0]}, world_size=1)
    t_run = time.perf_counter()
    try:
        with recording(scalars):
            for epoch in range(start_epoch, job.epochs):
                if job.epoch_fn is not None:
                    job.epoch_fn(epoch, model)
                row = _train_epoch_alone(job, epoch, stepper, pipeline, report, scalars, steps_per_epoch)
                scalars.take()
                if _eval_due(job, epoch):
                    model.eval()
                    with torch.no_grad():
                        report.evaluated(epoch, float(job.eval_fn(model, job.eval_dataset)), row=row)
                report.epoch(row)
    finally:
        pipeline.close()
        report.close()
    wall_s = time.perf_counter() - t_run
    if job.save_path:
        report.save(model.state_dict(), {
            "epoch": job.epochs, "global_step": None, "reason": "completed", "world_size": 1, "coordinator": None,
        })
    report.finish(wall_s)
    result.batch_share = [1.0]
    return result


def _resume_alone(job: Job, model: torch.nn.Module) -> int:
    """Load `job.resume_from` into `model`; the epoch to start at (0 without one)."""
    if not job.resume_from:
        return 0
    state, meta = bundle.load(job.resume_from)
    model.load_state_dict(state)
    return int(meta.get("epoch", 0))


def _train_epoch_alone(job: Job, epoch: int, stepper: Stepper, pipeline: BatchPipeline, report: RunReport,
                       scalars: ScalarLog, steps_per_epoch: int) -> dict[str, Any]:
    """Every step of `epoch` in the cluster's data order; the epoch's row (scalars not yet taken)."""
    t0 = time.perf_counter()
    perm = epoch_permutation(job.seed, epoch, job.total_samples)
    loss_sum, batches, parts = 0.0, 0, 0
    pipeline.extend(perm[start : start + job.batch_size] for start in range(0, len(perm), job.batch_size))
    while len(pipeline):
        # The global step of a single process: every step before this one, resumed ones too.
        stepper.follow(epoch * steps_per_epoch + batches)
        loss_sum += stepper.step(pipeline.next())
        batches += 1
        report.step()
        if job.reports_per_epoch > 1 and len(pipeline):
            # The cluster's rule (coordinator/metrics.py): one partial row per n-th of the epoch.
            k = batches * job.reports_per_epoch // steps_per_epoch
            if k > parts:
                parts = k
                report.progress({**alone_row(epoch, loss_sum, batches, min(batches * job.batch_size, len(perm)), t0, scalars),
                                 "fraction": k / job.reports_per_epoch})
    return alone_row(epoch, loss_sum, batches, min(batches * job.batch_size, len(perm)), t0, scalars)


def _eval_due(job: Job, epoch: int) -> bool:
    """An eval after `epoch`: every `eval_every` epochs and after the last one."""
    return bool(job.eval_fn is not None and job.eval_dataset is not None and job.eval_every and (
        (epoch + 1) % job.eval_every == 0 or epoch + 1 == job.epochs
    ))
