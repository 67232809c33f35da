"""The reducer: the controller's round ledger and the divide-once reduce.

``RoundLedger`` is the pure core (no sockets, no clocks); the ZeroMQ
service that feeds it is ``reducer_service.ReducerService``.

Rules the ledger keeps:

- Hosts and their global ranks are fixed at construction; every rank belongs
  to exactly one host.
- Dead-rank ledger: a death is permanent for the run and declaring it again is
  a no-op. The first declaration names the owning host, so the service forwards
  each death exactly once (the relay's fold barrier must let go of that rank).
- A host is expected in a round while any of its ranks is alive. The round
  completes when every expected host has deposited its HostFrame; a host that
  deposited and then lost its ranks stays counted, because that work was
  realized (the same rule as the relay fold).
- HostFrames arrive mass-premultiplied and already summed (the fold never
  divides). The ledger holds the round's first two frames as received. A
  round they complete is summed, divided and encoded block by block in one
  pass; otherwise they are summed in f32 into one reused image per schema
  and later frames add in place. Either way the ledger divides exactly once,
  by the total mass of exactly the frames it summed, and encodes the
  consensus in the round's dtype (bf16 rounds to nearest even) in the same
  pass. A zero-mass round is not divided: it ships mass 0 and receivers keep
  their state.
- A protocol violation (unknown host, a round id ahead of the open round,
  schema drift from the round's first frame, bad mass, another size than the
  outer optimizer's model) raises ProtocolError and changes nothing: the host
  stays expected, so the service must tear it down or have its ranks
  declared dead.
- Round id + host make a frame idempotent: a second frame from one host in
  the open round (a resend that crossed the original) is dropped and
  counted, never summed twice. A host whose frame of the open round is
  missing is asked for it again (`awaits`, PROTOCOL.md 10.6).
- A frame with a NaN or infinite element, with a value over the magnitude bound
  (``robust.check_magnitude``: far above the last consensus's), or with more mass than the round's
  bound for its host (the sum of its ranks' bounds, given by the coordinator
  with `bound_round` before the round's first frame can arrive), raises
  PoisonedDeposit (MassOverBound for the mass) and changes nothing (a frame held for the sum, found by the
  pass that sums it, is listed in ``refused`` and the round computed without
  it): one host must not NaN or dominate the consensus. A round with no bound given is not capped. Bounds of one round
  add up rank by rank (the larger wins): a deposit told ahead brings its
  rank's bound with its plan, the trigger every rank's.
- A round whose deposits were told ahead (PROTOCOL.md 10.1) is published only
  once its trigger opened it (`bound_round(..., opens=True)`): its frames may
  all arrive before the coordinator has seen the window end, and a consensus
  published then would reach ranks whose round the coordinator does not know.
- A frame for a finished round, or from a host whose ranks are all dead, is
  dropped and counted.
- Under a robust aggregation (``aggregation`` median or trimmed_mean) the
  relays ship each rank's deposit as its own frame, so a round's members are
  ranks: it waits for every live rank, keeps every frame whole (each checked
  on arrival), and publishes ``robust.combine`` of the ranks' models; the
  divide-once sum is the mean's alone. The mass checks stay per frame.
- A round is never dropped silently: if no host is expected any more, the
  ledger reports the open round as Abandoned with the reason.
- With an outer optimizer (flodl_zmq/outer.py), the divided average is
  stepped into the next global model before it is published or kept; a
  zero-mass round is not stepped (there is no average).
- The latest consensus stays available for point-to-point recovery (a relay
  that missed the broadcast asks for it by round id). Its tensors live in
  buffers reused only when the next round with the same schema completes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flodl_zmq.errors import MassOverBound, ProtocolError
from flodl_zmq.fold import (
    ImageCache,
    OpenRound,
    Schema,
    Sending,
    SumImage,
    carve,
    contribute,
    round_gate,
)
from flodl_zmq.outer import OuterOptimizer, outer_from_start
from flodl_zmq.robust import MagnitudeBound, combine
from flodl_zmq.settings import AGGREGATIONS
from flodl_zmq.tensors import DTYPES
from flodl_zmq.wire.records import HostFrame, ShardStart

_AGAIN = object()  # _settle_once refused a frame: settle the round again without it


@dataclass(frozen=True, eq=False)
class Reduced:
    """A round's consensus: broadcast ``tensors`` with ``mass`` (0 means keep local state).

    ``masses``: each of ``hosts``' part of the mass, in that order (a host whose ranks trained
    nothing in the round deposits 0).
    """

    round_id: int
    mass: float
    hosts: tuple[str, ...]
    tensors: tuple[np.ndarray, ...]
    masses: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()  # whose deposits it holds, as its hosts' frames named them


@dataclass(frozen=True)
class Abandoned:
    """No host is expected any more; ``round_id`` is None when no round was open."""

    round_id: int | None
    reason: str


@dataclass(frozen=True)
class Gone:
    """A recovery request the ledger cannot serve; ``latest`` is the round it can resend, if any."""

    round_id: int
    latest: int | None
    reason: str


@dataclass(frozen=True)
class Declared:
    """Result of a death: where to forward DeclareDead (None: already forwarded) and any round outcome."""

    rank: int
    forward_to: str | None
    outcome: Reduced | Abandoned | None


@dataclass
class LedgerCounters:
    """Ledger instrumentation (monotonic)."""

    frames: int = 0
    late_drops: int = 0
    duplicate_drops: int = 0
    dead_host_drops: int = 0
    rounds_reduced: int = 0
    rounds_abandoned: int = 0
    bytes_reduced: int = 0


def _consensus_outputs(schema: Schema) -> tuple[SumImage, list[np.ndarray]]:
    image = SumImage(schema)
    per_dtype = {dt: iter(carve([s for d, s in schema if d == dt], DTYPES[dt])[1]) for dt in {d for d, _ in schema}}
    return image, [next(per_dtype[dt]) for dt, _ in schema]


class RoundLedger:
    """Round bookkeeping and the reduce for one run: HostFrames and deaths in, outcomes out.

    Feed ``deposit`` with each authenticated HostFrame and ``declare_dead`` with
    every death the coordinator or a relay reports. Either returns a Reduced to
    broadcast when it completes the round, an Abandoned when no host is left,
    or nothing yet.
    """

    def __init__(self, hosts: Mapping[str, Iterable[int]], outer: OuterOptimizer | None = None,
                 aggregation: str = "mean") -> None:
        if aggregation not in AGGREGATIONS:
            raise ProtocolError(f"reducer: aggregation {aggregation!r} is not one of {', '.join(AGGREGATIONS)}")
        self.outer = outer
        # Under a robust aggregation a round's members are ranks (each frame one rank's deposit), else hosts.
        self.per_rank = aggregation != "mean"
        self.aggregation = aggregation
        self.hosts: dict[str, frozenset[int]] = {}
        self._owner: dict[int, str] = {}
        for host, ranks in hosts.items():
            rs = frozenset(int(r) for r in ranks)
            if not rs:
                raise ProtocolError(
                    f"host {host!r} announced no ranks; a relay must serve at least one"
                )
            for r in rs:
                if r in self._owner:
                    raise ProtocolError(
                        f"rank {r} is announced by hosts {self._owner[r]!r} and {host!r}; "
                        "each global rank must belong to exactly one host"
                    )
                self._owner[r] = host
            self.hosts[host] = rs
        if not self.hosts:
            raise ProtocolError("a reducer needs at least one host")
        self.dead: set[int] = set()
        # Hosts refused for a poisoned frame found when the round was summed: expected no more, and
        # listed in `refused` (host, why) for the service, which declares their ranks dead.
        self.refused_hosts: set[str] = set()
        self.refused: list[tuple[str, str]] = []
        self.counters = LedgerCounters()
        self.last_round: int | None = None
        self.latest: Reduced | None = None
        self._abandoned: Abandoned | None = None
        self._all_dead_reported = False
        self._round: OpenRound | None = None
        self._frame_ranks: dict[object, frozenset[int]] = {}  # the open round's members -> the ranks they carry
        self._bounds: dict[int, dict[int, float]] = {}  # round -> rank -> most mass it may carry
        self._unopened: set[int] = set()  # rounds told ahead whose trigger has not opened them
        # The magnitude bound (robust.py): the last consensus, measured only when a frame needs it, so
        # never between a round's last frame and its publication, and not at all in an honest round.
        self._bound = MagnitudeBound()
        # Sum images and consensus buffers by schema, most recently used last; the buffers are
        # separate from the sums, so the latest consensus survives while the next round accumulates.
        self._images = ImageCache(_consensus_outputs)

    def start_at(self, round_id: int, tensors: Sequence[np.ndarray]) -> None:
        """Begin as if ``round_id`` had just been reduced to ``tensors``: a resumed world's starting consensus.

        Its ranks ask for that round before their first step (PROTOCOL.md 13), and
        ``recover`` serves it like any latest consensus; later rounds start above it.
        """
        self.last_round = int(round_id)
        self.latest = Reduced(int(round_id), 1.0, (), tuple(tensors))
        self._bound.seen(self.latest.tensors)

    @property
    def round_id(self) -> int | None:
        """The round being collected, or None between rounds."""
        return self._round.round_id if self._round else None

    def expected_hosts(self) -> frozenset[str]:
        """Hosts with at least one live rank: the ones a round waits for."""
        return frozenset(h for h, rs in self.hosts.items() if not rs <= self.dead and h not in self.refused_hosts)

    def _members_of(self, host: str) -> frozenset:
        """What a round waits for from expected ``host``: its frame, or under a robust aggregation each live rank's."""
        return self.hosts[host] - self.dead if self.per_rank else frozenset((host,))

    def _member(self, host: str, ranks: Sequence[int], who: str) -> tuple[object, frozenset[int]]:
        """The round member a frame is from, and the ranks whose work it carries."""
        if not self.per_rank:
            return host, self.hosts[host]
        if len(ranks) != 1 or ranks[0] not in self.hosts[host]:
            raise ProtocolError(f"{who}: the frame names ranks {list(ranks)}; under aggregation={self.aggregation} a "
                                "relay ships each of its ranks' deposits as its own frame (is FLODL_AGGREGATION set "
                                "alike on every host?)")
        return ranks[0], frozenset(ranks)

    def deposit(self, host: str, round_id: int, mass: float, tensors: Sequence[np.ndarray],
                ranks: Sequence[int] = ()) -> Reduced | Abandoned | None:
        """Sum one host's authenticated HostFrame for ``round_id`` (naming ``ranks``) into the round."""
        who = f"reducer: host {host!r} (round {round_id})"
        if host not in self.hosts:
            raise ProtocolError(f"{who}: unknown host; known hosts are {sorted(self.hosts)}")
        folded = frozenset(ranks) & self.hosts[host]  # whose deposits it carries, as its relay folded them
        member, ranks = self._member(host, ranks, who)
        if ranks <= self.dead or host in self.refused_hosts:
            # A frame that raced its host's last death: nobody there will load the consensus.
            self.counters.dead_host_drops += 1
            return None
        rnd = self._round
        if not round_gate(round_id, self.last_round, rnd, member, self.counters, who, ProtocolError):
            return None
        bounds = self._bounds.get(round_id)
        if bounds is not None:
            cap = sum(bounds.get(r, 0.0) for r in ranks)
            if not float(mass) <= cap:
                # Mass is the weight of a frame in the mean: a host claiming more work
                # than its ranks did would replace the consensus with its own values.
                raise MassOverBound(
                    f"{who}: mass {mass!r} exceeds {cap:g}, the most its ranks {sorted(ranks)} can have "
                    "realized this round by the coordinator's step count (a tampered or desynced host)"
                )
        if self.outer is not None and sum(t.size for t in tensors) != self.outer.global_model.size:
            # Checked before the frame is summed: the outer step must never mix two models.
            raise ProtocolError(f"{who}: the frame has {sum(t.size for t in tensors)} values, the model "
                                f"{self.outer.global_model.size} (a host built another model)")
        self._round = contribute(rnd, round_id, member, mass, tensors, self._images, who, ProtocolError,
                                 self._bound, self.per_rank)
        self._frame_ranks[member] = folded
        self.counters.frames += 1
        self.counters.bytes_reduced += sum(t.nbytes for t in tensors)
        self._note_refused(self._round)
        done = self._settle()
        if done is None and self._round is not None:
            self._round.promote(self._images)  # sum while the other hosts' frames travel
            if self._note_refused(self._round):
                done = self._settle()
        return done

    def _note_refused(self, rnd: OpenRound) -> bool:
        """Hosts ``rnd`` refused are expected no more, and listed in ``refused``; True if there were any."""
        for host, why in rnd.refused:
            self.refused_hosts.add(host)
            self.refused.append((host, why))
        got = bool(rnd.refused)
        rnd.refused.clear()
        return got

    def bound_round(self, round_id: int, bounds: Mapping[int, float], opens: bool = True) -> Reduced | Abandoned | None:
        """Cap the mass of ``round_id``'s frames: a host may carry at most the sum of its ranks' bounds.

        A rank without a bound (not in the round) contributes 0. `opens`
        False: a deposit told ahead, so the round waits for its trigger
        (`opens` True), which may complete it. Bounds of finished rounds are
        dropped.
        """
        round_id = int(round_id)
        if self.last_round is not None and round_id <= self.last_round:
            return None
        have = self._bounds.setdefault(round_id, {})
        for r, b in bounds.items():
            have[int(r)] = max(have.get(int(r), 0.0), float(b))
        for r in [r for r in self._bounds if self.last_round is not None and r <= self.last_round]:
            del self._bounds[r]  # abandoned rounds' bounds
        if not opens:
            self._unopened.add(round_id)
            return None
        self._unopened.discard(round_id)
        return self._settle() if self.round_id == round_id else None

    def declare_dead(self, rank: int) -> Declared:
        """Record ``rank``'s death (idempotent, permanent) and settle the open round."""
        host = self._owner.get(rank)
        if host is None:
            raise ProtocolError(f"reducer: DeclareDead for rank {rank}, which no host serves")
        if rank in self.dead:
            return Declared(rank, None, None)
        self.dead.add(rank)
        return Declared(rank, host, self._settle())

    def is_dead(self, rank: int) -> bool:
        """Whether ``rank`` has been declared dead."""
        return rank in self.dead

    def awaits(self, host: str, round_id: int) -> bool:
        """Whether ``host``'s frame for ``round_id`` is still wanted and not here (lost: ask for it again).

        True only for an unfinished round that is open (or not yet learned) and
        a host that is expected and has not deposited in it.
        """
        if host not in self.expected_hosts():
            return False
        if self.last_round is not None and round_id <= self.last_round:
            return False
        rnd = self._round
        return rnd is None or (rnd.round_id == round_id and not self._members_of(host) <= set(rnd.members))

    def hold(self, tensors: Sequence[np.ndarray], sending: Sending) -> None:
        """A consensus's ``tensors`` go out without a copy: later rounds reduce into other buffers until
        ``sending`` is done (fold.ImageCache.hold)."""
        self._images.hold(tensors, sending)

    def recover(self, round_id: int) -> Reduced | Gone:
        """The consensus of ``round_id`` if it is the latest one, else why it is not available."""
        latest = self.latest
        if latest is not None and latest.round_id == round_id:
            return latest
        latest_id = latest.round_id if latest else None
        if self._abandoned is not None and self._abandoned.round_id == round_id:
            reason = f"round {round_id} was abandoned: {self._abandoned.reason}"
        elif latest_id is not None and round_id < latest_id:
            reason = f"round {round_id} was superseded by round {latest_id}"
        else:
            reason = f"round {round_id} has not been reduced yet"
        return Gone(round_id, latest_id, reason)

    def _settle(self) -> Reduced | Abandoned | None:
        """Complete or abandon the open round if the live hosts allow it."""
        while True:
            done = self._settle_once()
            if done is not _AGAIN:
                return done  # type: ignore[return-value]

    def _settle_once(self) -> Reduced | Abandoned | None | object:
        expected = self.expected_hosts()
        rnd = self._round
        if not expected:
            if rnd is None and self._all_dead_reported:
                return None
            self._all_dead_reported = True
            self._round = None
            self._frame_ranks.clear()
            out = Abandoned(
                rnd.round_id if rnd else None,
                f"every rank of every host {sorted(self.hosts)} is dead",
            )
            if rnd is not None:
                self.last_round = rnd.round_id
                self._abandoned = out
                self.counters.rounds_abandoned += 1
            return out
        if rnd is None or rnd.round_id in self._unopened:
            return None
        if not frozenset().union(*map(self._members_of, expected)) <= set(rnd.members):
            return None
        image, outputs = self._images.get(rnd.schema)
        if rnd.keep:  # a robust aggregation: each rank's model, checked on arrival, combined coordinate-wise
            combine(rnd.held, rnd.masses, self.aggregation, outputs)
            return self._publish(rnd, outputs, rnd.mass if rnd.mass > 0.0 else None)
        # The one divide of the whole reduce: by the mass of exactly the frames summed.
        divisor = rnd.mass if rnd.mass > 0.0 else None
        # Held frames are checked by the pass that sums them (a frame over the magnitude bound, or a
        # non-finite sum's culprit, is refused and the round computed again without it); later ones
        # were checked before their add.
        if len(rnd.held) == 2 and rnd.judge(image.encode_sum_into(*rnd.held, outputs, divisor)) or \
                len(rnd.held) == 1 and rnd.judge(image.fill(rnd.held[0])):  # one host: its frame was never copied
            self._note_refused(rnd)
            return _AGAIN
        if len(rnd.held) != 2:
            image.encode_into(outputs, divisor)
        return self._publish(rnd, outputs, divisor)

    def _publish(self, rnd: OpenRound, outputs: list[np.ndarray], divisor: float | None) -> Reduced:
        """Close ``rnd`` with its average in ``outputs`` (None ``divisor``: nothing was realized)."""
        self._round = None
        self.last_round = rnd.round_id
        for r in [r for r in self._bounds if r <= rnd.round_id]:
            del self._bounds[r]
        self._unopened = {r for r in self._unopened if r > rnd.round_id}
        if self.outer is not None and divisor is not None:
            self.outer.step(outputs)
        by_host: dict[str, float] = {}
        for member, mass in zip(rnd.members, rnd.masses, strict=True):
            host = self._owner[member] if self.per_rank else member
            by_host[host] = by_host.get(host, 0.0) + mass
        hosts = tuple(sorted(by_host))
        ranks = frozenset().union(*(self._frame_ranks.get(m, ()) for m in rnd.members))
        self._frame_ranks.clear()
        self.latest = Reduced(rnd.round_id, rnd.mass, hosts, tuple(outputs), tuple(by_host[h] for h in hosts),
                              tuple(sorted(ranks)))
        if divisor is not None:  # a zero-mass round leaves every model as it was
            self._bound.seen(self.latest.tensors)
        self.counters.rounds_reduced += 1
        return self.latest


