"""The join ROUTER: the ZeroMQ shell around the join rules (flodl_zmq/join.py).

A worker host's agent dials the controller's join ROUTER and sends one `JoinHello`. `MembershipService`
decodes it, hands it to the pure `JoinWindow` (admission, ranks, the formation verdict; its rules are in
join.py) and sends what it decides; after admission it watches the host links (`HostLinks`, host_links.py)
and reports rank exits, lost and done hosts to the controller service. This module keeps the socket, the
thread, the clock and the trust modes.

Trust modes (pre-shared key, open admission): flodl_zmq/trust.py.

Pre-admission frames carry the all-zero run id (`JOIN_RUN_ID`): a joiner does
not know the run yet. So each exchange is made fresh by a challenge
(PROTOCOL.md 10.4): the joiner (or a status client) asks with
`join.challenge_request`, gets a nonce (`Challenges`, join.py) and signs it
into its hello or status request; a replayed one is dropped without a reply.
Nothing is answered before a message's MAC verifies, not even a version
skew. The accept names the run id, this controller's incarnation id and the
host's token (from `route_secret`), which its relay's hello must carry: the
session key says "a member", the token "this host". Every later frame on the
link carries the incarnation with the session key, so a frame recorded in an
earlier run under the same pre-shared key, or before the controller restarted,
cannot tear down a host of this one nor report a rank of it gone (PROTOCOL.md
4.1). Each formed and re-formed world gets its own incarnation id, which its
relays and ranks sign with. Under CURVE a host name stays its first key's.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import zmq

from flodl_zmq.environment import SpawnSpec
from flodl_zmq.errors import MembershipError, VersionError, WireError
from flodl_zmq.formation import rank_space
from flodl_zmq.host_links import (
    HostDone,
    HostLinks,
    HostLost,
    MembershipEvent,
    RankExitReported,
    RelayExitReported,
)
from flodl_zmq.io_threads import keep_off_the_data_plane
from flodl_zmq.join import Challenges, JoinVerdict, JoinWindow, Member, Rejected, WindowPhase
from flodl_zmq.links import (
    CONTROL_MAX_FRAME_BYTES,
    JOIN_MAX_FRAMES,
    ROUTE_SECRET_BYTES,
    act_for_peer,
    drain,
    host_token,
    limit_receive,
)
from flodl_zmq.mailbox import Mailbox
from flodl_zmq.security import (
    JOIN_ZAP_DOMAIN,
    CleartextWarner,
    CurveGate,
    CurveKeys,
    apply_server,
    client_key,
)
from flodl_zmq.service_loop import ServiceLoop
from flodl_zmq.settings import DEFAULTS
from flodl_zmq.trust import (
    JOIN_RUN_ID,
    TrustMode,
    check_open_admission_bind,
    check_open_admission_curve,
    endpoint_ip,
    join_key,
)
from flodl_zmq.wire import Attribution, Channel, Codec, Envelope
from flodl_zmq.wire.records import (
    Abort,
    ChallengeRequest,
    JoinAccept,
    JoinHeartbeat,
    JoinHello,
    JoinReject,
    RankExited,
    RelayExited,
    StatusReply,
    StatusRequest,
    WorldFormed,
)

log = logging.getLogger(__name__)

# How long a watched status endpoint stays up at a run's end for its watcher's next query
# (`status --watch` asks every second unless told --interval).
WATCH_LINGER_S = 3.0


class EndWatch:
    """Keeps a status endpoint up a moment at a run's end while someone watches it.

    `status --watch` exits 0 on a reply that says the run ended. An endpoint that closed between two of its
    queries left it saying the controller stopped answering, exit 1, after a good run. Not watched (no query
    in the last WATCH_LINGER_S) or not ended: closing waits for nothing.
    """

    def __init__(self) -> None:
        self._asked_at = -math.inf
        self._told = threading.Event()  # a reply saying the run ended went out

    def answered(self, training: Mapping[str, Any] | None, now: float) -> None:
        """A status reply went out carrying `training` (the coordinator's view, if any)."""
        self._asked_at = now
        if _ended(training):
            self._told.set()

    def hold(self, training: Mapping[str, Any] | None, now: float) -> None:
        """Before closing: wait, at most WATCH_LINGER_S, until a watcher has been told the run ended."""
        if _ended(training) and now - self._asked_at <= WATCH_LINGER_S:
            self._told.wait(WATCH_LINGER_S)


def _ended(training: Mapping[str, Any] | None) -> bool:
    return bool(training and training.get("ended"))


# Replay-ledger entries the join codec keeps before admission (one per connection seen): under open admission
# anyone may hello from fresh routing ids, and uncapped each would grow the controller's memory (~1 kB apiece).
JOIN_LEDGER_CAP = 4096
# Messages the join thread reads per wake-up before it runs its timers again.
JOIN_RECV_BUDGET = 256


# --------------------------------------------------------------------------- service (ZeroMQ)


SENDER = "membership"


# The join thread's commands (its mailbox), each with the reply its caller waits on.


@dataclass(frozen=True)
class _Abort:
    reason: str
    reply: Future[None] = field(default_factory=Future)  # set once the aborts are handed to ZeroMQ


@dataclass(frozen=True)
class _Reform:
    env: Mapping[str, str]
    incarnation: bytes
    reply: Future[dict[str, tuple[int, ...]]] = field(default_factory=Future)  # the new world


@dataclass(frozen=True)
class _EndJoins:
    reason: str
    reply: Future[bool] = field(default_factory=Future)  # whether any pending joiner was sent its abort


class MembershipService:
    """The join ROUTER of the controller: runs the window, then keeps the host links.

    Protocol, per agent (one DEALER each):

        agent  -> join.hello        keyed by the join key (see TrustMode)
        agent <-  join.accept       ranks, formation budget, run id, incarnation (+ session key if open)
               |  join.reject       the reason; the agent exits
        agent <-  join.world_formed world size + SpawnSpec JSON + the world's incarnation, when it forms
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
    owns the socket; the public methods are safe from any thread, which reach
    it as typed commands through its ServiceLoop (flodl_zmq/service_loop.py):
    it sleeps until a frame, a command or its next timer (heartbeat, window,
    silent host). With `curve` the join socket is
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
        incarnation: bytes,
        spawn: SpawnSpec,
        join_heartbeat_period_s: float = DEFAULTS.join_heartbeat_period_s,
        host_silence_at_controller_s: float = DEFAULTS.host_silence_at_controller_s,
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
        self.incarnation = incarnation  # the join links', and the formed world's until a re-form draws its own
        self.spawn = spawn
        self.join_heartbeat_period_s = join_heartbeat_period_s
        self._quiet_s = 2 * join_heartbeat_period_s  # silent longer, a member may have lost its link (`_repeat_world`)
        self.clock = clock
        self.links = HostLinks(host_silence_at_controller_s)
        self.events: Mailbox[MembershipEvent] = Mailbox()
        self.dropped = 0  # join frames dropped unanswered (bad MAC, junk, replays, another incarnation)
        self.counts: collections.Counter[str] = collections.Counter()  # violations, by `links.act_for_peer`
        self._next_beat = 0.0  # when the join thread next sends the admitted agents a heartbeat
        self._session_key = session_key
        # Each host's token derives from it (links.host_token), for the controller role to check its relay's
        # hellos. Once per controller process: a re-formed world keeps it, and with it the hosts' tokens.
        self.route_secret = os.urandom(ROUTE_SECRET_BYTES)
        self._join = Codec(join_key(trust, session_key), JOIN_RUN_ID, SENDER, max_ledger=JOIN_LEDGER_CAP)
        self._session = Codec(session_key, incarnation, SENDER)
        self._hosts: dict[bytes, str] = {}  # ROUTER identity -> admitted host
        self._told: dict[str, WorldFormed] = {}  # each member host's word of its world, repeated after a silence
        self._lost: dict[bytes, tuple[str, bool]] = {}  # a lost host's connections: host, and whether that was said
        self._challenges = Challenges()  # the nonce each connection must sign into its hello
        self._end_watch = EndWatch()
        # What a connection may send before admission, one handler per record kind.
        self._pre_admission: dict[type, Callable[[bytes, Envelope, list[Any], float], None]] = {
            ChallengeRequest: self._on_challenge_request, JoinHello: self._on_hello, StatusRequest: self._on_status_request,
        }
        self._loop = ServiceLoop("membership", clock)  # its mailbox carries the commands
        self._closed = threading.Event()
        self._verdict: JoinVerdict | None = None
        self._pending: tuple[Member, ...] = ()  # the window's pending joiners, swapped whole for other threads
        self.joins: list[dict[str, Any]] = []  # hosts that entered the world at a re-form (status)
        self._training: dict[str, Any] | None = None  # swapped whole by the controller's thread: no lock needed
        self._curve = curve
        self._gate = gate  # learns each admitted agent's CURVE key (security.CurveGate)
        self._cleartext = CleartextWarner(log)
        self._sock = _join_socket(context or zmq.Context.instance(), endpoint, curve)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="flodl-membership", daemon=True)

    # ------------------------------------------------------------------ public

    def start(self) -> None:
        self._thread.start()

    def wait_closed(self, timeout: float | None = None) -> JoinVerdict | None:
        """The window's final verdict, or None if it is still open after `timeout` seconds."""
        self._closed.wait(timeout)
        return self._verdict

    def abort(self, reason: str, timeout: float = 5.0) -> bool:
        """Fail the window if it is open and send every admitted agent an abort.

        Returns once the service thread has handed the aborts to ZeroMQ (True),
        or after `timeout` seconds, or at once if the thread is not running (False).
        """
        return self._ask(_Abort(reason), timeout)

    def pending(self) -> tuple[Member, ...]:
        """Hosts admitted after formation, waiting for the next re-form (safe from any thread)."""
        return self._pending

    def reform(self, env: Mapping[str, str], incarnation: bytes, timeout: float = 5.0) -> dict[str, tuple[int, ...]]:
        """Re-form the world with the pending joiners: send every running host and joiner the new world.

        `env` is added to the spawn spec (the checkpoint to resume, FLODL_RESUME);
        `incarnation` is the new world's (PROTOCOL.md 4.1).
        Hosts no longer running (done or lost) leave the world. Returns the new
        world once the records are handed to ZeroMQ; `wait_reformed` then says
        when every host stopped its ranks of the incarnation before.
        """
        command = _Reform(env, incarnation)
        if not self._ask(command, timeout):
            raise MembershipError("the membership service did not re-form the world: its thread is gone or stuck")
        return command.reply.result()

    def end_joins(self, reason: str, timeout: float = 5.0) -> bool:
        """Admit nobody any more and abort the pending joiners (the run is over); True once any abort is sent."""
        command = _EndJoins(reason)
        return self._ask(command, timeout) and command.reply.result()

    def _ask(self, command: _Abort | _Reform | _EndJoins, timeout: float) -> bool:
        """Hand `command` to the join thread; True once it is done, False if the thread is gone or stuck."""
        if not self._loop.put(command) or not self._thread.is_alive():
            return False
        try:
            command.reply.result(timeout)
        except FutureTimeout:  # concurrent.futures' own before Python 3.11
            return False
        return True

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
        verdict = self._verdict or JoinVerdict(self.window.phase, "waiting for workers")
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
        if self.counts:
            out["violations"] = dict(self.counts)
        if self._training is not None:
            out["training"] = self._training
        return out

    def close(self, timeout: float = 5.0) -> None:
        # The training view only (a reference the controller swaps whole): status() reads what this thread does not own.
        self._end_watch.hold(self._training, self.clock())
        self._loop.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            # Only once the thread is gone: it polls these descriptors and owns the socket.
            self._sock.close(0)
            self._loop.close()
            self.events.close()

    # ------------------------------------------------------------------ loop

    def _run(self) -> None:
        loop = self._loop
        loop.on_message(_Abort, self._on_abort)
        loop.on_message(_Reform, lambda command: command.reply.set_result(self._on_reform(command)))
        loop.on_message(_EndJoins, lambda command: command.reply.set_result(self._on_end_joins(command.reason)))
        loop.on_socket(self._sock, self._drained)
        self._next_beat = self.clock()
        loop.timer(lambda: self._next_beat, lambda now: self._beat())
        loop.timer(lambda: _due(self.window.next_due(self.clock())), lambda now: self._on_verdict(self.window.poll(now)))
        loop.timer(lambda: _due(self.links.next_due()), self._expire)
        loop.run()

    def _drained(self) -> None:
        # Bounded per message and per wake-up; heartbeats go even mid-discard (the agents time out on them).
        oversized = drain(self._sock, lambda frames: self._on_message(bytes(frames[0].bytes), frames[1:]),
                          copy=False, budget=JOIN_RECV_BUDGET, max_frames=JOIN_MAX_FRAMES, tick=self._beat)
        self.dropped += oversized  # not `+= drain(...)`: the handler counts drops too
        self._on_verdict(self.window.poll(self.clock()))  # an admission may have formed the world

    def _expire(self, now: float) -> None:
        """Report the hosts whose agents fell silent (a pending joiner leaves quietly)."""
        for host in (lost := self.links.lost(now)):
            self._lose(host, "its agent fell silent")
        if lost and self.links.all_silent_together():
            log.error("every host fell silent at once: the controller's own link is the likelier cause; raise "
                      "--host-silence (%g s) above the outages that link may have", self.links.timeout_s)

    def _lose(self, host: str, why: str) -> None:
        """`host` is gone (`why`): its ranks are reported lost; a pending joiner just leaves."""
        ranks = self.links.live_ranks(host)
        waiting = self.window.phase is WindowPhase.OPEN or any(m.host == host for m in self.window.pending)
        if self.window.phase is not WindowPhase.FAILED:
            self.window.depart(host)  # it may join again, with fresh ranks
            self._pending = self.window.pending
            self._lost.update({i: (host, False) for i, h in self._hosts.items() if h == host})
            self._drop_connections(host)
        if waiting:  # not in a world yet: nobody schedules its ranks (before formation, they are left vacant)
            log.warning("host %r lost while waiting to join: %s", host, why)
            return
        log.warning("host %r lost: %s; ranks %s are gone", host, why, list(ranks))
        self.events.put(HostLost(host, ranks, why))

    def _violation(self, host: str | None, why: str) -> None:
        """Acting on a record of `host` (None: a connection not admitted, nothing to drop) raised."""
        if host is not None and self.links.cut(host):
            self._lose(host, why)

    def _drop_connections(self, host: str) -> None:
        """Forget every join connection of `host` (it left, or came back on a new one), and its world."""
        self._hosts = {i: h for i, h in self._hosts.items() if h != host}
        self._told.pop(host, None)

    def _beat(self) -> None:
        """Send every admitted agent its heartbeat if one is due."""
        now = self.clock()
        if now >= self._next_beat:
            self._next_beat = now + self.join_heartbeat_period_s
            self._to_all(JoinHeartbeat())

    def _on_verdict(self, verdict: JoinVerdict) -> None:
        if self._verdict is not None or verdict.phase is WindowPhase.OPEN:
            return
        self._verdict = verdict
        if verdict.phase is WindowPhase.FORMED:
            log.info("world formed with %d ranks (%s)", self.window.joined_ranks, verdict.reason)
            world = {m.host: m.ranks for m in verdict.members}
            spawn_json = dataclasses.replace(self.spawn, world=world).to_json()
            for ident, host in self._hosts.items():
                self._send(ident, self._session, self._formed(host, verdict.world_size, spawn_json, self.incarnation))
        else:
            log.error("join window failed: %s", verdict.reason)
            self._to_all(Abort(verdict.reason))
        self._closed.set()

    def _on_reform(self, command: _Reform) -> dict[str, tuple[int, ...]]:
        running = set(self.links.running())
        for m in self.window.members:
            if m.host not in running:
                self.window.depart(m.host)  # done or lost: its ranks stay dead
        joined = [m.host for m in self.window.pending]
        world = self.window.reform()
        self._pending = ()
        self.spawn = dataclasses.replace(self.spawn, env={**self.spawn.env, **command.env}, world=world)
        spawn_json = self.spawn.to_json()
        for m in self.window.members:
            if m.host not in joined:  # a joiner has nothing to stop
                self.links.reform(m)
        for ident, host in self._hosts.items():
            if host in world:
                self._send(ident, self._session, self._formed(host, rank_space(world), spawn_json, command.incarnation))
        self.joins.extend({"host": h, "ranks": list(world[h]), "at": time.time()} for h in joined)
        log.info("world re-formed: %s (joined: %s)", world, joined)
        return world

    def _on_abort(self, command: _Abort) -> None:
        verdict = self.window.abort(command.reason)
        if self._verdict is None:
            self._verdict = verdict
            self._closed.set()
        log.error("aborting the run on every host: %s", command.reason)
        self._to_all(Abort(command.reason))
        command.reply.set_result(None)

    def _on_end_joins(self, reason: str) -> bool:
        away = {m.host for m in self.window.end(reason)}
        aborted = []
        for ident, host in list(self._hosts.items()):
            if host in away:
                aborted.append(self._send(ident, self._session, Abort(reason)))
                self.links.forget(host)
                del self._hosts[ident]
        self._pending = ()
        return any(aborted)

    def _on_message(self, ident: bytes, frames: list[Any]) -> None:
        # Whatever acting on a record raises is its sender's violation: that host is lost, the window serves on.
        host = self._hosts.get(ident)
        act_for_peer(f"host {host!r}" if host is not None else f"join connection {ident.hex()}",
                     lambda: self._on_frames(ident, host, frames), lambda why: self._violation(host, why),
                     self.counts, "join", log, "membership")

    def _on_frames(self, ident: bytes, host: str | None, frames: list[Any]) -> None:
        if host is not None:
            self._on_member_frame(ident, host, frames)
            return
        env = self._decode_pre_admission(ident, frames)
        if env is None:
            return
        now = self.clock()
        handler = self._pre_admission.get(type(env.record))
        if handler is None:
            self.dropped += 1
            log.warning("join frame dropped: %s before admission (expected a challenge request, hello or status request)", env.kind)
            return
        handler(ident, env, frames, now)

    def _decode_pre_admission(self, ident: bytes, frames: list[Any]) -> Envelope | None:
        """The record from a connection not admitted yet; None when it is dropped or refused here."""
        try:
            # Before admission the hello introduces its sender; its numbers are kept per connection.
            return self._join.decode_from(frames, Channel.JOIN, Attribution.anyone("a join link", scope=ident.hex()))
        except VersionError as exc:
            # The version is read before the MAC: answer only a sender who holds the key,
            # or a stranger would get a reject signed with it (PROTOCOL.md 10.4).
            if not self._join.authentic(frames):
                self.dropped += 1
                log.warning("join frame of another protocol version dropped without reply: its MAC does not verify")
                return None
            log.warning("join refused, protocol version skew: %s", exc)
            self._send(ident, self._join, JoinReject(f"protocol version skew: {exc}", b""))
        except WireError as exc:
            # Under a pre-shared key this is how a stranger's hello looks: no reply at all.
            self.dropped += 1
            host, said = self._lost.get(ident, (None, False))
            if host is None:
                log.warning("join frame dropped without reply: %s", exc)
            elif not said:  # an agent that woke from a stall past --host-silence: its own silence rule re-dials
                self._lost[ident] = (host, True)
                log.warning("join frames of host %r dropped without reply: it was declared lost; its agent dials in "
                            "again when it notices, and joins with new ranks", host)
        return None

    def _on_challenge_request(self, ident: bytes, env: Envelope, frames: list[Any], now: float) -> None:
        challenge = self._challenges.answer(ident, env.record, now)
        if challenge is None:
            self.dropped += 1
            log.warning("join.challenge_request with a %d-byte nonce dropped", len(env.record.nonce))
        else:
            self._send(ident, self._join, challenge)

    def _on_status_request(self, ident: bytes, env: Envelope, frames: list[Any], now: float) -> None:
        if self._fresh(ident, env, now):
            status = self.status()
            self._send(ident, self._join, StatusReply(json.dumps(status), env.record.nonce))
            self._end_watch.answered(status.get("training"), now)

    def _fresh(self, ident: bytes, env: Envelope, now: float) -> bool:
        """Whether `env`'s hello or status request signs the challenge issued to its connection (used up)."""
        fresh = self._challenges.take(ident, env.record.nonce, now)
        if fresh == "unknown":
            # Never issued to this connection, or used already: a replay, answered by nothing.
            self.dropped += 1
            log.warning("%s dropped without reply: its challenge nonce is unknown or used (a replay?)", env.kind)
            return False
        if fresh == "expired":
            log.warning("%s refused: its challenge expired", env.kind)
            self._send(ident, self._join, JoinReject(
                f"challenge expired: the hello came more than {self._challenges.ttl_s:g} s after its challenge; "
                "retry (is the link or the agent stalled?)", env.record.nonce))
            return False
        return True

    def _on_hello(self, ident: bytes, env: Envelope, frames: list[Any], now: float) -> None:
        hello: JoinHello = env.record
        if not self._fresh(ident, env, now):
            return
        taken = "" if self._gate is None else self._gate.name_taken(hello.host, client_key(frames))
        silent = self.links.silent_for(hello.host, now)  # its agent, cut off, may have torn down and dial in again
        if not taken and self.window.phase is WindowPhase.FORMED and silent > self._quiet_s:
            self._lose(hello.host, f"its agent dialled in again after {silent:.1f} s of silence on its old link")
        done = self.links.state(hello.host) == "done"
        outcome = Rejected(taken) if taken else self.window.admit(hello, now, finished=done)
        if isinstance(outcome, Rejected):
            log.warning("join refused for %r: %s", hello.host, outcome.reason)
            self._send(ident, self._join, JoinReject(outcome.reason, hello.nonce))
            return
        key = self._session_key if self.trust is TrustMode.OPEN else None
        accept = JoinAccept(list(outcome.ranks), key, outcome.formation_wait_s, self.run_id, self.incarnation,
                            hello.nonce, host_token(self.route_secret, hello.host))
        if not self._send(ident, self._join, accept):
            self.window.retract_last(hello.host)
            return
        self._admitted(ident, hello.host, outcome.ranks, frames, now)

    def _admitted(self, ident: bytes, host: str, ranks: tuple[int, ...], frames: list[Any], now: float) -> None:
        """`host`'s accept is handed to ZeroMQ: its connection, link and CURVE key are the member's now."""
        self._drop_connections(host)  # a host taken back: WorldFormed and heartbeats go to the new one
        self._hosts[ident] = host
        self.links.add(self.window.last_admitted, now)
        self._pending = self.window.pending
        if self._gate is not None:
            self._admit_curve_key(host, frames)
        peer = _peer_address(frames)
        if peer is not None:
            self._cleartext.warn_if_cleartext(peer, encrypted=self._curve is not None)
        if self.window.phase is WindowPhase.FORMED:
            log.info("admitted %r as ranks %s, pending: it joins the world at the next re-form",
                     host, list(ranks))
            return
        cfg = self.window.config
        log.info("admitted %r as ranks %s (%d/%s ranks joined)",
                 host, list(ranks), self.window.joined_ranks, cfg.target_ranks or f"{cfg.min_ranks}+")

    def _admit_curve_key(self, host: str, frames: list[Any]) -> None:
        """Let the key that carried `host`'s admitted hello through the data sockets (the gate)."""
        assert self._gate is not None
        key = client_key(frames)
        if key is None:
            log.warning("host %r admitted but its CURVE key is unknown: its relay will be refused", host)
            return
        self._gate.admit(key, host)

    def _on_member_frame(self, ident: bytes, host: str, frames: list[Any]) -> None:
        try:
            # An admitted agent signs with the host name its hello gave.
            sender = Attribution.signed_by(host, f"host {host!r}'s join link", scope=ident.hex())
            env = self._session.decode_from(frames, Channel.JOIN, sender)
        except WireError as exc:
            self.dropped += 1
            log.warning("frame from host %r dropped: %s", host, exc)
            return
        now = self.clock()
        if self.links.heard(host, now) > self._quiet_s:
            self._repeat_world(ident, host)
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
        elif isinstance(rec, RelayExited):
            log.warning("host %r: its relay exited with code %d", host, rec.code)
            self.events.put(RelayExitReported(host, rec.code))
        elif not isinstance(rec, JoinHeartbeat):
            log.warning("host %r sent %s on its join link; ignored", host, env.kind)

    def _formed(self, host: str, world_size: int, spawn_json: str, incarnation: bytes) -> WorldFormed:
        """`host`'s word of the formed world, kept to repeat: the route secret goes to a host whose relay runs a
        reducer shard (it proves every relay's hello there, PROTOCOL.md 10.9) and to no other."""
        shard = self.spawn.shard_map.shard_of(host)
        formed = WorldFormed(world_size, spawn_json, incarnation, self.route_secret if shard is not None else b"")
        self._told[host] = formed
        return formed

    def _repeat_world(self, ident: bytes, host: str) -> None:
        """`host` spoke after a silence: a new connection holds nothing its old one had (PROTOCOL.md 10.4). An
        agent of its name dialling in during such a silence takes its place (`_on_hello`, PROTOCOL.md 13.1)."""
        formed = self._told.get(host)
        if formed is not None and self.links.state(host) == "live":
            log.info("host %r heard again after a silence: its join.world_formed sent again", host)
            self._send(ident, self._session, formed)

    def _to_all(self, record: object) -> None:
        """Send `record` to every admitted host."""
        for ident in self._hosts:
            self._send(ident, self._session, record)

    def _send(self, ident: bytes, codec: Codec, rec: Any) -> bool:
        try:
            self._sock.send_multipart([ident, *codec.encode(rec, channel=Channel.JOIN)], zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("could not send %s to an agent (its queue is full); it will time out", rec.KIND)
            return False


def _due(at: float | None) -> float:
    """A core's next due time as a timer's (None: not armed)."""
    return math.inf if at is None else at


def _join_socket(ctx: zmq.Context, endpoint: str, curve: CurveKeys | None) -> zmq.Socket:
    """The join ROUTER, bound to `endpoint`: bounded frames, a CURVE server with `curve`."""
    sock = ctx.socket(zmq.ROUTER)
    keep_off_the_data_plane(sock)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        apply_server(sock, curve)
        sock.zap_domain = JOIN_ZAP_DOMAIN  # a stranger's key may knock here, nowhere else
    # An agent's DEALER keeps its routing id across reconnects (agent.py): the reconnected pipe takes it over.
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    limit_receive(sock, CONTROL_MAX_FRAME_BYTES)
    sock.bind(endpoint)
    return sock


def _peer_address(frames: list[Any]) -> str | None:
    """The IP address a received message came from (ZeroMQ's Peer-Address metadata), if known."""
    try:
        return frames[0].get("Peer-Address")
    except (zmq.ZMQError, AttributeError, IndexError):
        return None
