"""The local launcher: a whole cluster on this machine, one process per role.

`flodl-zmq launch --hosts H --ranks-per-host K script.py [args]` starts the
user's script H*K + 1 times, the controller and the ranks, and one relay per
simulated host (`h0`, `h1`, ...; `python -m flodl_zmq.relay`), each with its
FLODL_* environment (see flodl_zmq/environment.py). Every line a child prints comes out prefixed with
`[controller]`, `[host:relay]` or `[host:rank]`. The controller and the ranks
are forked from one warm interpreter that has imported torch already
(flodl_zmq/warm.py), so the run does not start with H*K + 1 torch imports side
by side; the relays start meanwhile (torch only for a bf16 run: tensors.preload). With
`--shards N` (or FLODL_SHARDS) the first N hosts' relays each run a reducer
shard too (flodl_zmq/shards.py), and only those relays are given the route
secret (FLODL_ROUTE_SECRET) their shard proves every relay's hello with.

Rules this module keeps:

- No process left behind. Each child runs in its own process group (its own
  session), so a signal reaches everything it started; teardown is SIGTERM to
  every group, a grace period, then SIGKILL, and it runs on every exit path:
  the controller finishing, Ctrl-C, SIGTERM to the launcher, an exception.
  A launcher that cannot tear down (SIGKILL, a parent killed by a harness's
  timeout) still leaves nothing: every child holds the read end of a pipe
  only the launcher writes to (FLODL_LIFELINE_FD) and stops as on SIGTERM at
  its end of file.
- The controller's exit status is the run's: ranks and relays that are still
  up a grace period after it ended are stopped, at once if it failed. A
  script that never trained (no `Trainer.run()`, no `Session`) ends its
  processes with UNPLAYED_EXIT, not 0, and the launch ends saying so.
- The launcher is the agent of every simulated host: it reports every relay
  and rank exit to the controller at once (`ExitReports` on a pipe, the
  FLODL_EXIT_FD of flodl_zmq/environment.py), as an agent does over its join
  link, so a rank that dies before it ever spoke is never waited for.
- A controller killed by a signal other than SIGTERM/SIGINT (which stop a
  run) comes back when the run writes checkpoints (FLODL_CHECKPOINT_DIR):
  the relays and ranks are stopped, and the whole cohort starts again with
  the same run id, key and world and a fresh incarnation id (nothing of the
  cohort before is accepted by it, PROTOCOL.md 4.1), resuming the newest
  checkpoint (FLODL_RESUME). A checkpoint already restarted from is not tried twice:
  a controller that keeps dying before the next checkpoint is not a loop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
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

from flodl_zmq.endpoints import OFFSETS, ControllerAddress
from flodl_zmq.environment import (
    CHILD_SCOPES,
    RELAY_ARGV,
    UNPLAYED_EXIT,
    ChildExit,
    ExitReports,
    ProcessEnv,
    failed_with,
    own_error,
    with_tunables,
)
from flodl_zmq.errors import ConfigError
from flodl_zmq.links import ROUTE_SECRET_BYTES, host_token, remove_local_dir
from flodl_zmq.settings import DEFAULT_MODE, MODE_NAMES, Settings
from flodl_zmq.warm import WarmProcess, WarmServer, check_target, runnable, start
from flodl_zmq.wire import RUN_ID_BYTES, new_incarnation, new_key, session_key
from flodl_zmq.wire.shm import unlink_run

AFTER_CONTROLLER_GRACE_S = 10.0
TERM_GRACE_S = 5.0


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def local_shards(hosts: Sequence[str], count: int, first_port: int) -> str:
    """FLODL_SHARDS for `--shards N`: the first N hosts hold a shard each, on 127.0.0.1 from `first_port` up
    (its data ROUTER and its PUB: two ports each)."""
    return ",".join(f"{host}=tcp://127.0.0.1:{first_port + 2 * k}" for k, host in enumerate(hosts[:count]))


def _listening_port_range(span: int) -> range:
    """Bases for `span` ports outside the kernel's ephemeral range: the controller binds seconds after
    the probe (it imports torch first), and a port in that range can meanwhile become the local end of
    any outgoing connection on the machine (a CI run lost a launch to one)."""
    low, high = 32768, 60999  # Linux's default, where the range cannot be read
    try:
        low, high = (int(x) for x in EPHEMERAL_PORTS.read_text().split())
    except (OSError, ValueError):
        pass
    if low - span > 10000:
        return range(10000, low - span)
    if high + 1 < 65536 - span:
        return range(high + 1, 65536 - span)
    return range(1024, 65536 - span)  # the whole range is ephemeral: nothing better to do


CONTROLLER_PORTS = max(OFFSETS.values()) + 1
# Drawn from the OS, not from `random`'s global generator: a job seeds that one (Job.build_model), and two
# processes seeded alike would then probe the same ports in the same order and bind each other's.
_PORT_DRAWS = random.SystemRandom()


def free_port_base(host: str = "127.0.0.1", tries: int = 200, extra: int = 0, avoid: int | None = None) -> int:
    """A port P such that P..P+3 (the controller's four endpoints), and `extra` ports after them, are free on
    `host` right now, and none of them is `avoid` (the metrics port, bound later)."""
    span = CONTROLLER_PORTS + extra
    bases = _listening_port_range(span)
    for _ in range(tries):
        base = _PORT_DRAWS.choice(bases)
        if avoid is not None and base <= avoid < base + span:
            continue
        socks = []
        try:
            for offset in range(span):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, base + offset))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ConfigError(f"found no {span} consecutive free ports on {host}; pass --port explicitly")


@dataclass
class Child:
    label: str
    env: ProcessEnv
    proc: subprocess.Popen | WarmProcess
    reader: threading.Thread | None = None
    raised: str | None = None  # a rank's: the error its own code raised, from its `training failed` line
    stopped_by: str | None = None  # the last of our own errors a traceback of its ended with (`own_error`)


@dataclass
class Cluster:
    """The processes of one local run. `start()`, then `wait()`; `shutdown()` on any other exit.

    `env_for` adds or overrides environment variables of one child by label
    (`controller`, `h0:relay`, `h1:3`), which is how tests give one process a
    wrong key or a different dataset. `warm`: a warm interpreter (`warm_interpreter`)
    to fork from and leave running, for a caller that starts run after run (a
    sweep, a test session) and imports torch once for all of them; by default
    each run starts its own.
    """

    argv: Sequence[str]  # what follows the interpreter: ["script.py", *args] or ["-m", "pkg.mod", *args]
    hosts: int = 2
    ranks_per_host: int = 2
    port: int | None = None
    slow: Mapping[int, float] = field(default_factory=dict)
    env_for: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    sink: Callable[[str], None] | None = None
    startup_timeout_s: float | None = None
    run_dir: str | None = None  # the controller's run directory (--run-dir; None: its own default)
    metrics_port: int | None = None  # the controller's Prometheus port (--metrics-port; None: the environment's)
    grace_s: float = AFTER_CONTROLLER_GRACE_S  # how long ranks and relays may outlive the controller
    shards: int = 0  # host shards (--shards N): the first N hosts' relays reduce a slice each (flodl_zmq/shards.py)
    warm: WarmServer | None = None
    children: dict[str, Child] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks_per_host < 1:
            raise ConfigError(f"--hosts ({self.hosts}) and --ranks-per-host ({self.ranks_per_host}) must be >= 1")
        if not 0 <= self.shards <= self.hosts:
            raise ConfigError(f"--shards {self.shards}: each host shard runs in one host's relay, so at most --hosts "
                              f"({self.hosts}); 0 for one reducer, the controller's")
        world_size = self.hosts * self.ranks_per_host
        for rank, factor in self.slow.items():
            # `not 1 <= factor < inf`: a NaN compares false both ways, and must not reach a rank's delay.
            if not 0 <= rank < world_size or not 1.0 <= factor < math.inf:
                raise ConfigError(f"--slow {rank}:{factor}: rank must be in 0..{world_size - 1} and factor a "
                                  "finite number >= 1, e.g. --slow 1:3")
        if self.port:  # checked before any process starts, not first by the controller's bind
            ControllerAddress("127.0.0.1", self.port)
        self._lock = threading.Lock()
        self._sink_lock = threading.Lock()
        self.run_id: bytes | None = None
        self.incarnation: bytes | None = None  # the running cohort's (PROTOCOL.md 4.1): new at each restart
        self._exits: int | None = None  # write end of the controller's FLODL_EXIT_FD pipe
        self._lifeline: int | None = None  # write end of the children's FLODL_LIFELINE_FD pipe
        self.restarts: list[tuple[str, float]] = []  # (checkpoint, seconds from the kill to the respawn)
        self.key: bytes | None = None
        self._warm: WarmServer | None = None  # forks the controller and the ranks (flodl_zmq/warm.py)

    @property
    def world(self) -> dict[str, tuple[int, ...]]:
        k = self.ranks_per_host
        return {f"h{h}": tuple(range(h * k, (h + 1) * k)) for h in range(self.hosts)}

    def start(self) -> None:
        """Spawn the controller, the relays, then the ranks."""
        self.run_id = os.urandom(RUN_ID_BYTES)
        self._route_secret = os.urandom(ROUTE_SECRET_BYTES)  # each relay gets its host's token of it, no other's
        # The run's settings come from our environment, like the controller's; slowdowns from --slow.
        settings = replace(Settings.from_environ(scopes=CHILD_SCOPES), slowdown=1.0)
        if self.startup_timeout_s is not None:
            settings = replace(settings, startup_timeout_s=self.startup_timeout_s)
        if self.run_dir is not None:
            settings = replace(settings, run_dir=self.run_dir)
        if self.metrics_port is not None:
            settings = replace(settings, metrics_port=self.metrics_port)
        extra = 2 * self.shards
        address = ControllerAddress("127.0.0.1", self.port or free_port_base(extra=extra, avoid=settings.metrics_port))
        # Before any process starts: a clash was a traceback from the controller's first bind.
        address.check_apart(settings.metrics_port, extra)
        if self.port:
            address.check_free("--port PORT", extra)
        if self.shards:
            if settings.shards is not None:
                raise ConfigError(f"--shards {self.shards} and FLODL_SHARDS={settings.shards} both say where the "
                                  "shards run: give one of them")
            settings = replace(settings, shards=local_shards(list(self.world), self.shards,
                                                             address.port + CONTROLLER_PORTS))
        # The warm interpreter first: its torch import is most of the start-up, and nothing here waits on it.
        if runnable(self.argv):
            self._warm = self.warm or warm_interpreter()
        if settings.resume is not None:
            # Imported only to resume: checkpoints imports torch (bundle does), which would hold this
            # start up by a second torch import, and the agent, which imports this module, never may.
            from flodl_zmq import checkpoints

            # `auto` is chosen once, here: every process must continue the same checkpoint.
            settings = checkpoints.pin_resume(settings)
        self._settings = settings
        # FLODL_KEY, when set, is the run's key, so that `flodl-zmq status` can sign with it.
        given = session_key(os.environ)
        key = self.key = given or new_key()
        self._base = dict(controller=address, key=key, run_id=self.run_id, world=self.world)
        self._spawn_cohort(self._settings)
        # Never the key itself: output and logs are read (and kept) by more than the run's owner.
        watch = f"flodl-zmq status --controller {address} --watch"
        self._emit(f"[launch] controller at {address}; " + (
            f"watch it with: {watch}" if given else
            f"to watch a run with `{watch}`, export FLODL_KEY (`flodl-zmq keygen`) before launch: "
            "a generated key is never printed"))

    def _spawn_cohort(self, settings: Settings) -> None:
        exits, exits_w = os.pipe()
        os.set_blocking(exits_w, False)  # a controller that stops reading never blocks the launcher
        lifeline, self._lifeline = os.pipe()  # never written: only this process's death closes it
        # Every cohort is an incarnation of its own: nothing the one before signed reaches this one.
        self.incarnation = new_incarnation()
        base = dict(self._base, incarnation=self.incarnation, lifeline_fd=lifeline)
        with self._lock:
            self._exits = exits_w
        try:
            # The relays first: the controller and the ranks wait for the warm interpreter's imports.
            for host in self.world:
                token = host_token(self._route_secret, host)
                # A shard host's relay runs a reducer, which proves every relay's hello by its host's token:
                # it needs the secret they derive from. No other host gets it (it could pass for any host).
                secret = self._route_secret if settings.shard_map.shard_of(host) else None
                self._spawn(f"{host}:relay", ProcessEnv(role="relay", host=host, settings=settings, host_token=token,
                                                        route_secret=secret, **base),
                            pass_fds=(lifeline,), argv=RELAY_ARGV)
            self._spawn("controller", ProcessEnv(role="controller", settings=settings, exit_fd=exits,
                                                 route_secret=self._route_secret, **base),
                        pass_fds=(exits, lifeline))
            for host, ranks in self.world.items():
                for local, rank in enumerate(ranks):
                    slowed = replace(settings, slowdown=float(self.slow.get(rank, 1.0)))
                    self._spawn(
                        f"{host}:{rank}",
                        ProcessEnv(role="rank", host=host, rank=rank, local_rank=local, settings=slowed, **base),
                        pass_fds=(lifeline,),
                    )
        finally:
            os.close(exits)  # the children hold their own copies
            os.close(lifeline)

    def _restart(self, code: int) -> bool:
        """A controller killed by a signal comes back from the newest checkpoint; True if it did (module doc)."""
        if code >= 0 or -code in (signal.SIGTERM, signal.SIGINT) or self._settings.checkpoint_dir is None:
            return False
        from flodl_zmq import checkpoints  # see start()

        t0 = time.monotonic()
        killed = signal.Signals(-code).name
        stem = checkpoints.newest(self._settings.checkpoint_dir)
        if stem is None or str(stem) == self._settings.resume:
            self._emit(f"[launch] the controller was killed by {killed} and there is no newer checkpoint in "
                       f"{self._settings.checkpoint_dir} than the last restart's: not restarting")
            return False
        self._emit(f"[launch] the controller was killed by {killed}; stopping the relays and ranks, "
                   f"restarting the run from {stem}")
        self._stop_children()
        self._settings = replace(self._settings, resume=str(stem))
        self._spawn_cohort(self._settings)
        self.restarts.append((str(stem), time.monotonic() - t0))
        return True

    def _spawn(self, label: str, penv: ProcessEnv, pass_fds: tuple[int, ...] = (),
               argv: Sequence[str] | None = None) -> None:
        env = with_tunables(os.environ, penv.role)
        env.update(penv.to_environ())
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env_for.get(label, {}))
        warm = self._warm if penv.role != "relay" else None  # the user's script: torch is imported already
        proc = start(label, self.argv if argv is None else argv, env, pass_fds, warm)
        child = Child(label, penv, proc)
        child.reader = threading.Thread(target=self._forward, args=(child,), daemon=True)
        child.reader.start()
        self.children[label] = child

    def _forward(self, child: Child) -> None:
        assert child.proc.stdout is not None
        for raw in child.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if child.env.role == "rank" and child.raised is None:
                child.raised = failed_with(line)
            child.stopped_by = own_error(line) or child.stopped_by
            self._emit(f"[{child.label}] {line}")
        if child.env.role != "controller":  # its output ended: it exited (or is about to)
            self._report(ChildExit(child.env.host or "", child.env.rank, child.proc.wait()))

    def _emit(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)
        if self.sink is not None:
            # Outside `_lock`: a sink that waits on a lock of its own while another thread holds
            # that lock and reads `output()` deadlocked a test. Sinks still get one line at a time.
            with self._sink_lock:
                self.sink(line)

    def _report(self, exit: ChildExit) -> None:
        with self._lock:
            if self._exits is None:
                return
            try:
                os.write(self._exits, ExitReports.line(exit))
            except OSError:  # the controller is gone (or stopped reading): nobody to tell
                pass

    def output(self) -> str:
        with self._lock:
            return "\n".join(self.lines)

    def pid(self, label: str) -> int:
        return self.children[label].proc.pid

    def kill(self, label: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one child's process group (tests: SIGKILL a rank mid-epoch)."""
        signal_group(self.children[label].proc, sig)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the controller, then stop whatever is left; returns the controller's exit status."""
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            controller = self.children["controller"].proc
            try:
                code = controller.wait(None if until is None else max(0.0, until - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.shutdown()
                raise
            if not self._restart(code):
                break
        # After a failed controller nobody will tell the ranks and relays to stop: at once.
        deadline = time.monotonic() + (self.grace_s if code == 0 else 0.0)
        for child in self.children.values():
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.shutdown()
        if code == UNPLAYED_EXIT:  # the script said why in each process; the run's end says what it means
            self._emit(f"[launch] no rank ever trained: the script ended without calling Trainer(...).run() or "
                       f"entering a Session (exit status {code})")
        raised = {label: c.raised for label, c in self.children.items() if c.raised is not None}
        stopped = {label: c.stopped_by for label, c in self.children.items() if c.stopped_by is not None}
        if raised:  # the ranks' tracebacks scrolled by, and the controller never learns what they raised
            self._emit(raised_summary(raised, sum(map(len, self.world.values()))))
        elif stopped and code not in (0, UNPLAYED_EXIT):  # a job refused, a run stopped: one traceback a process
            self._emit(stopped_summary(stopped))
        return code

    def shutdown(self) -> None:
        """Stop every child (see `_stop_children`), then the warm interpreter if it started it (idempotent)."""
        self._stop_children()
        if self._warm is not None and self._warm is not self.warm:
            self._warm.close()
        self._warm = None

    def _stop_children(self) -> None:
        """SIGTERM every child's group, wait, SIGKILL stragglers, reap all (idempotent). The controller goes
        first: signalled with its ranks, it could read their deaths before its own signal and end its run
        log "all_ranks_lost" where the user stopped the run (its end line says "interrupted")."""
        end_groups([c.proc for label, c in self.children.items() if label == "controller"])
        end_groups([c.proc for label, c in self.children.items() if label != "controller"])
        for c in self.children.values():
            if c.reader is not None:
                c.reader.join(2.0)
        with self._lock:
            if self._exits is not None:
                os.close(self._exits)
                self._exits = None
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        if self.incarnation is not None and self.key is not None:
            unlink_run(self.key, self.incarnation)  # a SIGKILLed relay or rank cannot unlink its shared-memory segments
            remove_local_dir(self.key, self.incarnation)  # nor its ipc socket files


def raised_summary(raised: Mapping[str, str], world_size: int) -> str:
    """The launch's last line when ranks left because their own code raised: `raised` maps each one's label
    (`h0:1`) to its error (`ValueError: ...`)."""
    who = "every rank" if len(raised) == world_size else f"{len(raised)} of {world_size} ranks"
    return (f"[launch] {who} left the run because its own code raised (its train_step or its dataset: a sample "
            f"that raises ends every rank that is handed it): {_by_error(raised)}; each traceback is above, under "
            "its [host:rank] prefix")


def stopped_summary(stopped: Mapping[str, str]) -> str:
    """The launch's last line when the run failed on one of our own errors (a job refused, a run stopped early) and
    no rank's own code raised: `stopped` maps each process's label (`controller`, `h0:1`) to that error. Each
    process printed its traceback, and the cause, once per process, scrolled by in them."""
    return f"[launch] the run failed: {_by_error(stopped)}; each traceback is above, under its [label] prefix"


def _by_error(errors: Mapping[str, str]) -> str:
    """`h0:0, h1:1 raised ValueError: bad; h0:1 raised MemoryError`: the processes that raised one error together."""
    by_error: dict[str, list[str]] = {}
    for label, error in errors.items():
        by_error.setdefault(error, []).append(label)
    return "; ".join(f"{', '.join(labels)} raised {error}" for error, labels in by_error.items())


def warm_interpreter(python: str = sys.executable) -> WarmServer:
    """A warm interpreter for `Cluster`s and agents: started with the ranks' environment (their malloc tunables)."""
    return WarmServer(with_tunables(os.environ, "rank"), python)


def end_groups(procs: Sequence[subprocess.Popen | WarmProcess]) -> None:
    """SIGTERM the process group of each live one of `procs`, wait up to TERM_GRACE_S, then SIGKILL every
    group (also of one that already exited: it may have left grandchildren) and reap all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        signal_group(p, signal.SIGKILL)
        p.wait()


def signal_group(proc: subprocess.Popen | WarmProcess, sig: int) -> None:
    """Send `sig` to the process group `proc` leads (children run with start_new_session)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_cluster(cluster: Cluster) -> int:
    """Run `cluster` to the end with Ctrl-C / SIGTERM tearing everything down; returns an exit status."""
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster.start()
        return cluster.wait()
    except KeyboardInterrupt:
        print("flodl-zmq launch: interrupted; stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        # Block further signals' handler from interrupting the teardown itself.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        cluster.shutdown()
        for s, handler in previous.items():
            signal.signal(s, handler)


def parse_slow(items: Sequence[str]) -> dict[int, float]:
    """`["3:3.0"]` -> {3: 3.0}."""
    out = {}
    for item in items:
        rank, sep, factor = item.partition(":")
        try:
            out[int(rank)] = float(factor) if sep else 3.0
        except ValueError:
            raise ConfigError(f"--slow {item!r} must be RANK:FACTOR, e.g. 3:3") from None
    return out


def default_sink(line: str) -> None:
    print(line, flush=True)


# --------------------------------------------------------------------------- command line


def _launch_command(args: argparse.Namespace) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("launch needs a script to run: flodl-zmq launch [options] script.py [args]")
    check_target(argv, "launch")
    cluster = Cluster(
        argv=argv, hosts=args.hosts, ranks_per_host=args.ranks_per_host, port=args.port,
        slow=parse_slow(args.slow), sink=default_sink, run_dir=args.run_dir, metrics_port=args.metrics_port,
        shards=args.shards,
    )
    return run_cluster(cluster)


def _demo_command(args: argparse.Namespace) -> int:
    from flodl_zmq import demo
    from flodl_zmq.runlog import default_run_dir
    from flodl_zmq.runreport import write_report

    world = 4
    result: dict | None = None
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir()
    # The single-process baseline, built first: its Trainer checks --epochs before any process starts.
    # It keeps its own log beside the cluster's.
    alone = demo.trainer(args.epochs, args.mode, quiet=True, run_dir=str(run_dir / "single-process"))
    argv = ["-m", "flodl_zmq.demo", "--epochs", str(args.epochs), "--mode", args.mode]
    if args.json:
        argv.append("--quiet")
    cluster = Cluster(  # `--slow 1` is none; any other factor is the launcher's to check (nan, < 1)
        argv=argv, hosts=2, ranks_per_host=2, slow={world - 1: args.slow} if args.slow != 1 else {},
        sink=None if args.json else (lambda line: None if demo.RESULT_TAG in line else default_sink(line)),
        run_dir=str(run_dir.resolve()),
    )
    code = run_cluster(cluster)
    for line in cluster.lines:
        _, _, text = line.partition("] ")
        if text.startswith(demo.RESULT_TAG):
            result = json.loads(text[len(demo.RESULT_TAG):])
    if code != 0 or result is None:
        if args.json:
            print(cluster.output(), file=sys.stderr)
        print(f"flodl-zmq demo: the cluster run failed (controller exit status {code})", file=sys.stderr)
        return code or 1
    report = write_report(run_dir)
    alone_result = alone.run()
    figures = {
        "epochs": args.epochs,
        "mode": args.mode,
        "slow_rank": world - 1 if args.slow > 1 else None,
        "slowdown": args.slow,
        "cluster_accuracy": result["accuracy"],
        "single_process_accuracy": alone_result.final_eval,
        "batch_share": result["batch_share"],
        "cluster_wall_s": result["wall_s"],
        "single_process_wall_s": alone_result.wall_s,
        "report": str(report),
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    print()
    print(f"digits MLP, {args.epochs} epochs, 2 hosts x 2 ranks ({args.mode}), rank {world - 1} slowed {args.slow:g}x")
    print(f"  test accuracy, cluster (consensus):   {result['accuracy'] * 100:.2f}%")
    print(f"  test accuracy, one process alone:     {alone_result.final_eval * 100:.2f}%")
    print("  batch share per rank:  " + "  ".join(f"r{i} {s * 100:.1f}%" for i, s in enumerate(result["batch_share"])))
    if result["accuracy"] < alone_result.final_eval:
        print(demo.trailing_note(world, alone.job.batch_size))
    print(f"  report (open in a browser):  {report}")
    return 0


def add_commands(sub: Any) -> None:
    """Register `launch` and `demo` on the `flodl-zmq` sub-command parser."""
    launch = sub.add_parser(
        "launch", help="run controller, relays and ranks of a script as local processes",
        description="Run SCRIPT as a whole cluster on this machine (prefix output [host:rank]).",
    )
    launch.add_argument("--hosts", type=int, default=1, help="simulated hosts, one relay each (default 1)")
    launch.add_argument("--ranks-per-host", type=int, default=2, help="ranks per host (default 2)")
    launch.add_argument("--port", type=int, help="controller base port (default: a free one; uses PORT..PORT+3)")
    launch.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR",
                        help="emulate a slower rank (per-batch delay), e.g. --slow 3:3; repeatable")
    launch.add_argument("--run-dir", metavar="DIR",
                        help="the controller's run directory for events.jsonl (default: runs/TIME-ID; "
                             "Trainer(run_dir=...) wins)")
    launch.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the controller's Prometheus metrics at http://127.0.0.1:PORT/metrics "
                             "(env FLODL_METRICS_PORT; default: none)")
    launch.add_argument("--shards", type=int, default=0, metavar="N",
                        help="sharded reduction: the first N hosts' relays each reduce a slice of every round besides "
                             "the controller's reducer, on free local ports (with --port: PORT+4 .. PORT+3+2N); "
                             "FLODL_SHARDS says the same by address (default 0: one reducer)")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="script.py [args], or -- -m module [args]")
    launch.set_defaults(func=_launch_command)
    demo = sub.add_parser("demo", help="train an MLP on the packaged digits on 2 hosts x 2 ranks, one rank slowed")
    demo.add_argument("--slow", type=float, default=3.0, help="slowdown factor of rank 3 (default 3; 1 = none)")
    demo.add_argument("--epochs", type=int, default=15, help="epochs (default 15)")
    demo.add_argument("--mode", default=DEFAULT_MODE, choices=MODE_NAMES)
    demo.add_argument("--json", action="store_true", help="print only the final figures, as JSON")
    demo.add_argument("--run-dir", metavar="DIR",
                      help="where the run directory goes (events.jsonl, report.html; default: runs/TIME-ID)")
    demo.set_defaults(func=_demo_command)
