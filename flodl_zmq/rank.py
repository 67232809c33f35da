"""The rank runtime: one model replica that trains what it is dispatched and joins each averaging round.

A rank process holds two DEALER sockets to its host's relay (control and
data; routing identity = its global rank as ASCII digits). It takes part in
the protocol like this (PROTOCOL.md, Rank):

1. Sends `RankHello` (rank, world size, host, model and dataset signatures).
   A rank of a resumed or re-formed world then asks its relay for the
   starting consensus (`ConsensusRequest(RESUME_ROUND)`, again every
   `consensus_wait_at_relay_s`) and loads it before anything else: its model comes
   over the wire from the controller's checkpoint, never from a file.
2. Trains the spans of the epoch permutation it is given (`StartEpoch`,
   `Update.next_plan`, `ExtendPartition`), reporting its steps' timings in
   `Batch` records (coalesced: `StepReport`), one `EpochMetrics` per
   completed span.
3. On `RequestParams(round)` snapshots its parameters and float buffers into
   a reused host buffer, multiplies it by its realized-work mass (steps since
   the last sync) and deposits one `RoundFrame` on the data socket; a span
   whose plan names a round (`EpochPlan.deposit`) is deposited so at its end,
   unasked, before its `EpochMetrics`. A round is deposited in once: a
   request for a round already deposited is ignored.
4. On the round's `Consensus` loads it and answers `SyncAck` with the
   divergence triple; a zero-mass consensus keeps local state. It overwrites
   the replica, except under cpu-async, where the rank trained on while its
   deposit travelled: it adds `easgd_alpha * (consensus - snapshot)`, so
   those steps are kept (the overlapped round's correction).
5. Runs eval / checkpoint / epoch callbacks when its role is elected and
   reports them (`EvalResult`, `CheckpointResult`, `EpochFnElapsed`), with
   the rank and the traceback when one raises; training continues.
6. Says goodbye (`Exiting`) on `Shutdown`, `ShutdownWithSave` or a lost
   controller; stops with an error on its own `DeclareDead`.

Rules this module keeps:

- The training thread never touches a socket: its link (flodl_zmq/rank_link.py)
  owns both, and hands it records through mailboxes.
- The snapshot is taken into buffers allocated once, pinned on CUDA, in the
  rank's shared-memory segment when the relay is on this machine (its data
  endpoint is ipc://): flodl_zmq/param_buffers.py.
- An `Update` is held until that round's consensus is loaded, and every
  control record after it with it (a shutdown aside), handled in order after
  the load: it rides beside the consensus (PROTOCOL.md 10.1), and training
  its plan, or data sent after it, on the pre-consensus replica would throw
  those steps away. An eval or a checkpoint that arrives while a consensus is
  pending waits for it the same way: it scores that consensus.
- A deposit is kept until its round's consensus arrives (the link asks the
  relay again after `consensus_wait_at_relay_s`, PROTOCOL.md 10.6). The snapshot is
  not overwritten before that consensus, so a resend is the same deposit.
- A span's batches are queued in the loader pipeline (flodl_zmq/loader.py)
  as soon as the span arrives: its indices are known, so worker processes
  build them while earlier batches train.
- The learning-rate schedule sits at the global step plus this rank's steps
  not yet in a consensus (flodl_zmq/training.py); a `SetGlobalStep` that
  arrives before its round's consensus is held until the load, like the
  plan. A rate change goes to the coordinator as `LrUpdate` with the next
  step report (the last rate noted since the previous one).
"""

from __future__ import annotations

import logging
import os
import queue
import time
import traceback
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from flodl_zmq.datasets import dataset_signature
from flodl_zmq.environment import DECLARED_DEAD_EXIT, raise_lost_signal, training_failed
from flodl_zmq.errors import ShmError, TrainingError
from flodl_zmq.job import MODES, Job, seed_generators
from flodl_zmq.links import data_max_frame_bytes
from flodl_zmq.loader import BatchPipeline
from flodl_zmq.param_buffers import ParamBuffers
from flodl_zmq.payload import copy_unaveraged, load_flat, model_signature, refresh_estimates
from flodl_zmq.rank_link import ConsensusIn, FromCoordinator, RankConfig, RankLink
from flodl_zmq.sampling import epoch_permutation, plan_indices
from flodl_zmq.training import ScalarLog, Stepper, recording, score
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.shm import Segment, rank_owner

