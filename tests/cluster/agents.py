"""`flodl-zmq controller` and one agent per host as plain processes on this machine, run to their end."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from flodl_zmq.wire import new_key

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "flodl_zmq.cli"]
T = TypeVar("T")


def run_agents(tmp_path: Path, port: int, program: list[str], hosts: str | tuple[str, ...], *, min_ranks: int,
               env: dict[str, str] | None = None, controller_env: dict[str, str] | None = None,
               late: tuple[str, ...] = (), timeout: float = 200.0) -> tuple[dict[str, str], dict[str, int]]:
    """A run of `program` under a controller on 127.0.0.1:`port` and an agent (one CPU rank) per host in
    `hosts`, all sharing one fresh key: each one's output and exit status by name, none left running.

    `env` goes to every process, `controller_env` to the controller alone; the world forms at every host
    or, after the join window, at `min_ranks`. The agents of `late` dial in once the world has formed
    (the run's first event `start`): they join mid-run."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLODL_KEY": new_key().hex(), **(env or {})}
    procs = {"controller": subprocess.Popen(
        [*CLI, "controller", "--bind", f"127.0.0.1:{port}", "--min-ranks", str(min_ranks), "--target-ranks",
         str(len(hosts)), "--join-window", "60", "--run-dir", str(tmp_path / "run"), "--", *program],
        cwd=tmp_path, env={**env, **(controller_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)}

    def agent(host: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*CLI, "agent", "--controller", f"127.0.0.1:{port}", "--host", host, "--cpu-slots", "1",
             "--join-timeout", "60", "--script", shlex.join(program)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    procs |= {host: agent(host) for host in hosts}
    if late:
        wait_for_event(tmp_path, "start", timeout)
        procs |= {host: agent(host) for host in late}
    outputs, codes = {}, {}
    try:
        for name, proc in procs.items():
            outputs[name], _ = proc.communicate(timeout=timeout)
            codes[name] = proc.returncode
    finally:
        for proc in procs.values():
            proc.kill()
            proc.communicate()
    return outputs, codes


def until(probe: Callable[[], T], what: str | Callable[[], str], timeout: float) -> T:
    """`probe()`'s first truthy value, asked every 50 ms for at most `timeout` seconds; else it fails saying
    `what` (a callable: what it says then, such as a log so far)."""
    deadline = time.monotonic() + timeout
    while not (seen := probe()):
        assert time.monotonic() < deadline, f"{what() if callable(what) else what} (waited {timeout:g} s)"
        time.sleep(0.05)
    return seen


def wait_for_event(tmp_path: Path, kind: str, timeout: float = 90.0) -> None:
    """Until the run of `run_agents(tmp_path, ...)` has written an event of `kind` to its run directory."""
    until(lambda: any(f'"kind": "{kind}"' in f.read_text() for f in (tmp_path / "run").glob("**/events.jsonl")),
          f"the run wrote no {kind!r} event", timeout)


def when(event: str, tmp_path: Path, act) -> threading.Thread:
    """A thread that runs `act()` once the run of `run_agents(tmp_path, ...)` has written an `event`."""
    thread = threading.Thread(target=lambda: (wait_for_event(tmp_path, event), act()), daemon=True)
    thread.start()
    return thread
