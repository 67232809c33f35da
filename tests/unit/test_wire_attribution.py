"""Codec.decode_from: the MAC, then the signer against the route, then the sequence."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from flodl_zmq.errors import AttributionError, AuthError, ReplayError
from flodl_zmq.wire import PROTOCOL_VERSION, Attribution, Channel, Codec, compute_mac
from flodl_zmq.wire.records import Heartbeat, RelayHello, RoundFrame

KEY = bytes(range(32))
RUN = bytes(range(100, 116))
RANK_0 = Attribution.signed_by("rank:0", "rank 0's connection", rank=0)


def heartbeat(rank: int = 0) -> Heartbeat:
    return Heartbeat(rank=rank, step_count=1)


def forged(signer: str, seq: int, key: bytes) -> list[bytes]:
    head = msgpack.packb(
        {"v": PROTOCOL_VERSION, "k": "timing.heartbeat", "run": RUN, "ch": "control", "from": signer, "salt": bytes(16), "seq": seq,
         "f": {"rank": 0, "step_count": 1, "ack": 0}, "p": []},  # fmt: skip
        use_bin_type=True,
    )
    return [head, compute_mac(key, head, [])]


def test_a_forged_mac_from_a_wrong_signer_is_reported_as_the_mac_failure() -> None:
    rx = Codec(KEY, RUN, "relay:a")
    with pytest.raises(AuthError):
        rx.decode_from(forged("rank:1", 1, bytes(32)), Channel.CONTROL, RANK_0)


def test_a_wrong_signer_is_refused_and_leaves_the_ledger_for_the_genuine_sender() -> None:
    rx, genuine = Codec(KEY, RUN, "relay:a"), Codec(KEY, RUN, "rank:0")
    # A key holder speaking for rank 0 on rank 0's route, with a sequence far ahead.
    with pytest.raises(AttributionError, match="only 'rank:0' may use") as info:
        rx.decode_from(forged("rank:1", 2**62, KEY), Channel.CONTROL, RANK_0)
    assert (info.value.signer, info.value.expected, info.value.kind) == ("rank:1", "rank:0", "timing.heartbeat")
    # Signed by rank 0 itself but far ahead: refused because it names rank 0 on rank 1's route.
    with pytest.raises(AttributionError):
        rx.decode_from(forged("rank:0", 2**62, KEY), Channel.CONTROL, Attribution.signed_by("rank:1", "rank 1"))
    assert rx.decode_from(genuine.encode(heartbeat()), Channel.CONTROL, RANK_0).seq == 1


def test_a_replay_from_the_right_signer_is_a_replay() -> None:
    rx, tx = Codec(KEY, RUN, "relay:a"), Codec(KEY, RUN, "rank:0")
    frames = tx.encode(heartbeat())
    rx.decode_from(frames, Channel.CONTROL, RANK_0)
    with pytest.raises(ReplayError):
        rx.decode_from(frames, Channel.CONTROL, RANK_0)
    # Broadcasts are decoded without the sequence; attribution still holds.
    assert rx.decode_from(frames, Channel.CONTROL, RANK_0, replay=False).seq == 1


def test_a_rank_may_only_speak_for_itself() -> None:
    rx, tx = Codec(KEY, RUN, "relay:a"), Codec(KEY, RUN, "rank:0")
    with pytest.raises(AttributionError, match="names rank 1"):
        rx.decode_from(tx.encode(heartbeat(rank=1)), Channel.CONTROL, RANK_0)
    assert rx.decode_from(tx.encode(heartbeat()), Channel.CONTROL, RANK_0).seq == 2


def test_a_route_that_names_nobody_refuses_every_signer() -> None:
    rx, tx = Codec(KEY, RUN, "reducer"), Codec(KEY, RUN, "relay:a")
    with pytest.raises(AttributionError, match="no peer registered") as info:
        rx.decode_from(tx.encode(heartbeat()), Channel.CONTROL, Attribution.nobody("route b'x'"))
    assert info.value.expected is None


def test_a_rule_attributes_by_the_decoded_record() -> None:
    rx = Codec(KEY, RUN, "reducer")
    seen: list[Any] = []

    def rule(rec: Any) -> Attribution:
        seen.append(rec)
        return Attribution.signed_by(f"relay:{rec.host}", "a new relay's route")

    hello = RelayHello("a", [0, 1], [], bytes(32))
    assert rx.decode_from(Codec(KEY, RUN, "relay:a").encode(hello, channel=Channel.DATA), Channel.DATA, rule).record == hello
    with pytest.raises(AttributionError):
        rx.decode_from(Codec(KEY, RUN, "relay:b").encode(hello, channel=Channel.DATA), Channel.DATA, rule)
    assert seen == [hello, hello]


def test_anyone_keeps_the_sequence_per_connection() -> None:
    rx, tx = Codec(KEY, RUN, "membership"), Codec(KEY, RUN, "host-a")
    frames = tx.encode(heartbeat())
    rx.decode_from(frames, Channel.CONTROL, Attribution.anyone("a join link", scope="01"))
    rx.decode_from(frames, Channel.CONTROL, Attribution.anyone("a join link", scope="02"))
    with pytest.raises(ReplayError):
        rx.decode_from(frames, Channel.CONTROL, Attribution.anyone("a join link", scope="01"))


def test_a_by_reference_message_is_attributed_in_the_same_order() -> None:
    rx, tx = Codec(KEY, RUN, "relay:a"), Codec(KEY, RUN, "rank:1")
    payload = [np.arange(4, dtype=np.float32)]
    header, tag = tx.encode_reference(RoundFrame(1, 0, 1.0), payload, b"loc")
    views = [memoryview(payload[0]).cast("B")]
    with pytest.raises(AttributionError):
        rx.decode_reference(header, b"loc", tag, lambda _: views, Channel.DATA, sender=RANK_0)
    with pytest.raises(AuthError):
        rx.decode_reference(header, b"other", tag, lambda _: views, Channel.DATA, sender=RANK_0)
    rank_1 = Attribution.signed_by("rank:1", "rank 1's connection")
    assert rx.decode_reference(header, b"loc", tag, lambda _: views, Channel.DATA, sender=rank_1).seq == 1
