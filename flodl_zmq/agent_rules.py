"""The worker agent's rules: what a host offers, what it agrees to run, what it takes from the controller.

Pure: no socket, thread, clock or process here; flodl_zmq/agent.py does the
dialling, waiting and spawning and asks these functions what to make of it.

Rules this module keeps:

- **Devices come from text, never from torch.** `nvidia-smi -L`'s output
  and `CUDA_VISIBLE_DEVICES` name the GPUs (CUDA's own reading: everything
  from the first invalid entry on is ignored); without GPUs, CPU slots. A
  child is pinned to its one device through its environment.
- **Nothing from the wire runs unchecked.** The agent runs only the program
  it was told to run locally (`--script`/FLODL_SCRIPT): the controller's
  argv must start with exactly those words, or the run is refused naming
  both. This holds in every trust mode: under a pre-shared key every worker
  holds the key, so the MAC proves "a member of the run", not "the
  controller". The spawn spec's environment may set only the run and process
  settings of flodl_zmq/settings.py (FLODL_*), with valid values; any other
  variable (LD_PRELOAD, PYTHONPATH, ...) refuses the run: dropping it would
  run with settings the controller did not mean, and it is a hostile or
  mismatched controller either way.
- **The controller's answers are checked before they are used.** An accept
  carries a session key (ours under a pre-shared key, its own under open
  admission), a run id and an incarnation id of the right size and one rank
  per device offered; a formed or re-formed world gives this host exactly the
  ranks it holds, under an incarnation id of the right size.
- **A restarted controller takes us back only into our own run.** Another
  run id is a controller started fresh: the host leaves. A refusal as a
  duplicate join is worth re-dialling (the controller has not yet declared
  our old link lost); any other refusal is final.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import CHILD_SCOPES, SpawnSpec
from flodl_zmq.errors import ConfigError, MembershipError
from flodl_zmq.formation import rank_space
from flodl_zmq.join import DUPLICATE_JOIN, MAX_DEVICES_PER_HOST
from flodl_zmq.links import HOST_TOKEN_BYTES, ROUTE_SECRET_BYTES
from flodl_zmq.security import CurveKeys
from flodl_zmq.settings import DEFAULTS, Settings, env_names
from flodl_zmq.wire import RUN_ID_BYTES
from flodl_zmq.wire.mac import check_key
from flodl_zmq.wire.records import JoinAccept, JoinReject, WorldFormed

REJOIN_BACKOFF_S = (0.5, 5.0)  # first and longest wait between two re-dials of a silent controller
# Variables of the contract that are settings, not identity: the controller's
# SpawnSpec.env sets the run's for every child, and ours (FLODL_SLOWDOWN) pass through.
TUNABLES = env_names(CHILD_SCOPES)


# --------------------------------------------------------------------------- devices


def parse_nvidia_smi(text: str) -> list[tuple[str, str]]:
    """`nvidia-smi -L` output -> [(index, uuid)]."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*GPU\s+(\d+):.*?\(UUID:\s*([^)\s]+)\)", line)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def cuda_devices(environ: Mapping[str, str], smi_output: str | None) -> list[str]:
    """The CUDA devices this host offers, as `cuda:ID` (ID as CUDA_VISIBLE_DEVICES names it).

    `smi_output` is `nvidia-smi -L`'s output, None when it is missing or
    failed (no driver: no GPUs). CUDA_VISIBLE_DEVICES, when set, restricts the
    GPUs to the ones it lists that nvidia-smi sees, by index or UUID.
    """
    gpus = parse_nvidia_smi(smi_output or "")
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [f"cuda:{index}" for index, _ in gpus]
    out = []
    for entry in (e.strip() for e in visible.split(",")):
        if any(entry == index or (len(entry) > 4 and uuid.startswith(entry)) for index, uuid in gpus):
            out.append(f"cuda:{entry}")
        else:
            break  # CUDA ignores everything from the first invalid entry on
    return out


def resolve_devices(
    explicit: list[str] | None, cpu_slots: int, environ: Mapping[str, str], smi_output: str | None
) -> tuple[str, ...]:
    """The devices to offer: `explicit`, else the CUDA devices, else `cpu_slots` CPU slots."""
    if explicit:
        bad = [d for d in explicit if not re.fullmatch(r"cuda:[\w-]+|cpu:\d+", d)]
        if bad:
            raise ConfigError(f"devices {bad} are not cuda:ID or cpu:N (e.g. --devices cuda:0,cuda:1)")
        devices = tuple(explicit)
    else:
        devices = tuple(cuda_devices(environ, smi_output)) or tuple(f"cpu:{i}" for i in range(cpu_slots))
    if not devices:
        raise ConfigError("this host has no GPUs and --cpu-slots is 0: give it at least one CPU slot")
    if len(devices) > MAX_DEVICES_PER_HOST or len(set(devices)) != len(devices):
        raise ConfigError(f"devices must be distinct and at most {MAX_DEVICES_PER_HOST}: {list(devices)[:8]}")
    return devices


