"""The rank's link: the I/O thread that owns its two DEALERs to its host's relay.

A rank holds a control and a data DEALER to its relay (routing identity = its
global rank as ASCII digits). The link encodes every outgoing record, decodes
and attributes every inbound one, beats, and hands what it received to the
training thread (flodl_zmq/rank.py) through a mailbox.

Rules this module keeps:

- One socket, one thread. The I/O thread owns both sockets, encodes every
  outgoing record (so each channel's sequence numbers go out in order),
  sends heartbeats on its own clock (a rank busy in a long batch still
  beats) and hands decoded inbound records to the training thread through a
  mailbox (flodl_zmq/mailbox.py) as typed items (`FromCoordinator`,
  `ConsensusIn`, `CoordinatorLost`); the training thread hands it outgoing
  ones through its ServiceLoop's mailbox (flodl_zmq/service_loop.py). The
  training thread never touches a socket.
- Pending step timings, and the learning rate with them, always go out ahead
  of any other record of the rank (flodl_zmq/step_report.py).
- The control streams to and from the coordinator (PROTOCOL.md 10.7): what
  this rank sent is kept until acknowledged and resent byte-identical, what
  it receives is handed on in order; a closing rank waits (bounded) for the
  acknowledgement of its last records, its goodbye among them.
- A deposit is kept until its round's consensus arrives: a rank that waited
  `consensus_wait_at_relay_s` asks its relay (ConsensusRequest), which resends the
  consensus or asks for the deposit again (FrameRequest), so a record lost
  on the local link never stalls the round (PROTOCOL.md 10.6).
- When the relay is on this machine the deposit goes by reference through the
  rank's segment, and the consensus comes back by reference into the relay's,
  verified here end to end against the reducer's MAC (flodl_zmq/wire/shm.py).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from flodl_zmq.errors import ReplayError, WireError
from flodl_zmq.links import (
    CONTROL_MAX_FRAME_BYTES,
    CONTROL_MAX_FRAMES,
    DATA_MAX_FRAME_BYTES,
    DATA_MAX_FRAMES,
    FROM_REDUCER,
    act_for_peer,
    coordinator_sender,
    limit_receive,
    rank_identity,
    rank_sender,
    recv_bounded,
    relay_sender,
)
from flodl_zmq.mailbox import Mailbox
from flodl_zmq.param_buffers import ParamBuffers
from flodl_zmq.service_loop import ServiceLoop
from flodl_zmq.settings import DEFAULTS
from flodl_zmq.step_report import StepReport
from flodl_zmq.wire import Attribution, Channel, Codec, Envelope
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.shm import SegmentMap, by_reference, host_owner, is_by_reference, run_dir
from flodl_zmq.wire.stream import RESEND_AFTER_S, InOrder, Outage, Outstream

log = logging.getLogger(__name__)

# How long a closing rank waits for the coordinator to acknowledge its last records (its
# goodbye among them): two resends, and under close()'s join timeout.
ACK_WAIT_AT_EXIT_S = 2 * RESEND_AFTER_S


@dataclass(frozen=True)
class RankConfig:
    """Where this rank is and how it talks (built from the FLODL_* environment by the API)."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    key: bytes
    incarnation: bytes
    control_endpoint: str
    data_endpoint: str
    slowdown: float = 1.0
    rank_heartbeat_period_s: float = DEFAULTS.rank_heartbeat_period_s
    coordinator_silence_at_rank_s: float = DEFAULTS.coordinator_silence_at_rank_s
    # The world forms only once every rank has started: the first word may take long.
    coordinator_first_contact_at_rank_s: float = DEFAULTS.coordinator_first_contact_at_rank_s
    consensus_wait_at_relay_s: float = DEFAULTS.consensus_wait_at_relay_s  # then the rank asks its relay for it
    # A resumed or re-formed world: the rank loads the reducer's starting consensus (round
    # rec.RESUME_ROUND) before its first step; it never reads a checkpoint (PROTOCOL.md 13).
    resumed: bool = False
    # A sharded reduction (shards.py): the relay puts the shards' slices together and signs the consensus itself.
    sharded: bool = False


