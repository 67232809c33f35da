"""The controller's control ROUTER: the relays' routes, who may sign what, the control streams with each rank.

Framing (see flodl_zmq/relay.py): a relay's message is
`[relay id, route, header, payload..., mac]`; `route` is the rank identity of
the rank a record is from (records cross the relay verbatim, signed by the
rank) or `b""` for the relay's own records (RelayHello, RankExit,
HostReports). Records to a rank go out as `[relay id of its host, rank
identity, frames...]`.

Rules this module keeps:

- Attribution. A rank's record must come through its own host's relay; a
  relay's own record is signed by that relay (a hello names the host it
  claims). A record that fails authentication or schema is counted per host
  and logged, never fatal; the `Upstream` (the controller) sees only
  authenticated records whose signer is the rank their route names.
- The signer answers for its record. Whatever acting on an accepted record
  raises, in this router, the coordinator or the replies it causes, is a
  violation of its signer (`links.act_for_peer`): that rank, or every rank of
  the relay's host, is declared dead; the controller serves on.
- One relay per host, proved by its token. A hello counts only with the
  token its host was given at admission (`links.hello_signer`), checked before
  its sequence number is recorded: another member naming the host moves no
  route and burns no sequence number. A hello for a host whose relay is still
  connected under another identity is refused (a reconnect keeps its identity).
- The control streams with each rank (PROTOCOL.md 10.7): records to it kept
  until it acknowledges them and sent again if a reset lost them; its records
  handed on in order. A record is never failed while its rank lives, so a
  chunk is reassigned only after a death, and a dead rank's records are never
  sent again: nothing is trained twice.
- Never blocks: a relay whose queue is full stopped reading, and the one loop
  of the coordinator must not wait on it; what does not go now goes again
  with the resends.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, Protocol

import zmq

from flodl_zmq.errors import AttributionError, AuthError, ReplayError, WireError
from flodl_zmq.links import (
    COORDINATOR_SENDER,
    RELAY_ROUTE,
    Connections,
    Refusal,
    act_for_peer,
    coordinator_sender,
    decode_or_count,
    hello_signer,
    rank_identity,
    rank_of,
    rank_sender,
    relay_sender,
)
from flodl_zmq.wire import Attribution, Channel, Codec
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.stream import RESEND_AFTER_S, InOrder, Outage, Outstream

log = logging.getLogger(__name__)
# Why a relay reported a rank gone is in its own log; the controller's line says where to look.
RELAY_SAW = "an exit, silence, its agent's death, or a deposit or record it refused (that host's relay log says which)"


class Upstream(Protocol):
    """What the router hands on: the controller's side of the control socket."""

    def on_rank_record(self, rank: int, record: Any) -> None:
        """A rank's authenticated control record, in the order it sent them."""

    def declare_dead(self, rank: int, reason: str) -> None:
        """A relay saw `rank` leave."""

    def auth_failed(self, error: str) -> None:
        """A record failed authentication (a wrong FLODL_KEY somewhere)."""

    def has_exited(self, rank: int) -> bool:
        """`rank` said goodbye: a resent record of it gets its acknowledgement at once."""

    def is_gone(self, rank: int) -> bool:
        """`rank` is dead or exited: its records are never sent again."""

    def violation(self, ranks: tuple[int, ...], reason: str) -> None:
        """Acting on a record signed for `ranks` raised (`links.act_for_peer`): they are out, the run goes on."""


