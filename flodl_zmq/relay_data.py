"""The relay's data thread: ranks' deposits into the host fold, host frames up, the consensus down.

`relay.Relay` owns the thread and its sockets (the local data ROUTER, the
up data DEALER, the SUB) and its ServiceLoop, whose mailbox carries the
control thread's `RankGone`; a `DataPlane` serves them all. `Plane` is what both of the relay's
threads do alike. The rules the data thread keeps are stated in relay.py's
module docstring (one fold, deposits verified before they join it, nothing
lost in a reset stalls a round, consensus by reference to same-host ranks).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from flodl_zmq.errors import FoldError, PoisonedDeposit, ProtocolError, ShmError
from flodl_zmq.fold import FoldStation, HostFold, NothingToShip
from flodl_zmq.links import (
    TAG_BCAST,
    TAG_DATA,
    act_for_peer,
    decode_or_count,
    drain,
    from_reducer,
    monitor_events,
    rank_identity,
    rank_of,
    rank_sender,
    route_refusal,
    send,
    send_by_reference,
)
from flodl_zmq.reducer_messages import HostRefused, OuterSlice
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.relay_core import ConsensusWatch, HelloRetry, SendQueue
from flodl_zmq.service_loop import ServiceLoop
from flodl_zmq.shards import Assembly, Cut
from flodl_zmq.wire import Attribution, Channel, Codec, Envelope
from flodl_zmq.wire.records import (
    RESUME_ROUND,
    Consensus,
    ConsensusGone,
    ConsensusRequest,
    FrameRequest,
    HostFrame,
    OuterState,
    OuterStateRequest,
    Probe,
    RankExit,
    RelayDeclareDead,
    RelayHello,
    RelayHelloAck,
    RoundFrame,
    ShardStart,
    SubscriberReady,
)
from flodl_zmq.wire.shm import (
    Segment,
    SegmentMap,
    by_reference,
    host_owner,
    is_by_reference,
    rank_owner,
    run_dir,
    unlink_owner,
)
from flodl_zmq.wire_format import CHUNK_MAX_BYTES, Hop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankGone:
    """The control thread's word to the data thread: local rank `rank` left (its fold stops waiting)."""

    rank: int


@dataclass(frozen=True)
class RankRefused:
    """The data thread's word to the control thread: `rank` is out for its deposit (`why`: poison, a violation).

    The control thread reports it gone upstream, so the coordinator reassigns its
    work at once instead of waiting on a rank whose deposits no round will take.
    """

    rank: int
    why: str


class Plane:
    """What both of a relay's threads do alike: send within a time bound, and verify a rank's record."""

    def __init__(self, cfg: RelayConfig, stop: threading.Event, count: collections.Counter[str], codec: Codec):
        self.cfg, self.stop, self.count, self.codec = cfg, stop, count, codec

    def verify(self, frames: list[Any], channel: Channel, rank: int, where: str, mapped: SegmentMap | None = None,
               replay: bool = True) -> Envelope | None:
        """Decode a rank's record; None (counted) unless it is authentic, from `rank` itself, and (with `replay`) fresh.

        With `mapped`, a by-reference message is read from that rank's own segment.
        """
        sender = Attribution.signed_by(rank_sender(rank), f"rank {rank}'s connection", rank=rank)

        def decode() -> Envelope:
            if mapped is not None:
                return mapped.decode(self.codec, frames, rank_owner(rank), channel, sender=sender)
            return self.codec.decode_from(frames, channel, sender, replay=replay)

        return decode_or_count(decode, self.count, route_refusal(where), log,
                               f"relay {self.cfg.host} ({where}, routed as rank {rank})")

    def send(self, sock: zmq.Socket, frames: Sequence[Any], where: str, copy: bool = True) -> bool:
        """Send, bounded in time; a message a peer did not take in time is dropped and counted.

        Upstream control waits up to `peer_send_timeout_s`; a local rank at most half
        its silence deadline, so one wedged rank never starves the others' liveness.
        (Upstream data never waits: `DataPlane.send_up`.)
        """
        cfg = self.cfg
        limit = min(cfg.peer_send_timeout_s, cfg.rank_silence_at_relay_s / 2) if where.startswith("local") else cfg.peer_send_timeout_s
        if send(sock, frames, self.stop, copy=copy, timeout_s=limit):
            return True
        if not self.stop.is_set():
            self.count[f"send_timeout.{where}"] += 1
            log.warning("relay %s: a send on %s timed out after %g s: the peer is not reading", cfg.host, where, limit)
        return False


