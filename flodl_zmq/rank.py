"""The rank runtime: one model replica that trains what it is dispatched and joins each averaging round.

A rank process holds two DEALER sockets to its host's relay (control and
data; routing identity = its global rank as ASCII digits). It takes part in
the protocol like this (PROTOCOL.md, Rank):

1. Sends `RankHello` (rank, world size, host, model and dataset signatures).
   A rank of a resumed or re-formed world then asks its relay for the
   starting consensus (`ConsensusRequest(RESUME_ROUND)`, again every
   `consensus_wait_s`) and loads it before anything else: its model comes
   over the wire from the controller's checkpoint, never from a file.
2. Trains the spans of the epoch permutation it is given (`StartEpoch`,
   `Update.next_plan`, `ExtendPartition`), reporting its steps' timings in
   `Batch` records (coalesced: `StepReport`), one `EpochMetrics` per
   completed span.
3. On `RequestParams(round)` snapshots its parameters and float buffers into
   a reused host buffer, multiplies it by its realized-work mass (steps since
   the last sync) and deposits one `RoundFrame` on the data socket.
4. On the round's `Consensus` loads it and answers `SyncAck` with the
   divergence triple; a zero-mass consensus keeps local state. It overwrites
   the replica, except under cpu-async, where the rank trained on while its
   deposit travelled: it adds `easgd_alpha * (consensus - snapshot)`, so
   those steps are kept (the overlapped round's correction).
5. Runs eval / checkpoint / epoch callbacks when its role is elected and
   reports them (`EvalResult`, `CheckpointResult`, `EpochFnElapsed`), with
   the rank and the traceback when one raises; training continues.
6. Says goodbye (`Exiting`) on `Shutdown`, `ShutdownWithSave` or a lost
   controller.

Rules this module keeps:

- One socket, one thread. An I/O thread owns both sockets, encodes every
  outgoing record (so each channel's sequence numbers go out in order),
  sends heartbeats on its own clock (a rank busy in a long batch still
  beats) and hands decoded inbound records to the training thread through a
  mailbox (flodl_zmq/mailbox.py), as the training thread hands it outgoing
  ones. The training thread never touches a socket.
- Snapshot buffers are allocated once. On CUDA they are pinned, filled with
  non-blocking copies and fenced by one synchronize per round, never one per
  tensor; a snapshot waits until ZeroMQ has released the previous deposit
  (sent zero-copy) before overwriting it.
- When the relay is on this machine (its data endpoint is ipc://) the snapshot
  buffer is the rank's shared-memory segment and the deposit goes by reference
  (flodl_zmq/wire/shm.py): the relay verifies and folds it in place, and sends
  the consensus back by reference into its host segment, verified here end to
  end against the reducer's MAC. No model bytes cross the local socket.
- The next plan of an `Update` is held until that round's consensus is
  loaded: training it on the pre-consensus replica would throw its steps away.
- A deposit is kept until its round's consensus arrives: a rank that waited
  `consensus_wait_s` asks its relay (ConsensusRequest), which resends the
  consensus or asks for the deposit again (FrameRequest), so a record lost
  on the local link never stalls the round (PROTOCOL.md 10.6). The snapshot
  is not overwritten before that consensus, so the resend is the same deposit.
- A span's batches are queued in the loader pipeline (flodl_zmq/loader.py)
  as soon as the span arrives: its indices are known, so worker processes
  build them while earlier batches train.
- The learning-rate schedule sits at the global step plus this rank's steps
  not yet in a consensus (flodl_zmq/training.py); a `SetGlobalStep` that
  arrives before its round's consensus is held until the load, like the
  plan. Each rate change goes to the coordinator as `LrUpdate`.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from flodl_zmq import int8
from flodl_zmq.datasets import dataset_signature
from flodl_zmq.errors import ConfigError, ReplayError, ShmError, TrainingError, WireError
from flodl_zmq.job import Job
from flodl_zmq.links import (
    CONTROL_MAX_FRAME_BYTES,
    CONTROL_MAX_FRAMES,
    DATA_MAX_FRAME_BYTES,
    DATA_MAX_FRAMES,
    FROM_REDUCER,
    coordinator_sender,
    limit_receive,
    rank_identity,
    rank_sender,
    recv_bounded,
    relay_sender,
)
from flodl_zmq.loader import BatchPipeline
from flodl_zmq.mailbox import Mailbox
from flodl_zmq.payload import flat_views, load_flat, model_signature, payload_tensors
from flodl_zmq.sampling import epoch_permutation, plan_indices
from flodl_zmq.settings import Settings
from flodl_zmq.tensors import DTYPES, as_numpy, bf16_from_f32, torch_view
from flodl_zmq.training import ScalarLog, Stepper, recording
from flodl_zmq.wire import Attribution, Channel, Codec
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.shm import (
    Segment,
    SegmentMap,
    by_reference,
    host_owner,
    is_by_reference,
    rank_owner,
    run_dir,
)
from flodl_zmq.wire.stream import RESEND_AFTER_S, InOrder, Outage, Outstream

log = logging.getLogger(__name__)

DEFAULTS = Settings()  # the timings below default to the settings table
# Wire dtype name -> the torch dtype of the deposit buffer, and the numpy dtype a received consensus has.
WIRE_TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
WIRE_NUMPY = {name: DTYPES["i8" if name == "int8" else name] for name in WIRE_TORCH}
SEND_RELEASE_TIMEOUT_S = 60.0
# How long a step's timing may wait to be coalesced with the next ones (PROTOCOL.md, timing.batch).
REPORT_PERIOD_S = 0.05
# How long a closing rank waits for the coordinator to acknowledge its last records (its
# goodbye among them): two resends, and under close()'s join timeout.
ACK_WAIT_AT_EXIT_S = 2 * RESEND_AFTER_S


class ParamBuffers:
    """Snapshot and consensus-load machinery for one replica, on reused host buffers.

    `snapshot(mass)` fills one flat float32 host vector (pinned on CUDA) with
    the payload tensors times `mass` and returns the deposit in the wire dtype
    (in `segment` when one is given, for deposits by reference): the f32
    vector itself, its bf16 encoding in a second reused buffer, or its int8
    encoding (values and scales, with this rank's error feedback).
    `load(consensus)` takes a consensus payload in the wire dtype (bf16 and
    int8 are widened into a reused f32 buffer first), writes it back with one
    batched copy, or under a blend adds `blend * (consensus - snapshot)` to
    the live parameters (the overlapped round's correction: the steps taken
    since the snapshot are kept), and returns the divergence triple against
    the last snapshot.
    """

    def __init__(self, model: torch.nn.Module, segment: Segment | None = None, wire_dtype: str = "f32") -> None:
        self.tensors = payload_tensors(model)
        self.device = self.tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.numel = sum(t.numel() for t in self.tensors)
        self.segment = segment
        if wire_dtype not in WIRE_TORCH:
            raise ConfigError(f"wire_dtype must be one of {tuple(WIRE_TORCH)}, got {wire_dtype!r}")
        self.wire_dtype = wire_dtype
        dtype = WIRE_TORCH[wire_dtype]
        # Under int8 the deposit is two tensors: the values, then one f32 scale per block.
        nscales = int8.blocks(self.numel) if wire_dtype == "int8" else 0
        if segment is None:
            self.wire = torch.empty(self.numel, dtype=dtype, pin_memory=self.cuda and wire_dtype == "f32")
            self.scales = torch.empty(nscales, dtype=torch.float32)
        else:
            views = segment.layout([self.numel * dtype.itemsize] + ([nscales * 4] if nscales else []))
            self.wire = torch.frombuffer(views[0], dtype=dtype)
            self.scales = torch.frombuffer(views[1], dtype=torch.float32) if nscales else torch.empty(0)
        self._feedback = int8.ErrorFeedback(self.numel) if wire_dtype == "int8" else None
        # The f32 snapshot is the deposit itself under f32; under bf16 it is kept for the
        # divergence against the consensus, and the deposit is its encoding (bf16_from_f32).
        self.snap = self.wire if wire_dtype == "f32" else torch.empty(self.numel, dtype=torch.float32, pin_memory=self.cuda)
        self._snap_views = flat_views(self.snap, self.tensors)
        self._scratch = torch.empty(self.numel, dtype=torch.float32)
        self._widened = torch.empty(self.numel, dtype=torch.float32) if wire_dtype != "f32" else None
        self.consensus: torch.Tensor | None = None  # the last loaded consensus, f32 (valid until the next load)
        self._recv: torch.Tensor | None = None
        self._recv_views: list[torch.Tensor] = []
        self._recv_done: Any = None  # torch.cuda.Event of the last H2D copy out of _recv
        self._device_scratch: list[torch.Tensor] | None = None
        self._tracker: Any = None
        self._handed_over = threading.Event()  # set once the I/O thread has sent (or never had) a deposit
        self._handed_over.set()
        self.mass = 0.0
        self.pre_norm: float | None = None
        if self.cuda:
            self._recv = torch.empty(self.numel, dtype=torch.float32, pin_memory=True)
            self._recv_views = flat_views(self._recv, self.tensors)

    def mark_queued(self) -> None:
        """The snapshot was queued for sending: the next snapshot must wait for `hold_until_sent`."""
        self._handed_over.clear()

    def hold_until_sent(self, tracker: Any) -> None:
        """Remember the zmq MessageTracker of the deposit that references `snap` (zero-copy send)."""
        self._tracker = tracker
        self._handed_over.set()

    def _wait_sent(self) -> None:
        if not self._handed_over.wait(SEND_RELEASE_TIMEOUT_S):
            raise TrainingError("the previous deposit was never sent: the rank's I/O thread is stuck")
        if self._tracker is not None and not self._tracker.done:
            # The previous deposit still references `snap`; overwriting it now
            # would corrupt a frame already authenticated and in flight.
            self._tracker.wait(SEND_RELEASE_TIMEOUT_S)
        self._tracker = None

    def snapshot(self, mass: float) -> list[torch.Tensor]:
        """Fill the flat host snapshot, pre-multiplied by `mass`; returns the deposit's payload in the wire dtype."""
        self._wait_sent()
        with torch.no_grad():
            torch._foreach_copy_(self._snap_views, [t.detach() for t in self.tensors], non_blocking=self.cuda)
            if self.cuda:
                torch.cuda.synchronize(self.device)  # one fence for all tensors
            self.pre_norm = float(torch.linalg.vector_norm(self.snap))
            if mass == 0.0:
                self._scratch.copy_(self.snap)  # the deposit is zeros: a correction needs the snapshot itself
            if mass != 1.0:
                self.snap.mul_(mass)
            if self._feedback is not None:
                self._feedback.encode(as_numpy(self.snap), as_numpy(self.wire), as_numpy(self.scales))
            elif self.wire is not self.snap:
                bf16_from_f32(as_numpy(self.snap), as_numpy(self.wire))
        self.mass = float(mass)
        return [self.wire, self.scales] if self._feedback is not None else [self.wire]

    def load(self, payload: Sequence[np.ndarray], blend: float | None = None) -> tuple[float | None, float, float | None]:
        """Adopt a consensus payload in the wire dtype: overwrite (`blend` None), or add
        `blend * (consensus - snapshot)` (cpu-async: the rank trained on while the round was in
        flight, and keeps those steps); returns (divergence ||pre - consensus|| / ||consensus||,
        post norm, pre norm)."""
        flat = payload[0].reshape(-1) if payload else np.empty(0, np.float32)
        expected = WIRE_NUMPY[self.wire_dtype]
        pairs = self._feedback is None or int8.is_int8(payload)
        if flat.dtype != expected or flat.size != self.numel or len(payload) != (2 if self._feedback else 1) or not pairs:
            raise TrainingError(
                f"consensus of {flat.size} {flat.dtype} elements does not fit this model's "
                f"{self.numel} {self.wire_dtype} elements: every rank must build the same model "
                f"and run with the same wire_dtype"
            )
        cons = torch_view(flat)  # the received frame is read-only; it is only ever read here
        if self._feedback is not None:
            assert self._widened is not None
            cons = torch.from_numpy(int8.widen(payload, [as_numpy(self._widened)])[0])
        elif self._widened is not None:
            cons = self._widened.copy_(cons)  # exact: bf16 is the top half of f32
        self.consensus = cons
        with torch.no_grad():
            post = float(torch.linalg.vector_norm(cons))
            divergence = None
            if self.mass > 0.0:
                torch.mul(cons, self.mass, out=self._scratch).sub_(self.snap)  # (consensus - snapshot) * mass
                if post > 0.0:
                    divergence = float(torch.linalg.vector_norm(self._scratch)) / self.mass / post
                if blend is not None:
                    self._scratch.div_(self.mass)
            elif blend is not None:
                torch.sub(cons, self._scratch, out=self._scratch)  # a zero-mass snapshot kept itself here
            source = cons if blend is None else self._scratch
            if self.cuda:
                self._load_cuda(source, blend)
            elif blend is None:
                torch._foreach_copy_(self.tensors, flat_views(source, self.tensors))
            else:
                torch._foreach_add_(self.tensors, flat_views(source, self.tensors), alpha=blend)
        return divergence, post, self.pre_norm

    def _load_cuda(self, source: torch.Tensor, blend: float | None) -> None:
        """Write `source` (the consensus, or under a blend the correction) to the device parameters."""
        assert self._recv is not None
        if self._recv_done is not None:
            self._recv_done.synchronize()  # the previous H2D copy must be out of the pinned buffer
        self._recv.copy_(source)
        if blend is None:
            torch._foreach_copy_(self.tensors, self._recv_views, non_blocking=True)
        else:
            if self._device_scratch is None:
                self._device_scratch = [torch.empty_like(t) for t in self.tensors]
            torch._foreach_copy_(self._device_scratch, self._recv_views, non_blocking=True)
            torch._foreach_add_(self.tensors, self._device_scratch, alpha=blend)
        self._recv_done = torch.cuda.Event()
        self._recv_done.record()


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class RankConfig:
    """Where this rank is and how it talks (built from the FLODL_* environment by the API)."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    key: bytes
    run_id: bytes
    control_endpoint: str
    data_endpoint: str
    slowdown: float = 1.0
    heartbeat_s: float = DEFAULTS.rank_heartbeat_period_s
    coordinator_timeout_s: float = DEFAULTS.coordinator_silence_at_rank_s
    # The world forms only once every rank has started: the first word may take long.
    first_contact_timeout_s: float = DEFAULTS.coordinator_first_contact_at_rank_s
    consensus_wait_s: float = DEFAULTS.consensus_wait_at_relay_s  # then the rank asks its relay for it
    # A resumed or re-formed world: the rank loads the reducer's starting consensus (round
    # rec.RESUME_ROUND) before its first step; it never reads a checkpoint (PROTOCOL.md 13).
    resumed: bool = False


def pick_device(local_rank: int) -> torch.device:
    """cuda:(local index) when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


# --------------------------------------------------------------------------- step reports


class StepReport:
    """The steps not yet reported, coalesced into one `Batch` record (training thread only).

    One record per step (a wake-up of the I/O thread, encode and MAC, the
    relay's and the controller's decode) cost a small model's rank about as
    much as its step. Steps now go out together at least every `period_s`,
    and at once before any other record of the rank and before it stops
    stepping (a chunk done, a deposit, a throttle: the edges of a window), so
    the coordinator's gate and ElChe see the same steps in the same order.
    """

    def __init__(self, rank: int, period_s: float) -> None:
        self.rank = rank
        self.period_s = period_s
        self.reported = 0  # the step count of the last report taken
        self._step_count = 0
        self._batch_ms: list[float] = []
        self._data_ms: list[float] = []
        self._loss: list[float] = []
        self._opened = 0.0

    def add(self, batch_ms: float, data_ms: float, loss: float, step_count: int, now: float) -> rec.Batch | None:
        """Note one step; returns the report when it is due."""
        if not self._batch_ms:
            self._opened = now
        self._batch_ms.append(batch_ms)
        self._data_ms.append(data_ms)
        self._loss.append(loss)
        self._step_count = step_count
        return self.take() if now - self._opened >= self.period_s else None

    def take(self) -> rec.Batch | None:
        """The pending steps as one record (None when there are none)."""
        if not self._batch_ms:
            return None
        report = rec.Batch(rank=self.rank, step_count=self._step_count, batch_ms=self._batch_ms,
                           data_ms=self._data_ms, batch_loss=self._loss)
        self._batch_ms, self._data_ms, self._loss = [], [], []
        self.reported = self._step_count
        return report


# --------------------------------------------------------------------------- I/O thread


class _Link:
    """The I/O thread: owns the control and data DEALERs, encodes, decodes, beats.

    Inbound items on `inbox`: ("control", record), ("consensus", Envelope) or
    ("lost", reason). Outbound: `step(...)` and `send(record, payload,
    tracked_by)` from the training thread; pending step timings always go
    out ahead of any other record (`flush_steps`).
    """

    def __init__(self, cfg: RankConfig, ctx: zmq.Context, report_period_s: float) -> None:
        self.cfg = cfg
        self.steps = StepReport(cfg.rank, report_period_s)
        self.codec = Codec(cfg.key, cfg.run_id, rank_sender(cfg.rank))
        self.mapped = SegmentMap(cfg.run_id, run_dir(cfg.key, cfg.run_id))  # the relay's consensus segment, by reference
        self._from_relay = Attribution.signed_by(relay_sender(cfg.host), "this host's relay")
        self._from_coordinator = Attribution.signed_by(coordinator_sender(cfg.rank), "the coordinator's link")
        # The control streams to and from the coordinator (PROTOCOL.md 10.7): what this rank
        # sent is kept until acknowledged, what it receives is handed on in order.
        self._up = Outstream(self.codec)
        self._outage = Outage()  # resends logged once per outage of the link, with a summary after
        self._down = InOrder()
        self.resent_control = 0
        self.duplicates = 0
        self.inbox: Mailbox[tuple[str, Any]] = Mailbox()
        # None is a bare wake-up (close): the I/O thread then sees _stop.
        self._outbox: Mailbox[tuple[Any, list[Any], ParamBuffers | None] | None] = Mailbox()
        self._ctx = ctx
        self._stop = threading.Event()
        self.rejected = 0
        self.resent = 0  # deposits sent again because the relay asked (lost on the local link)
        # The round's deposit, kept until its consensus passes; the round whose consensus is awaited
        # (the deposit's, or a resumed world's start, asked for at once) and when to ask the relay for it.
        self._deposit: tuple[Any, list[Any], ParamBuffers | None] | None = None
        self._awaited: int | None = rec.RESUME_ROUND if cfg.resumed else None
        self._ask_at = 0.0 if cfg.resumed else math.inf
        self._thread = threading.Thread(target=self._run, name=f"flodl-rank{cfg.rank}-io", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step(self, batch_ms: float, data_ms: float, loss: float, step_count: int) -> None:
        """Note one finished step; its report goes out when due (training thread only)."""
        report = self.steps.add(batch_ms, data_ms, loss, step_count, time.monotonic())
        if report is not None:
            self._outbox.put((report, [], None))

    def flush_steps(self) -> None:
        """Send the pending step timings now: the rank is about to stop stepping."""
        report = self.steps.take()
        if report is not None:
            self._outbox.put((report, [], None))

    def send(self, record: Any, payload: Sequence[Any] = (), tracked_by: ParamBuffers | None = None) -> None:
        """Queue `record` for the I/O thread, after the pending step timings (training thread only)."""
        self.flush_steps()
        self._outbox.put((record, list(payload), tracked_by))

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush queued records (the goodbye among them), stop the thread, close the sockets."""
        self._stop.set()
        self._outbox.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # a mailbox is closed only once its receiver has stopped
            self._outbox.close()
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
        data = self._socket(self.cfg.data_endpoint, DATA_MAX_FRAME_BYTES)
        poller = zmq.Poller()
        for s in (control, data, self._outbox):
            poller.register(s, zmq.POLLIN)
        next_beat = started = time.monotonic()
        last_heard: float | None = None
        lost = False
        try:
            while True:
                self._flush(control, data)
                if self._stop.is_set():
                    break
                now = time.monotonic()
                if now >= next_beat:
                    # The steps already reported: a count ahead of the timings would let the
                    # gate close a window whose last steps ElChe has not seen yet.
                    self._encode_send(control, rec.Heartbeat(rank=self.cfg.rank, step_count=self.steps.reported,
                                                             ack=self._down.acked))
                    next_beat = now + self.cfg.heartbeat_s
                self._resend(control, now)
                if now >= self._ask_at and self._awaited is not None:
                    self._encode_send(data, rec.ConsensusRequest(round=self._awaited), Channel.DATA)
                    self._ask_at = now + self.cfg.consensus_wait_s
                limit = self.cfg.first_contact_timeout_s if last_heard is None else self.cfg.coordinator_timeout_s
                if not lost and now - (last_heard or started) > limit:
                    lost = True
                    self.inbox.put(("lost", f"no word from the coordinator for {limit:.0f} s"))
                wake = min(next_beat, self._ask_at, self._up.due_at())
                events = dict(poller.poll(max(1, int((wake - time.monotonic()) * 1000))))
                if control in events:
                    while control.poll(0):
                        frames = recv_bounded(control, CONTROL_MAX_FRAMES, copy=False)
                        env = None if frames is None else self._decode_control(frames)
                        if env is not None:
                            last_heard = time.monotonic()
                            self._on_control(env)
                if data in events:
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
                            self.inbox.put(("consensus", env))
            # A coordinator gone silent, or never heard (its records all refused: another key),
            # acknowledges nothing: the agent or launcher reports this exit instead.
            if not lost and last_heard is not None:
                self._await_acks(control)
        finally:
            self._flush(control, data)
            control.close()
            data.close()

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
        for record in self._down.accept(env.seq, env.record):
            self.inbox.put(("control", record))

    def _acked(self, n: int) -> None:
        if self._up.ack(n):
            summary = self._outage.settled(self.cfg.rank, time.monotonic())
            if summary is not None:
                log.info("rank %d: the coordinator acknowledges again: %d control records resent over %.1f s",
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
        # Framed, a consensus is the reducer's message fanned out verbatim; by reference,
        # the relay signs the header and locator of the copy it placed in its segment.
        sender = self._from_relay if is_by_reference(msg) else FROM_REDUCER
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
        if isinstance(env.record, rec.FrameRequest) and held is not None and held[0].round == env.record.round:
            log.warning("rank %d: the relay lost this rank's deposit of round %d; sending it again",
                        self.cfg.rank, env.record.round)
            self.resent += 1
            self._send_deposit(data, *held, again=True)

    def _flush(self, control: zmq.Socket, data: zmq.Socket) -> None:
        for item in self._outbox.drain():
            if item is None:
                continue
            record, payload, tracked_by = item
            if payload:
                self._send_deposit(data, record, payload, tracked_by)
                self._deposit, self._awaited = item, record.round
                self._ask_at = time.monotonic() + self.cfg.consensus_wait_s
            else:
                self._encode_send(control, record)

    def _send_deposit(self, data: zmq.Socket, record: Any, payload: list[Any], tracked_by: ParamBuffers | None,
                      again: bool = False) -> None:
        """Send a deposit; `again` re-signs a kept one (a fresh sequence number: a copy would be a replay)."""
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


# --------------------------------------------------------------------------- training thread


@dataclass
class _Span:
    epoch: int
    indices: np.ndarray
    pos: int = 0
    started: float = 0.0
    loss_sum: float = 0.0
    batches: int = 0
    compute_ms: float = 0.0
    data_ms: float = 0.0


class RankRuntime:
    """Runs one rank of `job` until the coordinator says stop; `run()` returns the exit code."""

    def __init__(self, job: Job, cfg: RankConfig, device: torch.device | None = None) -> None:
        self.job = job
        self.cfg = cfg
        torch.set_num_threads(job.torch_threads)
        torch.manual_seed(job.seed)  # same initial replica on every rank
        self.device = device or pick_device(cfg.local_rank)
        # A resumed rank's start comes over the wire (_load_start), never from job.resume_from's files.
        self.model = job.model().to(self.device)
        self.optimizer = job.optimizer(self.model.parameters())
        self.stepper = Stepper(job, self.model, self.optimizer, self.device)
        self.scalars = ScalarLog()
        # Built before any thread starts: its workers are forked (loader.py).
        self.pipeline = BatchPipeline(job.dataset, self.device, job.num_workers, job.prefetch_factor,
                                      job.pin_memory, job.collate_fn)
        # A relay on this machine (ipc://) shares memory with this rank: deposit by reference.
        same_host = cfg.data_endpoint.startswith("ipc://")
        try:
            self.buffers = ParamBuffers(
                self.model, Segment(cfg.key, cfg.run_id, rank_owner(cfg.rank)) if same_host else None, job.wire_dtype
            )
        except ShmError as exc:  # a squatted or foreign shared-memory path: deposit framed instead
            log.error("rank %d: deposits go framed, not by reference: %s", cfg.rank, exc)
            self.buffers = ParamBuffers(self.model, None, job.wire_dtype)
        self.blend = job.blend
        self.steps = 0  # cumulative optimizer steps
        self.steps_since_avg = 0
        self.global_step = 0  # every rank's steps in the last loaded consensus (SetGlobalStep)
        self._held_global_step: int | None = None
        self._spans: deque[_Span] = deque()
        self._perms: dict[int, np.ndarray] = {}
        self._throttled = False
        self._consensus_model: torch.nn.Module | None = None
        self._pending_round: int | None = None  # deposited, consensus not yet loaded
        self.stale_consensus = 0  # consensus records refused by round: duplicates, late joins, replays
        self._steps_at_snapshot = 0
        self._held_plans: dict[int, rec.EpochPlan] = {}
        self._epoch_role = 0
        self._epoch_fn_done: set[int] = set()
        self._stop_reason: str | None = None

    # -- the loop --------------------------------------------------------

    def run(self) -> int:
        ctx = zmq.Context.instance()
        # Sync averages after every step: each step is a window edge and is reported at once.
        link = _Link(self.cfg, ctx, 0.0 if self.job.mode == "cpu-sync" else REPORT_PERIOD_S)
        self.link = link
        link.start()
        link.send(
            rec.RankHello(
                rank=self.cfg.rank,
                world_size=self.cfg.world_size,
                host=self.cfg.host,
                model_sig=model_signature(self.model),
                dataset_sig=dataset_signature(self.job.dataset),
            )
        )
        code = 0
        try:
            if self.cfg.resumed:
                self._load_start()
            with recording(self.scalars):
                while self._stop_reason is None:
                    if not self._can_train():
                        link.flush_steps()  # a window edge: the coordinator must see every step before we wait
                    self._drain(block=not self._can_train())
                    if self._stop_reason is None and self._can_train():
                        self._train_one()
        except Exception:
            log.exception("rank %d: training failed", self.cfg.rank)
            code = 1
        finally:
            link.send(rec.Exiting(rank=self.cfg.rank))
            link.close()
            self.pipeline.close()
            if self.buffers.segment is not None:
                self.buffers.segment.close()
        if self._stop_reason and self._stop_reason.startswith("lost"):
            log.error("rank %d: %s; exiting", self.cfg.rank, self._stop_reason)
            code = code or 1
        return code

    def _load_start(self) -> None:
        """Load the resumed world's starting consensus, asked of the relay, before the first step (PROTOCOL.md 13).

        Control records that arrive meanwhile wait in order: a RequestParams served
        on the initial replica would deposit a model the run never had.
        """
        limit = self.cfg.first_contact_timeout_s
        deadline = time.monotonic() + limit
        held: list[Any] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TrainingError(
                    f"rank {self.cfg.rank}: the resumed run's starting model (the consensus of round "
                    f"{rec.RESUME_ROUND}) did not come from the controller's reducer within {limit:g} s "
                    "(FLODL_COORDINATOR_FIRST_CONTACT_AT_RANK): check that this host reaches the controller's "
                    "data ports and that the controller resumed the same run"
                )
            try:
                kind, item = self.link.inbox.get(min(left, 0.5))
            except queue.Empty:
                continue
            if kind == "control":
                held.append(item)
            elif kind == "consensus" and item.record.round == rec.RESUME_ROUND:
                self._adopt(item.payload, None)  # the start replaces the initial replica, whatever the blend
                break
            elif kind == "consensus":
                self.stale_consensus += 1
            else:
                self._stop_reason = f"lost: {item}"
                return
        for record in held:
            self._on_control(record)

    def _can_train(self) -> bool:
        return bool(self._spans) and not self._throttled

    def _drain(self, block: bool) -> None:
        timeout = 0.5 if block else 0.0
        while True:
            try:
                kind, item = self.link.inbox.get(timeout)
            except queue.Empty:
                return
            timeout = 0.0
            if kind == "control":
                self._on_control(item)
            elif kind == "consensus":
                self._on_consensus(item)
            else:
                self._stop_reason = f"lost: {item}"
            if self._stop_reason is not None:
                return

    # -- records ----------------------------------------------------------

    def _on_control(self, r: Any) -> None:
        # Only Update (and Shutdown) releases a Throttle: new data is no licence to run ahead
        # of the round in flight; the rank was throttled for being too far ahead, and still is.
        if isinstance(r, rec.StartEpoch):
            self._add_span(r.plan.epoch, r.plan.offset, r.plan.size)
        elif isinstance(r, rec.Update):
            self._throttled = False
            if r.next_plan is not None:
                if self._pending_round is not None and self._pending_round <= r.round:
                    self._held_plans[r.round] = r.next_plan
                else:
                    self._add_span(r.next_plan.epoch, r.next_plan.offset, r.next_plan.size)
        elif isinstance(r, rec.ExtendPartition):
            self._add_span(r.epoch, r.offset, r.size)
        elif isinstance(r, rec.RequestParams):
            self._deposit(r.round)
        elif isinstance(r, rec.Throttle):
            self._throttled = True
        elif isinstance(r, rec.SetGlobalStep):
            # It counts the steps of the round just finished; until its consensus is loaded,
            # steps_since_avg still holds this rank's share of them (counted twice otherwise).
            if self._pending_round is None:
                self.global_step = r.global_step
            else:
                self._held_global_step = r.global_step
        elif isinstance(r, rec.SetEpochCallbackRole):
            self._epoch_role = r.rank
        elif isinstance(r, rec.ExecuteEval):
            if r.target_rank == self.cfg.rank:
                self._run_eval(r)
        elif isinstance(r, rec.Checkpoint):
            if r.target_rank == self.cfg.rank:
                self._run_checkpoint(r)
        elif isinstance(r, (rec.Shutdown, rec.ShutdownWithSave)):
            self._stop_reason = type(r).__name__
        # CoordHeartbeat, EpochAggregated, EvalBroadcast, DeclareDead: nothing to do on a CPU-reduce rank.

    def _add_span(self, epoch: int, offset: int, size: int) -> None:
        if size <= 0:
            return
        perm = self._perms.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.job.seed, epoch, self.job.total_samples)
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            self._perms[epoch] = perm
        indices = plan_indices(perm, rec.EpochPlan(epoch, offset, size))
        self._spans.append(_Span(epoch, indices))
        bs = self.job.batch_size
        self.pipeline.extend(indices[i : i + bs] for i in range(0, len(indices), bs))

    def _deposit(self, round_id: int) -> None:
        self._steps_at_snapshot = self.steps_since_avg
        payload = self.buffers.snapshot(float(self.steps_since_avg))
        self._pending_round = round_id
        self.buffers.mark_queued()
        self.link.send(rec.SnapshotReady(rank=self.cfg.rank, round=round_id))
        self.link.send(
            rec.RoundFrame(round=round_id, rank=self.cfg.rank, mass=float(self._steps_at_snapshot)),
            payload,
            tracked_by=self.buffers,
        )

    def _on_consensus(self, env: Any) -> None:
        c: rec.Consensus = env.record
        if self._pending_round is None or c.round != self._pending_round:
            # A round this rank did not deposit in (joined late), a duplicate, or a replay: the
            # broadcast waives the sequence check, so the round is the guard (PROTOCOL.md 5.2).
            self.stale_consensus += 1
            log.info("rank %d: consensus of round %d refused: not the round awaited (%s)", self.cfg.rank, c.round,
                     self._pending_round)
            return
        divergence = post = pre = None
        if c.mass > 0.0:
            divergence, post, pre = self._adopt(env.payload, self.blend)
        # Steps taken while the round was in flight keep their credit for the next frame.
        self.steps_since_avg -= self._steps_at_snapshot
        self._pending_round = None
        if self._held_global_step is not None:
            self.global_step, self._held_global_step = self._held_global_step, None
        self.link.send(
            rec.SyncAck(
                rank=self.cfg.rank, round=c.round, step_count=self.steps,
                divergence=divergence, post_norm=post, pre_norm=pre,
            )
        )
        for held in sorted(r for r in self._held_plans if r <= c.round):
            plan = self._held_plans.pop(held)
            self._add_span(plan.epoch, plan.offset, plan.size)

    def _adopt(self, payload: Sequence[np.ndarray], blend: float | None) -> tuple[float | None, float, float | None]:
        """Load a consensus payload (ParamBuffers.load); a blending rank, whose replica is not the
        consensus, also keeps the consensus for its evals."""
        out = self.buffers.load(payload, blend)
        if self.blend is not None and self.job.eval_fn is not None:
            assert self.buffers.consensus is not None
            self._keep_consensus(self.buffers.consensus)
        return out

    # -- training -----------------------------------------------------------

    def _train_one(self) -> None:
        span = self._spans[0]
        if span.pos == 0:
            span.started = time.perf_counter()
            self._maybe_epoch_fn(span.epoch)
        idx = span.indices[span.pos : span.pos + self.job.batch_size]
        t0 = time.perf_counter()
        batch = self.pipeline.next()  # the batch of `idx`: the pipeline keeps the spans' order
        t1 = time.perf_counter()
        lr = self.stepper.follow(self.global_step + self.steps_since_avg)
        if lr is not None:
            self.link.send(rec.LrUpdate(rank=self.cfg.rank, lr=lr))
        loss_value = self.stepper.step(batch)
        t2 = time.perf_counter()
        if self.cfg.slowdown > 1.0:
            # Emulated slower hardware: the delay is part of the step's compute time.
            time.sleep((self.cfg.slowdown - 1.0) * (t2 - t0))
        compute_ms = (time.perf_counter() - t1) * 1000.0
        data_ms = (t1 - t0) * 1000.0
        self.steps += 1
        self.steps_since_avg += 1
        span.pos += len(idx)
        span.batches += 1
        span.loss_sum += loss_value
        span.compute_ms += compute_ms
        span.data_ms += data_ms
        self.link.step(compute_ms, data_ms, loss_value, self.steps)
        if span.pos >= len(span.indices):
            self._spans.popleft()
            sums, counts = self.scalars.take()
            self.link.send(
                rec.EpochMetrics(
                    rank=self.cfg.rank, epoch=span.epoch, avg_loss=span.loss_sum / span.batches,
                    batches_processed=span.batches, samples_processed=len(span.indices),
                    epoch_ms=(time.perf_counter() - span.started) * 1000.0,
                    compute_only_ms=span.compute_ms, data_starve_ms=span.data_ms,
                    scalar_sums=sums, scalar_counts=counts,
                )
            )

    # -- callbacks ----------------------------------------------------------

    def _callback_error(self, what: str) -> str:
        text = f"{what} raised on rank {self.cfg.rank} ({self.cfg.host}):\n{traceback.format_exc()}"
        log.error("%s", text)
        return text

    def _maybe_epoch_fn(self, epoch: int) -> None:
        if self.job.epoch_fn is None or self._epoch_role != self.cfg.rank or epoch in self._epoch_fn_done:
            return
        self._epoch_fn_done.add(epoch)
        t0 = time.perf_counter()
        try:
            self.job.epoch_fn(epoch, self.model)
        except Exception:
            self._callback_error(f"epoch_fn(epoch={epoch})")
        elapsed = (time.perf_counter() - t0) * 1000.0
        self.link.send(rec.EpochFnElapsed(rank=self.cfg.rank, epoch=epoch, elapsed_ms=elapsed))

    def _keep_consensus(self, consensus: torch.Tensor) -> None:
        """Hold the last consensus (flat f32) in a model of its own: a blending (EASGD) rank's
        live model is not the consensus, and `adopt_consensus` evals must score the consensus."""
        if self._consensus_model is None:
            self._consensus_model = self.job.model().to(self.device)
        load_flat(self._consensus_model, consensus)

    def _run_eval(self, r: rec.ExecuteEval) -> None:
        model = self._consensus_model if r.adopt_consensus and self._consensus_model is not None else self.model
        t0 = time.perf_counter()
        metric, error = float("nan"), None
        if self.job.eval_fn is None or self.job.eval_dataset is None:
            error = f"rank {self.cfg.rank} was asked to evaluate but the job has no eval_fn/eval_dataset"
        else:
            try:
                model.eval()
                with torch.no_grad():
                    metric = float(self.job.eval_fn(model, self.job.eval_dataset))
            except Exception:
                error = self._callback_error(f"eval_fn(epoch={r.epoch})")
        self.link.send(
            rec.EvalResult(
                rank=self.cfg.rank, schedule_id=r.schedule_id, epoch=r.epoch, metric=metric,
                elapsed_ms=(time.perf_counter() - t0) * 1000.0, error=error,
            )
        )

    def _run_checkpoint(self, r: rec.Checkpoint) -> None:
        t0 = time.perf_counter()
        error = None
        if self.job.checkpoint_fn is not None:
            try:
                self.job.checkpoint_fn(r.version, self.model)
            except Exception:
                error = self._callback_error(f"checkpoint_fn(version={r.version})")
        self.link.send(
            rec.CheckpointResult(
                rank=self.cfg.rank, version=r.version, elapsed_ms=(time.perf_counter() - t0) * 1000.0, error=error,
            )
        )


__all__ = [
    "ParamBuffers",
    "RankConfig",
    "RankRuntime",
    "pick_device",
]
