"""Window feedback: what the metrics of a finished window teach the next one.

Between two reduces the coordinator gathers a window's measurements: each
rank's batch timings (the `WindowLedger`), its learning rate (`LrUpdate`),
and at the reduce each rank's divergence from the consensus (`SyncAck`).
When the cycle finishes, `WindowFeedback.close` turns them into the next
window's schedule: ElChe's per-rank batch counts, the guard's verdict on
window growth, and Async's overshoot.

Rules this module keeps:

- **Pure, and one step per window, in two halves.** `calibrate` runs once
  per published consensus (the timings: the next plans ride beside that
  consensus, PROTOCOL.md 10.1), `judge` once its every live rank has
  acknowledged it (the divergence samples and each live rank's window
  steps); no clocks, sockets or records. The coordinator opens no window
  between the two. A window torn down by the reducer teaches nothing: its
  measurements stay in the ledger and count towards the next one.
- **Calibrate before judging.** ElChe takes the window's timings first, then
  the verdict: the guard judges the window that was just measured. The
  plans sent with the consensus are sized before the verdict, so a verdict
  (growth adopted, a nudge down) steers the window after next.
- **The LR meta-controller shrinks before the guard's verdict applies.** A
  NudgeDown it returns (an LR cliff, or sustained guard pressure) goes to
  ElChe first, which discards any pending growth proposal, so the guard's
  verdict in the same window cannot adopt the growth the nudge meant to stop.
- **Only Async relaxes upward.** With `relax_up` set, a Stable verdict under
  Async also grows the anchor by one (within `max_anchor` and
  `max_batch_diff`); the barrier modes ignore the setting.
- **Sync feeds only the compute scale.** Its windows are about one step per
  rank, and the delivered scale counts only batches 2..n of a window (the
  first is pipeline fill; timing.py).
- **The round trip is amortized one window late.** Each window's report
  carries the duration of the cycle that closed the *previous* window: the
  current one is still in flight when its window is measured.
- **Overshoot auto-tunes up slowly and resets at once** (Async, when not
  pinned): one more step of lookahead per Stable window up to the ceiling,
  back to the initial value on a NudgeDown, since lookahead is what lets a
  fast rank drift from the consensus.
- **A resume continues the trajectory.** ElChe restarts from its saved
  state (anchor, phase, rates) and the TrendGuard from its saved ring
  (`state()` writes both), so a resumed run keeps its schedule instead of
  probing again, and a divergence that was rising still counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flodl_zmq.coordinator.config import CoordinatorConfig, GuardKind, Mode
from flodl_zmq.coordinator.convergence import (
    ConvergenceGuard,
    DivergenceReport,
    DivergenceSample,
    GuardVerdict,
    GuardVerdictKind,
    LrEventMeta,
    MsfGuard,
    NoGuard,
    TrendGuard,
)
from flodl_zmq.coordinator.elche import ElChe, ElCheState
from flodl_zmq.coordinator.timing import WindowLedger


def make_guard(config: CoordinatorConfig, history: Sequence[float] = ()) -> ConvergenceGuard:
    """The guard `config` asks for; a TrendGuard starts from `history` (a checkpoint's ring)."""
    kind = config.guard
    if kind is GuardKind.NONE:
        return NoGuard()
    if kind is GuardKind.MSF:
        if config.msf_thresholds is None:
            return MsfGuard()
        suppress, nudge = config.msf_thresholds
        return MsfGuard(suppress_threshold=suppress, nudge_threshold=nudge)
    return TrendGuard.with_history(config.guard_threshold, list(history))


class WindowFeedback:
    """ElChe, the convergence guard, the LR meta-controller and overshoot for one run.

    `resume` is the ElChe state of a checkpoint (`state()` of an earlier run);
    None starts a fresh calibration. The coordinator feeds `ledger` every
    `Batch` and callback cost, `on_lr` every `LrUpdate`, and calls `calibrate`
    once per published consensus and `judge` once it is acknowledged.
    """

    def __init__(
        self, config: CoordinatorConfig, world_size: int, resume: ElCheState | None = None
    ) -> None:
        self.world_size = world_size
        self.ledger = WindowLedger(world_size)
        if resume is None:
            self.elche = ElChe(config.elche_config(world_size), world_size)
        else:
            self.elche = ElChe.from_state(config.elche_config(world_size), world_size, resume)
        self.elche.set_epoch_cap(config.batches_per_epoch)
        self.guard = make_guard(config, () if resume is None else resume.trend_history or ())
        self.meta = LrEventMeta() if config.meta_controller else None
        self._mode = config.mode
        self._relax_up = config.relax_up
        init, self._overshoot_ceiling, self._overshoot_auto = config.overshoot_bounds
        self._overshoot_initial = init
        self.overshoot = init
        self._lr: list[float | None] = [None] * world_size
        self._round_trip_ms = 0.0  # the cycle that closed the previous window
        # The last close's verdict and worst divergence, for the run log (what the guard saw).
        self.last_verdict: GuardVerdict | None = None
        self.last_divergence: float | None = None

    def on_lr(self, rank: int, lr: float) -> None:
        """`rank` reported its learning rate (the meta-controller reads the first rank's)."""
        self._lr[rank] = lr

    def calibrate(self, live: Sequence[bool], round_trip_ms: float) -> None:
        """A consensus was published: ElChe takes the window's timings, the ledger starts the next window.

        `round_trip_ms` is this cycle's duration, which the next window amortizes.
        """
        report = self.ledger.report(live, self._mode is not Mode.SYNC, self._round_trip_ms)
        self.elche.report_window(report)
        self.ledger.reset_steps()
        self.ledger.reset_timing()
        self._round_trip_ms = round_trip_ms

    def judge(self, divergence: Sequence[DivergenceSample | None], live_steps: Sequence[int]) -> GuardVerdict:
        """Every live rank acknowledged the consensus: the guard's verdict on the window; returns it as applied.

        `divergence` has one entry per rank (None: no finite sample),
        `live_steps` each live rank's window steps (the guard's k_used and
        k_max).
        """
        div = DivergenceReport.from_samples(divergence)
        verdict = self.guard.report(div, sum(live_steps), max(live_steps, default=0))
        if self.meta is not None:
            lr = next((x for x in self._lr if x is not None), None)
            nudge = self.meta.observe(lr, self.elche.anchor, verdict, self.elche.phase)
            if nudge is not None:
                self.elche.apply_verdict(nudge)  # discards any pending growth first
        if verdict.kind is GuardVerdictKind.STABLE and self._mode is Mode.ASYNC:
            verdict = GuardVerdict.stable(relax_up=self._relax_up)
        self.elche.apply_verdict(verdict)
        if self._overshoot_auto:
            if verdict.kind is GuardVerdictKind.STABLE:
                self.overshoot = min(self.overshoot + 1, self._overshoot_ceiling)
            elif verdict.kind is GuardVerdictKind.NUDGE_DOWN:
                self.overshoot = self._overshoot_initial
        self.last_verdict, self.last_divergence = verdict, div.max_relative_delta
        return verdict

    def state(self) -> ElCheState:
        """ElChe's state with the TrendGuard's ring: what a resume needs to continue."""
        state = self.elche.state()
        if isinstance(self.guard, TrendGuard):
            state = dataclasses.replace(state, trend_history=tuple(self.guard.history()))
        return state

    def smoothed_ms(self) -> list[float | None]:
        """Each rank's smoothed ms per batch (None before its first sample)."""
        return [self.elche.smoothed_ms_per_batch(r) for r in range(self.world_size)]
