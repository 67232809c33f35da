"""bench/round.py runs end to end and prints the JSON keys docs/benchmarks.md documents."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster import procs

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def test_round_bench_prints_every_documented_figure_for_both_transports():
    # One dtype, f32: the keys of every dtype are made by the same code, and bf16's conversions have every
    # process of each fresh world import torch (its run took 34 s here, f32's 11 s). bf16 rounds between
    # real processes are tested in test_dataplane_processes.
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/round.py"), "--sizes", "1M", "--dtypes", "f32", "--rounds", "3",
         "--warmup", "1", "--repeats", "1", "--transports", "shm,socket", "--json"],
        capture_output=True, text=True, timeout=170, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("gloo_ms", "gloo_cpu_ms", "zmq_ms", "zmq_cpu_ms", "ratio", "zmq_ms_socket", "zmq_cpu_ms_socket",
                "ratio_socket", "fold_vs_numpy"):
        key = f"{key}_f32_1M"
        assert key in figures, sorted(figures)
        assert math.isfinite(figures[key]) and figures[key] >= 0, (key, figures[key])
    assert figures["ratio_f32_1M"] == pytest.approx(figures["zmq_ms_f32_1M"] / figures["gloo_ms_f32_1M"], rel=0.01)


def test_the_bench_killed_leaves_none_of_its_processes_behind():
    # A user's kill of the bench alone (no Ctrl-C to the whole group) must not leave its ranks and services
    # waiting for ever on a stop event or a barrier no one will set.
    bench = subprocess.Popen([sys.executable, str(ROOT / "bench/round.py"), "--sizes", "1M", "--dtypes", "f32",
                              "--rounds", "500", "--repeats", "1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 60
    while len(spawned := procs.children(bench.pid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)  # the gloo side's four ranks, spawned at once
    bench.kill()
    bench.wait(timeout=10)
    assert len(spawned) >= 4, spawned
    deadline = time.monotonic() + 30
    while (left := [p for p in spawned if procs.alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"still running after their bench was killed: {left}"
