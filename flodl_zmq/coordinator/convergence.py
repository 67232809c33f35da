"""Convergence guards: watch weight-space divergence, veto or shrink window growth.

At every reduce each rank measures how far its replica drifted from the
consensus it receives (``divergence = ||pre - post|| / ||post||`` over the whole
parameter list, see :func:`divergence_triple`) and ships the triple
``(divergence, post_norm, pre_norm)`` in its ``SyncAck``. The coordinator
collects one triple per rank into a :class:`DivergenceReport` and asks its
guard for a :class:`GuardVerdict`:

* :class:`NoGuard` always answers Stable.
* :class:`TrendGuard` keeps the last five worst-rank divergences; three strict
  rises ending above its threshold answer SuppressGrowth. It never shrinks.
* :class:`MsfGuard` estimates the per-step growth rate lambda of the divergence
  (a bias-corrected EMA of ``ln(D_t / D_{t-1}) / k_max``) and answers
  SuppressGrowth, or NudgeDown when the rate stays steep, after a sustained
  streak.

Above the guard sits :class:`LrEventMeta`, which watches the learning rate
and the verdict history and shrinks the window at LR cliffs and under
sustained guard pressure.

Rules this module keeps:

* Pure: numbers in, verdicts out. No clocks, no I/O; only
  :func:`divergence_triple` (run on ranks) touches tensors.
* The verdict is the single seam into ElChe (``ElChe.apply_verdict``); nothing
  here mutates the schedule directly.
* The guard's primary scalar is the *worst* rank's divergence: one drifting
  rank is enough to stop growing the window for everyone.

How the coordinator uses this (through ``WindowFeedback``, feedback.py): after
each reduce it builds ``DivergenceReport.from_samples`` from the SyncAck
triples of that round only (a stale value must never pin the anchor), calls
``guard.report(report, k_used, k_max)`` with the window's step totals, passes
the verdict to ``LrEventMeta.observe`` (applying any NudgeDown it returns to
ElChe first), then applies the guard's verdict with ``ElChe.apply_verdict``.
On checkpoint it stores ``TrendGuard.history()`` as the ElChe state's
``trend_history`` and restores it with ``TrendGuard.with_history``.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from flodl_zmq.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DivergenceReport",
    "DivergenceSample",
    "LambdaEstimator",
    "LrEventMeta",
    "MsfGuard",
    "NoGuard",
    "Calibration",
    "TrendGuard",
    "ConvergenceGuard",
    "GuardVerdict",
    "GuardVerdictKind",
    "divergence_triple",
]

# ||post|| at or below this means "no consensus to compare against": the ratio
# would blow up on an all-zero model, so the divergence reads 0.
POST_NORM_FLOOR = 1e-10


class Calibration(enum.IntEnum):
    """ElChe's calibration phase (ordered: comparisons like ``phase >= Calibration.STABLE`` hold).

    Defined here because both ElChe and the LR meta-controller gate on it.
    """

    PROBE = 0
    WARMUP = 1
    STABLE = 2
    MATURE = 3


class GuardVerdictKind(enum.Enum):
    STABLE = "stable"
    SUPPRESS_GROWTH = "suppress_growth"
    NUDGE_DOWN = "nudge_down"


@dataclass(frozen=True)
class GuardVerdict:
    """What a guard (or the meta-controller) asks ElChe to do with the window.

    Build with :meth:`stable`, :meth:`suppress_growth` or :meth:`nudge_down`.
    ``relax_up`` only means something on Stable, ``factor`` only on NudgeDown.
    """

    kind: GuardVerdictKind
    factor: float = 1.0
    relax_up: bool = False

    @classmethod
    def stable(cls, relax_up: bool = False) -> GuardVerdict:
        return cls(GuardVerdictKind.STABLE, relax_up=relax_up)

    @classmethod
    def suppress_growth(cls) -> GuardVerdict:
        return cls(GuardVerdictKind.SUPPRESS_GROWTH)

    @classmethod
    def nudge_down(cls, factor: float) -> GuardVerdict:
        return cls(GuardVerdictKind.NUDGE_DOWN, factor=factor)

    @property
    def is_pressure(self) -> bool:
        """True for SuppressGrowth and NudgeDown (the guard pushed back)."""
        return self.kind is not GuardVerdictKind.STABLE


# --------------------------------------------------------------------------
# The measure (rank side) and the report (coordinator side)


class DivergenceSample(NamedTuple):
    """One rank's measurement, in SyncAck field order. Norms are None for an empty model."""

    divergence: float
    post_norm: float | None
    pre_norm: float | None


