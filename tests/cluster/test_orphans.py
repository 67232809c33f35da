"""No orphans: a launcher killed outright leaves no relay, rank or controller behind.

A test harness's `timeout` SIGKILLs or SIGTERMs the launcher (or the pytest
process that holds a `Cluster`) without letting it tear down, and its children
run in sessions of their own, so no signal reaches them. They stop on the end
of file of the launcher's lifeline pipe (FLODL_LIFELINE_FD), as on SIGTERM,
instead of waiting for a controller that never comes back (docs/operations.md,
Failure behaviour).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from flodl_zmq.launch import free_port_base
from flodl_zmq.links import remove_local_dir
from flodl_zmq.wire import key_from_hex
from flodl_zmq.wire.shm import unlink_run
from tests.cluster import procs

ROOT = Path(__file__).resolve().parents[2]
DEMO = ["-m", "flodl_zmq.demo", "--epochs", "100000"]  # far longer than any test waits
# docs/operations.md, "When the launcher dies": every child stops at once as on SIGTERM, a rank
# after at most 5 s for its goodbye's acknowledgement, given the CPU to run. Waited for as a hang
# guard, not as a speed: a stress run (a load of 8 on 2 cores) saw ranks take more than 10 s to
# get through their exit. The lifeline is the only way out within it: a rank would otherwise stop
# only after its coordinator's silence, set far beyond it here (SILENCE).
ORPHAN_DEADLINE_S = 60.0
SILENCE = {"FLODL_COORDINATOR_SILENCE_AT_RANK": "600"}
# A pytest-like parent: holds the Cluster in-process, and dies of SIGTERM without tearing down.
PARENT = f"""
from flodl_zmq.launch import Cluster
c = Cluster(argv={DEMO!r}, hosts=2, ranks_per_host=1, sink=lambda line: print(line, flush=True))
c.start()
c.wait()
"""

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="/proc, sessions")]


def children_of(pid: int) -> dict[int, str]:
    """The live processes `pid` started, with their FLODL_ROLE. /proc shows those its warm
    interpreter forked (flodl_zmq/warm.py) the interpreter's environment, and their own name:
    the controller, or a rank's label."""
    out = {}
    for child in procs.children(pid):
        with contextlib.suppress(OSError):  # gone meanwhile
            if b"flodl_zmq.warm" not in Path(f"/proc/{child}/cmdline").read_bytes():
                out[child] = environ_of(child).get("FLODL_ROLE", "")
                continue
            out[child] = "warm"
            for forked in procs.children(child):
                name = Path(f"/proc/{forked}/comm").read_text().strip()
                out[forked] = "controller" if name == "controller" else "rank"
    return out


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_text()
    return dict(v.split("=", 1) for v in raw.split("\0") if "=" in v)


def start(argv: list[str]) -> subprocess.Popen:
    """Start the launcher and return once the controller reported a trained epoch (every role is up)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **SILENCE)
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    wait_for_an_epoch(proc)
    return proc


def wait_for_an_epoch(proc: subprocess.Popen) -> queue.Queue[str]:
    """Return once `proc` (a launcher or a controller) printed a trained epoch: every rank is past start-up.
    The lines it prints after that come on the queue returned.

    A rank watches its lifeline from `Trainer.run` on; a rank still importing
    torch when its parent dies stops only when it gets there.
    """
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(raw.decode(errors="replace")) for raw in proc.stdout],
                     daemon=True).start()
    if next_line(lines, lambda line: line.startswith(("[controller] epoch ", "epoch ")), 90) is None:
        proc.kill()
        proc.wait(10)
        pytest.fail("the cluster trained no epoch within 90 s")
    return lines


def next_line(lines: queue.Queue[str], wanted: Callable[[str], bool], timeout: float) -> str | None:
    """The first line `wanted` within `timeout` s (None then); every line read is printed, for a failure's log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        print(line, end="")
        if wanted(line):
            return line
    return None


def left_after_deadline(children: dict[int, str]) -> dict[int, str]:
    """The children still running ORPHAN_DEADLINE_S from now (polled; those gone early end the wait)."""
    deadline = time.monotonic() + ORPHAN_DEADLINE_S
    while time.monotonic() < deadline and any(procs.alive(p) for p in children):
        time.sleep(0.1)
    return {p: role for p, role in children.items() if procs.alive(p)}


def reap(children: dict[int, str], key: bytes, run_id: bytes | None) -> None:
    """SIGKILL what is left and remove the run's segments and sockets (a SIGKILLed process leaves them)."""
    for pid in children:
        if procs.alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if run_id is not None:
        unlink_run(key, run_id)
        remove_local_dir(key, run_id)


