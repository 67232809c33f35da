"""The warm interpreter (flodl_zmq/warm.py): a forked child runs a script as `python script.py` would."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_zmq.environment import with_tunables
from flodl_zmq.errors import ConfigError
from flodl_zmq.warm import WarmServer, runnable
from tests.unit.test_environment import MALLOC_FREE_RSS, torch_threads_of

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(sys.platform != "linux", reason="fork, SCM_RIGHTS")]

SCRIPT = textwrap.dedent("""
    import atexit, gc, json, os, sys, threading, time
    atexit.register(lambda: print("atexit ran", flush=True))
    def late():
        time.sleep(0.2)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()
    fd = os.environ.get("PASSED_FD")
    print(json.dumps({
        "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
        "env": {k: os.environ.get(k) for k in ("ASKED", "ONLY_IN_SERVER")},
        "passed": os.read(int(fd), 5).decode() if fd and sys.argv[1:] != ["until-eof"] else None,
        "session_leader": os.getsid(0) == os.getpid(), "torch_preloaded": "torch" in sys.modules,
        "collector": gc.isenabled(),
    }), flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    if sys.argv[1:] == ["raise"]:
        raise RuntimeError("raised on purpose")
    if sys.argv[1:] == ["hang"]:
        time.sleep(60)
    if sys.argv[1:] == ["until-eof"]:
        while os.read(int(fd), 1):
            pass
        print("finished on its own", flush=True)
    sys.exit(int(sys.argv[1]) if sys.argv[1:] else 0)
""")


@pytest.fixture(scope="module")
def server() -> Iterator[WarmServer]:
    warm = WarmServer({**os.environ, "ONLY_IN_SERVER": "yes"})
    yield warm
    warm.close()


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job" / "script.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def report(text: str) -> dict:
    return json.loads(next(line for line in text.splitlines() if line.startswith("{")))


def test_a_forked_script_runs_as_python_would_with_the_requests_argv_environment_and_descriptors(server, script):
    read, write = os.pipe()
    os.write(write, b"hello")
    try:
        child = server.spawn("job", [str(script), "3"], {"ASKED": "1", "PASSED_FD": str(read)}, pass_fds=(read,))
    finally:
        os.close(read)
        os.close(write)
    out = child.stdout.read().decode()
    assert child.wait(10) == 3
    seen = report(out)
    assert seen["argv"] == [str(script), "3"] and seen["name"] == "__main__"
    assert seen["path0"] == str(script.parent) and seen["cwd"] == os.getcwd()
    # The request's environment only: not the server's (the launcher passes its own on purpose).
    assert seen["env"] == {"ASKED": "1", "ONLY_IN_SERVER": None}
    assert seen["passed"] == "hello" and seen["session_leader"]
    assert seen["torch_preloaded"]  # the reason to fork: torch is imported already
    assert seen["collector"]  # off while the server imported, on again for what the script makes
    # stderr on the same pipe; at exit, non-daemon threads are joined, then atexit runs.
    assert "on stderr" in out and out.index("thread joined") < out.index("atexit ran")


def test_an_exception_exits_1_with_its_traceback_and_a_module_runs_with_dash_m(server, script):
    child = server.spawn("job", [str(script), "raise"], {})
    out = child.stdout.read().decode()
    assert child.wait(10) == 1
    assert "RuntimeError: raised on purpose" in out and "atexit ran" in out
    module = server.spawn("job", ["-m", "json.tool", "--help"], {})
    assert "usage:" in module.stdout.read().decode() and module.wait(10) == 0


def test_a_child_killed_by_a_signal_reads_as_subprocess_would(server, script):
    child = server.spawn("job", [str(script), "hang"], {})
    assert child.stdout.readline().startswith(b"{")  # it runs
    assert child.poll() is None
    assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "job"  # what ps -o comm and top show
    os.killpg(child.pid, signal.SIGKILL)  # its own process group, as the launcher's teardown sends
    assert child.wait(10) == -signal.SIGKILL


def test_a_dead_server_takes_its_children_and_the_next_spawn_names_it(script):
    warm = WarmServer(os.environ)
    try:
        child = warm.spawn("job", [str(script), "hang"], {})
        assert child.stdout.readline().startswith(b"{")
        warm.proc.kill()
        assert child.wait(10) == -signal.SIGKILL
        with pytest.raises(ConfigError, match="warm interpreter"):
            warm.spawn("job", [str(script)], {})
    finally:
        warm.close()
    assert not running(child.pid)  # no orphan left


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie that init has yet to reap does not)."""
    deadline = time.monotonic() + 10.0  # a hang guard: the kernel signals at the server's exit
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.01)
    return True


def test_a_server_whose_client_is_gone_lets_its_children_finish_and_then_exits(script):
    # A launcher killed outright: its children stop on their own lifeline, gracefully, not killed.
    warm = WarmServer(os.environ)
    lifeline, keep = os.pipe()
    try:
        child = warm.spawn("job", [str(script), "until-eof"], {"PASSED_FD": str(lifeline)}, pass_fds=(lifeline,))
        assert child.stdout.readline().startswith(b"{")
        warm._sock.shutdown(socket.SHUT_RDWR)  # what the kernel does for a launcher that died
        os.close(keep)
        assert b"finished on its own" in child.stdout.read()
        assert warm.proc.wait(10) == 0
    finally:
        os.close(lifeline)
        warm.close()


def test_a_child_takes_the_malloc_tunables_of_its_request_where_mallopt_can_set_them(server, tmp_path):
    # The launcher forks its controller (service tunables: freed memory is kept for the next
    # round's message) from the server the ranks' environment started (glibc's defaults).
    script = tmp_path / "malloc_free.py"
    script.write_text(MALLOC_FREE_RSS)
    rss = {}
    for role in ("controller", "rank"):
        env = {**os.environ, "GLIBC_TUNABLES": with_tunables({}, role)["GLIBC_TUNABLES"]}
        child = server.spawn(role, [str(script)], env)
        out = child.stdout.read().decode()
        assert child.wait(30) == 0, out
        rss[role] = tuple(map(int, out.split()))
    held, after = rss["controller"]
    assert after > held - (16 << 10), f"the controller's RSS fell from {held} to {after} KiB after free"
    held, after = rss["rank"]
    assert after < held - (200 << 10), f"a rank's freed block should go back to the kernel ({held} -> {after} KiB)"


def test_a_child_takes_torchs_thread_count_of_its_request(server, tmp_path):
    # The launcher's controller is forked from the ranks' server: its pool, not torch's team, spreads a round.
    script = tmp_path / "threads.py"
    script.write_text("import torch; print(torch.get_num_threads())\n")
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    counts = {}
    for role in ("controller", "rank"):
        child = server.spawn(role, [str(script)], with_tunables(base, role))
        out = child.stdout.read().decode()
        assert child.wait(30) == 0, out
        counts[role] = int(out)
    assert counts["controller"] == 1
    assert counts["rank"] == torch_threads_of(base)  # a rank's is the job's to set: the server's default


def test_only_a_script_or_a_module_is_runnable():
    assert runnable(["job.py", "--epochs", "3"]) and runnable(["-m", "pkg.job"])
    assert not runnable([]) and not runnable(["-m"]) and not runnable(["-c", "print(1)"])