def divergence_triple(
    pre: Sequence[torch.Tensor], post: Sequence[torch.Tensor]
) -> DivergenceSample:
    """Measure ``||pre - post|| / ||post||`` over a whole parameter list (global L2).

    ``pre`` is the rank's parameters just before the sync, ``post`` the
    consensus. Tensors may be bf16 (the wire dtype): every norm is taken in
    f32 so bf16 and f32 runs report comparable numbers. Raises ConfigError
    when the lists differ in length or shape (the rank loaded a different
    model than the consensus describes).
    """
    import torch  # only ranks measure; the coordinator core never needs torch

    if len(pre) != len(post):
        raise ConfigError(
            f"divergence: pre has {len(pre)} tensors but the consensus has {len(post)}; "
            "the rank's model and the consensus must have the same parameter list"
        )
    if not pre:
        return DivergenceSample(0.0, None, None)
    diff_sq = pre_sq = post_sq = 0.0
    for i, (a, b) in enumerate(zip(pre, post, strict=True)):
        if a.shape != b.shape:
            raise ConfigError(
                f"divergence: parameter {i} has shape {tuple(a.shape)} locally but "
                f"{tuple(b.shape)} in the consensus; the models differ"
            )
        a32 = a.detach().to(torch.float32)
        b32 = b.detach().to(torch.float32)
        # Sum squared per-tensor norms in Python floats (f64) so a long
        # parameter list does not lose precision in the accumulation.
        diff_sq += float(torch.linalg.vector_norm(a32 - b32)) ** 2
        pre_sq += float(torch.linalg.vector_norm(a32)) ** 2
        post_sq += float(torch.linalg.vector_norm(b32)) ** 2
    post_norm = math.sqrt(post_sq)
    divergence = math.sqrt(diff_sq) / post_norm if post_norm > POST_NORM_FLOOR else 0.0
    return DivergenceSample(divergence, post_norm, math.sqrt(pre_sq))


@dataclass(frozen=True)
class DivergenceReport:
    """The cohort's divergence at one reduce.

    ``deltas[r]`` is rank r's divergence (0 where a rank sent none);
    ``pre_norms`` is present only when every rank sent one; ``post_norm`` is
    the consensus norm (identical on every rank), None when nobody sent one.
    """

    deltas: tuple[float, ...]
    pre_norms: tuple[float, ...] | None
    post_norm: float | None

    @classmethod
    def from_samples(cls, samples: Sequence[DivergenceSample | None]) -> DivergenceReport:
        """Build from per-rank samples; None marks a rank that sent nothing (dead, or skipped)."""
        deltas = tuple(0.0 if s is None else float(s.divergence) for s in samples)
        pres = [None if s is None else s.pre_norm for s in samples]
        pre_norms = tuple(float(p) for p in pres) if pres and None not in pres else None
        post_norm = next(
            (float(s.post_norm) for s in samples if s is not None and s.post_norm is not None),
            None,
        )
        return cls(deltas, pre_norms, post_norm)

    @property
    def max_relative_delta(self) -> float:
        """The worst rank's divergence (``d_raw``); 0 for an empty cohort."""
        return max(self.deltas, default=0.0)

    def cosine_similarities(self) -> tuple[float, ...] | None:
        """cos(pre, post) per rank from the norms alone; None when norms are missing.

        ``||pre - post||^2 = pre^2 + post^2 - 2 pre.post``, and
        ``||pre - post|| = d * post``, so the cosine needs no extra traffic.
        """
        if self.pre_norms is None or self.post_norm is None:
            return None
        post = self.post_norm
        out = []
        for d, pre in zip(self.deltas, self.pre_norms, strict=True):
            denom = 2.0 * pre * post
            if denom <= 0.0:
                out.append(1.0)
                continue
            cos = (pre * pre + post * post - (d * post) ** 2) / denom
            out.append(min(1.0, max(-1.0, cos)))
        return tuple(out)

    def magnitude_shifts(self) -> tuple[float, ...] | None:
        """``||pre|| - ||post||`` per rank (how much averaging shrank or grew it)."""
        if self.pre_norms is None or self.post_norm is None:
            return None
        return tuple(pre - self.post_norm for pre in self.pre_norms)


