"""A launched cluster run seen by its user: `flodl-zmq status --watch` live, then the run directory and its report.

One run serves both (they start the same cluster): the watch follows it from
the address the launcher prints, and the controller logs rounds, epochs and
a killed rank into the run directory the report is drawn from.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from test_training import Run

from flodl_zmq.runlog import EVENTS_FILE
from flodl_zmq.runreport import write_report
from flodl_zmq.wire import new_key
from tests.cluster.digits_job import held

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]

EPOCHS = 9
ROW = re.compile(r"^\s*(\d+)\s+(h\d)\s+(alive|dead|exited)\s")


def test_a_launched_run_is_watched_rank_by_rank_and_its_run_directory_and_report_mark_a_killed_rank(
        tmp_path, warm, monkeypatch):
    run_dir = tmp_path / "run"
    key = new_key().hex()
    monkeypatch.setenv("FLODL_KEY", key)  # the launcher never prints a key: the user sets one to watch
    # Held (digits_job.held) from epoch 2 on until the kill is seen: the run cannot end before it.
    gate = tmp_path / "gate"
    r = Run("--epochs", str(EPOCHS), "--batch-size", "16", "--step-ms", "8",
            *held(gate, after_epochs=2, epochs=EPOCHS, ranks=4), warm=warm)
    r.cluster.run_dir = str(run_dir)  # what `flodl-zmq launch --run-dir` sets
    r.start()
    r.wait_for("[launch] controller at")
    hint = next(line for line in r.cluster.output().splitlines() if line.startswith("[launch] controller at"))
    address = re.search(r"watch it with: flodl-zmq status --controller (\S+) --watch", hint).group(1)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "flodl_zmq.cli", "status", "--controller", address, "--watch", "--interval", "0.3"],
        env={**os.environ, "FLODL_KEY": key}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watcher.stdout), daemon=True)
    reader.start()
    try:
        r.wait_for("[controller] epoch 2/")
        r.cluster.kill("h1:2", signal.SIGKILL)
        r.wait_for("rank 2 declared dead")
        gate.touch()
        code, result, out = r.finish()
        assert code == 0, out
        assert watcher.wait(30) in (0, 1)  # 0: it saw the end; 1: the controller was gone first (said)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    reader.join(5)

    # The live view: redrawn while the run went on, a row per rank.
    headers = [line for line in lines if line.startswith(f"controller {address}  epoch ")]
    assert len(headers) >= 2, "".join(lines)
    rows = [ROW.match(line) for line in lines]
    seen = {(int(m.group(1)), m.group(2)) for m in rows if m}
    assert seen == {(0, "h0"), (1, "h0"), (2, "h1"), (3, "h1")}, "".join(lines)
    assert any(m and m.group(3) == "alive" for m in rows)
    assert "ended: completed" in "".join(lines) or "stopped answering" in lines[-1], "".join(lines)

    # The run directory and the report drawn from it.
    events = [json.loads(line) for line in (run_dir / EVENTS_FILE).read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "end" and events[-1]["reason"] == "completed", kinds
    assert events[0]["world"] == {"h0": [0, 1], "h1": [2, 3]} and events[0]["world_size"] == 4
    assert kinds.count("epoch") == EPOCHS and kinds.count("eval") >= EPOCHS
    deaths = [e for e in events if e["kind"] == "death"]
    assert [d["rank"] for d in deaths] == [2], deaths
    rounds = [e for e in events if e["kind"] == "round"]
    assert rounds and all(len(e["counts"]) == 4 and e["round_ms"] > 0 for e in rounds), rounds
    assert any(e["verdict"] in ("stable", "suppress_growth", "nudge_down") for e in rounds), rounds
    assert [e["epoch"] for e in events if e["kind"] == "epoch"] == [row["epoch"] for row in result["epochs"]]
    page = write_report(run_dir).read_text()
    assert "death rank 2" in page and 'class="mark mark-death"' in page
