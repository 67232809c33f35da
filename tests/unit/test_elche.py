"""ElChe: calibration, election, growth, verdicts, caps and resume state."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.coordinator.elche import Calibration, ElChe, ElCheConfig, ElCheState, GuardVerdict
from flodl_zmq.coordinator.timing import WindowReport
from flodl_zmq.errors import ConfigError, CoordinatorError


def compute_report(ms_per_batch, steps=10, sync_ms=0.0, fill_ms=None) -> WindowReport:
    """A compute-scale window where rank r ran `steps` batches at ms_per_batch[r]."""
    w = len(ms_per_batch)
    steps_t = tuple(steps if m > 0 else 0 for m in ms_per_batch)
    return WindowReport(
        wall_ms=tuple(m * s for m, s in zip(ms_per_batch, steps_t, strict=True)),
        steps=steps_t,
        delivered_ms=(0.0,) * w,
        delivered_batches=(0,) * w,
        fill_ms=tuple(fill_ms) if fill_ms else (0.0,) * w,
        delivered_coherent=False,
        sync_ms=sync_ms,
    )


def feed(el: ElChe, ms_per_batch, n=1, sync_ms=0.0, verdict: GuardVerdict | None = None) -> None:
    for _ in range(n):
        el.report_window(compute_report(ms_per_batch, sync_ms=sync_ms))
        if verdict is not None:
            el.apply_verdict(verdict)


def elche(world=2, **knobs) -> ElChe:
    return ElChe(ElCheConfig(**knobs), world)


# -- the feed ---------------------------------------------------------------


def test_coherent_report_feeds_the_delivered_scale():
    el = elche()
    el.report_window(
        WindowReport(
            wall_ms=(50.0, 125.0),
            steps=(5, 5),
            delivered_ms=(80.0, 220.0),
            delivered_batches=(4, 4),
            fill_ms=(0.0, 0.0),
            delivered_coherent=True,
            sync_ms=0.0,
        )
    )
    assert el.ms_per_batch() == (20.0, 55.0)


def test_incoherent_report_feeds_the_compute_scale():
    el = elche()
    el.report_window(
        WindowReport(
            wall_ms=(50.0, 125.0),
            steps=(5, 5),
            delivered_ms=(80.0, 0.0),
            delivered_batches=(4, 0),
            fill_ms=(0.0, 0.0),
            delivered_coherent=False,
            sync_ms=0.0,
        )
    )
    assert el.ms_per_batch() == (10.0, 25.0)


def test_all_zero_window_reports_nothing():
    el = elche()
    feed(el, [50.0, 100.0])
    before = (el.batch_counts, el.calibration_count, el.ms_per_batch())
    for _ in range(10):  # more than the forget threshold: zero windows are not misses
        feed(el, [0.0, 0.0])
    assert (el.batch_counts, el.calibration_count, el.ms_per_batch()) == before


def test_report_with_wrong_world_size_is_rejected():
    with pytest.raises(CoordinatorError, match="world of 2"):
        elche().report_window(compute_report([1.0, 2.0, 3.0]))


# -- counts -----------------------------------------------------------------


def test_first_calibration_scales_counts_by_speed():
    el = elche(anchor=10)
    feed(el, [50.0, 100.0])
    assert el.batch_counts == (20, 10)
    assert el.anchor_rank == 1
    assert el.anchor_wall_ms() == 1000.0
    assert el.has_speed_hint()


def test_counts_are_uniform_before_calibration():
    el = elche(world=3, anchor=7)
    assert el.batch_counts == (7, 7, 7)
    assert not el.is_calibrated
    assert el.anchor_wall_ms() == 0.0
    assert el.recent_batch_share() == pytest.approx((1 / 3,) * 3)


def test_dead_zone_ignores_small_changes_and_follows_large_ones():
    el = elche(anchor=100)
    feed(el, [50.0, 100.0])
    assert el.batch_counts == (200, 100)
    feed(el, [48.0, 100.0])  # mean 49 -> target 204: within 5 % of 200
    assert el.batch_counts == (200, 100)
    feed(el, [30.0, 100.0])  # mean 42.7 -> target 234
    assert el.batch_counts == (234, 100)


def test_speed_ratio_is_capped_at_64():
    el = elche(anchor=10)
    feed(el, [1.0, 1000.0])
    assert el.batch_counts == (640, 10)


def test_counts_round_half_up():
    el = elche(anchor=5)
    feed(el, [40.0, 100.0])  # 5 * 2.5 = 12.5
    assert el.batch_counts == (13, 5)


def test_max_batch_diff_limits_each_move_after_calibration():
    el = elche(anchor=10, max_batch_diff=3)
    feed(el, [50.0, 100.0])  # the first calibration places counts freely
    assert el.batch_counts == (20, 10)
    feed(el, [10.0, 100.0])  # mean 30 -> target 33, moves at most 3
    assert el.batch_counts == (23, 10)


def test_epoch_cap_scales_counts_down_to_exactly_the_cap():
    el = elche(anchor=10)
    feed(el, [50.0, 100.0])
    el.set_epoch_cap(16)
    assert el.batch_counts == (11, 5)  # floors 10 + 5, remainder to the largest
    assert el.window_cap_binding
    el.set_epoch_cap(None)
    feed(el, [50.0, 100.0])
    assert el.batch_counts == (20, 10)
    assert not el.window_cap_binding


def test_epoch_cap_never_drops_a_rank_below_one_batch():
    el = elche(world=3, anchor=10)
    feed(el, [1.0, 100.0, 100.0])
    el.set_epoch_cap(3)
    assert el.batch_counts == (1, 1, 1)
    el.set_epoch_cap(2)  # fewer batches than ranks: the floor wins
    assert el.batch_counts == (1, 1, 1)


def test_binding_epoch_cap_suppresses_growth():
    el = elche(anchor=10)
    feed(el, [100.0, 100.0])
    el.set_epoch_cap(15)
    feed(el, [100.0, 100.0], sync_ms=5000.0)
    assert el.proposed_anchor is None


def test_callback_slack_shrinks_one_window_only():
    el = elche(anchor=10)
    feed(el, [50.0, 100.0])
    el.stage_callback_slack([200.0, 0.0])  # 200 ms at 50 ms/batch = 4 batches
    feed(el, [50.0, 100.0])
    assert el.batch_counts == (16, 10)
    feed(el, [50.0, 100.0])
    assert el.batch_counts == (20, 10)


def test_callback_slack_never_drops_a_rank_to_zero():
    el = elche(anchor=10)
    feed(el, [50.0, 100.0])
    el.stage_callback_slack([1e9, 0.0])
    feed(el, [50.0, 100.0])
    assert el.batch_counts == (1, 10)


# -- election ----------------------------------------------------------------


def test_election_picks_lowest_index_within_the_slow_band():
    el = elche(world=3)
    feed(el, [90.0, 100.0, 50.0])  # 90 >= 0.85 * 100: both in the cohort
    assert el.anchor_rank == 0


def test_single_slowest_rank_wins_the_election():
    el = elche(world=3)
    feed(el, [50.0, 100.0, 60.0])
    assert el.anchor_rank == 1


def test_election_is_closed_during_warmup():
    el = elche()
    feed(el, [100.0, 95.0])
    assert el.anchor_rank == 0
    feed(el, [100.0, 300.0], n=4)  # reports 2..5 are in Warmup
    assert el.phase is Calibration.STABLE
    assert el.anchor_rank == 0
    feed(el, [100.0, 300.0])  # first Stable report: election open
    assert el.anchor_rank == 1


def test_incumbent_keeps_the_anchor_against_a_challenger_within_the_margin():
    el = elche()
    feed(el, [100.0, 95.0], n=5)
    assert el.phase is Calibration.STABLE and el.anchor_rank == 0
    feed(el, [100.0, 108.0], n=5)  # 8 % slower: not enough
    assert el.anchor_rank == 0
    feed(el, [100.0, 112.0], n=5)  # 12 % slower: steals the anchor
    assert el.anchor_rank == 1


def test_rank_without_samples_for_five_reports_is_forgotten():
    el = elche(anchor=10)
    feed(el, [50.0, 100.0])
    el.report_window(compute_report([0.0, 100.0]))
    assert el.smoothed_ms_per_batch(0) == 50.0  # one miss keeps the window
    for _ in range(4):
        el.report_window(compute_report([0.0, 100.0]))
    assert el.smoothed_ms_per_batch(0) is None
    assert el.batch_counts[0] == 10  # unknown speed: the anchor count


def test_pinned_anchor_that_never_reports_is_replaced_after_five_reports():
    el = elche(anchor_rank=1)
    for _ in range(4):
        feed(el, [50.0, 0.0])
        assert el.anchor_rank == 1 and not el.is_calibrated
    feed(el, [50.0, 0.0])
    assert el.anchor_rank == 0
    assert el.is_calibrated


def test_anchor_rank_pin_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="anchor_rank"):
        elche(world=2, anchor_rank=2)


# -- phases and growth -------------------------------------------------------


def test_phases_advance_at_one_five_and_twenty_calibrations():
    el = elche()
    assert el.phase is Calibration.PROBE
    seen = {}
    for i in range(1, 21):
        feed(el, [100.0, 100.0])
        seen[i] = el.phase
    assert seen[1] is Calibration.WARMUP and seen[4] is Calibration.WARMUP
    assert seen[5] is Calibration.STABLE and seen[19] is Calibration.STABLE
    assert seen[20] is Calibration.MATURE


def test_first_report_never_proposes_growth():
    el = elche(anchor=10)
    feed(el, [100.0, 100.0], sync_ms=5000.0)
    assert el.proposed_anchor is None


def test_warmup_proposes_growth_from_the_second_calibration():
    el = elche(anchor=10)
    feed(el, [100.0, 100.0], sync_ms=5000.0)
    feed(el, [100.0, 100.0], sync_ms=5000.0)  # overhead 0.83: x2 cap
    assert el.phase is Calibration.WARMUP
    assert el.proposed_anchor == 20
    assert el.anchor == 10  # only proposed


def test_verdict_stable_commits_pending_grow():
    el = elche(anchor=10)
    feed(el, [100.0, 100.0], n=2, sync_ms=5000.0)
    el.apply_verdict(GuardVerdict.stable())
    assert el.anchor == 20
    assert el.batch_counts == (20, 20)
    assert el.proposed_anchor is None


def test_growth_respects_max_anchor():
    el = elche(anchor=10, max_anchor=15)
    feed(el, [100.0, 100.0], n=2, sync_ms=5000.0)
    assert el.proposed_anchor == 15


def test_growth_is_proportional_below_the_cap():
    el = elche(anchor=10, overhead_target=0.10)
    feed(el, [100.0, 100.0], sync_ms=150.0, n=5, verdict=GuardVerdict.stable())
    # overhead 150/1150 = 0.13 > 0.10 at Stable: scale 1.30 -> ceil(13.04)
    feed(el, [100.0, 100.0], sync_ms=150.0)
    assert el.proposed_anchor == 14


def test_borderline_warmup_pressure_waits_for_stable():
    el = elche(anchor=10, overhead_target=0.10)
    for _ in range(5):  # overhead 0.13: above target, below the 2x warmup margin
        feed(el, [100.0, 100.0], sync_ms=150.0)
        assert el.proposed_anchor is None
        el.apply_verdict(GuardVerdict.stable())
    feed(el, [100.0, 100.0], sync_ms=150.0)
    assert el.proposed_anchor is not None


def test_fill_counts_as_fixed_overhead():
    el = elche(anchor=10)
    feed(el, [50.0, 100.0])
    el.report_window(compute_report([50.0, 100.0], fill_ms=[5000.0, 0.0]))
    assert el.proposed_anchor is None  # only the anchor rank's fill counts
    el.report_window(compute_report([50.0, 100.0], fill_ms=[0.0, 5000.0]))
    assert el.proposed_anchor == 20


def test_sync_policy_exempt_from_window_pressure_growth():
    el = elche(anchor=1, window_growth=False)
    feed(el, [100.0, 100.0], n=25, sync_ms=5000.0, verdict=GuardVerdict.stable())
    assert el.anchor == 1
    assert el.phase is Calibration.MATURE


def test_warmup_growth_still_dies_on_a_guard_veto():
    el = elche(anchor=10)
    feed(el, [100.0, 100.0], n=2, sync_ms=5000.0)
    assert el.proposed_anchor == 20
    el.apply_verdict(GuardVerdict.suppress_growth())
    assert el.anchor == 10
    assert el.proposed_anchor is None


def test_verdict_suppress_growth_drops_proposal_and_latches():
    el = elche(anchor=10)
    feed(el, [100.0, 100.0], n=2, sync_ms=5000.0)
    el.apply_verdict(GuardVerdict.suppress_growth())
    assert not el.growth_enabled
    feed(el, [100.0, 100.0], sync_ms=5000.0)
    assert el.proposed_anchor is None


def test_growth_rearms_after_five_consecutive_stables():
    el = elche(anchor=10)
    feed(el, [100.0, 100.0])
    el.apply_verdict(GuardVerdict.suppress_growth())
    for _ in range(4):
        feed(el, [100.0, 100.0], sync_ms=5000.0, verdict=GuardVerdict.stable())
    assert not el.growth_enabled and el.anchor == 10
    el.apply_verdict(GuardVerdict.stable())
    assert el.growth_enabled
    feed(el, [100.0, 100.0], sync_ms=5000.0)
    assert el.proposed_anchor == 20


def test_pressure_verdict_resets_the_stable_streak():
    el = elche(anchor=10)
    el.apply_verdict(GuardVerdict.suppress_growth())
    for _ in range(4):
        el.apply_verdict(GuardVerdict.stable())
    el.apply_verdict(GuardVerdict.suppress_growth())
    for _ in range(4):
        el.apply_verdict(GuardVerdict.stable())
    assert not el.growth_enabled


# -- nudges and relax-up ----------------------------------------------------


def test_verdict_nudge_down_discards_and_nudges():
    el = elche(anchor=20)
    feed(el, [100.0, 100.0], n=2, sync_ms=5000.0)
    assert el.proposed_anchor == 40
    el.apply_verdict(GuardVerdict.nudge_down(0.5))
    assert el.anchor == 10
    assert el.proposed_anchor is None
    assert el.batch_counts == (10, 10)
    assert not el.growth_enabled


def test_nudge_then_discard_survives_a_later_commit():
    # The coordinator applies a meta nudge, then the guard's Stable in the
    # same cycle: the Stable must not resurrect the pre-nudge proposal.
    el = elche(anchor=20)
    feed(el, [100.0, 100.0], n=2, sync_ms=5000.0)
    el.apply_verdict(GuardVerdict.nudge_down(0.5))
    el.apply_verdict(GuardVerdict.stable())
    assert el.anchor == 10


def test_nudge_ignores_min_anchor_and_clamps_its_factor():
    el = elche(anchor=20, min_anchor=20)
    el.apply_verdict(GuardVerdict.nudge_down(0.5))
    assert el.anchor == 10
    el.apply_verdict(GuardVerdict.nudge_down(0.001))  # clamped to 0.1
    assert el.anchor == 1
    el.apply_verdict(GuardVerdict.nudge_down(0.001))
    assert el.anchor == 1  # never below one batch


def test_nudge_never_grows_the_anchor():
    el = elche(anchor=20)
    el.apply_verdict(GuardVerdict.nudge_down(3.0))
    assert el.anchor == 20


def test_non_finite_nudge_factor_leaves_the_anchor_but_still_vetoes_growth():
    el = elche(anchor=20)
    feed(el, [100.0, 100.0], n=2, sync_ms=5000.0)
    el.apply_verdict(GuardVerdict.nudge_down(math.nan))
    assert el.anchor == 20
    assert el.proposed_anchor is None
    assert not el.growth_enabled


def test_verdict_stable_relax_up_drifts_anchor():
    el = elche(anchor=10)
    el.apply_verdict(GuardVerdict.stable(relax_up=True))
    assert el.anchor == 11
    assert el.batch_counts == (11, 11)


def test_relax_up_stops_at_max_anchor():
    el = elche(anchor=10, max_anchor=10)
    assert not el.relax_anchor_up()
    assert el.anchor == 10


def test_relax_up_refuses_a_lead_beyond_max_batch_diff():
    el = elche(anchor=49, max_batch_diff=100)
    feed(el, [100.0, 300.0])  # speed ratio 3: lead = 2 * anchor
    assert el.relax_anchor_up()  # 50: lead 100, allowed
    assert el.anchor == 50
    assert not el.relax_anchor_up()  # 51: lead 102
    assert el.anchor == 50


# -- shares ------------------------------------------------------------------


def test_recent_batch_share_averages_recent_schedules():
    el = elche(anchor=10)
    feed(el, [50.0, 100.0])  # (20, 10)
    assert el.recent_batch_share() == pytest.approx((2 / 3, 1 / 3))


# -- config and state --------------------------------------------------------


@pytest.mark.parametrize(
    ("knobs", "setting"),
    [
        ({"anchor": 0}, "elche.anchor"),
        ({"anchor": 20, "max_anchor": 10}, "elche.max_anchor"),
        ({"min_anchor": 0}, "elche.min_anchor"),
        ({"overhead_target": 0.9}, "elche.overhead_target"),
        ({"overhead_target": 0.001}, "elche.overhead_target"),
        ({"max_batch_diff": -1}, "elche.max_batch_diff"),
        ({"anchor_rank": -1}, "elche.anchor_rank"),
    ],
)
def test_invalid_config_names_the_setting(knobs, setting):
    with pytest.raises(ConfigError, match=setting):
        ElCheConfig(**knobs)


def test_state_round_trips_through_json():
    el = elche(world=3, anchor=10)
    feed(el, [50.0, 100.0, 80.0], n=6, verdict=GuardVerdict.stable())
    state = el.state()
    assert state.phase is Calibration.STABLE
    data = json.loads(json.dumps(state.to_dict()))
    assert ElCheState.from_dict(data) == state
    resumed = ElChe.from_state(ElCheConfig(anchor=10), 3, state)
    assert resumed.state() == state
    assert resumed.batch_counts == el.batch_counts
    assert resumed.is_calibrated


def test_resume_keeps_trend_history_in_the_dict():
    state = ElCheState(14, 1, (50.0, 100.0), Calibration.STABLE, 17, (0.01, 0.02))
    assert ElCheState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


def test_resume_with_another_world_size_is_refused():
    state = elche(world=2).state()
    with pytest.raises(ConfigError, match="world size 2 but this run has 3"):
        ElChe.from_state(ElCheConfig(), 3, state)


def test_resume_rebinds_knobs_and_clamps_the_anchor():
    state = ElCheState(500, None, (0.0, 0.0), Calibration.WARMUP, 3)
    el = ElChe.from_state(ElCheConfig(anchor=10, max_anchor=100), 2, state)
    assert el.anchor == 100
    assert not el.is_calibrated
    assert el.phase is Calibration.WARMUP


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"anchor": 0}, "anchor"),
        ({"phase": "fast"}, "phase"),
        ({"smoothed_ms_per_batch": [1.0, -2.0]}, "smoothed_ms_per_batch"),
        ({"calibration_count": "x"}, "calibration_count"),
        ({"trend_history": "x"}, "trend_history"),
    ],
)
def test_corrupt_state_dict_names_the_field(patch, field):
    data = ElCheState(10, 0, (1.0, 2.0), Calibration.STABLE, 5).to_dict() | patch
    with pytest.raises(ConfigError, match=repr(field)):
        ElCheState.from_dict(data)


def test_state_dict_missing_field_is_named():
    data = ElCheState(10, 0, (1.0, 2.0), Calibration.STABLE, 5).to_dict()
    del data["phase"]
    with pytest.raises(ConfigError, match="'phase' is missing"):
        ElCheState.from_dict(data)


# -- properties --------------------------------------------------------------

rates = st.one_of(st.just(0.0), st.floats(0.01, 5000.0))
verdicts = st.sampled_from(
    [
        GuardVerdict.stable(),
        GuardVerdict.stable(relax_up=True),
        GuardVerdict.suppress_growth(),
        GuardVerdict.nudge_down(0.5),
        GuardVerdict.nudge_down(0.05),
    ]
)


@st.composite
def runs(draw):
    world = draw(st.integers(1, 5))
    cfg = ElCheConfig(
        anchor=draw(st.integers(1, 50)),
        max_anchor=draw(st.integers(50, 400)),
        max_batch_diff=draw(st.one_of(st.none(), st.integers(0, 20))),
        overhead_target=draw(st.floats(0.01, 0.5)),
    )
    steps = draw(
        st.lists(
            st.tuples(
                st.lists(rates, min_size=world, max_size=world),
                st.floats(0.0, 10_000.0),
                verdicts,
                st.one_of(st.none(), st.integers(1, 300)),
            ),
            max_size=30,
        )
    )
    return world, cfg, steps


@settings(max_examples=150, deadline=None)
@given(runs())
def test_schedule_invariants_hold_under_any_sequence(run):
    world, cfg, steps = run
    el = ElChe(cfg, world)
    for ms, sync_ms, verdict, cap in steps:
        el.set_epoch_cap(cap)
        el.report_window(compute_report(ms, sync_ms=sync_ms))
        el.apply_verdict(verdict)
        counts = el.batch_counts
        assert len(counts) == world
        assert all(c >= 1 for c in counts)
        if cap is not None and cap >= world:
            assert sum(counts) <= cap
        assert 1 <= el.anchor <= cfg.max_anchor
        if el.proposed_anchor is not None:
            assert el.anchor < el.proposed_anchor <= 2 * el.anchor


@settings(max_examples=100, deadline=None)
@given(runs())
def test_state_round_trip_is_identity(run):
    world, cfg, steps = run
    el = ElChe(cfg, world)
    for ms, sync_ms, verdict, _ in steps:
        el.report_window(compute_report(ms, sync_ms=sync_ms))
        el.apply_verdict(verdict)
    state = el.state()
    assert ElCheState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    assert ElChe.from_state(cfg, world, state).state() == state


def test_a_grown_world_keeps_the_measured_ranks_and_starts_the_new_ones_cold():
    state = ElCheState(10, 0, (40.0, 20.0), Calibration.STABLE, 6).grown(3)
    assert state.smoothed_ms_per_batch == (40.0, 20.0, 0.0)
    el = ElChe.from_state(ElCheConfig(anchor=10), 3, state)
    # The measured ranks keep their shares by speed; the cold rank probes with the anchor's count.
    assert el.batch_counts == (10, 20, 10) and el.anchor_rank == 0
    assert el.smoothed_ms_per_batch(2) is None
    with pytest.raises(ConfigError, match="only grow"):
        state.grown(2)
