"""The run directory: events.jsonl from a run alone, where it goes, and its failures (the report: tests/browser)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_zmq import demo
from flodl_zmq.runlog import EVENTS_FILE, run_dir_for


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / EVENTS_FILE).read_text().splitlines()]


def test_training_alone_writes_one_line_per_epoch_eval_and_the_end(tmp_path):
    run_dir = tmp_path / "alone"
    result = demo.trainer(2, quiet=True, run_dir=str(run_dir), save_path=str(tmp_path / "m")).run()
    lines = events(run_dir)
    kinds = [e["kind"] for e in lines]
    assert kinds[0] == "start" and kinds[-1] == "end", kinds
    assert kinds.count("epoch") == 2 and kinds.count("eval") == 2 and kinds.count("checkpoint") == 1
    assert kinds.index("checkpoint") < kinds.index("end")  # the log ends with the run's end
    epoch = next(e for e in lines if e["kind"] == "epoch")
    assert epoch["batch_share"] == [1.0] and epoch["throughput"][0] > 0
    assert lines[-1]["final_eval"] == result.final_eval
    assert all(lines[i]["t"] <= lines[i + 1]["t"] for i in range(len(lines) - 1))


def test_the_run_directory_is_the_trainers_then_the_commands_then_a_fresh_one(tmp_path, monkeypatch):
    assert run_dir_for("a", "b") == Path("a")
    assert run_dir_for(None, "b") == Path("b")
    one, two = run_dir_for(None, None), run_dir_for(None, None)
    assert one.parent == Path("runs") and one != two
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLODL_RUN_DIR", "from-env")
    demo.trainer(1, quiet=True).run()
    assert (tmp_path / "from-env" / EVENTS_FILE).is_file()


def test_an_unwritable_run_directory_is_reported_once_and_the_run_goes_on(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="flodl_zmq.runlog"):
        result = demo.trainer(2, quiet=True, run_dir=str(blocker / "run")).run()
    assert result.final_eval is not None and len(result.epochs) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "flodl_zmq.runlog"]
    assert len(warnings) == 1 and str(blocker / "run" / EVENTS_FILE) in warnings[0], warnings


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_full_disk_is_reported_once_with_the_path_and_the_run_goes_on(tmp_path, caplog):
    run_dir = tmp_path / "full"
    run_dir.mkdir()
    # One page of tmpfs, filled: every write there fails with ENOSPC (a symlink to /dev/full is refused).
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k,mode=0700", "tmpfs", str(run_dir)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        fd = os.open(run_dir / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while os.write(fd, b"x" * 4096):
                pass
        os.close(fd)
        with caplog.at_level(logging.WARNING, logger="flodl_zmq.runlog"):
            result = demo.trainer(2, quiet=True, run_dir=str(run_dir)).run()
        assert len(result.epochs) == 2
        warnings = [r.getMessage() for r in caplog.records if r.name == "flodl_zmq.runlog"]
        assert len(warnings) == 1 and "No space left" in warnings[0] and str(run_dir) in warnings[0], warnings
    finally:
        subprocess.run(["umount", str(run_dir)], check=True)


def test_a_run_directory_given_to_a_second_run_says_so_and_the_report_draws_the_last_run(tmp_path, caplog):
    # Five runs in one run_dir made one report: the first's mode and world, the last's final eval, all
    # their epochs and rounds added up, on one time axis.
    from flodl_zmq.runreport import read_events, write_report

    run_dir = tmp_path / "runs"
    demo.trainer(3, quiet=True, run_dir=str(run_dir)).run()
    with caplog.at_level(logging.WARNING, logger="flodl_zmq.runlog"):
        second = demo.trainer(2, quiet=True, run_dir=str(run_dir)).run()
    assert any("holds an earlier run's events" in r.getMessage() for r in caplog.records)
    drawn = read_events(run_dir)
    assert drawn.earlier == 1 and len(drawn["epoch"]) == 2 and drawn["end"][-1]["final_eval"] == second.final_eval
    assert "1 in this log before this one, not drawn" in write_report(run_dir).read_text()
