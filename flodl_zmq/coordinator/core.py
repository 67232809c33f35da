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

    Idle --gate--> Pending --reducer published--> Closing --every live rank acked--> Idle
         RequestParams(round)      Update(round, next_plan)      the guard's verdict
         [Sync: Throttle]          SetGlobalStep
         controller: RoundOpened(round, ranks)

The gate counts steps, never wall time (rounds.py keeps the counts). Sync
fires once every live rank did one step; Cadence and Async once every live
rank did its ElChe batch count (or has no work left: *quiesced*); Async opens
none in the run's last window, which the final round takes (`in_run_tail`). Steps
taken while the cycle is in flight stay credited to the next window. At the
publication the window's timings set the next window's schedule
(`WindowFeedback.calibrate`, feedback.py: ElChe) and each rank's next chunk
rides in its `Update`, sent beside the consensus (no round trip through the
acks); the acks then give the guard its divergence (`judge`: the convergence
guard, the LR meta-controller, overshoot), before any next window opens.
Under Cadence a chunk that fills its window names the next round, deposited
at its end unasked (`DepositsAhead`, rounds.py); the trigger asks only the
others. Evals and checkpoints (`EpochCallbacks`, `EvalLedger`: roles.py) go
out at the first finish whose consensus holds what they score, just before
the Updates.

Data dispatch is one `DispatchStrategy` (strategy.py: Sync partitions,
Cadence and Async chunk streams), so the cycle reads the same in every mode.
The strategy decides what data exists and who gets it; the coordinator
decides when it may go: a rank held at a barrier (Sync, Cadence) gets none
while a cycle is in flight; its next chunk rides in its Update, Sync data
follows the Updates (a rank must not train new data on the replica it
deposited).

What a rank trained is in the consensus once a published round holds its
deposit of it (`bank`, from the steps its snapshot announced): only then does
an epoch aggregate or a checkpoint cover it.

A rank leaves on a clean `Exiting`, a stale heartbeat, or a death reported by
its agent (`on_rank_death`). Its in-flight chunk, and what it trained into no
consensus (its replica took that along), return to the pool, the
reducer is told (`DeclareDead` to `REDUCER`) so no round waits for it, so is
a failed rank (if still running, it stops), and the run ends with a save when
`max_failure` is reached or nobody is left.

Run phases, strictly forward: Training -> FinalEvalDispatched ->
ShutdownInitiated; a shutdown-with-save latches orthogonally.

The contract with the service (what to call when, the order of what it
returns) and the error policy (what raises, what is ignored and counted):
docs/architecture.md, "The scheduler".
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flodl_zmq.coordinator.chunk_pool import Span
from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.elche import ElChe
from flodl_zmq.coordinator.feedback import WindowFeedback
from flodl_zmq.coordinator.liveness import Liveness, ShutdownReason, unrecoverable
from flodl_zmq.coordinator.metrics import EpochReports
from flodl_zmq.coordinator.outputs import (
    CONTROLLER,
    REDUCER,
    Evaluated,
    MassBound,
    Out,
    Outbox,
    RoundOpened,
    RunEnded,
    SaveState,
)
from flodl_zmq.coordinator.resume import ResumeState
from flodl_zmq.coordinator.roles import FINAL_EVAL_ID, CallbackRoles, EpochCallbacks, EvalLedger
from flodl_zmq.coordinator.rounds import (
    Consensus,
    Cycle,
    DepositsAhead,
    StepCounters,
    gate_open,
    over_lead_cap,
)
from flodl_zmq.coordinator.strategy import Send, strategy_for
from flodl_zmq.errors import CoordinatorError
from flodl_zmq.wire import records as rec

MAX_ABANDONED_ROUNDS = 3
"""Consecutive rounds the reducer may tear down before the run ends (ReduceStall)."""


class RunPhase(enum.Enum):
    TRAINING = "training"
    FINAL_EVAL_DISPATCHED = "final_eval_dispatched"
    SHUTDOWN_INITIATED = "shutdown_initiated"