def device_env(device: str) -> dict[str, str]:
    """Pin a child to its device: a rank on `cuda:ID` sees only that GPU; a CPU slot sees none."""
    kind, _, ident = device.partition(":")
    return {"CUDA_VISIBLE_DEVICES": ident if kind == "cuda" else ""}


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class AgentConfig:
    """One worker host.

    `key`: the pre-shared session key, or None for open admission (the key
    then arrives in the accept, and `curve` is required). `devices`: from
    `resolve_devices`. `curve`: CURVE client keys (`CurveKeys.for_client`),
    or None for cleartext links. `script`: the program this host agrees to
    run (`parse_script`); None refuses every run (the agent can still join).
    """

    controller: ControllerAddress
    host: str
    devices: tuple[str, ...]
    key: bytes | None = None
    dataset_sig: bytes = bytes(32)
    model_sig: bytes | None = None
    join_reply_timeout_s: float = DEFAULTS.join_reply_timeout_s
    formation_margin_s: float = 10.0
    join_heartbeat_period_s: float = DEFAULTS.join_heartbeat_period_s
    controller_silence_at_agent_s: float = DEFAULTS.controller_silence_at_agent_s
    controller_grace_s: float = DEFAULTS.controller_grace_s
    kill_grace_s: float = 5.0
    curve: CurveKeys | None = None
    script: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.key is not None:
            check_key(self.key)
        if self.key is None and self.curve is None:
            raise ConfigError(
                "open admission without CURVE refused: nothing would tell the controller from anyone who "
                "answers our hello (and would then choose what this host runs); set FLODL_CURVE_SERVER to the "
                "controller's public key (it logs it at start; or --curve-server FILE), or give every host "
                "the same FLODL_KEY"
            )
        if self.script is not None:
            check_script(self.script)
        if not self.host.strip():
            raise ConfigError("the agent needs a host name (--host, default: this machine's hostname)")
        if len(self.dataset_sig) != 32:
            raise ConfigError("dataset signature must be 32 bytes (64 hex characters)")
        for name in ("join_reply_timeout_s", "join_heartbeat_period_s", "controller_silence_at_agent_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 (got {getattr(self, name)})")
        if self.controller_silence_at_agent_s <= self.join_heartbeat_period_s:
            raise ConfigError(
                f"controller_silence_at_agent_s ({self.controller_silence_at_agent_s}) must exceed "
                f"join_heartbeat_period_s ({self.join_heartbeat_period_s})"
            )


class NoReply(MembershipError):
    """The controller did not answer a join in time (not running, unreachable, or another key)."""


class Refused(MembershipError):
    """The controller refused the join; `reason` is its word (PROTOCOL.md `join.reject`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"join REJECTED by the controller: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class Joined:
    """An admitted host in a formed world."""

    ranks: tuple[int, ...]
    session_key: bytes
    run_id: bytes
    incarnation: bytes  # the formed world's: its relay and ranks sign and check it (PROTOCOL.md 4.1)
    world_size: int
    spawn: SpawnSpec
    host_token: bytes  # join.accept's: the relay's hello proves the host with it (FLODL_HOST_TOKEN)
    route_secret: bytes  # join.world_formed's: a shard host's relay proves every relay's hello with it, else empty


# --------------------------------------------------------------------------- what may run


def check_script(words: tuple[str, ...]) -> tuple[str, ...]:
    """`words` if they name a program the way the controller's argv does, else ConfigError."""
    ok = bool(words) and (len(words) >= 2 if words[0] in ("-m", "-c") else not words[0].startswith("-"))
    if not ok:
        raise ConfigError(
            f"--script {shlex.join(words)!r}: give the program this host runs, SCRIPT [ARGS] or -m MODULE [ARGS] "
            "(the same words the controller gets after `--`), e.g. --script='-m flodl_zmq.demo'"
        )
    return words


def parse_script(text: str) -> tuple[str, ...]:
    """The words of `--script`/FLODL_SCRIPT (shell quoting), checked."""
    try:
        return check_script(tuple(shlex.split(text)))
    except ValueError as exc:
        raise ConfigError(f"--script {text!r}: {exc}") from None


def check_spawn(spawn: SpawnSpec, script: tuple[str, ...] | None) -> None:
    """Raise MembershipError unless `spawn` asks only what this host agreed to.

    The argv must start with the local `script`'s words (the rest are the
    program's arguments, which the program itself interprets); the env may
    carry only the run/process settings (`TUNABLES`), each with a valid value.
    """
    wanted = shlex.join(spawn.argv)
    if script is None:
        raise MembershipError(
            f"run refused: the controller asks this host to run {wanted!r}, but this agent was not told "
            "what it may run; start it with --script (or FLODL_SCRIPT) naming that program"
        )
    if tuple(spawn.argv[: len(script)]) != script:
        raise MembershipError(
            f"run refused: the controller asks this host to run {wanted!r}, but this agent runs only "
            f"{shlex.join(script)!r} (--script / FLODL_SCRIPT); start both with the same program"
        )
    foreign = sorted(k for k in spawn.env if k not in TUNABLES)
    if foreign:
        raise MembershipError(
            f"run refused: the controller's spawn environment sets {foreign[:8]}, which are not settings of "
            f"flodl-zmq (allowed: {', '.join(TUNABLES)}); a controller of another version, or a hostile one"
        )
    try:
        Settings.from_environ(spawn.env, scopes=CHILD_SCOPES)
    except ConfigError as exc:
        raise MembershipError(f"run refused: the controller's spawn environment is invalid: {exc}") from None