# --------------------------------------------------------------------------
# Guards


class ConvergenceGuard(Protocol):
    """A guard turns one reduce's divergence into a verdict for ElChe."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> GuardVerdict:
        """``k_used`` = total steps in the window, ``k_max`` = the largest per-rank count."""
        ...

    def reset(self) -> None: ...


class NoGuard:
    """Never objects: every reduce is Stable."""

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> GuardVerdict:
        return GuardVerdict.stable()

    def reset(self) -> None:
        pass


TREND_HISTORY_CAP = 5
TREND_RISES = 3


class TrendGuard:
    """SuppressGrowth when the worst divergence rose three times in a row past a threshold.

    Only vetoes growth, never shrinks: a rising trend says "the window is as
    large as it should get", not "it is too large". The ring of the last five
    values is persisted on checkpoint so a resumed run is guarded at once
    instead of answering Stable blindly for three cycles.
    """

    DEFAULT_THRESHOLD = 0.01

    def __init__(self, threshold: float = DEFAULT_THRESHOLD) -> None:
        if not (math.isfinite(threshold) and threshold >= 0.0):
            raise ConfigError(
                f"convergence guard threshold = {threshold!r}: must be a finite number >= 0"
            )
        self.threshold = threshold
        self._history: deque[float] = deque(maxlen=TREND_HISTORY_CAP)

    @classmethod
    def with_history(cls, threshold: float, history: Sequence[float]) -> TrendGuard:
        """A guard primed with saved history (only the last five values are kept)."""
        guard = cls(threshold)
        guard._history.extend(float(d) for d in history)
        return guard

    def history(self) -> list[float]:
        """Snapshot of the ring, oldest first (what goes into ``trend_history``)."""
        return list(self._history)

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> GuardVerdict:
        self._history.append(report.max_relative_delta)
        if len(self._history) >= TREND_RISES:
            a, b, c = list(self._history)[-TREND_RISES:]
            if a < b < c and c > self.threshold:
                return GuardVerdict.suppress_growth()
        return GuardVerdict.stable()

    def reset(self) -> None:
        self._history.clear()


# Divergences at or below this are numerical noise (replicas identical): a log
# ratio against them would be meaningless, so they break the estimator chain.
LAMBDA_NOISE_FLOOR = 1e-8
LAMBDA_EMA_ALPHA = 0.9


class LambdaEstimator:
    """Per-step log growth rate of the divergence, smoothed by a bias-corrected EMA.

    ``lambda_raw = ln(D_t / D_{t-1}) / k_max``: divided by the largest per-rank
    step count (the per-rank time axis), so adding ranks does not change it.
    """

    def __init__(self) -> None:
        self._prev: float | None = None
        self._ema = 0.0
        self._t = 0
        self.last_raw: float | None = None

    def observe(self, d: float, k_max: int) -> float | None:
        """Feed one reduce's ``d_raw``; returns the fresh raw sample or None."""
        self.last_raw = None
        if not (math.isfinite(d) and d > LAMBDA_NOISE_FLOOR):
            self._prev = None
            return None
        if self._prev is not None and k_max > 0:
            raw = math.log(d / self._prev) / k_max
            self._ema = LAMBDA_EMA_ALPHA * self._ema + (1.0 - LAMBDA_EMA_ALPHA) * raw
            self._t += 1
            self.last_raw = raw
        self._prev = d
        return self.last_raw

    @property
    def lambda_ema(self) -> float | None:
        """The bias-corrected EMA (None before the first raw sample)."""
        if self._t == 0:
            return None
        return self._ema / (1.0 - LAMBDA_EMA_ALPHA**self._t)

    def reset(self) -> None:
        self._prev = None
        self._ema = 0.0
        self._t = 0
        self.last_raw = None


