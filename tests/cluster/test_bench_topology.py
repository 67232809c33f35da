"""bench/topology.py runs a round over shaped links and prints the keys docs/benchmarks.md documents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.netns import unavailable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import topology  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_a_case_this_machine_cannot_hold_is_skipped_with_the_reason_and_half_the_hosts_run_instead():
    # 8 hosts at 100M need about 22.1 GB (the reducer's 11 copies, 5 per host); 4 hosts 11.7 GB.
    cases = topology.plan([2, 8], ["100M"], available=16e9)
    assert [(c.hosts, c.size, c.skipped is None) for c in cases] == [(2, "100M", True), (8, "100M", False),
                                                                      (4, "100M", True)]
    assert "ran 4 hosts instead" in cases[1].skipped and "16.0 GB available" in cases[1].skipped
    assert [c.hosts for c in topology.plan([4, 8], ["100M"], available=16e9)] == [4, 8]  # 4 is asked anyway


def test_topology_bench_prints_every_key_and_each_layout_is_no_faster_than_its_links_allow():
    if (why := unavailable()) is not None:
        pytest.skip(why)
    # Lean: 2 hosts, one round, a 7M-parameter (28 MB) vector: 4 chunks of 2^21 values, enough for the
    # sharded layout's 3 shards (the controller's and one per host); every case's keys come from the same code.
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/topology.py"), "--hosts", "2", "--sizes", "7M", "--rounds", "1",
         "--warmup", "0", "--json"],
        capture_output=True, text=True, timeout=170, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("round_s_2h_7M_s1", "round_s_2h_7M_s2", "bound_s_2h_7M", "gloo_s_2h_7M", "reasks_2h_7M_s1",
                "reasks_2h_7M_s2", "floor_s_2h_7M_s2"):
        assert key in figures, sorted(figures)
    assert figures["bound_s_2h_7M"] == pytest.approx(2 * 28e6 * 8 / 1e9)  # 2M bytes at 1 Gbit/s
    assert figures["gloo_s_2h_7M"] > 0, figures["why_null"]
    # Physical floors, not speed guesses. The one reducer takes both hosts' 28 MB frames in through its one
    # shaped link (2M bytes) before it can publish, so no round of that layout beats the bound.
    assert figures["round_s_2h_7M_s1"] >= figures["bound_s_2h_7M"], figures
    # Sharded (3 shards): the controller's shard takes its 8.4 MB slice from both hosts, then sends it to
    # both, 33.5 MB through its link in order: two thirds of the bound.
    assert figures["round_s_2h_7M_s2"] is not None, figures["why_null"]
    assert figures["floor_s_2h_7M_s2"] == pytest.approx(4 * 2**21 * 4 * 8 / 1e9)
    assert figures["round_s_2h_7M_s2"] >= figures["floor_s_2h_7M_s2"], figures


def test_a_model_of_fewer_chunks_than_shards_is_not_sharded_and_the_reason_says_so():
    shards = topology.shard_map({"h1": "10.0.0.2", "h2": "10.0.0.3"})
    assert str(shards) == "h1=tcp://10.0.0.2:7400,h2=tcp://10.0.0.3:7400"
    assert topology.why_not_sharded(shards, 3 * 2**21) is None  # 3 chunks, 3 shards
    why = topology.why_not_sharded(shards, 2 * 2**21)
    assert why is not None and "3 shards for a model of 2 chunk(s)" in why


def test_a_sharded_rounds_floor_is_its_busiest_links_bytes_whole_chunks_included():
    eight = topology.shard_map({f"h{i}": f"10.0.0.{i}" for i in range(1, 9)})
    # 25M is 12 chunks over 9 shards: h2, h5 and h8 own 2 chunks (16.8 MB), which each takes in from the 7
    # other hosts before it sends it out to them: 2 x 7 x 16.8 MB through one link, over the bound's 2M.
    floor = topology.sharded_floor_s(eight, 25_000_000, 1e9)
    assert floor == pytest.approx(2 * 7 * 2 * 2**21 * 4 * 8 / 1e9)
    assert floor > topology.bound_s(25_000_000, 1e9)
