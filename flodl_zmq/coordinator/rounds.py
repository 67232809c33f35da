"""The averaging round's bookkeeping: step counters, the cycle in flight, the gate, the consensus.

`Coordinator` (core.py) decides when a round opens and what goes out; this
module keeps the counts it decides on.

Rules this module keeps:

- **Steps are counted from the rank's own counter.** A rank's `step_count`
  (in `Batch` and `Heartbeat`) is monotonic since the process started, so a
  window is the counter minus its value at the last finished reduce, and a
  lost or reordered record can neither wedge the gate nor roll it back.
- **Only deposited steps are credited.** A cycle snapshots every counter at
  its trigger; at the finish a rank's base moves to its deposit (its count
  when its `SnapshotReady` came, which a rank sends after reporting every step
  before it; the trigger's count without one), so steps taken after its
  deposit count towards the next window.
- **The gate counts steps, never wall time** (a time-based gate deadlocked
  upstream: its target depended on samples that only land when it fires).
- **A deposit told ahead parks its rank.** Under Cadence a chunk that fills
  its rank's window names the next round (`EpochPlan.deposit`), and the rank
  deposits when it has trained it, unasked: no request crosses the relays
  after the window. Once that chunk is reported done the rank has deposited:
  it is parked at the barrier (it counts at the gate and gets no data) until
  the round is released, and the trigger asks it for nothing; a rank told
  but not parked at the trigger is asked, and the request supersedes what
  it was told (`DepositsAhead`).
- **The consensus record only grows.** What the last finished consensus holds
  (coverage, aggregated epochs, complete epochs) is the resume point and the
  bar an epoch's eval or checkpoint waits for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from flodl_zmq.coordinator.chunk_pool import Span
from flodl_zmq.coordinator.convergence import DivergenceSample
from flodl_zmq.coordinator.outputs import MassBound
from flodl_zmq.coordinator.strategy import DispatchStrategy
from flodl_zmq.wire import records as rec


class StepCounters:
    """Each rank's monotonic step counter, and its value at the last finished reduce."""

    def __init__(self, world_size: int) -> None:
        self.count = [0] * world_size
        self.base = [0] * world_size

    def saw(self, rank: int, step_count: int) -> None:
        # Monotonic: a reordered heartbeat must not roll the counter back.
        if step_count > self.count[rank]:
            self.count[rank] = step_count

    def window(self) -> list[int]:
        """Each rank's steps since the last finished reduce."""
        return [c - b for c, b in zip(self.count, self.base, strict=True)]

    def stepped(self, ranks: Iterable[int]) -> bool:
        """Whether any of `ranks` stepped since the last finished reduce."""
        return any(self.count[r] != self.base[r] for r in ranks)

    def credit(self, snapshot: list[int], ranks: Iterable[int]) -> list[int]:
        """Move `ranks`' bases to `snapshot`; each rank's snapshotted steps, as they were before."""
        moved = [s - b for s, b in zip(snapshot, self.base, strict=True)]
        for r in ranks:
            self.base[r] = snapshot[r]
        return moved


@dataclass
class Cycle:
    """The averaging cycle in flight (Pending)."""

    round: int
    started_at: float
    ranks: tuple[int, ...]
    snapshot: list[int]  # each rank's step counter at the trigger
    coverage: dict[int, list[Span]]  # what its consensus holds of the open epochs, set at its release
    last_aggregated: int  # every epoch up to it is in its consensus (at the trigger; at the release, once banked)
    done_through: int  # every sample of epochs <= this was reported trained at the trigger
    reduced: bool = False
    acks: dict[int, DivergenceSample | None] = field(default_factory=dict)
    credited: list[int] = field(default_factory=list)  # each live rank's steps in it, set at its release
    deposited: frozenset[int] | None = None  # the ranks whose deposits the reducer published (None: the live)

    @classmethod
    def open(
        cls,
        round: int,
        now: float,
        ranks: tuple[int, ...],
        steps: StepCounters,
        dispatch: DispatchStrategy,
        last_aggregated: int,
    ) -> Cycle:
        """Round `round`, triggered at `now` for `ranks`: every counter and the coverage as of now."""
        return cls(
            round=round,
            started_at=now,
            ranks=ranks,
            snapshot=list(steps.count),
            coverage={},  # what it holds is known at its release (`bank`)
            last_aggregated=last_aggregated,
            done_through=dispatch.done_through(last_aggregated),
        )

    def ack(self, rank: int, m: rec.SyncAck) -> str | None:
        """Take `rank`'s ack; the cause to count it under if it is ignored."""
        # The ack's step_count is deliberately ignored: CPU acks carry none
        # that means anything, and folding one in once wedged the gate upstream.
        if m.round != self.round or rank not in self.ranks:
            return "stale_round"
        if rank in self.acks:
            return "duplicate_ack"
        self.reduced = True  # an ack proves the consensus was published
        sample = None
        if m.divergence is not None and math.isfinite(m.divergence):
            sample = DivergenceSample(m.divergence, m.post_norm, m.pre_norm)
        self.acks[rank] = sample
        return None

    def stalled(self, now: float, limit_s: float) -> bool:
        """In flight longer than `limit_s` (`reduce_stall_s`): a wedge, if its ranks stay alive."""
        return now - self.started_at > limit_s

    def stall_due(self, limit_s: float) -> float:
        """The first time at which `stalled` holds, for a service that sleeps until then."""
        return math.nextafter(self.started_at + limit_s, math.inf)

    def settled(self, is_live: Callable[[int], bool]) -> bool:
        """The consensus is published and every live rank of the round has acked it."""
        return self.reduced and all(r in self.acks for r in self.ranks if is_live(r))