class MsfGuard:
    """Guard on the divergence growth rate lambda, with two independent sustained triggers.

    Each reduce with a fresh lambda sample compares the smoothed lambda to
    both thresholds; a streak counts consecutive reduces above its threshold
    and resets when one falls below. When the nudge streak reaches its
    sustain count the verdict is NudgeDown (it wins over SuppressGrowth, which
    it implies); otherwise a full suppress streak gives SuppressGrowth. Firing
    resets only the streak that fired. A reduce with no fresh sample (first
    reduce, or divergence at the noise floor) is no evidence of growth and
    resets both streaks. Not persisted across resume: it re-warms in a few
    reduces.
    """

    def __init__(
        self,
        suppress_threshold: float = 1e-3,
        suppress_sustain: int = 3,
        nudge_threshold: float = 1e-2,
        nudge_sustain: int = 3,
        nudge_factor: float = 0.5,
    ) -> None:
        for name, value in (
            ("suppress_sustain", suppress_sustain),
            ("nudge_sustain", nudge_sustain),
        ):
            if value < 1:
                raise ConfigError(f"MsfGuard {name} = {value}: must be >= 1")
        if not 0.0 < nudge_factor <= 1.0:
            raise ConfigError(f"MsfGuard nudge_factor = {nudge_factor}: must be in (0, 1]")
        self.suppress_threshold = suppress_threshold
        self.suppress_sustain = suppress_sustain
        self.nudge_threshold = nudge_threshold
        self.nudge_sustain = nudge_sustain
        self.nudge_factor = nudge_factor
        self.estimator = LambdaEstimator()
        self._suppress_streak = 0
        self._nudge_streak = 0

    @classmethod
    def without_nudge(cls, suppress_threshold: float = 1e-3, suppress_sustain: int = 3) -> MsfGuard:
        """A guard that only ever vetoes growth (the nudge threshold is infinite)."""
        return cls(suppress_threshold, suppress_sustain, nudge_threshold=math.inf)

    @property
    def lambda_ema(self) -> float | None:
        return self.estimator.lambda_ema

    @property
    def lambda_raw(self) -> float | None:
        """The last reduce's raw sample (None when it produced none)."""
        return self.estimator.last_raw

    def report(self, report: DivergenceReport, k_used: int, k_max: int) -> GuardVerdict:
        if self.estimator.observe(report.max_relative_delta, k_max) is None:
            self._suppress_streak = self._nudge_streak = 0
            return GuardVerdict.stable()
        lam = self.estimator.lambda_ema
        assert lam is not None  # a fresh raw sample always leaves an EMA
        self._suppress_streak = self._suppress_streak + 1 if lam > self.suppress_threshold else 0
        self._nudge_streak = self._nudge_streak + 1 if lam > self.nudge_threshold else 0
        if self._nudge_streak >= self.nudge_sustain:
            self._nudge_streak = 0
            return GuardVerdict.nudge_down(self.nudge_factor)
        if self._suppress_streak >= self.suppress_sustain:
            self._suppress_streak = 0
            return GuardVerdict.suppress_growth()
        return GuardVerdict.stable()

    def reset(self) -> None:
        self.estimator.reset()
        self._suppress_streak = self._nudge_streak = 0


# --------------------------------------------------------------------------
# LR-aware meta-controller

# Per-phase nudge base factor and sustain count: later phases trust the guard
# more (fewer verdicts needed) and shrink less (the window is already tuned).
_BASE_FACTOR = {Calibration.WARMUP: 0.3, Calibration.STABLE: 0.5, Calibration.MATURE: 0.7}
_SUSTAIN_K = {Calibration.PROBE: 5, Calibration.WARMUP: 5, Calibration.STABLE: 3, Calibration.MATURE: 2}
CLIFF_BASE_FACTOR = 0.5
SETTLED_EPSILON = 0.10


def base_factor(phase: Calibration) -> float | None:
    """The phase's nudge base factor (None in Probe, where the meta stays silent)."""
    return _BASE_FACTOR.get(phase)


def sustain_k(phase: Calibration) -> int:
    """Consecutive pressure verdicts needed to fire in this phase."""
    return _SUSTAIN_K[phase]


