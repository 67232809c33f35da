"""The relay: one per host, the broker between the host's ranks and the controller.

This module holds the service (`Relay`: the sockets, the two threads, the
control thread's handlers); the data thread's handlers are in relay_data.py,
the rules the two apply as pure objects (liveness, the consensus watch,
merged reports, restated exits, hello retries) in relay_core.py, and the
configuration in relay_config.py. The rules below are the relay's, whichever
of them keeps each.

Sockets (protocol/PROTOCOL.md, 1 and 3.1):

    local control  ROUTER (bind, ipc:// or tcp://)  <- each rank's control DEALER
    local data     ROUTER (bind)                    <- each rank's data DEALER
    up control     DEALER -> controller control ROUTER
    up data        DEALER -> controller data ROUTER (the reducer)
    sub            SUB    -> controller PUB (consensus, probes)

A sharded run (FLODL_SHARDS, flodl_zmq/shards.py) adds an up data DEALER and
a SUB per host shard, at the shard map's address for it (relay_data.Upstream),
and a listed host's relay runs that shard's reducer service too.

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

Rules the relay keeps:

- One socket is owned by one thread. The control thread owns the two control
  sockets and the local liveness clock; the data thread owns the data sockets,
  the SUB and the fold station. Each thread runs on a ServiceLoop
  (service_loop.py): it sleeps until a socket, its mailbox or its next timer
  (a hello, a liveness deadline, a merged report, a restated exit, a consensus
  re-ask) needs it. The control thread tells the data thread of a local death
  through the data thread's mailbox (`RankGone`), so a model frame never delays
  a heartbeat and a heartbeat never races the fold.
- Every record is authenticated before it is used, and a record whose
  authenticated sender is not the rank its routing identity names is dropped
  and counted: a rank cannot speak (or deposit) for another. Rejections never
  stop the relay. A deposit that breaks a rule of the round (another round
  than the open one, another layout, a bad mass), has a NaN or infinite
  element, or a finite value far over the last consensus's, is refused before
  it joins the fold: that rank leaves and the round completes without it; so
  does a rank whose payload is of another wire format than the run's. Only
  what is no one rank's fault stops the relay: the controller and the relay
  at odds on the world. The data thread tells the control thread (RankRefused), which
  reports it to the controller (RankExit) at once: the coordinator must not
  keep scheduling a rank whose deposits no round takes. So does a rank
  whose record makes anything else here raise (`links.act_for_peer`, around
  each thread's handling of a rank's record).
- Liveness (the wheels have no ROUTER_NOTIFY): a rank is dead when it says
  goodbye (timing.exiting), when no control record arrived from it within
  `rank_silence_at_relay_s` (or `rank_first_record_at_relay_s` before its first
  one), when the controller sends DeclareDead, or when the host's agent dies
  (its lifeline closes: `Relay.orphan`). Death is permanent, leaves
  the fold barrier at once and is reported upstream as RankExit, restated
  every RESEND_AFTER_S for the rest of the run (one lost in a reset must not
  leave the controller waiting for a timeout; a repeat changes nothing).
- A consensus is delivered to every live local rank once. A round that was
  shipped and whose consensus did not come (a later round came first, or
  silence past `consensus_wait_at_relay_s`, or a reconnect of the upstream
  data link or the SUB) is requested point to point: PUB drops messages and
  a lost consensus is a correctness bug for Local SGD.
- Nothing lost in a reset stalls a round (PROTOCOL.md 10.6): the last host
  frame shipped is kept until its consensus comes and sent again when the
  reducer asks (FrameRequest); a rank that asks for its consensus
  (ConsensusRequest) gets the last one delivered again, or a FrameRequest
  when its deposit never reached the fold. A request for RESUME_ROUND (a
  resumed world's starting consensus, PROTOCOL.md 13) not yet delivered goes
  to the reducer and is watched like a shipped round. Round id + sender make a resend
  idempotent: the fold and the reducer count a crossing copy once.
- Every queue is bounded by a high-water mark counted in records. The data
  thread never waits on a send upstream: its records wait in its own queue
  (`relay_core.SendQueue`), go in order as the socket takes them, and are
  dropped together once none has gone for `peer_send_timeout_s` (counted
  `send_timeout.upstream_data`), so it goes on reading the reducer, the SUB
  and its ranks. (A reader that stopped while model-sized consensus copies
  arrived had its connection's heartbeat time out, and libzmq can abort on
  that reconnect: docs/benchmarks.md, bench/topology.py.) A send to a local
  rank or up the control link waits, bounded (`Plane.send`).
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
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from flodl_zmq.environment import ProcessEnv, behind_the_ranks, watch_lifeline
from flodl_zmq.errors import ConfigError, FlodlError
from flodl_zmq.fold import FoldStation
from flodl_zmq.links import (
    CONTROL_MAX_FRAME_BYTES,
    CONTROL_MAX_FRAMES,
    DATA_MAX_FRAME_BYTES,
    FROM_COORDINATOR,
    RELAY_ROUTE,
    act_for_peer,
    bind_local,
    coordinator_sender,
    decode_or_count,
    drain,
    keep_alive,
    limit_receive,
    rank_of,
    relay_identity,
    relay_sender,
    remove_ipc,
    route_refusal,
    tune,
    tune_loopback,
)
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.relay_core import (
    MERGE_PERIOD_S,
    ConsensusWatch,
    Departures,
    HelloRetry,
    RankLiveness,
    ReportQueue,
    SendQueue,
)
from flodl_zmq.relay_data import DataPlane, Plane, RankGone, RankRefused, Upstream
from flodl_zmq.security import CurveKeys, apply_client
from flodl_zmq.service_loop import ServiceLoop
from flodl_zmq.tensors import preload
from flodl_zmq.wire import Attribution, Channel, Codec
from flodl_zmq.wire.records import (
    MERGEABLE,
    RANK_CONTROL_RECORDS,
    Exiting,
    HostReports,
    RankExit,
    RelayHello,
    RelayHelloAck,
)
from flodl_zmq.wire_format import WireFormat

log = logging.getLogger(__name__)

GOODBYE = "said goodbye"


class AgentGone:
    """`Relay.orphan`'s word to the control thread, which owns the ranks' liveness."""


class Relay:
    """One host's relay: control byte router, data fold station, consensus fan-out.

    `start()` binds the local endpoints (ranks may connect as soon as it
    returns), dials the controller and runs two threads until `stop()`, or
    until a fold protocol violation stops it (then `error` holds the cause).
    `counters()` reports every drop and rejection by cause and socket.
    Pass a shared `context` to use inproc:// endpoints.
    """

    def __init__(self, config: RelayConfig, context: zmq.Context | None = None, shard: ReducerConfig | None = None):
        """`shard`: the reducer shard this relay's process runs, exactly when the run's shard map lists its host."""
        if (shard is None) != (config.shards.shard_of(config.host) is None):
            raise ConfigError(f"relay {config.host}: the shard map {str(config.shards) or '(none)'} "
                              + ("lists this host, so its relay must run that shard" if shard is None
                                 else "does not list this host, yet it was given a shard to run"))
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ready = threading.Barrier(3)
        # Built here, so each thread can reach the other's mailbox from its first turn.
        self._control_thread = ServiceLoop(f"relay-{config.host}-control")
        self._data_thread = ServiceLoop(f"relay-{config.host}-data")
        self._counts: dict[str, collections.Counter[str]] = {"control": collections.Counter(), "data": collections.Counter()}
        self.error: BaseException | None = None
        self.orphaned = False  # `orphan`
        self.fold = FoldStation(config.ranks, unfolded=config.aggregation != "mean")
        self.shard = None if shard is None else ReducerService(shard)
        # Both upstream DEALERs carry it: stable for this process, so a reconnect keeps the route.
        self.identity = relay_identity(config.host, os.urandom(8))

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 10.0) -> None:
        """Bind, connect, and run; raises if a socket cannot be set up."""
        if self.shard is not None:
            self.shard.start(timeout)  # bound before any relay dials it
        for name, target in (("control", self._control_main), ("data", self._data_main)):
            t = threading.Thread(target=target, name=f"relay-{self.config.host}-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        try:
            self._ready.wait(timeout)
        except threading.BrokenBarrierError:
            self.stop()
            raise FlodlError(f"relay {self.config.host} failed to start: {self.error}") from self.error
        log.info("relay %s up: ranks %s, local %s / %s, aggregation %s%s", self.config.host, list(self.config.ranks),
                 self.config.local_control, self.config.local_data, self.config.aggregation,
                 "" if self.shard is None else f", reducer shard {self.shard.config.shard} at {self.shard.config.data_bind}")

    def stop(self, timeout: float = 5.0) -> None:
        """Stop both threads and close their sockets (idempotent)."""
        self._halt()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)
        if self.shard is not None:
            self.shard.stop(timeout)

    def orphan(self) -> None:
        """The agent (or launcher) that started this host's processes is gone, and the ranks with it: report each
        live one gone now, as a failure (its goodbye, if it sent one, came first), so the run acts on it at once."""
        self.orphaned = True
        self._control_thread.put(AgentGone())

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
            self._fail(exc)
            self._ready.abort()

    def _fail(self, exc: BaseException) -> None:
        """Stop the relay for `exc`; the first cause is the one kept."""
        self.error = self.error or exc
        self._halt()

    def _halt(self) -> None:
        # The event ends a send waiting on a full queue; the Stops end the loops.
        self._stop.set()
        self._control_thread.stop()
        self._data_thread.stop()

    # ------------------------------------------------------------------ control thread

    def _control_main(self) -> None:
        self._run("control", self._control_loop)

    def _control_loop(self) -> None:
        cfg, ctx = self.config, self._ctx
        local = ctx.socket(zmq.ROUTER)
        up = ctx.socket(zmq.DEALER)
        bound = ""  # the local endpoint this thread bound: its socket file is unlinked at exit
        try:
            for s in (local, up):
                tune(s, cfg.hwm_records, cfg.send_retry_s)
                limit_receive(s, CONTROL_MAX_FRAME_BYTES)
            local.setsockopt(zmq.ROUTER_MANDATORY, 1)
            bind_local(local, cfg.local_control)
            bound = cfg.local_control
            if cfg.curve is not None:
                apply_client(up, cfg.curve)
            up.setsockopt(zmq.ROUTING_ID, self.identity)
            keep_alive(up, cfg.control_upstream, cfg.link_heartbeat_period_s, cfg.link_silence_s)
            up.connect(cfg.control_upstream)
            self._ready.wait()
            plane = _ControlPlane(cfg, self._stop, self._counts["control"], local, up, self._data_thread)
            plane.serve(self._control_thread)
        finally:
            self._control_thread.close()
            for s in (local, up):
                s.close(0)
            remove_ipc(bound)

    # ------------------------------------------------------------------ data thread

    def _data_main(self) -> None:
        self._run("data", self._data_loop)

    def _data_loop(self) -> None:
        cfg, ctx = self.config, self._ctx
        codec = Codec(cfg.key, cfg.incarnation, relay_sender(cfg.host))
        local = ctx.socket(zmq.ROUTER)
        links: list[Upstream] = []
        d: DataPlane | None = None
        bound = ""
        try:
            for k in range(cfg.shards.count):
                links.append(self._upstream(ctx, k))
            tune(local, cfg.data_hwm_records, cfg.send_retry_s)
            limit_receive(local, DATA_MAX_FRAME_BYTES)
            local.setsockopt(zmq.ROUTER_MANDATORY, 1)
            bind_local(local, cfg.local_data)
            bound = cfg.local_data
            self._ready.wait()
            d = DataPlane(cfg, self._stop, self._counts["data"], codec, local, links, self.fold, self._fail,
                          self._control_thread, self.shard)
            d.serve(self._data_thread)
        finally:
            self._data_thread.close()
            for link in links:
                for sock, monitor in link.monitors.items():
                    sock.disable_monitor()
                    monitor.close(0)
            for s in [local] + [s for link in links for s in (link.up, link.sub)]:
                s.close(0)
            remove_ipc(bound)
            if d is not None and d.segment is not None:
                d.segment.close()

    def _upstream(self, ctx: zmq.Context, shard: int) -> Upstream:
        """The data DEALER and the SUB of reducer shard `shard`, dialled (0: the controller's reducer)."""
        cfg = self.config
        data, bcast = cfg.upstream(shard)
        up, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
        for s in (up, sub):
            tune(s, cfg.data_hwm_records, cfg.send_retry_s)
            limit_receive(s, DATA_MAX_FRAME_BYTES)
            if cfg.curve is not None:
                apply_client(s, cfg.curve)
        tune_loopback(up, data)
        up.setsockopt(zmq.ROUTING_ID, self.identity)
        keep_alive(up, data, cfg.link_heartbeat_period_s, cfg.link_silence_s)
        keep_alive(sub, bcast, cfg.link_heartbeat_period_s, cfg.link_silence_s)
        # Before dialling: a connection made before the monitor was would make the first one it sees a reconnect's.
        monitors = {s: s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) for s in (up, sub)}
        up.connect(data)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(bcast)
        return Upstream(shard, up, sub, ConsensusWatch(cfg.consensus_wait_at_relay_s), HelloRetry(cfg.hello_retry_s),
                        SendQueue(cfg.peer_send_timeout_s), monitors=monitors)