log = logging.getLogger(__name__)

DECLARED_DEAD = ("lost: the coordinator declared this rank dead and the run goes on without it (its relay refused "
                 "what it sent, or it was silent past the heartbeat deadline: the relay's and the controller's "
                 "logs name the cause)")
# How long a step's timing may wait to be coalesced with the next ones (PROTOCOL.md, timing.batch).
REPORT_PERIOD_S = 0.05


def pick_device(local_rank: int) -> torch.device:
    """cuda:(local index) when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def core_share(cores: Collection[int], local_rank: int, local_ranks: int, threads: int) -> set[int] | None:
    """The cores rank `local_rank` of its host's `local_ranks` keeps to: an equal share of `cores`, in order,
    when each share holds the rank's `threads` (torch's and its loader workers'); None where it would not.

    Kept to a core of its own, the CNN pair trained 1.6-5.6% faster than where the scheduler placed its
    ranks, measured within one run (docs/benchmarks.md, "Each rank on cores of its own"). Cores left
    over keep no rank: the services have them.
    """
    per = len(cores) // max(1, local_ranks)
    if per < max(1, threads) or not 0 <= local_rank < local_ranks:
        return None
    return set(sorted(cores)[local_rank * per:(local_rank + 1) * per])


def keep_to_share(local_rank: int, local_ranks: int, threads: int) -> set[int] | None:
    """Keep this thread, and every thread and process it starts from here, to its `core_share` of the cores
    it may use; the cores it had before (for its caller to give back), None where nothing changed (not
    Linux, too few cores, a cpuset that refused)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    before = os.sched_getaffinity(0)
    share = core_share(before, local_rank, local_ranks, threads)
    if share is None or share == before:
        return None
    try:
        os.sched_setaffinity(0, share)
    except OSError as exc:  # a cpuset changed under us: the scheduler places the rank, as without a share
        log.info("local rank %d stays on the scheduler's cores, not %s: %s", local_rank, sorted(share), exc)
        return None
    return before


# --------------------------------------------------------------------------- training thread


def epoch_fns_due(done: Collection[int], epoch: int) -> range:
    """The epochs whose `epoch_fn` the role's rank runs before its first batch of `epoch`: that one, and each
    since its last that it trained no batch of (a rank of a small share can get none of an epoch, whose
    `epoch_fn` was then skipped); none for a late chunk of an earlier epoch (one reclaimed from a dead rank)."""
    return range(max(done, default=epoch - 1) + 1, epoch + 1)


@dataclass
class _Span:
    epoch: int
    indices: np.ndarray
    deposit: int | None = None  # the round deposited in at its end (EpochPlan.deposit)
    pos: int = 0
    started: float = 0.0
    loss_sum: float = 0.0
    batches: int = 0
    compute_ms: float = 0.0
    data_ms: float = 0.0