class Coordinator:
    """The scheduling state machine for one run of `world_size` ranks (see the module docstring).

    `resume` is a dict from `state_dict()` of an earlier run of the same world,
    dataset and seed: training continues at its epoch with its global step,
    ElChe trajectory, guard history and (progressive modes) its coverage, so
    only the samples not yet in the saved consensus are trained again.
    """

    def __init__(self, config: CoordinatorConfig, world_size: int, now: float,
                 resume: Mapping[str, Any] | None = None) -> None:
        config.check_world(world_size)
        self.config = config
        self.world_size = world_size
        self.mode = config.mode
        self.phase = RunPhase.TRAINING
        self.save_reason: ShutdownReason | None = None
        self.ignored: Counter[str] = Counter()
        self.lost_sends: Counter[str] = Counter()
        self.liveness = Liveness(world_size, config.rank_silence_at_coordinator_s, now)
        self.roles = CallbackRoles(world_size, config.callback_rank)
        self.callbacks = EpochCallbacks(config.checkpoint_every, config.eval_every)
        point = None if resume is None else ResumeState.from_dict(resume, config, world_size)
        self.feedback = WindowFeedback(config, world_size, None if point is None else point.elche)

        self.round = 0 if point is None else point.round  # rounds triggered
        self.avg_count = self.round  # rounds finished
        self.global_step = 0 if point is None else point.global_step
        self.evals = EvalLedger(config, self.global_step)
        self.cycle: Cycle | None = None
        self._closing: Cycle | None = None  # released, awaiting its acks for the guard
        self._ahead = DepositsAhead(config.batch_size)
        self._unsettled: dict[int, int] = {}  # a rank that left -> the round of its deposit in flight
        self._abandoned = 0
        self._steps = StepCounters(world_size)
        self._throttled: set[int] = set()
        self._started = False
        self._final_reduced = False
        self._final_eval_rank = -1
        self._outbox = Outbox(self.liveness)
        self._now = now

        # Epochs: the lowest epoch not yet aggregated is `last_aggregated + 1`.
        self.last_aggregated = -1 if point is None else point.epoch - 1
        self._reports = EpochReports(world_size, config.reports_per_epoch, config.batches_per_epoch)
        coverage: dict[int, list[Span]] = {} if point is None else point.coverage
        # A resumed consensus holds every epoch before the resumed one.
        self._consensus = Consensus(
            coverage if self.mode.progressive else {}, self.last_aggregated, self.last_aggregated
        )
        self.dispatch = strategy_for(config, self.liveness, self.elche, self._announce_epoch_role, coverage,
                                     self._reports)

    # ================================================================ inputs

    def start(self, now: float, absent: Iterable[int] = ()) -> list[Out]:
        """The world has formed: dispatch the first epoch (or the resumed one).

        `absent`: ranks that died before the world formed. They keep their
        numbers and start dead (a failure each), so no plan, role or barrier
        ever waits for them and the live ranks cover every sample.
        """
        if self._started:
            raise CoordinatorError("start() called twice: the coordinator is already running")
        self._started = True
        self._now = now
        # Silence counts from here: every live rank just said hello, after a start-up
        # (imports, data) that may have outlasted the heartbeat timeout.
        for rank in self.liveness.live:
            self.liveness.saw(rank, now)
        for rank in absent:
            self.liveness.check_rank(rank)
            if self.liveness.fail(rank):
                self.roles.on_death(rank, self.feedback.smoothed_ms(), self.liveness.live_mask)
                self._outbox.emit(REDUCER, rec.DeclareDead(rank=rank))  # the reducer must not wait for it
        if self.global_step:
            # A resumed run continues its learning-rate schedule where it stopped, from the first step.
            self._outbox.to_live(rec.SetGlobalStep(global_step=self.global_step))
        self.dispatch.start(self.last_aggregated, now)
        first = self.last_aggregated + 1
        if first < self.config.num_epochs:
            self._open_epoch(first)
        self._advance(now)
        return self._outbox.flush()

    def on_record(self, rank: int, record: Any, now: float) -> list[Out]:
        """A record from `rank` (the sender identity the relay vouched for)."""
        self._require_started(record)
        self._now = now
        handler = self._HANDLERS.get(type(record))
        if handler is None:
            raise CoordinatorError(f"coordinator in phase {self.phase.value} cannot accept {type(record).__name__} "
                                   f"from rank {rank}: it is not a rank->coordinator record")
        self.liveness.check_rank(rank)
        if getattr(record, "rank", rank) != rank:
            raise CoordinatorError(
                f"{type(record).__name__} from rank {rank} claims rank {record.rank}: a relay "
                f"routed it wrongly or the rank is misconfigured (check FLODL_RANK)"
            )
        if self._over:
            if isinstance(record, rec.Exiting):
                self.liveness.exit(rank)
            self.ignored["after_end"] += 1
        elif not self.liveness.is_live(rank):
            self.ignored["from_departed"] += 1
        else:
            self.liveness.saw(rank, now)
            handler(self, rank, record, now)
            self._advance(now)
        return self._outbox.flush()

    def on_tick(self, now: float) -> list[Out]:
        """Time passes: beacons, heartbeat staleness, the reduce-stall ceiling."""
        if not self._started or self._over:
            return self._outbox.flush()
        self._now = now
        if self.liveness.beacon_due(now):
            self._outbox.to_live(rec.CoordHeartbeat())
        for r in self.liveness.stale(now):
            self._lose_rank(r, failure=True, now=now)
            if self._over:
                return self._outbox.flush()
        if self._in_flight is not None and self._in_flight.stalled(now, self.config.reduce_stall_s):
            # A round that neither completes nor fails while its ranks stay
            # alive is a wedge; saving beats hanging forever.
            self.cycle = self._closing = None
            self._shutdown_with_save(ShutdownReason.REDUCE_STALL)
            return self._outbox.flush()
        self._advance(now)
        return self._outbox.flush()

    def next_due(self) -> float | None:
        """When `on_tick` next has work (a beacon, a rank turning stale, the stall ceiling); None: never.
        A service sleeps until then; any other input may move it, so ask again after each."""
        if not self._started or self._over:
            return None
        due = self.liveness.next_due()
        if self._in_flight is not None:
            due = min(due, self._in_flight.stall_due(self.config.reduce_stall_s))
        return due

    def on_rank_death(self, rank: int, reason: str, now: float) -> list[Out]:
        """The agent or relay saw `rank` exit (`reason` is for logs): the fast death path."""
        self._require_started(f"death report of rank {rank} ({reason})")
        if self._failure_is_news(rank, "duplicate_death", now):
            self._lose_rank(rank, failure=True, now=now)
            self._advance(now)
        elif self._over:
            self.liveness.fail(rank)
        return self._outbox.flush()

    def on_send_failed(self, rank: int, record: Any, now: float) -> list[Out]:
        """The service could not deliver `record`, one of our outputs, to `rank`: the failure path of
        `on_rank_death`, which hands on what the record carried (a chunk to the reclaimed queue, redone
        first: a `ChunkPool.rollback` would leave it to be stolen last; a Sync span to the remainder)."""
        self._require_started(f"failed send of {type(record).__name__} to rank {rank}")
        if self._failure_is_news(rank, "send_to_departed", now):
            self.lost_sends[type(record).__name__] += 1
            self._lose_rank(rank, failure=True, now=now)
            self._advance(now)
        return self._outbox.flush()

    def _failure_is_news(self, rank: int, departed: str, now: float) -> bool:
        """Whether a failure of `rank` is acted on: not once the run is over (`ignored["after_end"]`), nor for a
        rank already gone (`ignored[departed]`)."""
        self._now = now
        self.liveness.check_rank(rank)
        ignored_as = "after_end" if self._over else None if self.liveness.is_live(rank) else departed
        if ignored_as is not None:
            self.ignored[ignored_as] += 1
        return ignored_as is None

    def on_round_complete(self, round: int, now: float, ranks: Iterable[int] | None = None) -> list[Out]:
        """The reducer published the consensus of `round`, of the deposits of `ranks` (None: each live rank's)."""
        cyc = self._noticed_cycle(round, "complete", now)
        if cyc is not None:
            cyc.reduced, cyc.deposited = True, None if ranks is None else frozenset(ranks)
            self._advance(now)
        return self._outbox.flush()

    def on_round_abandoned(self, round: int, now: float) -> list[Out]:
        """The reducer tore `round` down (bad deposit): no consensus; ranks keep local state.

        The window's steps stay uncredited, so the gate fires again at once
        and the work lands in the next round; repeated failures end the run.
        """
        if self._noticed_cycle(round, "abandoned", now) is not None:
            self.cycle = None
            self._settle(round)
            self._abandoned += 1
            if self._abandoned >= MAX_ABANDONED_ROUNDS:
                self._shutdown_with_save(ShutdownReason.REDUCE_STALL)
            else:
                self._advance(now)
        return self._outbox.flush()

    # ================================================================ queries

    @property
    def finished(self) -> bool:
        """True once shutdown (plain or with save) has been dispatched."""
        return self._over

    @property
    def elche(self) -> ElChe:
        """The per-rank batch-count schedule (kept by `feedback`)."""
        return self.feedback.elche

    @property
    def window_steps(self) -> list[int]:
        """Each rank's steps since the last finished reduce."""
        return self._steps.window()

    def state_dict(self, *, held_whole: bool = False) -> dict[str, Any]:
        """What a resume needs, as of the last finished consensus (JSON-able; see resume.py). `held_whole` (a re-form,
        13.1; a completed run): an epoch held whole and aggregated is done, though its last round was labelled before."""
        done = max(self._consensus.aggregated, min(self._consensus.complete, self.last_aggregated) if held_whole else -1)
        return ResumeState(epoch=done + 1, global_step=self.global_step, round=self.avg_count,
                           elche=self.feedback.state(), coverage=self._consensus.coverage).to_dict(self.config, self.world_size)

    # ================================================================ record handlers

    def _on_batch(self, rank: int, m: rec.Batch, now: float) -> None:
        self._steps.saw(rank, m.step_count)
        # One report covers every step since the last: the ledger sees each step as if
        # it had come alone, so ElChe's window (fill, marginal rate) is unchanged.
        for batch_ms, data_ms, loss in zip(m.batch_ms, m.data_ms, m.batch_loss, strict=True):
            self.feedback.ledger.record_batch(rank, batch_ms, data_ms, loss)
        self._check_throttle()

    def _on_heartbeat(self, rank: int, m: rec.Heartbeat, now: float) -> None:
        self._steps.saw(rank, m.step_count)

    def _on_sync_ack(self, rank: int, m: rec.SyncAck, now: float) -> None:
        cyc = self._closing if self._closing is not None and self._closing.round == m.round else self.cycle
        cause = "stale_round" if cyc is None else cyc.ack(rank, m)
        if cause is not None:
            self.ignored[cause] += 1

    def _on_snapshot_ready(self, rank: int, m: rec.SnapshotReady, now: float) -> None:
        # Its steps to its snapshot are counted (reported first): those past the trigger raise its bound (9.5),
        # and what it trained by then is in the round's consensus once that is published (`bank`).
        steps = self._steps.count[rank]
        if m.round == self.avg_count and self.cycle is None:  # published already: the notice came after
            self.dispatch.bank(rank, steps)
        elif m.round == self.round + (self.cycle is None):  # the open round's, or made ahead of its trigger
            self._ahead.snapped[rank] = (m.round, steps)
            if self.cycle is not None and steps > self.cycle.snapshot[rank]:
                self._outbox.emit(REDUCER, MassBound.for_window(m.round, self.window_steps, (rank,)))
        else:
            self.ignored["stale_round"] += 1

    def _on_exiting(self, rank: int, m: rec.Exiting, now: float) -> None:
        self._lose_rank(rank, failure=False, now=now)

    def _on_lr(self, rank: int, m: rec.LrUpdate, now: float) -> None:
        self.feedback.on_lr(rank, m.lr)

    def _on_callback_done(self, rank: int, m: Any, now: float) -> None:
        """A `CheckpointResult` or `EpochFnElapsed` (and every `EvalResult`)."""
        # Callback time is not training time, success or not.
        self.feedback.ledger.absorb_callback_cost(rank, m.elapsed_ms)
        retry = self.roles.on_result(rank, m, self.liveness.live_mask)
        if retry is not None:
            self._outbox.emit(retry.target_rank, retry)

    def _on_eval_result(self, rank: int, m: rec.EvalResult, now: float) -> None:
        self._on_callback_done(rank, m, now)
        samples = self.evals.answered(m.schedule_id, rank)
        if samples is None:  # a second answer, or one to a request never sent to it
            self.ignored["unasked_eval"] += 1
            return
        if m.error is None:
            self._outbox.to_live(rec.EvalBroadcast(epoch=m.epoch, metric=m.metric))
        self._outbox.emit(CONTROLLER, Evaluated(m, samples, self.evals.within_epoch(m.schedule_id)))
        if m.schedule_id == FINAL_EVAL_ID and self.phase is RunPhase.FINAL_EVAL_DISPATCHED:
            self._shutdown()

    def _on_metrics(self, rank: int, m: rec.EpochMetrics, now: float) -> None:
        if not self.dispatch.on_metrics(rank, m, self._steps.count[rank]):
            self.ignored["late_completion"] += 1
            return
        if self._ahead.chunk_done(rank, self.round + 1):
            self._throttled.add(rank)  # parked: it deposited at its chunk's end, unasked
        # `reports_per_epoch`: one `EpochProgress` per n-th of the epoch's batches crossed.
        progress = self._reports.add(m, self.last_aggregated)
        if progress is not None:
            self._outbox.emit(CONTROLLER, progress)
        self._send_plan(rank)

    _HANDLERS: dict[type, Callable[[Coordinator, int, Any, float], None]] = {
        rec.Batch: _on_batch,
        rec.Heartbeat: _on_heartbeat,
        rec.SyncAck: _on_sync_ack,
        rec.SnapshotReady: _on_snapshot_ready,
        rec.Exiting: _on_exiting,
        rec.LrUpdate: _on_lr,
        rec.EvalResult: _on_eval_result,
        rec.CheckpointResult: _on_callback_done,
        rec.EpochFnElapsed: _on_callback_done,
        rec.EpochMetrics: _on_metrics,
    }

    # ================================================================ the cycle

    def _advance(self, now: float) -> None:
        """Everything that follows from the current state, in upstream tick order."""
        if self._over:
            return
        if self.cycle is not None and self.cycle.reduced:
            self._release(now)
        if self._closing is not None and self._closing.settled(self.liveness.is_live):
            self._judge()
        if self.cycle is None:
            self._outbox.release_held()
        if self._in_flight is None and self.phase is RunPhase.TRAINING and gate_open(
            self.liveness.live, self._steps, self.dispatch, self._throttled, self.last_aggregated
        ):
            self._trigger(now)
        self._aggregate(now)
        if self._in_flight is None and self.phase is RunPhase.TRAINING and self._score_awaits_average():
            self._trigger(now)
        if self.cycle is None:
            if not self._steps.stepped(self.liveness.live):
                # Nothing stepped since the last consensus: it holds all reported work.
                self._consensus.holds_through(self.dispatch.done_through(self.last_aggregated))
            self._flush_callbacks()
        self._maybe_end(now)

    def _score_awaits_average(self) -> bool:
        """Async: a due eval or checkpoint opens its round at once (ranks train on through it), not a window later,
        nor in the run's last half window, which the final round takes whole. Per record: the sums come last."""
        if self.mode.barrier_paced or not self._steps.stepped(self.liveness.live) or self.dispatch.in_run_tail(
                self.last_aggregated, windows=0.5):
            return False
        first, done = self.callbacks.first_epoch(), self.dispatch.done_through(self.last_aggregated)
        return done > self.last_aggregated or (first is not None and first - 1 <= done) or (
            self.liveness.is_live(self.roles.eval)
            and self.evals.awaits_round(self.global_step + sum(self.window_steps)))

    def _trigger(self, now: float, final: bool = False) -> None:
        live = tuple(self.liveness.live)
        self.round += 1
        self.cycle = Cycle.open(self.round, now, live, self._steps, self.dispatch, self.last_aggregated)
        self._final_reduced = final
        self._outbox.emit(CONTROLLER, RoundOpened(self.round, live))
        self._outbox.emit(REDUCER, MassBound.for_window(self.round, self.window_steps, live))
        for r in live:
            if self.mode.hard_barrier:
                # Without it the fast rank laps the others during the round
                # trip and Sync loses its convergence parity. Sent first: a
                # rank that handled the request alone would train a step on
                # the replica it deposited, which the consensus erases.
                self._throttle(r)
            if r not in self._ahead.parked:
                self._outbox.emit(r, rec.RequestParams(round=self.round))
        self._ahead.clear()

    def _release(self, now: float) -> None:
        """The consensus is published: credit the window, calibrate, and send the next plans beside it."""
        cyc = self.cycle
        assert cyc is not None
        live = self.liveness.live_mask
        held = cyc.deposited if cyc.deposited is not None else {r for r in cyc.ranks if live[r]}
        deposits = {r: d[1] for r in held if (d := self._ahead.in_flight(r, cyc, self.avg_count)) and d[0] == cyc.round}
        for r, steps in deposits.items():  # what each trained by then is in it
            self.dispatch.bank(r, steps)
        moved = self._steps.credit([deposits.get(r, s) for r, s in enumerate(cyc.snapshot)], cyc.ranks)  # rounds.py
        self._settle(cyc.round)  # and what ranks that left took along goes back
        self._aggregate(now)  # the epochs it completes: their callbacks go out before the Updates
        cyc.coverage, cyc.last_aggregated = self.dispatch.coverage(), self.last_aggregated  # what it holds
        cyc.credited = [moved[r] for r in cyc.ranks if live[r]]
        self.feedback.calibrate(live, (now - cyc.started_at) * 1000.0)
        if self.elche.is_calibrated:
            self.roles.on_calibrated(self.feedback.smoothed_ms(), live)
        self.global_step += sum(moved[r] for r in cyc.ranks if r in held)  # a rank that left took its steps along
        self.avg_count += 1
        self._abandoned = 0
        whole = self.mode.hard_barrier or not self._steps.stepped(self.liveness.live)  # none trained past it
        self._consensus.adopt(cyc, self.dispatch.done_through(self.last_aggregated), whole)
        self._throttled.clear()
        self.cycle, self._closing = None, cyc
        # Before the Updates: the eval rank then scores exactly the consensus it loads
        # (a rank holds both until that load; a Sync rank is throttled, a Cadence rank idle, until then).
        self._flush_callbacks()
        whole = self._consensus.complete + 1  # epochs it holds; all of them: the final eval scores it
        if whole < self.config.num_epochs and self.liveness.is_live(self.roles.eval):
            for request in self.evals.at_finish(self.global_step, whole, self.roles.eval):
                self._outbox.emit(request.target_rank, request)
        # -- tail: next plans ride in the Update (atomic dispatch), beside the consensus
        self.dispatch.replan()
        for r in cyc.ranks:
            if live[r]:
                self._outbox.emit(r, rec.Update(round=cyc.round, next_plan=self._next_plan(r)))
        self._outbox.to_live(rec.SetGlobalStep(global_step=self.global_step))
        self._wake_idle()

    def _judge(self) -> None:
        """Every live rank acknowledged the released consensus: the guard judges its window."""
        cyc = self._closing
        assert cyc is not None
        self._closing = None
        self.feedback.judge([cyc.acks.get(r) for r in range(self.world_size)], cyc.credited)
        self._wake_idle()  # the verdict moves the budget (overshoot): a rank refused a chunk may now have one

    # ================================================================ dispatch

    def _held_at_barrier(self, rank: int) -> bool:
        """`rank` waits at the barrier for the cycle in flight, or parked by its deposit (Sync, Cadence; never
        Async): a rank that got data while its round was in flight would train it on the replica it deposited,
        and the consensus would overwrite those steps (under load a whole epoch was lost so)."""
        return self.mode.barrier_paced and (self.cycle is not None or rank in self._ahead.parked)

    def _next_plan(self, rank: int) -> rec.EpochPlan | None:
        """Take `rank`'s next chunk if it may have one now (live, training, not held); under Cadence
        one that fills the rank's window names the next round, its deposit at the chunk's end."""
        if not self.liveness.is_live(rank) or self.phase is not RunPhase.TRAINING or self._held_at_barrier(rank):
            return None  # a held rank's next plan rides in this cycle's Update
        window = self.window_steps[rank]
        plan = self.dispatch.next_plan(rank, window, self.feedback.overshoot, self.last_aggregated, self._now)
        if plan is None or not self.mode.deposits_unasked:
            return plan
        plan, bound = self._ahead.plan(rank, plan, window, self.dispatch, self.round + 1)
        if bound is not None:
            self._outbox.emit(REDUCER, bound)  # before the plan that tells it
        return plan

    def _send_plan(self, rank: int) -> None:
        plan = self._next_plan(rank)
        if plan is not None:
            self._outbox.emit(rank, rec.StartEpoch(plan=plan))

    def _wake_idle(self) -> None:
        """Dispatch to every live rank with nothing in flight (after reduces, deaths, epoch edges)."""
        for r in self.liveness.live:
            self._send_plan(r)

    def _open_epoch(self, epoch: int) -> None:
        self._send_data(self.dispatch.open_epoch(epoch, self._steps.count))
        self._wake_idle()

    def _send_data(self, sends: list[Send]) -> None:
        """Send data the strategy produced unasked, or hold it until after the Updates."""
        for rank, record in sends:
            if self._held_at_barrier(rank):
                self._outbox.hold(rank, record)
            else:
                self._outbox.emit(rank, record)

    # ================================================================ epochs

    def _aggregate(self, now: float) -> None:
        """Aggregate finished epochs in order; open the next epoch at each boundary."""
        while self.last_aggregated + 1 < self.config.num_epochs:
            epoch = self.last_aggregated + 1
            if not self.dispatch.epoch_done(epoch):
                return
            agg = self._reports.close(epoch, self.dispatch.close_epoch(epoch, now))
            self.last_aggregated = epoch
            self._outbox.to_live(agg)
            self._outbox.emit(CONTROLLER, agg)
            self._epoch_boundary(epoch + 1)

    def _epoch_boundary(self, epoch: int) -> None:
        """Entering `epoch`: its callbacks (held until the cycle is idle), then its data."""
        if epoch < self.config.num_epochs:
            self.callbacks.entering(epoch)
            self._open_epoch(epoch)

    def _flush_callbacks(self) -> None:
        """Eval and checkpoint calls whose epoch the last consensus holds whole (roles.py)."""
        for target, record in self.evals.one_per_consensus(
                self.callbacks.release(self._consensus.complete, self.roles), self.global_step, self._consensus.complete):
            if target is CONTROLLER or self.liveness.is_live(target):
                self._outbox.emit(target, self.evals.sent(record, self.global_step)
                                  if isinstance(record, rec.ExecuteEval) else record)

    def _announce_epoch_role(self) -> None:
        if self.roles.epoch_dirty:
            self.roles.epoch_dirty = False
            self._outbox.to_live(rec.SetEpochCallbackRole(rank=self.roles.epoch))

    def _maybe_end(self, now: float) -> None:
        if self.phase is RunPhase.FINAL_EVAL_DISPATCHED and not self.liveness.is_live(self._final_eval_rank):
            self._shutdown()  # the eval rank died: there is no result to wait for
            return
        if (self.phase is not RunPhase.TRAINING or self._in_flight is not None
                or self.dispatch.done_through(self.last_aggregated) + 1 < self.config.num_epochs):
            return
        if self.last_aggregated + 1 < self.config.num_epochs or (
                not self._final_reduced and self._steps.stepped(self.liveness.live)):
            # Every sample is trained: the edge of the last epoch can leave steps, and chunks, no average has seen.
            self._trigger(now, final=True)
            return
        eval_rank = self.roles.eval
        if self.config.final_eval and self.liveness.is_live(eval_rank):
            self.phase = RunPhase.FINAL_EVAL_DISPATCHED
            self._final_eval_rank = eval_rank
            self._outbox.emit(eval_rank, self.evals.final(eval_rank, self.global_step))
            return
        self._shutdown()

    def _shutdown(self) -> None:
        self.phase = RunPhase.SHUTDOWN_INITIATED
        self._outbox.to_live(rec.Shutdown())
        self._outbox.emit(CONTROLLER, RunEnded(None))

    # ================================================================ deaths

    def _lose_rank(self, rank: int, failure: bool, now: float) -> None:
        """`rank` left (a clean exit too, not counted as a failure): its roles move, the reducer stops
        waiting, its data is handed on; the run ends with a save if too many failed or nobody is left."""
        left = self.liveness.fail(rank) if failure else self.liveness.exit(rank)
        if not left:
            return
        self._throttled.discard(rank)
        if (deposit := self._ahead.in_flight(rank, self.cycle, self.avg_count)) is not None:
            self._unsettled[rank] = deposit[0]  # it may be in a coming consensus: settled at that round
        self._ahead.forget(rank)
        self.roles.on_death(rank, self.feedback.smoothed_ms(), self.liveness.live_mask)
        self.evals.on_death(rank)
        # The reducer must not wait for a deposit that will never come.
        self._outbox.emit(REDUCER, rec.DeclareDead(rank=rank))
        if failure:  # it may still run (expelled by its relay, back from a stall): it stops now, freeing its device
            self._outbox.emit(rank, rec.DeclareDead(rank=rank))
        # What it did not train goes to the survivors (Sync) or back to the pool.
        self._send_data(self.dispatch.on_death(rank, self._steps.count[rank], None if deposit is None else deposit[1]))
        reason = unrecoverable(self.liveness, self.config.max_failure)
        if reason is not None and self.phase is not RunPhase.SHUTDOWN_INITIATED:
            self._shutdown_with_save(reason)
            return
        if self.phase is RunPhase.TRAINING:
            self.dispatch.replan()  # the survivors' counts
            self._wake_idle()

    def _settle(self, round: int) -> None:
        """Round `round` is published or torn down: what ranks that left before it trained into no consensus."""
        for r in [r for r, rnd in self._unsettled.items() if rnd <= round]:
            del self._unsettled[r]
            self._send_data(self.dispatch.settle(r))

    def _shutdown_with_save(self, reason: ShutdownReason) -> None:
        if self.save_reason is not None:
            return
        self.save_reason = reason
        self._outbox.emit(CONTROLLER, SaveState(reason, self.state_dict()))
        self._outbox.to_live(rec.ShutdownWithSave(reason=reason.value))
        self._outbox.emit(CONTROLLER, RunEnded(reason))

    # ================================================================ helpers

    @property
    def _over(self) -> bool:
        return self.save_reason is not None or self.phase is RunPhase.SHUTDOWN_INITIATED

    @property
    def _in_flight(self) -> Cycle | None:
        """The cycle not yet over: pending its consensus, or released and awaiting its acks."""
        return self.cycle if self.cycle is not None else self._closing

    def _check_throttle(self) -> None:
        """Explicit lead cap (`max_batch_diff`), only while the whole world is alive."""
        diff = self.config.max_batch_diff
        if diff is not None and len(self.liveness.live) == self.world_size:
            for r in over_lead_cap(self.window_steps, diff):
                self._throttle(r)

    def _throttle(self, rank: int) -> None:
        """Park `rank` at the barrier until its Update (once per cycle)."""
        if rank not in self._throttled:
            self._throttled.add(rank)
            self._outbox.emit(rank, rec.Throttle())

    def _noticed_cycle(self, round: int, what: str, now: float) -> Cycle | None:
        """The cycle a reducer notice about `round` concerns; None (counted) if it is stale."""
        self._require_started(f"round {round} {what}")
        self._now = now
        cyc = self.cycle
        if self._over or cyc is None or cyc.round != round:
            if self._closing is None or self._closing.round != round:  # not released already, by an ack
                self.ignored["stale_reducer_notice"] += 1
            return None
        return cyc

    def _require_started(self, what: Any) -> None:
        if not self._started:
            raise CoordinatorError(
                f"coordinator received {type(what).__name__ if not isinstance(what, str) else what} "
                f"before start(): call start(now) once the world has formed"
            )
