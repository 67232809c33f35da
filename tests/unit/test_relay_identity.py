"""A relay's routing identity (links.relay_identity, PROTOCOL.md 10.5 item 1) for every host name the membership admits."""

from __future__ import annotations

import pytest
import zmq

from flodl_zmq.join import MAX_HOST_CHARS
from flodl_zmq.links import relay_identity

INCARNATION = bytes.fromhex("0123456789abcdef")


@pytest.mark.parametrize("host", ["a" * MAX_HOST_CHARS, "é" * 200, "日" * MAX_HOST_CHARS, "a" * 199 + "日" * 56])
def test_a_long_host_name_gives_an_identity_zeromq_accepts(host: str) -> None:
    ident = relay_identity(host, INCARNATION)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.ROUTING_ID, ident)  # EINVAL over 255 bytes: the relay could not start
        assert sock.getsockopt(zmq.ROUTING_ID) == ident
    finally:
        sock.close(0)
    text = ident.decode()  # cut at a character boundary, never inside one
    assert text.startswith("relay:" + host[:10]) and text.endswith(":0123456789abcdef")
    assert len(ident) <= 223


def test_a_short_host_name_is_kept_whole() -> None:
    assert relay_identity("host-a", INCARNATION) == b"relay:host-a:0123456789abcdef"
    assert relay_identity("gpu-é", INCARNATION) == "relay:gpu-é:0123456789abcdef".encode()
