"""bench/peers.py runs ours and a peer over shaped links and prints the keys docs/benchmarks.md documents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.netns import unavailable

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_peers_bench_prints_a_time_to_target_per_run_number_or_null():
    if (why := unavailable()) is not None:
        pytest.skip(why)
    # Lean: one task, ours and the peer torch ships, one repeat, one epoch (ours may miss the target: null;
    # the peer, given up to 4x the epochs, stops at it).
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/peers.py"), "--tasks", "mlp", "--runs", "flodl_int8,postlocalsgd",
         "--repeats", "1", "--epochs", "1", "--cap", "30", "--json"],
        capture_output=True, text=True, timeout=290, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for run in ("flodl_int8", "postlocalsgd"):
        for key in (f"time_to_target_s_{run}_100mbit", f"final_metric_{run}_100mbit"):
            assert key in figures, sorted(figures)
            assert figures[key] is None or isinstance(figures[key], float), (key, figures[key])
        assert figures[f"final_metric_{run}_100mbit"] is not None, f"{run} printed no result:\n{out.stderr[-3000:]}"
    assert "time_to_target_s_flodl_int8_transformer_100mbit" not in figures  # --tasks chose the mlp alone