@pytest.mark.parametrize("how", ["sigkill-launcher", "sigkill-launcher-then-controller", "sigterm-parent"])
def test_every_child_exits_when_the_launcher_dies_without_tearing_down(how):
    if how == "sigterm-parent":
        launcher = start(["-c", PARENT])
    else:
        launcher = start(["-m", "flodl_zmq.cli", "launch", "--hosts", "2", "--ranks-per-host", "1", "--", *DEMO])
    children = children_of(launcher.pid)
    key, run_id = bytes(32), None  # the run's, once read from a relay: what reap unlinks
    try:
        assert sorted(children.values()) == ["controller", "rank", "rank", "relay", "relay", "warm"], children
        env = environ_of(next(p for p, role in children.items() if role == "relay"))
        key, run_id = key_from_hex(env["FLODL_KEY"]), bytes.fromhex(env["FLODL_INCARNATION"])
        # While they run, the services leave the cores to the ranks' steps (environment.behind_the_ranks).
        batch, other = frozenset({os.SCHED_BATCH}), frozenset({os.SCHED_OTHER})
        assert {(role, frozenset(procs.policies(p))) for p, role in children.items() if role != "warm"} == {
            ("controller", batch), ("relay", batch), ("rank", other)}
        launcher.send_signal(signal.SIGTERM if how == "sigterm-parent" else signal.SIGKILL)
        launcher.wait(10)
        if how == "sigkill-launcher-then-controller":
            with contextlib.suppress(ProcessLookupError):  # it may have stopped on its own already
                os.kill(next(p for p, role in children.items() if role == "controller"), signal.SIGKILL)
        left = left_after_deadline(children)
        assert not left, f"still running {ORPHAN_DEADLINE_S:g} s after the launcher died: {left}"
    finally:
        if launcher.poll() is None:  # a check failed before the launcher was stopped: nothing outlives the test
            launcher.kill()
            launcher.wait(10)
        reap(children, key, run_id)


def controller_and_agents(host_silence: str, *agent_args: str) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
    """`flodl-zmq controller` of the demo (its output piped) and two agents, h0 and h1, of one CPU slot each,
    in sessions of their own under a fresh key."""
    address = f"127.0.0.1:{free_port_base()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", FLODL_KEY=os.urandom(32).hex(), **SILENCE)
    controller = subprocess.Popen(
        [sys.executable, "-m", "flodl_zmq.cli", "controller", "--bind", address, "--min-ranks", "2",
         "--target-ranks", "2", "--host-silence", host_silence, "--", *DEMO],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    agents = [subprocess.Popen(
        [sys.executable, "-m", "flodl_zmq.cli", "agent", "--controller", address, "--host", f"h{i}",
         "--cpu-slots", "1", *agent_args, "--script", " ".join(DEMO[:2])],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for i in range(2)]
    return controller, agents


def test_a_sigkilled_agent_leaves_no_relay_or_rank_behind():
    # The agent gives its children the same lifeline as the launcher (agent.py): its death closes it.
    controller, agents = controller_and_agents("600")
    children: dict[int, str] = {}
    key, run_id = b"", None
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and sorted(children.values()) != ["rank", "relay", "warm"]:
            children = children_of(agents[0].pid)
            time.sleep(0.2)
        assert sorted(children.values()) == ["rank", "relay", "warm"], f"agent h0 started {children} within 90 s"
        lines = wait_for_an_epoch(controller)
        relay_env = environ_of(next(p for p, role in children.items() if role == "relay"))
        key, run_id = key_from_hex(relay_env["FLODL_KEY"]), bytes.fromhex(relay_env["FLODL_INCARNATION"])
        agents[0].kill()
        agents[0].wait(10)
        # Its rank is a failure, reported by its relay as it goes: not a goodbye (a rank leaving on purpose,
        # which max_failures would not count), and not after the host's silence (600 s here).
        said = next_line(lines, lambda line: "declared dead" in line or "said goodbye" in line, ORPHAN_DEADLINE_S)
        assert said is not None and "declared dead: the relay on h0 saw it leave" in said, said
        left = left_after_deadline(children)
        assert not left, f"still running {ORPHAN_DEADLINE_S:g} s after their agent was SIGKILLed: {left}"
    finally:
        for proc in agents[1:]:  # the other host's relay and rank, which no test kill reached
            children.update(children_of(proc.pid))
        for proc in (*agents, controller):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        reap(children, key, run_id)
