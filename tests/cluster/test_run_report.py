"""A launched cluster run seen by its user: `flodl-zmq status --watch` and Prometheus live, then the run directory.

One run serves all (they start the same cluster): the watch follows it from
the address the launcher prints, a scraper reads `--metrics-port`'s
/metrics while it trains, and the controller logs rounds, epochs and a
killed rank into the run directory the report and the TensorBoard event
files are drawn from.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_training import Run

from flodl_zmq.launch import free_port_base
from flodl_zmq.runlog import EVENTS_FILE
from flodl_zmq.runreport import write_report
from flodl_zmq.wire import new_key
from tests.cluster.digits_job import held

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]

EPOCHS = 9
ROW = re.compile(r"^\s*(\d+)\s+(h\d)\s+(alive|dead|exited)\s")
SCRAPE_EVERY_S = 0.1


def scrape_until(port: int, stop: threading.Event, seen: list[dict[str, float]]) -> None:
    """Scrape http://127.0.0.1:port/metrics until `stop`, keeping each answer's unlabelled samples.

    A refused or failed scrape (the controller not up yet, or gone) is skipped: `seen` is what a
    Prometheus server polling the endpoint would have stored.
    """
    while not stop.wait(SCRAPE_EVERY_S):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                text = reply.read().decode()
        except OSError:
            continue
        seen.append({s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels})


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
    r.cluster.metrics_port = metrics_port = free_port_base()  # what `flodl-zmq launch --metrics-port` sets
    scrapes: list[dict[str, float]] = []
    stop_scraping = threading.Event()
    scraper = threading.Thread(target=scrape_until, args=(metrics_port, stop_scraping, scrapes), daemon=True)
    scraper.start()
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
        assert watcher.wait(30) == 0  # it saw the end: the controller stays up for a watcher (EndWatch)
    finally:
        stop_scraping.set()
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    reader.join(5)
    scraper.join(10)

    # Prometheus, scraped while the run trained: the round counter rising, the killed rank counted.
    rounds_seen = sorted({s["flodl_rounds_total"] for s in scrapes})
    assert len(rounds_seen) >= 3, scrapes  # it rose twice
    assert max(s["flodl_rank_deaths_total"] for s in scrapes) == 1, scrapes

    # The live view: redrawn while the run went on, a row per rank.
    headers = [line for line in lines if line.startswith(f"controller {address}  epoch ")]
    assert len(headers) >= 2, "".join(lines)
    rows = [ROW.match(line) for line in lines]
    seen = {(int(m.group(1)), m.group(2)) for m in rows if m}
    assert seen == {(0, "h0"), (1, "h0"), (2, "h1"), (3, "h1")}, "".join(lines)
    assert any(m and m.group(3) == "alive" for m in rows)
    assert "ended: completed" in headers[-1] and "stopped answering" not in "".join(lines), "".join(lines)

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
    # TensorBoard's own reader, on the event files beside events.jsonl: the same epochs and rounds.
    board = EventAccumulator(str(run_dir))
    board.Reload()
    assert [e.step for e in board.Scalars("loss")] == [e["epoch"] + 1 for e in events if e["kind"] == "epoch"]
    assert {f"share/rank{r}" for r in range(4)} <= set(board.Tags()["scalars"])
    assert len(board.Scalars("round_ms")) == len(rounds)
    assert max(rounds_seen) <= len(rounds)
    page = write_report(run_dir).read_text()
    assert "death rank 2" in page and 'class="mark mark-death"' in page


def test_a_run_its_launcher_stops_ends_its_run_log_saying_so_without_a_traceback(tmp_path, warm):
    # The controller died of launch's SIGTERM (Ctrl-C) mid-round: events.jsonl stopped at a round
    # line, so the run directory could not tell a stopped run from a crashed one.
    gate = tmp_path / "gate"  # never opened: the ranks hold after an epoch until they are stopped
    r = Run("--epochs", "6", "--batch-size", "16", *held(gate, after_epochs=1, epochs=6, ranks=2),
            warm=warm, hosts=1, ranks_per_host=2)
    r.cluster.run_dir = str(tmp_path / "run")
    r.start()
    try:
        r.wait_for("[controller] epoch 1/6")
    finally:
        r.cluster.shutdown()  # what Ctrl-C on `flodl-zmq launch` does: SIGTERM to every process it started
    events = [json.loads(line) for line in (tmp_path / "run" / EVENTS_FILE).read_text().splitlines()]
    assert [e["kind"] for e in events].count("end") == 1
    assert events[-1]["kind"] == "end" and events[-1]["reason"] == "interrupted"
    assert "Traceback" not in r.cluster.output()
