"""Linux network namespaces as test hosts, and a docker-compose.yml reader to fill them.

No Docker engine runs where the tests run, so the compose file is executed
another way: each service becomes a process in its own network namespace,
with its own interface and address on a shared bridge, and the service names
resolve through /etc/netns/<ns>/hosts. Traffic between "hosts" then crosses
real veth interfaces, can be captured, and can be cut with `ip link set down`.

Layout (everything lives in namespaces; the root namespace is never touched):

    <tag>-br      namespace holding bridge `br0`, and one veth end per host (`v<i>`)
    <tag>-<name>  one namespace per host: `lo` up, `eth0` = 10.231.0.<i+1>/24

Rules this module keeps:

- Addresses come only from 10.231.0.0/24, and only on our own veths: the
  harness never routes anywhere else.
- Every name carries the tag `flt<pid>`, so a crashed run's leftovers are
  found and removed at the next start (`clean_stale`), and a harness never
  removes a live run's namespaces (its pid is still alive).
- `Network.destroy()` always runs (context manager / fixture finalizer): it
  kills every process it started (their whole process groups), then deletes
  the namespaces and their /etc/netns directories.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from flodl_zmq.environment import parse_world
from flodl_zmq.links import remove_host_sockets
from flodl_zmq.wire.shm import unlink_host

PREFIX = "flt"
SUBNET = "10.231.0"
NETNS_ETC = Path("/etc/netns")


def unavailable() -> str | None:
    """Why namespaces cannot be used here (a pytest skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network-namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network-namespace tests need iproute2's `ip` command"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


@contextlib.contextmanager
def network_or_skip(*names: str) -> Iterator[Network]:
    """A Network with one host per name (a module fixture's body), or a pytest skip where namespaces cannot be made."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Network() as net:
        for name in names:
            net.add_host(name)
        yield net


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run_files_of(pid: int) -> tuple | None:
    """(key, incarnation id, host, *rank) naming the files a relay or rank process owns, from its environment."""
    try:
        env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
    except OSError:
        return None
    role, host = env.get(b"FLODL_ROLE"), env.get(b"FLODL_HOST", b"").decode()
    if role not in (b"relay", b"rank"):
        return None
    # A relay names its host's ranks too: a rank forked from an agent's warm interpreter shows
    # that interpreter's environment here, not its own.
    ranks = (int(env[b"FLODL_RANK"]),) if role == b"rank" else parse_world(env[b"FLODL_WORLD"].decode()).get(host, ())
    return (bytes.fromhex(env[b"FLODL_KEY"].decode()), bytes.fromhex(env[b"FLODL_INCARNATION"].decode()), host, *ranks)


def clean_stale() -> list[str]:
    """Delete namespaces (and /etc/netns dirs) left by harness runs whose process is gone."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = {line.split()[0] for line in listing.splitlines() if line.strip()}
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir()}
    removed = []
    for name in sorted(names):
        m = re.fullmatch(rf"{PREFIX}(\d+)-.+", name)
        if m and not _pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Host:
    name: str  # the service name other hosts resolve
    netns: str
    address: str
    peer: str  # its veth end in the bridge namespace: set it down to cut the host off


