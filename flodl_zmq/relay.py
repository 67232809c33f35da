"""The relay: one per host, the broker between the host's ranks and the controller.

Sockets (protocol/PROTOCOL.md, 1 and 3.1):

    local control  ROUTER (bind, ipc:// or tcp://)  <- each rank's control DEALER
    local data     ROUTER (bind)                    <- each rank's data DEALER
    up control     DEALER -> controller control ROUTER
    up data        DEALER -> controller data ROUTER (the reducer)
    sub            SUB    -> controller PUB (consensus, probes)

A rank's DEALER routing identity is its global rank in ASCII decimal
(`rank_identity`). Framing on the relay's upstream legs:

- up control, both directions: ``[route, header, payload..., mac]`` where
  ``route`` is the rank identity of the rank the record is from (upward) or
  for (downward), and ``b""`` for the relay's own records (RelayHello,
  RankExit) and the replies to them. A rank's record crosses verbatim: the
  relay verifies it but never re-encodes it, so its end-to-end MAC survives.
- up data, relay -> reducer: a plain data-channel record (RelayHello,
  HostFrame, RankExit, SubscriberReady, ConsensusRequest).
- up data, reducer -> relay: ``[tag, header, payload..., mac]`` where ``tag``
  names the channel the record was encoded for: ``b"data"`` (RelayHelloAck,
  RelayDeclareDead, ConsensusGone) or ``b"bcast"`` (a Consensus resent point to
  point, byte-identical to what PUB carried).

Rules this module keeps:

- One socket is owned by one thread. The control thread owns the two control
  sockets and the local liveness clock; the data thread owns the data sockets,
  the SUB and the fold station. The control thread tells the data thread of a
  local death over an inproc PAIR, so a model frame never delays a heartbeat
  and a heartbeat never races the fold.
- Every record is authenticated before it is used, and a record whose
  authenticated sender is not the rank its routing identity names is dropped
  and counted: a rank cannot speak (or deposit) for another. Rejections never
  stop the relay; only a fold protocol violation does (the stream is
  desynced and the polluted round must never ship). A deposit with a NaN or
  infinite element is refused before it joins the fold: that rank leaves
  (RankExit upstream) and the round completes without it.
- Liveness (the wheels have no ROUTER_NOTIFY): a rank is dead when it says
  goodbye (timing.exiting), when no control record arrived from it within
  `heartbeat_deadline_s` (or `first_contact_deadline_s` before its first
  one), or when the controller sends DeclareDead. Death is permanent, leaves
  the fold barrier at once and is reported upstream as RankExit, restated
  every RESEND_AFTER_S for the rest of the run (one lost in a reset must not
  leave the controller waiting for a timeout; a repeat changes nothing).
- A consensus is delivered to every live local rank once. A round that was
  shipped and whose consensus did not come (a later round came first, or
  silence past `consensus_deadline_s`) is requested point to point: PUB
  drops messages and a lost consensus is a correctness bug for Local SGD.
- Nothing lost in a reset stalls a round (PROTOCOL.md 10.6): the last host
  frame shipped is kept until its consensus comes and sent again when the
  reducer asks (FrameRequest); a rank that asks for its consensus
  (ConsensusRequest) gets the last one delivered again, or a FrameRequest
  when its deposit never reached the fold. A request for RESUME_ROUND (a
  resumed world's starting consensus, PROTOCOL.md 13) not yet delivered goes
  to the reducer and is watched like a shipped round. Round id + sender make a resend
  idempotent: the fold and the reducer count a crossing copy once.
- Every queue is bounded by a high-water mark counted in records; a slow
  upstream blocks the data thread, which stops reading the ranks.
- Same-host ranks may deposit by reference (flodl_zmq/wire/shm.py): the
  payload lies in the rank's shared-memory segment and is verified there
  exactly as if it were frames. A rank that deposits by reference proved it
  shares the relay's memory, so its consensus goes by reference too: the
  relay verifies the reducer's consensus, writes it once into its host segment
  and sends that rank the same record by reference, signed by the relay. A
  rank that leaves has its segments unlinked (a SIGKILLed rank cannot).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from flodl_zmq import int8, mailbox
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv, watch_lifeline
from flodl_zmq.errors import (
    AttributionError,
    ConfigError,
    FlodlError,
    FoldError,
    PoisonedDeposit,
    ShmError,
    WireError,
)
from flodl_zmq.fold import FoldStation, HostFold, NothingToShip
from flodl_zmq.links import (
    CONTROL_MAX_FRAME_BYTES,
    CONTROL_MAX_FRAMES,
    DATA_MAX_FRAME_BYTES,
    FROM_COORDINATOR,
    FROM_REDUCER,
    RELAY_ROUTE,
    TAG_BCAST,
    TAG_DATA,
    bind_local,
    coordinator_sender,
    drain,
    keep_alive,
    limit_receive,
    local_endpoints,
    rank_identity,
    rank_of,
    rank_sender,
    relay_identity,
    relay_sender,
    remove_ipc,
    send,
    tune,
    tune_loopback,
)
from flodl_zmq.relay_core import (
    MERGE_PERIOD_S,
    ConsensusWatch,
    Departures,
    HelloRetry,
    RankLiveness,
    ReportQueue,
)
from flodl_zmq.security import CurveKeys, apply_client
from flodl_zmq.settings import Settings
from flodl_zmq.wire import Attribution, Channel, Codec, Envelope
from flodl_zmq.wire.records import (
    MERGEABLE,
    RANK_CONTROL_RECORDS,
    RESUME_ROUND,
    Consensus,
    ConsensusGone,
    ConsensusRequest,
    Exiting,
    FrameRequest,
    HostFrame,
    HostReports,
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

log = logging.getLogger(__name__)

GOODBYE = "said goodbye"
DEFAULTS = Settings()  # RelayConfig's timings default to the settings table

@dataclass(frozen=True)
class RelayConfig:
    """Everything a relay needs; validated on construction."""

    host: str
    ranks: tuple[int, ...]
    key: bytes
    run_id: bytes
    control_upstream: str
    data_upstream: str
    bcast_upstream: str
    local_control: str
    local_data: str
    heartbeat_deadline_s: float = DEFAULTS.rank_silence_at_relay_s
    first_contact_deadline_s: float = DEFAULTS.rank_first_record_at_relay_s
    consensus_deadline_s: float = DEFAULTS.consensus_wait_at_relay_s
    hwm_records: int = 64
    data_hwm_records: int = 4  # data records are model-sized: a few in flight is plenty
    poll_s: float = 0.05
    curve: CurveKeys | None = None  # CURVE client keys for the three upstream sockets (None: cleartext)
    link_heartbeat_s: float = DEFAULTS.link_heartbeat_period_s  # ZeroMQ heartbeats on the tcp:// upstream links
    link_silence_s: float = DEFAULTS.link_silence_s  # an upstream link silent this long is re-dialled
    send_timeout_s: float = DEFAULTS.peer_send_timeout_s  # a send to a peer that stopped reading fails after this
    hello_retry_s: float = 1.0  # a RelayHello not acknowledged by then is sent again (one lost in a reset)

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("relay host name must not be empty")
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ConfigError(f"relay ranks {self.ranks} must be distinct non-negative global ranks, at least one")
        for name in ("heartbeat_deadline_s", "first_contact_deadline_s", "consensus_deadline_s", "poll_s",
                     "link_heartbeat_s", "link_silence_s", "send_timeout_s", "hello_retry_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"relay {name} must be > 0, got {getattr(self, name)}")
        if self.poll_s >= self.heartbeat_deadline_s:
            raise ConfigError("relay poll_s must be below heartbeat_deadline_s or deaths are detected late")
        if self.hwm_records < 1 or self.data_hwm_records < 1:
            raise ConfigError("relay high-water marks must be at least 1 record")

    @classmethod
    def for_controller(
        cls,
        host: str,
        ranks: Iterable[int],
        key: bytes,
        run_id: bytes,
        controller: ControllerAddress,
        local: tuple[str, str] | None = None,
        **timing: Any,
    ) -> RelayConfig:
        """A relay of `controller`; local endpoints default to per-run ipc:// paths."""
        control, data = local or local_endpoints(key, run_id, host)
        return cls(
            host=host,
            ranks=tuple(sorted(int(r) for r in ranks)),
            key=key,
            run_id=run_id,
            control_upstream=controller.endpoint(Channel.CONTROL),
            data_upstream=controller.endpoint(Channel.DATA),
            bcast_upstream=controller.endpoint(Channel.BROADCAST),
            local_control=control,
            local_data=data,
            **timing,
        )


