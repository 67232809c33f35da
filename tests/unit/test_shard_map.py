"""The shard map and the consensus put together from its shards' slices (flodl_zmq/shards.py, PROTOCOL.md 10.9)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flodl_zmq.errors import ConfigError, ProtocolError
from flodl_zmq.shards import Assembly, ShardMap, slice_of

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


@pytest.mark.parametrize("case", VECTORS["vectors"], ids=lambda c: f"{c['chunks']}c-{c['shards']}s")
def test_chunks_split_into_contiguous_runs_as_the_spec_vectors_say(case):
    m = ShardMap(tuple((f"h{k}", f"tcp://10.0.0.{k}:7400") for k in range(1, case["shards"])))
    got = m.ranges(case["chunks"])
    assert [[r.start, r.stop] for r in got] == case["ranges"]
    assert sum(len(r) for r in got) == case["chunks"] and all(len(r) >= 1 for r in got)


def test_more_shards_than_chunks_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="3 shards for a model of 2 chunk"):
        ShardMap.parse("a=tcp://1.2.3.4:1000,b=tcp://1.2.3.5:1000").ranges(2)


def test_a_slice_is_its_chunks_frames_two_each_under_int8():
    payload = list(range(10))
    assert slice_of(payload, range(1, 3), 1) == [1, 2]
    assert slice_of(payload, range(1, 3), 2) == [2, 3, 4, 5]


def test_a_round_is_whole_once_every_shard_is_in_in_shard_order_whatever_order_they_came():
    a = Assembly([1, 2, 1])
    assert a.add(2, 5, 3.0, ["c"]) is None
    assert a.add(0, 5, 3.0, ["a"]) is None
    whole = a.add(1, 5, 3.0, ["b1", "b2"])
    assert (whole.round_id, whole.mass, whole.payload) == (5, 3.0, ["a", "b1", "b2", "c"])


def test_a_slice_of_a_round_older_than_the_last_whole_one_is_dropped_and_older_partial_rounds_are_forgotten():
    a = Assembly([1, 1])
    a.add(0, 1, 1.0, ["x"])  # round 1 never completes
    a.add(0, 2, 1.0, ["a"])
    assert a.add(1, 2, 1.0, ["b"]).round_id == 2
    assert a.add(1, 1, 1.0, ["late"]) is None
    assert a.add(1, 2, 1.0, ["again"]) is None


def test_a_slice_of_mass_zero_makes_the_round_keep_every_ranks_state():
    a = Assembly([1, 1])
    a.add(0, 1, 4.0, ["a"])
    assert a.add(1, 1, 0.0, ["zeros"]).mass == 0.0


def test_a_slice_of_another_layout_or_an_unknown_shard_is_a_protocol_violation():
    a = Assembly([1, 2])
    with pytest.raises(ProtocolError, match="shard 1's slice of round 3 has 1 payload frames, its chunks 2"):
        a.add(1, 3, 1.0, ["only one"])
    with pytest.raises(ProtocolError, match="from shard 2, but the run has 2 shards"):
        a.add(2, 3, 1.0, ["x"])
