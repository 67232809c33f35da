"""A warm interpreter: torch imported once, every rank (and the launcher's controller) forked from it.

Each rank runs the user's script, and the script imports torch: about 2 s of CPU, and 2 s more
for torch._dynamo, which torch.optim imports at its first step. On a host with few cores those
imports run side by side, so starting a run costs seconds per rank. Instead the launcher and
each agent start one `python -m flodl_zmq.warm`, which imports them once. Each child is then a
fork of it that takes its argv, environment, working directory, standard streams and passed
descriptors from the request. It runs the script as `python script.py` (or `-m module`) would:
as `__main__`, with sys.argv and sys.path[0] set, atexit handlers run, and non-daemon threads
joined at exit.

Rules this module keeps:
- The server forks only from its one thread (importing torch and numpy starts no Python
  thread). The children are its own: it reaps each one and reports its exit status, a signal as
  a negative code, as subprocess does.
- A child dies with the server (PR_SET_PDEATHSIG). Its status could no longer be reported, and
  no process is left that nobody can account for. Its handle then reads as killed by SIGKILL.
- The server exits when the client's end of the socket closes, once its children have: a
  launcher killed outright leaves nothing behind, and its children still stop as they would
  on their own (on their lifeline, flodl_zmq/environment.py), not killed by this exit.
- A fresh interpreter reads some variables when it starts (PYTHON*, GLIBC_TUNABLES, and
  OMP_NUM_THREADS when the thread-pool library loads). A forked child gets those from the
  server's environment, which its starter gives (the ranks' own), except the malloc tunables
  mallopt can still set and torch's thread count, which it takes from its request
  (`adopt_malloc_tunables`, `adopt_torch_threads`: the controller's). Every other variable
  comes from the request.
  `/proc/PID/cmdline` and `/proc/PID/environ` show the server's; the child's name
  (`ps -o comm`, `top`) is the one requested.
- A child started with a role (FLODL_ROLE) must play it: a script that ends, or exits 0,
  without a `Trainer.run()` or `Session` trained nothing, and exits UNPLAYED_EXIT saying so
  (`session.unplayed`), so that its launcher or agent, and the user, learn it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from flodl_zmq.environment import ProcessEnv
from flodl_zmq.errors import ConfigError

# What the user's script will import anyway, in the order a rank imports it.
PRELOAD = ("numpy", "zmq", "msgpack", "torch", "torch.optim", "torch._dynamo", "flodl_zmq.api",
           "flodl_zmq.rank", "flodl_zmq.controller")
MAX_REQUEST_BYTES = 1 << 20  # an argv and an environment
MAX_FDS = 16  # the three standard streams and the passed descriptors
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
# The glibc malloc tunables mallopt(3) can still set once glibc has read the server's at its
# start: the tunable's name -> mallopt's parameter (malloc.h's M_* values).
MALLOPT = {"glibc.malloc.trim_threshold": -1, "glibc.malloc.top_pad": -2, "glibc.malloc.mmap_threshold": -3,
           "glibc.malloc.mmap_max": -4, "glibc.malloc.arena_test": -7, "glibc.malloc.arena_max": -8}
INT_MAX = (1 << 31) - 1


def runnable(argv: Sequence[str]) -> bool:
    """Whether `argv` (what follows the interpreter) is a form the server runs: a script or `-m`."""
    if not argv:
        return False
    if argv[0] == "-m":
        return len(argv) >= 2
    return not argv[0].startswith("-")


def check_target(argv: Sequence[str], who: str) -> Sequence[str]:
    """`argv`, checked: a script that is not a file, or a `-m` module whose package is not found, is said once here,
    not by the traceback of every process the cluster would start to run it (`who`: the command, for the message)."""
    if not runnable(argv):
        return argv
    if argv[0] != "-m" and not Path(argv[0]).is_file():
        raise ConfigError(f"{who}: no script {argv[0]!r} (from {os.getcwd()}): give the path of a Python file, "
                          "or -- -m module for a module")
    if argv[0] == "-m" and not package_found(argv[1]):
        raise ConfigError(f"{who}: no module {argv[1]!r} to run with -m (from {os.getcwd()}, which -m searches "
                          "first): check its name, or install its package")
    return argv


def package_found(module: str) -> bool:
    """Whether `-m module`'s top-level package is there for the cohort, which runs it from this directory.

    Only the top level: finding a submodule would import its package here, the user's code (and
    maybe torch) in the launcher before any process starts.
    """
    top = module.partition(".")[0]
    sys.path.insert(0, os.getcwd())
    try:
        return bool(top) and importlib.util.find_spec(top) is not None
    finally:
        sys.path.pop(0)


# --------------------------------------------------------------------------- the server


@dataclass
class _Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    name: str


def _preload() -> None:
    for name in PRELOAD:
        # A module that fails here fails again in the child, which shows the error as it should.
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _report(sock: socket.socket, message: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the client is gone: the next receive ends the loop
        sock.send(json.dumps(message).encode())


def _serve(sock: socket.socket) -> _Request | None:
    """Fork a child per request; returns in that child (with its request), or None once the client is gone."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up descriptor is written
    signal.set_wakeup_fd(wake_w)
    parent = os.getpid()
    while True:
        try:
            ready, _, _ = select.select([sock, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap(sock)
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, MAX_FDS)
        if not data:
            _wait_children()
            return None
        try:
            raw = json.loads(data)
            request = _Request(list(raw["argv"]), dict(raw["env"]), str(raw["cwd"]), str(raw["name"]))
            targets = [int(t) for t in raw["fds"]]
            if len(targets) != len(fds):
                raise ValueError(f"{len(fds)} descriptors came for {len(targets)} targets")
            pid = os.fork()
        except (ValueError, KeyError, TypeError, OSError) as exc:
            for fd in fds:
                os.close(fd)
            _report(sock, {"error": f"{type(exc).__name__}: {exc}"})
            continue
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            _become(parent, fds, targets, request)
            return request
        for fd in fds:
            os.close(fd)
        _report(sock, {"pid": pid})


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _wait_children() -> None:
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _become(parent: int, fds: list[int], targets: list[int], request: _Request) -> None:
    """In the fresh child: its own session and name, its descriptors on their numbers, death with the server."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.prctl(PR_SET_NAME, request.name.encode()[:15])
    if os.getppid() != parent:  # the server died before the line above took effect
        os._exit(128 + signal.SIGKILL)
    adopt_malloc_tunables(libc, request.env.get("GLIBC_TUNABLES", ""))
    adopt_torch_threads(request.env.get("OMP_NUM_THREADS"))
    # Above every target first, so that placing one never closes another still to be placed.
    floor = max(targets, default=2) + 1
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(high, targets, strict=True):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    os.chdir(request.cwd)


def adopt_malloc_tunables(libc: ctypes.CDLL, tunables: str) -> None:
    """Set this process's malloc as `tunables` (GLIBC_TUNABLES' form) says, where mallopt can.

    A child of the server gets glibc's start-up tunables from the server; this gives it its own
    request's (flodl_zmq/environment.py). The controller's huge pages are not among them: glibc reads
    that one only at start-up, so a controller forked from the ranks' server runs without, as they do.
    mallopt takes an int: a trim threshold above it means never trim, which is mallopt's -1.
    """
    for item in filter(None, tunables.split(":")):
        name, _, text = item.partition("=")
        if name not in MALLOPT:
            continue
        try:
            value = int(text, 0)
        except ValueError:
            continue  # glibc ignores a malformed tunable too
        if value > INT_MAX:
            value = -1 if name == "glibc.malloc.trim_threshold" else INT_MAX
        libc.mallopt(MALLOPT[name], value)


def adopt_torch_threads(text: str | None) -> None:
    """Give torch the request's OMP_NUM_THREADS where it differs from the server's, which torch read.

    The server runs no torch op, so its children may still set the count: the controller's is 1
    (flodl_zmq/environment.py, SERVICE_THREADS). A malformed or absent value changes nothing, as
    OpenMP ignores one.
    """
    if text is None or text == os.environ.get("OMP_NUM_THREADS") or "torch" not in sys.modules:
        return
    with contextlib.suppress(ValueError):
        if (threads := int(text)) > 0:
            sys.modules["torch"].set_num_threads(threads)


def _run(request: _Request) -> None:
    """Run the script or module as `python` would; its exceptions and exit leave this process as they would,
    but for a script that ends (returns, or exits 0) without playing the role it was started with: that
    process exits UNPLAYED_EXIT, saying so (flodl_zmq/session.py, `unplayed`)."""
    os.environ.clear()
    os.environ.update(request.env)
    penv = ProcessEnv.from_environ()
    if penv is None:
        _run_main(request.argv)
        return
    # Here, not at the top: the launcher and the agent import this module and never torch (session does).
    from flodl_zmq.session import hosted, unplayed

    with hosted(penv) as host:
        try:
            _run_main(request.argv)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
    raise SystemExit(unplayed(host))


def _run_main(argv: list[str]) -> None:
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    # Imports leave next to no cyclic garbage, but the collector ran 700 passes over torch's
    # objects as they came: a quarter of the preload (measured: 1.71 s, 1.27 s without).
    gc.disable()
    _preload()
    # What the server imported lives as long as any child: out of the collector's sight, a
    # child's collections do not touch (and so copy) those pages, and its exit skips them
    # (measured: a child that imported torch exits in 0.27 s, not 0.87 s; gc.freeze's own advice).
    gc.freeze()
    gc.enable()  # the children's own objects are collected as ever
    sys.stdout.flush()
    sys.stderr.flush()
    _report(sock, {"ready": True})
    request = _serve(sock)
    if request is None:
        # Nothing of ours to flush or finalise: tearing down an interpreter that imported
        # torch would take the launcher's last second (measured: about 1 s of 2 cores).
        os._exit(0)
    _run(request)


# --------------------------------------------------------------------------- the client


class WarmProcess:
    """A child of the warm server: the part of `subprocess.Popen` the launcher uses."""

    def __init__(self, server: WarmServer, pid: int, args: Sequence[str], stdout: IO[bytes]):
        self._server = server
        self.pid = pid
        self.args = list(args)
        self.stdout = stdout

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        code = self.returncode
        assert code is not None
        return code


class WarmServer:
    """The launcher's end: start the server, ask it for children, learn how each one ended.

    `spawn` blocks until the server has imported what it preloads (the first call) and forked;
    a caller that must not block that long (an agent heartbeating its join link) waits on
    `wait_ready` first. A server that dies takes its children with it: their handles read as
    killed by SIGKILL, and `spawn` raises ConfigError naming the server's exit code.
    """

    def __init__(self, env: Mapping[str, str], python: str = sys.executable):
        """`env`: what the children read only at start-up (see the module docstring) comes from it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self.proc = subprocess.Popen(
            [python, "-m", "flodl_zmq.warm", str(theirs.fileno())],
            env={**env, "PYTHONUNBUFFERED": "1"},  # so are the children: lines leave as printed
            stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.changed = threading.Condition()
        self._codes: dict[int, int] = {}  # every exit the server reported, by pid
        self._replies: list[dict[str, Any]] = []
        self._gone = False
        self._ready = False
        self._spawning = threading.Lock()  # one request in flight: its reply is the next one
        threading.Thread(target=self._read, name="flodl-warm", daemon=True).start()

    def wait_ready(self, timeout: float) -> bool:
        """True once the server has preloaded (or is gone: `spawn` then says why); False after `timeout`."""
        with self.changed:
            return self.changed.wait_for(lambda: self._ready or self._gone, timeout)

    def exit_code(self, pid: int) -> int | None:
        """How child `pid` ended; None while it runs (-SIGKILL once the server is gone: it died too)."""
        with self.changed:
            code = self._codes.get(pid)
            return -signal.SIGKILL if code is None and self._gone else code

    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str], pass_fds: Sequence[int] = ()) -> WarmProcess:
        """A child named `name` running `argv` (see `runnable`) in our working directory, stdout and stderr on one pipe."""
        if not runnable(argv):
            raise ConfigError(f"the warm interpreter runs a script or -m module, not {list(argv)!r}")
        read, write = os.pipe()
        request = {"argv": list(argv), "env": dict(env), "cwd": os.getcwd(), "name": name,
                   "fds": [0, 1, 2, *pass_fds]}
        try:
            with open(os.devnull, "rb") as null, self._spawning:
                socket.send_fds(self._sock, [json.dumps(request).encode()], [null.fileno(), write, write, *pass_fds])
                with self.changed:
                    self.changed.wait_for(lambda: self._replies or self._gone)
                    reply = self._replies.pop(0) if self._replies else {"error": self._gone_reason()}
        except OSError as exc:
            reply = {"error": f"{self._gone_reason()} ({exc})"}
        finally:
            os.close(write)
        if "pid" in reply:
            return WarmProcess(self, reply["pid"], argv, os.fdopen(read, "rb"))
        os.close(read)
        raise ConfigError(f"could not start {list(argv)!r} in the warm interpreter: {reply['error']}")

    def close(self) -> None:
        """Stop the server (a child still running is killed with it), and reap it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()

    def _gone_reason(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "the warm interpreter closed its socket"
        return f"the warm interpreter (pid {self.proc.pid}) exited with code {code}; its output is above"

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_REQUEST_BYTES)
            except OSError:
                data = b""
            with self.changed:
                if not data:
                    self._gone = True
                    self.changed.notify_all()
                    return
                message = json.loads(data)
                if "exit" in message:
                    self._codes[message["exit"]] = message["code"]
                elif "ready" in message:
                    self._ready = True
                else:
                    self._replies.append(message)
                self.changed.notify_all()



def start(name: str, argv: Sequence[str], env: Mapping[str, str], pass_fds: Sequence[int],
          warm: WarmServer | None, python: str = sys.executable) -> subprocess.Popen | WarmProcess:
    """A child running `argv` in a session of its own, stdout and stderr on one pipe: forked by
    `warm` when given, else a fresh `python` (the launcher's and the agent's one way to start)."""
    if warm is not None:
        return warm.spawn(name, argv, env, pass_fds)
    return subprocess.Popen(
        [python, *argv], env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: a teardown reaches all it started
        pass_fds=tuple(pass_fds),
    )


if __name__ == "__main__":
    main()
