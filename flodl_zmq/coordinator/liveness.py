"""Who is alive: heartbeats both ways, staleness, clean exits, reported deaths.

ZeroMQ never tells us a peer is gone, so liveness is application-level:

- **Rank -> coordinator.** Every record a rank sends refreshes its
  last-seen time (a dedicated 1 s heartbeat keeps a rank that is blocked at a
  barrier visible). A rank silent for longer than `timeout_s` is stale.
- **Coordinator -> rank.** The coordinator beacons `CoordHeartbeat` every
  `BEACON_INTERVAL_S` so a rank can tell a quiet coordinator from a dead one.
- **Clean exit.** `Exiting` latches the rank out of staleness detection and
  of the failure count: a rank that said goodbye stops heartbeating, and
  counting it again as stale double-decremented the live count upstream and
  tripped spurious max-failure shutdowns.
- **Reported deaths.** The agent (or the relay) sees a child exit first-hand
  and reports it in milliseconds; the report takes the same path as a
  staleness verdict. Duplicate or late reports are ignored.

Rules this module keeps: a rank leaves the live set exactly once, either as a
failure or as a clean exit, and never comes back; only failures count towards
`max_failure`; times are passed in, never read.
"""

from __future__ import annotations

import enum
import math

from flodl_zmq.coordinator.config import MaxFailure
from flodl_zmq.errors import CoordinatorError

BEACON_INTERVAL_S = 1.0


class ShutdownReason(str, enum.Enum):
    """Why a run ends with a save (`ShutdownWithSave.reason`; floDl reason bytes 0-5)."""

    GRACEFUL = "graceful"
    MAX_FAILURE_EXCEEDED = "max_failure_exceeded"
    SINGLE_SURVIVOR = "single_survivor"  # NCCL-only upstream; kept for the wire vocabulary
    ALL_RANKS_LOST = "all_ranks_lost"
    REDUCE_STALL = "reduce_stall"
    CHECKPOINT = "checkpoint"


# What a user reads after the reason when a run stops early: where the cause is written (`stop_hint`).
STOP_HINTS: dict[ShutdownReason, str] = {
    ShutdownReason.ALL_RANKS_LOST: (
        ": every rank left or was declared dead (the controller's log names each death); a rank whose own "
        "code raised logged 'rank N: training failed: ERROR' with its traceback in its host's log"
    ),
    ShutdownReason.MAX_FAILURE_EXCEEDED: ": more ranks failed than max_failures allows (the controller's log names each)",
}
# All lost and none died: every rank said goodbye. No record says why a rank leaves, so the likely causes are
# named, the first first: one sample that raises is handed on to rank after rank, and ends each.
ALL_LEFT_HINT = (
    ": no rank died, every one said goodbye before the end, as a rank does when its own code raised (its "
    "train_step, or its dataset: a sample that raises ends every rank that is handed it), when its Session loop "
    "ended early, or when it was sent SIGTERM; one whose code raised logged 'rank N: training failed: ERROR' with "
    "its traceback in its host's log (the [host:N] lines under launch)"
)


def stop_hint(reason: ShutdownReason, liveness: Liveness) -> str:
    """What a user reads after `reason` when a run stops early, knowing how its ranks left."""
    if reason is ShutdownReason.ALL_RANKS_LOST and liveness.failures == 0:
        return ALL_LEFT_HINT
    return STOP_HINTS.get(reason, "")


class RankState(enum.Enum):
    LIVE = "live"
    EXITED = "exited"  # said goodbye: not a failure
    DEAD = "dead"  # failed: stale, or reported dead


