"""A real cluster run's run directory: what the controller logs, and the report drawn from it."""

from __future__ import annotations

import json
import signal
import sys

import pytest
from test_training import Run

from flodl_zmq.runlog import EVENTS_FILE
from flodl_zmq.runreport import write_report

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def test_a_cluster_run_logs_rounds_epochs_and_a_killed_rank_and_its_report_marks_the_death(tmp_path):
    run_dir = tmp_path / "run"
    r = Run("--epochs", "6", "--batch-size", "16", "--step-ms", "4")
    r.cluster.run_dir = str(run_dir)  # what `flodl-zmq launch --run-dir` sets
    r.start()
    r.wait_for("[controller] epoch 2/")
    r.cluster.kill("h1:2", signal.SIGKILL)
    code, result, out = r.finish()
    assert code == 0, out
    events = [json.loads(line) for line in (run_dir / EVENTS_FILE).read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and events[-1]["reason"] == "completed", kinds
    assert events[0]["world"] == {"h0": [0, 1], "h1": [2, 3]} and events[0]["world_size"] == 4
    assert kinds.count("epoch") == 6 and kinds.count("eval") >= 6
    deaths = [e for e in events if e["kind"] == "death"]
    assert [d["rank"] for d in deaths] == [2], deaths
    rounds = [e for e in events if e["kind"] == "round"]
    assert rounds and all(len(e["counts"]) == 4 and e["round_ms"] > 0 for e in rounds), rounds
    assert any(e["verdict"] in ("stable", "suppress_growth", "nudge_down") for e in rounds), rounds
    assert [e["epoch"] for e in events if e["kind"] == "epoch"] == [row["epoch"] for row in result["epochs"]]
    page = write_report(run_dir).read_text()
    assert "death rank 2" in page and 'class="mark mark-death"' in page
