"""The FLODL_* environment contract (flodl_zmq.environment)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import traceback

import pytest

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import (
    ChildExit,
    ExitReports,
    ProcessEnv,
    SigtermInterrupt,
    behind_the_ranks,
    failed_with,
    moves_the_run,
    own_error,
    parse_world,
    raise_interrupt_on_sigterm,
    raise_lost_signal,
    training_failed,
    with_tunables,
)
from flodl_zmq.errors import ConfigError
from flodl_zmq.formation import rank_space, vacancies
from flodl_zmq.report import interrupted_notice
from flodl_zmq.settings import Settings
from flodl_zmq.wire import new_key


def rank_env() -> ProcessEnv:
    return ProcessEnv(
        role="rank", controller=ControllerAddress("127.0.0.1", 7300), key=new_key(), run_id=os.urandom(16), incarnation=os.urandom(16),
        world={"h0": (0, 1), "h1": (2, 3)}, host="h1", rank=3, local_rank=1,
        settings=Settings(slowdown=3.0, rank_silence_at_relay_s=4.0),
    )


def test_to_environ_and_back_is_the_same_process_env():
    env = rank_env()
    assert ProcessEnv.from_environ(env.to_environ()) == env
    assert env.world_size == 4


def test_no_role_means_a_single_process_run():
    assert ProcessEnv.from_environ({}) is None


def test_a_missing_variable_is_named():
    environ = rank_env().to_environ()
    del environ["FLODL_KEY"]
    with pytest.raises(ConfigError, match="FLODL_KEY"):
        ProcessEnv.from_environ(environ)


def test_a_rank_outside_its_host_is_refused():
    environ = rank_env().to_environ()
    environ["FLODL_RANK"] = "0"
    with pytest.raises(ConfigError, match="not one of host h1"):
        ProcessEnv.from_environ(environ)


@pytest.mark.parametrize("text", ["", "h0=0,1;h1=1,2", "h0=-1", "h0=0;h1=", "=0"])
def test_a_world_must_give_each_rank_to_one_host(text):
    with pytest.raises(ConfigError):
        parse_world(text)


def test_a_rank_no_host_holds_is_a_vacancy_in_the_rank_space():
    world = parse_world("h0=0;h2=3")  # h1 (ranks 1, 2) left before the world re-formed
    assert rank_space(world) == 4 and vacancies(world) == (1, 2)


# A fresh process's malloc, through ctypes, and its RSS (KiB): the start of each script below.
_MALLOC = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None)\n"
    "libc.malloc.restype = ctypes.c_void_p\n"
    "def rss():\n"
    "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])\n"
)
# Mallocs and touches 256 MiB, frees it, prints its RSS (KiB) with the block held and after.
MALLOC_FREE_RSS = _MALLOC + (
    "p = libc.malloc(256 << 20)\n"
    "ctypes.memset(p, 1, 256 << 20)\n"
    "held = rss()\n"
    "libc.free(ctypes.c_void_p(p))\n"
    "print(held, rss())\n"
)
# Mallocs 8 MiB, writes one byte in its middle, prints how much its RSS (KiB) grew.
MALLOC_TOUCH_RSS = _MALLOC + (
    "before = rss()\n"
    "p = libc.malloc(8 << 20)\n"
    "ctypes.memset(p + (4 << 20), 1, 1)\n"
    "print(rss() - before)\n"
)


def _printed(script: str, tunables: str) -> list[int]:
    """The numbers `script` prints, run in a fresh process whose glibc reads `tunables`."""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "GLIBC_TUNABLES": tunables},
                         capture_output=True, text=True, timeout=60, check=True)
    return [int(x) for x in out.stdout.split()]


def test_services_keep_freed_memory_for_the_next_message_and_ranks_keep_glibc_defaults():
    # A relay or controller receives a model-sized message every round: the pages must stay mapped
    # (a returned buffer comes back as pages the kernel must zero again).
    service = with_tunables({}, "relay")["GLIBC_TUNABLES"]
    held, after = _printed(MALLOC_FREE_RSS, service)
    assert after > held - (16 << 10), f"{service}: RSS fell from {held} to {after} KiB after free"
    rank = with_tunables({}, "rank")["GLIBC_TUNABLES"]
    held, after = _printed(MALLOC_FREE_RSS, rank)
    assert after < held - (200 << 10), f"{rank}: a rank's freed block should go back to the kernel"
    assert with_tunables({}, "controller")["GLIBC_TUNABLES"] == service


def test_a_ranks_fresh_memory_comes_in_small_pages_as_a_process_alone_gets_it():
    # With huge pages (glibc.malloc.hugetlb=1, which ranks had) the kernel zeroed 2 MB for each block a rank's
    # heap grew by: a CNN rank's first eval took 25 ms more than the same eval alone.
    [alone] = _printed(MALLOC_TOUCH_RSS, "")
    [rank] = _printed(MALLOC_TOUCH_RSS, with_tunables({}, "rank")["GLIBC_TUNABLES"])
    assert rank <= alone + 64, alone  # KiB: not 2 MB more


def torch_threads_of(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout)


def test_services_run_torch_on_one_thread_and_ranks_and_the_users_own_setting_are_left_alone():
    # A service's pool already puts one piece of a round on each core: torch must not add a team per piece.
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert torch_threads_of(with_tunables(base, "relay")) == 1
    assert torch_threads_of(with_tunables(base, "controller")) == 1
    assert with_tunables(base, "rank").get("OMP_NUM_THREADS") is None  # a rank's threads are the job's
    assert with_tunables({**base, "OMP_NUM_THREADS": "3"}, "relay")["OMP_NUM_THREADS"] == "3"


def test_tunables_the_user_set_win_and_are_kept():
    got = with_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4:glibc.cpu.x86_ibt=on"}, "relay")
    names = dict(t.split("=") for t in got["GLIBC_TUNABLES"].split(":"))
    assert names["glibc.malloc.arena_max"] == "4"
    assert names["glibc.cpu.x86_ibt"] == "on"
    assert names["glibc.malloc.mmap_max"] == "0"
    assert names["glibc.malloc.hugetlb"] == "1"


def test_the_controller_command_restarts_once_with_the_service_tunables(monkeypatch):
    # glibc reads its tunables only at start-up; a controller started from a shell has none.
    import sys

    from flodl_zmq import controller

    calls = []
    monkeypatch.setattr(controller.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    controller.restart_with_service_tunables()
    assert len(calls) == 1
    path, argv, env = calls[0]
    assert path == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["GLIBC_TUNABLES"] == with_tunables({}, "controller")["GLIBC_TUNABLES"]
    monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])  # the restarted process: nothing more to do
    controller.restart_with_service_tunables()
    assert len(calls) == 1


def test_exit_reports_cross_a_pipe_line_by_line_and_end_when_the_launcher_closes_it():
    r, w = os.pipe()
    try:
        reports = ExitReports(r)
        line = ExitReports.line(ChildExit("h1", 3, -9))
        os.write(w, line[:7])  # half a line: nothing yet
        assert reports.read() == []
        os.write(w, line[7:] + ExitReports.line(ChildExit("h0", None, 1)))
        assert reports.read() == [ChildExit("h1", 3, -9), ChildExit("h0", None, 1)]
        os.close(w)
        w = -1
        assert reports.read() is None
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_the_controllers_exit_fd_round_trips_through_the_environment():
    penv = ProcessEnv(role="controller", controller=ControllerAddress("127.0.0.1", 7300), key=bytes(32),
                      run_id=bytes(16), incarnation=bytes(16), world={"h0": (0, 1)}, exit_fd=7,
                      route_secret=bytes(range(32)))
    assert ProcessEnv.from_environ(penv.to_environ()) == penv


def test_the_route_secret_and_the_host_token_round_trip_and_a_missing_one_is_named():
    where = dict(controller=ControllerAddress("127.0.0.1", 7300), key=bytes(32), run_id=bytes(16),
                 incarnation=bytes(range(16)), world={"h0": (0,)})
    controller = ProcessEnv(role="controller", route_secret=bytes(range(32)), **where)
    relay = ProcessEnv(role="relay", host="h0", host_token=bytes(range(1, 33)), **where)
    for penv, name in ((controller, "FLODL_ROUTE_SECRET"), (relay, "FLODL_HOST_TOKEN")):
        environ = penv.to_environ()
        assert ProcessEnv.from_environ(environ) == penv
        with pytest.raises(ConfigError, match=name):
            ProcessEnv.from_environ({k: v for k, v in environ.items() if k != name})
        with pytest.raises(ConfigError, match=name):
            ProcessEnv.from_environ({**environ, name: "ab" * 16})


def test_the_lifeline_fd_round_trips_and_a_bad_one_is_named():
    penv = dataclasses.replace(rank_env(), lifeline_fd=9)
    environ = penv.to_environ()
    assert ProcessEnv.from_environ(environ) == penv
    environ["FLODL_LIFELINE_FD"] = "nine"
    with pytest.raises(ConfigError, match="FLODL_LIFELINE_FD must be a file descriptor number"):
        ProcessEnv.from_environ(environ)


# A child holding the read end, as a spawned relay or rank does: its SIGTERM handler says so and exits 7.
LIFELINE_CHILD = """
import os, signal, sys
from flodl_zmq.environment import watch_lifeline
signal.signal(signal.SIGTERM, lambda *_: (print("stopped as on SIGTERM", flush=True), os._exit(7)))
watch_lifeline(int(sys.argv[1]))
print("watching", flush=True)
signal.pause()
"""


def test_the_end_of_the_lifeline_stops_the_process_as_sigterm_does():
    r, w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", LIFELINE_CHILD, str(r)], pass_fds=(r,), stdout=subprocess.PIPE,
                             text=True)
    os.close(r)
    try:
        assert child.stdout.readline() == "watching\n"
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)  # the launcher is alive: nothing happens
        os.close(w)  # the launcher died
        assert child.wait(60) == 7  # a hang guard: the end of file comes at once
        assert child.stdout.read() == "stopped as on SIGTERM\n"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


class SignalsWhenFreed:
    """An object whose finaliser sends this process a SIGTERM: its handler runs inside the finaliser."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_whose_raise_a_finaliser_swallowed_is_raised_again_where_the_loop_checks(monkeypatch):
    # A launcher's death stopped none of a controller's loop now and then (1 run in about 80 under load): its
    # SIGTERM's exception, raised inside a finaliser the main thread was running, was printed and dropped.
    dropped: list[BaseException | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_value))
    previous = raise_interrupt_on_sigterm()
    try:
        raise_lost_signal()  # nothing came: the loop goes on
        SignalsWhenFreed()  # freed at once: the handler raises in __del__, where Python drops the exception
        assert len(dropped) == 1 and isinstance(dropped[0], SigtermInterrupt)
        with pytest.raises(SigtermInterrupt):
            raise_lost_signal()
    finally:
        signal.signal(signal.SIGTERM, previous)
    raise_lost_signal()  # the handler that fired is gone with its scope: a later loop in this process is not stopped


