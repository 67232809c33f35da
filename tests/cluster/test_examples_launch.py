"""The examples under `flodl-zmq launch` (1 host x 2 ranks), as examples/README.md shows them, for a few seconds each."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def launch_example(script: str, *args: str, run_dir: Path | None = None) -> dict:
    """Run examples/`script` on a local cluster (its run log in `run_dir`); returns the controller's RESULT record."""
    cmd = [sys.executable, "-m", "flodl_zmq.cli", "launch", "--hosts", "1", "--ranks-per-host", "2",
           *(["--run-dir", str(run_dir)] if run_dir is not None else []), "--", str(ROOT / "examples" / script), *args]
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
    assert "RESULT" not in out.replace("[controller] RESULT", ""), "only the controller prints a result"
    return json.loads(results[0][len("[controller] RESULT "):])


def test_cnn_digits_under_launch_reports_accuracy_from_the_controller() -> None:
    result = launch_example("cnn_digits.py", "--epochs", "2", "--limit", "512", "--quiet")
    assert 0.0 <= result["accuracy"] <= 1.0


@pytest.mark.parametrize("split", [False, True], ids=["own-batch", "split-every-step"])
def test_char_transformer_under_launch_reports_a_finite_validation_loss(tmp_path, split) -> None:
    # Its rounds carry the model's float buffers too: a constant -inf attention mask
    # there would get both ranks evicted by the relay's non-finite check.
    extra = ["--batch-size", "16", "--every-step"] if split else []
    result = launch_example("char_transformer.py", "--epochs", "1", "--train-chars", "20000", "--val-chars", "4000",
                            "--quiet", *extra, run_dir=tmp_path)
    assert math.isfinite(result["val_loss"]) and result["val_loss"] < math.log(128)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["kind"] == "round"]
    # ElChe's window as each round's log line states it: one step with --every-step, its own otherwise.
    assert rounds and all(r["anchor"] == 1 for r in rounds) == split, [r["anchor"] for r in rounds]
