"""The run's wire format: what every round carries, f32, bf16 or int8 (PROTOCOL.md 3.4 and 3.6).

Rules this module keeps:

- One object per format, ``F32``, ``BF16`` and ``INT8``, named by the
  ``wire_dtype`` setting (``named``). The user sets it once, as the Trainer
  keyword ``wire_dtype``; ``Job`` validates it into the object (``Job.wire``),
  and everything downstream holds the object: a rank's buffers
  (param_buffers.py), the controller's kept consensus and its resume
  (checkpoints.py, ``resume_payload``), the reducer (``ReducerConfig.wire``)
  and the relays (``RelayConfig.wire``). No other module compares dtype names
  to learn what a run carries.
- What a format means is said here once: the element of its values
  (``tensors.ELEMENTS``); whether each tensor travels as int8 (values, scales)
  pairs, every sender keeping error feedback (``packed``); whether a payload is
  one of it (``is_payload``); how flat f32 is encoded for it (``encode_into``,
  into buffers of ``layout``), a consensus included (``resume_payload``); how
  a payload of it widens back to f32 (``widen``).
- The reducer is always told the format (the controller runs the script, so it
  has the Job). A relay is told when the run's environment announces it
  (FLODL_WIRE_DTYPE, a run setting: the launcher and the controller hand it to
  every relay and rank, and a rank or controller whose Trainer says otherwise
  refuses to start). A relay runs none of the script, so without that
  variable it cannot know the keyword: it then holds the run to the format of
  the first payload it receives, and the reducer, told, refuses a host frame
  of another.
- A hop of the data plane (``Hop``: a relay's fold, the reducer) refuses a
  payload that is not of the run's format at the first such frame, with the
  protocol error class of that hop and a message naming the setting; an int8
  payload is widened into reused f32 buffers per sender, and what the hop
  sends on is encoded in int8 again with the hop's own error feedback.
- Wire bytes are the protocol's: a format decides what tensors a payload
  holds, never how they are framed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from flodl_zmq import int8
from flodl_zmq.errors import ConfigError, ProtocolError
from flodl_zmq.tensors import ELEMENTS, Element, element_of

SETTING = "wire_dtype"
F32_DTYPE = ELEMENTS["f32"].dtype
# Values per payload chunk (PROTOCOL.md 3.4): 8 MiB of f32, so no frame takes a slow link longer than its
# silence; libzmq resets a connection's heartbeat timeout only when a whole frame has arrived. A whole
# number of int8 blocks, so an int8 chunk's scales are the flat vector's own.
CHUNK_VALUES = 1 << 21
CHUNK_MAX_BYTES = CHUNK_VALUES * F32_DTYPE.itemsize  # the longest payload frame of any format
T = TypeVar("T", bound=Any)


def chunks(n: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a flat n-value vector: CHUNK_VALUES each, the last one shorter."""
    return [(a, min(a + CHUNK_VALUES, n)) for a in range(0, n, CHUNK_VALUES)]


