"""What goes in and out of a reducer service (reducer_service.py): the outcomes it puts on its `completed`
Mailbox for the controller's loop (or a shard host's relay), and the commands other threads hand its loop.

Apart from the service so that their readers need not import it; plain frozen records, no logic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flodl_zmq.wire.records import ShardStart

# ---------------------------------------------------------------- outcomes (ReducerService.completed)


@dataclass(frozen=True)
class RoundOutcome:
    """What became of a round: reduced over `hosts` with `mass` (each host's part in `masses`), or abandoned
    (`abandoned` names why)."""

    round_id: int | None
    mass: float
    hosts: tuple[str, ...]
    abandoned: str | None = None
    published_at: float | None = None  # time.perf_counter() once the consensus was sent to every host
    masses: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()  # whose deposits the consensus holds (Reduced.ranks)


@dataclass(frozen=True)
class HostRefused:
    """The reducer refused `host`'s frames for good (`reason`): its ranks are out of every round. Its relay was
    told and may lie: the coordinator hears it here, at once, not at the ranks' heartbeat deadline."""

    host: str
    ranks: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class OuterSlice:
    """A shard's outer state after its step of `round_id` (`ReducerService.want_state`): its slice's global model,
    then its momentum (`shards.state_frames`); out on `completed`."""

    shard: int
    round_id: int
    payload: list[Any]


# ---------------------------------------------------------------- commands (the service loop's mailbox)


@dataclass(frozen=True)
class WantState:
    """The outer state of the first round published at or after `round_id` is wanted (ReducerService.want_state)."""

    round_id: int


@dataclass(frozen=True)
class StartFrom:
    """A host shard's start, from the controller's reducer through its relay (ReducerService.start_from)."""

    record: ShardStart
    payload: list[Any]


@dataclass(frozen=True)
class DeclareDead:
    """The coordinator declared `rank` dead (ReducerService.declare_dead)."""

    rank: int


@dataclass(frozen=True)
class BoundRound:
    """The coordinator's mass bound per rank for `round_id` (ReducerService.bound_round)."""

    round_id: int
    bounds: dict[int, float]
    opens: bool  # the trigger's bound; False: one deposit told ahead (RoundLedger.bound_round)


@dataclass(frozen=True)
class DropBroadcast:
    """Test hook: the consensus of `round_id` is not sent (ReducerService.drop_broadcast)."""

    round_id: int