class StartGate:
    """A host shard's wait for its start (PROTOCOL.md 10.9 item 11): it sums no frame before it holds the
    start, and keeps those that come first, a resend replacing the copy it repeats (same host, ranks, round).

    A core: the service hands it what comes, and sums what `open` returns.
    """

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.started = shard == 0  # the controller's reducer starts from the run itself
        self.held: list[tuple[str, HostFrame, list[Any]]] = []

    def hold(self, host: str, frame: HostFrame, payload: list[Any]) -> None:
        """Keep `host`'s frame until the start: a resend replaces the copy it repeats."""
        self.held = [e for e in self.held if (e[0], e[1].ranks, e[1].round) != (host, frame.ranks, frame.round)]
        self.held.append((host, frame, payload))

    def open(self, start: ShardStart, payload: Sequence[np.ndarray]) -> OuterOptimizer | None:
        """Take `start`: the outer step over this shard's slice it names (None: no outer step); a ProtocolError
        for a start of another shard, or one whose fields or frames are not as the spec says."""
        who = f"reducer shard {self.shard}"
        if start.shard != self.shard:
            raise ProtocolError(f"{who}: the controller's reducer sent the start of shard {start.shard}: the two "
                                "hold different shard maps; give every process the same FLODL_SHARDS")
        outer = None
        if start.outer != "none":
            outer = outer_from_start(start, payload, who)
        elif payload:
            raise ProtocolError(f"{who}: a start without an outer step came with {len(payload)} payload frames")
        self.started = True
        return outer
