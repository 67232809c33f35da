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
    # Lean: 2 hosts, one round, a 7M-parameter (28 MB) vector, cut into the sharded layout's 3 shards (the
    # controller's and one per host); every case's keys come from the same code.
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
    # Sharded (3 shards): the controller's shard takes its slice (569 of the 1,709 blocks of 4096 values,
    # 9.3 MB) from both hosts, then sends it to both, 37 MB through its link in order: under the bound.
    assert figures["round_s_2h_7M_s2"] is not None, figures["why_null"]
    assert figures["floor_s_2h_7M_s2"] == pytest.approx(4 * 569 * 4096 * 4 * 8 / 1e9)
    assert figures["round_s_2h_7M_s2"] >= figures["floor_s_2h_7M_s2"], figures


def test_a_model_of_fewer_blocks_than_shards_is_not_sharded_and_the_reason_says_so():
    shards = topology.shard_map({"h1": "10.0.0.2", "h2": "10.0.0.3"})
    assert str(shards) == "h1=tcp://10.0.0.2:7400,h2=tcp://10.0.0.3:7400"
    assert topology.why_not_sharded(shards, 3 * 4096) is None  # 3 blocks, 3 shards
    why = topology.why_not_sharded(shards, 2 * 4096)
    assert why is not None and "3 shards for a model of 8192 values (2 block(s)" in why


def test_a_sharded_rounds_floor_is_its_busiest_links_bytes():
    eight = topology.shard_map({f"h{i}": f"10.0.0.{i}" for i in range(1, 9)})
    # 25M over 9 even shards of 678 or 679 blocks: the controller's shard takes its 678 blocks (11.1 MB) in
    # from all 8 hosts before it sends them out to them, 2 x 8 x 11.1 MB through one link: under the bound's
    # 2M by 2H / (H + 1). (Whole chunks, before protocol 9, gave three hosts 2 of the 12: 1.88 s, over it.)
    floor = topology.sharded_floor_s(eight, 25_000_000, 1e9)
    assert floor == pytest.approx(2 * 8 * 678 * 4096 * 4 * 8 / 1e9)
    assert floor == pytest.approx(topology.bound_s(25_000_000, 1e9) * 8 / 9, rel=2e-3)
