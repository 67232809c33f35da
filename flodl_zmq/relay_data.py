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
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from flodl_zmq.errors import FoldError, PoisonedDeposit, ShmError
from flodl_zmq.fold import FoldStation, HostFold, NothingToShip
from flodl_zmq.links import (
    FROM_REDUCER,
    TAG_BCAST,
    TAG_DATA,
    act_for_peer,
    decode_or_count,
    drain,
    rank_identity,
    rank_of,
    rank_sender,
    route_refusal,
    send,
)
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.relay_core import ConsensusWatch, HelloRetry, SendQueue
from flodl_zmq.service_loop import ServiceLoop
from flodl_zmq.wire import Attribution, Channel, Codec, Envelope
from flodl_zmq.wire.records import (
    RESUME_ROUND,
    Consensus,
    ConsensusGone,
    ConsensusRequest,
    FrameRequest,
    HostFrame,
    Probe,
    RankExit,
    RelayDeclareDead,
    RelayHello,
    RelayHelloAck,
    RoundFrame,
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


class DataPlane(Plane):
    """The data thread's handlers: deposits into the fold station, consensus out under the watch."""

    def __init__(self, cfg: RelayConfig, stop: threading.Event, count: collections.Counter[str], codec: Codec,
                 local: zmq.Socket, up: zmq.Socket, fold: FoldStation, watch: ConsensusWatch,
                 fail: Callable[[BaseException], None], control_thread: ServiceLoop):
        super().__init__(cfg, stop, count, codec)
        self.local, self.up = local, up
        self.fold, self.watch, self.fail = fold, watch, fail
        self.control_thread = control_thread  # told of each refused rank (RankRefused)
        self.mapped = SegmentMap(self.cfg.incarnation, run_dir(self.cfg.key, self.cfg.incarnation))  # the ranks' deposits, read-only
        self.segment: Segment | None = None  # where consensus goes by reference (None: framed to everyone)
        try:
            self.segment = Segment(self.cfg.key, self.cfg.incarnation, host_owner(self.cfg.host))
        except ShmError as exc:
            self.shm_unusable(exc)
        self.by_reference: set[int] = set()  # ranks that deposit by reference
        self.hello = HelloRetry(self.cfg.hello_retry_s)
        self.outbox = SendQueue(self.cfg.peer_send_timeout_s)  # what waits for `up` to take it (`send_up`)
        # Kept for a resend after a reset: the host frame awaiting its consensus, and the last
        # consensus delivered (by reference while the host segment still holds it, and framed
        # unless every rank it went to takes it by reference: a model-sized message kept for
        # nobody is one more copy of the model in this relay while the next one arrives).
        self.shipped: HostFold | None = None
        self.resent: tuple[int, int] = (0, 0)  # (round, how many times its host frame was asked for again)
        self.delivered: tuple[int, list[Any] | None, list[Any] | None] | None = None
        # Deposits are held to the run's wire format; int8 ones are widened into the f32 fold, and the
        # host frame goes up in int8 again, with this relay's own error feedback (what its
        # quantization loses goes into its next frame).
        self.hop = Hop(f"relay {self.cfg.host}", self.cfg.wire, FoldError)

    def serve(self, loop: ServiceLoop, sub: zmq.Socket) -> None:
        """Until the relay stops: the control thread's word of a death, the reducer's records, the
        broadcast, the ranks' deposits, and the timers (hello, consensus re-asks)."""
        loop.on_socket(self.up, lambda: self.drained(self.up, self.from_reducer))
        loop.on_socket(sub, lambda: self.drained(sub, lambda m: self.consensus(m, "bcast")))
        loop.on_socket(self.local, lambda: self.drained(self.local, self.deposit))
        loop.on_writable(self.up, lambda: len(self.outbox) > 0, self.flush_up)
        loop.on_message(RankGone, lambda gone: self.local_death(gone.rank))
        loop.timer(self.hello.next_due, self.say_hello)
        loop.timer(self.watch.next_due, self.recover)
        loop.timer(self.outbox.next_due, self.upstream_stuck)
        # Each connection made, to the reducer or its PUB: a reconnect lost what the old one carried.
        monitors = [sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) for sock in (self.up, sub)]
        for monitor in monitors:
            loop.on_socket(monitor, lambda m=monitor: self.connected(m))
        try:
            loop.run()
        finally:
            for sock, monitor in zip((self.up, sub), monitors, strict=True):
                sock.disable_monitor()
                monitor.close(linger=0)

    def drained(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None]) -> None:
        self.count["oversized"] += drain(sock, handle, copy=False, budget=16)

    def say_hello(self, now: float) -> None:
        if self.hello.due(now):
            self.send_up(RelayHello(self.cfg.host, list(self.cfg.ranks), [], self.cfg.host_token))

    def shm_unusable(self, exc: ShmError) -> None:
        # A squatted or foreign shared-memory path must not stop the host: consensus goes framed.
        log.error("relay %s: consensus goes framed, not by reference: %s", self.cfg.host, exc)
        self.count["shm_unusable"] += 1
        if self.segment is not None:
            self.segment.close()
        self.segment = None

    def send_up(self, rec: Any, payload: Sequence[Any] = ()) -> None:
        """Queue one record for the reducer, after those before it, and send what `up` takes now.

        Never waits: this thread must go on reading `up` (the consensus comes on it,
        and a reader that stops gets its connection reset under it), the SUB and its ranks.
        """
        if not self.outbox.put(self.codec.encode(rec, payload, channel=Channel.DATA), time.monotonic()):
            self.count["queue_full.upstream_data"] += 1
            log.warning("relay %s: %d records already wait for the reducer to read; dropped a %s",
                        self.cfg.host, SendQueue.MAX_RECORDS, type(rec).__name__)
        self.flush_up()

    def flush_up(self) -> None:
        """Send the queued records, in order, for as long as `up` takes them without waiting."""
        while (frames := self.outbox.head) is not None:
            try:
                self.up.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # full: the loop polls `up` for writable and calls again
            self.outbox.went(time.monotonic())

    def upstream_stuck(self, now: float) -> None:
        """Nothing queued for the reducer went for `peer_send_timeout_s`: it is not reading; drop the queue."""
        dropped = self.outbox.expire(now)
        if dropped:
            self.count["send_timeout.upstream_data"] += dropped
            log.warning("relay %s: sends on upstream_data timed out: nothing went for %g s, the peer is not "
                        "reading; dropped the %d records queued", self.cfg.host, self.cfg.peer_send_timeout_s, dropped)

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
            payload = self.hop.take(f"rank {rank}", env.payload)
        except FoldError as exc:
            self.violation(exc)
            return
        try:
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
        nothing here: this relay's own watch asks the reducer.
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
            # The starting model of a resumed world: the reducer holds it, and this relay delivers
            # it to every live rank like a round it shipped (a rank that missed it asks again).
            # Once a later round is delivered it is superseded: nobody here can still need it.
            # Asked upstream once for all the host's ranks; the watch repeats it, backing off (10.3).
            if round_id not in self.watch.pending:
                self.watch.shipped(round_id, time.monotonic())
                self.request(round_id)
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
            self.send_host_frames(outcome)
            self.watch.shipped(outcome.round_id, time.monotonic())
            self.shipped = outcome
        elif isinstance(outcome, NothingToShip):
            log.info("relay %s: %s", self.cfg.host, outcome.reason)

    def local_death(self, rank: int) -> None:
        self.leave(rank)
        self.send_up(RankExit(rank))

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

    # reducer -> relay

    def from_reducer(self, msg: list[zmq.Frame]) -> None:
        tag = msg[0].bytes if msg else b""
        if tag == TAG_BCAST:
            self.consensus(msg[1:], "upstream_data")
            return
        if tag != TAG_DATA:
            self.count["rejected.upstream_data"] += 1
            return
        env = decode_or_count(lambda: self.codec.decode_from(msg[1:], Channel.DATA, FROM_REDUCER), self.count,
                              route_refusal("upstream_data"), log, f"relay {self.cfg.host} (upstream_data)")
        if env is None:
            return
        rec = env.record
        if isinstance(rec, RelayDeclareDead):
            if rec.rank in self.fold.dead:  # the reducer restates its deaths (10.7 item 8): a repeat is a no-op
                self.count["restated_death.upstream_data"] += 1
            elif rec.rank in self.cfg.ranks:
                log.warning("relay %s: the controller declared rank %d dead", self.cfg.host, rec.rank)
                self.leave(rec.rank)
            else:
                self.count["unknown_rank.upstream_data"] += 1
        elif isinstance(rec, ConsensusGone):
            # Unrecoverable for this host's ranks: say so loudly; the coordinator's
            # stall detection owns what happens next.
            log.error("relay %s: the reducer no longer holds round %d (latest %d); this host missed it",
                      self.cfg.host, rec.round, rec.latest)
            self.count["consensus_gone"] += 1
        elif isinstance(rec, RelayHelloAck):
            self.hello.acked()
        elif isinstance(rec, FrameRequest):
            self.resend_host_frame(rec.round)
        else:
            self.count["unexpected.upstream_data"] += 1

    def resend_host_frame(self, round_id: int) -> None:
        """The reducer never got this host's frame of `round_id` (lost in a reset): send it again.

        Re-signed with a fresh sequence number (a byte-identical copy would be a
        replay); the reducer counts the round once per host whatever arrives.
        """
        held = self.shipped
        if held is None or held.round_id != round_id or round_id not in self.watch.pending:
            self.count["stale_frame_request.upstream_data"] += 1
            return
        times = self.resent[1] + 1 if self.resent[0] == round_id else 1
        self.resent = (round_id, times)
        self.count["frames_resent.upstream_data"] += 1
        if times == 1:
            log.warning("relay %s: the reducer lost this host's frame of round %d; sending it again",
                        self.cfg.host, round_id)
        else:
            # One loss is a reset; the same round lost again and again is a link that drops every time.
            self.count["frames_lost_again.upstream_data"] += 1
            log.error("relay %s: the reducer lost this host's frame of round %d %d times; sending it again. A "
                      "link that drops every time most likely takes longer than link_silence_s (FLODL_LINK_SILENCE, "
                      "%g s) to carry one payload frame (at most %d MiB, PROTOCOL.md 3.4): raise FLODL_LINK_SILENCE "
                      "above that time on the slowest link, or find what else resets it (a firewall, a NAT timeout)",
                      self.cfg.host, round_id, times, self.cfg.link_silence_s, CHUNK_MAX_BYTES >> 20)
        self.send_host_frames(held)

    def send_host_frames(self, fold: HostFold) -> None:
        """The round's HostFrame: the host's sum, or under a robust aggregation one per rank (PROTOCOL.md 9.5)."""
        for ranks, mass, tensors in fold.frames():
            self.send_up(HostFrame(fold.round_id, self.cfg.host, list(ranks), mass), self.hop.send_on(tensors))

    def consensus(self, frames: list[zmq.Frame], where: str) -> None:
        """A broadcast-channel record from PUB or resent point to point: verify, then deliver."""
        # No sequence check: a resend is byte-identical to the broadcast and
        # may come after later rounds; the round id is the replay guard.
        env = decode_or_count(lambda: self.codec.decode_from(frames, Channel.BROADCAST, FROM_REDUCER, replay=False),
                              self.count, route_refusal(where), log, f"relay {self.cfg.host} ({where})")
        if env is None:
            return
        rec = env.record
        if isinstance(rec, Probe):
            self.send_up(SubscriberReady(self.cfg.host, rec.nonce))
            return
        if not isinstance(rec, Consensus):
            self.count[f"unexpected.{where}"] += 1
            return
        now = time.monotonic()
        deliver, gaps = self.watch.accept(rec.round, now)
        if not deliver:
            self.count[f"stale_consensus.{where}"] += 1
            return
        for r in gaps:
            self.request(r)
        live = self.live_ranks()
        if self.shipped is not None and self.shipped.round_id <= rec.round:
            self.shipped = None
        if rec.mass == 0.0:  # the bound stays, and may lie unread in the segment this round overwrites
            self.fold.bound.limit()
        shared = None
        if self.segment is not None and self.by_reference.intersection(live):
            # Verified above and written once for every same-host rank, under this relay's signature.
            try:
                self.segment.place(env.frames[1:-1])
                shared = by_reference(self.codec, rec, env.payload, self.segment, channel=Channel.BROADCAST)
            except ShmError as exc:
                self.shm_unusable(exc)
        framed = None if shared is not None and self.by_reference.issuperset(live) else list(frames)
        self.delivered = (rec.round, framed, shared)
        for rank in live:
            self.to_rank(rank, shared if shared is not None and rank in self.by_reference else frames)
        if rec.mass > 0.0:  # the model every rank now holds bounds the next deposits (robust.py)
            # Read only if a deposit needs it: from the frames kept for a resend, or else from the
            # segment (keeping the frames for it would be one more copy of the model in this relay).
            self.fold.consensus_seen(env.payload if framed is not None else self.segment.arrays(env.payload))

    def request(self, round_id: int) -> None:
        log.info("relay %s: consensus of round %d not here; asking the reducer", self.cfg.host, round_id)
        self.count["consensus_requests"] += 1
        self.send_up(ConsensusRequest(round_id))

    def connected(self, monitor: zmq.Socket) -> None:
        """An upstream link (re)connected: every round still pending is asked for now, not after its wait
        (which a slow round may have stretched to a minute: a consensus the PUB sent meanwhile is lost)."""
        while monitor.poll(0):
            recv_monitor_message(monitor)
        rounds = self.watch.reconnected(time.monotonic())
        if rounds:
            log.info("relay %s: an upstream link reconnected; asking again for rounds %s", self.cfg.host, rounds)
        for r in rounds:
            self.request(r)

    def recover(self, now: float) -> None:
        for r in self.watch.due(now):
            self.request(r)
