"""The reducer service: the controller's data plane around the RoundLedger core (flodl_zmq/reducer.py).

Sockets: a data ROUTER (relays' data DEALERs) and a PUB (relays' SUBs), both
owned by one thread. Framing toward a relay on the data ROUTER is
``[tag, header, payload..., mac]``, ``tag`` naming the channel the record was
encoded for (see flodl_zmq.relay): ``b"data"`` for the reducer's own data
records, ``b"bcast"`` for a consensus resent point to point, byte-identical
to the broadcast.

Rules this module keeps:

- Every record is authenticated before use; a relay is known only after an
  authenticated RelayHello that carries its host's token (checked before the
  hello's sequence number is recorded, so another member cannot take or lock
  out a host) and matches the world it was built with, and later records
  must be signed by that relay. Rejections are logged and
  counted, never fatal.
- A relay is counted as a subscriber only after it answered a Probe seen on
  PUB (PUB silently drops messages for peers that are not yet subscribed).
  Until then a consensus reaches it point to point.
- Each consensus is encoded once and published with its round id; the
  latest stays resendable for a relay that asks (ConsensusRequest). A request
  the ledger cannot serve is answered ConsensusGone, never ignored; one for
  an open round whose host frame never came is answered FrameRequest (the
  frame was lost in a reset; PROTOCOL.md 10.6).
- The reducer is told the run's wire format (`ReducerConfig.wire`, the
  Job's): a host frame of another is refused as a protocol violation at the
  first one, naming the setting (flodl_zmq/wire_format.py, `Hop`).
- A service that starts from a checkpoint (`resumed`) holds the checkpoint's
  consensus as its latest, encoded in the run's wire format like a broadcast
  (`WireFormat.resume_payload`):
  the ranks of a resumed or re-formed world ask for that round and get their
  starting model over the wire, never from a file (PROTOCOL.md 13).
- Each death reaches the owning relay as DeclareDead at once (or when the
  relay registers), and is restated every RESEND_AFTER_S for the rest of the
  run: one lost in a reset must not leave a wedged rank in the host's fold
  until the relay's own heartbeat deadline (PROTOCOL.md 10.7 item 8). A death
  the relay reported itself (RankExit) is not echoed back. In a sharded run
  every death also goes, and is restated, to each shard host's relay
  (`ReducerConfig.shard_hosts`; the owner's only once): a shard whose round
  waited for a dead rank's host would hang it.
- A host shard (`ReducerConfig.shard` > 0) sums no frame before its start
  (`data.shard_start`, PROTOCOL.md 10.9 item 11; `reducer.StartGate`), its
  slice's outer step; for a bundle, each shard sends its state (item 12).
- A relay that breaks the round protocol (a round ahead, schema drift, a
  non-finite element, more mass than the coordinator's bound) has
  every one of its ranks declared dead: a desynced host must not wedge the
  run, and the ledger never sums its polluted frame. So does one whose
  record makes anything here raise (`links.act_for_peer`, the one boundary
  in `_on_message`): no record a relay can sign ends the reducer.
- No send waits on a relay: a relay that stops reading has what would
  overflow its queue dropped (counted `peer_full`) and asks for it again
  (ConsensusRequest), so it never delays another host's round. The data
  socket refuses a frame longer than the model's (`max_frame_bytes`,
  PROTOCOL.md 6.1).
- Other threads talk to the service through thread-safe methods
  (`declare_dead`, `drop_broadcast`) and read outcomes from `completed`.
  Both directions are Mailboxes (flodl_zmq.mailbox): commands (typed:
  `DeclareDead`, `BoundRound`, `DropBroadcast`) wake this thread's
  ServiceLoop (flodl_zmq.service_loop) at once, and `completed` wakes a loop
  that polls it next to its sockets. The loop sleeps in poll until a
  message, a command or its next timer (a probe, a restatement), with no
  polling interval.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import zmq

from flodl_zmq.errors import (
    AttributionError,
    ConfigError,
    FlodlError,
    MassOverBound,
    PoisonedDeposit,
    ProtocolError,
    WireError,
)
from flodl_zmq.io_threads import controller_context, io_affinity
from flodl_zmq.links import (
    TAG_BCAST,
    TAG_DATA,
    Refusal,
    act_for_peer,
    decode_or_count,
    drain,
    hello_signer,
    keep_alive,
    limit_receive,
    reducer_sender,
    relay_sender,
    send_by_reference,
    take_over_routes,
    tune,
    tune_loopback,
)
from flodl_zmq.mailbox import Mailbox
from flodl_zmq.outer import OuterOptimizer
from flodl_zmq.reducer import Abandoned, Gone, Reduced, RoundLedger, StartGate
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_messages import (
    BoundRound,
    DeclareDead,
    DropBroadcast,
    HostRefused,
    OuterSlice,
    RoundOutcome,
    StartFrom,
    WantState,
)
from flodl_zmq.security import apply_server
from flodl_zmq.service_loop import ServiceLoop
from flodl_zmq.shards import state_frames
from flodl_zmq.wire import Attribution, Channel, Codec, Envelope
from flodl_zmq.wire.records import (
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
    ShardStart,
    SubscriberReady,
)
from flodl_zmq.wire.stream import RESEND_AFTER_S
from flodl_zmq.wire_format import Hop

log = logging.getLogger(__name__)


# How long a frame whose mass is over its bound waits for the bound to rise before it is refused: a rank's
# last steps (reported before its deposit) reach the coordinator on the control path, which raises the bound
# when it hears the rank's snapshot, while the frame travels the data path (PROTOCOL.md 9.5).
MASS_WAIT_S = 2.0


class _OverBound(NamedTuple):
    """A host frame over its mass bound, held until `deadline` for the bound to rise (MASS_WAIT_S)."""

    deadline: float
    host: str
    frame: HostFrame
    payload: list[Any]


class ReducerService:
    """The controller's data plane: collect HostFrames, reduce, publish, recover, forward deaths.

    `start()` binds and runs the service thread; `stop()` ends it. Deaths the
    coordinator decides go in through `declare_dead(rank)`; each finished or
    abandoned round comes out on the `completed` Mailbox as a RoundOutcome
    (and, if the service thread fails, one last outcome with no round that
    names the failure, so a loop waiting on `completed` wakes to see `error`).
    `drop_broadcast(round)` is a test hook: that round's broadcast is not sent
    (relays must recover it point to point). Pass a shared `context` for inproc.
    The PUB is also bound on `local_bcast` (inproc): the controller's own copy of
    each consensus comes from there, without a loopback TCP hop (or CURVE) for
    every model.
    """

    def __init__(self, config: ReducerConfig, context: zmq.Context | None = None,
                 outer: OuterOptimizer | None = None, resumed: tuple[int, list[np.ndarray]] | None = None,
                 starts: Mapping[str, tuple[ShardStart, list[np.ndarray]]] | None = None):
        """`starts` (the controller's reducer of a sharded run): by host, what each host shard starts from,
        sent to its relay with its hello acknowledgement (`controller_shards.shard_starts`, `_send_start`)."""
        self.config = config
        self.ledger = RoundLedger(config.world, outer, config.aggregation)
        if resumed is not None and not (config.wire is not None and config.wire.is_payload(resumed[1])):
            raise ConfigError(f"the resumed consensus is not a payload of the run's wire format {config.wire} "
                              "(WireFormat.resume_payload)")
        self._resumed = resumed  # (round, payload in the wire format): the starting consensus, see WireFormat.resume_payload
        if resumed is not None:
            self.ledger.start_at(*resumed)
        # Held while the ledger may step the outer state, and by `outer_state`: a save must not
        # copy a global model and a momentum from two different rounds.
        self._outer_lock = threading.Lock()
        # Host frames are held to the run's wire format; int8 ones are widened into the f32 reduce,
        # and the consensus goes out in int8 again, with the reducer's own error feedback.
        self._hop = Hop("reducer", config.wire, ProtocolError)
        self.completed: Mailbox[RoundOutcome | HostRefused | OuterSlice] = Mailbox()
        self.error: BaseException | None = None
        self._ctx = context or controller_context()
        self._service = ServiceLoop("reducer")  # its mailbox carries the commands
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._count: collections.Counter[str] = collections.Counter()
        self._route: dict[str, bytes] = {}  # host -> relay routing id
        self._lost: dict[str, tuple[int, int]] = {}  # host -> (round, times) its frame of that round was lost
        self._host_of: dict[bytes, str] = {}
        self._subscribed: set[str] = set()
        self._forwarded: set[int] = set()
        self._restate: list[tuple[str, int]] = []  # (host, rank) this service told, restated until the end
        self._restate_at = math.inf
        self._over_bound: list[_OverBound] = []  # frames waiting for their mass bound to rise
        self._drop: set[int] = set()
        self._starts = dict(starts or {})
        self._start_sent: dict[str, tuple[int, float]] = {}  # host -> (starts sent, when the next may go)
        self._gate = StartGate(config.shard)  # a host shard sums no frame before its start
        self._state_wanted: int | None = None  # the round from which the outer state is wanted (want_state)
        self._bounded = -1  # the latest round bound_round opened
        self._nonce = itertools.count(1)
        self._last_nonce = 0
        self._next_probe = 0.0
        self._latest_frames: tuple[int, list[Any], Sequence[np.ndarray]] | None = None  # round, frames, buffers
        # The newest consensus published (its payload in the wire format), for a reader once this service stopped.
        self.published: tuple[Consensus, Sequence[np.ndarray]] | None = None
        self.local_bcast = f"inproc://flodl-bcast-{id(self):x}"

    # ------------------------------------------------------------------ API (any thread)

    def start(self, timeout: float = 10.0) -> None:
        """Bind both endpoints and run; raises if they cannot be bound."""
        self._thread = threading.Thread(target=self._main, name="reducer", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout) or self.error is not None:
            self.stop()
            raise FlodlError(f"reducer failed to start: {self.error}") from self.error

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the service thread and close its sockets (idempotent)."""
        self._service.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # Only once the loop is gone: a descriptor closed under its poll could be reused.
            self._service.close()
            self.completed.close()

    def declare_dead(self, rank: int) -> None:
        """The coordinator declared `rank` dead: out of every barrier, forwarded to its relay (and restated)."""
        self._service.put(DeclareDead(int(rank)))

    def bound_round(self, round_id: int, bounds: Mapping[int, float], opens: bool = True) -> None:
        """The coordinator's mass bound per rank for `round_id` (RoundLedger.bound_round).

        Call it before the round's RequestParams (or the plan that tells a
        deposit ahead) go out: commands are handled before the frames that
        arrive with them, so the bound is in place first.
        """
        self._service.put(BoundRound(int(round_id), dict(bounds), opens))

    def start_from(self, record: ShardStart, payload: Sequence[Any]) -> None:
        """A host shard's start, as its relay took it from the controller's reducer (PROTOCOL.md 10.9 item 11):
        the first one holds; one this shard cannot use fails the service (its relay, and the run, stop)."""
        self._service.put(StartFrom(record, list(payload)))

    def want_state(self, round_id: int) -> None:
        """This shard's outer state of its first round at or after `round_id` (now, if it has one) on `completed`
        as an OuterSlice (PROTOCOL.md 10.9 item 12); the controller's reducer asks each host shard too."""
        self._service.put(WantState(int(round_id)))

    def drop_broadcast(self, round_id: int) -> None:
        """Test hook: do not send the consensus of `round_id` (neither on PUB nor point to point)."""
        self._service.put(DropBroadcast(int(round_id)))

    def counters(self) -> dict[str, int]:
        """Every rejection, drop and recovery so far, keyed by cause, plus the ledger's counters."""
        out = dict(self._count)
        lc = self.ledger.counters
        out.update(late_frames=lc.late_drops, duplicate_frames=lc.duplicate_drops, dead_host_frames=lc.dead_host_drops,
                   rounds_reduced=lc.rounds_reduced, rounds_abandoned=lc.rounds_abandoned)
        return out

    def outer_state(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Copies of the outer optimizer's (global model, momentum) as of one round; None without one."""
        outer = self.ledger.outer
        if outer is None:
            return None
        with self._outer_lock:
            return outer.global_model.copy(), outer.momentum.copy()

    def serving(self) -> bool:
        """Whether a host still has a live rank: a round may still come (a host's shard serves until none does)."""
        return bool(self.ledger.expected_hosts())

    def subscribed(self) -> set[str]:
        """Hosts whose relays proved they receive the broadcast."""
        return set(self._subscribed)

    # ------------------------------------------------------------------ service thread

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the data plane must not die silently
            log.exception("reducer: service thread failed")
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """This service ends for `exc`: `error` set, and one last outcome naming it wakes whoever waits on it."""
        self.error = exc
        self._ready.set()
        self.completed.put(RoundOutcome(None, 0.0, (), f"the reducer failed: {exc}"))
        self._service.stop()  # the loop ends after this turn (a no-op once it has)

    def _loop(self) -> None:
        cfg = self.config
        self._codec = Codec(cfg.key, cfg.incarnation, reducer_sender(cfg.shard))
        if self._resumed is not None:  # served on request only (ConsensusRequest), as a resend is
            round_id, payload = self._resumed
            self._latest_frames = (round_id, self._codec.encode(Consensus(round_id, 1.0), payload,
                                                                channel=Channel.BROADCAST), payload)
        self._data = data = self._ctx.socket(zmq.ROUTER)
        self._pub = pub = self._ctx.socket(zmq.PUB)
        try:
            for s in (data, pub):
                tune(s, cfg.hwm_records, send_retry_s=0.0)  # no send here waits (`_to_relay`; PUB drops)
            data.setsockopt(zmq.ROUTER_MANDATORY, 1)
            limit_receive(data, cfg.max_frame_bytes)
            take_over_routes(data)  # a relay's data DEALER keeps its identity across reconnects
            keep_alive(data, cfg.data_bind, cfg.link_heartbeat_period_s, cfg.link_silence_s)
            keep_alive(pub, cfg.bcast_bind, cfg.link_heartbeat_period_s, cfg.link_silence_s)
            affinity = io_affinity(self._ctx)
            data.setsockopt(zmq.AFFINITY, affinity.data)
            pub.setsockopt(zmq.AFFINITY, affinity.pub)
            tune_loopback(pub, cfg.bcast_bind)
            if cfg.curve is not None:
                apply_server(data, cfg.curve)
                apply_server(pub, cfg.curve)
            data.bind(cfg.data_bind)
            pub.bind(cfg.bcast_bind)
            pub.bind(self.local_bcast)
            self._ready.set()
            # Commands first in a turn (the loop's rule): a bound is in place before the frames it bounds.
            loop = self._service
            # A host shard hears the coordinator's deaths from its relay, after the controller's reducer told the
            # owner's relay itself (PROTOCOL.md 10.9 item 6): it forwards none of them.
            loop.on_message(DeclareDead, lambda cmd: self._death(cmd.rank, None, owner_knows=self.config.shard != 0))
            loop.on_message(BoundRound, self._bound)
            loop.on_message(DropBroadcast, lambda cmd: self._drop.add(cmd.round_id))
            loop.on_message(StartFrom, self._start)
            loop.on_message(WantState, self._want_state)
            loop.on_socket(data, lambda: self._drained(data))
            loop.timer(lambda: self._next_probe if self._unsubscribed() else math.inf, self._probe)
            loop.timer(lambda: self._restate_at, self._restate_deaths)
            loop.timer(lambda: min((e.deadline for e in self._over_bound), default=math.inf),
                       lambda now: self._retake_frames())
            loop.run()
        finally:
            data.close(0)
            pub.close(0)

    def _unsubscribed(self) -> list[str]:
        expected = self.ledger.expected_hosts()
        return [h for h in self._route if h in expected and h not in self._subscribed]

    def _drained(self, data: zmq.Socket) -> None:
        self._count["oversized"] += drain(data, self._on_message, copy=False, budget=64)

    def _bound(self, cmd: BoundRound) -> None:
        if cmd.opens:
            self._bounded = cmd.round_id
        with self._outer_lock:
            outcome = self.ledger.bound_round(cmd.round_id, cmd.bounds, cmd.opens)
        self._settled(outcome)  # not under the lock: its publication may offer the outer state, which takes it
        self._retake_frames(cmd.round_id)

    def _probe(self, now: float) -> None:
        """Publish a probe while a relay has not proved it receives the broadcast (SubscriberReady)."""
        self._last_nonce = next(self._nonce)
        self._pub.send_multipart(self._codec.encode(Probe(self._last_nonce), channel=Channel.BROADCAST))
        self._next_probe = now + self.config.probe_interval_s

    def _to_relay(self, route: bytes, tag: bytes, frames: list[Any], consensus: Sequence[np.ndarray] = ()) -> None:
        """Send to one relay, never waiting: one relay that stops reading must not delay the others' rounds.

        A full queue drops the record (counted `peer_full`); what it carried is
        asked for again (PROTOCOL.md 10.5 item 6). `consensus`: the buffers the
        frames carry by reference, held from the next rounds until sent.
        """
        try:
            if consensus:
                self.ledger.hold(consensus, send_by_reference(self._data, [route, tag, *frames], zmq.NOBLOCK))
            else:
                self._data.send_multipart([route, tag, *frames], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._count["peer_full"] += 1
            log.warning("reducer: relay route %r stopped reading (its queue is full); a record to it was dropped", route)
        except zmq.ZMQError:  # EHOSTUNREACH: the relay's connection is gone
            self._count["undeliverable"] += 1

    def _send_record(self, host: str, rec: Any) -> None:
        self._to_relay(self._route[host], TAG_DATA, self._codec.encode(rec, channel=Channel.DATA))

    def _on_message(self, msg: list[zmq.Frame]) -> None:
        route = msg[0].bytes

        def relay_of(rec: Any) -> Attribution:
            # The relay this route belongs to; a hello names its own, proved by its host's token
            # (and _hello binds the route to it).
            where = f"relay route {route!r}"
            if isinstance(rec, RelayHello):
                return hello_signer(self.config.route_secret, rec, where)
            host = self._host_of.get(route)
            return Attribution.nobody(where) if host is None else Attribution.signed_by(relay_sender(host), where)

        def refusal(exc: WireError) -> Refusal:
            if isinstance(exc, AttributionError):
                if exc.kind == RelayHello.KIND:
                    return Refusal("bad_hello", logging.ERROR)
                return Refusal("unknown_peer" if exc.expected is None else "forged_sender")
            return Refusal("rejected")

        env = decode_or_count(lambda: self._codec.decode_from(msg[1:], Channel.DATA, relay_of), self._count, refusal,
                              log, "reducer")
        if env is None:
            return
        if isinstance(env.record, RelayHello):
            act_for_peer(f"relay connection {route!r}", lambda: self._hello(route, env.record), lambda reason: None,
                         self._count, "data", log, "reducer")  # not registered: nobody to drop
            return
        host = self._host_of[route]
        act_for_peer(f"the relay of {host}", lambda: self._on_record(host, env),
                     lambda reason: self._drop_host(host, reason), self._count, "data", log, "reducer")

    def _on_record(self, host: str, env: Envelope) -> None:
        """An attributed record of `host`'s relay (its hello aside)."""
        rec = env.record
        if isinstance(rec, HostFrame):
            if rec.round > self._bounded:
                self._service.dispatch_queued()  # a bound put before this round's requests went out is in place first
            if rec.host != host or not set(rec.ranks) <= set(self.config.world[host]):
                self._count["forged_sender"] += 1
                return
            try:
                payload = self._hop.take(f"host {host!r}", env.payload)
            except ProtocolError as exc:
                self._violation(host, exc)
                return
            if not self._gate.started:
                self._count["frames_before_start"] += 1
                self._gate.hold(host, rec, payload)
                return
            self._take_frame(host, rec, payload, time.monotonic() + MASS_WAIT_S)
        elif isinstance(rec, RankExit):
            if rec.rank in self.config.world[host]:
                self._death(rec.rank, reported_by=host)
            else:
                self._count["forged_sender"] += 1
        elif isinstance(rec, SubscriberReady):
            if rec.host == host and 1 <= rec.nonce <= self._last_nonce:
                self._subscribed.add(host)
        elif isinstance(rec, OuterState):
            hosts = self.config.shard_hosts
            if self.config.shard != 0 or not 1 <= rec.shard <= len(hosts) or hosts[rec.shard - 1] != host:
                self._count["forged_sender"] += 1  # only a shard's own relay speaks for it, to the controller's
                return
            self.completed.put(OuterSlice(rec.shard, rec.round, list(env.payload)))
        elif isinstance(rec, ConsensusRequest) and not self._gate.started:
            self._count["requests_before_start"] += 1  # no round ends before the start: nothing is lost yet
        elif isinstance(rec, ConsensusRequest):
            self._resend(host, rec.round)
        else:
            self._count["unexpected"] += 1

    def _take_frame(self, host: str, rec: HostFrame, payload: list[Any], deadline: float) -> None:
        """Sum `host`'s frame into its round; one over its mass bound waits for the bound to rise until `deadline`."""
        try:
            with self._outer_lock:
                outcome = self.ledger.deposit(host, rec.round, rec.mass, payload, rec.ranks)
        except MassOverBound as exc:
            if time.monotonic() < deadline:
                self._over_bound.append(_OverBound(deadline, host, rec, payload))
                return
            self._violation(host, exc)
            return
        except ProtocolError as exc:
            self._violation(host, exc)
            return
        self._refused()
        self._settled(outcome)

    def _retake_frames(self, round_id: int | None = None) -> None:
        """The frames held over their bound, of `round_id` (its bound rose) or past their deadline (None)."""
        now, keep, due = time.monotonic(), [], []
        for e in self._over_bound:  # (partitioned by hand: a held payload has no == to test membership with)
            ready = e.frame.round == round_id if round_id is not None else e.deadline <= now
            (due if ready else keep).append(e)
        self._over_bound = keep
        for e in due:
            self._take_frame(e.host, e.frame, e.payload, e.deadline)

    def _start(self, cmd: StartFrom) -> None:
        """Take this host shard's start (`StartGate.open`), then the frames that came before it."""
        if self._gate.started:
            self._count["repeated_starts"] += 1  # its relay's hello is answered each time: the first holds
            return
        try:
            outer = self._gate.open(cmd.record, cmd.payload)
        except ProtocolError as exc:  # the controller's reducer signed it: no peer to blame, this shard cannot run
            log.error("%s", exc)
            self._fail(exc)
            return
        with self._outer_lock:
            self.ledger.outer = outer
        held, self._gate.held = self._gate.held, []
        log.info("reducer shard %d: started (outer step %s); %d frames came before it", self.config.shard,
                 cmd.record.outer, len(held))
        for host, frame, payload in held:
            self._take_frame(host, frame, payload, time.monotonic() + MASS_WAIT_S)

    def _want_state(self, cmd: WantState) -> None:
        wanted = self._state_wanted
        self._state_wanted = cmd.round_id if wanted is None else min(wanted, cmd.round_id)
        if self.config.shard == 0:  # each host shard too, every time: a request lost in a reset is made good
            for host in self.config.shard_hosts:
                if host in self._route:
                    self._send_record(host, OuterStateRequest(cmd.round_id))
        self._offer_state()

    def _offer_state(self) -> None:
        """This shard's outer state, once a round at or after the one wanted is published."""
        outer, last = self.ledger.outer, self.ledger.last_round
        if self._state_wanted is None or outer is None or last is None or last < self._state_wanted:
            return
        self._state_wanted = None
        with self._outer_lock:
            frames = state_frames(outer.global_model.copy(), outer.momentum.copy())
        self.completed.put(OuterSlice(self.config.shard, last, frames))

    def _hello(self, route: bytes, rec: RelayHello) -> None:
        want = self.config.world.get(rec.host)
        if want is None or sorted(rec.ranks) != sorted(want):
            self._count["bad_hello"] += 1
            log.error("reducer: refused hello from host %r with ranks %s (world: %s)",
                      rec.host, rec.ranks, dict(self.config.world))
            return
        old = self._route.get(rec.host)
        if old is not None and old != route:
            # Another connection claims a registered host: refused while the old one is there
            # (a reconnect keeps its identity; only a host whose relay is gone may be taken over).
            if not self._route_gone(old):
                self._count["bad_hello"] += 1
                log.error("reducer: refused hello for %r from %r: relay %r is still connected", rec.host, route, old)
                return
            self._host_of.pop(old, None)
            self._subscribed.discard(rec.host)
        self._route[rec.host] = route
        self._host_of[route] = rec.host
        self._send_start(rec.host, route)  # before the acknowledgement, which its relay takes only after the start
        self._send_record(rec.host, RelayHelloAck())
        for rank in sorted(set(want) & self.ledger.dead - self._forwarded):
            self._forward(rec.host, rank)
        if old != route:  # a relay repeats its hello until acknowledged, and again after a reconnect: said once
            log.info("reducer: relay %s registered with ranks %s", rec.host, list(want))

    def _send_start(self, host: str, route: bytes) -> None:
        """A shard host's start (PROTOCOL.md 10.9 item 11) at its relay's first hello, then 2, 4, 8 ... 32 s later:
        not one model-sized message for each hello its relay repeated while this service was not yet up."""
        start, (sent, next_at) = self._starts.get(host), self._start_sent.get(host, (0, 0.0))
        if start is None or time.monotonic() < next_at:
            return
        self._start_sent[host] = (sent + 1, time.monotonic() + RESEND_AFTER_S * 2 ** min(sent, 4))
        self._to_relay(route, TAG_DATA, self._codec.encode(*start, channel=Channel.DATA))

    def _route_gone(self, route: bytes) -> bool:
        """True when ZeroMQ holds no connection for `route` (ROUTER_MANDATORY refuses a send to it)."""
        try:
            self._data.send_multipart([route, TAG_DATA, *self._codec.encode(RelayHelloAck(), channel=Channel.DATA)],
                                      zmq.NOBLOCK)
        except zmq.Again:
            return False  # connected, its queue full
        except zmq.ZMQError:
            return True  # EHOSTUNREACH
        return False

    def _death(self, rank: int, reported_by: str | None, owner_knows: bool = False) -> None:
        try:
            with self._outer_lock:
                declared = self.ledger.declare_dead(rank)
        except ProtocolError as exc:
            self._count["unknown_rank"] += 1
            log.error("%s", exc)
            return
        self._refused()
        if declared.forward_to is not None:
            for host in self.config.shard_hosts:  # the owner's relay is told below, or told us
                if host != declared.forward_to:
                    self._tell(host, rank)
            if declared.forward_to == reported_by or owner_knows:
                self._forwarded.add(rank)  # the relay told us, or was told: it already let go
            elif declared.forward_to in self._route:
                self._forward(declared.forward_to, rank)
        self._settled(declared.outcome)

    def _forward(self, host: str, rank: int) -> None:
        self._forwarded.add(rank)
        self._tell(host, rank)

    def _tell(self, host: str, rank: int) -> None:
        """Tell `host`'s relay that `rank` is dead, now if it registered, and restate it until the end
        (a shard host that registers later hears it at the next restatement)."""
        if host in self._route:
            self._send_record(host, RelayDeclareDead(rank))
        self._restate.append((host, rank))
        self._restate_at = min(self._restate_at, time.monotonic() + RESEND_AFTER_S)

    def _restate_deaths(self, now: float) -> None:
        """Send every forwarded death again; never waits (a relay not reading gets the next one)."""
        self._count["restated_deaths"] += len(self._restate)  # counted first: a reader may look as soon as one lands
        for host, rank in self._restate:
            route = self._route.get(host)
            if route is None:  # a shard host not registered yet
                continue
            try:
                self._data.send_multipart(
                    [route, TAG_DATA, *self._codec.encode(RelayDeclareDead(rank), channel=Channel.DATA)],
                    zmq.NOBLOCK)
            except zmq.ZMQError:  # full, or the relay's connection is gone: the next period tries again
                pass
        self._restate_at = now + RESEND_AFTER_S

    def _refused(self) -> None:
        """Hosts the ledger refused while summing a round (a poisoned frame): their ranks die."""
        while self.ledger.refused:
            host, why = self.ledger.refused.pop(0)
            self._violation(host, PoisonedDeposit(f"reducer: host {host!r}: {why}"))

    def _violation(self, host: str, exc: ProtocolError) -> None:
        log.error("reducer: relay %s broke the round protocol; declaring its ranks dead: %s", host, exc)
        self._count["poisoned_frames" if isinstance(exc, PoisonedDeposit) else "protocol_violations"] += 1
        self._drop_host(host, str(exc))

    def _drop_host(self, host: str, reason: str) -> None:
        """`host`'s relay broke the protocol (logged by the caller): its ranks are out of every round."""
        for rank in self.config.world[host]:
            self._death(rank, reported_by=None)
        self.completed.put(HostRefused(host, tuple(self.config.world[host]), reason))

    def _settled(self, outcome: Reduced | Abandoned | None) -> None:
        if isinstance(outcome, Reduced):
            self._publish(outcome)
            self.completed.put(RoundOutcome(outcome.round_id, outcome.mass, outcome.hosts, published_at=time.perf_counter(),
                                            masses=outcome.masses, ranks=outcome.ranks))
        elif isinstance(outcome, Abandoned):
            if outcome.round_id is None:  # nothing was lost: the run's normal end
                log.info("reducer: no round open: %s", outcome.reason)
            else:
                log.error("reducer: round %d abandoned: %s", outcome.round_id, outcome.reason)
            self.completed.put(RoundOutcome(outcome.round_id, 0.0, (), outcome.reason))

    def _publish(self, red: Reduced) -> None:
        tensors = self._hop.send_on(red.tensors)
        if self._hop.wire is not None and self._hop.wire.packed and self.ledger.outer is not None and red.mass > 0.0:
            self.ledger.outer.published(tensors)  # the next pseudo-gradient starts where the ranks do
        record = Consensus(red.round_id, red.mass)
        frames = self._codec.encode(record, tensors, channel=Channel.BROADCAST)
        self._latest_frames, self.published = (red.round_id, frames, tensors), (record, tensors)
        if red.round_id in self._drop:
            self._drop.discard(red.round_id)
            self._count["broadcasts_dropped_on_purpose"] += 1
            return
        # Never waits: PUB drops for a subscriber that stopped reading. Sent by reference, so the next
        # rounds reduce into other buffers until every subscriber has it (the controller's reads it late).
        self.ledger.hold(tensors, send_by_reference(self._pub, frames))
        # PUB loses messages for peers not yet proven subscribed: they get it directly.
        for host in self._unsubscribed():
            self._to_relay(self._route[host], TAG_BCAST, frames, tensors)
        self._offer_state()

    def _resend(self, host: str, round_id: int) -> None:
        got = self.ledger.recover(round_id)
        self._count["consensus_requests"] += 1
        if isinstance(got, Reduced) and self._latest_frames and self._latest_frames[0] == round_id:
            self._to_relay(self._route[host], TAG_BCAST, *self._latest_frames[1:])
            return
        last = self.ledger.last_round
        if isinstance(got, Gone) and (last is None or round_id > last):
            if self.ledger.awaits(host, round_id):
                # The request came after its host frame on one connection, so that frame was lost
                # in a reset: ask for it again (round id + host keep a crossing copy from counting twice).
                self._count["frame_requests"] += 1
                times = self._lost[host][1] + 1 if self._lost.get(host, (-1,))[0] == round_id else 1
                self._lost[host] = (round_id, times)
                if times == 2:  # said once a round here; the relay says it at each resend, with the fix
                    log.warning("reducer: host %s's frame of round %d was lost twice, and the round waits for it: a "
                                "link that drops before a whole frame crosses? its relay's log says", host, round_id)
                self._send_record(host, FrameRequest(round_id))
            return  # not finished yet: the broadcast will come, and the relay asks again if not
        latest = got.latest if isinstance(got, Gone) and got.latest is not None else -1
        log.error("reducer: relay %s asked for round %d: %s", host, round_id, getattr(got, "reason", "not cached"))
        self._send_record(host, ConsensusGone(round_id, latest))