@dataclass(frozen=True)
class FromCoordinator:
    """A record of the coordinator's control stream, handed on in its order."""

    record: Any


@dataclass(frozen=True)
class ConsensusIn:
    """A verified consensus (framed or by reference); the training thread judges its round."""

    env: Envelope


@dataclass(frozen=True)
class CoordinatorLost:
    """The coordinator stayed silent past its limit: the rank stops for `reason`."""

    reason: str


Inbound = FromCoordinator | ConsensusIn | CoordinatorLost


@dataclass(frozen=True)
class _Outgoing:
    """A record the training thread sends; with a payload it is the round's deposit."""

    record: Any
    payload: list[Any]
    tracked_by: ParamBuffers | None


class RankLink:
    """The I/O thread: owns the control and data DEALERs, encodes, decodes, beats.

    Inbound items on `inbox`: `Inbound` (FromCoordinator, ConsensusIn,
    CoordinatorLost). Outbound: `step(...)` and `send(record, payload,
    tracked_by)` from the training thread; pending step timings always go
    out ahead of any other record (`flush_steps`).
    """

    def __init__(self, cfg: RankConfig, ctx: zmq.Context, report_period_s: float,
                 data_max_frame_bytes: int = DATA_MAX_FRAME_BYTES) -> None:
        self.cfg = cfg
        self.data_max_frame_bytes = data_max_frame_bytes  # the model's largest frame, where the rank knows it
        self.steps = StepReport(cfg.rank, report_period_s)
        self.codec = Codec(cfg.key, cfg.incarnation, rank_sender(cfg.rank))
        self.mapped = SegmentMap(cfg.incarnation, run_dir(cfg.key, cfg.incarnation))  # the relay's consensus segment, by reference
        self._from_relay = Attribution.signed_by(relay_sender(cfg.host), "this host's relay")
        self._from_coordinator = Attribution.signed_by(coordinator_sender(cfg.rank), "the coordinator's link")
        # The control streams to and from the coordinator (PROTOCOL.md 10.7): what this rank
        # sent is kept until acknowledged, what it receives is handed on in order.
        self._up = Outstream(self.codec)
        self._outage = Outage()  # resends logged once per outage of the link, with a summary after
        self._down = InOrder()
        self.resent_control = 0
        self.duplicates = 0
        self.inbox: Mailbox[Inbound] = Mailbox()
        self._loop = ServiceLoop(f"rank{cfg.rank}-io")  # its mailbox carries the training thread's records
        self._ctx = ctx
        self.rejected = 0
        self.counts: collections.Counter[str] = collections.Counter()  # violations, by `links.act_for_peer`
        self.resent = 0  # deposits sent again because the relay asked (lost on the local link)
        # The round's deposit, kept until its consensus passes; the round whose consensus is awaited
        # (the deposit's, or a resumed world's start, asked for at once) and when to ask the relay for it.
        self._deposit: _Outgoing | None = None
        self._awaited: int | None = rec.RESUME_ROUND if cfg.resumed else None
        self._ask_at = 0.0 if cfg.resumed else math.inf
        # The I/O thread's clocks: the next heartbeat, and the coordinator's silence (None: never heard).
        self._started = self._next_beat = 0.0
        self._last_heard: float | None = None
        self._lost = False
        self._linger = True  # at close: wait for the coordinator's acknowledgements (`close`)
        self._thread = threading.Thread(target=self._run, name=f"flodl-rank{cfg.rank}-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step(self, batch_ms: float, data_ms: float, loss: float, step_count: int) -> None:
        """Note one finished step; its report goes out when due (training thread only)."""
        self._queue_reports(self.steps.add(batch_ms, data_ms, loss, step_count, time.monotonic()))

    def note_lr(self, lr: float) -> None:
        """The learning rate changed: it goes out with the next step report (training thread only)."""
        self.steps.note_lr(lr)

    def flush_steps(self) -> None:
        """Send the pending step timings (and rate) now: the rank is about to stop stepping."""
        self._queue_reports(self.steps.take())

    def _queue_reports(self, reports: Sequence[Any]) -> None:
        for report in reports:
            self._loop.put(_Outgoing(report, [], None))

    def send(self, record: Any, payload: Sequence[Any] = (), tracked_by: ParamBuffers | None = None) -> None:
        """Queue `record` for the I/O thread, after the pending step timings (training thread only)."""
        self.flush_steps()
        self._loop.put(_Outgoing(record, list(payload), tracked_by))

    def close(self, timeout_s: float = 5.0, linger: bool = True) -> None:
        """Flush queued records (the goodbye among them), stop the thread, close the sockets.

        `linger`: first wait (bounded) until the coordinator acknowledges every record. False when
        whoever stopped this rank reports its exit (its agent or launcher, by SIGTERM): in a re-form
        the coordinator is gone already, and the wait would only hold the new world back.
        """
        self._linger = linger
        self._loop.stop()  # after what is queued: the goodbye goes first
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # a mailbox is closed only once its receiver has stopped
            self.inbox.close()

    def _socket(self, endpoint: str, max_frame_bytes: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, rank_identity(self.cfg.rank))
        sock.setsockopt(zmq.LINGER, 2000)
        limit_receive(sock, max_frame_bytes)
        sock.connect(endpoint)
        return sock

    def _run(self) -> None:
        control = self._socket(self.cfg.control_endpoint, CONTROL_MAX_FRAME_BYTES)
        data = self._socket(self.cfg.data_endpoint, self.data_max_frame_bytes)
        loop = self._loop
        self._started = self._next_beat = time.monotonic()
        try:
            loop.on_message(_Outgoing, lambda out: self._send_out(control, data, out))
            loop.on_socket(control, lambda: self._from_upstream(lambda: self._receive_control(control)))
            loop.on_socket(data, lambda: self._from_upstream(lambda: self._receive_data(data)))
            loop.timer(lambda: self._next_beat, lambda now: self._beat(control, now))
            loop.timer(self._up.due_at, lambda now: self._resend(control, now))
            loop.timer(lambda: self._ask_at, lambda now: self._ask(data, now))
            loop.timer(self._silent_at, self._silence)
            loop.run()
            # A coordinator gone silent, or never heard (its records all refused: another key),
            # acknowledges nothing: the agent or launcher reports this exit instead.
            if self._linger and not self._lost and self._last_heard is not None:
                self._await_acks(control)
        finally:
            loop.close()
            control.close()
            data.close()

    def _beat(self, control: zmq.Socket, now: float) -> None:
        # The steps already reported: a count ahead of the timings would let the
        # gate close a window whose last steps ElChe has not seen yet.
        self._encode_send(control, rec.Heartbeat(rank=self.cfg.rank, step_count=self.steps.reported,
                                                 ack=self._down.acked))
        self._next_beat = now + self.cfg.rank_heartbeat_period_s

    def _ask(self, data: zmq.Socket, now: float) -> None:
        """The awaited consensus is late: ask the relay for it, again every `consensus_wait_at_relay_s`."""
        if self._awaited is None:
            self._ask_at = math.inf
            return
        self._encode_send(data, rec.ConsensusRequest(round=self._awaited), Channel.DATA)
        self._ask_at = now + self.cfg.consensus_wait_at_relay_s

    def _limit(self) -> float:
        return self.cfg.coordinator_first_contact_at_rank_s if self._last_heard is None else self.cfg.coordinator_silence_at_rank_s

    def _silent_at(self) -> float:
        """When the coordinator counts as lost if it stays silent (math.inf once it is)."""
        return math.inf if self._lost else (self._last_heard or self._started) + self._limit()

    def _silence(self, now: float) -> None:
        limit = self._limit()
        if now - (self._last_heard or self._started) > limit:
            self._lose(f"no word from the coordinator for {limit:.0f} s")

    def _lose(self, reason: str) -> None:
        """The coordinator is lost to this rank: the training thread stops with `reason` (once)."""
        if not self._lost:
            self._lost = True
            self.inbox.put(CoordinatorLost(reason))

    def _from_upstream(self, receive: Callable[[], None]) -> None:
        """Take what came from the coordinator or the relay; whatever acting on it raises leaves this rank
        unable to follow the protocol, so the coordinator counts as lost: the rank stops with the reason,
        instead of an I/O thread gone and a training thread waiting for it."""
        act_for_peer("the coordinator", receive, self._lose, self.counts, "upstream", log, f"rank {self.cfg.rank}")

    def _receive_control(self, control: zmq.Socket) -> None:
        """Take every queued control record; one authentic and fresh means the coordinator spoke."""
        while control.poll(0):
            frames = recv_bounded(control, CONTROL_MAX_FRAMES, copy=False)
            env = None if frames is None else self._decode_control(frames)
            if env is not None:
                self._last_heard = time.monotonic()
                self._on_control(env)

    def _receive_data(self, data: zmq.Socket) -> None:
        """Take every queued data record: consensus broadcasts, and the relay's own requests."""
        while data.poll(0):
            # The relay fans the reducer's broadcast out verbatim; a resend
            # is byte-identical and may follow later rounds, so the round id
            # (checked by the training thread), not the sequence, guards replays.
            frames = recv_bounded(data, DATA_MAX_FRAMES, copy=False)
            if frames is not None and len(frames) == 2:  # no payload: the relay's own record
                self._from_relay_data(frames, data)
                continue
            env = None if frames is None else self._decode_data(frames)
            if env is not None and isinstance(env.record, rec.Consensus):
                if env.record.round == self._awaited:
                    self._deposit, self._awaited, self._ask_at = None, None, math.inf
                self.inbox.put(ConsensusIn(env))

    def _decode_control(self, frames: list[Any]) -> Any:
        try:
            # The relay forwards the coordinator's records verbatim: nobody else signs them.
            return self.codec.decode_from(frames, Channel.CONTROL, self._from_coordinator)
        except ReplayError:  # a resend whose first copy arrived (its ack was lost): normal after a reset
            self.duplicates += 1
            return None
        except WireError as exc:
            # A rejected record never reaches the training thread; counted and logged.
            self.rejected += 1
            log.warning("rank %d: rejected a control message: %s", self.cfg.rank, exc)
            return None

    def _on_control(self, env: Any) -> None:
        """An authentic, fresh record of the coordinator's stream: acknowledgements at once, the rest in order."""
        if isinstance(env.record, rec.CoordHeartbeat):
            self._acked(env.record.ack)
        if isinstance(env.record, rec.DeclareDead) and env.record.rank == self.cfg.rank:
            # Final, and what came before it may never come (the coordinator resends nothing to a dead rank):
            # not held for the records of a gap (PROTOCOL.md 10.7 item 10).
            self.inbox.put(FromCoordinator(env.record))
            return
        for record in self._down.accept(env.seq, env.record):
            self.inbox.put(FromCoordinator(record))

    def _acked(self, n: int) -> None:
        if self._up.ack(n):
            summary = self._outage.settled(self.cfg.rank, time.monotonic())
            if summary is not None:  # at the warning's level: a rank logs warnings only, and this one ends it
                log.warning("rank %d: the coordinator acknowledges again: %d control records resent over %.1f s",
                            self.cfg.rank, *summary)

    def _resend(self, control: zmq.Socket, now: float) -> None:
        """Send again what the coordinator has not acknowledged (lost in a reset), byte-identical."""
        due = self._up.due(now)
        if due and self._outage.resent_on(self.cfg.rank, len(due), now):
            log.warning("rank %d: the coordinator has not acknowledged %d control records; sending them again "
                        "every %g s until it does", self.cfg.rank, len(due), RESEND_AFTER_S)
        for frames in due:
            self.resent_control += 1
            control.send_multipart(frames)

    def _await_acks(self, control: zmq.Socket) -> None:
        """Before closing, wait (bounded) until the coordinator has every record: the goodbye must not be lost."""
        deadline = time.monotonic() + ACK_WAIT_AT_EXIT_S
        while len(self._up) and time.monotonic() < deadline:
            self._resend(control, time.monotonic())
            if control.poll(int(min(RESEND_AFTER_S, max(0.0, deadline - time.monotonic())) * 1000)):
                frames = recv_bounded(control, CONTROL_MAX_FRAMES, copy=False)
                env = None if frames is None else self._decode_control(frames)
                if env is not None and isinstance(env.record, rec.CoordHeartbeat):
                    self._acked(env.record.ack)
        if len(self._up):
            log.warning("rank %d: the coordinator did not acknowledge %d control records before exit",
                        self.cfg.rank, len(self._up))

    def _decode_data(self, msg: list[Any]) -> Any:
        # Framed, a consensus is the reducer's message fanned out verbatim; by reference, the relay
        # signs the header and locator of the copy it placed in its segment, and under a sharded
        # reduction the message it put together from the shards' slices (PROTOCOL.md 10.9).
        sender = self._from_relay if is_by_reference(msg) or self.cfg.sharded else FROM_REDUCER
        try:
            return self.mapped.decode(self.codec, msg, host_owner(self.cfg.host), Channel.BROADCAST,
                                      sender=sender, replay=False)
        except WireError as exc:
            self.rejected += 1
            log.warning("rank %d: rejected a consensus: %s", self.cfg.rank, exc)
            return None

    def _from_relay_data(self, frames: list[Any], data: zmq.Socket) -> None:
        """A record of the relay's own on the data link: a FrameRequest for a deposit it never got."""
        try:
            env = self.codec.decode_from(frames, Channel.DATA, self._from_relay)
        except WireError as exc:
            self.rejected += 1
            log.warning("rank %d: rejected a data record from the relay: %s", self.cfg.rank, exc)
            return
        held = self._deposit
        if isinstance(env.record, rec.FrameRequest) and held is not None and held.record.round == env.record.round:
            log.warning("rank %d: the relay lost this rank's deposit of round %d; sending it again",
                        self.cfg.rank, env.record.round)
            self.resent += 1
            self._send_deposit(data, held, again=True)

    def _send_out(self, control: zmq.Socket, data: zmq.Socket, out: _Outgoing) -> None:
        if out.payload:
            self._send_deposit(data, out)
            self._deposit, self._awaited = out, out.record.round
            self._ask_at = time.monotonic() + self.cfg.consensus_wait_at_relay_s
        else:
            self._encode_send(control, out.record)

    def _send_deposit(self, data: zmq.Socket, out: _Outgoing, again: bool = False) -> None:
        """Send a deposit; `again` re-signs a kept one (a fresh sequence number: a copy would be a replay)."""
        record, payload, tracked_by = out.record, out.payload, out.tracked_by
        if tracked_by is not None and tracked_by.segment is not None:
            # The payload stays in the segment; the round protocol keeps it unwritten
            # until the relay is done with it (the next snapshot follows this consensus).
            data.send_multipart(by_reference(self.codec, record, payload, tracked_by.segment, channel=Channel.DATA))
            if not again:
                tracked_by.hold_until_sent(None)
            return
        frames = self.codec.encode(record, payload, channel=Channel.DATA)
        if again:
            data.send_multipart(frames)  # copied: the first send's tracker still guards the snapshot
            return
        tracker = data.send_multipart(frames, copy=False, track=True)
        if tracked_by is not None:
            tracked_by.hold_until_sent(tracker)

    def _encode_send(self, sock: zmq.Socket, record: Any, channel: Channel = Channel.CONTROL) -> None:
        if channel is Channel.CONTROL:  # one encoder for the control stream: it has no gap
            sock.send_multipart(self._up.send(record, time.monotonic()))
        else:
            sock.send_multipart(self.codec.encode(record, channel=channel))


__all__ = ["ConsensusIn", "CoordinatorLost", "FromCoordinator", "Inbound", "RankConfig", "RankLink"]