def test_a_ranks_training_failed_line_names_its_error_and_its_parent_reads_it_back():
    # No record carries a rank's exception to the controller: launch reads it from this line of the rank's log.
    line = training_failed(3, ValueError("sample 13 is corrupt\nsecond line"))
    assert line == "rank 3: training failed: ValueError: sample 13 is corrupt"
    assert failed_with(f"ERROR flodl_zmq.session: {line}") == "ValueError: sample 13 is corrupt"
    assert training_failed(0, RuntimeError()) == "rank 0: training failed: RuntimeError"
    assert failed_with("rank 3: training failed") is None and failed_with("epoch 1/2 | loss 0.5") is None


def test_the_last_line_of_a_traceback_of_one_of_our_errors_names_it_for_the_launcher():
    # What a launched process prints when its job is refused: the launcher names the error when the run ends.
    try:
        raise ConfigError("batch_size must be an integer (a Python int) >= 1, got '8'")
    except ConfigError as exc:
        printed = "".join(traceback.format_exception(exc)).splitlines()
    assert own_error(printed[-1]) == "ConfigError: batch_size must be an integer (a Python int) >= 1, got '8'"
    assert own_error("ValueError: sample 13 is corrupt") is None
    assert own_error("INFO flodl_zmq.errors: a logger of that name is not a traceback") is None


