"""Coordinator building blocks: config validation, liveness, callback roles, metrics."""

from __future__ import annotations

import math

import pytest

from flodl_zmq.coordinator.config import CoordinatorConfig, MaxFailure, Mode
from flodl_zmq.coordinator.liveness import (
    ALL_LEFT_HINT,
    STOP_HINTS,
    Liveness,
    ShutdownReason,
    stop_hint,
    unrecoverable,
)
from flodl_zmq.coordinator.metrics import aggregate_epoch
from flodl_zmq.coordinator.roles import CallbackRoles, fastest_live, is_due
from flodl_zmq.errors import ConfigError
from flodl_zmq.wire.records import EpochMetrics


def cfg(**kw):
    base = {"total_samples": 100, "batch_size": 4, "num_epochs": 2}
    return CoordinatorConfig(**{**base, **kw})


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("setting", "value"),
    [("batch_size", 0), ("num_epochs", 0), ("mode", "fast"), ("rank_silence_at_coordinator_s", 0),
     ("anchor", 0), ("eval_every", -1), ("max_overshoot", -1), ("guard", "tight")],
)
def test_bad_settings_are_refused_by_name(setting, value):
    with pytest.raises(ConfigError, match=setting):
        cfg(**{setting: value})


def test_world_dependent_settings_are_checked_against_the_world():
    with pytest.raises(ConfigError, match="callback_rank"):
        cfg(callback_rank=3).check_world(3)
    with pytest.raises(ConfigError, match="partition_ratios"):
        cfg(mode="sync", partition_ratios=[1, 2]).check_world(3)


def test_defaults_follow_the_mode():
    assert cfg(mode="sync").elche_config(2).anchor == 1
    assert not cfg(mode="sync").elche_config(2).window_growth
    assert cfg().elche_config(2).anchor == 10
    assert cfg().guard_threshold == 0.05
    assert cfg(mode="async").guard_threshold == 0.3
    assert cfg(mode="async").overshoot_bounds == (3, 15, True)
    assert cfg(mode="async", max_overshoot=7).overshoot_bounds == (7, 7, False)
    assert cfg().reduce_stall_s == 300.0 and cfg(rank_silence_at_coordinator_s=60).reduce_stall_s == 600.0
    assert Mode("async").barrier_paced is False


def test_partition_ratios_pin_the_anchor_on_the_smallest_share():
    assert cfg(mode="sync", partition_ratios=[3, 1]).elche_config(2).anchor_rank == 1


# ------------------------------------------------------------------ max failure


def test_absolute_limit_returns_n_directly():
    assert MaxFailure.absolute(5).limit(3) == 5


@pytest.mark.parametrize(("p", "world", "limit"), [(0.2, 10, 2), (0.2, 11, 3), (0.2, 5, 1),
                                                   (0.2, 3, 1), (1.0, 4, 4), (1.7, 4, 4),
                                                   (-1.0, 4, 0), (0.5, 0, 0)])
def test_percent_limit_rounds_up_and_clamps(p, world, limit):
    assert MaxFailure.percent(p).limit(world) == limit


def test_percent_zero_trips_on_the_first_failure_only():
    live = Liveness(3, 30.0, 0.0)
    assert unrecoverable(live, MaxFailure.percent(0)) is None
    live.fail(1)
    assert unrecoverable(live, MaxFailure.percent(0)) is ShutdownReason.MAX_FAILURE_EXCEEDED


# ------------------------------------------------------------------ liveness


def test_a_silent_rank_goes_stale_only_after_the_timeout():
    live = Liveness(2, 30.0, 0.0)
    live.saw(0, 25.0)
    assert live.stale(30.0) == []
    assert live.stale(30.5) == [1]


def test_clean_exit_latches_once_and_is_not_a_failure():
    live = Liveness(2, 1.0, 0.0)
    assert live.exit(1) and not live.exit(1) and not live.fail(1)
    assert live.stale(100.0) == [0] and live.failures == 0


def test_all_ranks_lost_counts_exits_too():
    live = Liveness(2, 1.0, 0.0)
    live.exit(0)
    assert unrecoverable(live, None) is None
    live.fail(1)
    assert unrecoverable(live, None) is ShutdownReason.ALL_RANKS_LOST


def test_a_run_whose_every_rank_said_goodbye_names_their_own_code_as_the_likely_cause():
    # One sample whose __getitem__ raises ends each rank it is handed to, and each says goodbye: no death to read.
    live = Liveness(2, 1.0, 0.0)
    live.exit(0)
    live.exit(1)
    assert stop_hint(ShutdownReason.ALL_RANKS_LOST, live) == ALL_LEFT_HINT
    assert "its own code raised" in ALL_LEFT_HINT and "a sample that raises ends every rank" in ALL_LEFT_HINT
    died = Liveness(2, 1.0, 0.0)
    died.exit(0)
    died.fail(1)
    assert stop_hint(ShutdownReason.ALL_RANKS_LOST, died) == STOP_HINTS[ShutdownReason.ALL_RANKS_LOST]
    assert stop_hint(ShutdownReason.REDUCE_STALL, live) == ""


