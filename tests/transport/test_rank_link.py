"""The rank's I/O thread over real sockets: what reaches the training thread, and what leaves at once."""

from __future__ import annotations

import queue
import time
import uuid

import numpy as np
import pytest
import zmq

from flodl_zmq import rank_link
from flodl_zmq.links import (
    COORDINATOR_SENDER,
    REDUCER_SENDER,
    coordinator_sender,
    rank_identity,
    relay_sender,
)
from flodl_zmq.rank_link import ConsensusIn, FromCoordinator, RankConfig, RankLink
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire import records as rec

from .dataplane_helpers import WAIT_S

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def link(request, tmp_path, monkeypatch):
    # No coordinator here acknowledges the rank's records: its bounded wait for that at exit
    # would only run out (4 s a test).
    monkeypatch.setattr(rank_link, "ACK_WAIT_AT_EXIT_S", 0.0)
    ctx = zmq.Context()
    key, run_id = new_key(), uuid.uuid4().bytes
    control, data = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for s, name in ((control, "c"), (data, "d")):
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"ipc://{tmp_path}/{name}")
    cfg = RankConfig(rank=0, local_rank=0, world_size=1, host="a", key=key, incarnation=run_id,
                     control_endpoint=f"ipc://{tmp_path}/c", data_endpoint=f"ipc://{tmp_path}/d",
                     rank_heartbeat_period_s=30.0, sharded=getattr(request, "param", False))
    lk = RankLink(cfg, ctx, lambda: 0)
    lk.start()
    # The first heartbeat tells us the link is up (and gives the ROUTER the rank's route).
    assert control.poll(int(WAIT_S * 1000))
    control.recv_multipart()
    # The data DEALER connects on its own schedule, and a ROUTER drops what it cannot route yet:
    # make such a send fail instead (tests retry it until the rank's data connection is there).
    data.setsockopt(zmq.ROUTER_MANDATORY, 1)
    yield lk, control, data, key, run_id
    lk.close()
    control.close(0)
    data.close(0)
    ctx.term()


def send_when_routable(router: zmq.Socket, frames: list) -> None:
    """Send once the peer's connection exists (ROUTER_MANDATORY: EHOSTUNREACH until then), within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            router.send_multipart(frames)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def test_only_the_coordinators_control_records_reach_the_training_thread(link):
    lk, control, _data, key, run_id = link
    # Right key, wrong signer: the reducer (or any holder of the key) may not speak as the coordinator.
    control.send_multipart([rank_identity(0), *Codec(key, run_id, REDUCER_SENDER).encode(rec.Shutdown())])
    control.send_multipart([rank_identity(0), *Codec(key, run_id, coordinator_sender(0)).encode(rec.CoordHeartbeat())])
    got = lk.inbox.get(WAIT_S)
    assert isinstance(got, FromCoordinator) and isinstance(got.record, rec.CoordHeartbeat)
    assert lk.rejected == 1
    with pytest.raises(queue.Empty):
        lk.inbox.get(0.2)


def test_the_rank_takes_its_own_death_at_once_whatever_came_before_it(link):
    # The coordinator resends nothing to a dead rank: the records of a gap before its DeclareDead never
    # come, and held for them in order the death never reached the training thread (PROTOCOL.md 10.7 item 10).
    lk, control, _data, key, run_id = link
    coordinator = Codec(key, run_id, coordinator_sender(0))
    coordinator.encode(rec.Throttle(), channel=Channel.CONTROL)  # seq 1: lost in the cut
    control.send_multipart([rank_identity(0), *coordinator.encode(rec.DeclareDead(rank=0), channel=Channel.CONTROL)])
    got = lk.inbox.get(WAIT_S)
    assert isinstance(got, FromCoordinator) and got.record == rec.DeclareDead(rank=0)


def test_a_consensus_framed_by_anyone_but_the_reducer_is_rejected(link):
    lk, _control, data, key, run_id = link
    t = [np.arange(4, dtype=np.float32)]
    forged = Codec(key, run_id, COORDINATOR_SENDER).encode(rec.Consensus(1, 1.0), t, channel=Channel.BROADCAST)
    genuine = Codec(key, run_id, REDUCER_SENDER).encode(rec.Consensus(1, 1.0), t, channel=Channel.BROADCAST)
    send_when_routable(data, [rank_identity(0), *forged])
    data.send_multipart([rank_identity(0), *genuine])
    got = lk.inbox.get(WAIT_S)
    assert isinstance(got, ConsensusIn) and got.env.sender == REDUCER_SENDER
    assert lk.rejected == 1


@pytest.mark.parametrize("link", [True], indirect=True, ids=["sharded"])
def test_in_a_sharded_run_the_framed_consensus_is_the_relays_and_no_one_shards(link):
    # The relay puts the shards' slices together and signs the whole (PROTOCOL.md 10.9 item 5): a slice
    # signed by a shard, the controller's included, is not a consensus a rank may load.
    lk, _control, data, key, run_id = link
    t = [np.arange(4, dtype=np.float32)]
    slice_ = Codec(key, run_id, REDUCER_SENDER).encode(rec.Consensus(1, 1.0), t, channel=Channel.BROADCAST)
    whole = Codec(key, run_id, relay_sender("a")).encode(rec.Consensus(1, 1.0), t, channel=Channel.BROADCAST)
    send_when_routable(data, [rank_identity(0), *slice_])
    data.send_multipart([rank_identity(0), *whole])
    got = lk.inbox.get(WAIT_S)
    assert isinstance(got, ConsensusIn) and got.env.sender == relay_sender("a")
    assert lk.rejected == 1


def test_a_record_the_training_thread_sends_leaves_without_waiting_for_a_heartbeat(link):
    lk, control, _data, key, run_id = link
    lk.send(rec.Exiting(rank=0))  # the I/O thread sleeps until its next beat, 30 s away
    assert control.poll(int(WAIT_S * 1000))
    frames = control.recv_multipart()
    assert frames[0] == rank_identity(0)
    assert isinstance(Codec(key, run_id, "test").decode(frames[1:], Channel.CONTROL).record, rec.Exiting)


def test_a_rank_its_agent_stops_says_goodbye_and_closes_without_awaiting_an_acknowledgement(link, monkeypatch):
    # A re-form stops every rank by SIGTERM after its coordinator is gone: nobody will acknowledge the goodbye,
    # and the agent, which reports the exit, waits for it before the new world starts (PROTOCOL.md 13.1 item 3).
    monkeypatch.setattr(rank_link, "ACK_WAIT_AT_EXIT_S", 60.0)
    lk, control, _data, key, run_id = link
    # The coordinator was heard: a lingering close would now wait for it to acknowledge the goodbye.
    control.send_multipart([rank_identity(0), *Codec(key, run_id, coordinator_sender(0)).encode(rec.CoordHeartbeat())])
    assert isinstance(lk.inbox.get(WAIT_S), FromCoordinator)
    lk.send(rec.Exiting(rank=0))
    lk.close(timeout_s=WAIT_S, linger=False)
    assert lk.inbox.closed  # the I/O thread ended within the close, not after the 60 s acknowledgement wait
    assert control.poll(int(WAIT_S * 1000))
    frames = control.recv_multipart()
    assert isinstance(Codec(key, run_id, "test").decode(frames[1:], Channel.CONTROL).record, rec.Exiting)
    assert lk.resent_control == 0
