"""A rank's coalesced step reports: what goes out when, and that the coordinator learns the same from them."""

from __future__ import annotations

import pytest

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.core import Coordinator
from flodl_zmq.errors import SchemaError
from flodl_zmq.step_report import StepReport
from flodl_zmq.wire import records as rec


def test_steps_wait_for_the_period_then_go_out_together_in_order():
    report = StepReport(rank=1, period_s=0.05)
    assert report.add(10.0, 1.0, 0.9, step_count=1, now=0.00) == []
    assert report.add(11.0, 0.5, 0.8, step_count=2, now=0.02) == []
    assert report.reported == 0  # nothing sent yet: the heartbeat must not claim these steps
    out = report.add(12.0, 0.0, 0.7, step_count=3, now=0.05)
    assert out == [rec.Batch(rank=1, step_count=3, batch_ms=[10.0, 11.0, 12.0], data_ms=[1.0, 0.5, 0.0],
                             batch_loss=[0.9, 0.8, 0.7])]
    assert report.reported == 3
    assert report.take() == []  # nothing left


def test_a_window_edge_takes_the_pending_steps_at_once():
    report = StepReport(rank=0, period_s=0.05)
    report.add(10.0, 0.0, 1.0, step_count=7, now=0.0)
    (out,) = report.take()
    assert out.step_count == 7 and out.batch_ms == [10.0]
    assert report.reported == 7


def test_with_no_period_every_step_is_reported_at_once():
    # cpu-sync: each step closes a window, so no step may wait.
    report = StepReport(rank=0, period_s=0.0)
    assert report.add(10.0, 0.0, 1.0, step_count=1, now=5.0) == [rec.Batch(
        rank=0, step_count=1, batch_ms=[10.0], data_ms=[0.0], batch_loss=[1.0])]


def test_a_rate_changed_every_step_goes_out_once_a_report_after_its_steps():
    # A schedule changes the rate before every step: one LrUpdate a report, the last rate, not one a step.
    report = StepReport(rank=2, period_s=0.05)
    report.note_lr(0.1)
    assert report.add(10.0, 0.0, 1.0, step_count=1, now=0.00) == []
    report.note_lr(0.09)
    assert report.add(10.0, 0.0, 1.0, step_count=2, now=0.02) == []
    report.note_lr(0.08)
    out = report.add(10.0, 0.0, 1.0, step_count=3, now=0.06)
    assert [type(r) for r in out] == [rec.Batch, rec.LrUpdate]
    assert out[1] == rec.LrUpdate(rank=2, lr=0.08) and out[0].step_count == 3
    assert report.add(10.0, 0.0, 1.0, step_count=4, now=0.07) == []  # the rate did not change: none pending
    report.note_lr(0.07)  # before the first step of a window: it goes with the edge's report
    assert report.take() == [rec.Batch(rank=2, step_count=4, batch_ms=[10.0], data_ms=[0.0], batch_loss=[1.0]),
                             rec.LrUpdate(rank=2, lr=0.07)]
    report.note_lr(0.06)
    assert report.take() == [rec.LrUpdate(rank=2, lr=0.06)]  # no steps pending: the rate alone


def test_a_report_whose_lists_differ_in_length_is_refused():
    with pytest.raises(SchemaError, match="lists each step once"):
        rec.Batch(rank=0, step_count=2, batch_ms=[1.0, 2.0], data_ms=[0.0], batch_loss=[1.0, 1.0])


def _ledger_after(reports: list[rec.Batch]) -> tuple:
    cfg = CoordinatorConfig(total_samples=800, batch_size=1, num_epochs=1, mode="cadence")
    c = Coordinator(cfg, 2, 0.0)
    c.start(0.0)
    for r in reports:
        c.on_record(r.rank, r, 0.1)
    led = c.feedback.ledger
    return (c.window_steps, led.window_steps, [led.compute_ms(r) for r in (0, 1)],
            [led.delivered(r) for r in (0, 1)], [led.fill_excess(r) for r in (0, 1)], led.mean_loss())


def test_the_coordinator_learns_the_same_from_one_report_as_from_one_record_per_step():
    steps = [(12.0, 3.0, 0.5), (10.0, 0.5, 0.4), (11.0, 0.25, float("nan"))]
    single = [rec.Batch(rank=0, step_count=i + 1, batch_ms=[b], data_ms=[d], batch_loss=[loss])
              for i, (b, d, loss) in enumerate(steps)]
    coalesced = [rec.Batch(rank=0, step_count=3, batch_ms=[s[0] for s in steps], data_ms=[s[1] for s in steps],
                           batch_loss=[s[2] for s in steps])]
    assert _ledger_after(coalesced) == _ledger_after(single)


def test_the_link_sends_pending_step_timings_ahead_of_any_other_record():
    import zmq

    from flodl_zmq.rank_link import RankConfig, RankLink

    cfg = RankConfig(rank=0, local_rank=0, world_size=2, host="h0", key=bytes(32), incarnation=bytes(16),
                     control_endpoint="ipc:///nonexistent-c", data_endpoint="ipc:///nonexistent-d")
    ctx = zmq.Context()
    link = RankLink(cfg, ctx, report_period_s=60.0)  # never due by time: only the edge sends them
    try:
        link.note_lr(0.5)
        link.step(10.0, 0.0, 1.0, step_count=1)
        link.note_lr(0.4)
        link.step(11.0, 0.0, 0.9, step_count=2)
        link.send(rec.SnapshotReady(rank=0, round=4))
        queued = [item.record for item in link._loop.mailbox.drain()]
        assert queued == [rec.Batch(rank=0, step_count=2, batch_ms=[10.0, 11.0], data_ms=[0.0, 0.0],
                                    batch_loss=[1.0, 0.9]), rec.LrUpdate(rank=0, lr=0.4),
                          rec.SnapshotReady(rank=0, round=4)]
        link.flush_steps()
        assert link._loop.mailbox.drain() == []  # nothing pending: no empty report
    finally:
        link._loop.close()
        link.inbox.close()
        ctx.term()
