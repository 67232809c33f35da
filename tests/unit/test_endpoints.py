"""Which sockets count as loopback-only, and the send buffer they get (flodl_zmq.endpoints, links.tune_loopback)."""

from __future__ import annotations

import pytest
import zmq

from flodl_zmq.endpoints import is_loopback_endpoint
from flodl_zmq.links import LOOPBACK_SNDBUF, tune_loopback

LOOPBACK = ["tcp://127.0.0.1:7302", "tcp://127.8.9.10:7302", "tcp://[::1]:7302", "tcp://localhost:7302"]
ELSEWHERE = [
    "tcp://10.0.0.5:7302",  # a LAN peer
    "tcp://*:7302",  # a wildcard also listens on the network
    "tcp://0.0.0.0:7302",
    "tcp://[::]:7302",
    "tcp://gpu-box.lan:7302",  # a name may resolve anywhere
    "ipc:///tmp/flodl-x-data",
    "inproc://reducer-bcast",
]


@pytest.mark.parametrize("endpoint", LOOPBACK)
def test_tcp_on_a_loopback_address_is_loopback(endpoint):
    assert is_loopback_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ELSEWHERE)
def test_anything_that_may_reach_another_machine_or_is_not_tcp_is_not(endpoint):
    assert not is_loopback_endpoint(endpoint)


def test_only_a_loopback_socket_gets_the_small_send_buffer():
    ctx = zmq.Context()
    try:
        local, remote = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
        tune_loopback(local, "tcp://127.0.0.1:7302")
        tune_loopback(remote, "tcp://10.0.0.5:7302")
        assert local.getsockopt(zmq.SNDBUF) == LOOPBACK_SNDBUF
        assert remote.getsockopt(zmq.SNDBUF) == -1  # the kernel's autotuned buffer
    finally:
        ctx.destroy(0)
