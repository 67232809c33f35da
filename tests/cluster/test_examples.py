"""The CNN example under `flodl-zmq launch` (1 host x 2 ranks), as the README shows it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def test_cnn_digits_under_launch_reports_accuracy_from_the_controller() -> None:
    cmd = [sys.executable, "-m", "flodl_zmq.cli", "launch", "--hosts", "1", "--ranks-per-host", "2", "--",
           str(ROOT / "examples" / "cnn_digits.py"), "--epochs", "2", "--limit", "512", "--quiet"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher tears its process groups down on SIGTERM
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"launch did not finish in time:\n{out}")
    assert proc.returncode == 0, out
    results = [line for line in out.splitlines() if line.startswith("[controller] RESULT ")]
    assert len(results) == 1, out
    assert 0.0 <= json.loads(results[0][len("[controller] RESULT "):])["accuracy"] <= 1.0
    assert "RESULT" not in out.replace("[controller] RESULT", ""), "only the controller prints a result"
