"""Every process-level setting: one table, one validated object, one parser.

A setting reaches a process three ways, all through this module: a flag of a
command (`flodl-zmq controller`, `agent`, `status`, `run`), a `FLODL_*` environment
variable, or, for a spawned relay or rank, the environment its launcher or
agent writes from the controller's `Settings` (`SpawnSpec.env`,
`ProcessEnv.to_environ`). The `Settings` dataclass is the table: each field
carries its row (flags, variables, default, what it bounds; `SETTINGS` lists
the rows); from it

- `add_arguments(parser, command)` gives a command its flags,
- `Settings.from_environ(environ)` reads the environment,
- `Settings.from_args(args, environ)` lays the given flags over it,
- `Settings.to_environ(scopes)` writes the variables a child reads back,

and docs/operations.md documents it row for row (tests/unit/test_settings.py
checks that they agree).

Each timing is named by what it bounds, because "heartbeat timeout" used to
mean four things:

    rank silence at the coordinator   Trainer(rank_silence_at_coordinator_s=...), a Job keyword (see job.py)
    host silence at the controller    host_silence_at_controller_s (--heartbeat-timeout of the controller)
    controller silence at an agent    controller_silence_at_agent_s (--heartbeat-timeout of the agent)
    rank silence at a relay           rank_silence_at_relay_s

Rules this module keeps:

- A value is checked when the object is built; a bad one is a `ConfigError`
  naming the setting, the value, where it came from and what is allowed.
- A flag wins over its variable; a variable's old name (an alias) still
  works, and two spellings that disagree are refused rather than one
  silently winning.
- Scopes say who reads a setting. `run`: relays and ranks of every host read
  the controller's value (shipped in the spawn spec), so a cohort never mixes
  timings. `process`: each process's own (a rank's slowdown). `command`: only
  the command that takes the flag.
- Shared definitions the job and the coordinator both need (`MaxFailure`)
  live here, below both.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from flodl_zmq.errors import ConfigError
from flodl_zmq.shards import ShardMap
from flodl_zmq.wire_format import NAMES as WIRE_FORMATS
from flodl_zmq.wire_format import WireFormat
from flodl_zmq.wire_format import named as wire_format_named

# How the reducer may combine a round's deposits (flodl_zmq/robust.py's `aggregate`).
AGGREGATIONS = ("mean", "trimmed_mean", "median")
# The Trainer's modes (flodl_zmq/job.py maps them to the coordinator's), and the default: the one
# bench/tta.py measured soonest to target (docs/benchmarks.md, "The overlapped round as the default").
MODE_NAMES = ("cpu-async", "cpu-cadence", "cpu-sync")
DEFAULT_MODE = "cpu-async"
SCOPES = ("run", "process", "command")
COMMANDS = ("controller", "agent", "status", "run")
# `flodl-zmq run` is a controller that also starts its agents: it takes every controller flag too.
TAKES = {"run": ("controller", "run")}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class MaxFailure:
    """How many rank failures end the run: `count` ranks, or `fraction` of the world.

    Build with `MaxFailure.absolute(n)` or `MaxFailure.percent(p)`; exactly one
    field is set. Clean exits are never failures.
    """

    count: int | None = None
    fraction: float | None = None

    @classmethod
    def absolute(cls, n: int) -> MaxFailure:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigError(f"max_failure absolute = {n!r}: must be an integer >= 0")
        return cls(count=n)

    @classmethod
    def percent(cls, p: float) -> MaxFailure:
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p):
            raise ConfigError(f"max_failure percent = {p!r}: must be a finite number in [0, 1]")
        # Out-of-range fractions are clamped (upstream behaviour): 1.5 means "all".
        return cls(fraction=min(1.0, max(0.0, float(p))))

    def limit(self, world_size: int) -> int:
        """Failures that trip the threshold: `count`, or ceil(fraction * world)."""
        if self.count is not None:
            return self.count
        return math.ceil((self.fraction or 0.0) * max(world_size, 0))


@dataclass(frozen=True)
class Setting:
    """One row of the table.

    `flags`/`env`: the first is the name to use, the rest are old names kept
    working. `kind`: float, int, str or bool; `optional`: None is allowed (the
    default then means "derived", said in `default_text`). `minimum`: values
    must be >= it, or > it when `strict`; `maximum`: values must be <= it.
    `commands`: the parsers that take the flags.
    """

    field: str
    default: Any
    bounds: str
    kind: type = float
    flags: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    commands: tuple[str, ...] = ()
    scope: str = "command"
    minimum: float | None = None
    strict: bool = False
    maximum: float | None = None
    optional: bool = False
    default_text: str | None = None
    metavar: str | None = None

    @property
    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return "none" if self.default is None else str(self.default)

    def format(self, value: Any) -> str:
        """The text `parse` reads back as `value`."""
        if self.kind is bool:
            return "1" if value else "0"
        return repr(float(value)) if self.kind is float else str(value)

    def describe(self) -> str:
        """How a user sets it, for error messages: `--flag / FLODL_X`."""
        names = [*self.flags[:1], *self.env[:1]]
        return " / ".join(names) if names else self.field

    def parse(self, text: str, source: str) -> Any:
        """A value from its text form (a variable or a flag named `source`)."""
        text = text.strip()
        if self.kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ConfigError(f"{source}={text!r}: {self.field} is on or off; use 1 or 0")
        if not text:
            return self.default
        if self.kind is str:
            return text
        try:
            return self.kind(text)
        except ValueError:
            what = "a whole number" if self.kind is int else "a number"
            raise ConfigError(f"{source}={text!r}: {self.field} must be {what} ({self.bounds})") from None

    def check(self, value: Any) -> None:
        if value is None:
            if self.optional or self.default is None:
                return
            raise ConfigError(f"{self.field} is required ({self.describe()})")
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is str:
            ok = isinstance(value, str)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and self.minimum is not None:
            ok = value > self.minimum if self.strict else value >= self.minimum
        if ok and self.maximum is not None:
            ok = value <= self.maximum
        if not ok:
            limits = [] if self.minimum is None else [f"{'>' if self.strict else '>='} {self.minimum:g}"]
            limits += [] if self.maximum is None else [f"<= {self.maximum:g}"]
            limit = f" {' and '.join(limits)}" if limits else ""
            kind = {float: "a finite number", int: "an integer", str: "text", bool: "on or off"}[self.kind]
            raise ConfigError(
                f"{self.field} = {value!r} is not allowed: it must be {kind}{limit} "
                f"({self.bounds}); set it with {self.describe()}"
            )


ROW = "setting"  # the key of a Settings field's metadata that holds its row


def setting(default: Any, bounds: str, **row: Any) -> Any:
    """A field of `Settings` that carries its row of the table (`Setting`: flags, variables, checks)."""
    return field(default=default, metadata={ROW: Setting("", default, bounds, **row)})


@dataclass(frozen=True)
class Settings:
    """Every process-level setting, validated; `Settings()` is the defaults.

    The class is the table: each field is one setting, with its row (`setting(...)`:
    default, what it bounds, flags, variables, scope, checks). Flags and variables
    that existed before the table keep their names and defaults.
    """

    # ---- timings that every host of a run shares (the controller's values are shipped)
    rank_heartbeat_period_s: float = setting(0.5, "how often a rank sends a heartbeat to its relay and the coordinator",
            env=("FLODL_RANK_HEARTBEAT_PERIOD",), scope="run", minimum=0.0, strict=True)
    rank_silence_at_relay_s: float = setting(1.5, "rank silence after which its relay declares it dead",
            env=("FLODL_RANK_SILENCE_AT_RELAY",), scope="run", minimum=0.0, strict=True)
    rank_first_record_at_relay_s: float = setting(60.0, "how long a relay waits for a rank's first record before "
            "declaring it dead", env=("FLODL_RANK_FIRST_RECORD_AT_RELAY",), scope="run", minimum=0.0, strict=True)
    consensus_wait_at_relay_s: float = setting(2.0, "how long a relay (or a rank) waits for a round's consensus "
            "before asking the reducer (or its relay) for it; a relay waits at least twice the shortest ship-to-consensus "
            "time of its last 3 rounds", env=("FLODL_CONSENSUS_WAIT_AT_RELAY",), scope="run", minimum=0.0,
            strict=True)
    coordinator_silence_at_rank_s: float = setting(30.0, "coordinator silence after which a rank exits",
            env=("FLODL_COORDINATOR_SILENCE_AT_RANK",), scope="run", minimum=0.0, strict=True)
    coordinator_first_contact_at_rank_s: float = setting(120.0, "how long a rank waits for the coordinator's first "
            "word before it exits", env=("FLODL_COORDINATOR_FIRST_CONTACT_AT_RANK",), scope="run", minimum=0.0,
            strict=True)
    startup_timeout_s: float = setting(120.0, "how long the controller waits for every rank's hello before failing "
            "the run", flags=("--startup-timeout",), env=("FLODL_STARTUP_TIMEOUT",), commands=("controller",),
            scope="run", minimum=0.0, strict=True)
    link_heartbeat_period_s: float = setting(1.0, "how often the two ends of every tcp:// link between the controller "
            "and a relay ping each other (ZeroMQ heartbeats; also the TCP keepalive interval)",
            env=("FLODL_LINK_HEARTBEAT_PERIOD",), scope="run", minimum=0.0, strict=True)
    link_silence_s: float = setting(8.0, "silence after which a tcp:// link between the controller and a relay is "
            "dropped and re-dialled (a flap shorter than this costs only time)", env=("FLODL_LINK_SILENCE",),
            scope="run", minimum=0.0, strict=True)
    peer_send_timeout_s: float = setting(10.0, "how long a relay waits on a peer that stops reading before that "
            "send fails (on the link to the reducer, nothing sent for this long drops every record queued; the "
            "controller's sends, its reducer's included, never wait)",
            env=("FLODL_PEER_SEND_TIMEOUT",), scope="run", minimum=0.0, strict=True)
    # ---- the run's wire format, announced to the relays (they run none of the script that names it)
    wire_dtype: str | None = setting(None, "the run's wire format, announced to every relay; the Trainer's wire_dtype "
            "must be the same, or the controller and the ranks refuse to start (none: each relay holds the run "
            "to the format of its ranks' first deposit, and the reducer refuses a host frame of another)",
            kind=str, metavar="|".join(WIRE_FORMATS), env=("FLODL_WIRE_DTYPE",), scope="run")
    # ---- the Accelerate path's epochs: the one-line change leaves no argument to say them (flodl_zmq/accelerate.py)
    accelerate_epochs: int | None = setting(None, "the epochs of a loop run through flodl_zmq.accelerate's Accelerator "
            "(its `for epoch in range(E)`): the run's epochs are fixed before the loop starts, so they must be said "
            "outside the script (none: such a script refuses to start under a role)", kind=int, metavar="E",
            env=("FLODL_ACCELERATE_EPOCHS",), scope="run", minimum=1)
    # ---- how the reducer combines the deposits; the relays must know it too (PROTOCOL.md 9.5)
    aggregation: str = setting("mean", "how the reducer combines a round's deposits: mean (the mass-weighted average), "
            "or trimmed_mean or median, coordinate-wise over each rank's model, so that one poisoning rank in four "
            "cannot move the consensus outside the honest ranks' range (relays then ship each rank's deposit "
            "unfolded); the Trainer's aggregation, if given, must be the same", kind=str,
            metavar="|".join(AGGREGATIONS), flags=("--aggregation",), env=("FLODL_AGGREGATION",),
            commands=("controller",), scope="run")
    # ---- which hosts' relays reduce a slice of each round besides the controller's reducer (flodl_zmq/shards.py)
    shards: str | None = setting(None, "sharded reduction: HOST=tcp://ADDRESS:PORT,... names the hosts whose relays "
            "each run one more reducer shard, bound at that address (its broadcast at PORT+1), so that no one link "
            "carries every host's frame; shard 0 is the controller's reducer (none: one shard, the controller's "
            "reducer)", kind=str,
            metavar="HOST=tcp://ADDRESS:PORT,...", env=("FLODL_SHARDS",), scope="run")
    # ---- the controller's consensus checkpoints (read by the controller role; PROTOCOL.md 13)
    checkpoint_dir: str | None = setting(None, "where the controller writes its periodic consensus checkpoints, keeping "
            "the last checkpoint_keep (none: no checkpoints)", kind=str, metavar="DIR", flags=("--checkpoint-dir",),
            env=("FLODL_CHECKPOINT_DIR",), commands=("controller",), scope="run")
    checkpoint_every_s: float = setting(300.0, "seconds between two checkpoints (one is also written at every epoch "
            "end); 0: only at epoch ends and every checkpoint_every_rounds", flags=("--checkpoint-every",),
            env=("FLODL_CHECKPOINT_EVERY",), commands=("controller",), scope="run", minimum=0.0)
    checkpoint_every_rounds: int = setting(0, "a checkpoint every this many averaging rounds as well (0: off)",
            kind=int, flags=("--checkpoint-every-rounds",), env=("FLODL_CHECKPOINT_EVERY_ROUNDS",),
            commands=("controller",), scope="run", minimum=0)
    resume: str | None = setting(None, "restart a killed run: a checkpoint directory (its newest checkpoint), a bundle stem, "
            "or auto (the newest checkpoint of checkpoint_dir, if any; else a fresh run; nothing, exit 0, once the run "
            "completed); only the controller reads "
            "it: the ranks load its consensus from the controller's reducer", kind=str, metavar="DIR|STEM|auto", flags=("--resume",),
            env=("FLODL_RESUME",), commands=("controller",), scope="run")
    checkpoint_keep: int = setting(3, "how many of the newest checkpoints to keep", kind=int,
            flags=("--checkpoint-keep",), env=("FLODL_CHECKPOINT_KEEP",), commands=("controller",), scope="run",
            minimum=1)
    # ---- each process's own
    slowdown: float = setting(1.0, "a rank emulates slower hardware by this factor (per-batch delay); set in an "
            "agent's environment it applies to every rank of that host", env=("FLODL_SLOWDOWN",),
            scope="process", minimum=1.0)
    run_dir: str | None = setting(None, "the run directory: events.jsonl (and report.html, `flodl-zmq report`); "
            "Trainer(run_dir=...) wins over it", kind=str, metavar="DIR", flags=("--run-dir",),
            env=("FLODL_RUN_DIR",), commands=("controller",), scope="process",
            default_text="runs/TIME-ID")
    metrics_port: int | None = setting(None, "serve the controller's Prometheus metrics at http://HOST:PORT/metrics, "
            "HOST the controller's bind host (none: no metrics)", kind=int, metavar="PORT", flags=("--metrics-port",),
            env=("FLODL_METRICS_PORT",), commands=("controller",), scope="process", minimum=1,
            maximum=65535)  # refused when the settings are read, not first by the bind
    # ---- the join link between agents and the controller
    join_heartbeat_period_s: float = setting(1.0, "how often the controller and each agent send a heartbeat on the "
            "join link", env=("FLODL_JOIN_HEARTBEAT_PERIOD",), minimum=0.0, strict=True)
    host_silence_at_controller_s: float = setting(10.0, "agent silence after which the controller declares every rank "
            "of its host dead; in a sharded run, how long its link to a host shard may stay down once dropped before "
            "the run stops", flags=("--host-silence", "--heartbeat-timeout"),
            env=("FLODL_HOST_SILENCE", "FLODL_HEARTBEAT_TIMEOUT"), commands=("controller",), scope="process",
            minimum=0.0, strict=True)  # process: `launch` hands its controller the value (a shard's silence)
    controller_silence_at_agent_s: float = setting(10.0, "controller silence after which an agent stops its host's relay "
            "and ranks (and re-dials for controller_grace_s)",
            flags=("--controller-silence", "--heartbeat-timeout"), env=("FLODL_CONTROLLER_SILENCE",),
            commands=("agent",), minimum=0.0, strict=True)
    controller_grace_s: float = setting(600.0, "how long an agent whose controller fell silent keeps re-dialling it "
            "(its ranks stopped) for a restarted controller to take it back; 0: exit at once",
            flags=("--controller-grace",), env=("FLODL_CONTROLLER_GRACE",), commands=("agent",), minimum=0.0)
    join_reply_timeout_s: float = setting(30.0, "how long an agent waits for the controller's answer to its hello",
            flags=("--join-timeout",), env=("FLODL_JOIN_TIMEOUT",), commands=("agent",), minimum=0.0, strict=True)
    status_reply_timeout_s: float = setting(5.0, "how long `status` waits for the controller's reply",
            flags=("--timeout",), env=("FLODL_STATUS_TIMEOUT",), commands=("status",), minimum=0.0, strict=True)
    # ---- the controller's join window
    bind: str | None = setting(None, "the address the controller listens on; it uses PORT..PORT+3", kind=str, metavar="HOST:PORT",
            flags=("--bind",), env=("FLODL_BIND",), commands=("controller",),
            default_text="required; `run`: this machine's address toward the first host, a free port")
    open_admission: bool = setting(False, "admit any agent that reaches the address and hand it the session key; "
            "needs CURVE (the agents pin the controller's key), refused unless the address is loopback or "
            "private, and refused together with FLODL_KEY", kind=bool,
            flags=("--open-admission",), env=("FLODL_OPEN_ADMISSION",), commands=("controller",))
    min_ranks: int = setting(2, "the fewest ranks the run may start with (at least 2: a one-rank world has nothing to "
            "average)", kind=int,
            flags=("--min-ranks",), env=("FLODL_MIN_RANKS",), commands=("controller",), minimum=2)
    target_ranks: int | None = setting(None, "form the world as soon as this many ranks joined (none: wait for the "
            "window to close)", kind=int, flags=("--target-ranks",), env=("FLODL_TARGET_RANKS",),
            commands=("controller",), minimum=2)
    max_ranks: int | None = setting(None, "the most ranks the world may grow to, hosts joining mid-run included (none: no "
            "cap); a host that would pass it is refused by name", kind=int, flags=("--max-ranks",),
            env=("FLODL_MAX_RANKS",), commands=("controller",), minimum=2)
    max_pending_hosts: int = setting(8, "the most hosts that may wait at once to enter a formed world (admitted "
            "mid-run, until the next re-form); one more is refused by name: a stranger's hellos must not grow "
            "the controller without bound", kind=int, flags=("--max-pending-hosts",), env=("FLODL_MAX_PENDING_HOSTS",),
            commands=("controller",), minimum=1)
    join_window_s: float = setting(300.0, "how long the join window stays open, from the controller's start",
            flags=("--join-window",), env=("FLODL_JOIN_WINDOW",), commands=("controller",), minimum=0.0)
    join_cap_s: float | None = setting(None, "hard limit of the join window: without the minimum ranks by then, the run "
            "aborts", flags=("--join-cap",), env=("FLODL_JOIN_CAP",), commands=("controller",), minimum=0.0,
            optional=True, default_text="2 x join_window_s")
    dataset_sig: str | None = setting(None, "the dataset signature (64 hex characters) agents announce at join; the "
            "controller's default is the first agent's", kind=str, metavar="HEX", flags=("--dataset-sig",),
            env=("FLODL_DATASET_SIG",), commands=("controller", "agent"))
    # ---- `flodl-zmq run`: the hosts it starts an agent on, and how it reaches them
    hosts: str | None = setting(None, "the hosts `run` starts an agent on over SSH: a file (one `HOST [slots=N]` a "
            "line) or a comma list (`HOST[:N],...`); N is the host's --cpu-slots", kind=str, metavar="FILE|LIST",
            flags=("--hosts",), env=("FLODL_HOSTS",), commands=("run",), default_text="required")
    ssh: str = setting("ssh -o BatchMode=yes", "the command `run` reaches a host with, as `SSH HOST COMMAND` (split "
            "like a shell would)", kind=str, metavar="COMMAND", flags=("--ssh",), env=("FLODL_SSH",),
            commands=("run",))
    curve: bool = setting(False, "`run` makes a fresh CURVE keypair for the controller and hands its public "
            "key to every agent: every link of the run encrypted, nothing to distribute by hand", kind=bool,
            flags=("--curve",), env=("FLODL_CURVE",), commands=("run",))
    # ---- where the agents and `status` find the controller, and who the agent is
    controller: str | None = setting(None, "the controller's address HOST:PORT (the one given to --bind)", kind=str, metavar="HOST:PORT",
            flags=("--controller",), env=("FLODL_CONTROLLER",), commands=("agent", "status"),
            default_text="required")
    agent_host: str | None = setting(None, "this host's name, unique in the run", kind=str, metavar="NAME", flags=("--host",),
            env=("FLODL_AGENT_HOST",), commands=("agent",), default_text="hostname")
    devices: str | None = setting(None, "devices to offer, cuda:ID or cpu:N, comma-separated", kind=str, metavar="LIST",
            flags=("--devices",), env=("FLODL_DEVICES",), commands=("agent",),
            default_text="every visible GPU, else CPU slots")
    cpu_slots: int = setting(1, "ranks to run when the host has no GPU", kind=int, flags=("--cpu-slots",),
            env=("FLODL_CPU_SLOTS",), commands=("agent",), minimum=0)
    script: str | None = setting(None, "the program this host agrees to run, SCRIPT or -m MODULE (ARGS after it pin "
            "those too); the controller's program must start with exactly these words, or the agent refuses "
            "the run", kind=str, metavar="PROGRAM", flags=("--script",), env=("FLODL_SCRIPT",),
            commands=("agent",), default_text="required")
    # ---- CURVE certificates (the keys themselves go in FLODL_CURVE_*, see security.py)
    curve_secret_file: str | None = setting(None, "this process's secret CURVE certificate; on the controller it turns "
            "CURVE on for every socket", kind=str, metavar="FILE", flags=("--curve-secret",), env=("FLODL_CURVE_SECRET_FILE",),
            commands=("controller", "agent"))
    curve_clients_dir: str | None = setting(None, "admit only the CURVE public keys of the `*.key` files in this directory "
            "(the join socket included); without it any key may ask to join, and only admitted agents' keys "
            "reach the other sockets", kind=str, metavar="DIR", flags=("--curve-clients",),
            env=("FLODL_CURVE_CLIENTS",), commands=("controller",), default_text="admitted agents' keys")
    curve_server_file: str | None = setting(None, "the controller's public CURVE certificate; turns CURVE on for every "
            "link of this host", kind=str, metavar="FILE", flags=("--curve-server",), env=("FLODL_CURVE_SERVER_FILE",),
            commands=("agent", "status"))

    def __post_init__(self) -> None:
        for s in SETTINGS:
            s.check(getattr(self, s.field))
        if self.wire_dtype is not None:
            wire_format_named(self.wire_dtype, BY_FIELD["wire_dtype"].describe())
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation {self.aggregation!r} ({BY_FIELD['aggregation'].describe()}) is not one of "
                              f"{', '.join(AGGREGATIONS)}")
        try:  # refused by name when the settings are read, not first by a relay's bind mid-start
            ShardMap.parse(self.shards)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (the setting is {BY_FIELD['shards'].describe()})") from None
        # A silence limit at or below the beat that proves life would declare live peers dead.
        for silence, period in (
            ("rank_silence_at_relay_s", "rank_heartbeat_period_s"),
            ("coordinator_silence_at_rank_s", "rank_heartbeat_period_s"),
            ("host_silence_at_controller_s", "join_heartbeat_period_s"),
            ("controller_silence_at_agent_s", "join_heartbeat_period_s"),
            ("link_silence_s", "link_heartbeat_period_s"),
        ):
            if not getattr(self, silence) > getattr(self, period):
                raise ConfigError(
                    f"{silence} ({getattr(self, silence):g} s, {BY_FIELD[silence].describe()}) must exceed "
                    f"{period} ({getattr(self, period):g} s, {BY_FIELD[period].describe()}): a peer that "
                    f"beats on time would be declared dead"
                )
        if self.target_ranks is not None and self.target_ranks < self.min_ranks:
            raise ConfigError(
                f"target_ranks ({self.target_ranks}, --target-ranks) must be >= min_ranks "
                f"({self.min_ranks}, --min-ranks)"
            )
        if self.max_ranks is not None and self.max_ranks < max(self.min_ranks, self.target_ranks or 0):
            raise ConfigError(
                f"max_ranks ({self.max_ranks}, --max-ranks) must be >= min_ranks and target_ranks: the world "
                "could never form"
            )

    @property
    def wire(self) -> WireFormat | None:
        """The run's wire format as its environment announces it (FLODL_WIRE_DTYPE), None when it does not."""
        return None if self.wire_dtype is None else wire_format_named(self.wire_dtype)

    @property
    def shard_map(self) -> ShardMap:
        """The run's reducer shards (FLODL_SHARDS): which hosts hold one, and where it binds."""
        return ShardMap.parse(self.shards)

    @property
    def effective_join_cap_s(self) -> float:
        """The join window's hard cap: `join_cap_s`, or twice the window."""
        return self.join_cap_s if self.join_cap_s is not None else 2 * self.join_window_s

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, scopes: Iterable[str] = SCOPES) -> Settings:
        """The settings of `scopes` the environment gives (unset variables, other scopes: defaults; a
        variable set but empty is refused)."""
        env = os.environ if environ is None else environ
        scopes = tuple(scopes)
        values: dict[str, Any] = {}
        for s in SETTINGS:
            if s.scope not in scopes:
                continue
            given = {name: env[name] for name in s.env if name in env}
            for name, text in given.items():
                if not text.strip():  # `FLODL_X=` is a value forgotten, not a default asked for: said, not guessed
                    raise ConfigError(f"{name} is set but empty: give it a value ({s.bounds}), or unset it "
                                      f"(`unset {name}`) for the default ({s.shown_default})")
            parsed = {name: s.parse(text, name) for name, text in given.items()}
            if len(set(map(repr, parsed.values()))) > 1:
                raise ConfigError(
                    f"{' and '.join(f'{n}={t!r}' for n, t in given.items())} disagree: they are one setting "
                    f"({s.field}, {s.bounds}); set only {s.env[0]}"
                )
            if parsed:
                values[s.field] = next(iter(parsed.values()))
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
        """The environment's settings with the flags given on the command line laid over them."""
        base = cls.from_environ(environ)
        given = {s.field: getattr(args, s.field) for s in SETTINGS if hasattr(args, s.field)}
        return replace(base, **given)

    def to_environ(self, scopes: Iterable[str] = ("run", "process")) -> dict[str, str]:
        """The variables that make `from_environ` read back this object's settings of `scopes`."""
        scopes = tuple(scopes)
        out = {}
        for s in SETTINGS:
            value = getattr(self, s.field)
            if s.scope in scopes and s.env and value is not None:
                out[s.env[0]] = s.format(value)
        return out