@dataclass(frozen=True, eq=False)
class WireFormat:
    """One wire format. Compare formats with ``is``: there is one object per format (pickling keeps it)."""

    name: str  # the value of the wire_dtype setting
    element: Element  # the element of the values a payload carries
    packed: bool  # int8: each tensor is (values, scales), and every sender keeps error feedback
    widens: bool  # a payload must be widened to f32 before it is used as one (f32's is itself)

    def __reduce__(self) -> tuple:
        return named, (self.name,)

    def __repr__(self) -> str:
        return f"WireFormat({self.name})"

    def layout(self, n: int) -> list[tuple[np.dtype, int]]:
        """(numpy dtype, element count) of each frame of the payload of a flat n-value vector: its chunks
        (``chunks``) in order, under int8 each one's values then its scales."""
        out: list[tuple[np.dtype, int]] = []
        for a, b in chunks(n):
            out += [(self.element.dtype, b - a)] + ([(F32_DTYPE, int8.blocks(b - a))] if self.packed else [])
        return out

    @property
    def frames_per_chunk(self) -> int:
        """Payload frames per chunk (`layout`): its values, and under int8 their scales."""
        return 2 if self.packed else 1

    def cut(self, values: T, scales: T | None = None) -> list[T]:
        """The payload frames of a flat vector's ``values`` (and, int8, its ``scales``): views, one per
        frame of ``layout``, in order (numpy arrays or torch tensors alike)."""
        out = []
        for a, b in chunks(len(values)):
            out.append(values[a:b])
            if self.packed:
                assert scales is not None
                out.append(scales[a // int8.BLOCK : int8.blocks(b)])
        return out

    def largest_frame_bytes(self, n: int) -> int:
        """The longest payload frame a round of a flat n-value model carries: what a data socket
        that knows the model accepts at most (links.data_max_frame_bytes; PROTOCOL.md 6.1)."""
        return max(np.dtype(dt).itemsize * count for dt, count in self.layout(n))

    def feedback(self, n: int) -> int8.ErrorFeedback | None:
        """A sender's error feedback for a flat n-value tensor (int8), else None."""
        return int8.ErrorFeedback(n) if self.packed else None

    def is_payload(self, payload: Sequence[np.ndarray]) -> bool:
        """Whether ``payload`` is a payload of this format (int8: (values, scales) pairs)."""
        if self.packed:
            return int8.is_int8(payload)
        return all(isinstance(t, np.ndarray) and t.dtype == self.element.dtype for t in payload)

    def fits(self, payload: Sequence[np.ndarray], n: int) -> bool:
        """Whether ``payload`` is exactly this format's payload of a flat n-value vector (``layout``)."""
        return self.is_payload(payload) and [(t.dtype, t.size) for t in payload] == self.layout(n)

    def values(self, payload: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """The value tensor of each model tensor of a payload of this format."""
        return payload[::2] if self.packed else payload

    def numel(self, payload: Sequence[np.ndarray]) -> int:
        """How many f32 values a payload of this format widens to."""
        return sum(v.size for v in self.values(payload))

    def encode_into(self, src: np.ndarray, out: Sequence[np.ndarray],
                    feedback: int8.ErrorFeedback | None = None) -> None:
        """Encode flat f32 ``src`` into this format's preallocated frames ``out`` (``layout``); int8
        needs the sender's ``feedback``. Under f32, ``out`` may be ``src``'s own chunks (nothing to do)."""
        if self.packed:
            if feedback is None:
                raise ValueError("an int8 payload is encoded with its sender's error feedback")
            feedback.encode(src, out[::2], out[1::2])
            return
        flat, at = src.reshape(-1), 0
        for o in out:
            if not np.may_share_memory(flat[at : at + o.size], o):
                assert self.element.encode is not None
                self.element.encode(flat[at : at + o.size], o.reshape(-1))
            at += o.size

    def widen(self, payload: Sequence[np.ndarray], out: np.ndarray) -> np.ndarray:
        """Widen a payload of this format into flat f32 ``out`` (its tensors one after the other); returns ``out``."""
        if self.numel(payload) != out.size:
            raise ValueError(f"a {self.name} payload of {self.numel(payload)} values does not widen into {out.size}")
        at = 0
        for i, v in enumerate(self.values(payload)):
            part = out[at : at + v.size]
            at += v.size
            if self.packed:
                int8.dequantize(v, payload[2 * i + 1], part)
            else:
                assert self.element.widen is not None
                self.element.widen(v.reshape(-1), part)
        return out

    def resume_payload(self, consensus: np.ndarray) -> list[np.ndarray]:
        """A resumed world's starting consensus (f32) as its broadcast carries it in this format.

        f32 is the checkpoint itself. bf16 is exact too: the checkpoint is the
        widened bf16 broadcast, or under an outer step its f32 global model,
        whose broadcast is this same rounding. int8 is quantized afresh,
        without the error feedback of the run before (it is not saved).
        """
        flat = np.array(consensus, dtype=np.float32).reshape(-1)  # a copy: the caller's consensus moves on
        out = [np.empty(count, dt) for dt, count in self.layout(flat.size)]
        self.encode_into(flat, out, self.feedback(flat.size))
        return out


F32 = WireFormat("f32", ELEMENTS["f32"], packed=False, widens=False)
BF16 = WireFormat("bf16", ELEMENTS["bf16"], packed=False, widens=True)
INT8 = WireFormat("int8", ELEMENTS["i8"], packed=True, widens=True)
FORMATS: dict[str, WireFormat] = {f.name: f for f in (F32, BF16, INT8)}
NAMES = tuple(FORMATS)


def named(name: object, source: str = SETTING) -> WireFormat:
    """The format the setting names; ConfigError naming ``source`` (the setting as the user wrote it) otherwise."""
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ConfigError(f"{source} must be one of {NAMES}, got {name!r}")
    return fmt


def of_payload(payload: Sequence[np.ndarray]) -> WireFormat | None:
    """The format ``payload`` is a payload of; None when it is none's (empty, f16, mixed, loose i8)."""
    if not payload:
        return None
    return next((f for f in FORMATS.values() if f.is_payload(payload)), None)


def describe(payload: Sequence[np.ndarray]) -> str:
    """What a payload is, for a message: a format's name, else its element dtypes."""
    fmt = of_payload(payload)
    if fmt is not None:
        return fmt.name
    names = set()
    for t in payload:
        try:
            names.add(element_of(t).name)
        except (TypeError, AttributeError):
            names.add(str(getattr(t, "dtype", type(t).__name__)))
    return "/".join(sorted(names)) if names else "empty"


class Hop:
    """A receiver that sums payloads in f32 and sends the result on: a relay's fold, the reducer.

    ``take(sender, payload)`` refuses (``error``, the hop's protocol error) a
    payload not of the run's format and returns what the sums take: the
    payload itself, or an int8 one widened into this sender's reused f32
    buffers (valid until its next). ``send_on(tensors)`` is what goes out:
    the sums themselves, or under int8 their encoding with this hop's own
    error feedback. Told the format (``wire``), the hop holds every frame to
    it; not told (None), to the format of the first payload it takes.
    """

    def __init__(self, who: str, wire: WireFormat | None, error: type[ProtocolError]) -> None:
        self.who, self.wire, self.error = who, wire, error
        self.announced = wire is not None
        self._buffers: dict[object, list[np.ndarray]] = {}
        self._encoder = int8.PayloadEncoder()

    def take(self, sender: object, payload: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        wire = self.wire
        if wire is None:
            wire = of_payload(payload)
            if wire is None:
                raise self.error(f"{self.who}: the payload from {sender} is {describe(payload)}, not one of a "
                                 f"{SETTING} ({', '.join(NAMES)})")
            self.wire = wire
        elif not wire.is_payload(payload):
            if self.announced:
                why = f"the run's {SETTING} is {wire.name}"
            else:  # a relay spawned without FLODL_WIRE_DTYPE
                why = f"the run's first payload was {wire.name} (this process was not told the run's {SETTING})"
            raise self.error(f"{self.who}: the payload from {sender} is {describe(payload)}, but {why}: every process "
                             f"of a run must use the one {SETTING} its Trainer names")
        if not wire.packed:
            return payload
        bufs = self._buffers.get(sender)
        values = wire.values(payload)
        if bufs is None or [b.size for b in bufs] != [v.size for v in values]:
            bufs = self._buffers[sender] = [np.empty(v.size, np.float32) for v in values]
        return int8.widen(payload, bufs)

    def send_on(self, tensors: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        return self._encoder.encode(tensors) if self.wire is not None and self.wire.packed else tensors


__all__ = ["BF16", "F32", "FORMATS", "INT8", "NAMES", "Hop", "WireFormat", "describe", "named", "of_payload"]