class Liveness:
    """Per-rank liveness ledger for a world of `world_size` ranks, started at `now`."""

    def __init__(self, world_size: int, timeout_s: float, now: float) -> None:
        if world_size < 1:
            raise CoordinatorError(f"Liveness world_size = {world_size}: must be >= 1")
        self.world_size = world_size
        self.timeout_s = timeout_s
        # Every rank starts fresh at construction: a rank that never speaks
        # is declared dead one timeout after the coordinator started.
        self._last_seen = [now] * world_size
        self._state = [RankState.LIVE] * world_size
        # Asked for on every record: kept, not rebuilt (O(world) per record at 256 ranks).
        self._live = tuple(range(world_size))
        self._last_beacon: float | None = None

    # ----------------------------------------------------------------- inputs

    def saw(self, rank: int, now: float) -> None:
        """Any record from `rank` is a sign of life."""
        self.check_rank(rank)
        self._last_seen[rank] = max(self._last_seen[rank], now)

    def exit(self, rank: int) -> bool:
        """Latch a clean exit; True if the rank was live (the first goodbye counts)."""
        return self._leave(rank, RankState.EXITED)

    def fail(self, rank: int) -> bool:
        """Record a failure; True if the rank was live (duplicate reports are no-ops)."""
        return self._leave(rank, RankState.DEAD)

    def beacon_due(self, now: float) -> bool:
        """True when a CoordHeartbeat should go out now; marks it sent."""
        if self._last_beacon is not None and now - self._last_beacon < BEACON_INTERVAL_S:
            return False
        self._last_beacon = now
        return True

    def next_due(self) -> float:
        """When a beacon is next due or the quietest live rank turns stale (now, if a beacon is owed)."""
        due = -math.inf if self._last_beacon is None else self._last_beacon + BEACON_INTERVAL_S
        seen = [self._last_seen[r] for r in range(self.world_size) if self._state[r] is RankState.LIVE]
        if seen:
            # `stale` is strict (silent for longer than the timeout): due just after.
            due = min(due, math.nextafter(min(seen) + self.timeout_s, math.inf))
        return due

    # ---------------------------------------------------------------- queries

    def stale(self, now: float) -> list[int]:
        """Live ranks silent for longer than the timeout, in rank order."""
        return [
            r
            for r in range(self.world_size)
            if self._state[r] is RankState.LIVE and now - self._last_seen[r] > self.timeout_s
        ]

    def is_live(self, rank: int) -> bool:
        return 0 <= rank < self.world_size and self._state[rank] is RankState.LIVE

    def state(self, rank: int) -> RankState:
        self.check_rank(rank)
        return self._state[rank]

    @property
    def live(self) -> tuple[int, ...]:
        """The live ranks, in rank order."""
        return self._live

    @property
    def live_mask(self) -> list[bool]:
        return [s is RankState.LIVE for s in self._state]

    @property
    def failures(self) -> int:
        """Ranks that failed (clean exits excluded): what max_failure counts."""
        return sum(s is RankState.DEAD for s in self._state)

    def last_seen(self, rank: int) -> float:
        self.check_rank(rank)
        return self._last_seen[rank]

    # -------------------------------------------------------------- internals

    def _leave(self, rank: int, to: RankState) -> bool:
        self.check_rank(rank)
        if self._state[rank] is not RankState.LIVE:
            return False
        self._state[rank] = to
        self._live = tuple(r for r in self._live if r != rank)
        return True

    def check_rank(self, rank: int) -> None:
        """Raise CoordinatorError for a rank id outside the world."""
        if not 0 <= rank < self.world_size:
            raise CoordinatorError(
                f"rank {rank} is outside the world of {self.world_size} ranks "
                f"(valid 0..{self.world_size - 1})"
            )


def unrecoverable(liveness: Liveness, max_failure: MaxFailure | None) -> ShutdownReason | None:
    """The reason the run cannot go on, or None.

    The user's threshold wins over the all-lost rule; it counts failures
    only, so ranks that exited cleanly never trip it.
    """
    failures = liveness.failures
    # A limit of 0 means "the first failure ends the run", not "end it now".
    if max_failure is not None and failures > 0 and failures >= max_failure.limit(liveness.world_size):
        return ShutdownReason.MAX_FAILURE_EXCEEDED
    if not liveness.live:
        return ShutdownReason.ALL_RANKS_LOST
    return None