@dataclass
class Network:
    """A bridge and one namespace per host; use as a context manager.

    >>> with Network() as net:
    ...     net.add_host("controller"); net.add_host("worker1")
    ...     net.run("worker1", ["getent", "hosts", "controller"])
    """

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    def __enter__(self) -> Network:
        clean_stale()
        self._netns_add(self.bridge_ns)
        self._ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    # ------------------------------------------------------------------ topology

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge, reachable from every other host as `name`."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,30}", name):
            raise ValueError(f"host name {name!r}: use lowercase letters, digits and dashes")
        index = len(self.hosts) + 1
        if index > 250:
            raise ValueError("at most 250 hosts fit in 10.231.0.0/24")
        host = Host(name, f"{self.tag}-{name}", f"{SUBNET}.{index + 1}", f"v{index}")
        self._netns_add(host.netns)
        # Create the pair inside the bridge namespace and move one end out, so no
        # interface ever appears in the root namespace.
        self._ip("-n", self.bridge_ns, "link", "add", host.peer, "type", "veth", "peer", "name", "eth0",
                 "netns", host.netns)
        self._ip("-n", self.bridge_ns, "link", "set", host.peer, "master", "br0", "up")
        self._ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        self._ip("-n", host.netns, "link", "set", "eth0", "up")
        self._ip("-n", host.netns, "link", "set", "lo", "up")
        self.hosts[name] = host
        self._write_hosts_files()
        return host

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{h.address} {h.name}" for h in self.hosts.values()]
        for h in self.hosts.values():
            etc = NETNS_ETC / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def cut(self, name: str) -> None:
        """Take the host's link down at the bridge: its packets go nowhere, both ways."""
        self._ip("-n", self.bridge_ns, "link", "set", self.hosts[name].peer, "down")

    def restore(self, name: str) -> None:
        self._ip("-n", self.bridge_ns, "link", "set", self.hosts[name].peer, "up")

    # ------------------------------------------------------------------ processes

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    def run(self, name: str, argv: Sequence[str], timeout: float = 30.0, **kw) -> subprocess.CompletedProcess:
        """Run `argv` in host `name` to completion (bounded by `timeout`)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(name, argv), timeout=timeout, check=False, **kw)

    def popen(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `argv` in host `name` in its own process group; `destroy()` kills the group."""
        proc = subprocess.Popen(
            self.command(name, argv), env=dict(env) if env is not None else None, start_new_session=True, **kw
        )
        self._procs.append(proc)
        return proc

    def pids(self, name: str) -> list[int]:
        """The processes in the host's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.hosts[name].netns], capture_output=True, text=True,
                             check=False).stdout
        return [int(pid) for pid in out.split()]

    def pid_with(self, name: str, *environment: str) -> int:
        """The pid of the process on host `name` whose environment holds every `VAR=value` given."""
        for pid in self.pids(name):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if all(e.encode() in env for e in environment):
                return pid
        raise AssertionError(f"no process with {' '.join(environment)} on {name}")

    def kill_host_processes(self, name: str) -> None:
        """SIGKILL every process in the host's namespace (a machine that dies), then remove the
        shared-memory segments and ipc socket files its relays and ranks leave (no agent is left to).
        Every process is stopped first, as a machine's power cut stops them all at once: killed one by
        one, a rank could see its agent's lifeline close and leave cleanly before its own SIGKILL."""
        left: dict[tuple[bytes, bytes, str], set[int]] = {}
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        for pid in pids:
            owner = _run_files_of(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            if owner is not None:
                left.setdefault(owner[:3], set()).update(owner[3:])
        for (key, run_id, host), ranks in left.items():
            unlink_host(key, run_id, host, sorted(ranks))
            remove_host_sockets(key, run_id, host)

    def stop(self, procs: Iterator[subprocess.Popen] | Sequence[subprocess.Popen]) -> None:
        """SIGKILL every process in every host (the agents' children run in sessions of their own;
        killed first, before an agent's death could stop them halfway), then `procs`' process groups."""
        for host in self.hosts:
            self.kill_host_processes(host)
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    # ------------------------------------------------------------------ teardown

    def destroy(self) -> None:
        for name in self.hosts:
            self.kill_host_processes(name)
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self._created.clear()
        self._procs.clear()
        self.hosts.clear()

    def _netns_add(self, ns: str) -> None:
        self._ip("netns", "add", ns)
        self._created.append(ns)

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


# --------------------------------------------------------------------------- docker-compose


class Logged:
    """Processes a test starts in the namespaces, each writing `logs/<name>.log`: wait on a log or an exit,
    show the tails, tear down. The chaos and compose harnesses start theirs each their own way."""

    WAIT_S = 60.0

    def __init__(self, net: Network, logs: Path):
        self.net, self.logs = net, logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, host: str, argv: Sequence[str], env: Mapping[str, str], **kw) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "w") as out:  # the child keeps its own descriptor
            self.procs[name] = self.net.popen(host, argv, env=env, stdout=out, stderr=subprocess.STDOUT, **kw)
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait_for(self, name: str, predicate: str | Callable[[str], bool], timeout: float | None = None) -> str:
        """Poll `name`'s log until it contains the text (or satisfies the predicate); its log."""
        test = (lambda text: predicate in text) if isinstance(predicate, str) else predicate
        deadline = time.monotonic() + (self.WAIT_S if timeout is None else timeout)
        while True:
            text = self.log(name)
            if test(text):
                return text
            if time.monotonic() > deadline or self.procs[name].poll() is not None and not test(self.log(name)):
                raise AssertionError(f"{name}: {predicate!r} never appeared:\n{text[-4000:]}\n{self.tails()}")
            time.sleep(0.1)

    def wait(self, name: str, timeout: float | None = None) -> int:
        """`name`'s exit code, once it exits."""
        try:
            return self.procs[name].wait(self.WAIT_S if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout or self.WAIT_S:g} s\n{self.tails()}") from None

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-2000:]}" for n in self.procs)

    def down(self) -> None:
        self.net.stop(self.procs.values())


