"""Training in this process alone: the batches of every epoch in the cluster's order, and their report.

`AloneLoop` is the single-process side of the session machinery
(flodl_zmq/session.py): `batches()` hands out every sample of each epoch
once, in the seeded order the cluster's ranks share (sampling.py), and
`step(loss)` counts a step the caller took on the last one. Trainer's step
and a user's own loop (`Session`) both run through it, so the two print,
evaluate and save identically (report.py).

Evals: after every `eval_every` epochs and the last, and within epochs every
`eval_every_samples` samples (the cluster's rule, roles.py `SampleCadence`:
one eval per due point, an epoch's eval counting for it), after the step
that reaches them, so a lone run is scored as often as a cluster's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from flodl_zmq import bundle
from flodl_zmq.coordinator.roles import SampleCadence
from flodl_zmq.errors import ConfigError
from flodl_zmq.job import Job
from flodl_zmq.loader import BatchPipeline
from flodl_zmq.payload import check_model
from flodl_zmq.report import RunReport, eval_due
from flodl_zmq.result import TrainResult, epoch_row
from flodl_zmq.runlog import run_dir_for
from flodl_zmq.sampling import epoch_permutation
from flodl_zmq.settings import Settings
from flodl_zmq.training import ScalarLog, Stepper, score

log = logging.getLogger(__name__)


class AloneLoop:
    """One process's run of `job` on `model` (on `device`) with `optimizer`: batches out, steps in."""

    def __init__(self, job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        # The cluster's rules on what a round averages (float32, shaped, finite) and on its wire, checked
        # alone too: a script that trains alone must not first fail when it is launched on a cluster.
        check_model(model, job.wire)
        self.job = job
        self.model = model
        self.start_epoch, self.start_batches = _resume_alone(job, model)
        # The job's step under Trainer; under Session only its schedule (follow) is used.
        self.stepper = Stepper(job, model, optimizer, device)
        self.steps_per_epoch = math.ceil(job.total_samples / job.batch_size)
        self.pipeline = BatchPipeline(job.dataset, device, job.num_workers, job.prefetch_factor, job.pin_memory,
                                      job.collate_fn)
        self.scalars = ScalarLog()
        self.result = TrainResult(model=model)
        self.report = RunReport(
            job, self.result, self.steps_per_epoch,
            run_dir_for(job.run_dir, Settings.from_environ(scopes=("process",)).run_dir), self.start_epoch,
        )
        self.epoch: int | None = None
        self.epochs_done = self.start_epoch
        self._t_run = self._t_epoch = 0.0
        self._samples = 0
        self._loss_sum, self._batches, self._parts = 0.0, 0, 0
        self._skipped = 0
        self.cadence = SampleCadence(job.eval_every_samples if job.eval_fn is not None else 0,
                                     self.start_epoch * job.total_samples + self.start_batches * job.batch_size)

    def batches(self) -> Iterator[Any]:
        """Every batch of every epoch left, in the cluster's data order; each epoch's row, eval and report."""
        job = self.job
        self.report.events.write("start", mode="alone", epochs=job.epochs, world={"local": [0]}, world_size=1)
        self._t_run = time.perf_counter()
        for epoch in range(self.start_epoch, job.epochs):
            self.epoch = epoch
            if job.epoch_fn is not None:
                job.epoch_fn(epoch, self.model)
            self._t_epoch = time.perf_counter()
            perm = epoch_permutation(job.seed, epoch, job.total_samples)
            self._samples = len(perm)
            self._loss_sum, self._batches, self._parts = 0.0, 0, 0
            self._skipped = self.start_batches if epoch == self.start_epoch else 0  # trained before a resume
            first = self._skipped * job.batch_size
            self.pipeline.extend(perm[start : start + job.batch_size] for start in range(first, len(perm), job.batch_size))
            while len(self.pipeline):
                # The global step of a single process: every step before this one, resumed ones too.
                self.stepper.follow(epoch * self.steps_per_epoch + self._skipped + self._batches)
                yield self.pipeline.next()
                if len(self.pipeline) and self.cadence.due(self._trained()):
                    self._evaluate(self._trained(), within_epoch=True)
            row = self._row()
            self.scalars.take()
            if eval_due(job, epoch) or self.cadence.due(self._trained()):
                self._evaluate(self._trained(), within_epoch=not eval_due(job, epoch), row=row)
            self.report.epoch(row)
            self.epochs_done = epoch + 1
        if self.start_epoch >= job.epochs and job.eval_fn is not None:
            # A resume of a finished run trains nothing: its model is scored as it stands, as a cluster's is.
            self.epoch = job.epochs - 1
            self._evaluate(job.epochs * job.total_samples, within_epoch=False)

    def step(self, loss_value: float) -> None:
        """The caller's optimizer step on the last batch is done: count it, report its progress."""
        self._loss_sum += loss_value
        self._batches += 1
        self.report.step()
        if self.job.reports_per_epoch > 1 and len(self.pipeline):
            # The cluster's rule (coordinator/metrics.py): one partial row per n-th of the epoch.
            k = (self._skipped + self._batches) * self.job.reports_per_epoch // self.steps_per_epoch
            if k > self._parts:
                self._parts = k
                self.report.progress({**self._row(), "fraction": k / self.job.reports_per_epoch})

    def _trained(self) -> int:
        """Samples trained so far: every epoch before this one whole, and this one's steps."""
        assert self.epoch is not None
        return self.epoch * self.job.total_samples + min((self._skipped + self._batches) * self.job.batch_size,
                                                         self._samples)

    def _evaluate(self, samples: int, within_epoch: bool, row: dict[str, Any] | None = None) -> None:
        """Score the model, trained on `samples` samples, and report it; an eval_fn that fails follows
        on_callback_error, as on a cluster: "report" logs it and trains on (the run and its save must not
        be lost to a metric)."""
        self.cadence.scored(samples)
        try:
            metric = score(self.job, self.model)
        except Exception as exc:
            if (stop := self.job.stop_on_callback_error("eval_fn", repr(exc))) is not None:
                raise stop from exc
            log.exception("eval_fn(epoch=%d) raised; on_callback_error='report': training goes on", self.epoch or 0)
            return
        self.report.evaluated(self.epoch or 0, metric, samples, within_epoch, row=row)

    def release(self) -> None:
        """Stop the loader workers and the progress bar (also when the caller's loop raised)."""
        self.pipeline.close()
        self.report.close()

    def interrupted(self) -> None:
        """Ctrl-C (or SIGTERM) stopped the loop: its log ends "interrupted", and the user reads that nothing was
        saved (a KeyboardInterrupt lands anywhere, mid-step included: the model it leaves is no save)."""
        self.release()
        self.report.interrupted(time.perf_counter() - self._t_run, None, checkpoints=False)

    def finish(self) -> TrainResult:
        """End the run (all epochs, or the caller stopped early): save the bundle, finish the report."""
        self.release()
        wall_s = time.perf_counter() - self._t_run
        # The result, the bundle and the run log's end say the same: a loop left early is not a completed run.
        self.result.reason = "completed" if self.epochs_done >= self.job.epochs else "stopped"
        if self.job.save_path:
            # A loop left within an epoch: the batches of it already trained, which a lone resume skips.
            within = self._skipped + self._batches if self.epoch == self.epochs_done else 0
            self.report.save(self.model.state_dict(), {
                "epoch": self.epochs_done, "epoch_batches": within, "global_step": None, "reason": self.result.reason,
                "world_size": 1, "coordinator": None,
            })
        self.report.finish(wall_s)
        self.result.batch_share = [1.0]
        return self.result

    def _row(self) -> dict[str, Any]:
        """The row of `TrainResult.epochs` for the batches of the epoch trained so far."""
        samples = min(self._batches * self.job.batch_size, self._samples)
        epoch_ms = (time.perf_counter() - self._t_epoch) * 1000.0
        scalars = self.scalars
        return epoch_row(self.epoch or 0, self._loss_sum / max(self._batches, 1), epoch_ms, [1.0],
                         [samples / max(epoch_ms, 1e-9)], {k: scalars.sums[k] / scalars.counts[k] for k in sorted(scalars.sums)},
                         per_rank_samples=[samples], round=-1, reconnects=0)


def _resume_alone(job: Job, model: torch.nn.Module) -> tuple[int, int]:
    """Load `job.resume_from` into `model`; the epoch to start at and the batches of it already trained (a
    loop left within an epoch: its permutation's first ones), 0 and 0 without one."""
    if not job.resume_from:
        return 0, 0
    state, meta = bundle.load(job.resume_from)
    epoch = int(meta.get("epoch", 0))
    if epoch > job.epochs:  # the cluster's rule (coordinator/resume.py): it trained nothing, and said `completed`
        raise ConfigError(f"resume: the bundle {job.resume_from} holds {epoch} epochs, more than this run's "
                          f"{job.epochs}; raise epochs (Trainer(epochs=...)) to continue training")
    bundle.load_into(model, state, job.resume_from)
    return epoch, int(meta.get("epoch_batches", 0))
