"""Data dispatch strategies: how an epoch's samples reach the ranks.

The coordinator owns one `DispatchStrategy` for the run and drives it the
same way whatever the mode; the strategy decides what data exists and who
gets it, the coordinator decides when it may go out.

- `SyncPartitions` (Sync): at each epoch every live rank gets a whole
  contiguous partition (`StartEpoch`); a dead rank's remainder goes to the
  survivors (`ExtendPartition`). Every step closes a rank's window.
- `ChunkStream` (Cadence, Async): one `ChunkPool` per open epoch (see
  chunk_pool.py); a rank takes one chunk at a time, sized by
  `dispatch.chunk_batches`, and the next one rides in its `Update` or goes
  out as a `StartEpoch` when it asks.

Rules this module keeps:

- **Pure.** Inputs are records, step counts and the time, passed in; outputs
  are plans and `(rank, record)` pairs for the coordinator to send. It reads
  the coordinator's `Liveness` and `ElChe` but never changes them. No
  sockets, threads or clocks.
- **The coordinator owns the timing.** It asks for a rank's next plan only
  while the rank is live, the run is training and the rank is not held at a
  barrier; data a strategy produces unasked (Sync partitions and remainders)
  is held by the coordinator until the round in flight is over (a rank must
  not train new data on the replica it deposited). Each strategy calls
  `epoch_opened` before the first data of an epoch, so the epoch-callback
  role is announced first.
- **Nothing lost, nothing twice.** A Sync rank's remainder is exactly its
  plans after the samples it reported plus full batches for its steps since
  that a consensus holds (a span's short last batch is always followed by its
  report), handed on whole. A stream forfeits what no consensus holds of a
  dead rank's chunk (the first batches a deposit holds stay done) to its
  pool's reclaimed queue, where a survivor redoes it first; a completion of a
  chunk that was forfeited (`on_metrics` returns False) is ignored, since a
  survivor redoes it.
- **Done means in a consensus.** An epoch is done when every sample of it is
  reported trained (`done_through`: under Sync when every live rank reported
  all it was assigned, in a stream when its pool `is_done()`) and a published
  round holds it (`epoch_done`): a rank's work is in the consensus once a
  round holds its deposit of the steps it trained it in (`bank`), batch by
  batch (a deposit mid-chunk holds the chunk's first batches). A rank that
  leaves takes the rest along in its replica: it is handed on, its reports
  withdrawn (the stream reports what a consensus holds of a chunk), once the
  round of its last deposit says whether that holds it (`settle`).
- **A stream's epochs open in order and never reopen.** Lower epochs are
  served first, so work reclaimed from a dead rank is redone before anyone
  streams ahead; barrier-paced streams (Cadence) open an epoch only once its
  predecessor is aggregated, Async may run ahead. Reopening an aggregated
  epoch's pool would orphan it: nothing would aggregate it again and its data
  would train twice.
- **A chunk is trained whole.** A completion of another size means the rank
  and the controller disagree on the dataset or the batch size:
  `CoordinatorError`, before any state changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from flodl_zmq.coordinator import dispatch
from flodl_zmq.coordinator.chunk_pool import ChunkPool, Span
from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.elche import ElChe
from flodl_zmq.coordinator.liveness import Liveness
from flodl_zmq.coordinator.metrics import EpochReports
from flodl_zmq.errors import CoordinatorError
from flodl_zmq.wire import records as rec

Send = tuple[int, rec.StartEpoch | rec.ExtendPartition]
"""New data for a rank, which the coordinator sends (or holds) in order."""


class DispatchStrategy(Protocol):
    """What the coordinator's cycle asks of data dispatch (see the module docstring)."""

    def start(self, last_aggregated: int, now: float) -> None:
        """The world has formed: reopen what a resumed run had open."""

    def open_epoch(self, epoch: int, step_counts: Sequence[int]) -> list[Send]:
        """Entering `epoch` (at start and at each boundary): the data it hands out at once."""

    def next_plan(
        self, rank: int, window_steps: int, overshoot: int, last_aggregated: int, now: float
    ) -> rec.EpochPlan | None:
        """`rank`'s next chunk, taken now, if it may have one (it rides in a record to `rank`)."""

    def on_metrics(self, rank: int, m: rec.EpochMetrics, step_count: int) -> bool:
        """`rank` reported trained data; False if it is a late report to ignore."""

    def on_death(self, rank: int, step_count: int, deposit: int | None) -> list[Send]:
        """`rank` has left: what it did not train, and what it trained into no consensus, handed on. `deposit`:
        the steps of its deposit in a round not yet published, which may hold them (`bank` or `settle`)."""

    def bank(self, rank: int, step_count: int) -> None:
        """A published consensus holds `rank`'s deposit of its first `step_count` steps: what it trained
        by then is in the consensus (an epoch aggregates, and a checkpoint covers, only such work)."""

    def settle(self, rank: int) -> list[Send]:
        """`rank` left, and the round of its last deposit is published or torn down: what is still in no
        consensus of what it trained is handed on."""

    def window_full(self, rank: int, window_steps: int) -> bool:
        """Whether `rank` has done its share of the window (the averaging gate)."""

    def ends_window(self, rank: int, plan: rec.EpochPlan, window_steps: int) -> bool:
        """Whether `rank`, `window_steps` into its window once `plan` (just taken) is trained, can take no
        more work in this window, whatever the others do (that chunk may then carry its deposit)."""

    def quiesced(self, rank: int, last_aggregated: int) -> bool:
        """`rank` cannot step before the next reduce: nothing in flight and no work for it."""

    def in_run_tail(self, last_aggregated: int, windows: float = 1.0) -> bool:
        """Async: less than `windows` windows of the live counts are left to hand out in the whole run.
        In one, the window gate stays shut and the budget is lifted; in half of one, a due eval or
        checkpoint opens no round either: the final round takes that stretch whole, where a round
        would leave it a few steps of a rank or two (weighted by mass, close to one replica)."""

    def replan(self) -> None:
        """A window begins or the live set changed: redo what depends on them, before dispatch."""

    def epoch_done(self, epoch: int) -> bool:
        """Every sample of `epoch` is reported trained."""

    def close_epoch(self, epoch: int, now: float) -> float | None:
        """`epoch` is aggregated: drop its state; its wall time in ms if it was measured."""

    def done_through(self, last_aggregated: int) -> int:
        """The highest epoch whose every sample (and every earlier epoch's) is reported trained."""

    def coverage(self) -> dict[int, list[Span]]:
        """Done spans per open epoch: what a consensus triggered now holds (for a resume)."""


