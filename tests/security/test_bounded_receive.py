"""Issue 27, item 2 and part of 6: what a stranger, or a member that stops reading, may cost a service.

- The controller's data port takes no frame longer than its model's (a 3-float
  model here): an oversized frame drops the connection before it is allocated.
- A flood of empty frames to the join port leaves the controller's memory where
  it was once the flood is discarded (ZeroMQ's own peak is stated in PROTOCOL.md 6.1).
- After formation, strangers' hellos cannot pile up pending admissions.
- A relay that stops reading never delays the other host's rounds.

Memory is this process's resident set (the services run in it); the attacker
is a raw ZMTP peer (`zmtp.RawPeer`) that buffers nothing on its side.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from transport.dataplane_helpers import ROUTE_SECRET, token

from flodl_zmq.join import JoinConfig, JoinWindow, Rejected, WindowPhase
from flodl_zmq.links import TAG_BCAST, TAG_DATA, relay_sender
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.wire import PROTOCOL_VERSION, Channel, Codec, new_key
from flodl_zmq.wire.records import HostFrame, JoinHello, RelayHello, RelayHelloAck

from .conftest import _status_kib
from .test_receive_limits import Join, _wait
from .zmtp import RawPeer

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
RUN_ID = bytes(range(16))


def test_an_oversized_frame_to_the_controllers_data_port_is_refused_at_the_models_size(ctx, peak_rss):
    from transport.test_controller import rig as make_rig  # the controller (Linear(2, 1): 3 floats)

    gen = make_rig.__wrapped__(None)  # no fixture request: the default mode
    service, _relay, _thread, _outcome = next(gen)
    try:
        data_ep = service.penv.controller.endpoint(Channel.DATA)
        peak_rss.reset()
        peer = RawPeer(data_ep)
        big = 400 * MiB
        sent = peer.send_big_frame(big)  # unbounded, the reducer takes the whole frame
        peer.close()
        assert sent < big, "the reducer read the whole 400 MB frame of a 3-float model"
        assert peak_rss.growth_mb() < 50, f"the frame grew the controller by {peak_rss.growth_mb():.0f} MB"
        # The data port still serves the run's relay.
        relay = ctx.socket(zmq.DEALER)
        relay.setsockopt(zmq.LINGER, 0)
        relay.connect(data_ep)
        relay.send_multipart(Codec(service.penv.key, service.penv.incarnation, relay_sender("h")).encode(
            RelayHello("h", [0, 1], [], token("h")), channel=Channel.DATA))
        assert relay.poll(30_000), "the reducer no longer answers its relay"
        tag, *frames = relay.recv_multipart()
        assert tag == TAG_DATA
        assert Codec(service.penv.key, service.penv.incarnation, "t").decode(frames, Channel.DATA).record == RelayHelloAck()
        relay.close(0)
    finally:
        next(gen, None)


def test_a_flood_of_empty_frames_to_the_join_port_leaves_memory_where_it_was(ctx, peak_rss):
    frames = 1_000_000  # 2 MB on the wire, 64 MB held: four times what a discarded flood may leave
    join = Join(ctx)
    peer = RawPeer(join.endpoint)
    try:
        assert join.status(ctx)["phase"] == "open"  # the service is up and has answered once
        peak_rss.reset()
        assert peer.send_empty_frames(frames)
        assert _wait(lambda: join.svc.dropped > 0, 60.0), "the flood never reached the service"
        after_mb = _status_kib("VmRSS") / 1024 - peak_rss.base_kib / 1024
        # ZeroMQ holds the whole message (64 bytes a frame) before the first frame is read.
        assert peak_rss.growth_mb() < frames * 100 / MiB
        # Discarded, its memory goes back to the kernel (PROTOCOL.md 6.1: within 16 MB).
        assert after_mb < 16, f"the discarded flood left the process {after_mb:.0f} MB larger"
        assert join.status(ctx)["phase"] == "open"
    finally:
        peer.close()
        join.close()


def test_hellos_past_the_pending_hosts_cap_are_refused_by_name():
    sig = bytes([0xA1]) * 32

    def hello(host: str, devices: int) -> JoinHello:
        return JoinHello(host, [f"cpu:{i}" for i in range(devices)], sig, PROTOCOL_VERSION, None, bytes(16))

    # The defaults a compose setup runs with: open admission, no --max-ranks.
    window = JoinWindow(JoinConfig(min_ranks=2, target_ranks=2), opened_at=0.0)
    window.admit(hello("a", 1), 1.0)
    window.admit(hello("b", 1), 1.0)
    assert window.poll(1.0).phase is WindowPhase.FORMED
    for i in range(8):
        assert not isinstance(window.admit(hello(f"stranger-{i}", 256), 2.0), Rejected)
    refused = window.admit(hello("stranger-8", 256), 2.0)
    assert isinstance(refused, Rejected)
    assert "too many hosts waiting" in refused.reason and "--max-pending-hosts" in refused.reason
    assert len(window.pending) == 8
    window.reform()  # once the waiting hosts are in, others may wait again
    assert not isinstance(window.admit(hello("stranger-8", 256), 3.0), Rejected)


def test_a_relay_that_stops_reading_does_not_stall_the_other_hosts_rounds(ctx):
    world = {"a": (0,), "b": (1,)}
    key = new_key()
    data_ep, bcast_ep = f"inproc://slow-data-{key.hex()[:8]}", f"inproc://slow-bcast-{key.hex()[:8]}"
    svc = ReducerService(ReducerConfig(world, key, RUN_ID, data_ep, bcast_ep, probe_interval_s=0.05,
                                       route_secret=ROUTE_SECRET), ctx)
    svc.start()
    relays = {}
    try:
        for host in world:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(data_ep)
            relays[host] = (sock, Codec(key, RUN_ID, relay_sender(host)))
        reader = Codec(key, RUN_ID, "test")
        for host, (sock, codec) in relays.items():
            sock.send_multipart(codec.encode(RelayHello(host, list(world[host]), [], token(host)), channel=Channel.DATA))
        # `a` reads everything; `b` never reads again and never subscribes, so every consensus
        # goes to it point to point and its queue fills within a few rounds.
        a, _ = relays["a"]
        # A hang guard for all 40 rounds (milliseconds of work): a reducer that waits on `b`
        # for its send timeout (10 s) once `b`'s queue is full needs minutes.
        deadline = time.monotonic() + 60.0
        for round_id in range(1, 41):
            for host, (sock, codec) in relays.items():
                sock.send_multipart(codec.encode(HostFrame(round_id, host, list(world[host]), 1.0),
                                                 [np.full(8, float(round_id), np.float32)], channel=Channel.DATA))
            got = None
            while got is None and time.monotonic() < deadline:
                if a.poll(100):
                    tag, *frames = a.recv_multipart()
                    if tag == TAG_BCAST:  # never subscribed: the consensus comes point to point
                        env = reader.decode(frames, Channel.BROADCAST, replay=False)
                        got = env if env.record.round == round_id else None
            assert got is not None, f"round {round_id} did not reach host a: the reducer waited on host b"
            assert np.allclose(got.payload[0], round_id)
        assert svc.counters().get("peer_full", 0) > 0, svc.counters()
    finally:
        for sock, _ in relays.values():
            sock.close(0)
        svc.stop()
