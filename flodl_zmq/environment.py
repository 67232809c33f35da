"""The FLODL_* environment contract: how a spawned process learns its role.

Whoever starts the processes (the local launcher, an agent, a compose file)
runs the user script as the controller and the ranks, a host's relay as
`python -m flodl_zmq.relay` (`RELAY_ARGV`: it needs nothing of the script),
and sets:

    FLODL_ROLE        controller | relay | rank (unset: train in this process alone)
    FLODL_CONTROLLER  the controller address HOST:PORT (it binds PORT..PORT+3)
    FLODL_KEY         the 32-byte session key, 64 hex characters (`flodl-zmq keygen`)
    FLODL_RUN_ID      the run id, 32 hex characters: names the run (checkpoints, an agent's
                      comeback); drawn at random by launch / the controller for each run
    FLODL_INCARNATION the incarnation id, 32 hex characters: binds every record, shared-memory
                      segment and local socket to this incarnation of the run; drawn at random
                      by launch for each cohort it starts and by the controller at each start
                      and re-form, never chosen or reused by hand (PROTOCOL.md 4.1)
    FLODL_WORLD       the world: HOST=RANK,RANK;HOST=RANK,... (e.g. h0=0,1;h1=2,3)
    FLODL_HOST        relay and rank: the host this process belongs to
    FLODL_RANK        rank: its global rank
    FLODL_LOCAL_RANK  rank: its index on the host (picks cuda:LOCAL_RANK when CUDA is present)
    FLODL_ROUTE_SECRET controller: 32 random bytes, 64 hex characters, drawn by whoever starts
                      the controller; every host's token derives from it (links.host_token).
                      Also a relay whose host runs a reducer shard (FLODL_SHARDS, shards.py)
    FLODL_HOST_TOKEN  relay: its host's token, 64 hex characters, which its `relay.hello`
                      carries: only the controller and this host know it (PROTOCOL.md 10.5)
    FLODL_EXIT_FD     controller under `flodl-zmq launch`: the pipe on which the launcher
                      reports every relay and rank exit (`ExitReports`), as an agent does
    FLODL_LIFELINE_FD every role under `flodl-zmq launch`, and an agent's relay and ranks: the
                      read end of a pipe only the parent holds open; its end of file means
                      the parent is gone: the process stops as on SIGTERM, and a rank or a
                      relay as a failure, not a goodbye (`watch_lifeline`)

and the settings of flodl_zmq/settings.py that a child reads (FLODL_SLOWDOWN,
FLODL_STARTUP_TIMEOUT, the relay's and the rank's timings), written and read
by `Settings.to_environ` / `Settings.from_environ`.

What an agent starts on its host (the program, the run's settings, the
world) comes from the controller as a `SpawnSpec` in `join.world_formed`.

An agent also hands its relay its CURVE keys (FLODL_CURVE_SERVER, _SECRET,
_PUBLIC; flodl_zmq/security.py) when the run's links are encrypted.

Rules this module keeps: the contract is parsed in one place, every variable
is checked, and an error names the variable and the fix. `to_environ` is the
exact inverse of `from_environ`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.errors import ConfigError, MembershipError
from flodl_zmq.formation import rank_space
from flodl_zmq.links import HOST_TOKEN_BYTES, ROUTE_SECRET_BYTES
from flodl_zmq.settings import Settings
from flodl_zmq.shards import ShardMap
from flodl_zmq.wire import KEY_ENV, RUN_ID_BYTES, key_from_hex

ROLES = ("controller", "relay", "rank")
# The interpreter's arguments that start a host's relay (flodl_zmq/relay.py, `main`). A user
# script run with FLODL_ROLE=relay serves the same relay; this one runs none of the user's code.
RELAY_ARGV = ("-m", "flodl_zmq.relay")
# The settings a spawned process reads (a command's own, such as --bind, are not its business).
CHILD_SCOPES = ("run", "process")
# glibc tunables for spawned processes (glibc reads them once, at process start).
# The controller and the relays: transparent huge pages for glibc's large
# allocations (fresh pages fault in at ~1.3 GB/s on the development machine, 6x
# slower than a memcpy), and they keep the memory they free. ZeroMQ allocates a
# fresh buffer for every message it receives; a buffer glibc returns to the
# kernel comes back as pages the kernel zeroes first, which perf showed as a
# seventh of a round's CPU. One arena that never maps, unmaps or trims lets each
# round's message reuse the last one's pages. Ranks keep glibc's defaults, as a
# process training alone does: their allocations are torch's, and with huge pages
# each block their heap grew by was zeroed 2 MB at a time (a CNN rank's first eval
# took 25 ms more than alone's, most of it in the kernel's clear_page_erms).
SERVICE_MALLOC_TUNABLES = (
    "glibc.malloc.hugetlb=1",
    "glibc.malloc.arena_max=1",
    "glibc.malloc.mmap_max=0",
    "glibc.malloc.trim_threshold=17179869184",
)


# The controller and the relays spread a round's bulk work (MACs, sums, bf16 widening) over the
# cores with their own pool (flodl_zmq/threads.py). torch's OpenMP team (and, in a fresh interpreter,
# OpenBLAS's threads) inside each piece would put cores x cores threads on it, spinning between pieces: perf showed
# libgomp and torch's parallel_for in a bf16 round, and one thread each cut its CPU by a tenth
# (bench/round.py, bf16 10M: 65 -> 58 ms). Read once, when the libraries load.
SERVICE_THREADS = {"OMP_NUM_THREADS": "1"}


def with_tunables(env: Mapping[str, str], role: str) -> dict[str, str]:
    """`env` plus what `role`'s process reads at start-up (glibc tunables; a service's thread counts); a
    tunable or variable already set in `env` is left as it is."""
    out = dict(env)
    have = [t for t in out.get("GLIBC_TUNABLES", "").split(":") if t]
    named = {t.split("=", 1)[0] for t in have}
    service = role in ("controller", "relay")
    ours = SERVICE_MALLOC_TUNABLES if service else ()
    out["GLIBC_TUNABLES"] = ":".join(have + [t for t in ours if t.split("=", 1)[0] not in named])
    if service:
        out = {**SERVICE_THREADS, **out}
    return out


def parse_world(text: str) -> dict[str, tuple[int, ...]]:
    """`h0=0,1;h1=2,3` -> {"h0": (0, 1), "h1": (2, 3)}; ranks distinct and >= 0.

    A rank no host holds is a *vacancy*: a rank of a host that left before the
    world re-formed (PROTOCOL.md 13.1). Numbers are never reused, so it stays
    in the rank space (`world_size`) and starts dead.
    """
    world: dict[str, tuple[int, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        host, sep, ranks = part.partition("=")
        if not sep or not host.strip():
            raise ConfigError(f"FLODL_WORLD entry {part!r} must be HOST=RANK,RANK,...")
        try:
            world[host.strip()] = tuple(int(r) for r in ranks.split(",") if r.strip())
        except ValueError:
            raise ConfigError(f"FLODL_WORLD entry {part!r}: ranks must be integers") from None
    every = [r for rs in world.values() for r in rs]
    if not world or len(set(every)) != len(every) or min(every, default=-1) < 0 or not all(world.values()):
        raise ConfigError(
            f"FLODL_WORLD {text!r} must give every host at least one rank and each rank (>= 0) to one host"
        )
    return world


def format_world(world: Mapping[str, tuple[int, ...]]) -> str:
    return ";".join(f"{h}={','.join(map(str, rs))}" for h, rs in world.items())


@dataclass(frozen=True)
class SpawnSpec:
    """What every admitted host runs, shipped as `WorldFormed.spawn_json`.

    `argv` follows the Python interpreter (`["train.py", "--lr", "0.1"]`,
    `["-m", "flodl_zmq", "demo"]`): the host's relay and ranks all run it,
    their role in the environment (this module's contract). Every host runs
    the controller's program and arguments, not whatever it was started with,
    so a cohort cannot train different scripts. `env` is added to every
    child's environment (the run's timings, `Settings.to_environ(("run",))`;
    it never overrides a child's identity). `world` maps each host to its global ranks;
    the controller fills it in when the world forms.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    world: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def shard_map(self) -> ShardMap:
        """The run's reducer shards as the spec ships them (its `shards` setting): which hosts' relays run one."""
        return Settings.from_environ(self.env, CHILD_SCOPES).shard_map

    def to_json(self) -> str:
        obj = {"argv": list(self.argv), "env": self.env, "world": format_world(self.world)}
        return json.dumps(obj, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SpawnSpec:
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise MembershipError(f"spawn artifacts are not valid JSON ({exc}): controller bug") from None
        ok = (
            isinstance(obj, dict)
            and set(obj) == {"argv", "env", "world"}
            and isinstance(obj["argv"], list)
            and bool(obj["argv"])
            and all(isinstance(a, str) for a in obj["argv"])
            and isinstance(obj["env"], dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in obj["env"].items())
            and isinstance(obj["world"], str)
        )
        if not ok:
            raise MembershipError(
                'spawn artifacts must be {"argv": [str, ...] (non-empty), "env": {str: str}, '
                '"world": "HOST=RANK,...;..."}; the controller runs another flodl-zmq version'
            )
        try:
            world = parse_world(obj["world"])
        except ConfigError as exc:
            raise MembershipError(f"spawn artifacts: {exc}") from None
        return cls(tuple(obj["argv"]), dict(obj["env"]), world)


@dataclass(frozen=True)
class ProcessEnv:
    """One process's place in the cluster."""

    role: str
    controller: ControllerAddress
    key: bytes
    run_id: bytes
    incarnation: bytes
    world: dict[str, tuple[int, ...]]
    host: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    settings: Settings = field(default_factory=Settings)
    exit_fd: int | None = None
    lifeline_fd: int | None = None
    route_secret: bytes | None = None  # controller, and a relay running a shard: what each host's token derives from
    host_token: bytes | None = None  # relay: its host's token, which its hello proves

    def need_route_secret(self) -> bytes:
        """The route secret (the controller's, or a shard host's); a ConfigError naming FLODL_ROUTE_SECRET without it."""
        if self.route_secret is None:
            raise ConfigError("the controller needs FLODL_ROUTE_SECRET (64 hex characters, drawn at random by "
                              "whoever starts it: launch, `flodl-zmq controller`); it proves each relay's hello")
        return self.route_secret

    @property
    def slowdown(self) -> float:
        return self.settings.slowdown

    @property
    def startup_timeout_s(self) -> float:
        return self.settings.startup_timeout_s

    @property
    def world_size(self) -> int:
        return rank_space(self.world)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ProcessEnv | None:
        """The process's role from the environment; None when FLODL_ROLE is unset (single process)."""
        env = os.environ if environ is None else environ
        role = env.get("FLODL_ROLE", "").strip()
        if not role:
            return None
        if role not in ROLES:
            raise ConfigError(f"FLODL_ROLE={role!r} is not one of {', '.join(ROLES)}")

        def need(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise ConfigError(f"FLODL_ROLE={role} needs {name} (see flodl_zmq/environment.py)")
            return value

        run_id, incarnation = (_id(need(name), name) for name in ("FLODL_RUN_ID", "FLODL_INCARNATION"))
        world = parse_world(need("FLODL_WORLD"))
        host = need("FLODL_HOST") if role in ("relay", "rank") else None
        if host is not None and host not in world:
            raise ConfigError(f"FLODL_HOST={host!r} is not a host of FLODL_WORLD ({', '.join(world)})")
        rank = local_rank = None
        exit_fd = _fd(env, "FLODL_EXIT_FD") if role == "controller" else None
        if role == "rank":
            try:
                rank, local_rank = int(need("FLODL_RANK")), int(need("FLODL_LOCAL_RANK"))
            except ValueError:
                raise ConfigError("FLODL_RANK and FLODL_LOCAL_RANK must be integers") from None
            if rank not in world[host]:  # type: ignore[index]
                raise ConfigError(f"FLODL_RANK={rank} is not one of host {host}'s ranks {world[host]}")  # type: ignore[index]
        settings = Settings.from_environ(env, CHILD_SCOPES)
        # A relay whose host runs a reducer shard checks every relay's hello there as the controller does.
        holds_shard = role == "relay" and settings.shard_map.shard_of(host or "") is not None
        return cls(
            role=role,
            controller=ControllerAddress.parse(need("FLODL_CONTROLLER")),
            key=key_from_hex(need(KEY_ENV)),
            run_id=run_id,
            incarnation=incarnation,
            world=world,
            host=host,
            rank=rank,
            local_rank=local_rank,
            settings=settings,
            exit_fd=exit_fd,
            lifeline_fd=_fd(env, "FLODL_LIFELINE_FD"),
            route_secret=(_secret(need, "FLODL_ROUTE_SECRET", ROUTE_SECRET_BYTES)
                          if role == "controller" or holds_shard else None),
            host_token=_secret(need, "FLODL_HOST_TOKEN", HOST_TOKEN_BYTES) if role == "relay" else None,
        )

    def to_environ(self) -> dict[str, str]:
        """The FLODL_* variables that make `from_environ` return this object.

        Exactly its inverse when `settings` differs from the defaults only in
        settings a child reads (scopes run and process): a command's own
        settings (the controller's --bind, ...) are not a child's business.
        """
        out = {
            "FLODL_ROLE": self.role,
            "FLODL_CONTROLLER": str(self.controller),
            KEY_ENV: self.key.hex(),
            "FLODL_RUN_ID": self.run_id.hex(),
            "FLODL_INCARNATION": self.incarnation.hex(),
            "FLODL_WORLD": format_world(self.world),
            **self.settings.to_environ(CHILD_SCOPES),
        }
        if self.host is not None:
            out["FLODL_HOST"] = self.host
        if self.rank is not None:
            out["FLODL_RANK"] = str(self.rank)
            out["FLODL_LOCAL_RANK"] = str(self.local_rank)
        if self.exit_fd is not None:
            out["FLODL_EXIT_FD"] = str(self.exit_fd)
        if self.lifeline_fd is not None:
            out["FLODL_LIFELINE_FD"] = str(self.lifeline_fd)
        if self.route_secret is not None:
            out["FLODL_ROUTE_SECRET"] = self.route_secret.hex()
        if self.host_token is not None:
            out["FLODL_HOST_TOKEN"] = self.host_token.hex()
        return out


def _id(value: str, name: str) -> bytes:
    """The 16-byte id given as hex in the variable `name` (FLODL_RUN_ID, FLODL_INCARNATION)."""
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raw = b""
    if len(raw) != RUN_ID_BYTES:
        raise ConfigError(f"{name} must be {RUN_ID_BYTES * 2} hex characters")
    return raw


def _secret(need: Callable[[str], str], name: str, size: int) -> bytes:
    """The `size` bytes of variable `name`, given in hex."""
    try:
        value = bytes.fromhex(need(name))
    except ValueError:
        raise ConfigError(f"{name} must be hex") from None
    if len(value) != size:
        raise ConfigError(f"{name} must be {size * 2} hex characters ({size} bytes), got {len(value) * 2}")
    return value


def _fd(env: Mapping[str, str], name: str) -> int | None:
    """The file descriptor number in `name`, None when unset."""
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be a file descriptor number") from None


def _threads() -> list[int]:
    """This process's thread ids (Linux: /proc/self/task; elsewhere none, and nothing is changed)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _set_policy(tid: int, policy: int) -> None:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError:  # a thread that ended meanwhile, or a system that refuses: the service runs as before
        pass


@contextmanager
def behind_the_ranks() -> Iterator[None]:
    """Serve (the controller, a relay) under SCHED_BATCH, every thread of this process and those it starts.

    A service wakes for every record and round, and on a machine whose cores the ranks keep busy
    each wake-up preempted a rank's step mid-way. A batch thread still gets its fair share of
    the CPU, and at once on an idle core, but waits for the scheduler's tick instead of preempting a
    busy one: a few milliseconds more for a round that the ranks do not wait on, and their steps
    whole (the CNN pair's epochs 1-2.6% shorter: docs/benchmarks.md, "The services behind the
    ranks"). No privilege is needed; where the system has no such policy nothing changes. The
    threads left when the block ends go back to the policy the caller had.
    """
    if not hasattr(os, "SCHED_BATCH"):
        yield
        return
    before = os.sched_getscheduler(0)
    for tid in _threads():
        _set_policy(tid, os.SCHED_BATCH)
    try:
        yield
    finally:
        for tid in _threads():
            _set_policy(tid, before)


def stop_as_on_sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def watch_lifeline(fd: int, on_lost: Callable[[], None] = stop_as_on_sigterm) -> None:
    """Call `on_lost` (from a thread of its own) once the launcher or agent that holds the pipe's write end is gone.

    Its children run in sessions of their own, so a parent killed outright
    (SIGKILL, a test harness's timeout) signals none of them; the kernel closing
    its end of this pipe is the one notice that always comes. A parent that
    stops its children on purpose signals them first, so only a parent's death
    is told apart this way: a rank and a relay then leave as failures.
    """

    def watch() -> None:
        while os.read(fd, 4096):  # nothing is ever written: only the end of file matters
            pass
        on_lost()

    threading.Thread(target=watch, name="flodl-lifeline", daemon=True).start()


class SigtermInterrupt(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is: the SIGINT path, but told apart (the controller's rule under
    --resume auto, and its exit status). A rank's SIGTERM is session.RankTerminated instead."""


def moves_the_run(stop: BaseException, resume: str | None) -> bool:
    """Whether `stop` is a SIGTERM under --resume auto: how an orchestrator moves a controller (Kubernetes, Compose),
    not the run's end. The agents are not aborted; they wait for the next controller, which resumes the newest
    checkpoint."""
    return isinstance(stop, SigtermInterrupt) and resume == "auto"


TERMINATED_EXIT = 143  # a shell's status for SIGTERM: not 0, so `restart: on-failure` and OnFailure restart it
INTERRUPTED_EXIT = 130  # a shell's status for SIGINT (Ctrl-C)
# A process handed a role whose script ended without playing it (no Trainer.run(), no Session): nothing
# trained, and a 0 told nobody (flodl_zmq/session.py, `unplayed`; launch names the cause by it).
UNPLAYED_EXIT = 3
# The ranks of an agent that refused the world its controller formed (a program or a setting it does not run,
# agent_rules.check_spawn): reported as their exits, so the run goes on without them at once.
REFUSED_EXIT = 4
# A rank the coordinator declared dead, told so: the run goes on without it (a crash's status is 1).
DECLARED_DEAD_EXIT = 5


def reported_exit(host: str, code: int) -> str:
    """Why a rank is gone, as its agent reported it: the controller's reason for its death."""
    if code == REFUSED_EXIT:
        return (f"its agent on {host} refused the run (the program or a setting it was sent is not what it runs: "
                "that agent's log names both)")
    return f"its agent on {host} reported exit code {code}"


# A rank whose own code raised (its train_step, its dataset) logs `training_failed`'s line, then the traceback. The
# line names the error because no record carries it to the controller: whoever reads the rank's output (launch)
# finds the cause there (`failed_with`) and names it when the run ends.
FAILED_MARK = ": training failed: "


def training_failed(rank: int, error: BaseException) -> str:
    """The line rank `rank` logs when its own code raised `error`: `rank 1: training failed: ValueError: ...`."""
    said = str(error).strip().splitlines()
    return f"rank {rank}{FAILED_MARK}{type(error).__name__}" + (f": {said[0]}" if said else "")


def failed_with(line: str) -> str | None:
    """The error a `training_failed` line names (`ValueError: ...`); None for any other line."""
    _, mark, error = line.partition(FAILED_MARK)
    return error if mark else None


# Our own errors (flodl_zmq/errors.py) name their cause and the fix. Raised out of a launched script (a job the
# controller or a rank refuses, a run that stops early), each process's traceback ends with one, qualified:
# `flodl_zmq.errors.ConfigError: ...`. The launcher finds it there (`own_error`) and names it when the run ends.
OWN_ERROR_PREFIX = "flodl_zmq.errors."


def own_error(line: str) -> str | None:
    """The error (`ConfigError: ...`) a traceback's last line names when it is one of ours; None for any other line."""
    return line[len(OWN_ERROR_PREFIX):] if line.startswith(OWN_ERROR_PREFIX) else None


def interrupted_exit(stop: KeyboardInterrupt) -> int:
    """The exit status of a process stopped by `stop`: SIGTERM's (`SigtermInterrupt`) or SIGINT's, as a shell's."""
    return TERMINATED_EXIT if isinstance(stop, SigtermInterrupt) else INTERRUPTED_EXIT


class RaisingHandler:
    """A signal handler that raises `stop()` where the main thread is, and remembers that it fired.

    Python prints and drops an exception raised inside a finaliser: a handler that runs while the
    main thread frees an object or closes a generator loses its stop, and the process runs on (a
    controller whose launcher had died kept serving nobody). The loops call `raise_lost_signal`
    where they can stop, and stop there after all.
    """

    def __init__(self, stop: Callable[[], BaseException]) -> None:
        self.stop = stop
        self.fired = False

    def __call__(self, _signum: int, _frame: object) -> None:
        self.fired = True
        raise self.stop()


def raise_lost_signal() -> None:
    """Raise the stop of a `RaisingHandler` (SIGTERM's or SIGHUP's) that fired, in case its own raise was lost."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        handler = signal.getsignal(signum)
        if isinstance(handler, RaisingHandler) and handler.fired:
            raise handler.stop()


def raise_interrupt_on_sigterm() -> Any:
    """SIGTERM takes the SIGINT path (`SigtermInterrupt`, a KeyboardInterrupt); returns the previous handler."""
    return signal.signal(signal.SIGTERM, RaisingHandler(SigtermInterrupt))


@dataclass(frozen=True)
class ChildExit:
    """A relay (`rank` None) or rank process of `host` ended with `code` (negative: killed by that signal)."""

    host: str
    rank: int | None
    code: int


class ExitReports:
    """The launcher's exit reports on FLODL_EXIT_FD: one JSON line per child exit.

    A pipe from the parent that started every process needs no MAC; it is how
    the controller of a local run learns at once what an agent would report.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending = b""

    @staticmethod
    def line(exit: ChildExit) -> bytes:
        return (json.dumps({"host": exit.host, "rank": exit.rank, "code": exit.code}) + "\n").encode()

    def read(self) -> list[ChildExit] | None:
        """The reports that arrived (call when the fd is readable); None once the launcher closed the pipe."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        return [ChildExit(**json.loads(raw)) for raw in lines]
