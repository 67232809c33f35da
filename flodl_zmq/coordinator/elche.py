"""ElChe: how many batches each rank runs per averaging window.

Heterogeneous ranks should reach the sync point together. ElChe measures
each rank's cost per batch, elects the slowest as the *anchor rank*, gives it
``anchor`` batches per window and every faster rank proportionally more
(``round(anchor * slow_ms / ms)``). It grows ``anchor`` when the fixed cost
of a sync is a large share of the window, and shrinks it only when told to
by a verdict (the convergence guard or the LR meta-controller).

Theory of operation, one window at a time:

1. ``report_window`` pushes each rank's ms/batch into a five-sample trust
   window (the smoothed value is their mean); five reports in a row without
   a sample forget the rank (fast recovery after a death or a stall).
2. The anchor rank is elected among the slow cohort (within 15 % of the
   slowest). An incumbent keeps the role unless a challenger is at least
   10 % slower: flapping between near-equal ranks would reshuffle counts
   every window. Election is closed in Warmup (the pin holds while the
   numbers settle) and open from Stable on.
3. A growth proposal is made from the overhead ratio
   ``(sync + fill) / (anchor * slow_ms + sync + fill)`` when it exceeds the
   target (twice the target in Warmup; never on the first report, whose sync
   includes cohort formation). Growth is at most x2 per cycle and only ever
   *proposed*: it commits on the next Stable verdict.
4. Batch counts are recomputed, with a 5 % dead zone (tiny timing noise must
   not churn the schedule), a x64 cap on the speed ratio, an optional
   per-update move limit (``max_batch_diff``) and the epoch cap (a window
   never asks for more batches than one epoch holds).
5. The phase advances by calibration count: Probe -> Warmup (1) ->
   Stable (5) -> Mature (20).

Rules this module keeps: pure (numbers in, counts out; no clock, no I/O);
every count is >= 1; the anchor never grows except by committing a proposal
or relax-up; a NudgeDown always discards the pending proposal *before*
shrinking (otherwise a later Stable would commit the stale growth and undo
the nudge — upstream bug "H12").

How the coordinator uses this: it builds one ``ElChe(config, world_size)``;
at each epoch start it calls ``set_epoch_cap(batches_in_epoch)``; at each
reduce it optionally ``stage_callback_slack``, calls
``report_window(ledger.report(...))``, asks the guard for a verdict and
passes it to ``apply_verdict``. ``batch_counts`` is the schedule for the
gate and chunk sizes; ``state()`` goes into the checkpoint meta and
``ElChe.from_state`` rebuilds it on resume.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flodl_zmq.coordinator.convergence import Calibration, GuardVerdict, GuardVerdictKind
from flodl_zmq.coordinator.timing import WindowReport
from flodl_zmq.errors import ConfigError, CoordinatorError

__all__ = ["ElChe", "ElCheConfig", "ElCheState", "Calibration", "GuardVerdict", "GuardVerdictKind"]

TRUST_WINDOW_CAP = 5
MISSED_REPORTS_TO_FORGET = 5
COHORT_BAND = 0.15
DOMINANCE_MARGIN = 0.10
MAX_SPEED_RATIO = 64.0
BATCH_COUNTS_WINDOW_CAP = 10
GROWTH_REARM_STABLE = 5
GROWTH_STEP_CAP = 2.0
WARMUP_GROWTH_MARGIN = 2.0
DEAD_ZONE = 0.05
STABLE_AT = 5
MATURE_AT = 20
NUDGE_FACTOR_RANGE = (0.1, 1.0)
OVERHEAD_TARGET_RANGE = (0.01, 0.50)
# Two rates this close are the same rank's rate (the anchor itself).
SAME_RATE_MS = 1e-6


def _round_half_up(x: float) -> int:
    # Python's round() is banker's rounding; counts follow the usual
    # half-away-from-zero rule (all values here are positive).
    return math.floor(x + 0.5)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class ElCheConfig:
    """ElChe's knobs. Validated on construction; errors name the setting.

    * ``anchor``: initial batches per window for the slowest rank.
    * ``max_anchor``: growth ceiling (bounds staleness).
    * ``min_anchor``: floor for growth proposals (None = ``anchor``);
      a NudgeDown ignores it.
    * ``overhead_target``: the fixed-overhead share of the anchor rank's
      window that growth aims for, in [0.01, 0.50].
    * ``max_batch_diff``: if set, a calibrated count moves by at most this
      much per update, and relax-up refuses to open a wider lead.
    * ``window_growth``: False for the Sync policy (anchor is telemetry only).
    * ``anchor_rank``: pin the anchor rank before the first election
      (e.g. the smallest ``partition_ratios`` entry).
    """

    anchor: int = 10
    max_anchor: int = 1000
    min_anchor: int | None = None
    overhead_target: float = 0.05
    max_batch_diff: int | None = None
    window_growth: bool = True
    anchor_rank: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.anchor) or self.anchor < 1:
            raise ConfigError(f"elche.anchor = {self.anchor!r}: must be an integer >= 1")
        if not _is_int(self.max_anchor) or self.max_anchor < self.anchor:
            raise ConfigError(
                f"elche.max_anchor = {self.max_anchor!r}: must be an integer >= anchor ({self.anchor})"
            )
        if self.min_anchor is not None and (
            not _is_int(self.min_anchor) or not 1 <= self.min_anchor <= self.max_anchor
        ):
            raise ConfigError(
                f"elche.min_anchor = {self.min_anchor!r}: must be an integer in "
                f"[1, max_anchor={self.max_anchor}]"
            )
        lo, hi = OVERHEAD_TARGET_RANGE
        if not (
            isinstance(self.overhead_target, (int, float)) and lo <= self.overhead_target <= hi
        ):
            raise ConfigError(
                f"elche.overhead_target = {self.overhead_target!r}: must be in [{lo}, {hi}]"
            )
        if self.max_batch_diff is not None and (
            not _is_int(self.max_batch_diff) or self.max_batch_diff < 0
        ):
            raise ConfigError(
                f"elche.max_batch_diff = {self.max_batch_diff!r}: must be an integer >= 0 or None"
            )
        if self.anchor_rank is not None and (not _is_int(self.anchor_rank) or self.anchor_rank < 0):
            raise ConfigError(
                f"elche.anchor_rank = {self.anchor_rank!r}: must be a rank index >= 0 or None"
            )

    @property
    def growth_floor(self) -> int:
        """The effective ``min_anchor``."""
        return self.anchor if self.min_anchor is None else self.min_anchor


@dataclass(frozen=True)
class ElCheState:
    """What a checkpoint keeps of ElChe: the trajectory, not the knobs.

    ``trend_history`` is the TrendGuard ring, filled by the coordinator.
    ``to_dict``/``from_dict`` give a plain JSON-able form for the meta file.
    """

    anchor: int
    anchor_rank: int | None
    smoothed_ms_per_batch: tuple[float, ...]
    phase: Calibration
    calibration_count: int
    trend_history: tuple[float, ...] | None = None

    def grown(self, world_size: int) -> ElCheState:
        """The state for a world grown to `world_size` ranks: the new ranks cold (no measurement yet).

        A cold rank gets the anchor's count until its first windows are
        measured (the probe), then a share by its speed, as at a run's start.
        """
        missing = world_size - len(self.smoothed_ms_per_batch)
        if missing < 0:
            raise ConfigError(
                f"resume: the checkpoint has {len(self.smoothed_ms_per_batch)} ranks, more than this "
                f"run's {world_size}; a world may only grow"
            )
        return dataclasses.replace(self, smoothed_ms_per_batch=self.smoothed_ms_per_batch + (0.0,) * missing)

    def to_dict(self) -> dict[str, Any]:
        return {
            "anchor": self.anchor,
            "anchor_rank": self.anchor_rank,
            "smoothed_ms_per_batch": list(self.smoothed_ms_per_batch),
            "phase": self.phase.name.lower(),
            "calibration_count": self.calibration_count,
            "trend_history": None if self.trend_history is None else list(self.trend_history),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ElCheState:
        """Parse a saved state; ConfigError names the bad field (the meta file is user-editable)."""

        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(
                f"resume: elche state field {field!r} {why}; fix or remove the meta file"
            )

        for key in ("anchor", "anchor_rank", "smoothed_ms_per_batch", "phase", "calibration_count"):
            if key not in d:
                raise bad(key, "is missing")
        anchor, rank, count = d["anchor"], d["anchor_rank"], d["calibration_count"]
        if not _is_int(anchor) or anchor < 1:
            raise bad("anchor", f"= {anchor!r}, must be an integer >= 1")
        if rank is not None and (not _is_int(rank) or rank < 0):
            raise bad("anchor_rank", f"= {rank!r}, must be a rank index or null")
        if not _is_int(count) or count < 0:
            raise bad("calibration_count", f"= {count!r}, must be an integer >= 0")
        smoothed = d["smoothed_ms_per_batch"]
        if not isinstance(smoothed, (list, tuple)) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for x in smoothed
        ):
            raise bad("smoothed_ms_per_batch", "must be a list of finite numbers >= 0")
        try:
            phase = Calibration[str(d["phase"]).upper()]
        except KeyError:
            raise bad(
                "phase", f"= {d['phase']!r}, must be probe, warmup, stable or mature"
            ) from None
        history = d.get("trend_history")
        if history is not None and (
            not isinstance(history, (list, tuple))
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in history)
        ):
            raise bad("trend_history", "must be a list of numbers or null")
        return cls(
            anchor=anchor,
            anchor_rank=rank,
            smoothed_ms_per_batch=tuple(float(x) for x in smoothed),
            phase=phase,
            calibration_count=count,
            trend_history=None if history is None else tuple(float(x) for x in history),
        )


class ElChe:
    """The cadence balancer for one world (see the module docstring for the algorithm).

    Contract: feed one :class:`WindowReport` per reduce with
    :meth:`report_window`, then exactly one guard verdict with
    :meth:`apply_verdict` (a pending growth proposal commits only on Stable).
    Read the schedule from :attr:`batch_counts`.
    """

    def __init__(self, config: ElCheConfig, world_size: int) -> None:
        if not _is_int(world_size) or world_size < 1:
            raise ConfigError(f"world_size = {world_size!r}: must be an integer >= 1")
        if config.anchor_rank is not None and config.anchor_rank >= world_size:
            raise ConfigError(
                f"elche.anchor_rank = {config.anchor_rank}: out of range for a world of "
                f"{world_size} ranks (valid 0..{world_size - 1})"
            )
        self.config = config
        self.world_size = world_size
        self._anchor = config.anchor
        self._anchor_rank = config.anchor_rank
        self._counts = [config.anchor] * world_size
        self._trust: list[deque[float]] = [
            deque(maxlen=TRUST_WINDOW_CAP) for _ in range(world_size)
        ]
        self._missed = [0] * world_size
        self._counts_history: deque[tuple[int, ...]] = deque(maxlen=BATCH_COUNTS_WINDOW_CAP)
        self._calibrated = False
        self._calibration_count = 0
        self._phase = Calibration.PROBE
        self._epoch_cap: int | None = None
        self._cap_binding = False
        self._slack_ms = [0.0] * world_size
        self._proposal: int | None = None
        self._growth_enabled = True
        self._consecutive_stable = 0

    # -- read side ---------------------------------------------------------

    @property
    def batch_counts(self) -> tuple[int, ...]:
        """Batches per rank for the current window (each >= 1)."""
        return tuple(self._counts)

    @property
    def anchor(self) -> int:
        return self._anchor

    @property
    def anchor_rank(self) -> int | None:
        return self._anchor_rank

    @property
    def phase(self) -> Calibration:
        return self._phase

    @property
    def calibration_count(self) -> int:
        return self._calibration_count

    @property
    def is_calibrated(self) -> bool:
        return self._calibrated

    @property
    def proposed_anchor(self) -> int | None:
        """The pending growth proposal (committed by the next Stable verdict)."""
        return self._proposal

    @property
    def growth_enabled(self) -> bool:
        """False after a SuppressGrowth/NudgeDown until five Stable verdicts in a row."""
        return self._growth_enabled

    @property
    def window_cap_binding(self) -> bool:
        """True when the last recompute had to shrink counts to fit the epoch cap."""
        return self._cap_binding

    def smoothed_ms_per_batch(self, rank: int) -> float | None:
        """Mean of the rank's trust window; None without samples."""
        w = self._trust[rank]
        return sum(w) / len(w) if w else None

    def ms_per_batch(self) -> tuple[float, ...]:
        """Smoothed ms/batch per rank, 0.0 where there is no sample."""
        return tuple(self._smoothed(r) for r in range(self.world_size))

    def anchor_wall_ms(self) -> float:
        """Expected wall time of the anchor rank's window (0 before calibration)."""
        if not self._calibrated or self._anchor_rank is None:
            return 0.0
        return self._anchor * self._smoothed(self._anchor_rank)

    def recent_batch_share(self) -> tuple[float, ...]:
        """Each rank's share of batches, averaged over the last ten schedules."""
        snaps = list(self._counts_history) or [tuple(self._counts)]
        means = [sum(s[r] for s in snaps) / len(snaps) for r in range(self.world_size)]
        total = sum(means)
        if total <= 0:
            return tuple(1.0 / self.world_size for _ in range(self.world_size))
        return tuple(m / total for m in means)

    def has_speed_hint(self) -> bool:
        """True once the schedule is not uniform (some rank known to be faster)."""
        return len(set(self._counts)) > 1

    # -- write side --------------------------------------------------------

    def set_epoch_cap(self, max_total_batches: int | None) -> None:
        """Cap a window's total batches at one epoch's worth (None lifts the cap).

        Applied to the current counts at once and to every later recompute.
        When more ranks than batches exist the floor of 1 per rank wins; that
        is harmless because dispatch hands out only what the pool holds.
        """
        if max_total_batches is not None and (
            not _is_int(max_total_batches) or max_total_batches < 1
        ):
            raise CoordinatorError(
                f"epoch cap = {max_total_batches!r}: must be an integer >= 1 or None"
            )
        self._epoch_cap = max_total_batches
        self._apply_cap()

    def stage_callback_slack(self, slack_ms: Sequence[float]) -> None:
        """Shrink each rank's next window by the time its callbacks will take (one-shot).

        Used for the last window of an epoch, so the callback runs in freed
        time instead of extending the barrier.
        """
        self._check_len("slack_ms", slack_ms)
        self._slack_ms = [s if math.isfinite(s) and s > 0 else 0.0 for s in slack_ms]

    def report_window(self, report: WindowReport) -> None:
        """Calibrate from one reduce window (see the module docstring, steps 1-5)."""
        self._check_len("WindowReport", report.wall_ms)
        # A proposal belongs to the window that made it; the verdict for
        # that window has already committed or dropped it.
        self._proposal = None
        ms, batches = report.feed()
        if not any(b > 0 for b in batches):
            return  # nothing ran: no evidence, and no rank missed a report
        for r in range(self.world_size):
            if batches[r] > 0 and math.isfinite(ms[r]) and ms[r] > 0:
                self._trust[r].append(ms[r] / batches[r])
                self._missed[r] = 0
            else:
                self._missed[r] += 1
                if self._missed[r] >= MISSED_REPORTS_TO_FORGET:
                    self._trust[r].clear()

        if self._anchor_rank is None or self._phase >= Calibration.STABLE:
            self._elect()
        if self._anchor_rank is None:
            return
        slow_ms = self._smoothed(self._anchor_rank)
        if slow_ms <= 0 and self._missed[self._anchor_rank] >= MISSED_REPORTS_TO_FORGET:
            # A pinned anchor that died would freeze calibration for good in
            # Warmup (election closed): re-elect among ranks with data.
            self._anchor_rank = None
            self._elect()
            if self._anchor_rank is None:
                return
            slow_ms = self._smoothed(self._anchor_rank)
        if slow_ms <= 0:
            return

        if self._phase >= Calibration.WARMUP:
            self._propose_growth(slow_ms, report.sync_ms, report.fill_ms[self._anchor_rank])
        self._recompute(slow_ms)
        self._counts_history.append(tuple(self._counts))
        self._calibrated = True
        self._calibration_count += 1
        self._advance_phase()

    def apply_verdict(self, verdict: GuardVerdict) -> None:
        """The single seam through which guards and the meta-controller steer the anchor."""
        if verdict.kind is GuardVerdictKind.STABLE:
            self._consecutive_stable += 1
            if self._consecutive_stable >= GROWTH_REARM_STABLE:
                self._growth_enabled = True
            if self._proposal is not None:
                self._anchor = self._proposal
                self._proposal = None
                self._refresh_counts()
            if verdict.relax_up:
                self.relax_anchor_up()
            return
        # Both pressure verdicts drop the proposal first and latch growth
        # off; for a nudge the order matters (see the module docstring).
        self._proposal = None
        self._consecutive_stable = 0
        self._growth_enabled = False
        if verdict.kind is GuardVerdictKind.NUDGE_DOWN and math.isfinite(verdict.factor):
            lo, hi = NUDGE_FACTOR_RANGE
            f = min(hi, max(lo, verdict.factor))
            self._anchor = min(self._anchor, max(1, math.ceil(self._anchor * f)))
            self._refresh_counts()

    def relax_anchor_up(self) -> bool:
        """Grow the anchor by one; returns False when max_anchor or max_batch_diff forbids it."""
        if self._anchor >= self.config.max_anchor:
            return False
        mbd = self.config.max_batch_diff
        rates = [m for m in self.ms_per_batch() if m > 0]
        if mbd is not None and rates:
            nxt = self._anchor + 1
            lead = _round_half_up(nxt * max(rates) / min(rates)) - nxt
            if lead > mbd:
                return False
        self._anchor += 1
        self._refresh_counts()
        return True

    # -- state -------------------------------------------------------------

    def state(self) -> ElCheState:
        """Snapshot for a checkpoint (``trend_history`` is the coordinator's to fill)."""
        return ElCheState(
            anchor=self._anchor,
            anchor_rank=self._anchor_rank,
            smoothed_ms_per_batch=self.ms_per_batch(),
            phase=self._phase,
            calibration_count=self._calibration_count,
        )

    @classmethod
    def from_state(cls, config: ElCheConfig, world_size: int, state: ElCheState) -> ElChe:
        """Rebuild from a checkpoint with (possibly new) knobs; the world size must match.

        Each trust window is seeded with one sample, the saved mean, so the
        schedule resumes where it was and fresh samples take over quickly.
        The anchor is clamped to the new ``max_anchor``.
        """
        if len(state.smoothed_ms_per_batch) != world_size:
            raise ConfigError(
                f"resume: the checkpoint was taken with world size "
                f"{len(state.smoothed_ms_per_batch)} but this run has {world_size}; "
                "resume with the same number of ranks"
            )
        if state.anchor_rank is not None and state.anchor_rank >= world_size:
            raise ConfigError(
                f"resume: saved anchor_rank {state.anchor_rank} is out of range for "
                f"world size {world_size}"
            )
        el = cls(config, world_size)
        el._anchor = min(state.anchor, config.max_anchor)
        el._anchor_rank = state.anchor_rank
        el._phase = state.phase
        el._calibration_count = state.calibration_count
        for r, ms in enumerate(state.smoothed_ms_per_batch):
            if ms > 0:
                el._trust[r].append(ms)
        el._counts = [el._anchor] * world_size
        el._refresh_counts()  # uncalibrated here: the counts land without a dead zone
        el._calibrated = any(ms > 0 for ms in state.smoothed_ms_per_batch)
        return el

    # -- internals ---------------------------------------------------------

    def _check_len(self, what: str, values: Sequence[object]) -> None:
        if len(values) != self.world_size:
            raise CoordinatorError(
                f"{what} has {len(values)} per-rank entries for a world of {self.world_size}"
            )

    def _smoothed(self, rank: int) -> float:
        w = self._trust[rank]
        return sum(w) / len(w) if w else 0.0

    def _elect(self) -> None:
        rates = {r: self._smoothed(r) for r in range(self.world_size)}
        rates = {r: m for r, m in rates.items() if m > 0}
        if not rates:
            return
        slowest = max(rates.values())
        cohort = sorted(r for r, m in rates.items() if m >= (1.0 - COHORT_BAND) * slowest)
        current = self._anchor_rank
        if len(cohort) == 1:
            self._anchor_rank = cohort[0]
        elif current in cohort:
            challenger = max((r for r in cohort if r != current), key=lambda r: rates[r])
            if rates[challenger] >= rates[current] * (1.0 + DOMINANCE_MARGIN):
                self._anchor_rank = challenger
        else:
            self._anchor_rank = cohort[0]

    def _propose_growth(self, slow_ms: float, sync_ms: float, fill_ms: float) -> None:
        if not self.config.window_growth or not self._growth_enabled or self._cap_binding:
            return
        fixed = sync_ms + fill_ms
        if not math.isfinite(fixed) or fixed <= 0:
            return
        overhead = fixed / (self._anchor * slow_ms + fixed)
        target = self.config.overhead_target
        # Warmup numbers are still noisy: only a clearly fixed-cost-bound
        # window may grow before Stable.
        fire_at = target if self._phase >= Calibration.STABLE else WARMUP_GROWTH_MARGIN * target
        if overhead <= fire_at:
            return
        scale = min(overhead / target, GROWTH_STEP_CAP)
        # The epsilon keeps float noise (20.000000001) from adding a batch.
        grown = math.ceil(self._anchor * scale - 1e-9)
        grown = min(self.config.max_anchor, max(self.config.growth_floor, grown))
        if grown > self._anchor:
            self._proposal = grown

    def _refresh_counts(self) -> None:
        """Recompute counts after an anchor change outside a report."""
        slow_ms = self._smoothed(self._anchor_rank) if self._anchor_rank is not None else 0.0
        if slow_ms > 0:
            self._recompute(slow_ms)
        else:
            self._counts = [self._anchor] * self.world_size
            self._apply_cap()

    def _recompute(self, slow_ms: float) -> None:
        mbd = self.config.max_batch_diff
        for r in range(self.world_size):
            ms = self._smoothed(r)
            if ms <= 0 or abs(ms - slow_ms) < SAME_RATE_MS:
                target = self._anchor
            else:
                target = max(1, _round_half_up(self._anchor * min(slow_ms / ms, MAX_SPEED_RATIO)))
            slack_ms = self._slack_ms[r]
            slack = math.ceil(slack_ms / ms) if slack_ms > 0 and ms > 0 else 0
            target = max(1, target - slack)
            current = self._counts[r]
            if not self._calibrated or slack > 0 or abs(target - current) > DEAD_ZONE * current:
                if mbd is not None and self._calibrated:
                    target = current + max(-mbd, min(mbd, target - current))
                self._counts[r] = max(1, target)
        self._slack_ms = [0.0] * self.world_size
        self._apply_cap()

    def _apply_cap(self) -> None:
        cap = self._epoch_cap
        total = sum(self._counts)
        self._cap_binding = cap is not None and total > cap
        if cap is None or total <= cap:
            return
        counts = [max(1, c * cap // total) for c in self._counts]
        # Hand the rounding difference to the largest counts (lowest index on
        # ties) so the window sums to exactly the cap where the floor of 1
        # per rank allows it.
        diff = cap - sum(counts)
        order = sorted(range(self.world_size), key=lambda r: (-counts[r], r))
        if diff > 0:
            counts[order[0]] += diff
        for r in order:
            if diff >= 0:
                break
            take = min(-diff, counts[r] - 1)
            counts[r] -= take
            diff += take
        self._counts = counts

    def _advance_phase(self) -> None:
        n = self._calibration_count
        if self._phase is Calibration.PROBE:
            self._phase = Calibration.WARMUP
        elif self._phase is Calibration.WARMUP and n >= STABLE_AT:
            self._phase = Calibration.STABLE
        elif self._phase is Calibration.STABLE and n >= MATURE_AT:
            self._phase = Calibration.MATURE
