"""Payload by reference: the message is the framed one, only its payload lies in shared memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.errors import AuthError, FramingError, SchemaError, WireError
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import RoundFrame
from flodl_zmq.wire.shm import (
    ALIGN,
    SHM_TAG,
    Segment,
    SegmentMap,
    by_reference,
    is_by_reference,
    rank_owner,
    segment_prefix,
    unlink_owner,
)

KEY, RUN = new_key(), bytes(range(16))


def deposit(seg: Segment, tensors: list[np.ndarray], seq_codec: Codec | None = None) -> list:
    """What a rank sends: the tensors laid out in its segment, the message by reference."""
    views = seg.layout([t.nbytes for t in tensors])
    placed = [np.frombuffer(v, t.dtype).reshape(t.shape) for v, t in zip(views, tensors, strict=True)]
    for dst, src in zip(placed, tensors, strict=True):
        np.copyto(dst, src)
    codec = seq_codec or Codec(KEY, RUN, "rank:0")
    return by_reference(codec.encode(RoundFrame(1, 0, 2.0), placed), seg.locator())


@pytest.fixture
def seg(tmp_path):
    s = Segment(RUN, rank_owner(0), str(tmp_path))
    yield s
    s.close()


def test_by_reference_decodes_to_exactly_what_the_framed_message_carries(seg, tmp_path):
    tensors = [np.arange(1000, dtype=np.float32), np.full((3, 5), 7, np.uint16)]
    msg = deposit(seg, tensors)
    assert is_by_reference(msg) and msg[0] == SHM_TAG and len(msg) == 4
    frames = SegmentMap(RUN, str(tmp_path)).resolve(msg, rank_owner(0))
    env = Codec(KEY, RUN, "relay").decode(frames, Channel.DATA)
    assert env.record == RoundFrame(1, 0, 2.0) and env.dtypes == ["f32", "bf16"]
    for got, want in zip(env.payload, tensors, strict=True):
        np.testing.assert_array_equal(got, want)
    # The same header and MAC verify as a framed message over the same bytes.
    framed = [msg[2], *[t.tobytes() for t in tensors], msg[3]]
    Codec(KEY, RUN, "other").decode(framed, Channel.DATA)


def test_frames_are_aligned_and_the_segment_is_reused_while_the_layout_fits(seg):
    views = seg.layout([10, 100, 1])
    first = seg.name
    offsets = msgpack.unpackb(seg.locator())[1]
    assert [o for o, _ in offsets] == [0, ALIGN, 3 * ALIGN] and [n for _, n in offsets] == [10, 100, 1]
    assert [v.nbytes for v in views] == [10, 100, 1]
    seg.layout([50])
    assert seg.name == first


def test_a_larger_layout_moves_to_a_new_generation_and_the_reader_follows(seg, tmp_path):
    reader = SegmentMap(RUN, str(tmp_path))
    small = deposit(seg, [np.ones(4, np.float32)])
    old = seg.name
    reader.resolve(small, rank_owner(0))
    big = deposit(seg, [np.full(10_000, 3, np.float32)], Codec(KEY, RUN, "rank:0"))
    assert seg.name != old and not os.path.exists(tmp_path / old)
    env = Codec(KEY, RUN, "relay").decode(reader.resolve(big, rank_owner(0)), Channel.DATA)
    assert env.payload[0].size == 10_000 and float(env.payload[0][-1]) == 3.0


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_byte_changed_in_the_segment_after_signing_fails_the_mac(tmp_path_factory, data):
    where = str(tmp_path_factory.mktemp("shm"))
    seg = Segment(RUN, rank_owner(0), where)
    try:
        msg = deposit(seg, [np.arange(64, dtype=np.float32), np.arange(10, dtype=np.float32)])
        view = seg.layout([256, 40])  # the same layout: the bytes just sent
        frame = data.draw(st.integers(0, 1))
        i = data.draw(st.integers(0, view[frame].nbytes - 1))
        view[frame][i] ^= 1 << data.draw(st.integers(0, 7))
        with pytest.raises(AuthError):
            Codec(KEY, RUN, "relay").decode(SegmentMap(RUN, where).resolve(msg, rank_owner(0)), Channel.DATA)
    finally:
        seg.close()


def _with_locator(msg: list, locator: object) -> list:
    return [msg[0], msgpack.packb(locator), msg[2], msg[3]]


@pytest.mark.parametrize(
    "locator, error",
    [
        (b"\xc1", SchemaError),  # not msgpack
        ({"seg": "x"}, SchemaError),
        (["/etc/passwd", [[0, 4]]], FramingError),
        ([f"{segment_prefix(RUN, 'r0')}1/../../x", [[0, 4]]], FramingError),
        ([f"{segment_prefix(bytes(16), 'r0')}1", [[0, 4]]], FramingError),  # another run
        ([f"{segment_prefix(RUN, 'r1')}1", [[0, 4]]], FramingError),  # another rank's segment
        ([f"{segment_prefix(RUN, 'r0')}1", [[0, 1 << 30]]], FramingError),  # outside the segment
        ([f"{segment_prefix(RUN, 'r0')}1", [[-1, 4]]], FramingError),
        ([f"{segment_prefix(RUN, 'r0')}9", [[0, 4]]], FramingError),  # no such segment
    ],
)
def test_a_locator_may_only_name_the_senders_own_segment_in_this_run(seg, tmp_path, locator, error):
    msg = deposit(seg, [np.ones(4, np.float32)])
    assert seg.name == f"{segment_prefix(RUN, 'r0')}1"
    with pytest.raises(error):
        SegmentMap(RUN, str(tmp_path)).resolve(_with_locator(msg, locator), rank_owner(0))


def test_a_framed_message_is_not_resolved_as_a_reference(tmp_path):
    framed = Codec(KEY, RUN, "rank:0").encode(RoundFrame(1, 0, 1.0), [np.ones(4, np.float32)])
    assert not is_by_reference(framed)
    with pytest.raises(WireError):
        SegmentMap(RUN, str(tmp_path)).resolve(framed, rank_owner(0))


def test_by_reference_refuses_a_locator_that_does_not_match_the_payload(seg):
    seg.layout([4, 4])
    frames = Codec(KEY, RUN, "rank:0").encode(RoundFrame(1, 0, 1.0), [np.ones(1, np.float32)])
    with pytest.raises(FramingError):
        by_reference(frames, seg.locator())


def test_a_dead_owners_segments_are_unlinked_and_no_one_elses(tmp_path):
    mine, other = Segment(RUN, rank_owner(3), str(tmp_path)), Segment(RUN, rank_owner(4), str(tmp_path))
    mine.layout([8])
    mine.layout([1 << 16])  # a second generation: the first is already gone
    other.layout([8])
    assert unlink_owner(RUN, rank_owner(3), str(tmp_path)) == 1
    assert sorted(os.listdir(tmp_path)) == [other.name]
    other.close()
    assert os.listdir(tmp_path) == []


def test_the_round_frame_vector_sent_by_reference_decodes_as_framed(tmp_path):
    """PROTOCOL.md 3.5's example: the vector's header and MAC, its payload bytes in a segment."""
    vectors = json.loads((Path(__file__).resolve().parents[2] / "protocol/vectors/records.json").read_text())
    vec = next(v for v in (vectors if isinstance(vectors, list) else vectors["vectors"])
               if v["kind"] == "data.round_frame")
    frames = [bytes.fromhex(f) for f in vec["frames"]]
    run = bytes.fromhex(vec["run_id"])
    seg = Segment(run, rank_owner(vec["record"]["rank"]), str(tmp_path))
    try:
        payload = frames[1:-1]
        for dst, src in zip(seg.layout([len(p) for p in payload]), payload, strict=True):
            dst[:] = src
        msg = by_reference(frames, seg.locator())
        resolved = SegmentMap(run, str(tmp_path)).resolve(msg, rank_owner(vec["record"]["rank"]))
        key = bytes.fromhex(vec["key"])
        got = Codec(key, run, "a").decode(resolved, Channel.DATA)
        want = Codec(key, run, "b").decode(frames, Channel.DATA)
        assert got.record == want.record and got.seq == want.seq
        for g, w in zip(got.payload, want.payload, strict=True):
            np.testing.assert_array_equal(g, w)
    finally:
        seg.close()