class Relay:
    """One host's relay: control byte router, data fold station, consensus fan-out.

    `start()` binds the local endpoints (ranks may connect as soon as it
    returns), dials the controller and runs two threads until `stop()`, or
    until a fold protocol violation stops it (then `error` holds the cause).
    `counters()` reports every drop and rejection by cause and socket.
    Pass a shared `context` to use inproc:// endpoints.
    """

    def __init__(self, config: RelayConfig, context: zmq.Context | None = None):
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ready = threading.Barrier(3)
        self._pipe = f"inproc://flodl-relay-{config.host}-{id(self):x}"
        self._counts: dict[str, collections.Counter[str]] = {"control": collections.Counter(), "data": collections.Counter()}
        self.error: BaseException | None = None
        self.fold = FoldStation(config.ranks)
        self.watch = ConsensusWatch(config.consensus_deadline_s)
        # Both upstream DEALERs carry it: stable for this process, so a reconnect keeps the route.
        self.identity = relay_identity(config.host, os.urandom(8))
        self._coordinator_to = {r: Attribution.signed_by(coordinator_sender(r), "the coordinator's link")
                                for r in config.ranks}

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 10.0) -> None:
        """Bind, connect, and run; raises if a socket cannot be set up."""
        for name, target in (("control", self._control_main), ("data", self._data_main)):
            t = threading.Thread(target=target, name=f"relay-{self.config.host}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            self._ready.wait(timeout)
        except threading.BrokenBarrierError:
            self.stop()
            raise FlodlError(f"relay {self.config.host} failed to start: {self.error}") from self.error
        log.info("relay %s up: ranks %s, local %s / %s", self.config.host, list(self.config.ranks),
                 self.config.local_control, self.config.local_data)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both threads and close their sockets (idempotent)."""
        self._stop.set()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    @property
    def running(self) -> bool:
        return not self._stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the relay stops; True if it did within `timeout`."""
        return self._stop.wait(timeout)

    def counters(self) -> dict[str, int]:
        """Every drop, rejection and recovery so far, keyed `cause.socket`."""
        out = dict(self._counts["control"])
        out.update(self._counts["data"])
        out["late_deposits"] = self.fold.counters.late_drops
        out["rounds_shipped"] = self.fold.counters.rounds_shipped
        return out

    def _run(self, name: str, body) -> None:
        try:
            body()
        except BaseException as exc:  # a dead thread must stop the relay loudly, never linger half-alive
            log.exception("relay %s: %s thread failed", self.config.host, name)
            self.error = self.error or exc
            self._ready.abort()
            self._stop.set()

    # ------------------------------------------------------------------ control thread

    def _control_main(self) -> None:
        self._run("control", self._control_loop)

    def _control_loop(self) -> None:
        cfg, ctx = self.config, self._ctx
        local = ctx.socket(zmq.ROUTER)
        up = ctx.socket(zmq.DEALER)
        pipe = ctx.socket(zmq.PAIR)
        bound = ""  # the local endpoint this thread bound: its socket file is unlinked at exit
        try:
            for s in (local, up, pipe):
                tune(s, cfg.hwm_records, cfg.poll_s)
            for s in (local, up):
                limit_receive(s, CONTROL_MAX_FRAME_BYTES)
            local.setsockopt(zmq.ROUTER_MANDATORY, 1)
            bind_local(local, cfg.local_control)
            bound = cfg.local_control
            if cfg.curve is not None:
                apply_client(up, cfg.curve)
            up.setsockopt(zmq.ROUTING_ID, self.identity)
            keep_alive(up, cfg.control_upstream, cfg.link_heartbeat_s, cfg.link_silence_s)
            up.connect(cfg.control_upstream)
            pipe.connect(self._pipe)
            self._ready.wait()
            _ControlPlane(self, local, up, pipe).run()
        finally:
            for s in (local, up, pipe):
                s.close(0)
            remove_ipc(bound)

    def _verify(self, codec: Codec, frames: list[Any], channel: Channel, rank: int, count, where: str,
                mapped: SegmentMap | None = None, replay: bool = True) -> Envelope | None:
        """Decode a rank's record; None (counted) unless it is authentic, from `rank` itself, and (with `replay`) fresh.

        With `mapped`, a by-reference message is read from that rank's own segment.
        """
        sender = Attribution.signed_by(rank_sender(rank), f"rank {rank}'s connection", rank=rank)
        try:
            if mapped is not None:
                env = mapped.decode(codec, frames, rank_owner(rank), channel, sender=sender)
            else:
                env = codec.decode_from(frames, channel, sender, replay=replay)
        except AttributionError as exc:
            count[f"forged_route.{where}"] += 1
            log.warning("relay %s: dropped: %s", self.config.host, exc)
            return None
        except WireError as exc:
            count[f"rejected.{where}"] += 1
            log.warning("relay %s: rejected a %s record routed as rank %d: %s", self.config.host, channel.value,
                        rank, exc)
            return None
        return env

    def _send(self, sock: zmq.Socket, frames: Sequence[Any], count, where: str, copy: bool = True) -> bool:
        """Send, bounded in time; a message a peer did not take in time is dropped and counted.

        Upstream waits up to `send_timeout_s`; a local rank at most half its
        silence deadline, so one wedged rank never starves the others' liveness.
        """
        cfg = self.config
        limit = min(cfg.send_timeout_s, cfg.heartbeat_deadline_s / 2) if where.startswith("local") else cfg.send_timeout_s
        if send(sock, frames, self._stop, copy=copy, timeout_s=limit):
            return True
        if not self._stop.is_set():
            count[f"send_timeout.{where}"] += 1
            log.warning("relay %s: a send on %s timed out after %g s: the peer is not reading", cfg.host, where, limit)
        return False

    # ------------------------------------------------------------------ data thread

    def _data_main(self) -> None:
        self._run("data", self._data_loop)

    def _data_loop(self) -> None:
        cfg, ctx = self.config, self._ctx
        codec = Codec(cfg.key, cfg.run_id, relay_sender(cfg.host))
        local = ctx.socket(zmq.ROUTER)
        up = ctx.socket(zmq.DEALER)
        sub = ctx.socket(zmq.SUB)
        pipe = ctx.socket(zmq.PAIR)
        d: _DataPlane | None = None
        bound = ""
        try:
            for s in (local, up, sub):
                tune(s, cfg.data_hwm_records, cfg.poll_s)
            tune(pipe, cfg.hwm_records, cfg.poll_s)
            for s in (local, up, sub):
                limit_receive(s, DATA_MAX_FRAME_BYTES)
            local.setsockopt(zmq.ROUTER_MANDATORY, 1)
            bind_local(local, cfg.local_data)
            bound = cfg.local_data
            pipe.bind(self._pipe)
            if cfg.curve is not None:
                apply_client(up, cfg.curve)
                apply_client(sub, cfg.curve)
            tune_loopback(up, cfg.data_upstream)
            up.setsockopt(zmq.ROUTING_ID, self.identity)
            keep_alive(up, cfg.data_upstream, cfg.link_heartbeat_s, cfg.link_silence_s)
            keep_alive(sub, cfg.bcast_upstream, cfg.link_heartbeat_s, cfg.link_silence_s)
            up.connect(cfg.data_upstream)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(cfg.bcast_upstream)
            self._ready.wait()
            d = _DataPlane(self, codec, local, up)
            poller = zmq.Poller()
            for s in (local, up, sub, pipe):
                poller.register(s, zmq.POLLIN)
            poll_ms = int(cfg.poll_s * 1000)
            while not self._stop.is_set():
                events = dict(poller.poll(poll_ms))
                if d.hello.due(time.monotonic()):
                    d.send_up(RelayHello(cfg.host, list(cfg.ranks), []))
                if pipe in events:
                    drain(pipe, lambda m: d.local_death(rank_of(m[0])))
                if up in events:
                    d.count["oversized"] += drain(up, d.from_reducer, copy=False, budget=16)
                if sub in events:
                    d.count["oversized"] += drain(sub, lambda m: d.consensus(m, "bcast"), copy=False, budget=16)
                if local in events:
                    d.count["oversized"] += drain(local, d.deposit, copy=False, budget=16)
                d.recover(time.monotonic())
        finally:
            for s in (local, up, sub, pipe):
                s.close(0)
            remove_ipc(bound)
            if d is not None and d.segment is not None:
                d.segment.close()


class _ControlPlane:
    """The control thread's handlers: ranks' records up, the coordinator's down, the local liveness clock."""

    def __init__(self, relay: Relay, local: zmq.Socket, up: zmq.Socket, pipe: zmq.Socket):
        self.relay, self.local, self.up, self.pipe = relay, local, up, pipe
        self.cfg = cfg = relay.config
        self.count = relay._counts["control"]
        self.codec = Codec(cfg.key, cfg.run_id, relay_sender(cfg.host))
        self.hello = HelloRetry(cfg.hello_retry_s)
        self.live = RankLiveness(cfg.ranks, time.monotonic(), cfg.heartbeat_deadline_s, cfg.first_contact_deadline_s)
        self.departed = Departures()
        self.reports = ReportQueue(cfg.ranks, MERGE_PERIOD_S)

    def run(self) -> None:
        """Until the relay stops: hello, ranks' records, due reports, the coordinator's records, restated exits."""
        poller = zmq.Poller()
        poller.register(self.local, zmq.POLLIN)
        poller.register(self.up, zmq.POLLIN)
        poll_ms = int(self.cfg.poll_s * 1000)
        while not self.relay._stop.is_set():
            if self.hello.due(time.monotonic()):
                self.send_own(RelayHello(self.cfg.host, list(self.cfg.ranks), []))
            wait_ms = min(poll_ms, mailbox.poll_ms(self.reports.due_at - time.monotonic()))
            events = dict(poller.poll(wait_ms))
            for rank in self.live.turn(time.monotonic(), wait_ms / 1000):
                self.death(rank, "heartbeat deadline passed")
            if self.local in events:
                self.count["oversized"] += drain(self.local, self.from_rank, max_frames=CONTROL_MAX_FRAMES)
            if time.monotonic() >= self.reports.due_at:
                self.report_up()
            if self.up in events:
                self.count["oversized"] += drain(self.up, self.to_rank, max_frames=CONTROL_MAX_FRAMES)
            self.restate(time.monotonic())

    def send_own(self, rec: Any) -> None:
        """Send one of this relay's own records up (route RELAY_ROUTE), signed by the relay."""
        self.relay._send(self.up, [RELAY_ROUTE, *self.codec.encode(rec, channel=Channel.CONTROL)], self.count,
                         "upstream_control")

    def report_up(self) -> None:
        held = self.reports.take()
        if isinstance(held, HostReports):
            self.send_own(held)
        elif held is not None:
            self.relay._send(self.up, held, self.count, "upstream_control")  # a lone record, verbatim (route, frames)

    def death(self, rank: int, why: str) -> None:
        # A goodbye is the normal end of a rank; only a silent departure deserves a warning.
        level = logging.INFO if why == GOODBYE else logging.WARNING
        log.log(level, "relay %s: rank %d left (%s)", self.cfg.host, rank, why)
        self.report_up()  # what it reported before it left comes first
        self.reports.leave(rank)
        self.send_own(RankExit(rank))
        self.departed.add(rank, time.monotonic())
        # In-process: the data thread reads it.
        send(self.pipe, [rank_identity(rank)], self.relay._stop, timeout_s=math.inf)

    def restate(self, now: float) -> None:
        """Every rank gone so far, reported again when due (one RankExit lost in a reset must not stall)."""
        gone = self.departed.due(now)
        if not gone:
            return
        self.count["restated_exit.upstream_control"] += len(gone)
        for rank in gone:
            self.send_own(RankExit(rank))

    # ranks -> relay

    def from_rank(self, msg: list[bytes]) -> None:
        rank = rank_of(msg[0]) if msg else None
        if rank is None or rank not in self.cfg.ranks:
            self.count["unknown_rank.local_control"] += 1
            return
        # No sequence check: the coordinator's window is the duplicate filter, and a rank's
        # resend whose first copy passed here but was lost upstream must pass again (10.7).
        env = self.relay._verify(self.codec, msg[1:], Channel.CONTROL, rank, self.count, "local_control",
                                 replay=False)
        if env is None:
            return
        if type(env.record) not in RANK_CONTROL_RECORDS:
            # A kind only the coordinator or a relay sends: the rank is out, as for any violation.
            self.count["illegal_kind.local_control"] += 1
            if self.live.leave(rank):
                self.death(rank, f"protocol violation: it sent {env.kind}, which a rank never sends")
            return
        now = time.monotonic()
        self.live.seen(rank, now)
        if isinstance(env.record, MERGEABLE):
            self.reports.add(env.seq, env.record, msg, now)  # merged: vouched for by this relay, under its MAC (9.4)
            return
        self.report_up()  # the rank's earlier records first: the coordinator hands them on in order
        self.relay._send(self.up, msg, self.count, "upstream_control")  # verbatim: the rank's own MAC travels on
        if isinstance(env.record, Exiting) and self.live.leave(rank):
            self.death(rank, GOODBYE)

    # coordinator -> relay

    def to_rank(self, msg: list[bytes]) -> None:
        if len(msg) < 3:
            self.count["rejected.upstream_control"] += 1
            return
        route = msg[0]
        rank = rank_of(route)
        if route != RELAY_ROUTE and (rank is None or rank not in self.cfg.ranks):
            self.count["unknown_rank.upstream_control"] += 1
            return
        try:
            # To a rank: signed for that rank's stream, and forwarded without the sequence
            # check (the rank's window is the duplicate filter; a resend must pass, 10.7).
            env = self.codec.decode_from(msg[1:], Channel.CONTROL, FROM_COORDINATOR) if route == RELAY_ROUTE else \
                self.codec.decode_from(msg[1:], Channel.CONTROL, self.relay._coordinator_to[rank], replay=False)
        except AttributionError:
            self.count["forged_route.upstream_control"] += 1
            return
        except WireError as exc:
            self.count["rejected.upstream_control"] += 1
            log.warning("relay %s: rejected a record from the coordinator: %s", self.cfg.host, exc)
            return
        if route == RELAY_ROUTE:
            if isinstance(env.record, RelayHelloAck):
                self.hello.acked()
            else:
                self.count["unexpected.upstream_control"] += 1
            return
        try:
            self.relay._send(self.local, [route, *msg[1:]], self.count, "local_control")
        except zmq.ZMQError:  # EHOSTUNREACH: the rank is not connected (not yet, or any more)
            self.count["undeliverable.local_control"] += 1


class _DataPlane:
    """The data thread's handlers; owns the fold station and the consensus watch through the relay."""

    def __init__(self, relay: Relay, codec: Codec, local: zmq.Socket, up: zmq.Socket):
        self.relay, self.codec, self.local, self.up = relay, codec, local, up
        self.cfg = relay.config
        self.count = relay._counts["data"]
        self.fold, self.watch, self.stop = relay.fold, relay.watch, relay._stop
        self.mapped = SegmentMap(self.cfg.run_id, run_dir(self.cfg.key, self.cfg.run_id))  # the ranks' deposits, read-only
        self.segment: Segment | None = None  # where consensus goes by reference (None: framed to everyone)
        try:
            self.segment = Segment(self.cfg.key, self.cfg.run_id, host_owner(self.cfg.host))
        except ShmError as exc:
            self.shm_unusable(exc)
        self.by_reference: set[int] = set()  # ranks that deposit by reference
        self.hello = HelloRetry(self.cfg.hello_retry_s)
        # Kept for a resend after a reset: the host frame awaiting its consensus, and the last
        # consensus delivered (framed, and by reference while the host segment still holds it).
        self.shipped: HostFold | None = None
        self.delivered: tuple[int, list[Any], list[Any] | None] | None = None
        # int8 deposits are widened into the f32 fold; the host frame goes up in int8 again, with this
        # relay's own error feedback (what its quantization loses goes into its next frame).
        self.widener = int8.Widener(f"relay {self.cfg.host}")
        self.uplink = int8.PayloadEncoder()

    def shm_unusable(self, exc: ShmError) -> None:
        # A squatted or foreign shared-memory path must not stop the host: consensus goes framed.
        log.error("relay %s: consensus goes framed, not by reference: %s", self.cfg.host, exc)
        self.count["shm_unusable"] += 1
        if self.segment is not None:
            self.segment.close()
        self.segment = None

    def send_up(self, rec: Any, payload: Sequence[Any] = ()) -> None:
        self.relay._send(self.up, self.codec.encode(rec, payload, channel=Channel.DATA), self.count, "upstream_data",
                         copy=False)

    def live_ranks(self) -> list[int]:
        return [r for r in self.cfg.ranks if r not in self.fold.dead]

    # ranks -> relay

    def deposit(self, msg: list[zmq.Frame]) -> None:
        rank = rank_of(msg[0].bytes) if msg else None
        if rank is None or rank not in self.cfg.ranks:
            self.count["unknown_rank.local_data"] += 1
            return
        frames = msg[1:]
        env = self.relay._verify(self.codec, frames, Channel.DATA, rank, self.count, "local_data", self.mapped)
        if env is None:
            return
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
            payload = self.widener.widen(f"rank {rank}", env.payload)
        except ValueError as exc:
            self.violation(FoldError(str(exc)))
            return
        try:
            outcome = self.fold.deposit(rank, rec.round, rec.mass, payload)
        except PoisonedDeposit as exc:
            # Refused before it touched the round: this rank leaves, the others' round goes on.
            log.error("relay %s: rank %d leaves: %s", self.cfg.host, rank, exc)
            self.count["poisoned.local_data"] += 1
            self.local_death(rank)
            return
        except FoldError as exc:
            self.violation(exc)
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
            self.relay._send(self.local, [rank_identity(rank), *frames], self.count, "local_data", copy=False)
        except zmq.ZMQError:  # EHOSTUNREACH: this rank's socket is gone
            self.count["undeliverable.local_data"] += 1

    def refused(self) -> None:
        """Ranks the fold refused while summing (a poisoned deposit): they leave, as after a bad deposit."""
        while self.fold.refused:
            rank, why = self.fold.refused.pop(0)
            log.error("relay %s: rank %d leaves: %s", self.cfg.host, rank, why)
            self.count["poisoned.local_data"] += 1
            self.local_death(rank)

    def violation(self, exc: FoldError) -> None:
        # The stream is desynced: the fold holds nothing that may ship, so the
        # relay stops and the controller sees this host go (never a wrong mean).
        log.error("relay %s: protocol violation, tearing the data channel down: %s", self.cfg.host, exc)
        self.relay.error = self.relay.error or exc
        self.stop.set()

    def ship(self, outcome: HostFold | NothingToShip | None) -> None:
        if isinstance(outcome, HostFold):
            rec = HostFrame(outcome.round_id, self.cfg.host, list(outcome.ranks), outcome.mass)
            self.send_up(rec, self.uplink.encode(outcome.tensors) if self.widener.packed else outcome.tensors)
            self.watch.shipped(outcome.round_id, time.monotonic())
            self.shipped = outcome
        elif isinstance(outcome, NothingToShip):
            log.info("relay %s: %s", self.cfg.host, outcome.reason)

    def local_death(self, rank: int | None) -> None:
        if rank is None:
            return
        self.leave(rank)
        self.send_up(RankExit(rank))

    def leave(self, rank: int) -> None:
        # A rank that is gone never unlinks its own segment; the fold keeps its
        # mapping for as long as it holds a deposit from it.
        if self.shipped is not None and self.shipped.verbatim and rank in self.shipped.ranks:
            self.shipped = None  # its tensors lie in that rank's deposit; its host has nobody left to wait
        self.mapped.forget(rank_owner(rank))
        unlink_owner(self.cfg.run_id, rank_owner(rank), self.mapped.directory)
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
        try:
            env = self.codec.decode_from(msg[1:], Channel.DATA, FROM_REDUCER)
        except AttributionError:
            self.count["forged_route.upstream_data"] += 1
            return
        except WireError as exc:
            self.count["rejected.upstream_data"] += 1
            log.warning("relay %s: rejected a record from the reducer: %s", self.cfg.host, exc)
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
        log.warning("relay %s: the reducer lost this host's frame of round %d; sending it again",
                    self.cfg.host, round_id)
        self.count["frames_resent.upstream_data"] += 1
        self.send_up(HostFrame(held.round_id, self.cfg.host, list(held.ranks), held.mass), held.tensors)

    def consensus(self, frames: list[zmq.Frame], where: str) -> None:
        """A broadcast-channel record from PUB or resent point to point: verify, then deliver."""
        try:
            # No sequence check: a resend is byte-identical to the broadcast and
            # may come after later rounds; the round id is the replay guard.
            env = self.codec.decode_from(frames, Channel.BROADCAST, FROM_REDUCER, replay=False)
        except AttributionError:
            self.count[f"forged_route.{where}"] += 1
            return
        except WireError as exc:
            self.count[f"rejected.{where}"] += 1
            log.warning("relay %s: rejected a broadcast record: %s", self.cfg.host, exc)
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
        shared = None
        if self.segment is not None and self.by_reference.intersection(live):
            # Verified above and written once for every same-host rank, under this relay's signature.
            try:
                self.segment.place(env.frames[1:-1])
                shared = by_reference(self.codec, rec, env.payload, self.segment, channel=Channel.BROADCAST)
            except ShmError as exc:
                self.shm_unusable(exc)
        self.delivered = (rec.round, list(frames), shared)
        for rank in live:
            self.to_rank(rank, shared if shared is not None and rank in self.by_reference else frames)

    def request(self, round_id: int) -> None:
        log.info("relay %s: consensus of round %d not here; asking the reducer", self.cfg.host, round_id)
        self.count["consensus_requests"] += 1
        self.send_up(ConsensusRequest(round_id))

    def recover(self, now: float) -> None:
        for r in self.watch.due(now):
            self.request(r)


def run_relay(penv: ProcessEnv) -> int:
    """The relay role: broker this host's ranks until every one of them has left (or SIGTERM)."""
    assert penv.host is not None
    # CURVE keys come from the agent, which puts its own into our environment (FLODL_CURVE_*).
    s = penv.settings
    cfg = RelayConfig.for_controller(
        penv.host, penv.world[penv.host], penv.key, penv.run_id, penv.controller,
        curve=CurveKeys.for_client(os.environ), heartbeat_deadline_s=s.rank_silence_at_relay_s,
        first_contact_deadline_s=s.rank_first_record_at_relay_s, consensus_deadline_s=s.consensus_wait_at_relay_s,
        link_heartbeat_s=s.link_heartbeat_period_s, link_silence_s=s.link_silence_s,
        send_timeout_s=s.peer_send_timeout_s,
    )
    relay = Relay(cfg)
    relay.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: relay.stop(timeout=0))
    ranks = set(cfg.ranks)
    while not relay.wait(0.2):
        if ranks <= relay.fold.dead:
            # Give the last goodbye and any shipped frame time to leave before closing.
            time.sleep(0.5)
            break
    relay.stop()
    return 1 if relay.error else 0


def main() -> int:
    """`python -m flodl_zmq.relay`: how the launcher and the agent start a host's relay. It needs
    nothing of the user's script, so it runs none of it: no user code, no dataset, no model."""
    penv = ProcessEnv.from_environ()
    if penv is None or penv.role != "relay":
        raise SystemExit("python -m flodl_zmq.relay runs a host's relay for `flodl-zmq launch` or an agent; "
                         "it needs their FLODL_ROLE=relay environment")
    if penv.lifeline_fd is not None:
        watch_lifeline(penv.lifeline_fd)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_relay(penv)


if __name__ == "__main__":
    raise SystemExit(main())
