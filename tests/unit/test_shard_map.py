"""The shard map and the consensus put together from its shards' slices (flodl_zmq/shards.py, PROTOCOL.md 10.9)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flodl_zmq import int8
from flodl_zmq.errors import ConfigError, ProtocolError
from flodl_zmq.shards import Assembly, Cut, OuterGather, ShardMap, parts, state_frames
from flodl_zmq.wire_format import CHUNK_VALUES, F32, INT8

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "shards.json").read_text())


def test_an_unset_map_is_one_shard_the_controllers():
    assert ShardMap.parse(None).count == ShardMap.parse("  ").count == 1
    assert ShardMap.parse(None).shard_of("h1") is None


def test_listed_hosts_hold_shards_one_on_in_order_at_the_port_given_and_the_next():
    m = ShardMap.parse("h1=tcp://10.0.0.1:7400, h2=tcp://[fd00::2]:7500")
    assert (m.count, m.shard_of("h1"), m.shard_of("h2"), m.shard_of("h3")) == (3, 1, 2, None)
    assert m.endpoints(1) == ("tcp://10.0.0.1:7400", "tcp://10.0.0.1:7401")
    assert m.endpoints(2) == ("tcp://[fd00::2]:7500", "tcp://[fd00::2]:7501")
    assert ShardMap.parse(str(m)) == m


@pytest.mark.parametrize("text, says", [
    ("h1", "must be HOST=tcp://ADDRESS:PORT"),
    ("h1=10.0.0.1:7400", "must be tcp://ADDRESS:PORT"),
    ("h1=tcp://10.0.0.1", "must be tcp://ADDRESS:PORT"),
    ("h1=tcp://10.0.0.1:65535", "also binds the next port"),
    ("h1=tcp://10.0.0.1:7400,h1=tcp://10.0.0.2:7400", "names a host twice"),
])
def test_a_bad_map_is_refused_naming_the_entry_and_the_form(text, says):
    with pytest.raises(ConfigError, match=says):
        ShardMap.parse(text)


def test_a_map_naming_a_host_outside_the_world_is_refused():
    with pytest.raises(ConfigError, match="h9, not hosts of this world"):
        ShardMap.parse("h9=tcp://10.0.0.9:7400").check_world(["h1", "h2"])


def listed(shards: int) -> ShardMap:
    return ShardMap(tuple((f"h{k}", f"tcp://10.0.0.{k}:7400") for k in range(1, shards)))


@pytest.mark.parametrize("case", VECTORS["vectors"], ids=lambda c: f"{c['values']}v-{c['shards']}s")
def test_values_split_into_even_contiguous_runs_cut_at_chunks_into_frames_as_the_spec_vectors_say(case):
    got = listed(case["shards"]).ranges(case["values"])
    assert [[r.start, r.stop] for r in got] == case["ranges"]
    assert [[[p.start, p.stop] for p in parts(r)] for r in got] == case["frames"]
    assert got[0].start == 0 and got[-1].stop == case["values"]
    assert all(a.stop == b.start for a, b in zip(got, got[1:], strict=False))
    sizes = [len(r) for r in got]
    assert max(sizes) - min(sizes) <= int8.BLOCK  # whole blocks apart at most (the last one may be short)
    assert all(len(p) <= CHUNK_VALUES and p.start // CHUNK_VALUES == (p.stop - 1) // CHUNK_VALUES
               for r in got for p in parts(r))  # no frame crosses a chunk or outgrows one


def test_twelve_chunks_over_nine_shards_are_within_a_block_of_each_other_where_whole_chunks_gave_some_twice():
    sizes = [len(r) for r in listed(9).ranges(12 * CHUNK_VALUES)]
    assert max(sizes) / min(sizes) < 1.002


def test_more_shards_than_blocks_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"3 shards for a model of 8000 values \(2 block\(s\) of 4096\).*at most 1"):
        ShardMap.parse("a=tcp://1.2.3.4:1000,b=tcp://1.2.3.5:1000").ranges(8000)


def flat_payload(wire, n: int) -> list[np.ndarray]:
    """The payload, in chunk layout, of a flat vector of n distinct values (int8: values and scales)."""
    if wire is INT8:
        return wire.cut(np.arange(n).astype(np.int8), np.arange(int8.blocks(n), dtype=np.float32))
    return wire.cut(np.arange(n, dtype=np.float32))


@pytest.mark.parametrize("wire", [F32, INT8], ids=["f32", "int8"])
def test_slices_are_views_of_each_shards_values_and_join_back_into_the_payload_chunk_for_chunk(wire):
    n = 2 * CHUNK_VALUES + 3 * int8.BLOCK + 5  # three chunks, the last short, cut by 3 shards inside chunks
    payload = flat_payload(wire, n)
    cut = Cut.of(listed(3), n, wire.frames_per_chunk)
    slices = cut.slices(payload)
    step = wire.frames_per_chunk
    for k, piece in enumerate(slices):
        assert cut.check(k, piece) is None
        r = listed(3).ranges(n)[k]
        assert np.array_equal(np.concatenate(piece[::step]), np.concatenate(payload[::step])[r.start : r.stop])
        if wire is INT8:  # each part starts on a block: its scales are the flat vector's for its values
            assert np.array_equal(np.concatenate(piece[1::2]),
                                  np.concatenate(payload[1::2])[r.start // int8.BLOCK : int8.blocks(r.stop)])
        assert all(any(np.shares_memory(f, p) for p in payload) for f in piece)
    whole = cut.join(slices)
    assert [f.dtype for f in whole] == [f.dtype for f in payload]
    assert all(np.array_equal(a, b) for a, b in zip(whole, payload, strict=True))


def test_a_chunk_inside_one_slice_is_passed_on_as_it_is_only_a_chunk_cut_between_shards_is_copied():
    n = 4 * CHUNK_VALUES  # 2 shards: the boundary falls between chunks 1 and 2
    payload = flat_payload(F32, n)
    cut = Cut.of(listed(2), n, 1)
    whole = cut.join(cut.slices(payload))
    assert all(np.shares_memory(a, b) for a, b in zip(whole, payload, strict=True))


def test_a_payload_of_another_model_is_refused_not_cut_out_of_shape():
    cut = Cut.of(listed(3), 3 * CHUNK_VALUES, 1)
    with pytest.raises(ProtocolError, match=f"a payload of {2 * CHUNK_VALUES} values in 2 chunks, where this run's "
                                            f"shards cut {3 * CHUNK_VALUES} values"):
        cut.slices(flat_payload(F32, 2 * CHUNK_VALUES))


def test_a_round_is_whole_once_every_shard_is_in_in_chunk_order_whatever_order_they_came():
    n = 3 * int8.BLOCK  # one chunk, a block for each of 3 shards
    a = Assembly(Cut.of(listed(3), n, 1))
    block = [np.full(int8.BLOCK, float(k), np.float32) for k in range(3)]
    assert a.add(2, 5, 3.0, [block[2]]) is None
    assert a.add(0, 5, 3.0, [block[0]]) is None
    whole = a.add(1, 5, 3.0, [block[1]])
    assert (whole.round_id, whole.mass) == (5, 3.0)
    assert len(whole.payload) == 1 and np.array_equal(whole.payload[0], np.concatenate(block))


def two_blocks() -> tuple[Assembly, list[np.ndarray], list[np.ndarray]]:
    """An Assembly of 2 shards owning a block each, and a slice for each."""
    return (Assembly(Cut.of(listed(2), 2 * int8.BLOCK, 1)), [np.zeros(int8.BLOCK, np.float32)],
            [np.ones(int8.BLOCK, np.float32)])


def test_a_slice_of_a_round_older_than_the_last_whole_one_is_dropped_and_older_partial_rounds_are_forgotten():
    a, x, y = two_blocks()
    a.add(0, 1, 1.0, x)  # round 1 never completes
    a.add(0, 2, 1.0, x)
    assert a.add(1, 2, 1.0, y).round_id == 2
    assert a.add(1, 1, 1.0, y) is None
    assert a.add(1, 2, 1.0, y) is None


def test_the_oldest_round_some_shards_sent_and_not_all_names_the_shards_it_waits_for():
    a = Assembly(Cut.of(listed(3), 3 * int8.BLOCK, 1))
    block = [np.full(int8.BLOCK, float(k), np.float32) for k in range(3)]
    assert a.waiting() is None
    a.add(0, 4, 1.0, [block[0]])
    a.add(2, 4, 1.0, [block[2]])
    a.add(0, 5, 1.0, [block[0]])
    assert a.waiting() == (4, [1])
    a.add(1, 4, 1.0, [block[1]])  # round 4 whole: round 5 waits for shards 1 and 2
    assert a.waiting() == (5, [1, 2])


def test_a_slice_of_mass_zero_makes_the_round_keep_every_ranks_state():
    a, x, y = two_blocks()
    a.add(0, 1, 4.0, x)
    assert a.add(1, 1, 0.0, y).mass == 0.0


def test_a_slice_of_another_layout_or_an_unknown_shard_is_a_protocol_violation():
    a, x, y = two_blocks()
    with pytest.raises(ProtocolError, match="shard 1's slice of round 3 has 2 payload frames, its parts 1"):
        a.add(1, 3, 1.0, y + y)
    with pytest.raises(ProtocolError, match=r"shard 1's slice of round 3 has frames of shape \[\(4095,\)\] for "
                                            r"values 4096 to 8192, which take \[\(4096,\)\]"):
        a.add(1, 3, 1.0, [y[0][1:]])
    with pytest.raises(ProtocolError, match=r"has frames of shape \[\(4096, 2\)\]"):  # as many rows, twice the values
        a.add(1, 3, 1.0, [np.ones((int8.BLOCK, 2), np.float32)])
    with pytest.raises(ProtocolError, match="from shard 2, but the run has 2 shards"):
        a.add(2, 3, 1.0, x)


# ---------------------------------------------------------------- the shards' outer state (PROTOCOL.md 10.9 item 12)


def test_the_shards_outer_state_is_whole_once_every_shard_sent_the_same_round():
    cut = Cut.of(ShardMap.parse("h1=tcp://10.0.0.2:7400,h2=tcp://10.0.0.3:7400"), 3 * CHUNK_VALUES + 5, 1)
    model = np.arange(cut.n_values, dtype=np.float32)
    momentum = -model
    gather = OuterGather(cut)

    def state(k: int) -> list[np.ndarray]:
        v = cut.values(k)
        return state_frames(model[v.start:v.stop], momentum[v.start:v.stop])

    assert all(f.size <= CHUNK_VALUES for k in range(3) for f in state(k))  # no frame longer than a chunk
    gather.add(0, 4, state(0))
    gather.add(1, 4, state(1))
    gather.add(2, 5, state(2))  # a newer round: round 4's slices are dropped
    assert gather.whole is None
    gather.add(2, 4, state(2))  # an older round than the newest seen: dropped
    gather.add(0, 5, state(0))
    gather.add(1, 5, state(1))
    assert gather.whole is not None and gather.whole[0] == 5
    np.testing.assert_array_equal(gather.whole[1], model)
    np.testing.assert_array_equal(gather.whole[2], momentum)


@pytest.mark.parametrize(("shard", "frames", "named"), [
    (3, [np.zeros(4096, np.float32)] * 2, "from shard 3, but the run has 3 shards"),
    (1, [np.zeros(100, np.float32)] * 2, "not its slice's"),
    (0, [np.zeros(4096, np.float32)], "not its slice's"),
    (0, [np.zeros(4096, np.float64)] * 2, "f32"),
], ids=["unknown-shard", "wrong-size", "odd-frames", "f64"])
def test_an_outer_state_that_is_not_the_shards_slice_is_refused_by_name(shard, frames, named):
    cut = Cut.of(ShardMap.parse("h1=tcp://10.0.0.2:7400,h2=tcp://10.0.0.3:7400"), 3 * 4096, 1)  # a block each
    with pytest.raises(ProtocolError, match=named):
        OuterGather(cut).add(shard, 1, frames)