class _ControlPlane(Plane):
    """The control thread's handlers: ranks' records up, the coordinator's down, the local liveness clock."""

    def __init__(self, cfg: RelayConfig, stop: threading.Event, count: collections.Counter[str], local: zmq.Socket,
                 up: zmq.Socket, data_thread: ServiceLoop):
        super().__init__(cfg, stop, count, Codec(cfg.key, cfg.incarnation, relay_sender(cfg.host)))
        self.local, self.up, self.data_thread = local, up, data_thread
        self.coordinator_to = {r: Attribution.signed_by(coordinator_sender(r), "the coordinator's link")
                               for r in cfg.ranks}
        self.hello = HelloRetry(cfg.hello_retry_s)
        self.live = RankLiveness(cfg.ranks, time.monotonic(), cfg.rank_silence_at_relay_s, cfg.rank_first_record_at_relay_s)
        self.departed = Departures()
        self.reports = ReportQueue(cfg.ranks, MERGE_PERIOD_S)

    def serve(self, loop: ServiceLoop) -> None:
        """Until the relay stops: ranks' records, the coordinator's records, and the timers (hello,
        due reports, liveness deadlines, restated exits); this process's own stall is no rank's silence."""
        loop.on_socket(self.local, lambda: self.drained(self.local, self.from_rank))
        loop.on_socket(self.up, lambda: self.drained(self.up, self.to_rank))
        loop.on_stall(self.live.stalled)
        loop.on_message(RankRefused, lambda refused: self.violation(refused.rank, refused.why))
        loop.on_message(AgentGone, lambda _: self.agent_gone())
        loop.timer(self.hello.next_due, self.say_hello)
        loop.timer(self.live.next_due, self.expire)
        loop.timer(lambda: self.reports.due_at, lambda now: self.report_up())
        loop.timer(lambda: self.departed.due_at, self.restate)
        loop.run()

    def drained(self, sock: zmq.Socket, handle: Callable[[list[bytes]], None]) -> None:
        self.count["oversized"] += drain(sock, handle, max_frames=CONTROL_MAX_FRAMES)

    def say_hello(self, now: float) -> None:
        if self.hello.due(now):
            self.send_own(RelayHello(self.cfg.host, list(self.cfg.ranks), [], self.cfg.host_token))

    def expire(self, now: float) -> None:
        for rank in self.live.expired(now):
            self.death(rank, "heartbeat deadline passed")

    def send_own(self, rec: Any) -> None:
        """Send one of this relay's own records up (route RELAY_ROUTE), signed by the relay."""
        self.send(self.up, [RELAY_ROUTE, *self.codec.encode(rec, channel=Channel.CONTROL)], "upstream_control")

    def report_up(self) -> None:
        held = self.reports.take()
        if isinstance(held, HostReports):
            self.send_own(held)
        elif held is not None:
            self.send(self.up, held, "upstream_control")  # a lone record, verbatim (route, frames)

    def death(self, rank: int, why: str) -> None:
        # A goodbye is the normal end of a rank; only a silent departure deserves a warning.
        level = logging.INFO if why == GOODBYE else logging.WARNING
        log.log(level, "relay %s: rank %d left (%s)", self.cfg.host, rank, why)
        self.report_up()  # what it reported before it left comes first
        self.reports.leave(rank)
        self.send_own(RankExit(rank))
        self.departed.add(rank, time.monotonic())
        self.data_thread.put(RankGone(rank))

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
        env = self.verify(msg[1:], Channel.CONTROL, rank, "local_control", replay=False)
        if env is not None:  # whatever acting on it raises is this rank's violation, never the relay's end
            act_for_peer(f"rank {rank}", lambda: self.act_on(rank, env, msg), lambda why: self.violation(rank, why),
                         self.count, "local_control", log, f"relay {self.cfg.host}")

    def violation(self, rank: int, reason: str) -> None:
        """`rank` broke the protocol: it is out, as for any departure."""
        if self.live.leave(rank):
            self.death(rank, reason)

    def agent_gone(self) -> None:
        """The host's agent is gone (`Relay.orphan`): each rank still here goes with it."""
        for rank in sorted(self.live.roster - self.live.dead):
            self.violation(rank, "its host's agent is gone (its lifeline closed)")

    def act_on(self, rank: int, env: Any, msg: list[bytes]) -> None:
        """A record of `rank`, authentic and its own: merged or sent up."""
        if type(env.record) not in RANK_CONTROL_RECORDS:
            # A kind only the coordinator or a relay sends: the rank is out, as for any violation.
            self.count["illegal_kind.local_control"] += 1
            self.violation(rank, f"protocol violation: it sent {env.kind}, which a rank never sends")
            return
        now = time.monotonic()
        self.live.seen(rank, now)
        if isinstance(env.record, MERGEABLE):
            self.reports.add(env.seq, env.record, msg, now)  # merged: vouched for by this relay, under its MAC (9.4)
            return
        self.report_up()  # the rank's earlier records first: the coordinator hands them on in order
        self.send(self.up, msg, "upstream_control")  # verbatim: the rank's own MAC travels on
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
        # To a rank: signed for that rank's stream, and forwarded without the sequence
        # check (the rank's window is the duplicate filter; a resend must pass, 10.7).
        env = decode_or_count(
            lambda: self.codec.decode_from(msg[1:], Channel.CONTROL, FROM_COORDINATOR) if route == RELAY_ROUTE else
            self.codec.decode_from(msg[1:], Channel.CONTROL, self.coordinator_to[rank], replay=False),
            self.count, route_refusal("upstream_control"), log, f"relay {self.cfg.host} (upstream_control)")
        if env is None:
            return
        if route == RELAY_ROUTE:
            if isinstance(env.record, RelayHelloAck):
                self.hello.acked()
            else:
                self.count["unexpected.upstream_control"] += 1
            return
        try:
            self.send(self.local, [route, *msg[1:]], "local_control")
        except zmq.ZMQError:  # EHOSTUNREACH: the rank is not connected (not yet, or any more)
            self.count["undeliverable.local_control"] += 1


