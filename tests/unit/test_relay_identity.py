"""Routing identities: a relay's (links.relay_identity, PROTOCOL.md 10.5 item 1) for every host name the membership
admits, and a rank's (links.rank_of, 3.1: its global rank in ASCII decimal, no leading zero)."""

from __future__ import annotations

import pytest
import zmq

from flodl_zmq.join import MAX_HOST_CHARS
from flodl_zmq.links import rank_identity, rank_of, relay_identity
from flodl_zmq.wire.records import MAX_RANK

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


@pytest.mark.parametrize("rank", [0, 3, 10, MAX_RANK])
def test_a_ranks_identity_names_it(rank: int) -> None:
    assert rank_of(rank_identity(rank)) == rank


@pytest.mark.parametrize("identity", [b"03", b"00", b"+3", b"-1", b"3 ", b"", b"2147483648", b"9999999999", b"12345678901"])
def test_an_identity_that_is_not_a_ranks_canonical_spelling_names_none(identity: bytes) -> None:
    # Replies go to rank_identity(rank): a peer dialling as b"03" would never receive what is sent to b"3".
    assert rank_of(identity) is None