class ControlRouter:
    """The control ROUTER of one controller, between the relays and its `Upstream`."""

    def __init__(self, world: dict[str, tuple[int, ...]], world_size: int, key: bytes, incarnation: bytes,
                 route_secret: bytes, counts: collections.Counter[str]) -> None:
        """`route_secret`: what each host's token derives from (`links.host_token`); `counts`: the controller's."""
        self.world = world
        self.route_secret = route_secret
        self.host_of = {r: h for h, rs in world.items() for r in rs}
        self.codec = Codec(key, incarnation, COORDINATOR_SENDER)
        self.counts = counts
        self.relay_route: dict[str, bytes] = {}
        # What `status` shows per host: records rejected by cause, when one was last accepted,
        # and resends (counted by the resend path, issue 13 part 2). Reconnects: self.connections.
        self.rejected: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.last_seen: dict[str, float] = {}
        self.resends: collections.Counter[str] = collections.Counter()  # per host, for `status`
        self.reconnects_this_epoch = 0
        self._outages: dict[str, Outage] = collections.defaultdict(Outage)  # host -> its resends, logged per outage
        self._to_rank = {r: Outstream(Codec(key, incarnation, coordinator_sender(r))) for r in range(world_size)}
        self._from_rank = {r: InOrder() for r in range(world_size)}
        self._told_dead: dict[int, float] = {}  # a dead rank still speaking: when it was last told (`_still_dead`)

    def attach(self, control: zmq.Socket, upstream: Upstream) -> None:
        """Serve `control` (bound by the caller) for `upstream`."""
        self.control, self.upstream = control, upstream
        self.connections = Connections(control)

    def due_at(self) -> float:
        """The next moment a record to a rank is due to be sent again (monotonic seconds)."""
        return min((s.due_at() for s in self._to_rank.values()), default=float("inf"))

    def links_status(self) -> dict[str, dict[str, Any]]:
        """Per host, what `status` shows of its link."""
        return {
            host: {
                "reconnects": self.connections.reconnects.get(host, 0),
                "resends": self.resends[host],
                "rejected": dict(self.rejected.get(host, {})),
                "last_seen": self.last_seen.get(host),
            }
            for host in [*self.world, *(["unknown"] if "unknown" in self.rejected else [])]
        }

    # ------------------------------------------------------------------ outbound

    def send_rank(self, rank: int, record: Any) -> None:
        """Send `record` on the control stream to `rank`, through its relay; kept until acknowledged."""
        if isinstance(record, rec.CoordHeartbeat):  # the beacon carries this rank's acknowledgement
            record = rec.CoordHeartbeat(ack=self._from_rank[rank].acked)
        self._to_relay_of(rank, self._to_rank[rank].send(record, time.monotonic()))

    def _to_relay_of(self, rank: int, frames: list[Any]) -> None:
        relay_id = self.relay_route.get(self.host_of.get(rank, ""))  # a vacancy has no host
        if relay_id is None:
            self.counts["undeliverable.control"] += 1
            return
        try:
            self.control.send_multipart([relay_id, rank_identity(rank), *frames], zmq.NOBLOCK)
        except zmq.ZMQError:  # full (not reading), or EHOSTUNREACH (re-dialling): resent later
            self.counts["undeliverable.control"] += 1

    def resend(self, now: float) -> None:
        """Send again what a live rank has not acknowledged; a dead or exited rank's records never go again."""
        for rank, stream in self._to_rank.items():
            if not len(stream):
                continue
            if self.upstream.is_gone(rank):
                stream.forget()
                self._settled(rank)
                continue
            due = stream.due(now)
            host = self.host_of.get(rank, "")  # a vacancy has no host
            if due and self._outages[host].resent_on(rank, len(due), now):
                log.warning("controller: host %s has not acknowledged %d control records; sending them again "
                            "every %g s until it does", host, len(due), RESEND_AFTER_S)
            for frames in due:
                self.resends[host] += 1
                self._to_relay_of(rank, frames)

    def _settled(self, rank: int) -> None:
        """Rank `rank`'s stream was acknowledged (or forgotten): the end of its host's outage, if the last."""
        host = self.host_of[rank]
        summary = self._outages[host].settled(rank, time.monotonic())
        if summary is not None:
            log.info("controller: host %s acknowledges again: %d control records resent over %.1f s",
                     host, *summary)

    def _send_relay(self, relay_id: bytes, record: Any) -> None:
        """Send a record of the coordinator's own to a relay; never blocks, never kept (a relay repeats its hello)."""
        try:
            self.control.send_multipart([relay_id, RELAY_ROUTE, *self.codec.encode(record, channel=Channel.CONTROL)],
                                        zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counts["undeliverable.control"] += 1

    def _route_gone(self, relay_id: bytes) -> bool:
        """True when ZeroMQ holds no connection for `relay_id` (ROUTER_MANDATORY refuses a send to it)."""
        try:
            self.control.send_multipart([relay_id, RELAY_ROUTE,
                                         *self.codec.encode(rec.RelayHelloAck(), channel=Channel.CONTROL)], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError:
            return True
        return False

    # ------------------------------------------------------------------ inbound

    def on_control(self, msg: list[Any]) -> None:
        """One message of the control ROUTER: decoded, attributed, handed on."""
        if len(msg) < 4:
            self.counts["rejected.control"] += 1
            return
        relay_id, route = msg[0].bytes, msg[1].bytes
        env = decode_or_count(
            lambda: self.codec.decode_from(msg[2:], Channel.CONTROL, lambda r: self._signer_of(relay_id, route, r)),
            self.counts, lambda exc: self._refused(relay_id, route, exc), log, "controller")
        if env is None:
            return
        host = self._host_of_relay(relay_id)
        if host != "unknown":  # else a first RelayHello: its host is known once it is acknowledged
            self.last_seen[host] = time.time()
            if self.connections.arrived(host, msg[-1]):
                self.reconnects_this_epoch += 1
                log.info("controller: host %s reconnected (%d so far)", host, self.connections.reconnects[host])
        rank = rank_of(route)  # attributed: a rank of this world, or None on the relay's own route
        # The signer answers for what its record makes us do: the rank, or the relay for its host's ranks.
        peer, ranks = (f"the relay of {host}", self.world.get(host, ())) if rank is None else (f"rank {rank}", (rank,))
        act_for_peer(peer, lambda: self._on_relay(relay_id, env) if rank is None else
                     self._from_stream(rank, env.seq, env.record),
                     lambda reason: self.upstream.violation(tuple(ranks), f"{env.kind}: {reason}"),
                     self.counts, "control", log, "controller")

    def _refused(self, relay_id: bytes, route: bytes, exc: WireError) -> Refusal:
        """A control record that did not decode: counted by cause (also per host), never fatal."""
        if isinstance(exc, AttributionError):
            hello = exc.kind == rec.RelayHello.KIND
            self.rejected[self._host_of_relay(relay_id)]["bad_hello" if hello else "forged_route"] += 1
            return Refusal("bad_hello.control", logging.ERROR) if hello else Refusal("forged_route.control")
        if isinstance(exc, ReplayError):
            rank = rank_of(route)  # attributed before the window: a rank of this world, or a relay
            if rank is not None and self.upstream.has_exited(rank):
                self.send_rank(rank, rec.CoordHeartbeat())  # an exited rank gets no beacon to carry it
            elif rank is not None:
                self._still_dead(rank)
            return Refusal("duplicate.control", logging.DEBUG)  # a resend whose first copy arrived: its ack was lost
        self.rejected[self._host_of_relay(relay_id)][type(exc).__name__] += 1
        if isinstance(exc, AuthError):
            self.upstream.auth_failed(str(exc))
        return Refusal("rejected.control")

    def _still_dead(self, rank: int) -> None:
        """`rank` spoke: if it is dead (not one that said goodbye), it is told again, at most once per resend
        period. Its DeclareDead went once, never resent, and a link cut at that moment lost it: the rank trained
        on unheard until its own silence limit (PROTOCOL.md 10.7 item 10)."""
        if not self.upstream.is_gone(rank) or self.upstream.has_exited(rank):
            return  # every record of a live rank comes here: nothing more to it
        now = time.monotonic()
        if now - self._told_dead.get(rank, -math.inf) >= RESEND_AFTER_S:
            self._told_dead[rank] = now
            self.send_rank(rank, rec.DeclareDead(rank=rank))

    def _from_stream(self, rank: int, seq: int, record: Any) -> None:
        """Record `seq` of `rank`'s stream, alone or merged by its relay: acknowledgements at once, the rest in order."""
        self._still_dead(rank)
        if isinstance(record, rec.Heartbeat) and self._to_rank[rank].ack(record.ack):
            self._settled(rank)
        for r in self._from_rank[rank].accept(seq, record):
            self.upstream.on_rank_record(rank, r)

    def _host_of_relay(self, relay_id: bytes) -> str:
        """The host whose relay holds `relay_id`, or "unknown" (counted apart)."""
        return next((h for h, rid in self.relay_route.items() if rid == relay_id), "unknown")

    def _signer_of(self, relay_id: bytes, route: bytes, record: Any) -> Attribution:
        """Who may sign a control record that came through `relay_id` with `route`."""
        if route == RELAY_ROUTE:
            where = f"relay connection {relay_id!r}"
            if isinstance(record, rec.RelayHello):
                return hello_signer(self.route_secret, record, where)
            host = self._host_of_relay(relay_id)
            if self.relay_route.get(host) != relay_id:  # "unknown": no host's relay holds this connection
                return Attribution.nobody(where)
            return Attribution.signed_by(relay_sender(host), where)
        rank = rank_of(route)
        where = f"route {route!r} through relay {relay_id!r}"
        if rank is None or rank not in self.host_of or self.relay_route.get(self.host_of[rank]) != relay_id:
            return Attribution.nobody(where)
        return Attribution.signed_by(rank_sender(rank), where)

    def _on_relay(self, relay_id: bytes, env: Any) -> None:
        r = env.record
        if isinstance(r, rec.RelayHello):
            self._on_relay_hello(relay_id, env.sender, r)
        elif isinstance(r, rec.RankExit):
            host = self._host_of_relay(relay_id)  # attributed: known
            if r.rank not in self.world[host]:
                self.counts["forged_route.control"] += 1
                return
            self.upstream.declare_dead(r.rank, f"the relay on {host} saw it leave: {RELAY_SAW}")
        elif isinstance(r, rec.HostReports):
            host = self._host_of_relay(relay_id)  # attributed: known
            merged = r.unmerge()
            if any(record.rank not in self.world[host] for _, record in merged):  # it speaks for its own ranks only
                self.counts["forged_route.control"] += 1
                return
            for seq, record in merged:
                self._from_stream(record.rank, seq, record)
        else:
            self.counts["unexpected.control"] += 1

    def _on_relay_hello(self, relay_id: bytes, sender: str, r: rec.RelayHello) -> None:
        want = self.world.get(r.host)
        if want is None or sorted(r.ranks) != sorted(want):
            self.counts["bad_hello.control"] += 1
            log.error("controller: refused relay hello from %r for %r with ranks %s", sender, r.host, r.ranks)
            return
        old = self.relay_route.get(r.host)
        if old is not None and old != relay_id and not self._route_gone(old):
            # A reconnect keeps its identity (links.relay_identity); a different one for a
            # host whose relay is still connected would take its ranks' route: refused.
            self.counts["bad_hello.control"] += 1
            log.error("controller: refused relay hello for %r from %r: relay %r is still connected",
                      r.host, relay_id, old)
            return
        self.relay_route[r.host] = relay_id  # the same identity again (a re-hello): acknowledged again
        self._send_relay(relay_id, rec.RelayHelloAck())