# The rows, in the order of the fields; `Setting.field` is the field's name.
SETTINGS: tuple[Setting, ...] = tuple(replace(f.metadata[ROW], field=f.name) for f in fields(Settings))
BY_FIELD = {s.field: s for s in SETTINGS}
# Every setting at its default: what a config object of a service defaults its timings to.
DEFAULTS = Settings()


def env_names(scopes: Iterable[str]) -> tuple[str, ...]:
    """Every variable (old names too) of the settings of `scopes`."""
    scopes = tuple(scopes)
    return tuple(name for s in SETTINGS if s.scope in scopes for name in s.env)


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Give `parser` the flags of every setting `command` takes.

    A flag that is not given leaves no attribute (argparse.SUPPRESS), so
    `Settings.from_args` tells "given" from "default" and the variable, when
    set, applies.
    """
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    takes = TAKES.get(command, (command,))
    for s in SETTINGS:
        if not any(c in s.commands for c in takes):
            continue
        # Old flag names are kept working; the agent's and the controller's --heartbeat-timeout
        # are the same old spelling for two different limits, so each command takes only its own.
        help_text = f"{s.bounds} (env {s.env[0]}; default {s.shown_default})" if s.env else \
            f"{s.bounds} (default {s.shown_default})"
        if len(s.flags) > 1:
            help_text += f"; {', '.join(s.flags[1:])} is its old name"
        common: dict[str, Any] = {"dest": s.field, "default": argparse.SUPPRESS, "help": help_text}
        if s.kind is bool:
            parser.add_argument(*s.flags, action="store_true", **common)
        else:
            parser.add_argument(*s.flags, type=_flag_type(s), metavar=_metavar(s), **common)


def _flag_type(s: Setting) -> Any:
    def parse(text: str) -> Any:
        try:
            return s.parse(text, s.flags[0])
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = s.kind.__name__
    return parse


def _metavar(s: Setting) -> str:
    if s.metavar is not None:
        return s.metavar
    if s.kind is float:
        return "S" if s.field.endswith("_s") else "X"
    return "N" if s.kind is int else s.field.split("_")[-1].upper()
