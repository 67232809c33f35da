"""A deterministic discrete-event simulator that drives the real `Coordinator`.

Simulated ranks train at given speeds, deposit parameters, load consensus,
heartbeat, die, hang, and see their messages delayed or lost; a simulated
reducer folds deposits and honours `DeclareDead`. Time is virtual, so
hundreds of epochs run in seconds, and the same seed replays the same run.

Rules this module keeps:

- The coordinator under test is the production object, fed through its
  public inputs only (`start`, `on_record`, `on_tick`, `on_rank_death`,
  `on_round_complete`, `on_send_failed`); nothing reaches into its state.
- Simulated ranks follow the rank side of the protocol as the coordinator
  expects it: one chunk in flight; a Sync partition is one flat list of
  samples batched across `ExtendPartition` seams, reported when it runs dry
  (only its last batch may be short); `RequestParams` is served at the next batch
  boundary, or at once when idle or throttled, unless the rank already
  deposited in that round; a chunk that names a round (`EpochPlan.deposit`)
  is deposited at its end, before its report; an `Update` is applied once
  its round's consensus is loaded; a `Throttle` holds the rank until the
  next `Update`; `step_count` counts steps since the process started.
- The simulated reducer knows what the real one knows: it learns a round
  from its first deposit, waits for every rank not declared dead, publishes
  a round told ahead only once the trigger's `MassBound` opened it, drops
  deposits from dead ranks and for rounds it has published, and ignores the
  coordinator's `RoundOpened` (a controller notice).
- Per-link message order is preserved (constant latency), like a ZeroMQ
  connection; a loss model may drop chosen record kinds, as a dying link
  would. A send-failure model makes chosen coordinator -> rank sends fail
  the way a ROUTER reports an unreachable peer: the service learns it at
  once (`on_send_failed`, whose outputs go out after the rest of the batch,
  as the coordinator's contract asks), and the link is cut: the rank stops,
  every later send to it fails too, and its records still on the wire are
  lost.
- A sample counts as trained when the coordinator receives the report of
  it (the chunk's `EpochMetrics`, or under Sync the step's `Batch`); work
  whose report is lost with a cut link never reaches a consensus, and the
  coordinator hands it to a survivor. A sample is in the consensus once a
  round publishes a deposit of a replica that trained it (a rank's replica
  holds all it trained since the last consensus it was in), whatever the
  coordinator believes: a rank that dies takes the rest with it.
- Everything measured is what a rank experienced: which samples it
  completed, how long it sat idle waiting for the others (barrier wait) and
  for the round trip (sync wait) in each window, and how many data records
  (`StartEpoch`, `ExtendPartition`) reached it between its deposit and that
  round's consensus: a real rank that trained them then would see the
  consensus overwrite those steps.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.core import Coordinator
from flodl_zmq.coordinator.outputs import (
    CONTROLLER,
    REDUCER,
    MassBound,
    Out,
    RunEnded,
    SaveState,
)
from flodl_zmq.wire import records as rec


@dataclass(frozen=True)
class RankSpec:
    """One simulated rank: its speed, and how (if at all) it fails.

    `die_at`: the process exits at that virtual time; its agent reports the
    exit `agent_delay_s` later when `reported` is true. `hang_at`: the
    process freezes (no records at all, no report): only heartbeat staleness
    can find it.
    """

    ms_per_batch: float
    die_at: float | None = None
    reported: bool = True
    hang_at: float | None = None


@dataclass(frozen=True)
class SimConfig:
    latency_s: float = 0.0005  # one way, every link
    upload_s: float = 0.002  # a deposit's transfer to the reducer
    reduce_s: float = 0.001  # sum, divide, publish
    jitter: float = 0.05  # +-fraction of a batch's time, uniform
    data_ms: float = 0.0  # data loading per batch
    agent_delay_s: float = 0.01  # agent's death report
    tick_s: float = 0.05  # coordinator tick period
    heartbeat_s: float = 1.0
    callback_ms: float = 5.0  # simulated eval / checkpoint / epoch_fn cost
    loss: dict[type, float] = field(default_factory=dict)  # record type -> drop probability
    send_fail: dict[type, float] = field(default_factory=dict)  # record type -> send-failure probability
    seed: int = 0
    max_time_s: float = 36_000.0


@dataclass
class Window:
    """One rank's window, between two Updates it received."""

    length_s: float
    barrier_wait_s: float  # idle, waiting for the others to reach the reduce
    sync_wait_s: float  # idle, waiting for the round trip


