"""The join rules: who may join the run, which global ranks they get, when the world forms, which hosts still live.

A pure core (no sockets, threads or clocks: every `now` is an argument on
one monotonic clock the caller owns); `membership.MembershipService` is the
ZeroMQ shell that feeds it decoded records. `JoinWindow` admits or refuses
each `JoinHello`, hands out global ranks and gives the formation verdict;
`Challenges` keeps the nonces that make each pre-admission exchange fresh;
`ReformGate` says when hosts admitted mid-run enter the world
(host_links.py keeps the admitted hosts' liveness).

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
  checks, plus `max_ranks` and `max_pending_hosts` (at most that many wait
  at once, so strangers' hellos cannot pile up), admit it as *pending*; it
  enters the world when the controller re-forms it (`reform`), at the next
  round or, under Sync, the next epoch boundary (`ReformGate`). Rank
  numbers are never reused: a joiner's ranks follow the highest ever given,
  and a host that left (`depart`) and comes back gets fresh ones. A host
  whose ranks have all exited is no duplicate either: its agent tore them
  down (it lost the controller for a while) and comes back the same way.
- **A challenge is used once** (PROTOCOL.md 10.4): a nonce is issued to one
  connection, good for one hello or status request within `CHALLENGE_TTL_S`,
  and at most `JOIN_CHALLENGE_CAP` are outstanding (the oldest forgotten
  first), so a recorded hello replayed later finds its nonce unknown.
"""

from __future__ import annotations

import enum
import hmac
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from flodl_zmq.errors import ConfigError, MembershipError
from flodl_zmq.formation import rank_space
from flodl_zmq.settings import DEFAULTS
from flodl_zmq.wire import PROTOCOL_VERSION
from flodl_zmq.wire.codec import MAX_SENDER_CHARS
from flodl_zmq.wire.records import Challenge, ChallengeRequest, JoinHello

# Challenge nonces (PROTOCOL.md 10.4): 16 random bytes, good for one hello or status request
# from the connection they were issued to, within CHALLENGE_TTL_S. At most JOIN_CHALLENGE_CAP
# are outstanding (one per connection; the oldest is forgotten first), so strangers asking
# from fresh routing ids cannot grow the controller's memory.
CHALLENGE_NONCE_BYTES = 16
CHALLENGE_TTL_S = 30.0
JOIN_CHALLENGE_CAP = 4096
# A hello offering more devices than any real machine has is an attack or a bug;
# refusing it keeps one joiner from claiming the whole rank space.
MAX_DEVICES_PER_HOST = 256
# A host's relay signs as `relay:<host>` (links.relay_sender), and a sender name holds at most
# MAX_SENDER_CHARS: a longer host name would be admitted with a relay whose every record is refused.
MAX_HOST_CHARS = MAX_SENDER_CHARS - len("relay:")
# How a refusal of a host that is already a member begins: an agent re-dialling after its link
# was cut retries it until the controller declares its old link lost (agent_rules.worth_redialling).
DUPLICATE_JOIN = "duplicate join"


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
    `join_window_s`: how long the window stays open once quorum is met early.
    `join_cap_s`: the hard limit; without quorum by then, the run aborts. After
    formation it is also how long a pending joiner may wait for the re-form
    that takes it in (its `formation_wait_s`).
    `max_ranks`: the most ranks the world may grow to (None: no cap).
    `max_pending_hosts`: the most hosts admitted after formation that may wait
    for the next re-form at once.
    """

    min_ranks: int = 2
    target_ranks: int | None = None
    join_window_s: float = DEFAULTS.join_window_s
    join_cap_s: float = DEFAULTS.effective_join_cap_s
    max_ranks: int | None = None
    max_pending_hosts: int = DEFAULTS.max_pending_hosts

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
        if not self.join_window_s >= 0:
            raise ConfigError(f"join window must be >= 0 seconds (got {self.join_window_s})")
        if not self.join_cap_s >= self.join_window_s:
            raise ConfigError(
                f"join cap ({self.join_cap_s} s) must be >= the join window ({self.join_window_s} s): "
                "the cap is the hard limit that bounds the window"
            )


# --------------------------------------------------------------------------- the window


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


class WindowPhase(str, enum.Enum):
    """Where the join window stands (its value is what status shows); the later rank handshake has its own,
    `formation.FormationPhase`."""

    OPEN = "open"
    FORMED = "formed"
    FAILED = "failed"


@dataclass(frozen=True)
class JoinVerdict:
    """The join window's outcome: its phase, why, and the members it admitted."""

    phase: WindowPhase
    reason: str
    members: tuple[Member, ...] = ()

    @property
    def world_size(self) -> int:
        """The rank space (a restarted run's world may hold vacancies, `environment.parse_world`)."""
        return rank_space({m.host: m.ranks for m in self.members})


