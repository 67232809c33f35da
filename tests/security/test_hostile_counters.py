"""Numbers and records a member holding the session key can sign (issue 27, item 5): none ends a service.

A heartbeat counting 2^64 - 1 steps was accepted, and the controller died
encoding the global step it summed from it when the next round finished:
one rank ended the run. Every number a peer sends now has a range, checked
at decode (PROTOCOL.md 3.3); and whatever acting on an accepted record
raises is its signer's violation (`links.act_for_peer`): that peer leaves,
the service serves the others. The run report draws whatever finite metric
a rank reported.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq
from transport.dataplane_helpers import WAIT_S, token
from transport.test_controller import rig  # noqa: F401  (the fixture: a real controller, a scripted relay)

from flodl_zmq.coordinator.liveness import RankState
from flodl_zmq.links import rank_identity
from flodl_zmq.runlog import RunLog
from flodl_zmq.runreport import write_report
from flodl_zmq.wire import Channel
from flodl_zmq.wire import records as rec

pytestmark = pytest.mark.timeout(150)
FLOAT_MAX = sys.float_info.max


def wait_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def form(relay) -> None:
    relay.hello(0)
    relay.hello(1)
    relay.wait_for(rank_identity(1), "StartEpoch")


@pytest.mark.parametrize("rig", ["cpu-sync"], indirect=True)  # every step a window: one step opens a round
def test_a_heartbeat_of_2_to_the_64_steps_is_refused_at_decode_and_the_round_after_it_completes(rig, ctx):  # noqa: F811
    service, relay, thread, outcome = rig
    form(relay)
    # Rank 0's next record (seq 2 of its stream), merged by its relay: validly signed, 2^64 - 1 steps.
    relay.relay_send(rec.HostReports([2], [rec.Heartbeat(rank=0, step_count=2**64 - 1, ack=0)], [], [], []))
    wait_until(lambda: service.router.rejected["h"]["SchemaError"] == 1, "the heartbeat refused, counted for host h")

    # A round: both ranks step once, the relay deposits their sum, both acknowledge.
    for rank in (0, 1):
        relay.send(rank, rec.Batch(rank=rank, step_count=1, batch_ms=[1.0], data_ms=[0.0], batch_loss=[0.5]))
    relay.wait_for(rank_identity(1), "RequestParams")
    data = ctx.socket(zmq.DEALER)
    data.setsockopt(zmq.LINGER, 0)
    data.connect(service.penv.controller.endpoint(Channel.DATA))
    data.send_multipart(relay.codec.encode(rec.RelayHello("h", [0, 1], [], token("h")), channel=Channel.DATA))
    assert data.poll(int(WAIT_S * 1000)), "the reducer did not acknowledge the relay"
    payload = [np.zeros((1, 2), np.float32), np.zeros(1, np.float32)]  # the model: Linear(2, 1)
    data.send_multipart(relay.codec.encode(rec.HostFrame(1, "h", [0, 1], 2.0), payload, channel=Channel.DATA))
    for rank in (0, 1):
        relay.send(rank, rec.SyncAck(rank=rank, round=1, step_count=1, divergence=None, post_norm=None,
                                     pre_norm=None))
    # Today's controller died here encoding SetGlobalStep(2^64); now the round ends as any other.
    relay.wait_for(rank_identity(1), "SetGlobalStep")
    assert service.core.global_step == 2
    assert thread.is_alive() and "error" not in outcome
    assert tuple(service.core.liveness.live) == (0, 1)


def test_a_record_the_controller_fails_on_drops_its_rank_only_and_the_run_goes_on(rig, monkeypatch, caplog):  # noqa: F811
    service, relay, thread, outcome = rig
    form(relay)

    def fails(rank: int, lr: float) -> None:  # stands in for any failure a record can reach: a bug, an overflow
        raise ZeroDivisionError(f"injected: rank {rank}'s learning rate {lr} cannot be taken")

    monkeypatch.setattr(service.core.feedback, "on_lr", fails)
    with caplog.at_level(logging.ERROR, logger="flodl_zmq.links"):
        relay.send(0, rec.LrUpdate(rank=0, lr=0.0))
        relay.wait_for(rank_identity(0), "Shutdown")
        wait_until(lambda: service.core.liveness.state(0) is RankState.DEAD, "rank 0 declared dead")
    reason = service.deaths[0][1]
    assert "timing.lr_update" in reason and "ZeroDivisionError" in reason and "injected" in reason
    assert service.counts["handler_error.control"] == 1
    assert "Traceback" in caplog.text and "injected" in caplog.text  # a bug of ours would stay visible
    # Only the sender left: the other rank is still served, the service did not end.
    assert thread.is_alive() and "error" not in outcome
    assert service.core.liveness.state(1) is RankState.LIVE
    relay.send(1, rec.Exiting(rank=1))
    relay.wait_for(rank_identity(1), "CoordHeartbeat")  # its goodbye acknowledged


@pytest.mark.parametrize("metrics", [(1e308, -1e308), (FLOAT_MAX, 0.5), (-1e308, -FLOAT_MAX)])
def test_the_report_draws_any_finite_metric_a_rank_reported(tmp_path: Path, metrics: tuple[float, float]) -> None:
    log = RunLog(tmp_path)
    log.write("start", mode="cpu-cadence", epochs=2, world_size=2, world={"h": [0, 1]})
    for epoch, metric in enumerate(metrics):
        log.write("epoch", epoch=epoch, avg_loss=metric, epoch_ms=900.0, batch_share=[0.5, 0.5],
                  throughput=[metric, 10.0])
        log.write("eval", epoch=epoch, metric=metric)
    log.write("end", reason="completed", wall_s=1.0, final_eval=metrics[-1])
    log.close()
    page = write_report(tmp_path).read_text()
    eval_chart = page.split('id="eval-epoch"', 1)[1].split("</figure>", 1)[0]
    assert eval_chart.count('class="dot"') == 2  # both drawn, inside the plot
    assert "nan" not in page and "inf" not in page.replace("info", "")