def shard_config(penv: ProcessEnv, cfg: RelayConfig) -> ReducerConfig | None:
    """The reducer shard this host runs when the run's shard map lists it (shards.py), else None.

    It binds the map's address for the host, serves the whole world as the controller's reducer
    does, and proves each relay's hello with the run's route secret (FLODL_ROUTE_SECRET).
    """
    k = cfg.shards.shard_of(cfg.host)
    if k is None:
        return None
    data, bcast = cfg.shards.endpoints(k)
    s = penv.settings
    return ReducerConfig(world={h: tuple(sorted(rs)) for h, rs in penv.world.items()}, key=cfg.key,
                         incarnation=cfg.incarnation, data_bind=data, bcast_bind=bcast,
                         link_heartbeat_period_s=s.link_heartbeat_period_s, link_silence_s=s.link_silence_s,
                         wire=cfg.wire, aggregation=cfg.aggregation, route_secret=penv.need_route_secret(), shard=k)


def run_relay(penv: ProcessEnv, wire: WireFormat | None = None) -> int:
    """The relay role: broker this host's ranks until every one of them has left (or SIGTERM, or its agent's death).

    `wire`: the run's wire format when the caller knows it (a user's script run as the relay);
    else the one its environment announces (FLODL_WIRE_DTYPE), if any (wire_format.py).
    """
    assert penv.host is not None
    # CURVE keys come from the agent, which puts its own into our environment (FLODL_CURVE_*).
    s = penv.settings
    cfg = RelayConfig.for_controller(
        penv.host, penv.world[penv.host], penv.key, penv.incarnation, penv.controller,
        curve=CurveKeys.for_client(os.environ), rank_silence_at_relay_s=s.rank_silence_at_relay_s,
        rank_first_record_at_relay_s=s.rank_first_record_at_relay_s, consensus_wait_at_relay_s=s.consensus_wait_at_relay_s,
        link_heartbeat_period_s=s.link_heartbeat_period_s, link_silence_s=s.link_silence_s,
        peer_send_timeout_s=s.peer_send_timeout_s, wire=s.wire if wire is None else wire, aggregation=s.aggregation,
        host_token=penv.host_token or b"", shards=s.shard_map,
    )
    if cfg.wire is not None:
        preload(cfg.wire.element)  # while the ranks start, not in the first round (a bf16 sum is torch's)
    with behind_the_ranks():
        relay = Relay(cfg, shard=shard_config(penv, cfg))
        relay.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: relay.stop(timeout=0))
        if penv.lifeline_fd is not None:
            watch_lifeline(penv.lifeline_fd, relay.orphan)
        ranks = set(cfg.ranks)
        while not relay.wait(0.2):
            # A host's shard reduces every host's slice: its relay stays until no rank of the run is left,
            # or its agent is gone (the run then loses the shard with the host).
            if ranks <= relay.fold.dead and (relay.orphaned or relay.shard is None or not relay.shard.serving()):
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
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_relay(penv)


if __name__ == "__main__":
    raise SystemExit(main())
