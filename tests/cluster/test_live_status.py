"""`flodl-zmq status --watch` on a run started by `flodl-zmq launch`: the address it prints, a live table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
from test_training import Run

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]

ROW = re.compile(r"^\s*(\d+)\s+(h\d)\s+(alive|dead|exited)\s")


def test_status_watch_follows_a_launched_run_rank_by_rank(tmp_path):
    r = Run("--epochs", "6", "--batch-size", "16", "--step-ms", "8")
    r.cluster.run_dir = str(tmp_path / "run")
    r.start()
    r.wait_for("[launch] controller at")
    hint = next(line for line in r.cluster.output().splitlines() if line.startswith("[launch] controller at"))
    key, address = re.search(r"FLODL_KEY=([0-9a-f]{64}) flodl-zmq status --controller (\S+) --watch", hint).groups()
    watcher = subprocess.Popen(
        [sys.executable, "-m", "flodl_zmq.cli", "status", "--controller", address, "--watch", "--interval", "0.3"],
        env={**os.environ, "FLODL_KEY": key}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watcher.stdout), daemon=True)
    reader.start()
    try:
        code, _result, out = r.finish()
        assert code == 0, out
        assert watcher.wait(30) in (0, 1)  # 0: it saw the end; 1: the controller was gone first (said)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    reader.join(5)
    headers = [line for line in lines if line.startswith(f"controller {address}  epoch ")]
    assert len(headers) >= 2, "".join(lines)  # redrawn while the run went on
    rows = [ROW.match(line) for line in lines]
    seen = {(int(m.group(1)), m.group(2)) for m in rows if m}
    assert seen == {(0, "h0"), (1, "h0"), (2, "h1"), (3, "h1")}, "".join(lines)
    assert any(m and m.group(3) == "alive" for m in rows)
    assert "ended: completed" in "".join(lines) or "stopped answering" in lines[-1], "".join(lines)