@dataclass(frozen=True)
class Service:
    name: str
    command: tuple[str, ...]
    environment: dict[str, str]
    depends_on: tuple[str, ...] = ()


def read_compose(path: str | os.PathLike[str]) -> list[Service]:
    """The services of a docker-compose file, dependencies first.

    Reads what the harness can honour: `command` (string or list),
    `environment` (map or `KEY=VALUE` list) and `depends_on` (list or map).
    `${VAR:-default}` takes the default, as Compose does with VAR unset;
    `${VAR:?message}` requires VAR.
    """
    import yaml  # the test extra: only the cluster tests need it

    doc = yaml.safe_load(Path(path).read_text())
    services = doc.get("services") if isinstance(doc, dict) else None
    if not isinstance(services, dict) or not services:
        raise ValueError(f"{path}: no `services` map")
    out: dict[str, Service] = {}
    for name, spec in services.items():
        command = spec.get("command")
        if isinstance(command, str):
            command = shlex.split(command)
        if not command or not all(isinstance(a, str | int | float) for a in command):
            raise ValueError(f"{path}: service {name!r} needs a `command` the harness can run")
        env_spec = spec.get("environment") or {}
        if isinstance(env_spec, list):
            env_spec = dict(item.split("=", 1) for item in env_spec)
        env = {str(k): _interpolate(str(v)) for k, v in env_spec.items() if v is not None}
        deps = spec.get("depends_on") or ()
        out[name] = Service(name, tuple(_interpolate(str(a)) for a in command), env, tuple(deps))
    return _dependency_order(out)


def _interpolate(text: str) -> str:
    def value(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        if op and op.endswith("?") and not os.environ.get(name):
            raise ValueError(f"compose file: {name} is required: {arg}")
        return os.environ.get(name, arg if op and op.endswith("-") else "")

    return re.sub(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}", value, text)


def _dependency_order(services: dict[str, Service]) -> list[Service]:
    ordered: list[Service] = []
    placing: set[str] = set()

    def place(name: str) -> None:
        if any(s.name == name for s in ordered):
            return
        if name in placing:
            raise ValueError(f"depends_on cycle through {name!r}")
        if name not in services:
            raise ValueError(f"depends_on names unknown service {name!r}")
        placing.add(name)
        for dep in services[name].depends_on:
            place(dep)
        ordered.append(services[name])

    for name in services:
        place(name)
    return ordered