class QueuedSend:
    """A host frame's way up (fold.Sending): the fold's buffers it carries are read until the socket took
    it and let go of every frame, or the queue dropped it."""

    def __init__(self) -> None:
        self.tracker: zmq.MessageTracker | None = None
        self.dropped = False

    @property
    def done(self) -> bool:
        return self.dropped or (self.tracker is not None and self.tracker.done)


@dataclass(eq=False)
class Upstream:
    """One reducer shard's link (shard 0: the controller's reducer; more with FLODL_SHARDS, shards.py).

    Each shard gets its slice of every host frame on its own DEALER and
    publishes its slice of the consensus on its own PUB; each link keeps what
    one reducer's always did: its records queued in order, its hello, and a
    watch that asks again for a slice that did not come (PROTOCOL.md 10.3,
    10.6), so a lost slice is recovered from its shard alone.
    """

    shard: int
    up: zmq.Socket
    sub: zmq.Socket
    watch: ConsensusWatch
    hello: HelloRetry
    outbox: SendQueue
    resent: tuple[int, int] = (0, 0)  # (round, how many times this shard asked for its host frame again)
    sending: dict[int, QueuedSend] = field(default_factory=dict)  # by id of queued frames: those that hold fold buffers
    # Each socket's monitor of its handshakes, made before it dialled (so the first is seen: `connected`), and
    # the sockets whose first connection was made.
    monitors: dict[zmq.Socket, zmq.Socket] = field(default_factory=dict)
    connected: set[zmq.Socket] = field(default_factory=set)
    signer: Attribution = field(init=False)  # who signs what comes on this link: its shard alone
    where: str = field(init=False)  # the counters' name of this link: the controller's keeps the one it always had

    def __post_init__(self) -> None:
        # Fixed for the link's life: not built again for every record it carries.
        self.signer = from_reducer(self.shard)
        self.where = "upstream_data" if self.shard == 0 else f"shard{self.shard}_data"


