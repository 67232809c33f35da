"""Divergence measure, guards and the LR-event meta-controller."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.coordinator.convergence import (
    Calibration,
    DivergenceReport,
    DivergenceSample,
    GuardVerdict,
    GuardVerdictKind,
    LambdaEstimator,
    LrEventMeta,
    MsfGuard,
    NoGuard,
    TrendGuard,
    base_factor,
    divergence_triple,
    sustain_k,
)
from flodl_zmq.errors import ConfigError

STABLE = GuardVerdict.stable()
SUPPRESS = GuardVerdict.suppress_growth()


def report(d: float) -> DivergenceReport:
    return DivergenceReport((d,), None, None)


# -- the measure -------------------------------------------------------------


def test_empty_param_list_is_zero_none_none():
    assert divergence_triple([], []) == DivergenceSample(0.0, None, None)


def test_length_mismatch_errors():
    with pytest.raises(ConfigError, match="same parameter list"):
        divergence_triple([torch.zeros(2)], [])


def test_shape_mismatch_errors():
    with pytest.raises(ConfigError, match="parameter 0"):
        divergence_triple([torch.zeros(2)], [torch.zeros(3)])


def test_matches_hand_computed_triple():
    d, post, pre = divergence_triple([torch.tensor([3.0, 4.0])], [torch.tensor([6.0, 8.0])])
    assert (d, post, pre) == pytest.approx((0.5, 10.0, 5.0))


def test_norms_are_global_over_the_parameter_list():
    pre = [torch.tensor([3.0]), torch.tensor([4.0])]
    post = [torch.tensor([6.0]), torch.tensor([8.0])]
    assert divergence_triple(pre, post) == pytest.approx((0.5, 10.0, 5.0))


def test_zero_post_norm_is_guarded():
    d, post, pre = divergence_triple([torch.ones(3)], [torch.zeros(3)])
    assert d == 0.0 and post == 0.0 and pre == pytest.approx(math.sqrt(3))


def test_bf16_post_matches_f32_reference():
    g = torch.Generator().manual_seed(0)
    pre = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g)]
    post = [p + 0.01 * torch.randn(p.shape, generator=g) for p in pre]
    post_bf16 = [p.to(torch.bfloat16) for p in post]
    ref = divergence_triple(pre, [p.to(torch.bfloat16).float() for p in post])
    got = divergence_triple(pre, post_bf16)
    assert got == pytest.approx(ref, rel=1e-5)
    assert got.divergence == pytest.approx(divergence_triple(pre, post).divergence, rel=0.1)


# -- the report --------------------------------------------------------------


def test_max_relative_delta_picks_worst_rank():
    rep = DivergenceReport.from_samples(
        [DivergenceSample(0.1, 10.0, 9.0), DivergenceSample(0.4, 10.0, 11.0), None]
    )
    assert rep.max_relative_delta == 0.4
    assert rep.deltas == (0.1, 0.4, 0.0)
    assert rep.post_norm == 10.0


def test_max_relative_delta_empty_is_zero():
    assert DivergenceReport.from_samples([]).max_relative_delta == 0.0


def test_cosine_similarities_none_when_missing_norms():
    rep = DivergenceReport.from_samples([DivergenceSample(0.1, 10.0, 9.0), None])
    assert rep.pre_norms is None
    assert rep.cosine_similarities() is None
    assert rep.magnitude_shifts() is None


def test_cosine_similarities_correct_for_small_delta():
    pre, post = torch.tensor([1.0, 0.01]), torch.tensor([1.0, 0.0])
    rep = DivergenceReport.from_samples([divergence_triple([pre], [post])])
    expected = float(torch.nn.functional.cosine_similarity(pre, post, dim=0))
    assert rep.cosine_similarities() == pytest.approx((expected,), abs=1e-6)


def test_magnitude_shifts_correct():
    rep = DivergenceReport.from_samples(
        [DivergenceSample(0.1, 10.0, 10.5), DivergenceSample(0.1, 10.0, 9.8)]
    )
    assert rep.magnitude_shifts() == pytest.approx((0.5, -0.2))


# -- NoGuard / TrendGuard ------------------------------------------------------


def test_no_guard_is_always_stable():
    guard = NoGuard()
    for d in (0.1, 0.2, 0.3, 0.4, 10.0):
        assert guard.report(report(d), 10, 10) == STABLE


def test_trend_default_threshold_is_0_01():
    assert TrendGuard().threshold == 0.01


def test_trend_3_rises_above_threshold_suppress():
    guard = TrendGuard(0.01)
    assert guard.report(report(0.02), 1, 1) == STABLE
    assert guard.report(report(0.03), 1, 1) == STABLE
    assert guard.report(report(0.04), 1, 1) == SUPPRESS


def test_trend_non_rising_is_stable():
    guard = TrendGuard(0.01)
    verdicts = [guard.report(report(d), 1, 1) for d in (0.03, 0.02, 0.04, 0.04)]
    assert verdicts == [STABLE] * 4


def test_trend_below_threshold_is_stable():
    guard = TrendGuard(0.01)
    verdicts = [guard.report(report(d), 1, 1) for d in (0.001, 0.002, 0.003)]
    assert verdicts == [STABLE] * 3


def test_trend_history_capped_at_5():
    guard = TrendGuard()
    for d in range(8):
        guard.report(report(float(d)), 1, 1)
    assert guard.history() == [3.0, 4.0, 5.0, 6.0, 7.0]


def test_trend_reset_clears_history():
    guard = TrendGuard()
    guard.report(report(0.5), 1, 1)
    guard.reset()
    assert guard.history() == []


def test_trend_history_snapshot_roundtrip():
    guard = TrendGuard(0.05)
    for d in (0.1, 0.05, 0.2):
        guard.report(report(d), 1, 1)
    assert TrendGuard.with_history(0.05, guard.history()).history() == guard.history()


def test_trend_with_history_skips_warmup_after_restore():
    guard = TrendGuard.with_history(0.01, [0.02, 0.03])
    assert guard.report(report(0.04), 1, 1) == SUPPRESS


def test_trend_with_history_truncates_oversize_input():
    guard = TrendGuard.with_history(0.01, [float(i) for i in range(9)])
    assert guard.history() == [4.0, 5.0, 6.0, 7.0, 8.0]


def test_trend_rejects_a_negative_threshold():
    with pytest.raises(ConfigError, match="threshold"):
        TrendGuard(-1.0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), max_size=30))
def test_trend_guard_never_nudges(ds):
    guard = TrendGuard(0.01)
    assert all(guard.report(report(d), 5, 5).kind is not GuardVerdictKind.NUDGE_DOWN for d in ds)


# -- lambda estimator --------------------------------------------------------


def test_lambda_first_event_is_none():
    est = LambdaEstimator()
    assert est.observe(1e-3, 4) is None
    assert est.lambda_ema is None


def test_lambda_growth_positive_uses_k_max():
    est = LambdaEstimator()
    est.observe(1e-3, 4)
    assert est.observe(2e-3, 4) == pytest.approx(math.log(2) / 4)


def test_lambda_decay_negative_uses_k_max():
    est = LambdaEstimator()
    est.observe(2e-3, 8)
    assert est.observe(1e-3, 8) == pytest.approx(-math.log(2) / 8)


def test_lambda_k_max_unchanged_by_world_size():
    small, large = MsfGuard(), MsfGuard()
    for d in (1e-3, 2e-3):
        small.report(DivergenceReport((d, d), None, None), k_used=8, k_max=4)
        large.report(DivergenceReport((d,) * 8, None, None), k_used=32, k_max=4)
    assert small.lambda_raw == large.lambda_raw == pytest.approx(math.log(2) / 4)


def test_lambda_noise_floor_resets_estimator():
    est = LambdaEstimator()
    est.observe(1e-3, 4)
    assert est.observe(1e-9, 4) is None
    assert est.observe(2e-3, 4) is None  # the chain restarts: no previous D


def test_lambda_ema_bias_corrected_at_warmup():
    est = LambdaEstimator()
    est.observe(1e-3, 1)
    raw = est.observe(3e-3, 1)
    assert est.lambda_ema == pytest.approx(raw)


def test_lambda_ema_smooths_over_constant_input():
    est = LambdaEstimator()
    d = 1e-3
    for _ in range(10):
        est.observe(d, 5)
        d *= math.exp(5 * 0.002)
    assert est.lambda_ema == pytest.approx(0.002)


# -- MsfGuard ------------------------------------------------------------------


def growing(guard: MsfGuard, rate: float, n: int, k_max: int = 10) -> list[GuardVerdict]:
    d, out = 1e-3, []
    for _ in range(n):
        out.append(guard.report(report(d), k_max * 2, k_max))
        d *= math.exp(rate * k_max)
    return out


def test_msf_default_starts_stable():
    assert MsfGuard().report(report(0.5), 10, 10) == STABLE


def test_msf_suppress_fires_after_sustain():
    verdicts = growing(MsfGuard(), rate=0.005, n=4)  # above 1e-3, below 1e-2
    assert verdicts[:3] == [STABLE] * 3
    assert verdicts[3] == SUPPRESS


def test_msf_nudge_fires_on_sustained_steeper_growth():
    verdicts = growing(MsfGuard(), rate=0.05, n=4)
    assert verdicts[3] == GuardVerdict.nudge_down(0.5)


def test_msf_decaying_lambda_does_not_fire():
    assert growing(MsfGuard(), rate=-0.01, n=10) == [STABLE] * 10


def test_msf_firing_resets_its_streak():
    verdicts = growing(MsfGuard(), rate=0.005, n=7)
    assert verdicts[3:] == [SUPPRESS, STABLE, STABLE, SUPPRESS]


def test_msf_without_nudge_disables_hard_trigger():
    verdicts = growing(MsfGuard.without_nudge(), rate=0.05, n=4)
    assert verdicts[3] == SUPPRESS


def test_msf_telemetry_carries_lambda():
    guard = MsfGuard()
    growing(guard, rate=0.005, n=3)
    assert guard.lambda_raw == pytest.approx(0.005)
    assert guard.lambda_ema == pytest.approx(0.005)


def test_msf_reset_clears_state():
    guard = MsfGuard()
    growing(guard, rate=0.005, n=3)
    guard.reset()
    assert guard.lambda_ema is None
    assert growing(guard, rate=0.005, n=3) == [STABLE] * 3


@pytest.mark.parametrize(
    ("knobs", "setting"),
    [({"suppress_sustain": 0}, "suppress_sustain"), ({"nudge_factor": 0.0}, "nudge_factor")],
)
def test_msf_invalid_knobs_name_the_setting(knobs, setting):
    with pytest.raises(ConfigError, match=setting):
        MsfGuard(**knobs)


# -- LR-event meta-controller ------------------------------------------------


def observe_many(meta: LrEventMeta, steps):
    return [meta.observe(lr, a, v, p) for lr, a, v, p in steps]


def test_single_observation_emits_noop():
    assert LrEventMeta().observe(0.1, 10, SUPPRESS, Calibration.MATURE) is None


def test_no_lr_report_is_a_noop():
    meta = LrEventMeta()
    assert meta.observe(None, 10, SUPPRESS, Calibration.MATURE) is None
    assert meta.observe(None, 10, SUPPRESS, Calibration.MATURE) is None
    assert meta.observe(0.1, 10, SUPPRESS, Calibration.MATURE) is None  # nothing was recorded


def test_observe_records_into_windows_with_cap():
    meta = LrEventMeta()
    meta.observe(0.1, 1000, STABLE, Calibration.STABLE)
    for _ in range(5):
        meta.observe(0.1, 10, STABLE, Calibration.STABLE)
    assert meta.anchor_trend() == 0.0  # the 1000 fell out of the five-slot window


def test_probe_phase_silences_both_watchers():
    meta = LrEventMeta()
    out = observe_many(
        meta, [(0.1, 10, SUPPRESS, Calibration.PROBE)] * 5 + [(0.01, 10, SUPPRESS, Calibration.PROBE)]
    )
    assert out == [None] * 6


def test_lr_cliff_fires_on_multistep_drop():
    meta = LrEventMeta()
    meta.observe(0.1, 10, STABLE, Calibration.STABLE)
    assert meta.observe(0.01, 10, STABLE, Calibration.STABLE) == GuardVerdict.nudge_down(0.5)


def test_lr_cliff_fires_once_per_drop():
    meta = LrEventMeta()
    meta.observe(0.1, 10, STABLE, Calibration.STABLE)
    assert meta.observe(0.01, 10, STABLE, Calibration.STABLE) is not None
    assert meta.observe(0.01, 10, STABLE, Calibration.STABLE) is None
    assert meta.observe(0.01, 10, STABLE, Calibration.STABLE) is None


def test_lr_cliff_silent_on_smooth_decay():
    meta = LrEventMeta()
    lr, out = 0.1, []
    for _ in range(20):
        out.append(meta.observe(lr, 10, STABLE, Calibration.STABLE))
        lr *= 0.9
    assert out == [None] * 20


def test_lr_cliff_silent_on_lr_rise():
    meta = LrEventMeta()
    out = observe_many(meta, [(0.01, 10, STABLE, Calibration.STABLE), (0.1, 10, STABLE, Calibration.STABLE)])
    assert out == [None, None]


def test_lr_cliff_silent_with_too_short_window():
    meta = LrEventMeta()
    assert meta.observe(0.0001, 10, STABLE, Calibration.STABLE) is None


@pytest.mark.parametrize(("drop", "fires"), [(0.25, False), (0.35, True)])
def test_lr_cliff_threshold_at_boundary(drop, fires):
    meta = LrEventMeta()
    meta.observe(1.0, 10, STABLE, Calibration.STABLE)
    assert (meta.observe(1.0 - drop, 10, STABLE, Calibration.STABLE) is not None) is fires


def test_convergence_fires_after_k_consecutive_at_stable():
    meta = LrEventMeta()
    out = observe_many(meta, [(0.1, 10, SUPPRESS, Calibration.STABLE)] * 3)
    assert out == [None, None, GuardVerdict.nudge_down(0.5)]


def test_convergence_silent_on_isolated_nudge():
    meta = LrEventMeta()
    steps = [(0.1, 10, STABLE, Calibration.STABLE), (0.1, 10, GuardVerdict.nudge_down(0.5), Calibration.STABLE)]
    assert observe_many(meta, steps + [(0.1, 10, STABLE, Calibration.STABLE)]) == [None] * 3


def test_convergence_silent_on_two_at_stable_needs_three():
    meta = LrEventMeta()
    assert observe_many(meta, [(0.1, 10, SUPPRESS, Calibration.STABLE)] * 2) == [None, None]


def test_convergence_at_mature_needs_only_two():
    meta = LrEventMeta()
    out = observe_many(meta, [(0.1, 10, SUPPRESS, Calibration.MATURE)] * 2)
    assert out[1] == GuardVerdict.nudge_down(pytest.approx(0.7))


def test_convergence_mixed_sustained_kinds_fire():
    meta = LrEventMeta()
    nudge = GuardVerdict.nudge_down(0.5)
    steps = [(0.1, 10, v, Calibration.STABLE) for v in (SUPPRESS, nudge, SUPPRESS)]
    assert observe_many(meta, steps)[2] is not None


def test_convergence_evidence_is_consumed_by_firing():
    meta = LrEventMeta()
    out = observe_many(meta, [(0.1, 10, SUPPRESS, Calibration.MATURE)] * 4)
    assert [o is not None for o in out] == [False, True, False, True]


def test_anchor_trend_rising():
    meta = LrEventMeta()
    observe_many(meta, [(0.1, a, STABLE, Calibration.STABLE) for a in (10, 30)])
    assert meta.anchor_trend() == pytest.approx(0.5)


def test_anchor_trend_falling():
    meta = LrEventMeta()
    observe_many(meta, [(0.1, a, STABLE, Calibration.STABLE) for a in (30, 10)])
    assert meta.anchor_trend() == pytest.approx(-0.5)


def test_anchor_trend_stable_near_zero():
    meta = LrEventMeta()
    observe_many(meta, [(0.1, a, STABLE, Calibration.STABLE) for a in (100, 101, 100, 99, 100)])
    assert abs(meta.anchor_trend()) < 0.01
    assert meta.is_settled()


def test_anchor_trend_short_window_is_zero():
    meta = LrEventMeta()
    meta.observe(0.1, 50, STABLE, Calibration.STABLE)
    assert meta.anchor_trend() == 0.0


def test_is_settled_within_epsilon():
    meta = LrEventMeta()
    observe_many(meta, [(0.1, a, STABLE, Calibration.STABLE) for a in (100, 100, 100, 100, 140)])
    assert meta.anchor_trend() == pytest.approx(32 / 108)
    assert not meta.is_settled()


def test_effective_factor_symmetric_around_zero_trend():
    up, down = LrEventMeta(), LrEventMeta()
    observe_many(up, [(0.1, a, STABLE, Calibration.STABLE) for a in (10, 30)])
    observe_many(down, [(0.1, a, STABLE, Calibration.STABLE) for a in (30, 10)])
    assert up.effective_factor(0.5) == pytest.approx(0.25)
    assert down.effective_factor(0.5) == pytest.approx(0.75)


def test_effective_factor_clamps_at_extremes():
    up, down = LrEventMeta(), LrEventMeta()
    observe_many(up, [(0.1, a, STABLE, Calibration.STABLE) for a in (1, 1000)])
    observe_many(down, [(0.1, a, STABLE, Calibration.STABLE) for a in (1000, 1)])
    assert up.effective_factor(0.5) == 0.1
    assert down.effective_factor(0.5) == 0.95


def test_both_watchers_compound_factor_at_mature():
    meta = LrEventMeta()
    meta.observe(0.1, 10, SUPPRESS, Calibration.MATURE)
    assert meta.observe(0.01, 10, SUPPRESS, Calibration.MATURE) == GuardVerdict.nudge_down(pytest.approx(0.35))


def test_per_phase_base_factors_match_design():
    assert [base_factor(p) for p in Calibration] == [None, 0.3, 0.5, 0.7]


def test_per_phase_sustain_k_match_design():
    assert [sustain_k(p) for p in Calibration] == [5, 5, 3, 2]


def test_trend_dampens_subsequent_nudge_after_cliff():
    meta = LrEventMeta()
    observe_many(meta, [(0.1, 100, STABLE, Calibration.STABLE)] * 4)
    out = meta.observe(0.01, 50, STABLE, Calibration.STABLE)
    assert out is not None and out.factor == pytest.approx(0.5 + 0.5 * 40 / 90)


def test_trend_amplifies_nudge_during_relax_up_climb():
    meta = LrEventMeta()
    out = observe_many(meta, [(0.1, a, SUPPRESS, Calibration.STABLE) for a in (10, 12, 14)])
    assert out[2] is not None and out[2].factor < 0.5


def test_meta_invalid_knobs_name_the_setting():
    with pytest.raises(ConfigError, match="sharp_drop_threshold"):
        LrEventMeta(sharp_drop_threshold=1.5)