class RankRuntime:
    """Runs one rank of `job` until the coordinator says stop; `run()` returns the exit code."""

    def __init__(self, job: Job, cfg: RankConfig, device: torch.device | None = None,
                 replica: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None) -> None:
        """A rank of `job`; `replica` is the user's own model (on `device`) and optimizer under Session,
        None under Trainer: built here from the job's factories, seeded so every rank builds the same."""
        self.job = job
        self.cfg = cfg
        torch.set_num_threads(job.torch_threads)
        self.device = device or pick_device(cfg.local_rank)
        if replica is None:  # the same initial replica on every rank (Job.build_model)
            # A resumed rank's start comes over the wire (_load_start), never from job.resume_from's files.
            model = job.build_model().to(self.device)
            replica = model, job.build_optimizer(model)
        self.model, self.optimizer = replica
        seed_generators(job.seed, stream=1 + cfg.rank)  # its own dropout masks and augmentations from here
        # The job's step under Trainer; under Session only its schedule (follow) is used.
        self.stepper = Stepper(job, self.model, self.optimizer, self.device)
        self.scalars = ScalarLog()
        # Built before any thread starts: its workers are forked (loader.py).
        self.pipeline = BatchPipeline(job.dataset, self.device, job.num_workers, job.prefetch_factor,
                                      job.pin_memory, job.collate_fn)
        # A relay on this machine (ipc://) shares memory with this rank: deposit by reference.
        same_host = cfg.data_endpoint.startswith("ipc://")
        try:
            self.buffers = ParamBuffers(
                self.model, Segment(cfg.key, cfg.incarnation, rank_owner(cfg.rank)) if same_host else None, job.wire
            )
        except ShmError as exc:  # a squatted or foreign shared-memory path: deposit framed instead
            log.error("rank %d: deposits go framed, not by reference: %s", cfg.rank, exc)
            self.buffers = ParamBuffers(self.model, None, job.wire)
        self.blend = job.blend
        self.steps = 0  # cumulative optimizer steps
        self.steps_since_avg = 0
        self.global_step = 0  # every rank's steps in the last loaded consensus (SetGlobalStep)
        self._held_global_step: int | None = None
        self._spans: deque[_Span] = deque()
        self._perms: dict[int, np.ndarray] = {}
        self._throttled = False
        # Sync averages after every step: the rank holds itself after each one until its Update. Waiting for
        # the coordinator's Throttle let a rank of sub-millisecond steps run on for a whole partition while
        # the trigger travelled, and the reducer then refused the honest deposit's mass.
        self._holds_each_step = MODES[job.mode].hard_barrier
        self._consensus_model: torch.nn.Module | None = None
        self._pending_round: int | None = None  # deposited, consensus not yet loaded
        self.stale_consensus = 0  # consensus records refused by round: duplicates, late joins, replays
        self._steps_at_snapshot = 0
        self._deposited = 0  # the highest round deposited in
        self._held: list[Any] = []  # control records waiting for the pending consensus (module docstring)
        self._epoch_role = 0
        self._epoch_fn_done: set[int] = set()
        self._stop_reason: str | None = None
        self._t_asked = self._t_got = 0.0  # when the last batch was asked for, and when it came

    # -- the loop --------------------------------------------------------

    def run(self) -> int:
        """Trainer's rank: the job's step on every batch the session machinery hands out."""
        self.start()
        failed = False
        try:
            with recording(self.scalars):
                for batch in self.batches():
                    self.step(self.stepper.step(batch))
        except Exception as exc:
            log.exception("%s", training_failed(self.cfg.rank, exc))
            failed = True
        return self.close(failed)

    def start(self) -> None:
        """Start the link and say hello to the relay."""
        # Under Sync each step is a window edge and is reported at once.
        link = RankLink(self.cfg, zmq.Context.instance(), 0.0 if self._holds_each_step else REPORT_PERIOD_S,
                        data_max_frame_bytes(self.job.wire.largest_frame_bytes(self.buffers.numel)))
        self.link = link
        link.start()
        link.send(
            rec.RankHello(
                rank=self.cfg.rank,
                world_size=self.cfg.world_size,
                host=self.cfg.host,
                model_sig=model_signature(self.model),
                dataset_sig=dataset_signature(self.job.dataset),
            )
        )

    def batches(self) -> Iterator[Any]:
        """The batches dispatched to this rank, in order, until the coordinator says stop.

        Between two batches the caller runs one optimizer step and reports it with `step`;
        records are handled here, so a snapshot never falls inside a step. A resumed or
        shipped-start world's starting model is loaded before the first.
        """
        if self.cfg.resumed:
            self._load_start()
        while True:
            if not self._can_train():
                self.link.flush_steps()  # a window edge: the coordinator must see every step before we wait
            self._drain(block=not self._can_train())
            if self._stop_reason is not None:
                return
            if self._can_train():
                yield self._take_batch()

    def close(self, failed: bool, linger: bool = True, goodbye: bool = True) -> int:
        """Say goodbye (`Exiting`) and release everything; the rank's exit status (`linger`: `RankLink.close`).

        A rank that lost the coordinator, or was declared dead by it, waits for no acknowledgement of its
        goodbye: none will come. One whose agent died (`goodbye` False) says none: it is not leaving on
        purpose, and its relay reports it gone.
        """
        lost = bool(self._stop_reason and self._stop_reason.startswith("lost"))
        try:
            if goodbye:
                self.link.send(rec.Exiting(rank=self.cfg.rank))
            self.link.close(linger=linger and not lost)
        finally:
            self.pipeline.close()
            if self.buffers.segment is not None:
                self.buffers.segment.close()
        if lost:
            log.error("rank %d: %s; exiting", self.cfg.rank, self._stop_reason)
            return DECLARED_DEAD_EXIT if self._stop_reason == DECLARED_DEAD else 1
        return 1 if failed else 0

    def _load_start(self) -> None:
        """Load the resumed world's starting consensus, asked of the relay, before the first step (PROTOCOL.md 13).

        Control records that arrive meanwhile wait in order: a RequestParams served
        on the initial replica would deposit a model the run never had.
        """
        limit = self.cfg.coordinator_first_contact_at_rank_s
        deadline = time.monotonic() + limit
        held: list[Any] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TrainingError(
                    f"rank {self.cfg.rank}: the resumed run's starting model (the consensus of round "
                    f"{rec.RESUME_ROUND}) did not come from the controller's reducer within {limit:g} s "
                    "(FLODL_COORDINATOR_FIRST_CONTACT_AT_RANK): check that this host reaches the controller's "
                    "data ports and that the controller resumed the same run"
                )
            try:
                item = self.link.inbox.get(min(left, 0.5))
            except queue.Empty:
                continue
            if isinstance(item, FromCoordinator):
                held.append(item.record)
            elif isinstance(item, ConsensusIn) and item.env.record.round == rec.RESUME_ROUND:
                self._adopt(item.env.payload, None)  # the start replaces the initial replica, whatever the blend
                break
            elif isinstance(item, ConsensusIn):
                self.stale_consensus += 1
            else:
                self._stop_reason = f"lost: {item.reason}"
                return
        for record in held:
            self._on_control(record)

    def _can_train(self) -> bool:
        return bool(self._spans) and not self._throttled

    def _drain(self, block: bool) -> None:
        timeout = 0.5 if block else 0.0
        while True:
            try:
                item = self.link.inbox.get(timeout)
            except queue.Empty:
                return
            timeout = 0.0
            if isinstance(item, FromCoordinator):
                self._on_control(item.record)
            elif isinstance(item, ConsensusIn):
                self._on_consensus(item.env)
            else:
                self._stop_reason = f"lost: {item.reason}"
            if self._stop_reason is not None:
                return

    # -- records ----------------------------------------------------------

    def _on_control(self, r: Any) -> None:
        if isinstance(r, rec.DeclareDead) and r.rank == self.cfg.rank:
            # Not held behind a consensus: the run has gone on without this rank, and no consensus comes.
            self._stop_reason = DECLARED_DEAD
            return
        if (self._held or (self._pending_round is not None and isinstance(r, (rec.Update, rec.ExecuteEval,
                                                                                   rec.Checkpoint)))) \
                and not isinstance(r, (rec.Shutdown, rec.ShutdownWithSave)):
            self._held.append(r)  # after the pending consensus's load (module docstring)
            return
        # Only Update (and Shutdown) releases a Throttle: new data is no licence to run ahead
        # of the round in flight; the rank was throttled for being too far ahead, and still is.
        if isinstance(r, rec.StartEpoch):
            self._add_span(r.plan)
        elif isinstance(r, rec.Update):
            self._throttled = False
            if r.next_plan is not None:
                self._add_span(r.next_plan)
        elif isinstance(r, rec.ExtendPartition):
            self._add_span(rec.EpochPlan(r.epoch, r.offset, r.size))
        elif isinstance(r, rec.RequestParams):
            if r.round > self._deposited:  # else deposited at its span's end, unasked
                self._deposit(r.round)
        elif isinstance(r, rec.Throttle):
            self._throttled = True
        elif isinstance(r, rec.SetGlobalStep):
            # It counts the steps of the round just finished; until its consensus is loaded,
            # steps_since_avg still holds this rank's share of them (counted twice otherwise).
            if self._pending_round is None:
                self.global_step = r.global_step
            else:
                self._held_global_step = r.global_step
        elif isinstance(r, rec.SetEpochCallbackRole):
            self._epoch_role = r.rank
        elif isinstance(r, rec.ExecuteEval):
            if r.target_rank == self.cfg.rank:
                self._run_eval(r)
        elif isinstance(r, rec.Checkpoint):
            if r.target_rank == self.cfg.rank:
                self._run_checkpoint(r)
        elif isinstance(r, (rec.Shutdown, rec.ShutdownWithSave)):
            self._stop_reason = type(r).__name__
        # CoordHeartbeat, EpochAggregated, EvalBroadcast, another rank's DeclareDead: nothing to do here.

    def _add_span(self, plan: rec.EpochPlan) -> None:
        epoch = plan.epoch
        if plan.size <= 0:
            return
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.job.seed, epoch, self.job.total_samples)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        indices = plan_indices(perm, plan)
        self._spans.append(_Span(epoch, indices, plan.deposit))
        bs = self.job.batch_size
        self.pipeline.extend(indices[i : i + bs] for i in range(0, len(indices), bs))

    def _deposit(self, round_id: int) -> None:
        self.link.flush_steps()  # every step in the deposit's mass is reported before it (PROTOCOL.md 9.5)
        self._steps_at_snapshot = self.steps_since_avg
        payload = self.buffers.snapshot(float(self.steps_since_avg))
        self._pending_round = self._deposited = round_id
        self.buffers.mark_queued()
        self.link.send(rec.SnapshotReady(rank=self.cfg.rank, round=round_id))
        self.link.send(
            rec.RoundFrame(round=round_id, rank=self.cfg.rank, mass=float(self._steps_at_snapshot)),
            payload,
            tracked_by=self.buffers,
        )

    def _on_consensus(self, env: Any) -> None:
        c: rec.Consensus = env.record
        if self._pending_round is None or c.round != self._pending_round:
            # A round this rank did not deposit in (joined late), a duplicate, or a replay: the
            # broadcast waives the sequence check, so the round is the guard (PROTOCOL.md 5.2).
            self.stale_consensus += 1
            log.info("rank %d: consensus of round %d refused: not the round awaited (%s)", self.cfg.rank, c.round,
                     self._pending_round)
            return
        divergence = post = pre = None
        if c.mass > 0.0:
            divergence, post, pre = self._adopt(env.payload, self.blend)
        # Steps taken while the round was in flight keep their credit for the next frame.
        self.steps_since_avg -= self._steps_at_snapshot
        self._pending_round = None
        if self._held_global_step is not None:
            self.global_step, self._held_global_step = self._held_global_step, None
        self.link.send(
            rec.SyncAck(
                rank=self.cfg.rank, round=c.round, step_count=self.steps,
                divergence=divergence, post_norm=post, pre_norm=pre,
            )
        )
        held, self._held = self._held, []
        for r in held:
            self._on_control(r)

    def _adopt(self, payload: Sequence[np.ndarray], blend: float | None) -> tuple[float | None, float, float | None]:
        """Load a consensus payload (ParamBuffers.load); a blending rank, whose replica is not the
        consensus, also keeps the consensus for its evals."""
        out = self.buffers.load(payload, blend)
        if self.blend is not None and self.job.eval_fn is not None:
            self._keep_consensus(self.buffers.consensus)
        return out

    # -- training -----------------------------------------------------------

    def _take_batch(self) -> Any:
        """The next batch of the first span, with the schedule moved to this step (a rate change reported)."""
        span = self._spans[0]
        if span.pos == 0:
            span.started = time.perf_counter()
            self._maybe_epoch_fn(span.epoch)
        self._t_asked = time.perf_counter()
        batch = self.pipeline.next()  # the batch of the span's next indices: the pipeline keeps the spans' order
        self._t_got = time.perf_counter()
        lr = self.stepper.follow(self.global_step + self.steps_since_avg)
        if lr is not None:
            self.link.note_lr(lr)
        return batch

    @property
    def epoch(self) -> int | None:
        """The epoch of the batch being trained (of the next one before the first)."""
        return self._spans[0].epoch if self._spans else None

    def step(self, loss_value: float) -> None:
        """The optimizer step on the last batch is done: count it, report its timing and loss."""
        raise_lost_signal()  # a SIGTERM or SIGHUP whose raise a finaliser swallowed stops the rank here
        t2 = time.perf_counter()
        if self.cfg.slowdown > 1.0:
            # Emulated slower hardware: the delay is part of the step's compute time.
            time.sleep((self.cfg.slowdown - 1.0) * (t2 - self._t_asked))
        compute_ms = (time.perf_counter() - self._t_got) * 1000.0
        data_ms = (self._t_got - self._t_asked) * 1000.0
        span = self._spans[0]
        self.steps += 1
        self.steps_since_avg += 1
        span.pos += min(self.job.batch_size, len(span.indices) - span.pos)
        span.batches += 1
        span.loss_sum += loss_value
        span.compute_ms += compute_ms
        span.data_ms += data_ms
        self.link.step(compute_ms, data_ms, loss_value, self.steps)
        if self._holds_each_step:
            self._throttled = True  # released by the Update of the round this step opens
        if span.pos >= len(span.indices):
            self._spans.popleft()
            if span.deposit is not None and span.deposit > self._deposited:
                self._deposit(span.deposit)  # its window ends here: no request crosses the relays
            sums, counts = self.scalars.take()
            self.link.send(
                rec.EpochMetrics(
                    rank=self.cfg.rank, epoch=span.epoch, avg_loss=span.loss_sum / span.batches,
                    batches_processed=span.batches, samples_processed=len(span.indices),
                    epoch_ms=(time.perf_counter() - span.started) * 1000.0,
                    compute_only_ms=span.compute_ms, data_starve_ms=span.data_ms,
                    scalar_sums=sums, scalar_counts=counts,
                )
            )

    # -- callbacks ----------------------------------------------------------

    def _callback_error(self, what: str) -> str:
        text = f"{what} raised on rank {self.cfg.rank} ({self.cfg.host}):\n{traceback.format_exc()}"
        log.error("%s", text)
        return text

    def _maybe_epoch_fn(self, epoch: int) -> None:
        if self.job.epoch_fn is None or self._epoch_role != self.cfg.rank or epoch in self._epoch_fn_done:
            return
        for due in epoch_fns_due(self._epoch_fn_done, epoch):
            self._epoch_fn_done.add(due)
            t0 = time.perf_counter()
            try:
                self.job.epoch_fn(due, self.model)
            except Exception:
                self._callback_error(f"epoch_fn(epoch={due})")
            elapsed = (time.perf_counter() - t0) * 1000.0
            self.link.send(rec.EpochFnElapsed(rank=self.cfg.rank, epoch=due, elapsed_ms=elapsed))

    def _keep_consensus(self, consensus: Sequence[torch.Tensor]) -> None:
        """Hold the last consensus (f32 chunks) in a model of its own: a blending (EASGD) rank's
        live model is not the consensus, and `adopt_consensus` evals must score the consensus."""
        if self._consensus_model is None:
            self._consensus_model = self.job.model().to(self.device)
        load_flat(self._consensus_model, consensus)
        copy_unaveraged(self._consensus_model, self.model)

    def _run_eval(self, r: rec.ExecuteEval) -> None:
        model = self._consensus_model if r.adopt_consensus and self._consensus_model is not None else self.model
        refresh_estimates(model)  # scored as it stands: what the average does not keep is estimated again
        t0 = time.perf_counter()
        metric, error = float("nan"), None
        if self.job.eval_fn is None or self.job.eval_dataset is None:
            error = f"rank {self.cfg.rank} was asked to evaluate but the job has no eval_fn/eval_dataset"
        else:
            try:
                metric = score(self.job, model)  # a user's loop (Session) gets its model back in its mode
            except Exception:
                error = self._callback_error(f"eval_fn(epoch={r.epoch})")
        self.link.send(
            rec.EvalResult(
                rank=self.cfg.rank, schedule_id=r.schedule_id, epoch=r.epoch, metric=metric,
                elapsed_ms=(time.perf_counter() - t0) * 1000.0, error=error,
            )
        )

    def _run_checkpoint(self, r: rec.Checkpoint) -> None:
        t0 = time.perf_counter()
        error = None
        if self.job.checkpoint_fn is not None:
            try:
                self.job.checkpoint_fn(r.version, self.model)
            except Exception:
                error = self._callback_error(f"checkpoint_fn(version={r.version})")
        self.link.send(
            rec.CheckpointResult(
                rank=self.cfg.rank, version=r.version, elapsed_ms=(time.perf_counter() - t0) * 1000.0, error=error,
            )
        )


__all__ = ["RankRuntime", "core_share", "keep_to_share", "pick_device"]
