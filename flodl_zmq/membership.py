"""The join window: who may join the run, which global ranks they get, and when the world forms.

A worker host's agent dials the controller's join ROUTER and sends one
`JoinHello` (host name, the devices it offers, its dataset and model
signatures, its protocol version). The window admits or refuses it, hands out
global ranks, and decides over time whether the world forms or the run
aborts. `JoinWindow` is the pure core (inputs in, verdicts out, the time is
always an argument); `MembershipService` is the thin ZeroMQ shell around it.

Rules the core keeps:

- **A bad joiner condemns only its own attempt.** A refused hello changes no
  state and burns no rank ids; the window stays open for honest hosts. Every
  refusal reason names the fix, because it is read in the log of a machine
  the operator may not be looking at.
- **Ranks are contiguous, in admission order.** Host `a` with 1 device gets
  [0], then `b` with 2 gets [1, 2]. Only the most recent admission can be
  rolled back (`retract_last`, used when the accept could not be sent), so
  the rank space never has holes.
- **First member seeds.** The dataset and model signatures are compared with
  the controller's when it has one, else with the first admitted member's:
  a cohort training on different data would average nonsense silently.
- **Verdicts, in order.** Target ranks reached: form now. Before the window
  elapses: stay open, even with quorum (more capacity is never refused while
  the clock runs). After it, with quorum: form. Before the hard cap: stay
  open (the first moment quorum is met, it forms). At the cap: fail, naming
  how many ranks came. A verdict other than open is final.
- **After formation a host may still join** (PROTOCOL.md 13.1): the same
  checks, plus `max_ranks`, admit it as *pending*; it enters the world when
  the controller re-forms it at the next epoch boundary (`reform`). Rank
  numbers are never reused: a joiner's ranks follow the highest ever given,
  and a host that left (`depart`) and comes back gets fresh ones. A host
  whose ranks have all exited is no duplicate either: its agent tore them
  down (it lost the controller for a while) and comes back the same way.

Trust modes (`TrustMode`):

- **Pre-shared key.** Every join frame is keyed with the run's session key
  from the first byte. A hello that fails its MAC is dropped without a reply,
  so a stranger learns nothing, not even that a controller listens.
- **Open admission.** Pre-admission frames (hello, accept, reject) are keyed
  with the well-known all-zero key, so the MAC proves nothing; the accept
  delivers the session key, which keys everything after it. It therefore
  needs CURVE (refused without it): the agents pin the controller's public
  key, so only the controller can answer a hello, and the accept with its
  session key travels encrypted. Anyone who can reach the port can join, so
  open admission is refused unless the join endpoint is bound to a loopback
  or private address, and it always logs a warning.

Pre-admission frames carry the all-zero run id (`JOIN_RUN_ID`): a joiner does
not know the run yet. So each exchange is made fresh by a challenge
(PROTOCOL.md 10.4): the joiner (or a status client) asks with
`join.challenge_request`, gets a random nonce issued to its connection
(`Challenges`: used once, 30 s, capped), and signs it into its hello or status
request; a recorded one replayed later finds its nonce unknown and is dropped
without a reply. Nothing is answered before a message's MAC verifies, not
even a version skew. The accept names the run id, and every later frame on
the link (world formed, rank exits, heartbeats, abort) carries it with the
session key, so a frame recorded in an earlier run that used the same
pre-shared key cannot tear down a host of this one.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq

from flodl_zmq.endpoints import is_private_address, tcp_host
from flodl_zmq.environment import format_world, parse_world
from flodl_zmq.errors import ConfigError, MembershipError, VersionError, WireError
from flodl_zmq.formation import rank_space
from flodl_zmq.io_threads import keep_off_the_data_plane
from flodl_zmq.links import CONTROL_MAX_FRAME_BYTES, JOIN_MAX_FRAMES, drain, limit_receive
from flodl_zmq.mailbox import Mailbox, poll_ms
from flodl_zmq.security import JOIN_ZAP_DOMAIN, CleartextWarner, CurveGate, CurveKeys, apply_server
from flodl_zmq.settings import Settings
from flodl_zmq.wire import KEY_BYTES, PROTOCOL_VERSION, RUN_ID_BYTES, Attribution, Channel, Codec
from flodl_zmq.wire.records import (
    Abort,
    Challenge,
    ChallengeRequest,
    JoinAccept,
    JoinHeartbeat,
    JoinHello,
    JoinReject,
    RankExited,
    StatusReply,
    StatusRequest,
    WorldFormed,
)

DEFAULTS = Settings()  # the service's timings default to the settings table
log = logging.getLogger(__name__)

JOIN_RUN_ID = bytes(RUN_ID_BYTES)
# Replay-ledger entries the join codec keeps before admission (one per connection seen):
# under open admission anyone may hello from fresh routing ids, and without a cap each
# one would grow the controller's memory for the rest of the run (~1 kB apiece).
JOIN_LEDGER_CAP = 4096
# Challenge nonces (PROTOCOL.md 10.4): 16 random bytes, good for one hello or status request
# from the connection they were issued to, within CHALLENGE_TTL_S. At most JOIN_CHALLENGE_CAP
# are outstanding (one per connection; the oldest is forgotten first), so strangers asking
# from fresh routing ids cannot grow the controller's memory.
CHALLENGE_NONCE_BYTES = 16
CHALLENGE_TTL_S = 30.0
JOIN_CHALLENGE_CAP = 4096
# Messages the join thread reads per wake-up before it runs its timers again.
JOIN_RECV_BUDGET = 256
OPEN_JOIN_KEY = bytes(KEY_BYTES)
# A hello offering more devices than any real machine has is an attack or a bug;
# refusing it keeps one joiner from claiming the whole rank space.
MAX_DEVICES_PER_HOST = 256
MAX_HOST_CHARS = 255
SIGNATURE_BYTES = 32
# How a refusal of a host that is already a member begins: an agent re-dialling after its link
# was cut retries it until the controller declares its old link lost (agent.py).
DUPLICATE_JOIN = "duplicate join"


# --------------------------------------------------------------------------- trust


class TrustMode(str, enum.Enum):
    PRE_SHARED = "pre-shared"
    OPEN = "open"


def join_key(mode: TrustMode, session_key: bytes) -> bytes:
    """The key of pre-admission frames: the session key, or all zeros under open admission."""
    return OPEN_JOIN_KEY if mode is TrustMode.OPEN else session_key


def check_open_admission_bind(address: str) -> None:
    """Raise ConfigError unless `address` (an IP literal) is a loopback or private address.

    A wildcard bind (0.0.0.0, ::) is refused too: it listens on every
    interface, public ones included.
    """
    if not is_private_address(address):
        raise ConfigError(
            f"open admission refused on {address}: anyone who reaches that address could join the "
            "run and poison training; bind the controller to a loopback or private address, or "
            "give every host the same pre-shared key (FLODL_KEY, `flodl-zmq keygen`)"
        )


def check_open_admission_curve(curve: CurveKeys | None) -> None:
    """Raise ConfigError when open admission would run without CURVE.

    Before admission the MAC key is all zeros: without CURVE nothing tells an
    agent the real controller from anyone who answers its hello (and would
    then choose what it runs), and the session key would cross the network in
    the clear.
    """
    if curve is None:
        raise ConfigError(
            "open admission without CURVE refused: the agents could not tell this controller from an "
            "impostor, and the session key would travel in the clear; give the controller a CURVE secret "
            "(`flodl-zmq curve-keygen DIR`, then --curve-secret DIR/controller.key_secret or "
            "FLODL_CURVE_SECRET) and every agent its public key (FLODL_CURVE_SERVER), or use a pre-shared "
            "FLODL_KEY instead of --open-admission"
        )


def resolve_trust(open_admission: bool, bind_address: str) -> TrustMode:
    """The trust mode for a controller bound to `bind_address` (an IP literal)."""
    if not open_admission:
        return TrustMode.PRE_SHARED
    check_open_admission_bind(bind_address)
    log.warning(
        "open admission on %s: any host that can reach this address may join and receives the "
        "session key; use a pre-shared key (FLODL_KEY) on shared networks",
        bind_address,
    )
    return TrustMode.OPEN


# --------------------------------------------------------------------------- challenges


class Challenges:
    """The challenge nonces issued before admission: one per connection, used once, short-lived.

    `issue(ident, now)` hands a connection a fresh nonce (replacing any it
    held); `take(ident, nonce, now)` consumes it and says whether it was the
    one issued to that connection and still fresh ("ok"), issued but expired
    ("expired"), or anything else ("unknown": never issued there, already
    used, forgotten). Bounded by `cap` outstanding nonces; the oldest go first.
    """

    def __init__(self, ttl_s: float = CHALLENGE_TTL_S, cap: int | None = None):
        self.ttl_s = ttl_s
        self.cap = JOIN_CHALLENGE_CAP if cap is None else cap
        self._issued: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._issued)

    def issue(self, ident: bytes, now: float) -> bytes:
        nonce = os.urandom(CHALLENGE_NONCE_BYTES)
        self._issued.pop(ident, None)
        self._issued[ident] = (nonce, now + self.ttl_s)  # insertion order is expiry order
        while self._issued:
            _, (_, expires) = next(iter(self._issued.items()))
            if len(self._issued) <= self.cap and expires > now:
                break
            self._issued.popitem(last=False)
        return nonce

    def answer(self, ident: bytes, request: ChallengeRequest, now: float) -> Challenge | None:
        """The `join.challenge` for `request` (a fresh nonce issued to `ident`); None for a malformed one,
        which is dropped unanswered. Shared by the membership and the status server (one exchange)."""
        if len(request.nonce) != CHALLENGE_NONCE_BYTES:
            return None
        return Challenge(request.nonce, self.issue(ident, now), self.ttl_s)

    def take(self, ident: bytes, nonce: bytes, now: float) -> str:
        issued = self._issued.get(ident)
        if issued is None or len(nonce) != CHALLENGE_NONCE_BYTES or not _same(issued[0], nonce):
            return "unknown"
        del self._issued[ident]
        return "ok" if now < issued[1] else "expired"


def _same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class JoinConfig:
    """When the world forms.

    `min_ranks`: quorum, the fewest ranks the run may start with.
    `target_ranks`: form as soon as this many have joined (None: wait for the window).
    `window_s`: how long the window stays open once quorum is met early.
    `cap_s`: the hard limit; without quorum by then, the run aborts. After
    formation it is also how long a pending joiner may wait for the next
    epoch boundary (its `formation_wait_s`).
    `max_ranks`: the most ranks the world may grow to (None: no cap).
    """

    min_ranks: int = 2
    target_ranks: int | None = None
    window_s: float = 300.0
    cap_s: float = 600.0
    max_ranks: int | None = None

    def __post_init__(self) -> None:
        # A one-rank world has nothing to average: it is a single-device run.
        if self.min_ranks < 2:
            raise ConfigError(
                f"min ranks must be >= 2 (got {self.min_ranks}): a one-rank world has nothing to "
                "average; train on one device without a cluster instead"
            )
        if self.target_ranks is not None and self.target_ranks < self.min_ranks:
            raise ConfigError(
                f"target ranks ({self.target_ranks}) must be >= min ranks ({self.min_ranks})"
            )
        if not self.window_s >= 0:
            raise ConfigError(f"join window must be >= 0 seconds (got {self.window_s})")
        if not self.cap_s >= self.window_s:
            raise ConfigError(
                f"join cap ({self.cap_s} s) must be >= the join window ({self.window_s} s): "
                "the cap is the hard limit that bounds the window"
            )


# --------------------------------------------------------------------------- the window (pure)


@dataclass(frozen=True)
class Member:
    host: str
    ranks: tuple[int, ...]
    devices: tuple[str, ...]
    joined_at: float


@dataclass(frozen=True)
class Accepted:
    ranks: tuple[int, ...]
    formation_wait_s: float  # the hard-cap budget left: how long the joiner may wait for WorldFormed


@dataclass(frozen=True)
class Rejected:
    reason: str


class Phase(str, enum.Enum):
    OPEN = "open"
    FORMED = "formed"
    FAILED = "failed"


@dataclass(frozen=True)
class Verdict:
    phase: Phase
    reason: str
    members: tuple[Member, ...] = ()

    @property
    def world_size(self) -> int:
        """The rank space (a restarted run's world may hold vacancies, `environment.parse_world`)."""
        return rank_space({m.host: m.ranks for m in self.members})


def _prefix(sig: bytes) -> str:
    return sig[:4].hex() + "…"


class JoinWindow:
    """The controller's join ledger: admission, rank assignment and the formation verdict.

    `opened_at` and every `now` are seconds on one monotonic clock the caller
    owns. The controller's `dataset_sig` / `model_sig` (None: the first
    member's seeds the expectation) and `protocol` are what joiners must match.
    `resumed`: the world of the checkpoint a restarted controller continues
    (PROTOCOL.md 13): only its hosts are admitted, each with as many devices
    as it had ranks, and each gets its old ranks back (the coordinator's
    state is per rank); the caller sets the quorum to the whole world.
    """

    def __init__(
        self,
        config: JoinConfig,
        opened_at: float,
        *,
        protocol: int = PROTOCOL_VERSION,
        dataset_sig: bytes | None = None,
        model_sig: bytes | None = None,
        resumed: Mapping[str, tuple[int, ...]] | None = None,
    ):
        self.config = config
        self.resumed = None if resumed is None else {h: tuple(rs) for h, rs in resumed.items()}
        self.opened_at = opened_at
        self.protocol = protocol
        self.dataset_sig = dataset_sig
        self.model_sig = model_sig
        self._members: list[Member] = []
        self._pending: list[Member] = []  # admitted after formation: in the world from the next re-form
        self._departed: list[Member] = []  # left after formation (lost); their ranks are never given again
        self._ended: str | None = None  # why no host may join any more (the run is over)
        self._next_rank = 0 if resumed is None else 1 + max((r for rs in resumed.values() for r in rs), default=-1)
        self._verdict = Verdict(Phase.OPEN, "waiting for workers")

    @property
    def members(self) -> tuple[Member, ...]:
        return tuple(self._members)

    @property
    def pending(self) -> tuple[Member, ...]:
        """Hosts admitted after formation, waiting for the next re-form."""
        return tuple(self._pending)

    @property
    def departed(self) -> tuple[Member, ...]:
        return tuple(self._departed)

    @property
    def joined_ranks(self) -> int:
        return sum(len(m.ranks) for m in self._members)

    @property
    def world(self) -> dict[str, tuple[int, ...]]:
        return {m.host: m.ranks for m in self._members}

    @property
    def phase(self) -> Phase:
        return self._verdict.phase

    def admit(self, hello: JoinHello, now: float, *, finished: bool = False) -> Accepted | Rejected:
        """Admit `hello` and assign its ranks, or refuse it with a reason that names the fix.

        `finished`: every rank of the host's current membership has exited (its join
        link says done). After formation such a host is no duplicate: it comes back
        as a host whose link was lost does, with fresh ranks (its old ones stay dead).
        """
        taken_back = finished and self.phase is Phase.FORMED
        reason = self._refusal(hello, taken_back)
        if reason is not None:
            return Rejected(reason)
        if taken_back:
            self.depart(hello.host)
        if self.dataset_sig is None:
            self.dataset_sig = hello.dataset_sig
        if self.model_sig is None and hello.model_sig is not None:
            self.model_sig = hello.model_sig
        if self.resumed is not None and self.phase is Phase.OPEN:
            ranks = self.resumed[hello.host]
        else:
            ranks = tuple(range(self._next_rank, self._next_rank + len(hello.devices)))
            self._next_rank += len(hello.devices)
        member = Member(hello.host, ranks, tuple(hello.devices), now)
        if self.phase is Phase.FORMED:
            # Into the world at the next epoch boundary; it may wait that long (bounded by the cap).
            self._pending.append(member)
            return Accepted(ranks, self.config.cap_s)
        self._members.append(member)
        elapsed = now - self.opened_at
        return Accepted(ranks, max(0.0, self.config.cap_s - elapsed))

    @property
    def last_admitted(self) -> Member:
        """The member (or pending joiner) the last `admit` accepted."""
        return self._pending[-1] if self.phase is Phase.FORMED else self._members[-1]

    def depart(self, host: str) -> None:
        """`host` left after formation (its link was lost): it may join again, with fresh ranks."""
        for group in (self._members, self._pending):
            for m in [m for m in group if m.host == host]:
                group.remove(m)
                if group is self._members:
                    self._departed.append(m)

    def end(self, reason: str) -> tuple[Member, ...]:
        """No host may join any more (the run ended); the pending joiners, now turned away."""
        self._ended = reason
        turned_away, self._pending = tuple(self._pending), []
        return turned_away

    def reform(self) -> dict[str, tuple[int, ...]]:
        """Take the pending joiners into the world (at an epoch boundary); the new world."""
        if self.phase is not Phase.FORMED:
            raise MembershipError(f"cannot re-form: the window is {self.phase.value}, not formed")
        self._members.extend(self._pending)
        self._pending.clear()
        return self.world

    def _refusal(self, hello: JoinHello, taken_back: bool) -> str | None:
        host, devices = hello.host, hello.devices
        if self.phase is Phase.FAILED:
            return f"join window closed: the run was aborted ({self._verdict.reason})"
        if self._ended is not None:
            return f"join window closed: {self._ended}"
        if hello.protocol != self.protocol:
            return (
                f"protocol version skew: worker {host!r} speaks {hello.protocol}, the controller "
                f"speaks {self.protocol}; install the same flodl-zmq version on every host"
            )
        if not host.strip() or len(host) > MAX_HOST_CHARS or not host.isprintable():
            return (
                f"invalid host name {host!r}: give each worker a non-blank printable name of at "
                f"most {MAX_HOST_CHARS} characters (--host)"
            )
        if not devices:
            return f"worker {host!r} offers no devices: give it GPUs or CPU slots (--cpu-slots)"
        if len(devices) > MAX_DEVICES_PER_HOST:
            return (
                f"worker {host!r} offers {len(devices)} devices, more than the {MAX_DEVICES_PER_HOST} "
                "one host may run; list its devices explicitly (--devices)"
            )
        if len(set(devices)) != len(devices) or not all(d.strip() for d in devices):
            return (
                f"worker {host!r} offers a blank or repeated device in {devices[:8]}: each rank "
                "needs its own device; fix --devices"
            )
        if self.resumed is not None and self.phase is Phase.OPEN and host not in self.resumed:
            return (
                f"host {host!r} is not part of the run this controller resumes (its checkpoint's hosts are "
                f"{sorted(self.resumed)}); a restarted run takes back only its own hosts"
            )
        if self.resumed is not None and self.phase is Phase.OPEN and len(devices) != len(self.resumed[host]):
            return (
                f"host {host!r} rejoins with {len(devices)} device(s) but ran ranks {list(self.resumed[host])} "
                "before the restart; give it the same devices (--devices) so it gets its ranks back"
            )
        if not taken_back and any(m.host == host for m in (*self._members, *self._pending)):
            return (
                f"{DUPLICATE_JOIN}: host {host!r} is already a member (a stale worker still running, "
                "or two machines sharing one name); stop the old agent or give this one --host"
            )
        if self.dataset_sig is not None and hello.dataset_sig != self.dataset_sig:
            return (
                f"dataset signature mismatch: worker {host!r} has {_prefix(hello.dataset_sig)}, the "
                f"run expects {_prefix(self.dataset_sig)}; point every host at the same dataset "
                "(same files, same preprocessing)"
            )
        if (
            self.model_sig is not None
            and hello.model_sig is not None
            and hello.model_sig != self.model_sig
        ):
            return (
                f"model signature mismatch: worker {host!r} builds {_prefix(hello.model_sig)}, the "
                f"run trains {_prefix(self.model_sig)}; run the same script and version everywhere"
            )
        cap = self.config.max_ranks
        if cap is not None and self._world_ranks() + len(devices) > cap:
            return (
                f"world full: worker {host!r} offers {len(devices)} rank(s) but the world already has "
                f"{self._world_ranks()} of at most {cap} (--max-ranks); raise --max-ranks or offer fewer devices"
            )
        return None

    def _world_ranks(self) -> int:
        """Ranks in the world once the pending joiners are in (departed hosts' ranks are dead, not counted)."""
        return self.joined_ranks + sum(len(m.ranks) for m in self._pending)

    def retract_last(self, host: str) -> None:
        """Roll back the most recent admission (its accept could not be delivered)."""
        if self.phase is Phase.FAILED:
            raise MembershipError(f"cannot retract {host!r}: the window is {self.phase.value}")
        group = self._pending if self.phase is Phase.FORMED else self._members
        if not group or group[-1].host != host:
            raise MembershipError(
                f"only the most recent member can be retracted; {host!r} is not it "
                "(retracting another would leave a hole in the rank space)"
            )
        gone = group.pop()
        if self.phase is Phase.FORMED or self.resumed is None:  # its ranks were the newest given
            self._next_rank -= len(gone.ranks)

    def poll(self, now: float) -> Verdict:
        """The verdict at `now`; once formed or failed, the same verdict forever."""
        if self.phase is not Phase.OPEN:
            return self._verdict
        cfg, joined, elapsed = self.config, self.joined_ranks, now - self.opened_at
        if cfg.target_ranks is not None and joined >= cfg.target_ranks:
            return self._close(Phase.FORMED, "target ranks reached")
        if elapsed < cfg.window_s:
            return self._verdict
        if joined >= cfg.min_ranks:
            return self._close(Phase.FORMED, "join window closed with quorum")
        if elapsed < cfg.cap_s:
            return self._verdict
        return self._close(
            Phase.FAILED,
            f"quorum not met: {joined}/{cfg.min_ranks} ranks joined within the hard cap of "
            f"{cfg.cap_s:g} s; start more workers, or lower the minimum ranks",
        )

    def next_due(self, now: float) -> float | None:
        """When `poll` next may change its verdict without a new admission; None once it is final."""
        if self.phase is not Phase.OPEN:
            return None
        window_ends = self.opened_at + self.config.window_s
        # After the window, only an admission (quorum) or the cap closes it.
        return window_ends if now < window_ends else self.opened_at + self.config.cap_s

    def abort(self, reason: str) -> Verdict:
        """Fail the window now (the controller is giving up); no effect once closed."""
        if self.phase is Phase.OPEN:
            return self._close(Phase.FAILED, reason)
        return self._verdict

    def _close(self, phase: Phase, reason: str) -> Verdict:
        self._verdict = Verdict(phase, reason, self.members)
        return self._verdict


# --------------------------------------------------------------------------- host links (pure)


class HostLinks:
    """Liveness of admitted hosts' join links.

    The join link is the controller's first-hand view of a host: a rank exit
    arrives here at once (the fast path to declaring a rank dead), and a host
    whose agent falls silent for `timeout_s` is lost with every rank it had
    not reported. A host is done once every one of its ranks has exited; a
    done host is never reported lost. At a re-form (`reform`) a host's ranks
    of the incarnation before are *retiring*: their exits are expected (the
    agent stops them) and belong to no rank of the new world, which may
    reuse the same numbers on that host; the agent reports them before it
    starts the new ones, so an exit is a retiring rank's while any remains.
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ConfigError(f"host silence timeout must be > 0 seconds (got {timeout_s})")
        self.timeout_s = timeout_s
        self._heard: dict[str, float] = {}
        self._live_ranks: dict[str, set[int]] = {}
        self._retiring: dict[str, set[int]] = {}
        self._closed: set[str] = set()

    def add(self, member: Member, now: float) -> None:
        """Watch `member`'s link from `now` (a host that was lost and came back starts over)."""
        self._heard[member.host] = now
        self._live_ranks[member.host] = set(member.ranks)
        self._retiring.pop(member.host, None)
        self._closed.discard(member.host)

    def reform(self, member: Member) -> None:
        """`member`'s host runs the ranks of `member` from now on; its live ones retire first."""
        self._retiring[member.host] = self._live_ranks.get(member.host, set())
        self._live_ranks[member.host] = set(member.ranks)

    def retire(self, host: str, rank: int) -> bool:
        """True when `rank`'s exit is that of a rank retiring at a re-form (and records it)."""
        old = self._retiring.get(host)
        if not old or rank not in old:
            return False
        old.discard(rank)
        return True

    def forget(self, host: str) -> None:
        """`host` is no longer watched (a joiner turned away before it ran anything)."""
        for ledger in (self._heard, self._live_ranks, self._retiring):
            ledger.pop(host, None)

    def retiring(self) -> list[str]:
        """Hosts still stopping their ranks of the incarnation before a re-form."""
        closed = set(self._closed)  # copies: the join thread changes both while the controller's asks
        return [h for h, old in list(self._retiring.items()) if old and h not in closed]

    def heard(self, host: str, now: float) -> None:
        if host in self._heard:
            self._heard[host] = max(self._heard[host], now)

    def rank_exited(self, host: str, rank: int, now: float) -> bool:
        """Record a reported exit; True when it was the host's last live rank."""
        self.heard(host, now)
        live = self._live_ranks.get(host)
        if live is None or rank not in live:
            return False
        live.discard(rank)
        if not live:
            self._closed.add(host)
            return True
        return False

    def live_ranks(self, host: str) -> tuple[int, ...]:
        return tuple(sorted(self._live_ranks.get(host, ())))

    def state(self, host: str) -> str:
        """`live`, `done` (every rank exited) or `lost` (fell silent with ranks live)."""
        if host not in self._closed:
            return "live"
        return "lost" if self._live_ranks.get(host) else "done"

    def running(self) -> list[str]:
        """Hosts neither done nor lost (safe from another thread: reads copies)."""
        return [h for h in self._heard.copy() if h not in self._closed]

    def next_due(self) -> float | None:
        """When the quietest open host turns lost if it stays silent; None with no open host."""
        heard = [t for h, t in self._heard.items() if h not in self._closed]
        # `lost` is strict (silent for longer than the timeout): due just after.
        return math.nextafter(min(heard) + self.timeout_s, math.inf) if heard else None

    def lost(self, now: float) -> list[str]:
        """Hosts that fell silent since the last call (each reported once)."""
        out = [
            h for h, t in self._heard.items() if h not in self._closed and now - t > self.timeout_s
        ]
        self._closed.update(out)
        return out


# --------------------------------------------------------------------------- spawn artifacts


@dataclass(frozen=True)
class SpawnSpec:
    """What every admitted host runs, shipped as `WorldFormed.spawn_json`.

    `argv` follows the Python interpreter (`["train.py", "--lr", "0.1"]`,
    `["-m", "flodl_zmq", "demo"]`): the host's relay and ranks all run it,
    their role in the environment (flodl_zmq/environment.py). Every host runs
    the controller's program and arguments, not whatever it was started with,
    so a cohort cannot train different scripts. `env` is added to every
    child's environment (the run's timings, `Settings.to_environ(("run",))`;
    it never overrides a child's identity). `world` maps each host to its global ranks;
    the controller fills it in when the world forms.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    world: dict[str, tuple[int, ...]] = field(default_factory=dict)

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


# --------------------------------------------------------------------------- service (ZeroMQ)


@dataclass(frozen=True)
class RankExitReported:
    host: str
    rank: int
    code: int  # negative: killed by that signal


@dataclass(frozen=True)
class HostLost:
    host: str
    ranks: tuple[int, ...]  # the ranks it had not reported as exited


@dataclass(frozen=True)
class HostDone:
    host: str


MembershipEvent = RankExitReported | HostLost | HostDone

SENDER = "membership"


class MembershipService:
    """The join ROUTER of the controller: runs the window, then keeps the host links.

    Protocol, per agent (one DEALER each):

        agent  -> join.hello        keyed by the join key (see TrustMode)
        agent <-  join.accept       ranks, formation budget, run id (+ session key if open)
               |  join.reject       the reason; the agent exits
        agent <-  join.world_formed world size + SpawnSpec JSON, when the window forms
               |  join.abort        the reason, when it fails or the controller gives up
        agent <-> join.heartbeat    both ways from admission on
        agent  -> join.rank_exited  at once, for every rank process that ends
        client -> join.status_request  any time, keyed like a hello (`flodl-zmq status`)
        client <- join.status_reply    the cohort's state as JSON; nothing is admitted

    A pre-admission frame that fails its MAC is dropped without reply; one
    from another protocol version is refused by name (the peer cannot decode
    our reply, but its own decoder then reports the skew). Sends never
    block: an agent that cannot take a record is handled by heartbeat silence.

    Use: `start()`; `wait_closed()` returns the verdict (formed with its
    members, or failed); afterwards read `events` (rank exits, lost and done
    hosts) for the coordinator: a Mailbox (flodl_zmq.mailbox) that a loop
    polls next to its sockets, or `events.get(timeout)`;
    `report_training(snapshot)` adds the coordinator's view to status
    replies; `abort(reason)` tells every agent to tear down and returns once
    the aborts are handed to ZeroMQ; `close()` stops the thread. One thread
    owns the socket; the public methods are safe from any thread. The thread
    sleeps in poll until a frame, a command or its next timer (heartbeat,
    window, silent host); it has no polling interval. With `curve` the join socket is
    a CURVE server; without it, an agent connecting from outside loopback and
    private networks is warned about once in the log.
    """

    def __init__(
        self,
        window: JoinWindow,
        *,
        endpoint: str,
        trust: TrustMode,
        session_key: bytes,
        run_id: bytes,
        spawn: SpawnSpec,
        heartbeat_s: float = DEFAULTS.join_heartbeat_period_s,
        silence_s: float = DEFAULTS.host_silence_at_controller_s,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context | None = None,
        curve: CurveKeys | None = None,
        gate: CurveGate | None = None,
    ):
        if trust is TrustMode.OPEN:
            check_open_admission_bind(endpoint_ip(endpoint))
            check_open_admission_curve(curve)
        self.window = window
        self.trust = trust
        self.run_id = run_id
        self.spawn = spawn
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.links = HostLinks(silence_s)
        self.events: Mailbox[MembershipEvent] = Mailbox()
        self.dropped = 0  # pre-admission frames dropped unanswered (bad MAC, junk)
        self._next_beat = 0.0  # when the join thread next sends the admitted agents a heartbeat
        self._session_key = session_key
        self._join = Codec(join_key(trust, session_key), JOIN_RUN_ID, SENDER, max_ledger=JOIN_LEDGER_CAP)
        self._session = Codec(session_key, run_id, SENDER)
        self._hosts: dict[bytes, str] = {}  # ROUTER identity -> admitted host
        self._challenges = Challenges()  # the nonce each connection must sign into its hello
        # Aborts, each with the event set once its frames are handed to ZeroMQ; None wakes us to stop.
        self._commands: Mailbox[Callable[[], None] | None] = Mailbox()  # run on the join thread
        self._closed = threading.Event()
        self._stop = threading.Event()
        self._verdict: Verdict | None = None
        self._pending: tuple[Member, ...] = ()  # the window's pending joiners, swapped whole for other threads
        self.joins: list[dict[str, Any]] = []  # hosts that entered the world at a re-form (status)
        # Replaced whole by the controller's thread, read whole by ours: a reference swap needs no lock.
        self._training: dict[str, Any] | None = None
        self._curve = curve
        self._gate = gate  # learns each admitted agent's CURVE key (security.CurveGate)
        self._cleartext = CleartextWarner(log)
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        keep_off_the_data_plane(self._sock)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            apply_server(self._sock, curve)
            self._sock.zap_domain = JOIN_ZAP_DOMAIN  # a stranger's key may knock here, nowhere else
        # An agent's DEALER keeps its routing id across reconnects (see agent.py);
        # handover lets the reconnected pipe take the id over instead of being ignored.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        limit_receive(self._sock, CONTROL_MAX_FRAME_BYTES)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="flodl-membership", daemon=True)

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        self._thread.start()

    def wait_closed(self, timeout: float | None = None) -> Verdict | None:
        """The window's final verdict, or None if it is still open after `timeout` seconds."""
        self._closed.wait(timeout)
        return self._verdict

    def abort(self, reason: str, timeout: float = 5.0) -> bool:
        """Fail the window if it is open and send every admitted agent an abort.

        Returns once the service thread has handed the aborts to ZeroMQ (True),
        or after `timeout` seconds, or at once if the thread is not running (False).
        """
        sent = threading.Event()
        if not self._commands.put(lambda: self._on_abort(reason, sent)) or not self._thread.is_alive():
            return False
        return sent.wait(timeout)

    def pending(self) -> tuple[Member, ...]:
        """Hosts admitted after formation, waiting for the next epoch boundary (safe from any thread)."""
        return self._pending

    def reform(self, env: Mapping[str, str], timeout: float = 5.0) -> dict[str, tuple[int, ...]]:
        """Re-form the world with the pending joiners: send every running host and joiner the new world.

        `env` is added to the spawn spec (the checkpoint to resume, FLODL_RESUME).
        Hosts no longer running (done or lost) leave the world. Returns the new
        world once the records are handed to ZeroMQ; `wait_reformed` then says
        when every host stopped its ranks of the incarnation before.
        """
        done: list[dict[str, tuple[int, ...]]] = []
        sent = threading.Event()

        def run() -> None:
            done.append(self._on_reform(env))
            sent.set()

        if not self._commands.put(run) or not self._thread.is_alive() or not sent.wait(timeout):
            raise MembershipError("the membership service did not re-form the world: its thread is gone or stuck")
        return done[0]

    def end_joins(self, reason: str, timeout: float = 5.0) -> bool:
        """Admit nobody any more and abort the pending joiners (the run is over); True once any abort is sent."""
        sent, aborted = threading.Event(), []

        def run() -> None:
            away = {m.host for m in self.window.end(reason)}
            for ident, host in list(self._hosts.items()):
                if host in away:
                    aborted.append(self._send(ident, self._session, Abort(reason)))
                    self.links.forget(host)
                    del self._hosts[ident]
            self._pending = ()
            sent.set()

        return self._commands.put(run) and self._thread.is_alive() and sent.wait(timeout) and any(aborted)

    def wait_reformed(self, timeout: float) -> list[str]:
        """Wait until every host stopped its ranks of the incarnation before; the hosts still stopping."""
        deadline = time.monotonic() + timeout
        while self.links.retiring() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.links.retiring()

    def report_training(self, snapshot: dict[str, Any]) -> None:
        """The coordinator's current view (JSON-able), served as `training` in status replies."""
        self._training = snapshot

    def hosts_running(self) -> list[str]:
        """Admitted hosts that are neither done (every rank exited) nor lost."""
        return self.links.running()

    def status(self) -> dict[str, Any]:
        """The cohort's state, as `join.status_reply` carries it (PROTOCOL.md)."""
        verdict = self._verdict or Verdict(self.window.phase, "waiting for workers")
        out: dict[str, Any] = {
            "phase": verdict.phase.value,
            "reason": verdict.reason,
            "joined_ranks": self.window.joined_ranks,
            "hosts": {
                m.host: {"ranks": list(m.ranks), "state": self.links.state(m.host)}
                for m in self.window.members
            },
        }
        # Joins after formation, and hosts that left (a host that came back is in both).
        if self.window.pending:
            out["pending"] = {m.host: {"ranks": list(m.ranks)} for m in self.window.pending}
        if self.window.departed:
            out["departed"] = [{"host": m.host, "ranks": list(m.ranks)} for m in self.window.departed]
        if self.joins:
            out["joins"] = list(self.joins)
        if self._training is not None:
            out["training"] = self._training
        return out

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(None)  # wakes the thread out of its poll
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            # Only once the thread is gone: it polls these descriptors and owns the socket.
            self._sock.close(0)
            self._commands.close()
            self.events.close()

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._commands, zmq.POLLIN)
        commands = self._commands.fileno()
        self._next_beat = self.clock()
        while not self._stop.is_set():
            due = [self._next_beat, self.window.next_due(self.clock()), self.links.next_due()]
            events = dict(poller.poll(poll_ms(min(d for d in due if d is not None) - self.clock())))
            if self._sock in events:
                # Bounded in frames per message and in messages per wake-up, heartbeats sent
                # even mid-discard: a flood must not stall the beat the agents time out on.
                oversized = drain(
                    self._sock,
                    lambda frames: self._on_message(bytes(frames[0].bytes), frames[1:]),
                    copy=False,
                    budget=JOIN_RECV_BUDGET,
                    max_frames=JOIN_MAX_FRAMES,
                    tick=self._beat,
                )
                self.dropped += oversized  # not `+= drain(...)`: the handler counts drops too
            now = self.clock()
            if commands in events:
                for command in self._commands.drain():
                    if command is not None:
                        command()
            self._on_verdict(self.window.poll(now))
            self._beat()
            for host in self.links.lost(now):
                ranks = self.links.live_ranks(host)
                pending = any(m.host == host for m in self.window.pending)
                if self.window.phase is Phase.FORMED:
                    self.window.depart(host)  # it may join again, with fresh ranks
                    self._pending = self.window.pending
                    self._drop_connections(host)
                if pending:  # not in the world yet: nobody schedules its ranks
                    log.warning("host %r lost while waiting to join: its agent is silent", host)
                    continue
                log.warning("host %r lost: its agent is silent; ranks %s are gone", host, list(ranks))
                self.events.put(HostLost(host, ranks))

    def _drop_connections(self, host: str) -> None:
        """Forget every join connection of `host` (it left, or came back on a new one)."""
        self._hosts = {i: h for i, h in self._hosts.items() if h != host}

    def _beat(self) -> None:
        """Send every admitted agent its heartbeat if one is due."""
        now = self.clock()
        if now >= self._next_beat:
            self._next_beat = now + self.heartbeat_s
            for ident in self._hosts:
                self._send(ident, self._session, JoinHeartbeat())

    def _on_verdict(self, verdict: Verdict) -> None:
        if self._verdict is not None or verdict.phase is Phase.OPEN:
            return
        self._verdict = verdict
        if verdict.phase is Phase.FORMED:
            log.info("world formed with %d ranks (%s)", verdict.world_size, verdict.reason)
            world = {m.host: m.ranks for m in verdict.members}
            formed = WorldFormed(verdict.world_size, dataclasses.replace(self.spawn, world=world).to_json())
            for ident in self._hosts:
                self._send(ident, self._session, formed)
        else:
            log.error("join window failed: %s", verdict.reason)
            for ident in self._hosts:
                self._send(ident, self._session, Abort(verdict.reason))
        self._closed.set()

    def _on_reform(self, env: Mapping[str, str]) -> dict[str, tuple[int, ...]]:
        running = set(self.links.running())
        for m in self.window.members:
            if m.host not in running:
                self.window.depart(m.host)  # done or lost: its ranks stay dead
        joined = [m.host for m in self.window.pending]
        world = self.window.reform()
        self._pending = ()
        self.spawn = dataclasses.replace(self.spawn, env={**self.spawn.env, **env}, world=world)
        formed = WorldFormed(rank_space(world), self.spawn.to_json())
        for m in self.window.members:
            if m.host not in joined:  # a joiner has nothing to stop
                self.links.reform(m)
        for ident, host in self._hosts.items():
            if host in world:
                self._send(ident, self._session, formed)
        self.joins.extend({"host": h, "ranks": list(world[h]), "at": time.time()} for h in joined)
        log.info("world re-formed: %s (joined: %s)", world, joined)
        return world

    def _on_abort(self, reason: str, sent: threading.Event) -> None:
        verdict = self.window.abort(reason)
        if self._verdict is None:
            self._verdict = verdict
            self._closed.set()
        log.error("aborting the run on every host: %s", reason)
        for ident in self._hosts:
            self._send(ident, self._session, Abort(reason))
        sent.set()

    def _on_message(self, ident: bytes, frames: list[Any]) -> None:
        host = self._hosts.get(ident)
        if host is not None:
            self._on_member_frame(ident, host, frames)
            return
        try:
            # Before admission the hello introduces its sender; its numbers are kept per connection.
            env = self._join.decode_from(frames, Channel.JOIN, Attribution.anyone("a join link", scope=ident.hex()))
        except VersionError as exc:
            # The version is read before the MAC: answer only a sender who holds the key,
            # or a stranger would get a reject signed with it (PROTOCOL.md 10.4).
            if not self._join.authentic(frames):
                self.dropped += 1
                log.warning("join frame of another protocol version dropped without reply: its MAC does not verify")
                return
            log.warning("join refused, protocol version skew: %s", exc)
            self._send(ident, self._join, JoinReject(f"protocol version skew: {exc}", b""))
            return
        except WireError as exc:
            # Under a pre-shared key this is how a stranger's hello looks: no reply at all.
            self.dropped += 1
            log.warning("join frame dropped without reply: %s", exc)
            return
        hello = env.record
        now = self.clock()
        if isinstance(hello, ChallengeRequest):
            challenge = self._challenges.answer(ident, hello, now)
            if challenge is None:
                self.dropped += 1
                log.warning("join.challenge_request with a %d-byte nonce dropped", len(hello.nonce))
            else:
                self._send(ident, self._join, challenge)
            return
        if not isinstance(hello, (JoinHello, StatusRequest)):
            self.dropped += 1
            log.warning("join frame dropped: %s before admission (expected a challenge request, hello or status request)", env.kind)
            return
        fresh = self._challenges.take(ident, hello.nonce, now)
        if fresh == "unknown":
            # Never issued to this connection, or used already: a replay, answered by nothing.
            self.dropped += 1
            log.warning("%s dropped without reply: its challenge nonce is unknown or used (a replay?)", env.kind)
            return
        if fresh == "expired":
            log.warning("%s refused: its challenge expired", env.kind)
            self._send(ident, self._join, JoinReject(
                f"challenge expired: the hello came more than {self._challenges.ttl_s:g} s after its challenge; "
                "retry (is the link or the agent stalled?)", hello.nonce))
            return
        if isinstance(hello, StatusRequest):
            self._send(ident, self._join, StatusReply(json.dumps(self.status()), hello.nonce))
            return
        outcome = self.window.admit(hello, now, finished=self.links.state(hello.host) == "done")
        if isinstance(outcome, Rejected):
            log.warning("join refused for %r: %s", hello.host, outcome.reason)
            self._send(ident, self._join, JoinReject(outcome.reason, hello.nonce))
            return
        key = self._session_key if self.trust is TrustMode.OPEN else None
        accept = JoinAccept(list(outcome.ranks), key, outcome.formation_wait_s, self.run_id, hello.nonce)
        if not self._send(ident, self._join, accept):
            self.window.retract_last(hello.host)
            return
        self._drop_connections(hello.host)  # a host taken back: WorldFormed and heartbeats go to the new one
        self._hosts[ident] = hello.host
        self.links.add(self.window.last_admitted, now)
        self._pending = self.window.pending
        if self._gate is not None:
            self._admit_curve_key(hello.host, frames)
        peer = _peer_address(frames)
        if peer is not None:
            self._cleartext.warn_if_cleartext(peer, encrypted=self._curve is not None)
        if self.window.phase is Phase.FORMED:
            log.info("admitted %r as ranks %s, pending: it joins the world at the next epoch boundary",
                     hello.host, list(outcome.ranks))
            return
        log.info(
            "admitted %r as ranks %s (%d/%s ranks joined)",
            hello.host,
            list(outcome.ranks),
            self.window.joined_ranks,
            self.window.config.target_ranks or f"{self.window.config.min_ranks}+",
        )

    def _admit_curve_key(self, host: str, frames: list[Any]) -> None:
        """Let the key that carried `host`'s admitted hello through the data sockets (the gate)."""
        assert self._gate is not None
        try:
            key = frames[0].get("User-Id")  # the client key the ZAP handler approved, Z85
        except (zmq.ZMQError, AttributeError, IndexError):
            key = None
        if not key:
            log.warning("host %r admitted but its CURVE key is unknown: its relay will be refused", host)
            return
        self._gate.admit(key)

    def _on_member_frame(self, ident: bytes, host: str, frames: list[Any]) -> None:
        try:
            # An admitted agent signs with the host name its hello gave.
            sender = Attribution.signed_by(host, f"host {host!r}'s join link", scope=ident.hex())
            env = self._session.decode_from(frames, Channel.JOIN, sender)
        except WireError as exc:
            log.warning("frame from host %r dropped: %s", host, exc)
            return
        now = self.clock()
        self.links.heard(host, now)
        rec = env.record
        if isinstance(rec, RankExited):
            if self.links.retire(host, rec.rank):
                log.info("host %r: rank %d of the world before the re-form stopped", host, rec.rank)
                return
            if rec.rank not in self.links.live_ranks(host):
                log.warning("host %r reported an exit of rank %d, not one of its live ranks", host, rec.rank)
                return
            log.info("host %r: rank %d exited with code %d", host, rec.rank, rec.code)
            self.events.put(RankExitReported(host, rec.rank, rec.code))
            if self.links.rank_exited(host, rec.rank, now):
                self.events.put(HostDone(host))
        elif not isinstance(rec, JoinHeartbeat):
            log.warning("host %r sent %s on its join link; ignored", host, env.kind)

    def _send(self, ident: bytes, codec: Codec, rec: Any) -> bool:
        try:
            self._sock.send_multipart([ident, *codec.encode(rec, channel=Channel.JOIN)], zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("could not send %s to an agent (its queue is full); it will time out", rec.KIND)
            return False


def _peer_address(frames: list[Any]) -> str | None:
    """The IP address a received message came from (ZeroMQ's Peer-Address metadata), if known."""
    try:
        return frames[0].get("Peer-Address")
    except (zmq.ZMQError, AttributeError, IndexError):
        return None


def endpoint_ip(endpoint: str) -> str:
    """The IP address a `tcp://host:port` endpoint binds (hostnames resolved)."""
    host = tcp_host(endpoint)
    if host is None:
        raise ConfigError(f"open admission needs a tcp:// join endpoint, got {endpoint!r}")
    if host in ("*", ""):
        return "0.0.0.0"
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except OSError as exc:
        raise ConfigError(f"cannot resolve the join endpoint host {host!r}: {exc}") from None
