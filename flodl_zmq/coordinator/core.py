"""The coordinator: a sans-I/O state machine that schedules one training run.

Inputs are decoded records from ranks, reducer notifications and the current
time; outputs are `Out(dest, record)` pairs for the ZeroMQ service to send.
Nothing here touches a socket, a thread or a clock.

Theory of operation
-------------------

Every rank trains its own replica (Local SGD). Ranks report every step
(`Batch`), every finished chunk or partition (`EpochMetrics`) and a heartbeat
each second. The coordinator counts steps per rank since the last average and
fires an *averaging cycle* when its gate opens:

    Idle --gate--> Pending --reducer published + every live rank acked--> Idle
         RequestParams(round)                 Update(round, next_plan)
         [Sync: Throttle]                     SetGlobalStep
         reducer: ExpectRound(round, ranks)

The gate counts steps, never wall time (a time-based gate deadlocked
upstream: its target depended on samples that only land when it fires).
Sync fires once every live rank did one step; Cadence and Async once every
live rank did its ElChe batch count (or has no work left: *quiesced*). The
per-rank step counters are snapshotted at the trigger; steps taken while the
cycle is in flight stay credited to the next window. At the finish the window
feeds ElChe, the convergence guard and the LR meta-controller, and each
rank's next chunk rides in its `Update` (no extra round trip). Epoch-boundary
callbacks (eval, checkpoint) go out at the first finish whose consensus
contains every sample of the epoch that ended, just before the Updates.

Data dispatch: Sync sends each rank a whole partition per epoch
(`StartEpoch`) and hands a dead rank's remainder to the survivors
(`ExtendPartition`), both held while a cycle is in flight and sent after its
Updates (a rank must not train new data on the replica it deposited).
Cadence and Async stream chunks from one `ChunkPool` per epoch: Cadence one
window-sized chunk at a time, held at the reduce and at the epoch edge;
Async throughput-sized chunks within a budget of `count + overshoot` steps
per window, streaming into the next epoch.

A rank leaves on a clean `Exiting`, a stale heartbeat, or a death reported by
its agent (`on_rank_death`). Its in-flight chunk returns to the pool, the
reducer is told (`DeclareDead` to `REDUCER`) so no round waits for it, and
the run ends with a save when `max_failure` is reached or nobody is left.

Run phases, strictly forward: Training -> FinalEvalDispatched ->
ShutdownInitiated; a shutdown-with-save latches orthogonally.

Contract with the service
-------------------------

- `Out.dest` is a rank id (send the record to that rank), `REDUCER` (a
  directive for the in-process reducer: `ExpectRound`, or `DeclareDead` to
  drop a rank from every barrier) or `CONTROLLER` (local effects: `SaveState`
  to write the checkpoint meta, `EpochAggregated` for `metrics_fn`,
  `EvalResult` for `eval_result_fn`, `RunEnded`). Broadcasts are expanded to
  one `Out` per live rank, so the service never needs to know who is live.
- Call `start` once when the world has formed, `on_record` for every record
  from a rank, `on_tick` at least every few hundred milliseconds,
  `on_rank_death` when an agent or relay reports a rank's exit, and
  `on_round_complete` / `on_round_abandoned` when the reducer has published
  or torn down a round.
- Call `on_send_failed` when a record for a rank could not be handed to the
  control socket (the relay's connection is gone, or the socket would
  block). The rank fails at once and what the record carried goes back to
  the pool: a rank that missed a record it needed (its partition, its chunk,
  the end of a round) can no longer follow the protocol, and waiting for the
  heartbeat timeout instead would wedge the gate whenever the link comes
  back and the rank keeps heartbeating. Send what it returns *after* the
  rest of the batch being sent: each rank must receive records in the order
  they were produced (a Sync rank trains its spans in arrival order, and the
  coordinator computes a dead rank's remainder in production order).
- A rank's `step_count` (in `Batch` and `Heartbeat`) counts the steps that
  process has taken since it started; the coordinator derives window steps
  from it, so a lost `Batch` record cannot wedge the gate.

Error policy: inputs that a correct peer can never send (a record whose rank
field disagrees with the sender, a chunk completion of the wrong size, a
record kind the coordinator does not consume, any input before `start`)
raise `CoordinatorError` naming the state and the record, before any state
changes. Inputs a real network produces routinely are ignored and counted in
`ignored` by cause: records from a rank already declared dead or exited
(`from_departed`), `SyncAck` / `SnapshotReady` for a finished round
(`stale_round`), duplicate acks (`duplicate_ack`), completions of a chunk that
was forfeited (`late_completion`), reducer notices for an old round
(`stale_reducer_notice`), duplicate death reports (`duplicate_death`), failed
sends to a rank already gone (`send_to_departed`), and anything after the run
ended (`after_end`). Failed sends to live ranks are counted in `lost_sends` by
record kind.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flodl_zmq.coordinator import dispatch
from flodl_zmq.coordinator.chunk_pool import ChunkPool, Span
from flodl_zmq.coordinator.config import CoordinatorConfig, GuardKind, Mode
from flodl_zmq.coordinator.convergence import (
    ConvergenceGuard,
    DivergenceReport,
    DivergenceSample,
    LrEventMeta,
    MsfGuard,
    NoGuard,
    TrendGuard,
    Verdict,
    VerdictKind,
)
from flodl_zmq.coordinator.elche import ElChe, ElCheState
from flodl_zmq.coordinator.liveness import Liveness, ShutdownReason, unrecoverable
from flodl_zmq.coordinator.metrics import aggregate_epoch
from flodl_zmq.coordinator.roles import CallbackRoles, is_due
from flodl_zmq.coordinator.timing import WindowLedger
from flodl_zmq.errors import ConfigError, CoordinatorError
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.records import (
    Batch,
    CheckpointResult,
    EpochFnElapsed,
    EpochMetrics,
    EvalResult,
    Exiting,
    Heartbeat,
    LrUpdate,
    SnapshotReady,
    SyncAck,
)

FINAL_EVAL_ID = 2**64 - 1
"""`ExecuteEval.schedule_id` of the one canonical eval of the final consensus."""

MAX_ABANDONED_ROUNDS = 3
"""Consecutive rounds the reducer may tear down before the run ends (ReduceStall)."""


class Target(enum.Enum):
    """Non-rank destinations of an `Out`."""

    REDUCER = "reducer"
    CONTROLLER = "controller"


REDUCER = Target.REDUCER
CONTROLLER = Target.CONTROLLER


@dataclass(frozen=True)
class Out:
    """One output: send `record` to `dest` (a rank id, `REDUCER` or `CONTROLLER`)."""

    dest: int | Target
    record: Any


@dataclass(frozen=True)
class ExpectRound:
    """Reducer directive: round `round` folds deposits from `ranks` (minus later DeclareDead)."""

    round: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class SaveState:
    """Controller directive: write the checkpoint meta `state` (see `Coordinator.state_dict`)."""

    reason: ShutdownReason
    state: dict[str, Any]


@dataclass(frozen=True)
class RunEnded:
    """Controller notice: the run is over; `reason` None means it finished normally."""

    reason: ShutdownReason | None


class RunPhase(enum.Enum):
    TRAINING = "training"
    FINAL_EVAL_DISPATCHED = "final_eval_dispatched"
    SHUTDOWN_INITIATED = "shutdown_initiated"


@dataclass
class _Cycle:
    """The averaging cycle in flight (Pending)."""

    round: int
    started_at: float
    ranks: tuple[int, ...]
    snapshot: list[int]  # each rank's step counter at the trigger
    coverage: dict[int, list[Span]]  # done spans at the trigger (covered is a subset of the consensus)
    last_aggregated: int
    done_through: int  # every sample of epochs <= this was reported trained at the trigger
    reduced: bool = False
    acks: dict[int, DivergenceSample | None] = field(default_factory=dict)
    upload_ms: dict[int, float] = field(default_factory=dict)


class Coordinator:
    """The scheduling state machine for one run of `world_size` ranks (see the module docstring).

    `resume` is a dict from `state_dict()` of an earlier run of the same world,
    dataset and seed: training continues at its epoch with its global step,
    ElChe trajectory, guard history and (progressive modes) its coverage, so
    only the samples not yet in the saved consensus are trained again.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        world_size: int,
        now: float,
        resume: Mapping[str, Any] | None = None,
    ) -> None:
        config.check_world(world_size)
        self.config = config
        self.world_size = world_size
        self.mode = config.mode
        self.phase = RunPhase.TRAINING
        self.save_reason: ShutdownReason | None = None
        self.ignored: Counter[str] = Counter()
        self.lost_sends: Counter[str] = Counter()
        self.liveness = Liveness(world_size, config.heartbeat_timeout_s, now)
        self.roles = CallbackRoles(world_size, config.callback_rank)
        self.ledger = WindowLedger(world_size)
        self.elche = ElChe(config.elche_config(world_size), world_size)
        self.guard: ConvergenceGuard = self._make_guard(None)
        self.meta = LrEventMeta() if config.meta_controller else None
        init, self._overshoot_ceiling, self._overshoot_auto = config.overshoot_bounds
        self._overshoot_initial = init
        self.overshoot = init

        self.round = 0  # rounds triggered
        self.avg_count = 0  # rounds finished
        self.global_step = 0
        self.cycle: _Cycle | None = None
        self._abandoned = 0
        self._last_sync_ms = 0.0
        self._step_count = [0] * world_size  # monotonic per-rank counter
        self._step_base = [0] * world_size  # counter value at the last finished reduce
        self._throttled: set[int] = set()
        self._lr: list[float | None] = [None] * world_size
        self._started = False
        self._final_reduced = False
        self._final_eval_rank = -1
        self._pending_callbacks: list[tuple[str, int]] = []  # ("checkpoint" | "eval", epoch)
        self._held: list[Out] = []  # Sync: data for ranks, held while a cycle is in flight
        self._out: list[Out] = []
        self._now = now

        # Epochs: the lowest epoch not yet aggregated is `last_aggregated + 1`.
        self.last_aggregated = -1
        self._metrics: dict[int, list[EpochMetrics]] = {}
        # Progressive dispatch state.
        self.pools: dict[int, ChunkPool] = {}
        self._pool_opened: dict[int, float] = {}
        self._in_flight: list[int | None] = [None] * world_size  # epoch of the chunk in flight
        self._final: dict[int, dispatch.FinalWindowPlan] = {}
        # Batches each rank has taken of its final-window allocation: a take can
        # come back short (a span's residue is smaller), so one allocation may
        # need several chunks.
        self._final_taken: dict[int, list[int]] = {}
        # Sync dispatch state.
        self._plans: list[list[dispatch.EpochPlan]] = [[] for _ in range(world_size)]
        self._assigned = [0] * world_size
        self._reported = [0] * world_size
        self._steps_at_report = [0] * world_size
        self._sync_epoch = -1
        # What the last finished consensus contains (for state_dict).
        self._consensus_coverage: dict[int, list[Span]] = {}
        self._consensus_aggregated = -1
        self._consensus_complete = -1  # every sample of epochs <= this is in the last consensus
        self._resume_coverage: dict[int, list[Span]] = {}
        self.elche.set_epoch_cap(config.batches_per_epoch)
        if resume is not None:
            self._restore(resume)

    # ================================================================ inputs

    def start(self, now: float) -> list[Out]:
        """The world has formed: dispatch the first epoch (or the resumed one)."""
        if self._started:
            raise CoordinatorError("start() called twice: the coordinator is already running")
        self._started = True
        self._now = now
        first = self.last_aggregated + 1
        if self.mode.progressive:
            for epoch, covered in sorted(self._resume_coverage.items()):
                pool = ChunkPool.from_coverage(
                    epoch, self.config.total_samples, self.config.batch_size, self.world_size, covered
                )
                self._open_pool(epoch, now, pool)
            if first not in self.pools and first < self.config.num_epochs:
                self._open_pool(first, now)
            self._wake_idle()
        elif first < self.config.num_epochs:
            self._start_sync_epoch(first)
        self._advance(now)
        return self._flush()

    def on_record(self, rank: int, record: Any, now: float) -> list[Out]:
        """A record from `rank` (the sender identity the relay vouched for)."""
        self._require_started(record)
        self._now = now
        handler = self._HANDLERS.get(type(record))
        if handler is None:
            raise CoordinatorError(
                f"coordinator in phase {self.phase.value} cannot accept "
                f"{type(record).__name__} from rank {rank}: it is not a rank->coordinator record"
            )
        self.liveness.check_rank(rank)
        if getattr(record, "rank", rank) != rank:
            raise CoordinatorError(
                f"{type(record).__name__} from rank {rank} claims rank {record.rank}: a relay "
                f"routed it wrongly or the rank is misconfigured (check FLODL_RANK)"
            )
        if self._over:
            if isinstance(record, Exiting):
                self.liveness.exit(rank)
            self.ignored["after_end"] += 1
            return self._flush()
        if not self.liveness.is_live(rank):
            self.ignored["from_departed"] += 1
            return self._flush()
        self.liveness.saw(rank, now)
        handler(self, rank, record, now)
        self._advance(now)
        return self._flush()

    def on_tick(self, now: float) -> list[Out]:
        """Time passes: beacons, heartbeat staleness, the reduce-stall ceiling."""
        if not self._started or self._over:
            return self._flush()
        self._now = now
        if self.liveness.beacon_due(now):
            self._to_live(rec.CoordHeartbeat())
        for r in self.liveness.stale(now):
            self._lose_rank(r, failure=True, now=now)
            if self._over:
                return self._flush()
        cyc = self.cycle
        if cyc is not None and now - cyc.started_at > self.config.reduce_stall_s:
            # A round that neither completes nor fails while its ranks stay
            # alive is a wedge; saving beats hanging forever.
            self.cycle = None
            self._shutdown_with_save(ShutdownReason.REDUCE_STALL)
            return self._flush()
        self._advance(now)
        return self._flush()

    def on_rank_death(self, rank: int, reason: str, now: float) -> list[Out]:
        """The agent or relay saw `rank` exit (`reason` is for logs): the fast death path."""
        self._require_started(f"death report of rank {rank} ({reason})")
        self._now = now
        self.liveness.check_rank(rank)
        if self._over:
            self.liveness.fail(rank)
            self.ignored["after_end"] += 1
        elif not self.liveness.is_live(rank):
            self.ignored["duplicate_death"] += 1
        else:
            self._lose_rank(rank, failure=True, now=now)
            self._advance(now)
        return self._flush()

    def on_send_failed(self, rank: int, record: Any, now: float) -> list[Out]:
        """The service could not deliver `record`, one of our outputs, to `rank`.

        The rank takes the failure path of `on_rank_death` (it counts towards
        `max_failure`), which also returns what the record carried, so no
        sample is lost: a progressive chunk (`StartEpoch`, `Update.next_plan`)
        is the rank's in-flight chunk and is forfeited to the reclaimed queue,
        where a survivor redoes it first (a `ChunkPool.rollback` into the
        rank's own span would leave it to be stolen last); under Sync an
        undelivered `StartEpoch` or `ExtendPartition` cannot have been trained,
        so it is part of the remainder handed on by `ExtendPartition`.
        """
        self._require_started(f"failed send of {type(record).__name__} to rank {rank}")
        self._now = now
        self.liveness.check_rank(rank)
        if self._over:
            self.ignored["after_end"] += 1
        elif not self.liveness.is_live(rank):
            self.ignored["send_to_departed"] += 1
        else:
            self.lost_sends[type(record).__name__] += 1
            self._lose_rank(rank, failure=True, now=now)
            self._advance(now)
        return self._flush()

    def on_round_complete(self, round: int, now: float) -> list[Out]:
        """The reducer published the consensus of `round`."""
        cyc = self._noticed_cycle(round, "complete", now)
        if cyc is None:
            return self._flush()
        cyc.reduced = True
        self._advance(now)
        return self._flush()

    def on_round_abandoned(self, round: int, now: float) -> list[Out]:
        """The reducer tore `round` down (bad deposit): no consensus; ranks keep local state.

        The window's steps stay uncredited, so the gate fires again at once
        and the work lands in the next round; repeated failures end the run.
        """
        if self._noticed_cycle(round, "abandoned", now) is None:
            return self._flush()
        self.cycle = None
        self._abandoned += 1
        if self._abandoned >= MAX_ABANDONED_ROUNDS:
            self._shutdown_with_save(ShutdownReason.REDUCE_STALL)
        else:
            self._advance(now)
        return self._flush()

    # ================================================================ queries

    @property
    def finished(self) -> bool:
        """True once shutdown (plain or with save) has been dispatched."""
        return self._over

    @property
    def window_steps(self) -> list[int]:
        """Each rank's steps since the last finished reduce."""
        return [c - b for c, b in zip(self._step_count, self._step_base, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs, as of the last finished consensus (JSON-able)."""
        state = self.elche.state()
        if isinstance(self.guard, TrendGuard):
            state = dataclasses.replace(state, trend_history=tuple(self.guard.history()))
        epoch = self._consensus_aggregated + 1
        return {
            "world_size": self.world_size,
            "mode": self.mode.value,
            "seed": self.config.seed,
            "total_samples": self.config.total_samples,
            "batch_size": self.config.batch_size,
            "epoch": epoch,
            "global_step": self.global_step,
            "round": self.avg_count,
            "elche": state.to_dict(),
            "coverage": {
                str(e): [list(s) for s in spans]
                for e, spans in sorted(self._consensus_coverage.items())
                if e >= epoch
            },
        }

    # ================================================================ record handlers

    def _on_batch(self, rank: int, m: Batch, now: float) -> None:
        self._count_steps(rank, m.step_count)
        self.ledger.record_batch(rank, m.batch_ms, m.data_ms, m.batch_loss)
        self._check_throttle()

    def _on_heartbeat(self, rank: int, m: Heartbeat, now: float) -> None:
        self._count_steps(rank, m.step_count)

    def _on_sync_ack(self, rank: int, m: SyncAck, now: float) -> None:
        # The ack's step_count is deliberately ignored: CPU acks carry none
        # that means anything, and folding one in once wedged the gate upstream.
        cyc = self.cycle
        if cyc is None or m.round != cyc.round or rank not in cyc.ranks:
            self.ignored["stale_round"] += 1
            return
        if rank in cyc.acks:
            self.ignored["duplicate_ack"] += 1
            return
        cyc.reduced = True  # an ack proves the consensus was published
        sample = None
        if m.divergence is not None and math.isfinite(m.divergence):
            sample = DivergenceSample(m.divergence, m.post_norm, m.pre_norm)
        cyc.acks[rank] = sample

    def _on_snapshot_ready(self, rank: int, m: SnapshotReady, now: float) -> None:
        cyc = self.cycle
        if cyc is None or m.round != cyc.round:
            self.ignored["stale_round"] += 1
            return
        # RequestParams -> SnapshotReady is an honest per-rank upload latency,
        # measured before any barrier wait.
        cyc.upload_ms.setdefault(rank, (now - cyc.started_at) * 1000.0)

    def _on_exiting(self, rank: int, m: Exiting, now: float) -> None:
        self._lose_rank(rank, failure=False, now=now)

    def _on_lr(self, rank: int, m: LrUpdate, now: float) -> None:
        self._lr[rank] = m.lr

    def _on_eval_result(self, rank: int, m: EvalResult, now: float) -> None:
        # Eval time is not training time, success or not.
        self.ledger.absorb_callback_cost(rank, m.elapsed_ms)
        self.roles.eval_ms.update(m.elapsed_ms)
        if m.error is None:
            self._to_live(rec.EvalBroadcast(epoch=m.epoch, metric=m.metric))
        self._emit(CONTROLLER, m)
        if m.schedule_id == FINAL_EVAL_ID and self.phase is RunPhase.FINAL_EVAL_DISPATCHED:
            self._shutdown()

    def _on_checkpoint_result(self, rank: int, m: CheckpointResult, now: float) -> None:
        self.ledger.absorb_callback_cost(rank, m.elapsed_ms)
        if m.error is None:
            self.roles.checkpoint_ms.update(m.elapsed_ms)
            self.roles.checkpoint_succeeded(m.version, rank)
            return
        nxt = self.roles.checkpoint_failed(m.version, rank, self.liveness.live_mask)
        if nxt is not None:
            self._emit(nxt, rec.Checkpoint(version=m.version, target_rank=nxt))

    def _on_epoch_fn(self, rank: int, m: EpochFnElapsed, now: float) -> None:
        self.ledger.absorb_callback_cost(rank, m.elapsed_ms)
        self.roles.epoch_fn_ms.update(m.elapsed_ms)

    def _on_metrics(self, rank: int, m: EpochMetrics, now: float) -> None:
        if self.mode.progressive:
            pool = self.pools.get(m.epoch)
            chunk = pool.in_flight(rank) if pool is not None else None
            if chunk is None or self._in_flight[rank] != m.epoch:
                self.ignored["late_completion"] += 1
                return
            if m.samples_processed != chunk.size:
                raise CoordinatorError(
                    f"rank {rank} reported {m.samples_processed} samples for its chunk "
                    f"({chunk.offset}, {chunk.size}) of epoch {m.epoch}: a chunk is trained whole; "
                    f"the rank and the controller disagree on the dataset or the batch size"
                )
            pool.complete(rank)
            self._in_flight[rank] = None
            self._metrics.setdefault(m.epoch, []).append(m)
            self._send_chunk(rank)
            return
        if m.epoch != self._sync_epoch:
            self.ignored["late_completion"] += 1
            return
        self._reported[rank] += m.samples_processed
        self._steps_at_report[rank] = self._step_count[rank]
        self._metrics.setdefault(m.epoch, []).append(m)

    _HANDLERS: dict[type, Callable[[Coordinator, int, Any, float], None]] = {
        Batch: _on_batch,
        Heartbeat: _on_heartbeat,
        SyncAck: _on_sync_ack,
        SnapshotReady: _on_snapshot_ready,
        Exiting: _on_exiting,
        LrUpdate: _on_lr,
        EvalResult: _on_eval_result,
        CheckpointResult: _on_checkpoint_result,
        EpochFnElapsed: _on_epoch_fn,
        EpochMetrics: _on_metrics,
    }

    # ================================================================ the cycle

    def _advance(self, now: float) -> None:
        """Everything that follows from the current state, in upstream tick order."""
        if self._over:
            return
        cyc = self.cycle
        if cyc is not None and cyc.reduced and all(
            r in cyc.acks for r in cyc.ranks if self.liveness.is_live(r)
        ):
            self._finish(now)
        if self.cycle is None:
            self._release_held()
            if self._should_average():
                self._trigger(now)
        self._aggregate(now)
        if self.cycle is None:
            steps = self.window_steps
            if not any(steps[r] for r in self.liveness.live):
                # Nothing stepped since the last consensus: it holds all reported work.
                self._consensus_complete = max(self._consensus_complete, self._done_through())
            self._flush_callbacks()
        self._maybe_end(now)

    def _should_average(self) -> bool:
        """The count-based gate (coordinator notes §4.2)."""
        if self.phase is not RunPhase.TRAINING or not self.liveness.live:
            return False
        counts = self.elche.batch_counts
        steps = self.window_steps
        any_mover = False
        for r in self.liveness.live:
            any_mover |= steps[r] > 0
            if self.mode is Mode.SYNC:
                hit = steps[r] >= 1
            elif self.mode is Mode.CADENCE:
                # The chunk must be complete too: its coverage then lands in
                # this consensus, and a final-window crumb is not left behind.
                hit = steps[r] >= counts[r] and self._in_flight[r] is None
            else:
                hit = steps[r] >= counts[r]
            # A rank we throttled is parked at the barrier on our orders.
            if not (hit or r in self._throttled or self._quiesced(r)):
                return False
        return any_mover

    def _quiesced(self, rank: int) -> bool:
        """`rank` cannot step before the next reduce: nothing in flight and no work for it."""
        if self.mode.progressive:
            return (
                self._in_flight[rank] is None
                and self._pool_with_work(rank) is None
                and self._next_epoch() is None
            )
        return self._reported[rank] >= self._assigned[rank]

    def _trigger(self, now: float, final: bool = False) -> None:
        live = tuple(self.liveness.live)
        self.round += 1
        self.cycle = _Cycle(
            round=self.round,
            started_at=now,
            ranks=live,
            snapshot=list(self._step_count),
            coverage={e: p.covered() for e, p in self.pools.items()},
            last_aggregated=self.last_aggregated,
            done_through=self._done_through(),
        )
        self._final_reduced = final
        # The reducer learns the barrier before any deposit can arrive.
        self._emit(REDUCER, ExpectRound(self.round, live))
        for r in live:
            if self.mode is Mode.SYNC and r not in self._throttled:
                # The hard barrier: without it the fast rank laps the others
                # during the round trip and Sync loses its convergence parity.
                # Sent first: a rank that handled the request alone would train
                # a step on the replica it deposited, which the consensus erases.
                self._emit(r, rec.Throttle())
            self._emit(r, rec.RequestParams(round=self.round))
        if self.mode is Mode.SYNC:
            self._throttled.update(live)

    def _finish(self, now: float) -> None:
        cyc = self.cycle
        assert cyc is not None
        live = self.liveness.live_mask
        # -- head: feedback to ElChe, the guard and the meta-controller
        report = self.ledger.report(live, self.mode is not Mode.SYNC, self._last_sync_ms)
        self.elche.report_window(report)
        moved = [cyc.snapshot[r] - self._step_base[r] for r in range(self.world_size)]
        live_moved = [moved[r] for r in cyc.ranks if live[r]]
        div = DivergenceReport.from_samples([cyc.acks.get(r) for r in range(self.world_size)])
        verdict = self.guard.report(div, sum(live_moved), max(live_moved, default=0))
        if self.meta is not None:
            lr = next((x for x in self._lr if x is not None), None)
            nudge = self.meta.observe(lr, self.elche.anchor, verdict, self.elche.phase)
            if nudge is not None:
                self.elche.apply_verdict(nudge)  # discards any pending growth first
        if verdict.kind is VerdictKind.STABLE and self.mode is Mode.ASYNC:
            verdict = Verdict.stable(relax_up=self.config.relax_up)
        self.elche.apply_verdict(verdict)
        if self.mode is Mode.ASYNC and self._overshoot_auto:
            if verdict.kind is VerdictKind.STABLE:
                self.overshoot = min(self.overshoot + 1, self._overshoot_ceiling)
            elif verdict.kind is VerdictKind.NUDGE_DOWN:
                self.overshoot = self._overshoot_initial
        if self.elche.is_calibrated:
            self.roles.on_calibrated(self._smoothed(), live)
        # -- counters: only the snapshotted steps are in this consensus
        self.global_step += sum(moved[r] for r in cyc.ranks)
        for r in cyc.ranks:
            self._step_base[r] = cyc.snapshot[r]
        self.avg_count += 1
        self._abandoned = 0
        self._last_sync_ms = (now - cyc.started_at) * 1000.0
        self._consensus_coverage = cyc.coverage
        self._consensus_aggregated = cyc.last_aggregated
        # Sync ranks sit throttled from their deposit to their Update, with any
        # new data held back (`_held`), so this consensus holds everything they
        # reported up to now; other ranks may train on, so only what was done
        # at the trigger counts.
        done = self._done_through() if self.mode is Mode.SYNC else cyc.done_through
        self._consensus_complete = max(self._consensus_complete, done)
        self.ledger.reset_steps()
        self.ledger.reset_timing()
        self._throttled.clear()
        self.cycle = None
        # Before the Updates: the eval rank then scores exactly the consensus it
        # just loaded (a Sync rank is throttled, a Cadence rank idle, until its Update).
        self._flush_callbacks()
        # -- tail: next plans ride in the Update (atomic dispatch)
        self._pin_final_windows()
        for r in cyc.ranks:
            if live[r]:
                self._emit(r, rec.Update(round=cyc.round, next_plan=_wire(self._take_chunk(r))))
        self._to_live(rec.SetGlobalStep(global_step=self.global_step))
        self._wake_idle()

    # ================================================================ progressive dispatch

    def _open_pool(self, epoch: int, now: float, pool: ChunkPool | None = None) -> ChunkPool:
        if epoch <= self.last_aggregated:
            # Re-creating an aggregated epoch's pool would orphan it: nothing
            # would ever aggregate it again, and its data would train twice.
            raise CoordinatorError(f"epoch {epoch} is already aggregated; its pool cannot reopen")
        if pool is None:
            counts = self.elche.batch_counts
            live = self.liveness.live_mask
            calibrated = self.elche.is_calibrated
            shares = [(counts[r] if calibrated else 1) if live[r] else 0 for r in range(self.world_size)]
            pool = ChunkPool(epoch, self.config.total_samples, self.config.batch_size, shares)
        self.pools[epoch] = pool
        self._pool_opened[epoch] = now
        self._announce_epoch_role()
        if self.mode.barrier_paced:
            self._pin_final(epoch)
        return pool

    def _pool_with_work(self, rank: int) -> ChunkPool | None:
        """The open pool `rank` would draw from, ignoring the reduce budget.

        Lower epochs first, so work reclaimed from a dead rank is redone
        before anyone streams ahead.
        """
        for epoch in sorted(self.pools):
            if self._pool_has_work(rank, self.pools[epoch]):
                return self.pools[epoch]
        return None

    def _next_epoch(self) -> int | None:
        """The epoch a rank may stream into next, if any.

        Barrier-paced modes never cross into an epoch whose predecessor is not
        aggregated; Async may run ahead.
        """
        nxt = max(self.pools, default=self.last_aggregated) + 1
        if nxt >= self.config.num_epochs or self.phase is not RunPhase.TRAINING:
            return None
        if self.mode.barrier_paced and nxt != self.last_aggregated + 1:
            return None
        return nxt

    def _pool_has_work(self, rank: int, pool: ChunkPool) -> bool:
        if pool.remaining() < self.config.batch_size:
            return False
        plan = self._final.get(pool.epoch)
        return plan is None or self._final_taken[pool.epoch][rank] < plan.alloc[rank]

    def _take_chunk(self, rank: int) -> dispatch.EpochPlan | None:
        """Take `rank`'s next chunk if it may have one now (one in flight, budget, barriers)."""
        if (
            not self.liveness.is_live(rank)
            or self.phase is not RunPhase.TRAINING
            or not self.mode.progressive
            or self._in_flight[rank] is not None
        ):
            return None
        if self.mode.barrier_paced and self.cycle is not None:
            return None  # the next plan rides in this cycle's Update
        counts = self._live_counts()
        budget = counts[rank] + (self.overshoot if self.mode is Mode.ASYNC else 0)
        steps = self.window_steps[rank]
        pool = self._pool_with_work(rank)
        if pool is None:
            nxt = self._next_epoch()
            if nxt is None:
                return None
            pool = self._open_pool(nxt, self._now)
        final = self._final.get(pool.epoch) if self.mode.barrier_paced else None
        if final is not None:
            # The pinned allocation bypasses the caps: it was sized so the
            # whole remainder lands in one window with no one-step rank.
            batches = final.alloc[rank] - self._final_taken[pool.epoch][rank]
        elif steps >= budget:
            return None  # reduce barrier: wait for the average
        else:
            batches = self._chunk_batches(rank, pool, counts, steps)
        plan = pool.take(rank, batches * self.config.batch_size)
        if plan is None:
            return None
        self._in_flight[rank] = pool.epoch
        if final is not None:
            self._final_taken[pool.epoch][rank] += plan.size // self.config.batch_size
        return plan

    def _chunk_batches(self, rank: int, pool: ChunkPool, counts: list[int], steps: int) -> int:
        return dispatch.chunk_batches(
            rank,
            remaining_batches=pool.remaining() // self.config.batch_size,
            counts=counts,
            window_steps=steps,
            barrier_paced=self.mode.barrier_paced,
            calibrated=self.elche.is_calibrated,
            probe_batches=dispatch.probe_chunk_batches(
                self.config.total_samples, self.world_size, self.config.batch_size
            ),
            min_chunk_batches=self.config.min_chunk_batches,
            overshoot=self.overshoot if self.mode is Mode.ASYNC else 0,
            final_window=None,
        )

    def _send_chunk(self, rank: int) -> None:
        plan = self._take_chunk(rank)
        if plan is not None:
            self._emit(rank, rec.StartEpoch(plan=_wire(plan)))

    def _wake_idle(self) -> None:
        """Dispatch to every live rank with nothing in flight (after reduces, deaths, epoch edges)."""
        if self.mode.progressive:
            for r in self.liveness.live:
                self._send_chunk(r)

    def _pin_final_windows(self) -> None:
        if self.mode.barrier_paced and self.mode.progressive:
            for epoch in self.pools:
                self._pin_final(epoch)

    def _pin_final(self, epoch: int) -> None:
        """At a window start: plan the epoch's final window if its remainder fits one window."""
        pool = self.pools[epoch]
        plan = dispatch.refresh_final_window_plan(
            None,
            epoch=epoch,
            remaining_batches=pool.remaining() // self.config.batch_size,
            counts=self._live_counts(),
            alive=self.liveness.live_mask,
        )
        if plan is None:
            self._final.pop(epoch, None)
        else:
            self._final[epoch] = plan
        self._final_taken[epoch] = [0] * self.world_size

    def _live_counts(self) -> list[int]:
        live = self.liveness.live_mask
        return [c if live[r] else 0 for r, c in enumerate(self.elche.batch_counts)]

    # ================================================================ Sync dispatch

    def _start_sync_epoch(self, epoch: int) -> None:
        self._announce_epoch_role()
        live = self.liveness.live
        ratios = self.config.partition_ratios
        if ratios is not None:
            ratios = [ratios[r] for r in live]
        plans = dispatch.sync_plans(epoch, self.config.total_samples, len(live), ratios)
        self._sync_epoch = epoch
        self._assigned = [0] * self.world_size
        self._reported = [0] * self.world_size
        self._plans = [[] for _ in range(self.world_size)]
        for r, plan in zip(live, plans, strict=True):
            self._plans[r] = [plan]
            self._assigned[r] = plan.size
            self._steps_at_report[r] = self._step_count[r]
            self._emit_data(r, rec.StartEpoch(plan=_wire(plan)))

    def _emit_data(self, rank: int, record: Any) -> None:
        """Sync: send new data for `rank` now, or after the Updates if a cycle is in flight.

        A rank that got data while its round was in flight would train it on
        the replica it just deposited, and the consensus would then overwrite
        those steps: under load (a long round trip) a whole epoch was lost so.
        """
        if self.cycle is None:
            self._emit(rank, record)
        else:
            self._held.append(Out(rank, record))

    def _release_held(self) -> None:
        # A rank that died meanwhile is skipped: its held plan is already part
        # of the remainder `_lose_rank` handed on.
        for out in self._held:
            if self.liveness.is_live(out.dest):
                self._out.append(out)
        self._held.clear()

    # ================================================================ epochs

    def _aggregate(self, now: float) -> None:
        """Aggregate finished epochs in order; open the next epoch at each boundary."""
        while self.last_aggregated + 1 < self.config.num_epochs:
            epoch = self.last_aggregated + 1
            if self.mode.progressive:
                pool = self.pools.get(epoch)
                if pool is None or not pool.is_done():
                    return
                wall = (now - self._pool_opened.pop(epoch)) * 1000.0
                del self.pools[epoch]
                self._final.pop(epoch, None)
                self._final_taken.pop(epoch, None)
            else:
                if self._sync_epoch != epoch or any(
                    self._reported[r] < self._assigned[r] for r in self.liveness.live
                ):
                    return
                wall = None
            agg = aggregate_epoch(epoch, self._metrics.pop(epoch, []), self.world_size, wall)
            self.last_aggregated = epoch
            self._to_live(agg)
            self._emit(CONTROLLER, agg)
            self._epoch_boundary(epoch + 1)

    def _epoch_boundary(self, epoch: int) -> None:
        """Entering `epoch`: its callbacks (held until the cycle is idle), then its data."""
        if epoch >= self.config.num_epochs:
            return
        if is_due(epoch, self.config.checkpoint_every):
            self._pending_callbacks.append(("checkpoint", epoch))
        if is_due(epoch, self.config.eval_every):
            self._pending_callbacks.append(("eval", epoch))
        if self.mode.progressive:
            self._wake_idle()
        else:
            self._start_sync_epoch(epoch)

    def _done_through(self) -> int:
        """The highest epoch whose every sample is reported trained (and every epoch before it)."""
        epoch = self.last_aggregated + 1
        while epoch in self.pools and self.pools[epoch].is_done():
            epoch += 1
        return epoch - 1

    def _flush_callbacks(self) -> None:
        # Each is held until a finished consensus contains the whole epoch that
        # ended before it (not merely until the cycle is idle: under Sync the
        # cycle is almost never idle); targets resolve now, after any failover.
        due = [(k, e) for k, e in self._pending_callbacks if e - 1 <= self._consensus_complete]
        self._pending_callbacks = [c for c in self._pending_callbacks if c not in due]
        for kind, epoch in due:
            if kind == "checkpoint":
                target = self.roles.checkpoint
                record: Any = rec.Checkpoint(version=epoch, target_rank=target)
            else:
                target = self.roles.eval
                # Always score the consensus: the live model may be mid-window
                # or an EASGD blend.
                record = rec.ExecuteEval(
                    schedule_id=epoch, epoch=epoch, target_rank=target, adopt_consensus=True
                )
            if self.liveness.is_live(target):
                self._emit(target, record)

    def _announce_epoch_role(self) -> None:
        if self.roles.epoch_dirty:
            self.roles.epoch_dirty = False
            self._to_live(rec.SetEpochCallbackRole(rank=self.roles.epoch))

    def _maybe_end(self, now: float) -> None:
        if self.phase is RunPhase.FINAL_EVAL_DISPATCHED and not self.liveness.is_live(
            self._final_eval_rank
        ):
            self._shutdown()  # the eval rank died: there is no result to wait for
            return
        if self.phase is not RunPhase.TRAINING or self.cycle is not None:
            return
        if self.last_aggregated + 1 < self.config.num_epochs:
            return
        live = self.liveness.live
        steps = self.window_steps
        if not self._final_reduced and any(steps[r] > 0 for r in live):
            # The edge of the last epoch can leave steps no average has seen.
            self._trigger(now, final=True)
            return
        eval_rank = self.roles.eval
        if self.config.final_eval and self.liveness.is_live(eval_rank):
            self.phase = RunPhase.FINAL_EVAL_DISPATCHED
            self._final_eval_rank = eval_rank
            self._emit(eval_rank, rec.ExecuteEval(
                schedule_id=FINAL_EVAL_ID, epoch=self.config.num_epochs, target_rank=eval_rank,
                adopt_consensus=True))
            return
        self._shutdown()

    def _shutdown(self) -> None:
        self.phase = RunPhase.SHUTDOWN_INITIATED
        self._to_live(rec.Shutdown())
        self._emit(CONTROLLER, RunEnded(None))

    # ================================================================ deaths

    def _lose_rank(self, rank: int, failure: bool, now: float) -> None:
        """The death side-effect chain (notes §5.2); a clean exit takes it too, minus the failure."""
        if self.mode is Mode.SYNC:
            # Computed before the rank leaves the ledger: what it left undone. Reported
            # samples are exact; only steps since the last report are full batches (a
            # span's short last batch is always followed by its report).
            done = self._reported[rank] + (
                self._step_count[rank] - self._steps_at_report[rank]
            ) * self.config.batch_size
            remainder = (
                dispatch.remainder_spans(self._plans[rank], done)
                if self._reported[rank] < self._assigned[rank]
                else []
            )
        left = self.liveness.fail(rank) if failure else self.liveness.exit(rank)
        if not left:
            return
        self._throttled.discard(rank)
        self.roles.on_death(rank, self._smoothed(), self.liveness.live_mask)
        # The reducer must not wait for a deposit that will never come.
        self._emit(REDUCER, rec.DeclareDead(rank=rank))
        if self.mode is Mode.SYNC:
            self._assigned[rank] = self._reported[rank]
            for r, plan in dispatch.extend_partition_plans(
                self._sync_epoch, remainder, self.liveness.live
            ):
                self._plans[r].append(plan)
                self._assigned[r] += plan.size
                self._emit_data(r, rec.ExtendPartition(epoch=plan.epoch, offset=plan.offset, size=plan.size))
        else:
            for pool in self.pools.values():
                pool.forfeit(rank)
            self._in_flight[rank] = None
        reason = unrecoverable(self.liveness, self.config.max_failure)
        if reason is not None and self.phase is not RunPhase.SHUTDOWN_INITIATED:
            self._shutdown_with_save(reason)
            return
        if self.mode.progressive and self.phase is RunPhase.TRAINING:
            self._pin_final_windows()
            self._wake_idle()

    def _shutdown_with_save(self, reason: ShutdownReason) -> None:
        if self.save_reason is not None:
            return
        self.save_reason = reason
        self._emit(CONTROLLER, SaveState(reason, self.state_dict()))
        self._to_live(rec.ShutdownWithSave(reason=reason.value))
        self._emit(CONTROLLER, RunEnded(reason))

    # ================================================================ helpers

    @property
    def _over(self) -> bool:
        return self.save_reason is not None or self.phase is RunPhase.SHUTDOWN_INITIATED

    def _count_steps(self, rank: int, step_count: int) -> None:
        # Monotonic: a reordered heartbeat must not roll the counter back.
        if step_count > self._step_count[rank]:
            self._step_count[rank] = step_count

    def _check_throttle(self) -> None:
        """Explicit lead cap (`max_batch_diff`), only while the whole world is alive."""
        diff = self.config.max_batch_diff
        if diff is None or len(self.liveness.live) != self.world_size:
            return
        steps = self.window_steps
        floor = min(steps)
        for r, s in enumerate(steps):
            if s > floor + diff and r not in self._throttled:
                self._throttled.add(r)
                self._emit(r, rec.Throttle())

    def _smoothed(self) -> list[float | None]:
        return [self.elche.smoothed_ms_per_batch(r) for r in range(self.world_size)]

    def _make_guard(self, history: list[float] | None) -> ConvergenceGuard:
        kind = self.config.guard
        if kind is GuardKind.NONE:
            return NoGuard()
        if kind is GuardKind.MSF:
            return MsfGuard()
        return TrendGuard.with_history(self.config.guard_threshold, history or [])

    def _emit(self, dest: int | Target, record: Any) -> None:
        self._out.append(Out(dest, record))

    def _to_live(self, record: Any) -> None:
        for r in self.liveness.live:
            self._out.append(Out(r, record))

    def _flush(self) -> list[Out]:
        out, self._out = self._out, []
        return out

    def _noticed_cycle(self, round: int, what: str, now: float) -> _Cycle | None:
        """The cycle a reducer notice about `round` concerns; None (counted) if it is stale."""
        self._require_started(f"round {round} {what}")
        self._now = now
        cyc = self.cycle
        if self._over or cyc is None or cyc.round != round:
            self.ignored["stale_reducer_notice"] += 1
            return None
        return cyc

    def _require_started(self, what: Any) -> None:
        if not self._started:
            raise CoordinatorError(
                f"coordinator received {type(what).__name__ if not isinstance(what, str) else what} "
                f"before start(): call start(now) once the world has formed"
            )

    def _restore(self, state: Mapping[str, Any]) -> None:
        cfg = self.config
        for key, want in (
            ("world_size", self.world_size),
            ("seed", cfg.seed),
            ("total_samples", cfg.total_samples),
            ("batch_size", cfg.batch_size),
        ):
            if state.get(key) != want:
                raise ConfigError(
                    f"resume: the checkpoint has {key} = {state.get(key)!r} but this run has "
                    f"{want!r}; resume with the same {key} (the data coverage depends on it)"
                )
        es = ElCheState.from_dict(state["elche"])
        self.elche = ElChe.from_state(cfg.elche_config(self.world_size), self.world_size, es)
        self.elche.set_epoch_cap(cfg.batches_per_epoch)
        self.guard = self._make_guard(list(es.trend_history or []))
        self.global_step = int(state["global_step"])
        self.avg_count = self.round = int(state["round"])
        epoch = int(state["epoch"])
        if not 0 <= epoch <= cfg.num_epochs:
            raise ConfigError(
                f"resume: checkpoint epoch {epoch} is outside this run's {cfg.num_epochs} epochs; "
                f"raise num_epochs to continue training"
            )
        self.last_aggregated = self._consensus_aggregated = self._consensus_complete = epoch - 1
        if self.mode.progressive:
            self._resume_coverage = {
                int(e): [(int(o), int(n)) for o, n in spans]
                for e, spans in state.get("coverage", {}).items()
            }
            self._consensus_coverage = dict(self._resume_coverage)



def _wire(plan: dispatch.EpochPlan | None) -> rec.EpochPlan | None:
    return None if plan is None else rec.EpochPlan(plan.epoch, plan.offset, plan.size)