class SyncPartitions:
    """Sync: whole partitions per epoch, a dead rank's remainder to the survivors."""

    def __init__(
        self, config: CoordinatorConfig, liveness: Liveness, epoch_opened: Callable[[], None]
    ) -> None:
        n = liveness.world_size
        self._config = config
        self._liveness = liveness
        self._epoch_opened = epoch_opened
        self._epoch = -1
        self._plans: list[list[rec.EpochPlan]] = [[] for _ in range(n)]  # in training order
        self._assigned = [0] * n
        self._reported = [0] * n
        self._steps_at_report = [0] * n
        self._banked_step = [0] * n  # the steps of each rank's deposit in the last consensus that held one
        self._dead_steps: dict[int, int] = {}  # a rank that left with a deposit in flight -> its step count

    def start(self, last_aggregated: int, now: float) -> None:
        """Nothing to reopen: a resumed Sync run trains its epoch whole."""

    def open_epoch(self, epoch: int, step_counts: Sequence[int]) -> list[Send]:
        self._epoch_opened()
        live = self._liveness.live
        ratios = self._config.partition_ratios
        if ratios is not None:
            ratios = [ratios[r] for r in live]
        plans = dispatch.sync_plans(epoch, self._config.total_samples, len(live), ratios, self._config.batch_size)
        n = self._liveness.world_size
        self._epoch = epoch
        self._assigned = [0] * n
        self._reported = [0] * n
        self._plans = [[] for _ in range(n)]
        sends: list[Send] = []
        for r, plan in zip(live, plans, strict=True):
            self._plans[r] = [plan]
            self._assigned[r] = plan.size
            self._steps_at_report[r] = step_counts[r]
            sends.append((r, rec.StartEpoch(plan=plan)))
        return sends

    def next_plan(
        self, rank: int, window_steps: int, overshoot: int, last_aggregated: int, now: float
    ) -> rec.EpochPlan | None:
        """Never: a Sync rank already holds its whole partition."""
        return None

    def on_metrics(self, rank: int, m: rec.EpochMetrics, step_count: int) -> bool:
        if m.epoch != self._epoch:
            return False
        if self._reported[rank] + m.samples_processed > self._assigned[rank]:
            # A rank trains only what it was given: reports past it would only inflate the epoch's
            # per-rank sample counts, up to a sum no record can carry (PROTOCOL.md 3.3).
            raise CoordinatorError(
                f"rank {rank} reported {m.samples_processed} more samples of epoch {m.epoch} after "
                f"{self._reported[rank]}, beyond the {self._assigned[rank]} of its partition")
        self._reported[rank] += m.samples_processed
        self._steps_at_report[rank] = step_count
        return True

    def on_death(self, rank: int, step_count: int, deposit: int | None) -> list[Send]:
        """Its remainder, once the round of its deposit in flight, if any, says what it holds (`settle`)."""
        self._dead_steps[rank] = step_count
        return [] if deposit is not None else self.settle(rank)

    def settle(self, rank: int) -> list[Send]:
        # Reported samples are exact; only steps since the last report are full
        # batches (a span's short last batch is always followed by its report).
        # A step in no consensus (taken, not deposited) is not done: it left with the replica.
        banked = min(self._dead_steps.pop(rank), self._banked_step[rank])
        done = self._reported[rank] + max(0, banked - self._steps_at_report[rank]) * self._config.batch_size
        remainder = (
            dispatch.remainder_spans(self._plans[rank], done)
            if self._reported[rank] < self._assigned[rank]
            else []
        )
        self._assigned[rank] = self._reported[rank]
        sends: list[Send] = []
        for r, plan in dispatch.extend_partition_plans(self._epoch, remainder, self._liveness.live,
                                                           self._config.batch_size):
            self._plans[r].append(plan)
            self._assigned[r] += plan.size
            sends.append((r, rec.ExtendPartition(epoch=plan.epoch, offset=plan.offset, size=plan.size)))
        return sends

    def bank(self, rank: int, step_count: int) -> None:
        self._banked_step[rank] = max(self._banked_step[rank], step_count)

    def window_full(self, rank: int, window_steps: int) -> bool:
        """Sync averages as soon as the rank did one step."""
        return window_steps >= 1

    def ends_window(self, rank: int, plan: rec.EpochPlan, window_steps: int) -> bool:
        """A partition is not a window: Sync ranks deposit when asked, after every step."""
        return False

    def quiesced(self, rank: int, last_aggregated: int) -> bool:
        return self._reported[rank] >= self._assigned[rank]

    def in_run_tail(self, last_aggregated: int, windows: float = 1.0) -> bool:
        """Never: every Sync step is a round."""
        return False

    def replan(self) -> None:
        """Nothing to redo: partitions depend on neither."""

    def epoch_done(self, epoch: int) -> bool:
        return self._epoch == epoch and not self._dead_steps and all(
            self._reported[r] >= self._assigned[r] and self._banked_step[r] >= self._steps_at_report[r]
            for r in self._liveness.live
        )

    def close_epoch(self, epoch: int, now: float) -> float | None:
        """Nothing to drop (the next `open_epoch` resets the partitions); no epoch clock."""
        return None

    def done_through(self, last_aggregated: int) -> int:
        """The last aggregated epoch: a Sync epoch aggregates as soon as its last report lands."""
        return last_aggregated

    def coverage(self) -> dict[int, list[Span]]:
        """None kept: a resumed Sync run trains its epoch whole."""
        return {}