class DepositsAhead:
    """Ranks told to deposit in the next round at their chunk's end, and those that did (parked)."""

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size
        self.told: dict[int, int] = {}  # rank -> the round its chunk in flight names
        self.parked: set[int] = set()  # ranks whose told chunk is done: they deposited unasked
        self.snapped: dict[int, tuple[int, int]] = {}  # rank -> (round, its step count) of its last snapshot

    def in_flight(self, rank: int, cycle: Cycle | None, published: int) -> tuple[int, int] | None:
        """(round, step count) of `rank`'s deposit in a round after `published`, if any: in the open `cycle`,
        every step counted at its trigger and any announced with its snapshot since (a rank trains on past
        the trigger under cpu-async); else one made ahead, unasked."""
        snap = self.snapped.get(rank)
        if cycle is not None and rank in cycle.ranks:
            return cycle.round, max(cycle.snapshot[rank], snap[1] if snap is not None and snap[0] == cycle.round else 0)
        return snap if snap is not None and snap[0] > published else None

    def plan(
        self, rank: int, plan: rec.EpochPlan, window_steps: int, dispatch: DispatchStrategy, next_round: int
    ) -> tuple[rec.EpochPlan, MassBound | None]:
        """`rank`'s next chunk after `window_steps` steps: if it is the rank's last of the window, it names
        `next_round` (and the rank's mass bound for it, for the reducer before the plan)."""
        steps = window_steps + -(-plan.size // self.batch_size)
        if not dispatch.ends_window(rank, plan, steps):
            return plan, None
        self.told[rank] = next_round
        return dataclasses.replace(plan, deposit=next_round), MassBound.ahead(next_round, rank, steps)

    def chunk_done(self, rank: int, next_round: int) -> bool:
        """`rank` reported its chunk trained; True if that chunk's end was its deposit in `next_round`."""
        if self.told.pop(rank, None) != next_round:
            return False
        self.parked.add(rank)
        return True

    def forget(self, rank: int) -> None:
        self.told.pop(rank, None)
        self.parked.discard(rank)

    def clear(self) -> None:
        """The round is triggered: the parked are in it, and a request superseded what the others were told."""
        self.told.clear()
        self.parked.clear()


@dataclass
class Consensus:
    """What the last finished consensus contains (for `state_dict` and the epoch callbacks)."""

    coverage: dict[int, list[Span]]
    aggregated: int  # the last epoch aggregated at its release: it holds every epoch up to it whole
    complete: int = -1  # every sample of epochs <= this is in it

    def adopt(self, cycle: Cycle, done_now: int, held: bool) -> None:
        """`cycle` was released: its consensus holds the coverage banked then, the epochs aggregated then,
        and the epochs done at its trigger.

        When no rank trained past its deposit (`held`), the consensus holds
        every epoch done now (`done_now`): behind the hard barrier ranks sit
        throttled from their deposit to their Update, with any new data held
        back (`Outbox.hold`); elsewhere, when no rank has stepped since the
        trigger's snapshot. Otherwise ranks trained on, so only what was done
        at the trigger counts. (Known at the release, before the evals go out:
        one that holds several epochs' ends is then scored once, roles.py.)
        """
        self.coverage = cycle.coverage
        self.aggregated = cycle.last_aggregated
        self.holds_through(max(cycle.last_aggregated, done_now if held else cycle.done_through))

    def holds_through(self, done: int) -> None:
        self.complete = max(self.complete, done)


def gate_open(
    live: Iterable[int],
    steps: StepCounters,
    dispatch: DispatchStrategy,
    throttled: set[int],
    last_aggregated: int,
) -> bool:
    """The count-based gate: every live rank full, throttled or quiesced, and one stepped; shut in the
    run's tail (`in_run_tail`, asked only of a gate that would open) unless a rank is throttled, which
    waits for a round."""
    any_mover = False
    for r in live:  # per record: stops at the first rank not done
        moved = steps.count[r] - steps.base[r]
        any_mover |= moved > 0
        # A rank we throttled is parked at the barrier on our orders.
        if not (
            dispatch.window_full(r, moved)
            or r in throttled
            or dispatch.quiesced(r, last_aggregated)
        ):
            return False
    return any_mover and (bool(throttled) or not dispatch.in_run_tail(last_aggregated))


def over_lead_cap(window: list[int], diff: int) -> list[int]:
    """The ranks more than `diff` steps ahead of the slowest in this window (`max_batch_diff`)."""
    floor = min(window)
    return [r for r, s in enumerate(window) if s > floor + diff]
