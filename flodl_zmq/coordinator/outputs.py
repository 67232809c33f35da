"""What the coordinator asks of its service: the `Out` records and the controller's effects.

`Coordinator` (core.py) answers every input with a list of `Out(dest,
record)`. `dest` is a rank id (send `record` to that rank), `REDUCER` (a
directive for the in-process reducer: `DeclareDead` to drop a rank from
every barrier, `MassBound`; the reducer learns each round from its first
deposit) or `CONTROLLER` (an effect on the controller itself: `RoundOpened`
to start the round's clock, `SaveState` to write the checkpoint meta,
`EpochAggregated` for `metrics_fn`, `EpochProgress` for `reports_per_epoch`,
`Evaluated` for the report's eval rows, `RunEnded`). These types are the whole
contract a service, or the simulator, needs to act on the core.

`Outbox` collects them in the order the core produces them: each rank must
receive its records in that order (a Sync rank trains its spans in arrival
order, and the coordinator computes a dead rank's remainder in production
order). Broadcasts expand to one `Out` per live rank, so the service never
needs to know who is live.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flodl_zmq.coordinator.liveness import Liveness, ShutdownReason
from flodl_zmq.wire.records import EpochAggregated, EvalResult


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


class Outbox:
    """The core's outputs since the last `flush`, with data held for ranks waiting at the barrier."""

    def __init__(self, liveness: Liveness) -> None:
        self._liveness = liveness
        self._out: list[Out] = []
        self._held: list[Out] = []  # data for ranks held at the barrier while a cycle is in flight

    def emit(self, dest: int | Target, record: Any) -> None:
        self._out.append(Out(dest, record))

    def to_live(self, record: Any) -> None:
        for r in self._liveness.live:
            self._out.append(Out(r, record))

    def hold(self, rank: int, record: Any) -> None:
        """Keep `record` for `rank` until `release_held` (after the cycle's Updates)."""
        self._held.append(Out(rank, record))

    def release_held(self) -> None:
        # A rank that died meanwhile is skipped: its held data is already part
        # of the remainder its death handed on.
        for out in self._held:
            if self._liveness.is_live(out.dest):
                self._out.append(out)
        self._held.clear()

    def flush(self) -> list[Out]:
        out, self._out = self._out, []
        return out


@dataclass(frozen=True)
class RoundOpened:
    """Controller notice: round `round` was triggered for `ranks`; the round's clock starts.

    The reducer needs no notice: like the real one, it learns a round from its
    first deposit and drops ranks on `DeclareDead`.
    """

    round: int
    ranks: tuple[int, ...]


# A rank's deposit mass is its steps since its previous snapshot, counted when it
# handles RequestParams; the coordinator's count at the trigger lags that by the
# steps whose Batch records were still in flight and those taken while the
# request travelled. The bound allows that much again, plus a margin, so an
# honest deposit is never refused; a liar gains at most that factor in weight.
MASS_SLACK_STEPS = 64


def mass_bound(window_steps: int) -> float:
    """The most mass a rank that the coordinator counted `window_steps` for may deposit in a round."""
    return float(2 * max(0, window_steps) + MASS_SLACK_STEPS)


@dataclass(frozen=True)
class MassBound:
    """Reducer directive: the most mass each rank of round `round` may deposit (`mass_bound`).

    Emitted with the round's trigger (`opens`), before its RequestParams, and
    for one rank with a plan that tells it to deposit ahead (`ahead`), before
    that plan: the reducer refuses a HostFrame with more mass than the sum of
    its ranks' bounds, and publishes a round told ahead only once its trigger
    opened it (deposits told ahead may all arrive before the trigger).
    """

    round: int
    bounds: tuple[tuple[int, float], ...]  # (rank, bound) for each rank in the round
    opens: bool = True

    @classmethod
    def ahead(cls, round: int, rank: int, window_steps: int) -> MassBound:
        """The bound of `rank`, told to deposit in `round` after `window_steps` steps in all."""
        return cls(round, ((rank, mass_bound(window_steps)),), opens=False)

    @classmethod
    def for_window(cls, round: int, window_steps: Sequence[int], ranks: Iterable[int]) -> MassBound:
        """The bounds of `ranks`, from each one's steps counted at the trigger."""
        return cls(round, tuple((r, mass_bound(window_steps[r])) for r in ranks))


@dataclass(frozen=True)
class SaveState:
    """Controller directive: write the checkpoint meta `state` (see `Coordinator.state_dict`)."""

    reason: ShutdownReason
    state: dict[str, Any]


@dataclass(frozen=True)
class EpochProgress:
    """Controller notice (`reports_per_epoch`): `fraction` of `epoch`'s batches are reported;
    `metrics` aggregates the chunk reports so far, as the epoch's record will."""

    epoch: int
    fraction: float
    metrics: EpochAggregated


@dataclass(frozen=True)
class Evaluated:
    """Controller notice: a rank answered an eval the coordinator asked for (each once); `samples`: what the
    scored consensus held (steps times the batch); `within_epoch`: the sample cadence's, not an epoch's."""

    result: EvalResult
    samples: int
    within_epoch: bool


@dataclass(frozen=True)
class EvalsMerged:
    """Controller notice: `epochs` (each counted as on entering it: 1 is the first epoch's end) have no
    eval of their own. The first consensus to hold them whole, of `samples` samples, also held a later
    epoch whole or was scored already, and is scored once: by the eval with these samples."""

    epochs: tuple[int, ...]
    samples: int


@dataclass(frozen=True)
class RunEnded:
    """Controller notice: the run is over; `reason` None means it finished normally."""

    reason: ShutdownReason | None
