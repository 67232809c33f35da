"""The link helpers every service shares: bounded sends, heartbeats on tcp://, stable relay identities."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from flodl_zmq.links import Connections, keep_alive, relay_identity, send, take_over_routes, tune
from flodl_zmq.relay_core import HelloRetry

pytestmark = pytest.mark.timeout(30)


def test_a_send_to_a_peer_that_never_reads_gives_up_after_its_timeout():
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)  # no peer: every send is back-pressure
        tune(push, 1, 0.01)
        t0 = time.monotonic()
        assert not send(push, [b"x"], threading.Event(), timeout_s=0.3)
        assert 0.25 <= time.monotonic() - t0 < 2.0
        push.close(0)
    finally:
        ctx.term()


def test_tcp_links_beat_and_keep_alive_and_local_links_are_left_alone():
    ctx = zmq.Context()
    try:
        tcp, ipc = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        keep_alive(tcp, "tcp://127.0.0.1:5555", 1.0, 8.0)
        keep_alive(ipc, "ipc:///tmp/x", 1.0, 8.0)
        assert tcp.getsockopt(zmq.HEARTBEAT_IVL) == 1000 and tcp.getsockopt(zmq.HEARTBEAT_TIMEOUT) == 8000
        assert tcp.getsockopt(zmq.HEARTBEAT_TTL) == 8000 and tcp.getsockopt(zmq.TCP_KEEPALIVE) == 1
        assert tcp.getsockopt(zmq.RECONNECT_IVL) == 500
        assert ipc.getsockopt(zmq.HEARTBEAT_IVL) == 0
        router = ctx.socket(zmq.ROUTER)
        take_over_routes(router)
        for s in (tcp, ipc, router):
            s.close(0)
    finally:
        ctx.term()


def test_a_relay_identity_is_fixed_by_host_and_incarnation_and_fits_zeromq():
    assert relay_identity("h0", b"\x01\x02") == b"relay:h0:0102"
    assert relay_identity("h0", b"\x01") != relay_identity("h0", b"\x02")  # a restart is another peer
    long = relay_identity("h" * 1000, bytes(8))
    assert 0 < len(long) <= 255 and long[0] != 0


def test_a_hello_is_repeated_until_acknowledged():
    hello = HelloRetry(retry_s=1.0)
    assert hello.due(0.0)
    assert not hello.due(0.5)
    assert hello.due(1.1)  # lost in a reset: sent again
    hello.acked()
    assert not hello.due(10.0)


def test_a_peer_coming_back_on_a_new_connection_counts_one_reconnect():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    take_over_routes(router)
    connections = Connections(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    try:
        def record_from(identity: bytes) -> list[zmq.Frame]:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.connect(f"tcp://127.0.0.1:{port}")
            dealers.append(dealer)
            dealer.send(b"record")
            assert router.poll(5000)
            connections.read_events()
            return router.recv_multipart(copy=False)

        first = record_from(b"relay:h0:01")
        assert not connections.arrived("h0", first[-1])
        assert not connections.arrived("h0", first[-1])  # the same connection again
        dealers[0].close(0)  # the link drops; the relay's DEALER re-dials with its identity
        again = record_from(b"relay:h0:01")
        assert connections.arrived("h0", again[-1])
        assert not connections.arrived("h1", record_from(b"relay:h1:01")[-1])  # a first record is no reconnect
        assert connections.reconnects == {"h0": 1}
    finally:
        for d in dealers:
            d.close(0)
        connections.close()
        router.close(0)
        ctx.term()