def test_a_sigterm_under_resume_auto_moves_the_run_and_its_notice_says_the_same_command_continues(tmp_path):
    # The notice advised `--resume CKPT` to a controller an orchestrator restarts with --resume auto, as it must be.
    assert moves_the_run(SigtermInterrupt(), "auto")
    assert not moves_the_run(KeyboardInterrupt(), "auto") and not moves_the_run(SigtermInterrupt(), "runs/ckpt")
    ckpt = tmp_path / "ckpt-r000000012"
    moved = interrupted_notice("runs/m", ckpt, moved=True)
    assert f"in the checkpoint {ckpt}, which this controller started again with the same command" in moved
    assert "--resume auto" in moved and f"--resume {ckpt}" not in moved
    assert f"continue with --resume {ckpt}" in interrupted_notice("runs/m", ckpt)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="a Linux scheduling policy")
def test_a_service_block_runs_every_thread_as_batch_and_gives_the_threads_back_as_they_were():
    # Every thread: those running when the block starts, the caller, and those started inside it.
    def policy(thread: threading.Thread | None = None) -> int:
        return os.sched_getscheduler(0 if thread is None else thread.native_id)

    stop = threading.Event()
    before = threading.Thread(target=stop.wait, daemon=True)
    before.start()
    assert policy() == policy(before) == os.SCHED_OTHER
    try:
        with behind_the_ranks():
            inside = threading.Thread(target=stop.wait, daemon=True)
            inside.start()
            assert policy() == policy(before) == policy(inside) == os.SCHED_BATCH
        assert policy() == policy(before) == policy(inside) == os.SCHED_OTHER
    finally:
        stop.set()
