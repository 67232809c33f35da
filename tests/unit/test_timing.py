"""The window ledger and the delivered-cost feed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.coordinator.elche import ElChe, ElCheConfig
from flodl_zmq.coordinator.timing import WindowLedger, WindowReport
from flodl_zmq.errors import CoordinatorError

ALL_LIVE = (True, True)


def run_batches(ledger: WindowLedger, rank: int, n: int, batch_ms: float, data_ms: float = 0.0):
    for _ in range(n):
        ledger.record_batch(rank, batch_ms, data_ms)


# -- accumulation ------------------------------------------------------------


def test_first_batch_fills_then_marginal_accumulates():
    led = WindowLedger(1)
    led.record_batch(0, 12.0, 3.0)  # delivered 15: the fill batch
    led.record_batch(0, 8.0, 2.0)
    led.record_batch(0, 9.0, 1.0)
    assert led.delivered(0) == (20.0, 2)
    assert led.fill_excess(0) == 5.0
    assert led.compute_ms(0) == 29.0
    assert led.steps(0) == 3


def test_fill_excess_clamps_at_zero():
    led = WindowLedger(1)
    led.record_batch(0, 5.0, 0.0)
    led.record_batch(0, 10.0, 0.0)
    assert led.fill_excess(0) == 0.0


def test_fill_excess_is_zero_without_a_marginal_sample():
    led = WindowLedger(1)
    led.record_batch(0, 50.0, 0.0)
    assert led.fill_excess(0) == 0.0


def test_absorb_callback_cost_clamps_and_ignores_oob():
    led = WindowLedger(2)
    run_batches(led, 0, 3, 10.0, 5.0)  # compute 30, delivered 30 over 2
    led.absorb_callback_cost(0, 12.0)
    assert led.compute_ms(0) == 18.0
    assert led.delivered(0) == (18.0, 2)
    led.absorb_callback_cost(0, 1000.0)
    assert led.compute_ms(0) == 0.0
    assert led.delivered(0) == (0.0, 2)
    led.absorb_callback_cost(7, 5.0)  # no such rank: ignored
    led.absorb_callback_cost(1, math.nan)
    assert led.compute_ms(1) == 0.0


def test_checkpoint_time_excluded_from_the_window_elche_sees():
    led = WindowLedger(2)
    run_batches(led, 0, 10, 100.0)
    run_batches(led, 1, 10, 100.0)
    led.absorb_callback_cost(0, 500.0)  # rank 0 checkpointed mid-window
    el = ElChe(ElCheConfig(), 2)
    el.report_window(led.report(ALL_LIVE, delivered_feed=False, sync_ms=0.0))
    assert el.ms_per_batch() == (50.0, 100.0)


def test_record_batch_ignores_oob_rank():
    led = WindowLedger(2)
    led.record_batch(2, 10.0, 0.0)
    led.record_batch(-1, 10.0, 0.0)
    assert led.window_steps == (0, 0)
    assert led.steps(5) == 0


def test_resets_are_split_steps_vs_timing():
    led = WindowLedger(1)
    run_batches(led, 0, 3, 10.0)
    led.reset_steps()
    assert led.steps(0) == 0
    assert led.compute_ms(0) == 30.0
    run_batches(led, 0, 2, 10.0)
    led.reset_timing()
    assert led.steps(0) == 2
    assert led.compute_ms(0) == 0.0
    assert led.delivered(0) == (0.0, 0)
    led.record_batch(0, 40.0, 0.0)  # after a timing reset the next batch is fill again
    assert led.delivered(0) == (0.0, 0)


def test_cohort_step_stats():
    led = WindowLedger(3)
    run_batches(led, 0, 4, 1.0)
    run_batches(led, 1, 7, 1.0)
    run_batches(led, 2, 9, 1.0)
    assert led.cohort_step_stats() == (20, 9)
    assert led.cohort_step_stats((True, True, False)) == (11, 7)


def test_mean_loss_is_absent_until_a_batch_reports():
    led = WindowLedger(2)
    assert led.mean_loss() is None
    led.record_batch(0, 1.0, 0.0, loss=0.5)
    led.record_batch(1, 1.0, 0.0, loss=1.5)
    assert led.mean_loss() == 1.0


def test_non_finite_loss_never_poisons_the_window_mean():
    led = WindowLedger(1)
    led.record_batch(0, 1.0, 0.0, loss=math.nan)
    assert led.mean_loss() is None
    led.record_batch(0, 1.0, 0.0, loss=2.0)
    led.record_batch(0, 1.0, 0.0, loss=math.inf)
    assert led.mean_loss() == 2.0


def test_loss_resets_with_the_window_timing():
    led = WindowLedger(1)
    led.record_batch(0, 1.0, 0.0, loss=2.0)
    led.reset_steps()
    assert led.mean_loss() == 2.0
    led.reset_timing()
    assert led.mean_loss() is None


# -- the feed ----------------------------------------------------------------


def test_movers_delivered_complete_requires_every_mover():
    led = WindowLedger(2)
    run_batches(led, 0, 3, 10.0)
    run_batches(led, 1, 1, 10.0)  # one step: no marginal sample yet
    assert not led.movers_delivered_complete(ALL_LIVE)
    led.record_batch(1, 10.0, 0.0)
    assert led.movers_delivered_complete(ALL_LIVE)


def test_movers_delivered_complete_ignores_idle_and_dead_ranks():
    led = WindowLedger(3)
    run_batches(led, 0, 3, 10.0)
    run_batches(led, 2, 1, 10.0)  # rank 2 is dead with a lone step; rank 1 idle
    assert led.movers_delivered_complete((True, True, False))


def test_timing_feed_uses_delivered_when_window_complete():
    led = WindowLedger(2)
    run_batches(led, 0, 5, 10.0, 10.0)  # delivered 20/batch, compute 10/batch
    run_batches(led, 1, 5, 25.0, 30.0)  # delivered 55/batch, compute 25/batch
    report = led.report(ALL_LIVE, delivered_feed=True, sync_ms=7.0)
    assert report.delivered_coherent
    assert report.feed() == ((80.0, 220.0), (4, 4))
    assert report.sync_ms == 7.0


def test_timing_feed_all_or_none_falls_back_to_compute_scale():
    led = WindowLedger(2)
    run_batches(led, 0, 5, 10.0, 10.0)
    run_batches(led, 1, 1, 25.0, 300.0)  # a data-starved rank with a lone step
    report = led.report(ALL_LIVE, delivered_feed=True, sync_ms=0.0)
    assert not report.delivered_coherent
    assert report.feed() == ((50.0, 25.0), (5, 1))  # every rank on compute scale


def test_timing_feed_sync_keeps_compute_scale():
    led = WindowLedger(2)
    run_batches(led, 0, 5, 10.0, 10.0)
    run_batches(led, 1, 5, 25.0, 30.0)
    report = led.report(ALL_LIVE, delivered_feed=False, sync_ms=0.0)
    assert not report.delivered_coherent
    assert report.feed() == ((50.0, 125.0), (5, 5))


def test_dead_rank_reports_zeros():
    led = WindowLedger(2)
    run_batches(led, 0, 3, 10.0)
    run_batches(led, 1, 3, 99.0)
    report = led.report((True, False), delivered_feed=True, sync_ms=0.0)
    assert report.wall_ms[1] == 0.0 and report.steps[1] == 0
    assert report.delivered_batches[1] == 0 and report.fill_ms[1] == 0.0


def test_report_carries_fill_excess():
    led = WindowLedger(1)
    led.record_batch(0, 100.0, 0.0)
    run_batches(led, 0, 2, 10.0)
    assert led.report((True,), delivered_feed=True, sync_ms=0.0).fill_ms == (90.0,)


def test_live_mask_of_wrong_length_is_rejected():
    with pytest.raises(CoordinatorError, match="one flag per rank"):
        WindowLedger(2).report((True,), delivered_feed=True, sync_ms=0.0)


def test_window_report_with_ragged_fields_is_rejected():
    with pytest.raises(CoordinatorError, match="steps"):
        WindowReport((1.0, 2.0), (1,), (0.0, 0.0), (0, 0), (0.0, 0.0), False, 0.0)


batch = st.tuples(st.integers(0, 2), st.floats(0.1, 100.0), st.floats(0.0, 100.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(batch, max_size=40), st.lists(st.booleans(), min_size=3, max_size=3), st.booleans())
def test_a_window_never_mixes_scales(batches, live, delivered_feed):
    led = WindowLedger(3)
    for rank, batch_ms, data_ms in batches:
        led.record_batch(rank, batch_ms, data_ms)
    report = led.report(live, delivered_feed, sync_ms=0.0)
    ms, n = report.feed()
    if report.delivered_coherent:
        assert delivered_feed
        # every live mover feeds its marginal delivered sample
        for r in range(3):
            if live[r] and led.steps(r) > 0:
                assert n[r] == led.steps(r) - 1 >= 1
    else:
        assert (ms, n) == (report.wall_ms, report.steps)