@dataclass(frozen=True)
class _Trained:
    """A chunk, or its first batches, a rank trained between its step counts `start` and `end`, with its report."""

    start: int
    end: int
    report: rec.EpochMetrics
    span: Span


class ChunkStream:
    """Cadence and Async: chunks streamed from one `ChunkPool` per open epoch.

    `barrier_paced` (Cadence) sizes one chunk per window, requires a rank's
    chunk to be complete before its window counts as full, pins each epoch's
    final window and never opens an epoch before its predecessor is
    aggregated; Async streams throughput-sized chunks ahead. `resumed` is a
    checkpoint's coverage, reopened at `start`.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        liveness: Liveness,
        elche: ElChe,
        epoch_opened: Callable[[], None],
        barrier_paced: bool,
        resumed: Mapping[int, list[Span]],
        reports: EpochReports,
    ) -> None:
        n = liveness.world_size
        self._reports = reports  # a redone chunk's report is withdrawn, its held part's credited: samples count once
        self._config = config
        self._liveness = liveness
        self._elche = elche
        self._epoch_opened = epoch_opened
        self._barrier_paced = barrier_paced
        self._resumed = dict(resumed)
        self._probe_batches = dispatch.probe_chunk_batches(
            config.total_samples, n, config.batch_size
        )
        self.pools: dict[int, ChunkPool] = {}
        self._opened_at: dict[int, float] = {}
        self._in_flight: list[int | None] = [None] * n  # epoch of the chunk in flight
        self._chunk_start = [0] * n  # each rank's step count when its chunk in flight began: its last one's end
        # Chunks done but not wholly in a published consensus yet, per rank. A rank that leaves takes what no
        # consensus holds of them along in its replica: that is redone.
        self._unbanked: list[list[_Trained]] = [[] for _ in range(n)]
        self._banked_step = [0] * n  # the steps of each rank's deposit in the last consensus that held one
        self._final: dict[int, dispatch.FinalWindowPlan] = {}
        # Batches each rank has taken of its final-window allocation: a take can
        # come back short (a span's residue is smaller), so one allocation may
        # need several chunks.
        self._final_taken: dict[int, list[int]] = {}

    def start(self, last_aggregated: int, now: float) -> None:
        cfg = self._config
        for epoch, covered in sorted(self._resumed.items()):
            pool = ChunkPool.from_coverage(
                epoch, cfg.total_samples, cfg.batch_size, self._liveness.world_size, covered
            )
            self._open(epoch, last_aggregated, now, pool)

    def open_epoch(self, epoch: int, step_counts: Sequence[int]) -> list[Send]:
        """Nothing at once: a pool opens when the first rank reaches its epoch."""
        return []

    def next_plan(
        self, rank: int, window_steps: int, overshoot: int, last_aggregated: int, now: float
    ) -> rec.EpochPlan | None:
        if self._in_flight[rank] is not None:
            return None
        counts = self._live_counts()
        pool = self._pool_with_work(rank)
        if pool is None:
            nxt = self._next_epoch(last_aggregated)
            if nxt is None:
                return None
            pool = self._open(nxt, last_aggregated, now)
        final = self._final.get(pool.epoch)
        tail = self.in_run_tail(last_aggregated)  # no round before the final one: no budget either
        if final is not None:
            # The pinned allocation bypasses the caps: it was sized so the
            # whole remainder lands in one window with no one-step rank.
            batches = final.alloc[rank] - self._final_taken[pool.epoch][rank]
        elif window_steps >= counts[rank] + overshoot and not tail:
            return None  # reduce barrier: wait for the average
        else:
            batches = dispatch.chunk_batches(
                rank,
                remaining_batches=pool.remaining() // self._config.batch_size,
                counts=counts,
                window_steps=0 if tail else window_steps,
                barrier_paced=self._barrier_paced,
                calibrated=self._elche.is_calibrated,
                probe_batches=self._probe_batches,
                min_chunk_batches=self._config.min_chunk_batches,
                overshoot=overshoot,
                final_window=None,
            )
        plan = pool.take(rank, batches * self._config.batch_size)
        if plan is None:
            return None
        self._in_flight[rank] = pool.epoch
        if final is not None:
            self._final_taken[pool.epoch][rank] += plan.size // self._config.batch_size
        return plan

    def on_metrics(self, rank: int, m: rec.EpochMetrics, step_count: int) -> bool:
        pool = self.pools.get(m.epoch)
        chunk = pool.in_flight(rank) if pool is not None else None
        if pool is None or chunk is None or self._in_flight[rank] != m.epoch:
            return False
        if m.samples_processed != chunk.size:
            raise CoordinatorError(
                f"rank {rank} reported {m.samples_processed} samples for its chunk "
                f"({chunk.offset}, {chunk.size}) of epoch {m.epoch}: a chunk is trained whole; "
                f"the rank and the controller disagree on the dataset or the batch size"
            )
        pool.complete(rank)
        self._in_flight[rank] = None
        start, self._chunk_start[rank] = self._chunk_start[rank], step_count
        if step_count > self._banked_step[rank]:
            self._unbanked[rank].append(_Trained(start, step_count, m, (chunk.offset, chunk.size)))
        return True

    def on_death(self, rank: int, step_count: int, deposit: int | None) -> list[Send]:
        """What a consensus holds of its chunks, or may (its deposit in flight: that round settles it), stays
        done; the rest goes to the reclaimed queue, to be redone first (`_cut`)."""
        kept = max(self._banked_step[rank], deposit or 0)
        epoch = self._in_flight[rank]
        chunk = None if epoch is None else self.pools[epoch].in_flight(rank)
        if chunk is not None:
            start = self._chunk_start[rank]
            n = self._held(start, kept, chunk.size)
            self.pools[chunk.epoch].forfeit(rank, kept=n)
            if n:  # its first batches, up to the deposit, and no report of theirs
                self._keep(rank, start, chunk.epoch, (chunk.offset, n))
        self._in_flight[rank] = None
        for u in [u for u in self._unbanked[rank] if u.end > kept]:
            self._cut(rank, u, kept)
        return []

    def bank(self, rank: int, step_count: int) -> None:
        self._banked_step[rank] = max(self._banked_step[rank], step_count)
        self._unbanked[rank] = [u for u in self._unbanked[rank] if u.end > step_count]

    def settle(self, rank: int) -> list[Send]:
        for u in list(self._unbanked[rank]):
            self._cut(rank, u, self._banked_step[rank])
        return []

    def _cut(self, rank: int, u: _Trained, steps: int) -> None:
        """Chunk `u` of `rank`, which left, past its step `steps`: redone first (reclaimed, its report withdrawn;
        its epoch stays open: `epoch_done`); the part up to it stays done, reported by us (`_keep`)."""
        n = self._held(u.start, steps, u.span[1])
        self._unbanked[rank].remove(u)
        self.pools[u.report.epoch].reclaim((u.span[0] + n, u.span[1] - n))
        self._reports.withdraw(u.report)
        if n:
            self._keep(rank, u.start, u.report.epoch, (u.span[0], n))

    def _keep(self, rank: int, start: int, epoch: int, span: Span) -> None:
        """`span`, the first batches of a chunk `rank` began at step `start` and left without a consensus holding
        it whole: a chunk of its own, done, reported by us in its epoch, and unbanked while no round holds it."""
        bs = self._config.batch_size
        report = rec.EpochMetrics(rank=rank, epoch=epoch, avg_loss=math.nan, batches_processed=span[1] // bs,
                                  samples_processed=span[1], epoch_ms=0.0, compute_only_ms=0.0, data_starve_ms=0.0,
                                  scalar_sums={}, scalar_counts={})  # no loss of theirs came: counted, not averaged
        self._reports.credit(report)
        if start + span[1] // bs > self._banked_step[rank]:
            self._unbanked[rank].append(_Trained(start, start + span[1] // bs, report, span))

    def _held(self, start: int, steps: int, size: int) -> int:
        """Samples of a chunk begun at step `start` that a deposit of step `steps` holds: its first batches."""
        return min(max(steps - start, 0) * self._config.batch_size, size)

    def window_full(self, rank: int, window_steps: int) -> bool:
        if window_steps < self._elche.batch_counts[rank]:
            return False
        # Cadence: the chunk must be complete too: its coverage then lands in
        # this consensus, and a final-window crumb is not left behind.
        return not self._barrier_paced or self._in_flight[rank] is None

    def ends_window(self, rank: int, plan: rec.EpochPlan, window_steps: int) -> bool:
        """Full, or the rest of the rank's allocation in its epoch's pinned final window (which bypasses
        the window, so a chunk short of it leaves the rank more to take: an epoch's tail crumb).

        The next epoch never feeds this window: a barrier-paced stream opens it once this one is
        aggregated, after the gate has triggered the round its last report completed.
        """
        final = self._final.get(plan.epoch)
        if final is not None:
            return self._final_taken[plan.epoch][rank] >= final.alloc[rank]
        return window_steps >= self._elche.batch_counts[rank]

    def quiesced(self, rank: int, last_aggregated: int) -> bool:
        return (
            self._in_flight[rank] is None
            and self._pool_with_work(rank) is None
            and self._next_epoch(last_aggregated) is None
        )

    def in_run_tail(self, last_aggregated: int, windows: float = 1.0) -> bool:
        if self._barrier_paced or self._next_epoch(last_aggregated) is not None:
            return False
        left = sum(p.remaining() // self._config.batch_size for p in self.pools.values())
        return left < windows * sum(self._live_counts())

    def replan(self) -> None:
        """Cadence: pin each open epoch's final window if its remainder fits one window."""
        if self._barrier_paced:
            for epoch in self.pools:
                self._pin_final(epoch)

    def epoch_done(self, epoch: int) -> bool:
        pool = self.pools.get(epoch)
        return pool is not None and pool.is_done() and not any(
            u.report.epoch == epoch for chunks in self._unbanked for u in chunks)

    def close_epoch(self, epoch: int, now: float) -> float | None:
        del self.pools[epoch]
        self._final.pop(epoch, None)
        self._final_taken.pop(epoch, None)
        return (now - self._opened_at.pop(epoch)) * 1000.0

    def done_through(self, last_aggregated: int) -> int:
        epoch = last_aggregated + 1
        while epoch in self.pools and self.pools[epoch].is_done():
            epoch += 1
        return epoch - 1

    def coverage(self) -> dict[int, list[Span]]:
        """Each open epoch's samples a published consensus holds: done chunks less what of them no deposit in
        one holds, and the first batches of chunks in flight that one does (a rank deposits mid-chunk)."""
        excluding: dict[int, list[Span]] = {}
        held: dict[int, list[Span]] = {}
        for rank, chunks in enumerate(self._unbanked):
            for u in chunks:
                n = self._held(u.start, self._banked_step[rank], u.span[1])
                excluding.setdefault(u.report.epoch, []).append((u.span[0] + n, u.span[1] - n))
        for rank, epoch in enumerate(self._in_flight):
            chunk = None if epoch is None else self.pools[epoch].in_flight(rank)
            if chunk is not None:
                held.setdefault(chunk.epoch, []).append(
                    (chunk.offset, self._held(self._chunk_start[rank], self._banked_step[rank], chunk.size)))
        return {e: p.covered(excluding.get(e, ()), held.get(e, ())) for e, p in self.pools.items()}

    # ---------------------------------------------------------------- helpers

    def _open(
        self, epoch: int, last_aggregated: int, now: float, pool: ChunkPool | None = None
    ) -> ChunkPool:
        if epoch <= last_aggregated:
            raise CoordinatorError(f"epoch {epoch} is already aggregated; its pool cannot reopen")
        if pool is None:
            counts = self._elche.batch_counts
            live = self._liveness.live_mask
            calibrated = self._elche.is_calibrated
            shares = [(counts[r] if calibrated else 1) if live[r] else 0 for r in range(len(live))]
            pool = ChunkPool(epoch, self._config.total_samples, self._config.batch_size, shares)
        self.pools[epoch] = pool
        self._opened_at[epoch] = now
        self._epoch_opened()
        if self._barrier_paced:
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

    def _pool_has_work(self, rank: int, pool: ChunkPool) -> bool:
        if pool.remaining() < self._config.batch_size:
            return False
        plan = self._final.get(pool.epoch)
        return plan is None or self._final_taken[pool.epoch][rank] < plan.alloc[rank]

    def _next_epoch(self, last_aggregated: int) -> int | None:
        """The epoch a rank may stream into next, if any.

        Barrier-paced streams never cross into an epoch whose predecessor is
        not aggregated; Async may run ahead.
        """
        nxt = max(self.pools, default=last_aggregated) + 1
        if nxt >= self._config.num_epochs:
            return None
        if self._barrier_paced and nxt != last_aggregated + 1:
            return None
        return nxt

    def _pin_final(self, epoch: int) -> None:
        """At a window start: plan the epoch's final window if its remainder fits one window."""
        pool = self.pools[epoch]
        plan = dispatch.refresh_final_window_plan(
            None,
            epoch=epoch,
            remaining_batches=pool.remaining() // self._config.batch_size,
            counts=self._live_counts(),
            alive=self._liveness.live_mask,
            whole_epoch=pool.remaining() == pool.size,
        )
        if plan is None:
            self._final.pop(epoch, None)
        else:
            self._final[epoch] = plan
        self._final_taken[epoch] = [0] * self._liveness.world_size

    def _live_counts(self) -> list[int]:
        live = self._liveness.live_mask
        return [c if live[r] else 0 for r, c in enumerate(self._elche.batch_counts)]


def strategy_for(
    config: CoordinatorConfig,
    liveness: Liveness,
    elche: ElChe,
    epoch_opened: Callable[[], None],
    resumed: Mapping[int, list[Span]],
    reports: EpochReports,
) -> DispatchStrategy:
    """The mode's strategy: a chunk stream (Cadence, Async) or partitions (Sync)."""
    if config.mode.progressive:
        return ChunkStream(config, liveness, elche, epoch_opened, config.mode.barrier_paced, resumed, reports)
    return SyncPartitions(config, liveness, epoch_opened)
