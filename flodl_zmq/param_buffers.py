"""The model <-> wire buffers of one replica: a snapshot to deposit, a consensus to load.

Rules this module keeps:

- Buffers are allocated once. On CUDA they are pinned, filled with
  non-blocking copies and fenced by one synchronize per round, never one per
  tensor; a snapshot waits until ZeroMQ has released the previous deposit
  (sent zero-copy) before overwriting it.
- Given a shared-memory segment (a relay on this machine), the deposit is
  written into it, and goes by reference (flodl_zmq/wire/shm.py).
- Flat model-sized vectors are few (each is 0.5 GB at 124M parameters): the
  snapshot (the deposit under f32), a bf16/int8 deposit's f32 snapshot, and
  only under a blend (or after a zero-mass snapshot) a correction buffer. An
  overwriting load computes the divergence in the spent snapshot's place.
- A consensus that does not fit this model (size, dtype, the int8 pair) is
  refused whole: every rank must build the same model and the same wire_dtype.
- What the deposit and the consensus are in each wire format is the format's
  (flodl_zmq/wire_format.py); only the torch dtype of its buffer is said here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from flodl_zmq.errors import TrainingError
from flodl_zmq.payload import flat_views, payload_tensors
from flodl_zmq.tensors import as_numpy, torch_view
from flodl_zmq.wire.shm import Segment
from flodl_zmq.wire_format import BF16, F32, INT8, WireFormat

# Wire format -> the torch dtype of the deposit's values buffer (int8's scales are float32).
WIRE_TORCH: dict[WireFormat, torch.dtype] = {F32: torch.float32, BF16: torch.bfloat16, INT8: torch.int8}
SEND_RELEASE_TIMEOUT_S = 60.0


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
    the last snapshot. `wire` is the run's format (`Job.wire`).
    """

    def __init__(self, model: torch.nn.Module, segment: Segment | None = None, wire: WireFormat = F32) -> None:
        self.tensors = payload_tensors(model)
        self.device = self.tensors[0].device
        self.cuda = self.device.type == "cuda"
        self.numel = sum(t.numel() for t in self.tensors)
        self.segment = segment
        self.wire_format = wire
        dtype = WIRE_TORCH[wire]
        # Under int8 the deposit is two tensors: the values, then one f32 scale per block.
        layout = wire.layout(self.numel)
        nscales = layout[1][1] if wire.packed else 0
        if segment is None:
            self.wire = torch.empty(self.numel, dtype=dtype, pin_memory=self.cuda and not wire.widens)
            self.scales = torch.empty(nscales, dtype=torch.float32)
        else:
            views = segment.layout([n * dt.itemsize for dt, n in layout])
            self.wire = torch.frombuffer(views[0], dtype=dtype)
            self.scales = torch.frombuffer(views[1], dtype=torch.float32) if wire.packed else torch.empty(0)
        self._feedback = wire.feedback(self.numel)
        # The f32 snapshot is the deposit itself under f32; otherwise it is kept for the
        # divergence against the consensus, and the deposit is its encoding.
        self.snap = self.wire if not wire.widens else torch.empty(self.numel, dtype=torch.float32, pin_memory=self.cuda)
        self._snap_views = flat_views(self.snap, self.tensors)
        # Only a blend (or a zero-mass snapshot) needs a third flat vector: allocated then, so an
        # overwriting run holds none (a 124M-parameter model: 0.5 GB, docs/benchmarks.md bench/large.py).
        self._scratch_buffer: torch.Tensor | None = None
        self._widened = torch.empty(self.numel, dtype=torch.float32) if wire.widens else None
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

    @property
    def _scratch(self) -> torch.Tensor:
        if self._scratch_buffer is None:
            self._scratch_buffer = torch.empty(self.numel, dtype=torch.float32)
        return self._scratch_buffer

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
            if self.wire is not self.snap:
                self.wire_format.encode_into(as_numpy(self.snap), self._payload_np(), self._feedback)
        self.mass = float(mass)
        return self._payload()

    def _payload(self) -> list[torch.Tensor]:
        return [self.wire, self.scales][: self.wire_format.frames_per_tensor]

    def _payload_np(self) -> list[np.ndarray]:
        return [as_numpy(t) for t in self._payload()]

    def load(self, payload: Sequence[np.ndarray], blend: float | None = None) -> tuple[float | None, float, float | None]:
        """Adopt a consensus payload in the wire dtype: overwrite (`blend` None), or add
        `blend * (consensus - snapshot)` (cpu-async: the rank trained on while the round was in
        flight, and keeps those steps); returns (divergence ||pre - consensus|| / ||consensus||,
        post norm, pre norm)."""
        wire = self.wire_format
        flat = payload[0].reshape(-1) if payload else np.empty(0, np.float32)
        if len(payload) != wire.frames_per_tensor or not wire.is_payload(payload) or flat.size != self.numel:
            raise TrainingError(
                f"consensus of {flat.size} {flat.dtype} elements does not fit this model's "
                f"{self.numel} {wire.name} elements: every rank must build the same model "
                f"and run with the same wire_dtype"
            )
        if self._widened is None:
            cons = torch_view(flat)  # the received frame is read-only; it is only ever read here
        else:
            cons = self._widened
            wire.widen(payload, as_numpy(cons))  # exact from bf16 (the top half of f32); int8: values times scales
        self.consensus = cons
        with torch.no_grad():
            post = float(torch.linalg.vector_norm(cons))
            divergence = None
            if self.mass > 0.0 and blend is None:
                # The snapshot is spent once its round's consensus exists (the relay shipped it, nobody
                # asks for it again, the next snapshot overwrites it): the difference goes in its place.
                self._wait_sent()
                self.snap.sub_(cons, alpha=self.mass)  # (snapshot - consensus) * mass
                if post > 0.0:
                    divergence = float(torch.linalg.vector_norm(self.snap)) / self.mass / post
            elif self.mass > 0.0:
                torch.mul(cons, self.mass, out=self._scratch).sub_(self.snap)  # (consensus - snapshot) * mass
                if post > 0.0:
                    divergence = float(torch.linalg.vector_norm(self._scratch)) / self.mass / post
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


__all__ = ["ParamBuffers"]