def _prefix(sig: bytes) -> str:
    return sig[:4].hex() + "…"


def _malformed(hello: JoinHello, protocol: int) -> str | None:
    """What is wrong with `hello` itself (its version, host name or devices), or None."""
    host, devices = hello.host, hello.devices
    if hello.protocol != protocol:
        return (
            f"protocol version skew: worker {host!r} speaks {hello.protocol}, the controller "
            f"speaks {protocol}; install the same flodl-zmq version on every host"
        )
    # The world travels as `HOST=RANK,...;...` (environment.format_world): a name holding `=` or `;`,
    # or one the parse would strip, would make every host's agent refuse the formed world.
    if (not host or host != host.strip() or len(host) > MAX_HOST_CHARS or not host.isprintable()
            or "=" in host or ";" in host):
        return (
            f"invalid host name {host!r}: give each worker a printable name of at most {MAX_HOST_CHARS} "
            "characters, without '=', ';' or surrounding spaces (--host)"
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
    return None


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
        self._verdict = JoinVerdict(WindowPhase.OPEN, "waiting for workers")

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
    def phase(self) -> WindowPhase:
        return self._verdict.phase

    def admit(self, hello: JoinHello, now: float, *, finished: bool = False) -> Accepted | Rejected:
        """Admit `hello` and assign its ranks, or refuse it with a reason that names the fix.

        `finished`: every rank of the host's current membership has exited (its join
        link says done). After formation such a host is no duplicate: it comes back
        as a host whose link was lost does, with fresh ranks (its old ones stay dead).
        """
        taken_back = finished and self.phase is WindowPhase.FORMED
        reason = self._refusal(hello, taken_back)
        if reason is not None:
            return Rejected(reason)
        if taken_back:
            self.depart(hello.host)
        if self.dataset_sig is None:
            self.dataset_sig = hello.dataset_sig
        if self.model_sig is None and hello.model_sig is not None:
            self.model_sig = hello.model_sig
        if self.resumed is not None and self.phase is WindowPhase.OPEN:
            ranks = self.resumed[hello.host]
        else:
            ranks = tuple(range(self._next_rank, self._next_rank + len(hello.devices)))
            self._next_rank += len(hello.devices)
        member = Member(hello.host, ranks, tuple(hello.devices), now)
        if self.phase is WindowPhase.FORMED:
            # Into the world at the next re-form (`ReformGate`); it may wait that long (bounded by the cap).
            self._pending.append(member)
            return Accepted(ranks, self.config.join_cap_s)
        self._members.append(member)
        elapsed = now - self.opened_at
        return Accepted(ranks, max(0.0, self.config.join_cap_s - elapsed))

    @property
    def last_admitted(self) -> Member:
        """The member (or pending joiner) the last `admit` accepted."""
        return self._pending[-1] if self.phase is WindowPhase.FORMED else self._members[-1]

    def depart(self, host: str) -> None:
        """`host` left (its link was lost): it may join again, with fresh ranks. Before formation its ranks are
        left vacant in the world (dead from the start, as after a re-form), never given to another."""
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
        """Take the pending joiners into the world (at the re-form `ReformGate` allows); the new world."""
        if self.phase is not WindowPhase.FORMED:
            raise MembershipError(f"cannot re-form: the window is {self.phase.value}, not formed")
        self._members.extend(self._pending)
        self._pending.clear()
        return self.world

    def _refusal(self, hello: JoinHello, taken_back: bool) -> str | None:
        """The first reason to refuse `hello`, or None: a closed window, a malformed hello, then the run's terms."""
        return (
            self._closed_refusal()
            or _malformed(hello, self.protocol)
            or self._resume_refusal(hello)
            or (None if taken_back else self._duplicate_refusal(hello))
            or self._signature_refusal(hello)
            or self._capacity_refusal(hello)
        )

    def _closed_refusal(self) -> str | None:
        if self.phase is WindowPhase.FAILED:
            return f"join window closed: the run was aborted ({self._verdict.reason})"
        if self._ended is not None:
            return f"join window closed: {self._ended}"
        return None

    def _resume_refusal(self, hello: JoinHello) -> str | None:
        """A restarted run takes back only its own hosts, each with as many devices as it had ranks."""
        if self.resumed is None or self.phase is not WindowPhase.OPEN:
            return None
        host, devices = hello.host, hello.devices
        if host not in self.resumed:
            return (
                f"host {host!r} is not part of the run this controller resumes (its checkpoint's hosts are "
                f"{sorted(self.resumed)}); a restarted run takes back only its own hosts"
            )
        if len(devices) != len(self.resumed[host]):
            return (
                f"host {host!r} rejoins with {len(devices)} device(s) but ran ranks {list(self.resumed[host])} "
                "before the restart; give it the same devices (--devices) so it gets its ranks back"
            )
        return None

    def _duplicate_refusal(self, hello: JoinHello) -> str | None:
        host = hello.host
        if any(m.host == host for m in (*self._members, *self._pending)):
            return (
                f"{DUPLICATE_JOIN}: host {host!r} is already a member and its agent still speaks (a stale "
                "worker still running, or two machines sharing one name; while the world forms, also an agent "
                "restarted before its predecessor's silence reached the controller's --host-silence); stop the "
                "old agent, give this one another --host, or retry once the old one is lost"
            )
        return None

    def _signature_refusal(self, hello: JoinHello) -> str | None:
        """A cohort training on different data or models would average nonsense silently."""
        host = hello.host
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
        return None

    def _capacity_refusal(self, hello: JoinHello) -> str | None:
        cap, host, devices = self.config.max_ranks, hello.host, hello.devices
        waiting = len(self._pending)
        if self.phase is WindowPhase.FORMED and waiting >= self.config.max_pending_hosts:
            # Each pending host is kept until the next re-form: strangers' hellos must not pile up.
            return (
                f"too many hosts waiting: {waiting} host(s) already wait to enter the world at the next "
                f"re-form, at most {self.config.max_pending_hosts} may (--max-pending-hosts); worker {host!r} "
                "may join after the next re-form, or raise --max-pending-hosts"
            )
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
        if self.phase is WindowPhase.FAILED:
            raise MembershipError(f"cannot retract {host!r}: the window is {self.phase.value}")
        group = self._pending if self.phase is WindowPhase.FORMED else self._members
        if not group or group[-1].host != host:
            raise MembershipError(f"only the most recent member can be retracted; {host!r} is not it "
                                  "(retracting another would leave a hole in the rank space)")
        gone = group.pop()
        if self.phase is WindowPhase.FORMED or self.resumed is None:  # its ranks were the newest given
            self._next_rank -= len(gone.ranks)

    def poll(self, now: float) -> JoinVerdict:
        """The verdict at `now`; once formed or failed, the same verdict forever."""
        if self.phase is not WindowPhase.OPEN:
            return self._verdict
        cfg, joined, elapsed = self.config, self.joined_ranks, now - self.opened_at
        if cfg.target_ranks is not None and joined >= cfg.target_ranks:
            return self._close(WindowPhase.FORMED, "target ranks reached")
        if elapsed < cfg.join_window_s:
            return self._verdict
        if joined >= cfg.min_ranks:
            return self._close(WindowPhase.FORMED, "join window closed with quorum")
        if elapsed < cfg.join_cap_s:
            return self._verdict
        if self.resumed is not None:  # a resumed run needs its own world back: the minimum is not a choice
            return self._close(WindowPhase.FAILED, (
                f"the resumed run's hosts {sorted(set(self.resumed) - set(self.world))} did not rejoin within the "
                f"hard cap of {cfg.join_cap_s:g} s (a resumed run takes back every host of its checkpoint's world, "
                "each with its ranks); start their agents again with the same --host and devices"))
        return self._close(WindowPhase.FAILED, (
            f"quorum not met: {joined}/{cfg.min_ranks} ranks joined within the hard cap of "
            f"{cfg.join_cap_s:g} s; start more workers, or lower the minimum ranks"))

    def next_due(self, now: float) -> float | None:
        """When `poll` next may change its verdict without a new admission; None once it is final."""
        if self.phase is not WindowPhase.OPEN:
            return None
        window_ends = self.opened_at + self.config.join_window_s
        # After the window, only an admission (quorum) or the cap closes it.
        return window_ends if now < window_ends else self.opened_at + self.config.join_cap_s

    def abort(self, reason: str) -> JoinVerdict:
        """Fail the window now (the controller is giving up); no effect once closed."""
        if self.phase is WindowPhase.OPEN:
            return self._close(WindowPhase.FAILED, reason)
        return self._verdict

    def _close(self, phase: WindowPhase, reason: str) -> JoinVerdict:
        self._verdict = JoinVerdict(phase, reason, self.members)
        return self._verdict


# --------------------------------------------------------------------------- the re-form


@dataclass
class ReformGate:
    """When the hosts admitted mid-run enter the world: the consensus a re-form starts from (PROTOCOL.md 13.1).

    A re-form resumes the larger world from a checkpoint, and a checkpoint
    holds what its consensus covers. A progressive mode's (Cadence, Async)
    records the spans of the epoch in progress, so the world re-forms at the
    first round finished after the joiner was noticed: a job of one long
    epoch takes a host within a round or two. Sync's records whole epochs
    only (a resume would train the epoch's done part again), so there the
    joiner waits for the first consensus that holds the epoch it was noticed
    in. Either waits for the evals owed (`due`). Nothing re-forms once every
    epoch is in the consensus (there is no training left to join). A failed
    re-form checkpoint is not tried again before the next epoch: the disk
    that refused it is not asked every round.
    """

    progressive: bool
    epochs: int
    _after: int | None = None  # the round (progressive) or epoch (Sync) the consensus must pass
    _floor: int = 0  # the first epoch a re-form may start in (past one whose checkpoint failed)

    def _mark(self, round: int, epoch: int) -> int:
        return round if self.progressive else epoch

    def notice(self, round: int, epoch: int) -> bool:
        """Hosts are pending while the consensus is `round` and `epoch` its first epoch not whole; True when
        this is news (the re-form point is set now)."""
        if self._after is not None or epoch >= self.epochs:
            return False
        self._after = self._mark(round, epoch)
        return True

    def due(self, round: int, epoch: int, reported: int, evals_owed: bool) -> bool:
        """Whether to re-form from the consensus of `round` (its first epoch not whole: `epoch`) while the
        run's result has a row for each epoch before `reported`. Not while they differ: between an epoch's
        row and the first consensus holding it whole, the new world would write that row again. Nor while an
        eval is owed: its answer would reach a coordinator that is gone, and the score would be lost."""
        return (self._after is not None and self._mark(round, epoch) > self._after and epoch == reported
                and not evals_owed and self._floor <= epoch < self.epochs)

    def failed(self, epoch: int) -> None:
        """The re-form checkpoint of a consensus in `epoch` could not be written: not again before the next."""
        self._floor = epoch + 1
