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

pytestmark = pytest.mark.timeout(120)


def test_a_case_this_machine_cannot_hold_is_skipped_with_the_reason_and_half_the_hosts_run_instead():
    # 8 hosts at 100M need about 22.1 GB (the reducer's 11 copies, 5 per host); 4 hosts 11.7 GB.
    cases = topology.plan([2, 8], ["100M"], available=16e9)
    assert [(c.hosts, c.size, c.skipped is None) for c in cases] == [(2, "100M", True), (8, "100M", False),
                                                                      (4, "100M", True)]
    assert "ran 4 hosts instead" in cases[1].skipped and "16.0 GB available" in cases[1].skipped
    assert [c.hosts for c in topology.plan([4, 8], ["100M"], available=16e9)] == [4, 8]  # 4 is asked anyway


def test_topology_bench_prints_every_key_and_one_shard_is_no_faster_than_the_bandwidth_bound():
    if (why := unavailable()) is not None:
        pytest.skip(why)
    # Lean: 2 hosts, a 1M-parameter (4 MB) vector, one round; the keys of every case come from the same code.
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/topology.py"), "--hosts", "2", "--sizes", "1M", "--rounds", "1",
         "--warmup", "0", "--json"],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("round_s_2h_1M_s1", "round_s_2h_1M_s2", "bound_s_2h_1M", "gloo_s_2h_1M", "reasks_2h_1M_s1"):
        assert key in figures, sorted(figures)
    assert figures["round_s_2h_1M_s2"] is None and "does not exist" in figures["why_null"]["round_s_2h_1M_s2"]
    assert figures["bound_s_2h_1M"] == pytest.approx(2 * 4e6 * 8 / 1e9)  # 2M bytes at 1 Gbit/s
    assert figures["gloo_s_2h_1M"] > 0, figures["why_null"]
    # A physical floor, not a speed guess: the one reducer takes both hosts' 4 MB frames in through its one
    # shaped link (2M bytes) before it can publish, so no round of today's layout beats the bound.
    assert figures["round_s_2h_1M_s1"] >= figures["bound_s_2h_1M"], figures
