"""`flodl-zmq demo` as a new user runs it: a short run, its figures, and why the cluster trails (real processes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def test_a_short_demo_says_why_the_cluster_trails_the_process_alone(tmp_path: Path) -> None:
    # `demo --epochs 2` ended at 40-57 % for the cluster against 89 % alone, with no word of why: a user
    # took it for a bug. One epoch: every rank trains an equal quarter of it, so the consensus trails.
    cmd = [sys.executable, "-m", "flodl_zmq.cli", "demo", "--epochs", "1", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=200, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    cluster = float(re.search(r"test accuracy, cluster \(consensus\): +([0-9.]+)%", out).group(1))
    alone = float(re.search(r"test accuracy, one process alone: +([0-9.]+)%", out).group(1))
    assert cluster < alone, out
    assert ("the cluster trails: its 4 ranks split every epoch, so each takes 1/4 of the steps alone takes (same "
            "batch size and learning rate), and their average moves about as far as one process at 128 a batch; "
            "it catches up over more epochs (the default is 15)") in proc.stdout, out
    assert (tmp_path / "run" / "report.html").is_file()
