"""The pure pieces the coordinator's cycle delegates to: window feedback, the resume point, epoch callbacks."""

from __future__ import annotations

import pytest

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.convergence import DivergenceSample, GuardVerdict, TrendGuard
from flodl_zmq.coordinator.feedback import WindowFeedback
from flodl_zmq.coordinator.resume import ResumeState
from flodl_zmq.coordinator.roles import CallbackRoles, EpochCallbacks
from flodl_zmq.errors import ConfigError
from flodl_zmq.wire import records as rec


def cfg(**kw):
    base = {"total_samples": 400, "batch_size": 4, "num_epochs": 3}
    return CoordinatorConfig(**{**base, **kw})


def window(fb, ms=(10.0, 20.0), steps=4):
    for r, m in enumerate(ms):
        for _ in range(steps):
            fb.ledger.record_batch(r, m, 0.0)


class _Fixed:
    """A guard that always answers `verdict`."""

    def __init__(self, verdict):
        self.verdict = verdict

    def report(self, report, k_used, k_max):
        return self.verdict


SAMPLES = [DivergenceSample(0.01, 1.0, 1.0)] * 2


def close(fb, samples, trip):
    """One window of two live ranks, 4 steps each: published (calibrate), then acknowledged (judge)."""
    fb.calibrate([True, True], trip)
    return fb.judge(samples, [4, 4])


def test_a_closed_window_calibrates_elche_and_empties_the_ledger():
    fb = WindowFeedback(cfg(), 2)
    window(fb)
    close(fb, SAMPLES, 5.0)
    assert fb.smoothed_ms()[0] < fb.smoothed_ms()[1]
    assert fb.ledger.window_steps == (0, 0)


def test_the_round_trip_is_amortized_one_window_late():
    fb = WindowFeedback(cfg(), 2)
    seen = []
    report_window = fb.elche.report_window
    fb.elche.report_window = lambda r: (seen.append(r.sync_ms), report_window(r))
    for trip in (7.0, 9.0, 11.0):
        window(fb)
        close(fb, SAMPLES, trip)
    assert seen == [0.0, 7.0, 9.0]


def test_async_overshoot_grows_on_stable_windows_and_resets_on_a_nudge():
    fb = WindowFeedback(cfg(mode="async"), 2)
    start = fb.overshoot
    fb.guard = _Fixed(GuardVerdict.stable())
    for _ in range(2):
        window(fb)
        close(fb, SAMPLES, 1.0)
    assert fb.overshoot == start + 2
    fb.guard = _Fixed(GuardVerdict.nudge_down(0.5))
    window(fb)
    close(fb, SAMPLES, 1.0)
    assert fb.overshoot == start


def test_a_pinned_overshoot_never_moves():
    fb = WindowFeedback(cfg(mode="async", max_overshoot=7), 2)
    fb.guard = _Fixed(GuardVerdict.stable())
    window(fb)
    close(fb, SAMPLES, 1.0)
    assert fb.overshoot == 7


def test_the_trend_ring_survives_a_resume():
    fb = WindowFeedback(cfg(), 2)
    for d in (0.01, 0.02, 0.03):
        window(fb)
        close(fb, [DivergenceSample(d, 1.0, 1.0)] * 2, 1.0)
    state = fb.state()
    assert state.trend_history == (0.01, 0.02, 0.03)
    again = WindowFeedback(cfg(), 2, state)
    assert isinstance(again.guard, TrendGuard) and again.guard.history() == [0.01, 0.02, 0.03]
    assert again.elche.batch_counts == fb.elche.batch_counts


def test_a_resume_point_round_trips_grows_with_the_world_and_refuses_a_smaller_one():
    config = cfg()
    point = ResumeState(1, 40, 5, WindowFeedback(config, 2).state(), {0: [(0, 8)], 1: [(0, 16)]})
    state = point.to_dict(config, 2)
    assert state["coverage"] == {"1": [[0, 16]]}  # epochs before the saved one are whole
    back = ResumeState.from_dict(state, config, 2)
    assert (back.epoch, back.global_step, back.round, back.coverage) == (1, 40, 5, {1: [(0, 16)]})
    grown = ResumeState.from_dict(state, config, 3)  # a host joined at a re-form: its rank starts cold
    assert grown.elche.smoothed_ms_per_batch == (*back.elche.smoothed_ms_per_batch, 0.0)
    assert grown.coverage == back.coverage
    with pytest.raises(ConfigError, match="world_size"):
        ResumeState.from_dict(state, config, 1)
    with pytest.raises(ConfigError, match=r"outside this run.s 3 epochs; raise epochs"):
        ResumeState.from_dict({**state, "epoch": 9}, config, 2)


def test_epoch_callbacks_wait_until_the_consensus_holds_the_epoch_that_ended():
    cbs = EpochCallbacks(checkpoint_every=1, eval_every=2)
    roles = CallbackRoles(3, 2)
    cbs.entering(1)
    cbs.entering(2)
    assert cbs.release(-1, roles) == []
    (target, ckpt), = cbs.release(0, roles)
    assert target == 2 and ckpt == rec.Checkpoint(version=1, target_rank=2)
    kinds = [type(r).__name__ for _, r in cbs.release(1, roles)]
    assert kinds == ["Checkpoint", "ExecuteEval"]
    assert cbs.release(5, roles) == []