class DataPlane(Plane):
    """The data thread's handlers: deposits into the fold station, host frames up to each shard, consensus out."""

    def __init__(self, cfg: RelayConfig, stop: threading.Event, count: collections.Counter[str], codec: Codec,
                 local: zmq.Socket, links: list[Upstream], fold: FoldStation, fail: Callable[[BaseException], None],
                 control_thread: ServiceLoop, shard: ReducerService | None = None):
        super().__init__(cfg, stop, count, codec)
        self.local, self.links = local, links
        self.fold, self.fail = fold, fail
        self.control_thread = control_thread  # told of each refused rank (RankRefused)
        # The reducer shard this relay's process runs, if any: told of the coordinator's deaths, and handed its
        # start (PROTOCOL.md 10.9 item 11), without which this relay's hello to the controller's reducer goes on.
        self.shard = shard
        self.start_handed = False
        self.mapped = SegmentMap(self.cfg.incarnation, run_dir(self.cfg.key, self.cfg.incarnation))  # the ranks' deposits, read-only
        self.segment: Segment | None = None  # where consensus goes by reference (None: framed to everyone)
        try:
            self.segment = Segment(self.cfg.key, self.cfg.incarnation, host_owner(self.cfg.host))
        except ShmError as exc:
            self.shm_unusable(exc)
        self.by_reference: set[int] = set()  # ranks that deposit by reference
        # How a host frame is cut between the shards (shards.py), known from the first one shipped; and the
        # shards' consensus slices put together, round by round. One shard: the reducer's own message.
        self.cut: Cut | None = None
        self.assembly: Assembly | None = None
        # Kept for a resend after a reset: the host frame awaiting its consensus, and the last
        # consensus delivered (by reference while the host segment still holds it, and framed
        # unless every rank it went to takes it by reference: a model-sized message kept for
        # nobody is one more copy of the model in this relay while the next one arrives).
        self.shipped: HostFold | None = None
        self.delivered: tuple[int, list[Any] | None, list[Any] | None] | None = None
        # Deposits are held to the run's wire format; int8 ones are widened into the f32 fold, and the
        # host frame goes up in int8 again, with this relay's own error feedback (what its
        # quantization loses goes into its next frame).
        self.hop = Hop(f"relay {self.cfg.host}", self.cfg.wire, FoldError)

    def serve(self, loop: ServiceLoop) -> None:
        """Until the relay stops: the control thread's word of a death, each shard's records and broadcast,
        the ranks' deposits, and the timers (hellos, consensus re-asks)."""
        # The shards' word first in a turn, then the ranks': a death restated before a deposit is acted on before it.
        for link in self.links:
            loop.on_socket(link.up, lambda k=link: self.drained(k.up, lambda m: self.from_reducer(k, m)))
            loop.on_socket(link.sub, lambda k=link: self.drained(k.sub, lambda m: self.consensus(k, m, "bcast")))
        loop.on_socket(self.local, lambda: self.drained(self.local, self.deposit))
        loop.on_message(RankGone, lambda gone: self.local_death(gone.rank))
        if self.shard is not None:
            loop.on_socket(self.shard.completed, self.shard_outcomes)
        for link in self.links:
            loop.on_writable(link.up, lambda k=link: len(k.outbox) > 0, lambda k=link: self.flush_up(k))
            loop.timer(link.hello.next_due, lambda now, k=link: self.say_hello(k, now))
            loop.timer(link.watch.next_due, lambda now, k=link: self.recover(k, now))
            loop.timer(link.outbox.next_due, lambda now, k=link: self.upstream_stuck(k, now))
            # Each connection made, to a shard or its PUB: a reconnect lost what the old one carried.
            for sock, monitor in link.monitors.items():
                loop.on_socket(monitor, lambda m=monitor, k=link, s=sock: self.connected(k, s, m))
        loop.run()

    def drained(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> None:
        self.count["oversized"] += drain(sock, handle, copy=False, budget=16)

    def say_hello(self, link: Upstream, now: float) -> None:
        if link.hello.due(now):
            self.send_up(link, RelayHello(self.cfg.host, list(self.cfg.ranks), [], self.cfg.host_token))

    def shm_unusable(self, exc: ShmError) -> None:
        # A squatted or foreign shared-memory path must not stop the host: consensus goes framed.
        log.error("relay %s: consensus goes framed, not by reference: %s", self.cfg.host, exc)
        self.count["shm_unusable"] += 1
        if self.segment is not None:
            self.segment.close()
        self.segment = None

    def send_up(self, link: Upstream, rec: Any, payload: Sequence[Any] = (),
                held: Sequence[np.ndarray] = ()) -> None:
        """Queue one record for `link`'s shard, after those before it, and send what its socket takes now;
        `held`: the fold's buffers its payload reads by reference, kept from later rounds until it went.

        Never waits: this thread must go on reading every shard (the consensus comes on their
        links, and a reader that stops gets its connection reset under it), the SUBs and its ranks.
        """
        frames = self.codec.encode(rec, payload, channel=Channel.DATA)
        if not link.outbox.put(frames, time.monotonic()):
            self.count[f"queue_full.{link.where}"] += 1
            log.warning("relay %s: %d records already wait for reducer shard %d to read; dropped a %s",
                        self.cfg.host, SendQueue.MAX_RECORDS, link.shard, type(rec).__name__)
        elif held:
            link.sending[id(frames)] = queued = QueuedSend()
            self.fold.hold(held, queued)
        self.flush_up(link)

    def flush_up(self, link: Upstream) -> None:
        """Send `link`'s queued records, in order, for as long as its socket takes them without waiting."""
        while (frames := link.outbox.head) is not None:
            queued = link.sending.get(id(frames))
            try:
                if queued is None:
                    link.up.send_multipart(frames, zmq.NOBLOCK, copy=False)
                else:
                    queued.tracker = send_by_reference(link.up, frames, zmq.NOBLOCK)
            except zmq.Again:
                return  # full: the loop polls the socket for writable and calls again
            link.sending.pop(id(frames), None)
            link.outbox.went(time.monotonic())

    def upstream_stuck(self, link: Upstream, now: float) -> None:
        """Nothing queued for `link`'s shard went for `peer_send_timeout_s`: it is not reading; drop the queue."""
        dropped = link.outbox.expire(now)
        if dropped:  # all of them: their buffers are the fold's again
            for queued in link.sending.values():
                queued.dropped = True
            link.sending.clear()
            self.count[f"send_timeout.{link.where}"] += dropped
            log.warning("relay %s: sends on %s timed out: nothing went for %g s, the peer is not reading; dropped "
                        "the %d records queued", self.cfg.host, link.where, self.cfg.peer_send_timeout_s, dropped)

    def live_ranks(self) -> list[int]:
        return [r for r in self.cfg.ranks if r not in self.fold.dead]

    # ranks -> relay

    def deposit(self, msg: list[zmq.Frame]) -> None:
        rank = rank_of(msg[0].bytes) if msg else None
        if rank is None or rank not in self.cfg.ranks:
            self.count["unknown_rank.local_data"] += 1
            return
        frames = msg[1:]
        env = self.verify(frames, Channel.DATA, rank, "local_data", self.mapped)
        if env is not None:  # whatever acting on it raises is this rank's violation: it leaves, the host goes on
            act_for_peer(f"rank {rank}", lambda: self.act_on(rank, env, frames), lambda why: self.out(rank, why),
                         self.count, "local_data", log, f"relay {self.cfg.host}")

    def act_on(self, rank: int, env: Envelope, frames: list[zmq.Frame]) -> None:
        """A record of `rank`, authentic and its own: a deposit into the fold, or a request."""
        if is_by_reference(frames):
            self.by_reference.add(rank)
        if isinstance(env.record, ConsensusRequest):
            self.rank_asks(rank, env.record.round)
            return
        if not isinstance(env.record, RoundFrame):
            self.count["unexpected.local_data"] += 1
            return
        rec = env.record
        try:
            # A payload of another wire format than the run's is this rank's violation (PROTOCOL.md 3.6, 8.2):
            # its Trainer would have refused to start against the run's announced format.
            payload = self.hop.take(f"rank {rank}", env.payload)
            outcome = self.fold.deposit(rank, rec.round, rec.mass, payload)
        except (PoisonedDeposit, FoldError) as exc:
            # Refused before it touched the round: this rank leaves, the others' round goes on.
            self.refuse(rank, str(exc), "poisoned" if isinstance(exc, PoisonedDeposit) else "protocol_violations")
            return
        self.ship(outcome)
        self.refused()

    def rank_asks(self, rank: int, round_id: int) -> None:
        """A rank waited too long for the consensus of `round_id`: resend it, or ask for its lost deposit.

        The request follows the rank's deposit on one connection, so a deposit the
        fold still awaits was lost. A round shipped and not yet delivered needs
        nothing here: this relay's own watches ask the shards.
        """
        if self.delivered is not None and self.delivered[0] == round_id:
            _, framed, shared = self.delivered
            out = shared if shared is not None and rank in self.by_reference else framed
            if out is None:  # not framed for anyone: this rank was not live when the round was delivered
                self.count["unexpected.local_data"] += 1
                return
            self.count["consensus_resent.local_data"] += 1
            self.to_rank(rank, out)
        elif round_id == RESUME_ROUND and self.delivered is None:
            # The starting model of a resumed world: the controller's reducer holds it whole (sharded or
            # not), and this relay delivers it to every live rank like a round it shipped (a rank that
            # missed it asks again). Once a later round is delivered it is superseded: nobody here can
            # still need it. Asked upstream once for all the host's ranks; the watch repeats it, backing
            # off (10.3).
            link = self.links[0]
            if round_id not in link.watch.pending:
                link.watch.shipped(round_id, time.monotonic())
                self.request(link, round_id)
        elif self.fold.awaits(rank, round_id):
            self.count["frame_requests.local_data"] += 1
            self.to_rank(rank, self.codec.encode(FrameRequest(round_id), channel=Channel.DATA))

    def to_rank(self, rank: int, frames: Sequence[Any]) -> None:
        try:
            self.send(self.local, [rank_identity(rank), *frames], "local_data", copy=False)
        except zmq.ZMQError:  # EHOSTUNREACH: this rank's socket is gone
            self.count["undeliverable.local_data"] += 1

    def refused(self) -> None:
        """Ranks the fold refused while summing (a poisoned deposit): they leave, as after a bad deposit."""
        while self.fold.refused:
            self.refuse(*self.fold.refused.pop(0))

    def refuse(self, rank: int, why: str, kind: str = "poisoned") -> None:
        """`rank` leaves for a deposit the fold refused (`kind`: poisoned, or a protocol violation): on both
        channels, through the control thread (RankRefused), which reports it upstream and hands it back here
        as RankGone (`local_death`)."""
        log.error("relay %s: rank %d leaves: %s", self.cfg.host, rank, why)
        self.count[f"{kind}.local_data"] += 1
        self.out(rank, why)

    def out(self, rank: int, why: str) -> None:
        """`rank` leaves for what this thread found (`why`): the control thread reports it to the controller."""
        self.control_thread.put(RankRefused(rank, why))

    def violation(self, exc: FoldError) -> None:
        # Not one rank's fault (a payload of another wire format than the run's, the controller and this
        # relay at odds on the world): the relay stops and the controller sees this host go, by name.
        log.error("relay %s: protocol violation, tearing the data channel down: %s", self.cfg.host, exc)
        self.fail(exc)

    def ship(self, outcome: HostFold | NothingToShip | None) -> None:
        if isinstance(outcome, HostFold):
            self.send_host_frames(outcome, self.links)
            for link in self.links:
                link.watch.shipped(outcome.round_id, time.monotonic())
            self.shipped = outcome
        elif isinstance(outcome, NothingToShip):
            log.info("relay %s: %s", self.cfg.host, outcome.reason)

    def local_death(self, rank: int) -> None:
        self.leave(rank)
        for link in self.links:
            self.send_up(link, RankExit(rank))

    def leave(self, rank: int) -> None:
        # A rank that is gone never unlinks its own segment; the fold keeps its
        # mapping for as long as it holds a deposit from it.
        if self.shipped is not None and self.shipped.verbatim and rank in self.shipped.ranks:
            self.shipped = None  # its tensors lie in that rank's deposit; its host has nobody left to wait
        self.mapped.forget(rank_owner(rank))
        unlink_owner(self.cfg.incarnation, rank_owner(rank), self.mapped.directory)
        try:
            self.ship(self.fold.mark_dead(rank))
        except FoldError as exc:
            self.violation(exc)
        self.refused()

    # the shards -> relay

    def from_reducer(self, link: Upstream, msg: list[zmq.Frame]) -> None:
        tag = msg[0].bytes if msg else b""
        if tag == TAG_BCAST:
            self.consensus(link, msg[1:], link.where)
            return
        if tag != TAG_DATA:
            self.count[f"rejected.{link.where}"] += 1
            return
        env = decode_or_count(lambda: self.codec.decode_from(msg[1:], Channel.DATA, link.signer), self.count,
                              route_refusal(link.where), log, f"relay {self.cfg.host} ({link.where})")
        if env is None:
            return
        rec = env.record
        if isinstance(rec, RelayDeclareDead):
            self.declared_dead(link, rec.rank)
        elif isinstance(rec, ConsensusGone):
            # Unrecoverable for this host's ranks: say so loudly; the coordinator's
            # stall detection owns what happens next.
            log.error("relay %s: reducer shard %d no longer holds round %d (latest %d); this host missed it",
                      self.cfg.host, link.shard, rec.round, rec.latest)
            self.count["consensus_gone"] += 1
            link.watch.gone(rec.round)
        elif isinstance(rec, RelayHelloAck):
            if link.shard == 0 and self.shard is not None and not self.start_handed:
                self.count["hello_ack_before_start"] += 1  # the start was lost: the next hello brings it again
                if self.count["hello_ack_before_start"] == 1:
                    log.warning("relay %s: the controller's reducer acknowledged this relay without its shard's start "
                                "(data.shard_start); its hello goes on until the start comes. If it never does, the "
                                "controller was not given this host in FLODL_SHARDS", self.cfg.host)
                return
            link.hello.acked()
        elif isinstance(rec, (ShardStart, OuterStateRequest)):
            self.for_shard(link, rec, env.payload)
        elif isinstance(rec, FrameRequest):
            self.resend_host_frame(link, rec.round)
        else:
            self.count[f"unexpected.{link.where}"] += 1

    def for_shard(self, link: Upstream, rec: ShardStart | OuterStateRequest, payload: list[Any]) -> None:
        """The controller's reducer's word to this host's shard: its start (the shard takes the first), or a request
        for its outer state (which comes back on its outcomes, `shard_outcomes`). From any other shard, or for a
        host that runs none, not this relay's to take."""
        if link.shard != 0 or self.shard is None:
            self.count[f"unexpected.{link.where}"] += 1
        elif isinstance(rec, ShardStart):
            self.shard.start_from(rec, payload)
            self.start_handed = True
        else:
            self.shard.want_state(rec.round)

    def declared_dead(self, link: Upstream, rank: int) -> None:
        """A shard declared `rank` dead: the controller's reducer for the coordinator (or a host's shard, for a
        frame it refused, which the coordinator must then hear of). A rank of another host is this host's shard's
        business: the controller's reducer tells every shard's host of every death (PROTOCOL.md 10.9)."""
        if rank in self.fold.dead:  # deaths are restated (10.7 item 8): a repeat is a no-op
            self.count[f"restated_death.{link.where}"] += 1
        elif rank in self.cfg.ranks and link.shard != 0:
            self.out(rank, f"reducer shard {link.shard} refused this host's frame")
        elif rank not in self.cfg.ranks and (self.shard is None or link.shard != 0):
            self.count[f"unknown_rank.{link.where}"] += 1
        else:
            if rank in self.cfg.ranks:
                log.warning("relay %s: the controller declared rank %d dead", self.cfg.host, rank)
                self.leave(rank)
            if self.shard is not None:
                self.shard.declare_dead(rank)

    def shard_outcomes(self) -> None:
        """What became of this host's shard's rounds (only a failure of its service is this relay's business), and
        its outer state for the controller's reducer."""
        for outcome in self.shard.completed.drain():  # type: ignore[union-attr]
            if isinstance(outcome, OuterSlice):  # its outer state, asked for by the controller's reducer
                self.send_up(self.links[0], OuterState(outcome.shard, outcome.round_id), outcome.payload)
                continue
            # A host it refused: that host's relay hears it (`declared_dead`) and reports its ranks gone. No
            # round (None): every rank is gone, the run's normal end, which the shard logs itself.
            lost = not isinstance(outcome, HostRefused) and outcome.abandoned is not None
            if lost and outcome.round_id is not None:
                log.warning("relay %s: its reducer shard abandoned round %d: %s", self.cfg.host, outcome.round_id,
                            outcome.abandoned)
            if self.shard.error is not None:  # type: ignore[union-attr]
                self.fail(self.shard.error)  # type: ignore[union-attr]

    def resend_host_frame(self, link: Upstream, round_id: int) -> None:
        """`link`'s shard never got this host's frame of `round_id` (lost in a reset): send it again.

        Re-signed with a fresh sequence number (a byte-identical copy would be a
        replay); a shard counts the round once per host whatever arrives.
        """
        held = self.shipped
        if held is None or held.round_id != round_id or round_id not in link.watch.pending:
            self.count[f"stale_frame_request.{link.where}"] += 1
            return
        times = link.resent[1] + 1 if link.resent[0] == round_id else 1
        link.resent = (round_id, times)
        self.count[f"frames_resent.{link.where}"] += 1
        if times == 1:
            log.warning("relay %s: reducer shard %d lost this host's frame of round %d; sending it again",
                        self.cfg.host, link.shard, round_id)
        else:
            # One loss is a reset; the same round lost again and again is a link that drops every time.
            self.count[f"frames_lost_again.{link.where}"] += 1
            log.error("relay %s: reducer shard %d lost this host's frame of round %d %d times; sending it again. A "
                      "link that drops every time most likely takes longer than link_silence_s (FLODL_LINK_SILENCE, "
                      "%g s) to carry one payload frame (at most %d MiB, PROTOCOL.md 3.4): raise FLODL_LINK_SILENCE "
                      "above that time on the slowest link, or find what else resets it (a firewall, a NAT timeout)",
                      self.cfg.host, link.shard, round_id, times, self.cfg.link_silence_s, CHUNK_MAX_BYTES >> 20)
        self.send_host_frames(held, [link])

    def send_host_frames(self, fold: HostFold, links: Sequence[Upstream]) -> None:
        """The round's HostFrame, to each of `links` its shard's slice: the host's sum, or under a robust
        aggregation one per rank (PROTOCOL.md 9.5)."""
        for ranks, mass, tensors in fold.frames():
            slices = self.slices(self.hop.send_on(tensors))
            for link in links:
                self.send_up(link, HostFrame(fold.round_id, self.cfg.host, list(ranks), mass), slices[link.shard],
                             held=tensors)

    def slices(self, payload: Sequence[Any]) -> Sequence[Sequence[Any]]:
        """Each shard's frames of a host frame's payload, by shard (one shard: all of it): views, no copy."""
        if len(self.links) == 1:
            return [payload]
        assert self.hop.wire is not None  # the run's, or its first deposit's: it took that deposit before this
        if self.cut is None:
            per_chunk = self.hop.wire.frames_per_chunk
            n_values = sum(len(values) for values in payload[::per_chunk])
            self.cut = Cut.of(self.cfg.shards, n_values, per_chunk)
            self.assembly = Assembly(self.cut)
        return self.cut.slices(payload)

    def consensus(self, link: Upstream, frames: list[zmq.Frame], where: str) -> None:
        """A broadcast-channel record of `link`'s shard, from its PUB or resent point to point: verify, then
        deliver once every shard's slice of the round is in."""
        # No sequence check: a resend is byte-identical to the broadcast and
        # may come after later rounds; the round id is the replay guard.
        env = decode_or_count(lambda: self.codec.decode_from(frames, Channel.BROADCAST, link.signer, replay=False),
                              self.count, route_refusal(where), log, f"relay {self.cfg.host} ({where})")
        if env is None:
            return
        rec = env.record
        if isinstance(rec, Probe):
            self.send_up(link, SubscriberReady(self.cfg.host, rec.nonce))
            return
        if not isinstance(rec, Consensus):
            self.count[f"unexpected.{where}"] += 1
            return
        deliver, gaps = link.watch.accept(rec.round, time.monotonic())
        if not deliver:
            self.count[f"stale_consensus.{where}"] += 1
            return
        for r in gaps:
            self.request(link, r)
        if len(self.links) == 1:
            self.deliver(rec, env.payload, list(frames))
            return
        if rec.round == RESUME_ROUND and link.shard == 0:  # the starting model, whole: signed here as a round is
            self.deliver(rec, env.payload, self.codec.encode(rec, env.payload, channel=Channel.BROADCAST))
            return
        if self.assembly is None:  # no host frame shipped yet: this host has no rank in any round
            self.count[f"unexpected.{where}"] += 1
            return
        try:
            whole = self.assembly.add(link.shard, rec.round, rec.mass, env.payload)
        except ProtocolError as exc:  # a shard of another map or model: its slice is not this round's
            self.count[f"protocol_violations.{where}"] += 1
            log.error("relay %s: %s", self.cfg.host, exc)
            return
        if whole is not None:
            # Signed by this relay: no one shard signed the whole (its ranks take it from this relay alone).
            whole_rec = Consensus(whole.round_id, whole.mass)
            self.deliver(whole_rec, whole.payload, self.codec.encode(whole_rec, whole.payload, channel=Channel.BROADCAST))

    def deliver(self, rec: Consensus, payload: list[Any], frames: list[Any]) -> None:
        """Hand the consensus of `rec.round` (`frames`: its message) to every live local rank."""
        live = self.live_ranks()
        if self.shipped is not None and self.shipped.round_id <= rec.round:
            self.shipped = None
        if rec.mass == 0.0:  # the bound stays, and may lie unread in the segment this round overwrites
            self.fold.bound.limit()
        shared = None
        if self.segment is not None and self.by_reference.intersection(live):
            # Verified above and written once for every same-host rank, under this relay's signature.
            try:
                self.segment.place(payload)
                shared = by_reference(self.codec, rec, payload, self.segment, channel=Channel.BROADCAST)
            except ShmError as exc:
                self.shm_unusable(exc)
        framed = None if shared is not None and self.by_reference.issuperset(live) else frames
        self.delivered = (rec.round, framed, shared)
        for rank in live:
            self.to_rank(rank, shared if shared is not None and rank in self.by_reference else frames)
        if rec.mass > 0.0:  # the model every rank now holds bounds the next deposits (robust.py)
            # Read only if a deposit needs it: from the frames kept for a resend, or else from the
            # segment (keeping the frames for it would be one more copy of the model in this relay).
            self.fold.consensus_seen(payload if framed is not None else self.segment.arrays(payload))

    def request(self, link: Upstream, round_id: int) -> None:
        log.info("relay %s: consensus of round %d not here; asking reducer shard %d", self.cfg.host, round_id,
                 link.shard)
        self.count["consensus_requests"] += 1
        self.send_up(link, ConsensusRequest(round_id))

    def connected(self, link: Upstream, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        """`sock`, a link to `link`'s shard, (re)connected: every round still pending there is asked for now, not
        after its wait (which a slow round may have stretched to a minute: a consensus the PUB sent meanwhile is
        lost). Not at its first connection, which replaced none: what the DEALER sent before it waited for it,
        and a SUB not yet proven subscribed gets each consensus point to point too (PROTOCOL.md 10.2)."""
        events = sum(1 for _ in monitor_events(monitor))
        if sock not in link.connected:
            link.connected.add(sock)
            events -= 1
        if events <= 0:
            return
        rounds = link.watch.reconnected(time.monotonic())
        if rounds:
            log.info("relay %s: a link to reducer shard %d reconnected; asking again for rounds %s", self.cfg.host,
                     link.shard, rounds)
        for r in rounds:
            self.request(link, r)

    def recover(self, link: Upstream, now: float) -> None:
        for r in link.watch.due(now):
            self.request(link, r)