class LrEventMeta:
    """Shrinks the window at LR cliffs and under sustained guard pressure.

    A sharp LR drop changes the optimum the replicas circle, so the long
    windows tuned for the old LR become too stale: shrink once, right away.
    Separately, K consecutive SuppressGrowth/NudgeDown verdicts mean the guard
    keeps pushing back: shrink by the phase's base factor. Both factors are
    adjusted by the anchor's own trend (``eff = base - (1 - base) * trend``):
    a recently shrunk anchor is shrunk less, a climbing one more. When both
    fire, the factors compound. Each firing consumes its evidence (the LR
    window keeps only the newest value, the verdict window empties) so one
    event nudges once.
    """

    def __init__(
        self,
        lr_window: int = 3,
        anchor_window: int = 5,
        verdict_window: int = 5,
        sharp_drop_threshold: float = 0.3,
        min_factor: float = 0.1,
        max_factor: float = 0.95,
    ) -> None:
        if lr_window < 2:
            raise ConfigError(f"meta lr_window = {lr_window}: must be >= 2 to see a drop")
        if anchor_window < 1:
            raise ConfigError(f"meta anchor_window = {anchor_window}: must be >= 1")
        if not 0.0 < sharp_drop_threshold < 1.0:
            raise ConfigError(
                f"meta sharp_drop_threshold = {sharp_drop_threshold}: must be in (0, 1)"
            )
        if not 0.0 < min_factor <= max_factor <= 1.0:
            raise ConfigError(
                f"meta factor clamp [{min_factor}, {max_factor}]: need 0 < min <= max <= 1"
            )
        self.sharp_drop_threshold = sharp_drop_threshold
        self.min_factor = min_factor
        self.max_factor = max_factor
        self._lrs: deque[float] = deque(maxlen=lr_window)
        self._anchors: deque[int] = deque(maxlen=anchor_window)
        # The window must hold the largest sustain count, or Probe/Warmup's K
        # could never be met.
        self._verdicts: deque[GuardVerdict] = deque(maxlen=max(verdict_window, max(_SUSTAIN_K.values())))

    def anchor_trend(self) -> float:
        """Relative distance of the newest anchor from the window mean (0 with < 2 samples)."""
        if len(self._anchors) < 2:
            return 0.0
        mean = sum(self._anchors) / len(self._anchors)
        return (self._anchors[-1] - mean) / mean if mean > 0 else 0.0

    def is_settled(self) -> bool:
        """The anchor has stopped moving (|trend| < 0.10)."""
        return abs(self.anchor_trend()) < SETTLED_EPSILON

    def effective_factor(self, base: float) -> float:
        """``clamp(base - (1 - base) * trend)``: dampen after a drop, amplify during a climb."""
        return self._clamp(base - (1.0 - base) * self.anchor_trend())

    def observe(
        self, lr: float | None, anchor: int, verdict: GuardVerdict, phase: Calibration
    ) -> GuardVerdict | None:
        """Record one reduce; returns a NudgeDown verdict for ElChe, or None.

        ``lr`` is the first rank's latest reported learning rate; None (no
        report yet) makes the call a no-op. In Probe the windows fill but
        nothing fires: there is no calibrated window to shrink.
        """
        if lr is None or not math.isfinite(lr):
            return None
        self._lrs.append(lr)
        self._anchors.append(anchor)
        self._verdicts.append(verdict)
        if phase is Calibration.PROBE:
            return None
        cliff = self._cliff()
        conv = self._sustained(phase)
        if cliff:
            self._lrs = deque([lr], maxlen=self._lrs.maxlen)
        if conv:
            self._verdicts.clear()
        factors = []
        if cliff:
            factors.append(self.effective_factor(CLIFF_BASE_FACTOR))
        if conv:
            base = base_factor(phase)
            assert base is not None  # Probe returned above
            factors.append(self.effective_factor(base))
        if not factors:
            return None
        return GuardVerdict.nudge_down(self._clamp(math.prod(factors)))

    def _cliff(self) -> bool:
        if len(self._lrs) < 2:
            return False
        prev, now = self._lrs[0], self._lrs[-1]
        return prev > 0.0 and now < prev and (prev - now) / prev > self.sharp_drop_threshold

    def _sustained(self, phase: Calibration) -> bool:
        k = sustain_k(phase)
        if len(self._verdicts) < k:
            return False
        return all(v.is_pressure for v in list(self._verdicts)[-k:])

    def _clamp(self, f: float) -> float:
        return min(self.max_factor, max(self.min_factor, f))
