"""bench/tta.py runs end to end and prints the JSON keys docs/benchmarks.md documents."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import tta  # noqa: E402

from flodl_zmq.datasets import digits  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def test_a_split_batch_is_the_lone_runs_batch_over_the_worlds_ranks():
    assert tta.keywords({}, "1x2") == {"batch_size": tta.BATCH}
    assert tta.keywords({"batch_size": "split", "anchor": 1}, "1x2") == {"batch_size": tta.BATCH // 2, "anchor": 1}
    assert tta.keywords({"batch_size": "split"}, "2x2slow")["batch_size"] == tta.BATCH // 4
    assert tta.keywords({"batch_size": 8}, "1x2")["batch_size"] == 8


def test_tta_bench_prints_every_documented_figure_for_a_pair_and_alone():
    # ours and alone only: a best run goes through the same code with `_best` keys (and its batch rule is
    # tested above); each run here is a fresh cluster or process, as the bench's figures count from its start.
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench/tta.py"), "--jobs", "cnn", "--worlds", "1x2", "--runs", "ours,alone",
         "--repeats", "1", "--timeline", "--json"],
        capture_output=True, text=True, timeout=230, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["best"] == {"cnn": tta.BEST["cnn"]}
    for tag in ("ours_cnn_1x2", "alone_cnn"):
        for key in ("ttt_s", "ttt_cmd_s", "samples", "budget_metric", "final", "run_s", "service_cpu_share",
                    "service_cpu_share_to_target"):
            assert f"{key}_{tag}" in figures, sorted(figures)
        assert 0.0 <= figures[f"final_{tag}"] <= 1.0 and figures[f"run_s_{tag}"] > 0
    assert 0.0 < figures["service_cpu_share_ours_cnn_1x2"] < 1.0
    assert figures["service_cpu_share_alone_cnn"] is None  # no services alone
    assert figures["service_cpu_share_to_target_alone_cnn"] is None
    # Scored within epochs (`eval_every_samples`, a quarter epoch): the pair's consensus at rounds, alone at steps.
    epochs = tta.JOBS["cnn"].epochs
    assert figures["evals_per_epoch"] == 4 and figures["evals_alone_cnn"] > 3 * epochs
    assert figures["evals_ours_cnn_1x2"] > epochs + 1, figures["evals_ours_cnn_1x2"]
    assert math.isfinite(figures["final_delta_vs_alone_cnn_1x2"])
    assert figures["run_speedup_vs_alone_cnn_1x2"] == pytest.approx(
        figures["run_s_alone_cnn"] / figures["run_s_ours_cnn_1x2"], rel=0.01)
    # Time to target is a ratio only where both reached it (a run that misses has no time).
    if "tta_speedup_vs_alone_cnn_1x2" in figures:
        assert figures["tta_speedup_vs_alone_cnn_1x2"] == pytest.approx(
            figures["ttt_s_alone_cnn"] / figures["ttt_s_ours_cnn_1x2"], rel=0.01)
    # Each rank's time by phase, over the whole run and cut where the run reached the target (about a third
    # of the 12 epochs): the cut holds less of every rank's training, and about the span to the target (its
    # first batch is fetched before the first step), well short of the whole run's.
    ttt, run_s = figures["ttt_s_ours_cnn_1x2"], figures["run_s_ours_cnn_1x2"]
    if ttt is not None:
        assert 0.0 < figures["service_cpu_share_to_target_ours_cnn_1x2"] < 1.0
        for label in ("h0:0", "h0:1"):
            whole = figures[f"timeline_ours_cnn_1x2_{label}"]
            cut = figures[f"timeline_to_target_ours_cnn_1x2_{label}"]
            assert 0.0 < cut["train"] < whole["train"], (cut, whole)
            assert sum(v for k, v in cut.items() if k != "start-up") <= ttt + (run_s - ttt) / 2, (cut, ttt, run_s)
    # Every training step timed, alone as on a rank: alone steps each epoch's short last batch too, the pair's
    # chunks leave it out (flodl_zmq/coordinator/chunk_pool.py); a step's CPU time is within its wall time.
    samples = len(digits()[0])
    alone, pair = figures["steps_alone_cnn"], [figures[f"steps_ours_cnn_1x2_{label}"] for label in ("h0:0", "h0:1")]
    assert alone["n"] == epochs * math.ceil(samples / tta.BATCH), alone
    assert sum(s["n"] for s in pair) == epochs * (samples // tta.BATCH), pair
    for s in (alone, *pair):
        assert 0.0 < s["cpu_ms"] <= s["ms"] * 1.05, s


def test_lr_scale_reaches_every_runs_optimizer_and_a_bad_one_is_refused():
    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "bench/tta.py"), "--jobs", "cnn", "--runs", "alone",
                               "--repeats", "1", "--json", *extra], capture_output=True, text=True, timeout=120, cwd=ROOT)

    out = run("--lr-scale", "1e-4")  # SGD at a ten-thousandth of the job's rate: the digits stay unlearned
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["lr_scale"] == 1e-4
    assert figures["final_alone_cnn"] < 0.5 and figures["ttt_s_alone_cnn"] is None
    bad = run("--lr-scale", "0")
    assert bad.returncode == 2 and "--lr-scale 0.0 must be a positive number" in bad.stderr
