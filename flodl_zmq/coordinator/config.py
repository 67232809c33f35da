"""The coordinator's configuration: one validated object for the whole run.

Rules this module keeps:

- Every setting is checked when the object is built; a bad value raises
  `ConfigError` naming the setting, the value and the allowed range, so a run
  never fails an hour in on a typo.
- Defaults follow floDl 0.7, so a run tuned there behaves the same here:
  Cadence mode, anchor 10 (1 under Sync), heartbeat timeout 30 s, TrendGuard
  at 0.05 (0.3 when the EASGD blend keeps a standing spread), overshoot
  auto-tuned from 3 to 15. How far a rank blends towards each consensus is
  the rank's own setting (`Job.blend`): the coordinator never sees it.
- Derived values (guard threshold, overshoot bounds, the ElChe knobs, the
  reduce-stall ceiling) are computed here once, so the state machine never
  re-derives policy.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from flodl_zmq.coordinator.elche import ElCheConfig
from flodl_zmq.errors import ConfigError
from flodl_zmq.sampling import SHUFFLE_BASE_SEED
from flodl_zmq.settings import MaxFailure

# MaxFailure lives in settings.py, below both this core and the job that also needs it; it is
# re-exported here for the coordinator's users.
__all__ = ["MaxFailure", "CoordinatorConfig", "Mode", "GuardKind"]

OVERSHOOT_AUTO_INITIAL = 3
OVERSHOOT_AUTO_CEILING = 15
TREND_THRESHOLD = 0.05
# A rank silent this long is dead to the coordinator: the default of the Job keyword too.
RANK_SILENCE_AT_COORDINATOR_S = 30.0
TREND_THRESHOLD_EASGD = 0.3  # EASGD keeps a standing spread of about 0.1
REDUCE_STALL_FLOOR_S = 300.0
REDUCE_STALL_HEARTBEATS = 10

# (setting, minimum): the integer settings, checked in this order.
_INTEGERS = (
    ("total_samples", 1), ("batch_size", 1), ("num_epochs", 1), ("seed", 0), ("eval_every", 0),
    ("eval_every_samples", 0), ("checkpoint_every", 0), ("max_anchor", 1), ("min_chunk_batches", 1), ("reports_per_epoch", 0),
)
# The same for settings where None means "not set" (a default or a policy).
_OPTIONAL_INTEGERS = (("callback_rank", 0), ("anchor", 1), ("max_overshoot", 0))


class Mode(str, enum.Enum):
    """When to average (floDl's ApplyPolicy; the backend is always CPU averaging here).

    - SYNC: whole partitions per epoch, average as soon as every live rank
      did one step, Throttle barrier each cycle.
    - CADENCE: ElChe windows, one window-sized chunk in flight per rank.
    - ASYNC: throughput-sized chunks, bounded overshoot past the window,
      ranks blend the consensus (EASGD) instead of overwriting.
    """

    SYNC = "sync"
    CADENCE = "cadence"
    ASYNC = "async"

    @property
    def barrier_paced(self) -> bool:
        """Sync and Cadence hold ranks at the reduce and at epoch edges; Async does not."""
        return self is not Mode.ASYNC

    @property
    def progressive(self) -> bool:
        """Cadence and Async stream chunks from a pool; Sync sends whole partitions."""
        return self is not Mode.SYNC

    @property
    def deposits_unasked(self) -> bool:
        """Cadence: a chunk that fills the window names the next round, deposited at its end (PROTOCOL.md 10.1)."""
        return self is Mode.CADENCE

    @property
    def hard_barrier(self) -> bool:
        """Sync throttles every rank from its deposit to its Update: nothing trains meanwhile."""
        return self is Mode.SYNC


class GuardKind(str, enum.Enum):
    NONE = "none"
    TREND = "trend"
    MSF = "msf"


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything the coordinator needs to schedule one run. See the module docstring.

    `callback_rank` selects the callback-role policy: None = Fastest (the
    quickest live rank runs eval, checkpoint and epoch_fn), n = Rank(n).
    `eval_every` / `checkpoint_every` are epoch cadences (0 = off);
    `eval_every_samples` scores the consensus within epochs too, each time
    it holds that many more samples (0 = off; roles.py, `EvalLedger`);
    `final_eval` asks for one canonical eval of the final consensus before
    shutdown. `max_overshoot` pins Async's lookahead (None = auto 3 -> 15).
    `reports_per_epoch` n > 1 emits `EpochProgress` as each n-th of an
    epoch's batches is reported (progressive modes; 0 or 1: the epoch only).
    """

    total_samples: int
    batch_size: int
    num_epochs: int
    mode: Mode = Mode.CADENCE
    seed: int = SHUFFLE_BASE_SEED
    rank_silence_at_coordinator_s: float = RANK_SILENCE_AT_COORDINATOR_S
    max_failure: MaxFailure | None = None
    eval_every: int = 0
    eval_every_samples: int = 0
    checkpoint_every: int = 0
    final_eval: bool = False
    callback_rank: int | None = None
    anchor: int | None = None
    max_anchor: int = 1000
    min_anchor: int | None = None
    overhead_target: float = 0.05
    max_batch_diff: int | None = None
    relax_up: bool = False
    partition_ratios: Sequence[float] | None = None
    guard: GuardKind = GuardKind.TREND
    divergence_threshold: float | None = None
    msf_thresholds: tuple[float, float] | None = None
    meta_controller: bool = True
    max_overshoot: int | None = None
    min_chunk_batches: int = 1
    reports_per_epoch: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", _enum(Mode, self.mode, "mode"))
        object.__setattr__(self, "guard", _enum(GuardKind, self.guard, "guard"))
        self._check_counts()
        silence = self.rank_silence_at_coordinator_s
        if not (isinstance(silence, (int, float)) and not isinstance(silence, bool) and silence > 0
                and math.isfinite(silence)):
            raise ConfigError(f"rank_silence_at_coordinator_s = {silence!r}: must be a finite number of seconds > 0")
        for name, minimum in _OPTIONAL_INTEGERS:
            if getattr(self, name) is not None:
                _int(getattr(self, name), name, minimum)
        self._check_guard()
        self._check_partition_ratios()
        # Built here so every ElChe knob error surfaces at configuration time.
        self.elche_config(1)

    # ------------------------------------------------------------ validation

    def _check_counts(self) -> None:
        """The integer settings, and an epoch that holds whole batches to report."""
        for name, minimum in _INTEGERS:
            _int(getattr(self, name), name, minimum)
        if self.reports_per_epoch > 1 and self.mode is Mode.SYNC:
            raise ConfigError(
                f"reports_per_epoch = {self.reports_per_epoch}: sync ranks report once per epoch (their "
                f"whole partition), so there is nothing to report within one; use 0 or 1, or a progressive mode"
            )
        if self.total_samples < self.batch_size:
            raise ConfigError(
                f"total_samples = {self.total_samples} is smaller than batch_size = "
                f"{self.batch_size}: an epoch would hold no whole batch; use a smaller batch"
            )

    def _check_guard(self) -> None:
        """Each guard's thresholds, given only with that guard; msf's are normalized to floats."""
        if self.divergence_threshold is not None and not (
            isinstance(self.divergence_threshold, (int, float))
            and math.isfinite(self.divergence_threshold) and self.divergence_threshold >= 0
        ):
            raise ConfigError(
                f"divergence_threshold = {self.divergence_threshold!r}: must be a finite number >= 0"
            )
        if self.divergence_threshold is not None and self.guard is not GuardKind.TREND:
            raise ConfigError(
                f"divergence_threshold is the trend guard's threshold, but guard = {self.guard.value!r}: "
                f"drop it or use guard='trend'"
            )
        if self.msf_thresholds is not None:
            if self.guard is not GuardKind.MSF:
                raise ConfigError(
                    f"msf_thresholds are the msf guard's thresholds, but guard = {self.guard.value!r}: "
                    f"drop them or use guard='msf'"
                )
            m = tuple(self.msf_thresholds) if isinstance(self.msf_thresholds, (tuple, list)) else ()
            if not (len(m) == 2 and all(_finite(x) and x > 0 for x in m) and m[0] <= m[1]):
                raise ConfigError(
                    f"msf_thresholds = {self.msf_thresholds!r}: must be (suppress, nudge), two divergence "
                    f"growth rates with 0 < suppress <= nudge (a nudge implies a suppress); default (1e-3, 1e-2)"
                )
            object.__setattr__(self, "msf_thresholds", (float(m[0]), float(m[1])))

    def _check_partition_ratios(self) -> None:
        if self.partition_ratios is not None:
            if not isinstance(self.partition_ratios, (tuple, list)) or not all(
                _finite(x) and x > 0 for x in self.partition_ratios
            ):
                raise ConfigError(
                    f"partition_ratios = {self.partition_ratios!r}: must be one positive finite number per rank"
                )
            if self.mode is not Mode.SYNC:
                raise ConfigError(
                    f"partition_ratios only apply to mode='sync' (mode is {self.mode.value}: "
                    f"progressive modes size chunks from measured speed)"
                )
            object.__setattr__(self, "partition_ratios", tuple(self.partition_ratios))

    # ------------------------------------------------------------ derived

    @property
    def guard_threshold(self) -> float:
        """Async ranks blend each consensus in (`Job.blend`), so their replicas sit further from it."""
        if self.divergence_threshold is not None:
            return self.divergence_threshold
        return TREND_THRESHOLD_EASGD if self.mode is Mode.ASYNC else TREND_THRESHOLD

    @property
    def overshoot_bounds(self) -> tuple[int, int, bool]:
        """(initial, ceiling, auto): a user value pins both and disables auto-tuning.

        Barrier-paced modes stop every rank at its window: no overshoot.
        """
        if self.mode.barrier_paced:
            return 0, 0, False
        if self.max_overshoot is not None:
            return self.max_overshoot, self.max_overshoot, False
        return OVERSHOOT_AUTO_INITIAL, OVERSHOOT_AUTO_CEILING, True

    @property
    def reduce_stall_s(self) -> float:
        """A pending cycle older than this, with ranks alive, ends the run (ReduceStall)."""
        return max(REDUCE_STALL_HEARTBEATS * self.rank_silence_at_coordinator_s, REDUCE_STALL_FLOOR_S)

    @property
    def batches_per_epoch(self) -> int:
        return self.total_samples // self.batch_size

    def elche_config(self, world_size: int) -> ElCheConfig:
        """ElChe's knobs for this run and world (Sync: anchor 1, no window growth)."""
        anchor = self.anchor if self.anchor is not None else (1 if self.mode is Mode.SYNC else 10)
        anchor_rank = None
        if self.partition_ratios is not None and len(self.partition_ratios) == world_size:
            # The smallest ratio marks the rank the user knows is slowest.
            anchor_rank = min(range(world_size), key=lambda r: (self.partition_ratios[r], r))
        return ElCheConfig(
            anchor=anchor,
            max_anchor=max(self.max_anchor, anchor),
            min_anchor=self.min_anchor,
            overhead_target=self.overhead_target,
            max_batch_diff=self.max_batch_diff,
            window_growth=self.mode is not Mode.SYNC,
            anchor_rank=anchor_rank,
        )

    def check_world(self, world_size: int) -> None:
        """Settings that depend on the world size (known only once the world forms)."""
        _int(world_size, "world_size", 1)
        if self.callback_rank is not None and self.callback_rank >= world_size:
            raise ConfigError(
                f"callback_rank = {self.callback_rank} is outside a world of {world_size} ranks "
                f"(valid 0..{world_size - 1}; without one the fastest rank runs the callbacks)"
            )
        if self.partition_ratios is not None and len(self.partition_ratios) != world_size:
            raise ConfigError(
                f"partition_ratios has {len(self.partition_ratios)} entries for a world of "
                f"{world_size} ranks; give one ratio per rank"
            )


def _enum(cls: type[enum.Enum], value: object, name: str) -> enum.Enum:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"{name} = {value!r}: must be one of {allowed}") from None


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(value: object, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} = {value!r}: must be an integer >= {minimum}")