# --------------------------------------------------------------------------- the controller's answers


def check_accept(reply: Any, config: AgentConfig) -> bytes:
    """The session key of `reply`, the controller's answer to our hello, if it admits us as we asked.

    Refused when it rejects us; MembershipError when it answers something else,
    leaves the trust mode undecided, or gives other ranks than devices offered.
    """
    if isinstance(reply, JoinReject):
        raise Refused(reply.reason)
    if not isinstance(reply, JoinAccept):
        raise MembershipError(f"expected join.accept or join.reject, got {reply.KIND}: controller bug")
    key = config.key or reply.session_key
    if key is None:
        raise MembershipError(
            "the controller admitted us without a session key: controller and worker disagree on the "
            "trust mode (give both the same FLODL_KEY, or neither)"
        )
    sizes = (len(reply.run_id), len(reply.incarnation), len(reply.host_token), len(reply.ranks))
    if sizes != (RUN_ID_BYTES, RUN_ID_BYTES, HOST_TOKEN_BYTES, len(config.devices)):
        raise MembershipError(
            f"malformed accept ({len(reply.ranks)} ranks for {len(config.devices)} devices, a {len(reply.run_id)}-byte "
            f"run id, a {len(reply.incarnation)}-byte incarnation id, a {len(reply.host_token)}-byte host token): "
            "protocol violation"
        )
    return key


def check_world(formed: WorldFormed, config: AgentConfig, ranks: Sequence[int], what: str) -> SpawnSpec:
    """The spawn spec of a formed world (`what`: "formed" or "re-formed") that gives this host exactly `ranks`.

    The spec is checked (`check_spawn`) before anything of it is used; a world
    that gives this host other ranks, or whose size is not its rank space, is
    a protocol violation.
    """
    spawn = SpawnSpec.from_json(formed.spawn_json)
    check_spawn(spawn, config.script)
    given = tuple(spawn.world.get(config.host, ()))
    if len(formed.incarnation) != RUN_ID_BYTES:
        raise MembershipError(f"{what} world with a {len(formed.incarnation)}-byte incarnation id: protocol violation")
    shard = spawn.shard_map.shard_of(config.host)
    if len(formed.route_secret) != (0 if shard is None else ROUTE_SECRET_BYTES):
        raise MembershipError(f"{what} world with a {len(formed.route_secret)}-byte route secret for host "
                              f"{config.host!r}, which {'runs no' if shard is None else 'runs a'} reducer shard: "
                              "protocol violation (PROTOCOL.md 10.9)")
    if given != tuple(ranks) or formed.world_size != rank_space(spawn.world):
        raise MembershipError(
            f"{what} world {spawn.world} of size {formed.world_size} gives host {config.host!r} "
            f"ranks {list(given)}, not its {list(ranks)}: protocol violation"
        )
    return spawn


def worth_redialling(exc: NoReply | Refused) -> bool:
    """Whether a failed re-join of a silent controller is worth another try within the grace period.

    A controller that still runs may not have seen our old link go silent yet:
    it refuses us as a duplicate until it declares this host lost. Anything
    else it says is final.
    """
    return not isinstance(exc, Refused) or exc.reason.startswith(DUPLICATE_JOIN)


def may_be_declared_lost(failed: int, finished: int) -> bool:
    """Every rank of the host exited, `failed` of them non-zero and `finished` with 0: whether the controller may
    have declared this host lost, which its silence then says (and the host dials in again).

    Only when no rank finished: a rank exits 0 once the controller ended the run (a script that ends without
    training exits UNPLAYED_EXIT), and a host declared lost has its ranks declared dead. A run that ended as a
    rank of the host had failed leaves the controller gone, and its silence would read as that verdict: the
    host re-dialled for the whole grace period a controller that had finished.
    """
    return failed > 0 and finished == 0


def check_comeback(before: Joined, joined: Joined, controller: ControllerAddress) -> bool:
    """Whether a restarted controller took us back with our old ranks (False: with new ones).

    MembershipError when it came back with another run: it was started fresh,
    not with --resume, and this host has no place in it.
    """
    if joined.run_id != before.run_id:
        raise MembershipError(
            f"the controller at {controller} came back with another run ({joined.run_id.hex()[:8]}, ranks "
            f"{list(joined.ranks)}) than ours ({before.run_id.hex()[:8]}, ranks {list(before.ranks)}): it was "
            "started fresh, not with --resume; host leaves"
        )
    return joined.ranks == before.ranks