def test_beacons_are_spaced_a_second_apart():
    live = Liveness(1, 1.0, 0.0)
    assert [live.beacon_due(t) for t in (0.0, 0.5, 0.99, 1.0, 1.5, 2.1)] == [
        True, False, False, True, False, True]


# ------------------------------------------------------------------ roles


def test_fastest_role_resolves_to_lowest_smoothed_ms():
    assert fastest_live([30.0, 10.0, 20.0], [True, True, True]) == 1


def test_fastest_role_falls_back_to_lowest_live_when_uncalibrated():
    assert fastest_live([None, None, None], [False, True, True]) == 1


def test_fastest_re_resolves_on_role_rank_death():
    roles = CallbackRoles(3, None)
    roles.on_calibrated([30.0, 10.0, 20.0], [True] * 3)
    assert (roles.checkpoint, roles.eval, roles.epoch) == (1, 1, 1)
    roles.epoch_dirty = False
    roles.on_death(1, [30.0, 10.0, 20.0], [True, False, True])
    assert (roles.checkpoint, roles.eval, roles.epoch) == (2, 2, 2) and roles.epoch_dirty


def test_rank_policy_fails_over_only_the_checkpoint_role():
    roles = CallbackRoles(3, 1)
    roles.on_calibrated([30.0, 10.0, 5.0], [True] * 3)
    assert (roles.checkpoint, roles.eval, roles.epoch) == (1, 1, 1)
    roles.on_death(1, [30.0, None, 5.0], [True, False, True])
    assert (roles.checkpoint, roles.eval, roles.epoch) == (0, 1, 1)


def test_checkpoint_gives_up_when_every_live_rank_tried():
    roles = CallbackRoles(2, None)
    assert roles.checkpoint_failed(3, 0, [True, True]) == 1
    assert roles.checkpoint_failed(3, 1, [True, True]) is None
    assert roles.tried(3) == 0


def test_checkpoint_ewma_blends_successive_successes():
    roles = CallbackRoles(1, None)
    roles.checkpoint_ms.update(100.0)
    roles.checkpoint_ms.update(50.0)
    assert roles.checkpoint_ms.value == pytest.approx(85.0)


def test_cadence_fires_on_multiples_after_epoch_zero():
    assert [e for e in range(7) if is_due(e, 3)] == [3, 6]
    assert not any(is_due(e, 0) for e in range(5))


# ------------------------------------------------------------------ metrics


def m(rank, loss, batches, samples, ms=1000.0, scalars=None):
    sums, counts = scalars or ({}, {})
    return EpochMetrics(rank=rank, epoch=0, avg_loss=loss, batches_processed=batches,
                        samples_processed=samples, epoch_ms=ms, compute_only_ms=ms,
                        data_starve_ms=0.0, scalar_sums=sums, scalar_counts=counts)


def test_aggregate_epoch_metrics_weights_loss_by_batches():
    agg = aggregate_epoch(0, [m(0, 0.5, 60, 1920), m(1, 0.7, 40, 1280, ms=1200.0)], 2)
    assert agg.avg_loss == pytest.approx(0.58)
    assert agg.per_rank_throughput[0] == pytest.approx(1.92)
    assert agg.epoch_ms == 1200.0 and agg.per_rank_batch_share == [0.6, 0.4]


def test_aggregate_sums_progressive_chunks_per_rank():
    agg = aggregate_epoch(0, [m(0, 1.0, 10, 10, 100.0), m(0, 2.0, 30, 30, 300.0)], 2, wall_ms=500.0)
    assert agg.per_rank_loss == [pytest.approx(1.75), None]
    assert agg.per_rank_samples == [40, 0] and agg.epoch_ms == 500.0


def test_non_finite_loss_never_poisons_the_epoch():
    agg = aggregate_epoch(0, [m(0, math.nan, 10, 10), m(1, 1.0, 10, 10)], 2)
    assert agg.avg_loss == 1.0 and agg.per_rank_samples == [10, 10]


def test_scalars_are_batch_weighted_means_of_rank_means():
    a = m(0, 1.0, 30, 30, scalars=({"acc": 3.0}, {"acc": 2}))  # mean 1.5
    b = m(1, 1.0, 10, 10, scalars=({"acc": 0.4}, {"acc": 1}))  # mean 0.4
    agg = aggregate_epoch(0, [a, b], 2)
    assert agg.scalars["acc"] == pytest.approx((30 * 1.5 + 10 * 0.4) / 40)
