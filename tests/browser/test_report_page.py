"""The run report (flodl_zmq/runreport.py): the page drawn from a run's events, and that page in a real browser.

In the browser (Debian's Chromium, headless, report.html opened from disk)
it must load with no console message at all (no error, no blocked fetch:
the page's policy forbids every one), and every chart must be drawn: the
page's own script counts the SVG charts with a visible line or dot and records any
script error in the DOM, which the browser's DOM dump shows. A screenshot is
kept in the test's temp directory for a person to look at.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from flodl_zmq.cli import main as cli
from flodl_zmq.runlog import EVENTS_FILE, RunLog
from flodl_zmq.runreport import REPORT_FILE, read_events, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
)
CHARTS = 9

NO_CHROMIUM = "needs Debian's chromium (apt-get install chromium; scripts/test.sh installs it when run as root)"


def synthetic_run(run_dir: Path, exit_rank: int | None = None) -> Path:
    """A cluster run's log as the controller writes it: 4 ranks, a death, guard pressure, a checkpoint (and
    `exit_rank` leaving mid-run, when given)."""
    log = RunLog(run_dir)
    log.write("start", mode="cpu-cadence", epochs=4, world_size=4, world={"h0": [0, 1], "h1": [2, 3]})
    for i in range(12):
        counts = [10 + i, 12 + i, 8, 0 if i > 6 else 3]
        verdict = ("stable", "suppress_growth", "nudge_down")[i % 3]
        log.write("round", round=i + 1, round_ms=40.0 + i, global_step=30 * i, epoch=i // 3, counts=counts,
                  anchor=10, verdict=verdict, divergence=0.01 * (i + 1))
        if i % 3 == 2:
            e = i // 3
            log.write("epoch", epoch=e, avg_loss=2.0 / (e + 1), epoch_ms=900.0, batch_share=[0.3, 0.3, 0.3, 0.1],
                      throughput=[900.0, 880.0, 870.0, 300.0 if e < 2 else float("nan")])
            log.write("eval", epoch=e, metric=0.5 + 0.1 * e)
        if i == 6:
            log.write("death", rank=3, reason="its agent on h1 reported exit code -9")
        if i == 4 and exit_rank is not None:
            log.write("exit", rank=exit_rank, reason="its loop broke or raised: it said goodbye")
    log.write("checkpoint", path=str(run_dir / "model.pt"), reason="completed", epoch=4)
    log.write("end", reason="completed", wall_s=12.5, final_eval=0.8)
    log.close()
    return run_dir


def test_the_report_draws_every_chart_and_marks_the_death(tmp_path):
    page = write_report(synthetic_run(tmp_path / "run")).read_text()
    for chart_id in ("loss-time", "eval-time", "loss-epoch", "eval-epoch", "share", "throughput", "round-time",
                     "windows", "divergence"):
        figure = page.split(f'id="{chart_id}"', 1)[1].split("</figure>", 1)[0]
        assert 'class="series"' in figure or 'class="dot"' in figure, chart_id
    assert page.count('class="mark mark-death"') >= 6  # on every chart against wall time
    assert "rank 3: its agent on h1 reported exit code -9" in page
    assert "nudge_down" in page and "suppress_growth" in page
    # Self-contained: nothing is fetched, and the policy forbids trying.
    assert "default-src 'none'" in page and "http://" not in page and "https://" not in page and "src=" not in page


def test_a_torn_last_line_is_skipped_and_counted(tmp_path):
    run_dir = synthetic_run(tmp_path / "torn")
    with open(run_dir / EVENTS_FILE, "a") as f:
        f.write('{"t": 1, "kind": "rou')  # a crash mid-write
    ev = read_events(run_dir)
    assert ev.skipped == 1 and len(ev["round"]) == 12
    assert "unreadable lines" in write_report(run_dir).read_text()


def test_report_command_writes_the_page_and_names_a_missing_log(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "cmd")
    assert cli(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir / REPORT_FILE)
    assert cli(["report", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nowhere" / EVENTS_FILE) in err and "run directory" in err


def browse(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium on `page` with a fresh profile; its console lines go to stderr."""
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
@pytest.mark.timeout(180)
def test_the_report_loads_without_console_messages_and_draws_every_chart(tmp_path):
    page = write_report(synthetic_run(tmp_path / "run"))
    dom = browse(page, tmp_path / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console
    root = re.search(r"<html[^>]*>", dom.stdout)
    assert root is not None, dom.stdout[:500]
    assert 'data-errors="0"' in root.group(0), root.group(0)
    assert f'data-charts-drawn="{CHARTS}"' in root.group(0), root.group(0)
    assert dom.stdout.count("<figure") == CHARTS and 'class="mark mark-death"' in dom.stdout

    shot = tmp_path / "report.png"
    browse(page, tmp_path / "profile-shot", f"--screenshot={shot}", "--window-size=1280,2400")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")


TIME_CHARTS = ("loss-time", "eval-time", "share", "throughput", "round-time", "windows", "divergence")


@pytest.mark.skipif(CHROMIUM is None, reason=NO_CHROMIUM)
@pytest.mark.timeout(180)
def test_a_rank_that_left_mid_run_is_marked_on_every_time_chart_listed_and_counted(tmp_path):
    # The run log's `exit` events (a rank that said goodbye before the end) were on the console and in
    # events.jsonl, and nowhere on the page: its share fell to 0 with no mark saying why.
    page = write_report(synthetic_run(tmp_path / "run", exit_rank=2))
    dom = browse(page, tmp_path / "profile-dom", "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    shown = dom.stdout
    for chart_id in TIME_CHARTS:
        figure = shown.split(f'id="{chart_id}"', 1)[1].split("</figure>", 1)[0]
        mark = re.search(r'<line class="mark mark-exit"[^>]*stroke="([^"]+)"><title>([^<]*)</title>', figure)
        assert mark is not None, (chart_id, figure[:3000])
        assert mark.group(2).startswith("exit rank 2: its loop broke or raised: it said goodbye at ")
        assert f'fill="{mark.group(1)}"></rect><text class="legend" x=' in figure and ">exit</text>" in figure
        assert mark.group(1) != re.search(r'class="mark mark-death"[^>]*stroke="([^"]+)"', figure).group(1)
    row = re.search(r'<tr class="ev-exit"><td>[0-9.]+ s</td><td>([^<]*)</td></tr>', shown)
    assert row is not None and row.group(1) == "exit rank 2: its loop broke or raised: it said goodbye"
    assert "<th>exits</th><td>1</td>" in shown
