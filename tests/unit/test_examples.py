"""The examples run as a user runs them, alone (`python examples/X.py`), for a few seconds each."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def run_example(script: str, *args: str) -> dict:
    """Run examples/`script` in a fresh interpreter; returns its RESULT line's record."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0][len("RESULT "):])


def test_cnn_digits_trains_alone_and_reports_accuracy() -> None:
    result = run_example("cnn_digits.py", "--epochs", "1", "--limit", "256", "--quiet")
    assert 0.0 <= result["accuracy"] <= 1.0


def test_own_loop_keeps_its_loop_under_a_session_and_stops_early_when_it_breaks() -> None:
    result = run_example("own_loop.py", "--epochs", "3", "--stop-after", "60", "--log-every", "20", "--quiet")
    # 45 steps an epoch (batch 32): the loop broke in the second epoch, so one epoch finished.
    assert [e["epoch"] for e in result["epochs"]] == [0]
    assert result["epochs"][0]["scalars"]["penalty"] > 0  # record_scalar from the user's loop


def test_char_transformer_beats_uniform_guessing_on_held_out_files() -> None:
    result = run_example("char_transformer.py", "--epochs", "1", "--train-chars", "20000", "--val-chars", "4000",
                         "--quiet")
    # "A few hundred thousand parameters", and a validation loss below uniform guessing over the vocabulary.
    assert 100_000 < result["parameters"] < 1_000_000
    assert result["val_loss"] < math.log(128)
