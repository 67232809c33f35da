"""The run report: what a person sees and what a run leaves behind, the same alone and on a cluster.

`RunReport` owns, for one run, the progress bar, the per-epoch lines
(`format_epoch`), the result rows of `TrainResult`, the user's `metrics_fn`
call, the bundle save and the run directory's event log (`events`, a
`RunLog`: flodl_zmq/runlog.py). `AloneLoop` (flodl_zmq/alone.py) and the
controller (flodl_zmq/controller_service.py) both feed it, so the two paths
print and save identically from one place: only where the numbers come
from differs (a local loop, or the coordinator's epoch aggregates).

Rules it keeps: the bar is on a terminal only (logs get the per-epoch
lines); `quiet` silences both; a `metrics_fn` that raises is handed to the
caller's `on_callback_error` when it gives one (the controller reports or
stops, as `on_callback_error` says), else it propagates, as any user code
in a single process does.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from flodl_zmq import bundle
from flodl_zmq.coordinator.core import Coordinator
from flodl_zmq.coordinator.outputs import EvalsMerged, Evaluated
from flodl_zmq.coordinator.roles import is_due
from flodl_zmq.errors import TrainingError
from flodl_zmq.job import Job
from flodl_zmq.payload import refresh_estimates
from flodl_zmq.result import TrainResult, format_epoch
from flodl_zmq.runlog import RunLog


class RunReport:
    """One run's report: progress, epoch rows and lines, metrics_fn, the saved bundle, the event log.

    `batches_per_epoch`: the bar's length. `run_dir`: where `events.jsonl`
    goes (runlog.run_dir_for). `first_epoch`: the epoch the run starts at
    (not 0 after a resume). `on_callback_error(message)`: what to do when
    `metrics_fn` raises (None: let it raise). `listener`: handed every event
    too (runlog.RunLog: the controller's Prometheus metrics). Epochs, evals, saves and the
    end are logged here, and a cluster's rounds (`round`); the controller adds world changes with
    `events.write`. `evals_follow`: an epoch's eval lands after its row (a
    cluster's, scored on a rank): `metrics_fn` gets the row once its eval is in.
    """

    def __init__(
        self,
        job: Job,
        result: TrainResult,
        batches_per_epoch: int,
        run_dir: Path,
        first_epoch: int = 0,
        on_callback_error: Callable[[str], None] | None = None,
        listener: Callable[[str, dict[str, Any]], None] | None = None,
        evals_follow: bool = False,
    ) -> None:
        self.job = job
        self.result = result
        self.batches_per_epoch = batches_per_epoch
        self.on_callback_error = on_callback_error
        self._bar: Any = None
        self._bar_epoch = self.first_epoch = first_epoch
        self._t0 = time.perf_counter()
        self.events = RunLog(run_dir, listener)
        self.evals_follow = evals_follow
        # Rows for metrics_fn, in order, held while the first waits for its epoch's eval (`_release`).
        self._held: list[dict[str, Any]] = []
        self._awaiting: set[int] = set()

    def started(self, world: dict[str, list[int]], world_size: int, round: int, restarted: bool) -> None:
        """The world formed and training starts now: eval times (`eval_at_s`) count from here.

        A run resumed from a checkpoint or a save says so first (`restarted`): after a controller's restart the
        rounds after `round` are trained again, and a reader tells this incarnation's lines from the one before's.
        """
        self._t0 = time.perf_counter()
        if restarted:
            self.events.write("restart", checkpoint=self.result.resumed_from, epoch=self.first_epoch, round=round,
                              incarnation=self.result.incarnation,
                              reason=f"resumed from {self.result.resumed_from} at epoch {self.first_epoch + 1}, "
                                     f"round {round}")
        self.events.write("start", mode=self.job.mode, epochs=self.job.epochs, world_size=world_size, world=world)

    def step(self) -> None:
        """One batch was trained: advance the progress bar."""
        if self.job.quiet or self._bar_epoch >= self.job.epochs:
            return
        if self._bar is None:
            from tqdm import tqdm

            # disable=None: a bar on a terminal only; logs get the per-epoch lines.
            self._bar = tqdm(
                total=self.batches_per_epoch, desc=f"epoch {self._bar_epoch + 1}/{self.job.epochs}",
                unit="batch", leave=False, disable=None,
            )
        if self._bar.n < self._bar.total:
            self._bar.update(1)

    def epoch(self, row: dict[str, Any]) -> None:
        """Epoch `row["epoch"]` is done: keep its row, print its line, call `metrics_fn`."""
        self.result.epochs.append(row)
        self.events.write(
            "epoch", epoch=row["epoch"], avg_loss=row["avg_loss"], epoch_ms=row["epoch_ms"], samples=row.get("samples"),
            batch_share=row.get("batch_share") or [],
            throughput=[x * 1000.0 for x in row.get("throughput") or []],  # the row's samples/ms, as samples/s
        )
        self.close()
        self._bar_epoch = row["epoch"] + 1
        if not self.job.quiet:
            print(format_epoch(row, self.job.epochs), flush=True)
        if self.evals_follow and eval_due(self.job, row["epoch"]):
            self._awaiting.add(row["epoch"])
        self._held.append(row)
        self._release()

    def progress(self, row: dict[str, Any]) -> None:
        """`row["fraction"]` of epoch `row["epoch"]` is done (`reports_per_epoch`): call `metrics_fn`."""
        self._held.append(row)
        self._release()

    def _scored(self, epoch: int) -> None:
        """Epoch `epoch`'s eval is in its row, or none will come (merged into a later one's, failed)."""
        self._awaiting.discard(epoch)
        self._release()

    def _release(self) -> None:
        """`metrics_fn` for the held rows, in order, up to the first whose eval is still to come: it sees the
        row as `result.epochs` holds it, the eval included, as alone."""
        while self._held:
            head = self._held[0]
            if "fraction" not in head and head["epoch"] in self._awaiting:  # an epoch's own row, its eval owed
                return
            self._metrics(self._held.pop(0))

    def _metrics(self, row: dict[str, Any]) -> None:
        if self.job.metrics_fn is not None:
            try:
                self.job.metrics_fn(dict(row))
            except Exception:
                if self.on_callback_error is None:
                    raise
                self.on_callback_error(f"metrics_fn raised on the controller:\n{traceback.format_exc()}")

    def evaluated(self, epoch: int, metric: float, samples: int, within_epoch: bool = False,
                  row: dict[str, Any] | None = None, by_rank: int | None = None) -> None:
        """The model (the consensus, on rank `by_rank` if any) scored `metric` after `samples` samples.

        Every eval is a row of `result.evals` with the time since training
        started. One after epoch index `epoch` also goes into that epoch's
        row (`row`, or the kept one); after the last epoch it is the final
        eval. One `within_epoch` (`eval_every_samples`) was taken during
        epoch index `epoch`.
        """
        at_s = time.perf_counter() - self._t0
        self.result.evals.append(
            {"epoch": epoch, "within_epoch": within_epoch, "samples": samples, "metric": metric, "eval_at_s": at_s})
        self.events.write("eval", epoch=epoch, metric=metric, samples=samples)
        if not within_epoch:
            row = row if row is not None else self.row(epoch)
            if row is not None:
                row["eval"], row["eval_at_s"] = metric, at_s
            if epoch + 1 >= self.job.epochs:
                self.result.final_eval = metric
            self._scored(epoch)
        if by_rank is not None and not self.job.quiet:
            when = f"within epoch {epoch + 1} ({samples} samples)" if within_epoch else f"after epoch {epoch + 1}"
            print(f"eval {when}: {metric:.4f} (rank {by_rank})", flush=True)

    def eval_notice(self, n: Evaluated | EvalsMerged) -> None:
        """The coordinator's word on an eval it asked for: its answer, or epochs left without one.

        `epoch` in both counts the epochs the consensus holds whole, so an
        epoch's row is the one before (one within an epoch is in the next).
        """
        if isinstance(n, Evaluated):
            m = n.result
            epoch = m.epoch if n.within_epoch else m.epoch - 1
            if m.error is None:
                self.evaluated(epoch, m.metric, n.samples, n.within_epoch, by_rank=m.rank)
            elif not n.within_epoch:
                self._scored(epoch)
            return
        for epoch in n.epochs:  # the row says where its score is rather than repeating it
            row = self.row(epoch - 1)
            if row is not None:
                row["eval_merged"] = n.samples
            self._scored(epoch - 1)
            if not self.job.quiet:
                print(f"eval after epoch {epoch}: none of its own: the first consensus holding it also holds a "
                      f"later epoch, scored once ({n.samples} samples)", flush=True)

    def row(self, epoch: int) -> dict[str, Any] | None:
        return next((row for row in self.result.epochs if row["epoch"] == epoch), None)

    def round(self, round_id: int, round_ms: float | None, masses: dict[str, float], core: Coordinator) -> None:
        """A cluster's round in the run log: its time, each host's mass, ElChe's windows, the guard's verdict."""
        verdict = core.feedback.last_verdict
        self.events.write(
            "round", round=round_id, round_ms=round_ms, masses=masses,
            global_step=core.global_step, epoch=core.last_aggregated + 1,
            counts=core.elche.batch_counts, anchor=core.elche.anchor,
            verdict=None if verdict is None else verdict.kind.value, divergence=core.feedback.last_divergence,
        )

    def save(self, state_dict: dict[str, Any], meta: dict[str, Any], outer_momentum: Any = None) -> str:
        """Write the bundle at the job's `save_path` (set); its path is the result's `saved`."""
        assert self.job.save_path, "save() needs the job's save_path"
        try:
            self.result.saved = str(bundle.save(self.job.save_path, state_dict, meta, outer_momentum))
        except OSError as exc:  # a full or read-only disk: say which setting, not only errno's words
            raise TrainingError(
                f"save_path={str(self.job.save_path)!r}: the bundle could not be written ({exc.strerror or exc}); "
                "a bundle already there is left as it was; free space, or point save_path at a writable directory"
            ) from exc
        self.events.write("checkpoint", path=self.result.saved, reason=meta.get("reason"), epoch=meta.get("epoch"))
        return self.result.saved

    def finish(self, wall_s: float) -> TrainResult:
        """The run is over: close the bar, note the wall time and each rank's mean batch share."""
        self._awaiting.clear()  # an eval still owed will not come now: metrics_fn gets its row without it
        self._release()
        self.close()
        refresh_estimates(self.result.model)  # the model handed back is scored as it stands, alone as on a cluster
        self.result.wall_s = wall_s
        shares = [row["batch_share"] for row in self.result.epochs if row.get("batch_share")]
        if shares:
            # A world that grew mid-run has longer rows from then on: a rank not yet there had no share.
            width = max(map(len, shares))
            self.result.batch_share = [float(np.mean([s[r] if r < len(s) else 0.0 for s in shares]))
                                       for r in range(width)]
        self.events.write("end", reason=self.result.reason, wall_s=wall_s, final_eval=self.result.final_eval)
        self.events.close()
        return self.result

    def interrupted(self, wall_s: float, checkpoint: Path | None, checkpoints: bool = True, moved: bool = False) -> None:
        """Ctrl-C or SIGTERM stopped the run: finish it as "interrupted", and, when it has a `save_path`, say that
        nothing was saved there, which its user would otherwise believe (`interrupted_notice`). `checkpoint`: the
        newest checkpoint that holds its progress, if any; `checkpoints`: whether the run could have written one
        (a cluster's controller; not a process training alone); `moved`: a SIGTERM under --resume auto, after which
        the same command continues the run."""
        self.result.reason = "interrupted"
        self.finish(wall_s)
        if self.job.save_path:
            print(interrupted_notice(str(self.job.save_path), checkpoint, checkpoints, moved), flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def eval_due(job: Job, epoch: int) -> bool:
    """An eval after `epoch`: every `eval_every` epochs, and after the last one (the final eval) even with
    `eval_every` 0, as the cluster's final eval scores its last model whatever the cadence."""
    return job.eval_fn is not None and job.eval_dataset is not None and (
        epoch + 1 == job.epochs or is_due(epoch + 1, job.eval_every))  # the coordinator's cadence rule


def interrupted_notice(save_path: str, checkpoint: Path | None, checkpoints: bool = True, moved: bool = False) -> str:
    """What an interrupted run says of its `save_path`: nothing was written there, and where its progress is kept.

    Not saved on purpose: an interruption lands anywhere in the controller's loop, where the kept consensus may be
    a round ahead of the coverage that describes it; a save may not finish within the 5 s `launch` grants a
    process it stops; and a Ctrl-C meant as "not this run" must not replace the bundle of an earlier one.
    """
    head = (f"interrupted: nothing was saved to {save_path} (save_path is written when the run ends, not when "
            "Ctrl-C or SIGTERM stops it)")
    if not checkpoints:  # alone: a Session loop that breaks ends the run, saved with what it trained
        return f"{head}; to stop early with a save, leave a Session's loop (`break`): it saves what it trained"
    if checkpoint is not None and moved:  # SIGTERM under --resume auto: the agents wait for the next controller
        return (f"{head}; its progress is in the checkpoint {checkpoint}, which this controller started again with "
                "the same command (--resume auto) continues from")
    if checkpoint is not None:
        return (f"{head}; its progress is in the checkpoint {checkpoint}: continue with --resume {checkpoint} "
                f"(FLODL_RESUME={checkpoint} under launch)")
    return (f"{head}, and no checkpoint holds its progress; checkpoints keep it through an interruption: "
            "--checkpoint-dir DIR (FLODL_CHECKPOINT_DIR=DIR under launch) writes one at every epoch end, and "
            "--resume DIR (FLODL_RESUME=DIR) continues the newest")
