"""`flodl-zmq run --hosts FILE|LIST -- PROGRAM`: the controller here, one agent per host over SSH.

The way a few machines of one's own are used together (`deepspeed --hostfile`,
`horovodrun -H`): this process is the controller (flodl_zmq/controller.py's
`serve`, with every controller flag), and for each listed host it runs

    SSH HOST 'cd CWD && exec sh -c "<read the secrets from stdin>" flodl-agent PYTHON -m flodl_zmq.cli agent ...'

with `--ssh` (default `ssh -o BatchMode=yes`) split like a shell would. The
agent's `--script` is the controller's whole program, its `--host` the
host's name, its `--cpu-slots` the host's slots; every host must have this
interpreter and this working directory at the same paths (as deepspeed
assumes). Each host's output comes back prefixed `[HOST]`.

Rules this module keeps:

- **Secrets never ride in argv.** `ps` on either machine shows a command
  line, and logs keep it: the session key (and the controller's CURVE
  public key, with `--curve`) are written to the remote command's stdin,
  which a remote `sh` reads into the agent's environment before it execs
  the agent. No local child holds the controller's secrets either: they are
  removed from the SSH command's environment.
- **A host that cannot be reached is named, not fatal.** SSH exits 255 when
  it cannot reach a host (or the remote command cannot start); the host is
  reported by name and the world forms without it while `--min-ranks`
  allow (the join window decides, as for any host that never joins).
- **Nothing is left behind.** The run ends when the controller's does: the
  agents are told (a completed run, a failure, or Ctrl-C / SIGTERM, which
  abort them with the reason) and exit by themselves; their SSH commands
  then end, and are waited for up to `STOP_GRACE_S`, then SIGTERMed, then
  SIGKILLed, each in its own process group, and reaped.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import zmq

from flodl_zmq.controller import (
    controller_options,
    restart_with_service_tunables,
    serve,
)
from flodl_zmq.environment import interrupted_exit, raise_interrupt_on_sigterm
from flodl_zmq.errors import ConfigError
from flodl_zmq.launch import end_groups, free_port_base
from flodl_zmq.security import PUBLIC_ENV, SECRET_ENV, SERVER_ENV, CurveKeys
from flodl_zmq.settings import Settings, add_arguments
from flodl_zmq.wire import KEY_ENV, new_key, session_key

SSH_UNREACHABLE = 255  # ssh's own failure (host unknown, refused, no key, ...), not the remote command's
STOP_GRACE_S = 30.0  # after the controller ended: how long the agents may take to see their ranks out
AGENT_ARGV0 = "flodl-agent"  # the remote shell's $0: what `ps` shows for it until it execs the agent


# --------------------------------------------------------------------------- pure: hosts and commands


@dataclass(frozen=True)
class RemoteHost:
    """One line of the host list: the name SSH reaches it by, and its ranks on CPU (None: the agent's default)."""

    name: str
    slots: int | None = None

    @property
    def address(self) -> str:
        """The name without ssh's `user@`: what resolves, and the agent's --host."""
        return self.name.rpartition("@")[2]


def parse_hosts(text: str, *, from_file: bool) -> tuple[RemoteHost, ...]:
    """The hosts of a host file (`HOST [slots=N]` a line, `#` comments) or of a comma list (`HOST[:N],...`)."""
    items = [line.split("#", 1)[0].split() for line in text.splitlines()] if from_file else \
        [item.strip().rsplit(":", 1) if ":" in item else [item.strip()] for item in text.split(",")]
    hosts = [_host(words, from_file) for words in items if words and words != [""]]
    if not hosts:
        raise ConfigError("--hosts names no host: give a file (one `HOST [slots=N]` a line) or a list `a,b:2`")
    names = [h.address for h in hosts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--hosts names {', '.join(twice)} twice: a host runs one agent; give it more slots instead")
    return tuple(hosts)


def _host(words: list[str], from_file: bool) -> RemoteHost:
    name, rest = words[0], words[1:]
    # A name ssh would read as an option (`-oProxyCommand=...`) must never reach its argv.
    if not name or name.startswith("-") or len(rest) > 1:
        raise ConfigError(f"--hosts: {' '.join(words)!r} is not `HOST`, `HOST slots=N` (file) or `HOST:N` (list)")
    if not rest:
        return RemoteHost(name)
    count = rest[0].removeprefix("slots=") if from_file else rest[0]
    if not count.isdigit() or int(count) < 1 or (from_file and not rest[0].startswith("slots=")):
        raise ConfigError(f"--hosts: {' '.join(words)!r}: slots must be a whole number >= 1 "
                          f"({'HOST slots=N' if from_file else 'HOST:N'})")
    return RemoteHost(name, int(count))


def agent_argv(host: RemoteHost, controller: str, program: Sequence[str], python: str) -> list[str]:
    """The agent a host runs: joins `controller`, pinned to the controller's whole `program`."""
    argv = [python, "-m", "flodl_zmq.cli", "agent", "--controller", controller, "--host", host.address,
            "--script", shlex.join(program)]
    return argv + (["--cpu-slots", str(host.slots)] if host.slots is not None else [])


def remote_command(agent: Sequence[str], cwd: str, secret_names: Sequence[str]) -> str:
    """The one string SSH hands the remote login shell: it reads each of `secret_names` from a line of
    stdin into the environment, then becomes the agent (`exec`: SSH's session is the agent's)."""
    reads = " && ".join(f"IFS= read -r {n} && export {n}" for n in secret_names)
    return f"cd {shlex.quote(cwd)} && exec " + shlex.join(["sh", "-c", f'{reads} && exec "$@"', AGENT_ARGV0, *agent])


def ssh_argv(ssh: str, host: RemoteHost, command: str) -> list[str]:
    """`SSH HOST COMMAND`, the --ssh words split like a shell would."""
    words = shlex.split(ssh)
    if not words:
        raise ConfigError("--ssh is empty: give the command that reaches a host, e.g. \"ssh -o BatchMode=yes\"")
    return [*words, host.name, command]


def secrets_input(secrets: Mapping[str, str]) -> bytes:
    """What the remote shell reads: one value a line, in the order `remote_command` was given the names."""
    return "".join(f"{value}\n" for value in secrets.values()).encode()


def exit_line(host: RemoteHost, code: int, ssh: str) -> str:
    """What the run says when a host's SSH command ended with `code`."""
    if code == SSH_UNREACHABLE:
        return (f"[run] host {host.name!r} unreachable: `{ssh}` exited {code} (its lines above say why); "
                "the world forms without it while --min-ranks allow")
    if code == 0:
        return f"[run] host {host.name!r}: its agent finished"
    return f"[run] host {host.name!r}: its agent exited {code} (0 done, 1 torn down, 2 join refused; see its lines)"


# --------------------------------------------------------------------------- the SSH commands


@dataclass
class Fleet:
    """One SSH command per host, its output forwarded with the host's name; `start()`, then `stop()`."""

    hosts: Sequence[RemoteHost]
    ssh: str
    controller: str
    program: Sequence[str]
    secrets: Mapping[str, str]  # variable -> value, handed to every agent over stdin
    sink: Callable[[str], None]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    readers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        cwd = os.getcwd()
        # Ours, not the remote's: a wrapper that runs the command here (tests) must not hand it our secrets.
        env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, SECRET_ENV, PUBLIC_ENV)}
        for host in self.hosts:
            command = remote_command(agent_argv(host, self.controller, self.program, sys.executable), cwd,
                                     list(self.secrets))
            proc = subprocess.Popen(ssh_argv(self.ssh, host, command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.procs[host.name] = proc
            assert proc.stdin is not None
            try:
                proc.stdin.write(secrets_input(self.secrets))
                proc.stdin.close()
            except BrokenPipeError:  # ssh already gave up: its exit status says why
                pass
            reader = threading.Thread(target=self._forward, args=(host, proc), daemon=True)
            reader.start()
            self.readers.append(reader)

    def _forward(self, host: RemoteHost, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        own = f"[{host.address}:"  # the agent prefixes its own lines and its children's with its name
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.sink(line if line.startswith(own) else f"[{host.address}] {line}")
        self.sink(exit_line(host, proc.wait(), self.ssh))

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Wait up to `grace_s` for every SSH command to end, then SIGTERM, then SIGKILL; reap all (idempotent)."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        end_groups(list(self.procs.values()))
        for reader in self.readers:
            reader.join(2.0)


class WholeLines(io.TextIOBase):
    """A text stream that passes on whole lines only, one at a time: `print` writes a line and its newline in two
    calls, so a line another thread forwards could otherwise land in the middle of it (a `RESULT {json}` line
    split by a host's)."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self._lock = threading.Lock()
        self._partial = threading.local()  # each thread's line so far

    def write(self, text: str) -> int:
        head, newline, tail = (getattr(self._partial, "text", "") + text).rpartition("\n")
        self._partial.text = tail
        if newline:
            with self._lock:
                self.out.write(head + newline)
                self.out.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self.out.flush()

    def fileno(self) -> int:
        return self.out.fileno()

    def isatty(self) -> bool:
        return self.out.isatty()


# --------------------------------------------------------------------------- command line


def default_bind(hosts: Sequence[RemoteHost]) -> str:
    """This machine's address on the route to the first host that resolves, and a free port base there."""
    for host in hosts:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host.address, 9))  # a route lookup: UDP sends nothing on connect
                ip = probe.getsockname()[0]
        except OSError:
            continue
        return f"{ip}:{free_port_base(ip)}"
    raise ConfigError("no host of --hosts resolves from here, so the controller's address cannot be chosen: "
                      "pass --bind HOST:PORT with an address the hosts reach")


def read_hosts(value: str | None) -> tuple[RemoteHost, ...]:
    if not value:
        raise ConfigError("run needs the hosts to start agents on: --hosts FILE or --hosts a,b:2 (or FLODL_HOSTS)")
    path = Path(value)
    if path.is_file():
        return parse_hosts(path.read_text(), from_file=True)
    if "/" in value:  # no host name has one: a host file that is not there
        raise ConfigError(f"--hosts {value}: no such host file (give an existing file, or a list `a,b:2`)")
    return parse_hosts(value, from_file=False)


def _run_command(args: argparse.Namespace) -> int:
    restart_with_service_tunables()
    logging.basicConfig(level=logging.INFO, format="[controller] %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_args(args)
    if settings.open_admission:
        raise ConfigError("run hands every agent the session key over SSH: drop --open-admission")
    hosts = read_hosts(settings.hosts)
    settings = replace(settings, bind=settings.bind or default_bind(hosts))
    key = session_key(os.environ) or new_key()
    if settings.curve:
        public, secret = zmq.curve_keypair()
        curve: CurveKeys | None = CurveKeys(public=public, secret=secret)
    else:
        curve = CurveKeys.for_server(os.environ, settings.curve_secret_file, settings.curve_clients_dir)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    opts = controller_options(settings, argv, key, curve)
    secrets = {KEY_ENV: key.hex(), **({SERVER_ENV: curve.public.decode()} if curve is not None else {})}
    # The program prints on the main thread while the readers forward hosts' lines: whole lines only.
    sys.stdout = WholeLines(sys.stdout)

    def sink(line: str) -> None:
        print(line, flush=True)

    fleet = Fleet(hosts, settings.ssh, str(opts.address), opts.argv, secrets, sink)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    raise_interrupt_on_sigterm()
    try:
        sink(f"[run] controller at {opts.address}; starting an agent on {', '.join(h.name for h in hosts)}")
        fleet.start()
        return serve(opts)  # Ctrl-C / SIGTERM: it aborts the agents with the reason (but see its --resume auto rule)
    except KeyboardInterrupt as stop:  # before the join window opened: serve had nobody to tell
        return interrupted_exit(stop)
    finally:
        for s in previous:  # a second Ctrl-C must not cut the teardown short and leave SSH commands behind
            signal.signal(s, signal.SIG_IGN)
        fleet.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def add_command(sub: Any) -> None:
    """Register `flodl-zmq run` on the sub-command parser."""
    p = sub.add_parser(
        "run", help="run the controller here and an agent on every listed host over SSH",
        description=(
            "Start the controller here (every `controller` flag applies) and `flodl-zmq agent` on every host of "
            "--hosts through --ssh, pinned to PROGRAM (after `--`: SCRIPT [ARGS] or -m MODULE [ARGS]); the "
            "session key (FLODL_KEY, or a fresh one) reaches each agent on its stdin, never its command line. "
            "Every host needs this Python and this directory at the same paths. Exit status: the controller's."
        ),
    )
    add_arguments(p, "run")  # flags and their variables: flodl_zmq/settings.py
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS], or -- -m MODULE [ARGS]")
    p.set_defaults(func=_run_command)
