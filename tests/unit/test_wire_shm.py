"""Payload by reference: the header and locator are signed, the payload lies in a segment only this user can write."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.errors import AuthError, FramingError, SchemaError, WireError
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import RoundFrame
from flodl_zmq.wire.shm import (
    ALIGN,
    PLACE_BLOCK,
    SHM_TAG,
    Segment,
    SegmentMap,
    by_reference,
    ensure_run_dir,
    host_owner,
    is_by_reference,
    rank_owner,
    run_dir,
    segment_prefix,
    unlink_host,
    unlink_owner,
)

KEY, RUN = new_key(), bytes(range(16))


def place(seg: Segment, tensors: list[np.ndarray]) -> list[np.ndarray]:
    """The tensors copied into a fresh layout of the segment."""
    views = seg.layout([t.nbytes for t in tensors])
    placed = [np.frombuffer(v, t.dtype).reshape(t.shape) for v, t in zip(views, tensors, strict=True)]
    for dst, src in zip(placed, tensors, strict=True):
        np.copyto(dst, src)
    return placed


def deposit(seg: Segment, tensors: list[np.ndarray]) -> list:
    """What a rank sends: the tensors laid out in its segment, the message by reference."""
    return by_reference(Codec(KEY, RUN, "rank:0"), RoundFrame(1, 0, 2.0), place(seg, tensors), seg)


def reference_mac_from_the_spec(key: bytes, header: bytes, locator: bytes) -> bytes:
    """PROTOCOL.md 3.5, written out with the standard library only."""
    label = b"flodl-zmq/10/by-reference\x00"
    return hmac.new(key, label + struct.pack("<Q", len(header)) + header + struct.pack("<Q", len(locator)) + locator,
                    hashlib.sha256).digest()


def decode(msg: list, where, owner: str = rank_owner(0)):
    return SegmentMap(RUN, str(where)).decode(Codec(KEY, RUN, "relay"), msg, owner, Channel.DATA)


@pytest.fixture
def seg(tmp_path):
    s = Segment(KEY, RUN, rank_owner(0), str(tmp_path))
    yield s
    s.close()


def test_by_reference_decodes_to_the_record_and_the_payload_where_it_lies(seg, tmp_path):
    tensors = [np.arange(1000, dtype=np.float32), np.full((3, 5), 7, np.uint16)]
    msg = deposit(seg, tensors)
    assert is_by_reference(msg) and msg[0] == SHM_TAG and len(msg) == 4
    assert msg[3] == reference_mac_from_the_spec(KEY, msg[2], msg[1])
    env = decode(msg, tmp_path)
    assert env.record == RoundFrame(1, 0, 2.0) and env.dtypes == ["f32", "bf16"]
    for got, want in zip(env.payload, tensors, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_reference_mac_never_validates_a_framed_message_or_the_reverse(seg, tmp_path):
    tensors = [np.arange(16, dtype=np.float32)]
    msg = deposit(seg, tensors)
    with pytest.raises(AuthError):  # the by-reference MAC on the framed form
        Codec(KEY, RUN, "relay").decode([msg[2], tensors[0].tobytes(), msg[3]], Channel.DATA)
    framed = Codec(KEY, RUN, "rank:0").encode(RoundFrame(1, 0, 2.0), place(seg, tensors))
    with pytest.raises(AuthError):  # the framed MAC on the by-reference form
        decode([SHM_TAG, seg.locator(), framed[0], framed[-1]], tmp_path)


def test_frames_are_aligned_and_the_segment_is_reused_while_the_layout_fits(seg):
    views = seg.layout([10, 100, 1])
    first = seg.name
    offsets = msgpack.unpackb(seg.locator())[1]
    assert [o for o, _ in offsets] == [0, ALIGN, 3 * ALIGN] and [n for _, n in offsets] == [10, 100, 1]
    assert [v.nbytes for v in views] == [10, 100, 1]
    seg.layout([50])
    assert seg.name == first


def test_placed_frames_are_copied_byte_for_byte_across_piece_boundaries(seg):
    rng = np.random.default_rng(2)
    big = rng.integers(0, 256, 2 * PLACE_BLOCK + 3, dtype=np.uint8)  # three pieces, the last one short
    frames = [zmq.Frame(big.tobytes()), b"tail", rng.standard_normal(1000).astype(np.float32)]
    seg.place(frames)
    views = seg.layout([len(big), 4, 4000])  # the same layout: the same bytes, not rewritten
    assert bytes(views[0]) == big.tobytes()
    assert bytes(views[1]) == b"tail"
    assert bytes(views[2]) == frames[2].tobytes()


def test_a_larger_layout_moves_to_a_new_generation_and_the_reader_follows(seg, tmp_path):
    reader = SegmentMap(RUN, str(tmp_path))
    relay = Codec(KEY, RUN, "relay")
    reader.decode(relay, deposit(seg, [np.ones(4, np.float32)]), rank_owner(0), Channel.DATA, replay=False)
    old = seg.name
    big = deposit(seg, [np.full(10_000, 3, np.float32)])
    assert seg.name != old and not os.path.exists(tmp_path / old)
    env = reader.decode(relay, big, rank_owner(0), Channel.DATA, replay=False)
    assert env.payload[0].size == 10_000 and float(env.payload[0][-1]) == 3.0


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_bit_changed_in_the_header_or_locator_after_signing_fails_the_mac(tmp_path_factory, data):
    where = tmp_path_factory.mktemp("shm")
    seg = Segment(KEY, RUN, rank_owner(0), str(where))
    try:
        msg = deposit(seg, [np.arange(64, dtype=np.float32), np.arange(10, dtype=np.float32)])
        frame = data.draw(st.sampled_from([1, 2]))  # locator or header
        changed = bytearray(msg[frame])
        changed[data.draw(st.integers(0, len(changed) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        msg[frame] = bytes(changed)
        with pytest.raises(WireError):
            decode(msg, where)
    finally:
        seg.close()


def _signed_with_locator(seg: Segment, locator: object) -> list:
    """A by-reference message whose (honestly signed) locator names `locator`."""
    payload = place(seg, [np.ones(4, np.float32)])
    loc = msgpack.packb(locator)
    header, mac = Codec(KEY, RUN, "rank:0").encode_reference(RoundFrame(1, 0, 1.0), payload, loc)
    return [SHM_TAG, loc, header, mac]


@pytest.mark.parametrize(
    "locator, error",
    [
        (["/etc/passwd", [[0, 4]]], FramingError),
        ([f"{segment_prefix(RUN, 'r0')}1/../../x", [[0, 4]]], FramingError),
        ([f"{segment_prefix(bytes(16), 'r0')}1", [[0, 4]]], FramingError),  # another run
        ([f"{segment_prefix(RUN, 'r1')}1", [[0, 4]]], FramingError),  # another rank's segment
        ([f"{segment_prefix(RUN, 'r0')}1", [[0, 1 << 30]]], FramingError),  # outside the segment
        ([f"{segment_prefix(RUN, 'r0')}1", [[-1, 4]]], FramingError),
        ([f"{segment_prefix(RUN, 'r0')}9", [[0, 4]]], FramingError),  # no such segment
        ({"seg": "x"}, SchemaError),
    ],
)
def test_a_signed_locator_may_still_only_name_the_senders_own_segment_in_this_run(seg, tmp_path, locator, error):
    msg = _signed_with_locator(seg, locator)
    assert seg.name == f"{segment_prefix(RUN, 'r0')}1"
    with pytest.raises(error):
        decode(msg, tmp_path)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o666])
def test_a_segment_other_users_may_read_or_write_is_refused(seg, tmp_path, mode):
    msg = deposit(seg, [np.ones(4, np.float32)])
    os.chmod(tmp_path / seg.name, mode)
    with pytest.raises(AuthError, match="not private"):
        decode(msg, tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_segment_owned_by_another_user_is_refused(seg, tmp_path):
    msg = deposit(seg, [np.ones(4, np.float32)])
    os.chown(tmp_path / seg.name, 4242, 4242)
    with pytest.raises(AuthError, match="owner uid 4242"):
        decode(msg, tmp_path)


def test_a_framed_message_decodes_as_framed_with_its_payload_mac(tmp_path):
    framed = Codec(KEY, RUN, "rank:0").encode(RoundFrame(1, 0, 1.0), [np.ones(4, np.float32)])
    assert not is_by_reference(framed)
    assert decode(framed, tmp_path).record == RoundFrame(1, 0, 1.0)
    tampered = [framed[0], np.zeros(4, np.float32).tobytes(), framed[-1]]
    with pytest.raises(AuthError):
        decode(tampered, tmp_path)


def test_by_reference_refuses_a_payload_the_layout_does_not_hold(seg):
    seg.layout([4, 4])
    with pytest.raises(FramingError):
        by_reference(Codec(KEY, RUN, "rank:0"), RoundFrame(1, 0, 1.0), [np.ones(1, np.float32)], seg)


def test_a_dead_owners_segments_are_unlinked_and_no_one_elses(tmp_path):
    mine, other = Segment(KEY, RUN, rank_owner(3), str(tmp_path)), Segment(KEY, RUN, rank_owner(4), str(tmp_path))
    mine.layout([8])
    mine.layout([1 << 16])  # a second generation: the first is already gone
    other.layout([8])
    assert unlink_owner(RUN, rank_owner(3), str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == [other.name]
    other.close()
    assert os.listdir(tmp_path) == []


def test_an_agent_unlinks_its_own_hosts_segments_and_not_another_agents_on_the_same_machine(tmp_path):
    # Two agents on one machine share its shared memory: a re-form on one must not pull the other's
    # live segments from under its ranks (a test in namespaces met exactly that).
    ours = [Segment(KEY, RUN, owner, ensure_run_dir(KEY, RUN, str(tmp_path))) for owner in (host_owner("a"), rank_owner(0))]
    theirs = Segment(KEY, RUN, rank_owner(2), run_dir(KEY, RUN, str(tmp_path)))
    for seg in (*ours, theirs):
        seg.layout([8])
    assert unlink_host(KEY, RUN, "a", [0], str(tmp_path)) == 2
    assert os.listdir(run_dir(KEY, RUN, str(tmp_path))) == [theirs.name]
    theirs.close()
    assert unlink_host(KEY, RUN, "b", [2], str(tmp_path)) == 0 and os.listdir(tmp_path) == []  # the empty dir goes


def test_the_round_frame_vector_sent_by_reference_decodes_to_the_vectors_record(tmp_path):
    """PROTOCOL.md 3.5's example: the vector's header, its payload in a segment, the MAC from the spec."""
    vectors = json.loads((Path(__file__).resolve().parents[2] / "protocol/vectors/records.json").read_text())
    vec = next(v for v in (vectors if isinstance(vectors, list) else vectors["vectors"])
               if v["kind"] == "data.round_frame")
    frames = [bytes.fromhex(f) for f in vec["frames"]]
    run, key = bytes.fromhex(vec["incarnation"]), bytes.fromhex(vec["key"])
    owner = rank_owner(vec["record"]["rank"])
    seg = Segment(key, run, owner, str(tmp_path))
    try:
        payload = frames[1:-1]
        for dst, src in zip(seg.layout([len(p) for p in payload]), payload, strict=True):
            dst[:] = src
        loc = seg.locator()
        msg = [SHM_TAG, loc, frames[0], reference_mac_from_the_spec(key, frames[0], loc)]
        got = SegmentMap(run, str(tmp_path)).decode(Codec(key, run, "a"), msg, owner, Channel.DATA)
        want = Codec(key, run, "b").decode(frames, Channel.DATA)
        assert got.record == want.record and got.seq == want.seq
        for g, w in zip(got.payload, want.payload, strict=True):
            np.testing.assert_array_equal(g, w)
    finally:
        seg.close()


def test_a_segment_name_that_is_a_symlink_is_not_followed(seg, tmp_path):
    # Another of this user's private files, linked under the segment's name: never read as a payload.
    msg = deposit(seg, [np.ones(4, np.float32)])
    private = tmp_path / "elsewhere"
    private.write_bytes(b"\xff" * 4096)
    private.chmod(0o600)
    os.unlink(tmp_path / seg.name)
    os.symlink(private, tmp_path / seg.name)
    with pytest.raises(FramingError, match="cannot be opened"):
        decode(msg, tmp_path)
