"""What the coordinator asks of its service: the `Out` records and the controller's effects.

`Coordinator` (core.py) answers every input with a list of `Out(dest,
record)`. `dest` is a rank id (send `record` to that rank), `REDUCER` (a
directive for the in-process reducer: `DeclareDead`) or `CONTROLLER` (an
effect on the controller itself: the records defined here, and
`EpochAggregated` / `EvalResult` for the run report). These types are the
whole contract a service, or the simulator, needs to act on the core.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from flodl_zmq.coordinator.liveness import ShutdownReason


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
class RoundOpened:
    """Controller notice: round `round` was triggered for `ranks`; the round's clock starts.

    The reducer needs no notice: like the real one, it learns a round from its
    first deposit and drops ranks on `DeclareDead`.
    """

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
