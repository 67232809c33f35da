"""The model <-> wire buffers of one replica: a snapshot to deposit, a consensus to load.

Rules this module keeps:

- Buffers are allocated once. On CUDA they are pinned, filled with
  non-blocking copies and fenced by one synchronize per round, never one per
  tensor; a snapshot waits until ZeroMQ has released the previous deposit
  (sent zero-copy) before overwriting it.
- Given a shared-memory segment (a relay on this machine), the deposit is
  written into it, and goes by reference (flodl_zmq/wire/shm.py).
- The deposit is the flat vector's chunks (``WireFormat.cut``, PROTOCOL.md
  3.4): views of one buffer, never copies; a consensus is loaded chunk by
  chunk from the frames it arrived in, so no flat copy of it is made.
- Flat model-sized vectors are few (each is 0.5 GB at 124M parameters): the
  snapshot (the deposit under f32), a bf16/int8 deposit's f32 snapshot, and
  only under a blend (or after a zero-mass snapshot) a correction buffer, and
  under a blend a bf16/int8 consensus widened. An overwriting load computes
  the divergence in the spent snapshot's place, and widens a bf16/int8
  consensus there chunk by chunk (through one chunk of scratch).
- A consensus that does not fit this model (size, dtype, chunks, int8 pairs) is
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

from flodl_zmq import int8
from flodl_zmq.errors import TrainingError
from flodl_zmq.payload import aligned_views, flat_views, payload_tensors
from flodl_zmq.tensors import as_numpy, torch_view
from flodl_zmq.wire.shm import Segment
from flodl_zmq.wire_format import BF16, CHUNK_VALUES, F32, INT8, WireFormat, chunks, describe

# Wire format -> the torch dtype of the deposit's values buffer (int8's scales are float32).
WIRE_TORCH: dict[WireFormat, torch.dtype] = {F32: torch.float32, BF16: torch.bfloat16, INT8: torch.int8}
SEND_RELEASE_TIMEOUT_S = 60.0


class ParamBuffers:
    """Snapshot and consensus-load machinery for one replica, on reused host buffers.

    `snapshot(mass)` fills one flat float32 host vector (pinned on CUDA) with
    the payload tensors times `mass` and returns the deposit in the wire dtype
    (in `segment` when one is given, for deposits by reference), in chunks
    (PROTOCOL.md 3.4): the f32 vector's own, or those of its bf16 encoding,
    or of its int8 encoding (values and scales, with this rank's error feedback).
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
        self._frames, values = self._deposit_frames(segment)  # the deposit's frames, in the wire dtype
        self._feedback = wire.feedback(self.numel)
        # The f32 snapshot is the deposit itself under f32; otherwise it is kept for the
        # divergence against the consensus, and the deposit is its encoding.
        self.snap = values if values is not None else torch.empty(self.numel, dtype=torch.float32,
                                                                  pin_memory=self.cuda)
        self._snap_views = flat_views(self.snap, self.tensors)
        # Only a blend (or a zero-mass snapshot) needs a third flat vector: allocated then, so an
        # overwriting run holds none (a 124M-parameter model: 0.5 GB, docs/benchmarks.md bench/large.py).
        self._scratch_buffer: torch.Tensor | None = None
        # A blend's bf16/int8 consensus widened to f32: allocated then (an overwriting load widens in the snapshot).
        self._widened_buffer: torch.Tensor | None = None
        self._chunk_scratch: torch.Tensor | None = None  # one chunk of f32: where an overwriting load widens
        # The last loaded consensus, f32 chunks (valid until the next load; after an overwriting bf16/int8
        # load, the snapshot's memory: until the next snapshot).
        self.consensus: list[torch.Tensor] = []
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

    def _deposit_frames(self, segment: Segment | None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The deposit's frames (WireFormat.layout), views of reused memory; and under f32 the flat
        vector they are the chunks of (the snapshot itself), else None."""
        wire, dtype = self.wire_format, WIRE_TORCH[self.wire_format]
        if segment is None:
            values = torch.empty(self.numel, dtype=dtype, pin_memory=self.cuda and not wire.widens)
            scales = torch.empty(int8.blocks(self.numel) if wire.packed else 0, dtype=torch.float32)
            return wire.cut(values, scales), (None if wire.widens else values)
        layout = wire.layout(self.numel)
        views = segment.layout([n * dt.itemsize for dt, n in layout])
        frames = [torch.frombuffer(v, dtype=torch.float32 if wire.packed and i % 2 else dtype)
                  for i, v in enumerate(views)]
        return frames, (None if wire.widens else torch.frombuffer(segment.span(), dtype=dtype))

    @property
    def _scratch(self) -> torch.Tensor:
        if self._scratch_buffer is None:
            self._scratch_buffer = torch.empty(self.numel, dtype=torch.float32)
        return self._scratch_buffer

    @property
    def _widened(self) -> torch.Tensor:
        if self._widened_buffer is None:
            self._widened_buffer = torch.empty(self.numel, dtype=torch.float32)
        return self._widened_buffer

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
            if self.wire_format.widens:
                self.wire_format.encode_into(as_numpy(self.snap), [as_numpy(f) for f in self._frames], self._feedback)
        self.mass = float(mass)
        return list(self._frames)

    def load(self, payload: Sequence[np.ndarray], blend: float | None = None) -> tuple[float | None, float, float | None]:
        """Adopt a consensus payload in the wire dtype: overwrite (`blend` None), or add
        `blend * (consensus - snapshot)` (cpu-async: the rank trained on while the round was in
        flight, and keeps those steps); returns (divergence ||pre - consensus|| / ||consensus||,
        post norm, pre norm)."""
        wire = self.wire_format
        if not wire.fits(payload, self.numel):
            raise TrainingError(
                f"consensus of {len(payload)} {describe(payload)} frames does not fit this model's "
                f"{self.numel} {wire.name} elements in {len(wire.layout(self.numel))} chunk frames: every "
                f"rank must build the same model and run with the same wire_dtype"
            )
        apart: float | None = None  # ||snapshot - consensus|| * mass, once known
        if not wire.widens:
            cons = [torch_view(t.reshape(-1)) for t in payload]  # read-only frames; only ever read here
        elif blend is None:
            cons, apart = self._widen_over_snapshot(payload)
        else:
            wire.widen(payload, as_numpy(self._widened))  # exact from bf16 (the top half of f32); int8: values times scales
            cons = [self._widened]
        self.consensus = cons
        with torch.no_grad():
            post = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(cons))))
            divergence = None
            snaps = _like(self.snap, cons)
            if self.mass > 0.0 and blend is None:
                if apart is None:
                    # The snapshot is spent once its round's consensus exists (the relay shipped it, nobody
                    # asks for it again, the next snapshot overwrites it): the difference goes in its place.
                    self._wait_sent()
                    torch._foreach_sub_(snaps, cons, alpha=self.mass)  # (snapshot - consensus) * mass
                    apart = float(torch.linalg.vector_norm(self.snap))
                if post > 0.0:
                    divergence = apart / self.mass / post
            elif self.mass > 0.0:
                for c, out, snap in zip(cons, _like(self._scratch, cons), snaps, strict=True):
                    torch.mul(c, self.mass, out=out).sub_(snap)  # (consensus - snapshot) * mass
                if post > 0.0:
                    divergence = float(torch.linalg.vector_norm(self._scratch)) / self.mass / post
                self._scratch.div_(self.mass)
            elif blend is not None:
                for c, out in zip(cons, _like(self._scratch, cons), strict=True):
                    torch.sub(c, out, out=out)  # a zero-mass snapshot kept itself here
            source = cons if blend is None else [self._scratch]
            if self.cuda:
                self._load_cuda(source, blend)
            elif blend is None:
                torch._foreach_copy_(*aligned_views(source, self.tensors))
            else:
                torch._foreach_add_(*aligned_views(source, self.tensors), alpha=blend)
        return divergence, post, self.pre_norm

    def _widen_over_snapshot(self, payload: Sequence[np.ndarray]) -> tuple[list[torch.Tensor], float | None]:
        """Widen an overwriting round's bf16/int8 consensus into the spent f32 snapshot, chunk by chunk,
        so no second model-sized f32 vector exists (0.5 GB at 124M parameters); returns its chunks and
        ||snapshot - consensus|| * mass (None after a zero-mass snapshot).

        The deposit is the snapshot's encoding, in frames of its own, so no send waits on the snapshot.
        """
        per = 2 if self.wire_format.packed else 1  # int8: each chunk is (values, scales)
        snaps = [self.snap[a:b] for a, b in chunks(self.numel)]  # the payload's chunks, in order
        if self._chunk_scratch is None:  # kept: a fresh 8 MiB every round would fault in zeroed pages each time
            self._chunk_scratch = torch.empty(min(self.numel, CHUNK_VALUES), dtype=torch.float32)
        part = self._chunk_scratch
        norms = []
        with torch.no_grad():
            for i, snap in enumerate(snaps):
                cons = part[: snap.numel()]
                self.wire_format.widen(payload[i * per : (i + 1) * per], as_numpy(cons))
                if self.mass > 0.0:
                    norms.append(torch.linalg.vector_norm(snap.sub_(cons, alpha=self.mass)))
                snap.copy_(cons)
        return snaps, float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None

    def _load_cuda(self, source: list[torch.Tensor], blend: float | None) -> None:
        """Write `source` (the consensus's chunks, or under a blend the correction) to the device parameters."""
        assert self._recv is not None
        if self._recv_done is not None:
            self._recv_done.synchronize()  # the previous H2D copy must be out of the pinned buffer
        torch._foreach_copy_(_like(self._recv, source), source)
        if blend is None:
            torch._foreach_copy_(self.tensors, self._recv_views, non_blocking=True)
        else:
            if self._device_scratch is None:
                self._device_scratch = [torch.empty_like(t) for t in self.tensors]
            torch._foreach_copy_(self._device_scratch, self._recv_views, non_blocking=True)
            torch._foreach_add_(self.tensors, self._device_scratch, alpha=blend)
        self._recv_done = torch.cuda.Event()
        self._recv_done.record()


def _like(flat: torch.Tensor, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` cut where `chunks` (consecutive pieces of a vector of its size) are."""
    return list(flat.split([c.numel() for c in chunks]))


__all__ = ["ParamBuffers"]