@dataclass
class SimResult:
    coordinator: Coordinator
    end_time: float
    ended: RunEnded | None
    saved: SaveState | None
    aggregated: list[rec.EpochAggregated]
    completed: dict[int, list[tuple[int, int, int]]]  # epoch -> [(offset, size, rank)]: reported trained
    in_consensus: dict[int, list[tuple[int, int, int]]]  # the same, of what published consensus holds
    windows: list[list[Window]]
    batches: list[int]
    events: int
    deaths_seen: list[tuple[float, int]]  # (time, rank) the coordinator declared gone
    outputs: list[tuple[float, Out]]  # every coordinator output, in order
    cut: list[tuple[float, int]]  # (time, rank) a failed send cut the rank's link
    data_mid_round: list[int]  # per rank: data records received between deposit and consensus


class _Rank:
    def __init__(self, sim: Simulation, rank: int, spec: RankSpec) -> None:
        self.sim = sim
        self.rank = rank
        self.spec = spec
        self.alive = True
        self.cut = False  # the link failed a send: nothing gets through either way any more
        self.steps = 0
        self.busy = False
        self.throttled = False
        self.request: int | None = None
        self.deposited: int | None = None  # the round deposited, consensus not yet received
        self.last_deposit = 0  # the highest round deposited in
        self.held: list[Any] = []  # an Update awaiting its round's consensus, and what came after it
        # Progressive: the current chunk (epoch, offset, size, done, deposit round or 0); Sync: a flat sample list.
        self.chunk: list[int] | None = None
        self.queue: list[rec.EpochPlan] = []
        self.unpublished: list[tuple[int, int, int]] = []  # (epoch, offset, size) trained into no consensus yet
        self.deposits: dict[int, int] = {}  # round -> how many of `unpublished` its deposit holds
        self.sync_epoch = -1
        self.sync_samples: list[tuple[int, int]] = []  # (epoch, offset) not yet trained
        self.sync_done = 0  # samples since the last EpochMetrics
        self.idle_since: float | None = 0.0
        self.window_start = 0.0
        self.barrier = 0.0
        self.syncw = 0.0
        self.requested_this_window = False
        self.batches = 0

    # ---------------------------------------------------------------- inbound

    def receive(self, t: float, r: Any) -> None:
        if not self.alive:
            return
        if self.held or (isinstance(r, rec.Update) and self.deposited is not None):
            self.held.append(r)  # beside the consensus: it, and what follows it, once that is loaded
            return
        if isinstance(r, (rec.StartEpoch, rec.ExtendPartition)) and self.deposited is not None:
            self.sim.data_mid_round[self.rank] += 1
        if isinstance(r, rec.StartEpoch):
            self._enqueue(r.plan)
        elif isinstance(r, rec.ExtendPartition):
            self.sync_samples.extend((r.epoch, o) for o in range(r.offset, r.offset + r.size))
        elif isinstance(r, rec.RequestParams):
            if r.round > self.last_deposit:  # not deposited ahead already
                self.request = r.round
            self._account(t)
            self.requested_this_window = True
        elif isinstance(r, rec.Throttle):
            self.throttled = True
        elif isinstance(r, rec.Update):
            self.throttled = False
            self._account(t)
            self.sim.windows[self.rank].append(
                Window(t - self.window_start, self.barrier, self.syncw)
            )
            self.window_start, self.barrier, self.syncw = t, 0.0, 0.0
            self.requested_this_window = False
            if r.next_plan is not None:
                self._enqueue(r.next_plan)
        elif isinstance(r, (rec.Shutdown, rec.ShutdownWithSave)):
            self.sim.send(t, self.rank, rec.Exiting(rank=self.rank))
            self.alive = False
            return
        elif isinstance(r, rec.Checkpoint):
            self.sim.send(t + self.sim.cfg.callback_ms / 1000, self.rank, rec.CheckpointResult(
                rank=self.rank, version=r.version, elapsed_ms=self.sim.cfg.callback_ms, error=None))
        elif isinstance(r, rec.ExecuteEval):
            self.sim.send(t + self.sim.cfg.callback_ms / 1000, self.rank, rec.EvalResult(
                rank=self.rank, schedule_id=r.schedule_id, epoch=r.epoch, metric=0.9,
                elapsed_ms=self.sim.cfg.callback_ms, error=None))
        self._work(t)

    def consensus(self, t: float, round: int) -> None:
        if self.deposited == round:
            self.deposited = None
        if self.alive:
            self.sim.send(t, self.rank, rec.SyncAck(
                rank=self.rank, round=round, step_count=0, divergence=0.01, post_norm=1.0,
                pre_norm=1.0))
            held, self.held = self.held, []
            for r in held:
                self.receive(t, r)

    # ---------------------------------------------------------------- training

    def _enqueue(self, plan: rec.EpochPlan) -> None:
        if self.sim.coord.mode.progressive:
            self.queue.append(plan)
        else:
            self.sync_epoch = plan.epoch
            self.sync_done = 0
            self.sync_samples.extend((plan.epoch, o) for o in range(plan.offset, plan.offset + plan.size))

    def _snapshot(self, t: float) -> None:
        rnd, self.request = self.request, None
        self.deposited = self.last_deposit = rnd
        self.deposits[rnd] = len(self.unpublished)  # the replica: all it trained since the last consensus it is in
        self.sim.send(t, self.rank, rec.SnapshotReady(rank=self.rank, round=rnd))
        self.sim.at(t + self.sim.cfg.upload_s, lambda t2: self.sim.deposit(t2, self.rank, rnd))

    def _work(self, t: float) -> None:
        if not self.alive or self.busy:
            return
        if self.request is not None:
            self._snapshot(t)
        if self.throttled:
            self._go_idle(t)
            return
        if self.chunk is None and self.queue:
            p = self.queue.pop(0)
            self.chunk = [p.epoch, p.offset, p.size, 0, p.deposit or 0]
        has_work = self.chunk is not None or bool(self.sync_samples)
        if not has_work:
            self._go_idle(t)
            return
        self._account(t)
        self.idle_since = None
        self.busy = True
        ms = self.spec.ms_per_batch * (1 + self.sim.rng.uniform(-1, 1) * self.sim.cfg.jitter)
        self.sim.at(t + (ms + self.sim.cfg.data_ms) / 1000, lambda t2: self._batch_done(t2, ms))

    def _batch_done(self, t: float, ms: float) -> None:
        if not self.alive:
            return
        self.busy = False
        self.steps += 1
        self.batches += 1
        bs = self.sim.coord.config.batch_size
        batch = rec.Batch(rank=self.rank, step_count=self.steps, batch_ms=[ms], data_ms=[self.sim.cfg.data_ms],
                          batch_loss=[1.0])
        if self.chunk is not None:
            self.sim.send(t, self.rank, batch)
            epoch, offset, size, done, deposit = self.chunk
            self.unpublished.append((epoch, offset + done, bs))  # in the replica from its step on, a deposit too
            self.chunk[3] = done = done + bs
            if done >= size:
                self.chunk = None
                if deposit > self.last_deposit:  # told ahead: its window ends here
                    self.request = deposit
                    self._snapshot(t)
                self.sim.send(t, self.rank, self._metrics(epoch, size // bs, size),
                              trained=[(epoch, offset, size)])
        else:
            taken, self.sync_samples = self.sync_samples[:bs], self.sync_samples[bs:]
            self.unpublished += [(epoch, off, 1) for epoch, off in taken]
            self.sim.send(t, self.rank, batch, trained=[(epoch, off, 1) for epoch, off in taken])
            self.sync_done += len(taken)
            if not self.sync_samples:
                self.sim.send(t, self.rank, self._metrics(self.sync_epoch, -(-self.sync_done // bs),
                                                          self.sync_done))
                self.sync_done = 0
        self._work(t)

    def _metrics(self, epoch: int, batches: int, samples: int) -> rec.EpochMetrics:
        return rec.EpochMetrics(
            rank=self.rank, epoch=epoch, avg_loss=1.0, batches_processed=batches,
            samples_processed=samples, epoch_ms=batches * self.spec.ms_per_batch,
            compute_only_ms=batches * self.spec.ms_per_batch, data_starve_ms=0.0,
            scalar_sums={}, scalar_counts={})

    def _go_idle(self, t: float) -> None:
        if self.idle_since is None:
            self.idle_since = t

    def _account(self, t: float) -> None:
        """Book the idle time up to `t`: barrier wait before the round's trigger, sync wait after."""
        if self.idle_since is None:
            return
        if self.requested_this_window:
            self.syncw += t - self.idle_since
        else:
            self.barrier += t - self.idle_since
        self.idle_since = t

    def heartbeat(self, t: float) -> None:
        if self.alive:
            self.sim.send(t, self.rank, rec.Heartbeat(rank=self.rank, step_count=self.steps))
            self.sim.at(t + self.sim.cfg.heartbeat_s, self.heartbeat)


class Simulation:
    """One simulated run. `run()` returns a `SimResult`; see the module docstring."""

    def __init__(self, config: CoordinatorConfig, ranks: list[RankSpec], sim: SimConfig | None = None,
                 resume: dict[str, Any] | None = None) -> None:
        self.cfg = sim or SimConfig()
        self.rng = random.Random(self.cfg.seed)
        self.coord = Coordinator(config, len(ranks), 0.0, resume=resume)
        self.ranks = [_Rank(self, r, spec) for r, spec in enumerate(ranks)]
        self.windows: list[list[Window]] = [[] for _ in ranks]
        self.data_mid_round = [0] * len(ranks)
        self.completed: dict[int, list[tuple[int, int, int]]] = {}
        self.in_consensus: dict[int, list[tuple[int, int, int]]] = {}
        self.aggregated: list[rec.EpochAggregated] = []
        self.ended: RunEnded | None = None
        self.saved: SaveState | None = None
        self.deaths_seen: list[tuple[float, int]] = []
        self.cut: list[tuple[float, int]] = []
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        self._rounds: dict[int, set[int]] = {}  # open round -> ranks that deposited
        self._unopened: set[int] = set()  # rounds told ahead, not yet opened by their trigger
        self._published = 0  # the last round the reducer published
        self._reducer_dead: set[int] = set()
        self.events = 0
        self.outputs: list[tuple[float, Out]] = []

    # ---------------------------------------------------------------- plumbing

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn))

    def send(self, t: float, rank: int, record: Any,
             trained: list[tuple[int, int, int]] | None = None) -> None:
        """Rank -> coordinator, after the link latency (or lost); `trained`: (epoch, offset, size)."""
        if self._lost(record):
            self._trained(rank, trained)  # trained all the same; only the report is lost
            return

        def deliver(t2: float) -> None:
            if self.ranks[rank].cut:
                return  # the link went down with this record on it
            self._trained(rank, trained)
            self._apply(t2, self.coord.on_record(rank, record, t2))

        self.at(t + self.cfg.latency_s, deliver)

    def _trained(self, rank: int, trained: list[tuple[int, int, int]] | None) -> None:
        for epoch, offset, size in trained or ():
            self.completed.setdefault(epoch, []).append((offset, size, rank))

    def _lost(self, record: Any) -> bool:
        p = self.cfg.loss.get(type(record), 0.0)
        return p > 0 and self.rng.random() < p

    def _apply(self, t: float, outs: list[Out]) -> None:
        after: list[Out] = []  # what failed sends produced: sent after the rest of `outs`
        for out in outs:
            self.outputs.append((t, out))
            r = out.record
            if out.dest is REDUCER:
                self._reducer(t, r)
            elif out.dest is CONTROLLER:
                if isinstance(r, rec.EpochAggregated):
                    self.aggregated.append(r)
                elif isinstance(r, SaveState):
                    self.saved = r
                elif isinstance(r, RunEnded):
                    self.ended = r
            elif self._send_fails(out.dest, r):
                if not self.ranks[out.dest].cut:
                    self.cut.append((t, out.dest))
                self.ranks[out.dest].alive = False
                self.ranks[out.dest].cut = True
                after += self.coord.on_send_failed(out.dest, r, t)
            elif not self._lost(r):
                rank = self.ranks[out.dest]
                self.at(t + self.cfg.latency_s, lambda t2, rank=rank, r=r: rank.receive(t2, r))
        if after:
            self._apply(t, after)

    def _send_fails(self, rank: int, record: Any) -> bool:
        if self.ranks[rank].cut:
            return True
        p = self.cfg.send_fail.get(type(record), 0.0)
        return p > 0 and self.rng.random() < p

    # ---------------------------------------------------------------- reducer

    def _reducer(self, t: float, r: Any) -> None:
        if isinstance(r, MassBound) and not r.opens:
            self._unopened.add(r.round)
        elif isinstance(r, MassBound) and r.round in self._unopened:
            self._unopened.discard(r.round)
            if r.round in self._rounds:
                self._check_round(t, r.round)
        elif isinstance(r, rec.DeclareDead):
            self._reducer_dead.add(r.rank)
            self.deaths_seen.append((t, r.rank))
            for rnd in list(self._rounds):
                self._check_round(t, rnd)

    def deposit(self, t: float, rank: int, rnd: int) -> None:
        if not self.ranks[rank].alive or rank in self._reducer_dead or rnd <= self._published:
            return
        self._rounds.setdefault(rnd, set()).add(rank)
        self._check_round(t, rnd)

    def _check_round(self, t: float, rnd: int) -> None:
        got = self._rounds[rnd]
        if rnd not in self._unopened and set(range(len(self.ranks))) - self._reducer_dead <= got:
            del self._rounds[rnd]
            self._published = rnd
            members = sorted(got - self._reducer_dead)
            self.at(t + self.cfg.reduce_s, lambda t2: self._publish(t2, rnd, members))

    def _publish(self, t: float, rnd: int, members: list[int]) -> None:
        for r in members:
            rank = self.ranks[r]
            n = rank.deposits.pop(rnd, 0)
            for epoch, offset, size in rank.unpublished[:n]:
                self.in_consensus.setdefault(epoch, []).append((offset, size, r))
            rank.unpublished = rank.unpublished[n:]
        self._apply(t, self.coord.on_round_complete(rnd, t, members))
        for r in members:
            rank = self.ranks[r]
            self.at(t + self.cfg.latency_s, lambda t2, rank=rank: rank.consensus(t2, rnd))

    # ---------------------------------------------------------------- run

    def _tick(self, t: float) -> None:
        self._apply(t, self.coord.on_tick(t))
        if not self.coord.finished:
            self.at(t + self.cfg.tick_s, self._tick)

    def _fail(self, t: float, rank: _Rank, reported: bool) -> None:
        rank.alive = False
        if reported:
            self.at(t + self.cfg.agent_delay_s,
                    lambda t2: self._apply(t2, self.coord.on_rank_death(rank.rank, "exit", t2)))

    def run(self) -> SimResult:
        self._apply(0.0, self.coord.start(0.0))
        self.at(self.cfg.tick_s, self._tick)
        for rank in self.ranks:
            self.at(self.cfg.heartbeat_s * (0.5 + 0.1 * rank.rank), rank.heartbeat)
            if rank.spec.die_at is not None:
                self.at(rank.spec.die_at,
                        lambda t, rank=rank: self._fail(t, rank, rank.spec.reported))
            if rank.spec.hang_at is not None:
                self.at(rank.spec.hang_at, lambda t, rank=rank: self._fail(t, rank, False))
        t = 0.0
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            if t > self.cfg.max_time_s:
                break
            fn(t)
            self.events += 1
            if self.coord.finished and not any(r.alive for r in self.ranks):
                break
        return SimResult(
            coordinator=self.coord, end_time=t, ended=self.ended, saved=self.saved,
            aggregated=self.aggregated, completed=self.completed, in_consensus=self.in_consensus,
            windows=self.windows,
            batches=[r.batches for r in self.ranks], events=self.events,
            deaths_seen=self.deaths_seen, outputs=self.outputs, cut=self.cut,
            data_mid_round=self.data_mid_round)
