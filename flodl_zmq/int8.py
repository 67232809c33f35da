"""The int8 wire: per-block symmetric int8 with an f32 scale, and error feedback (PROTOCOL.md 3.6).

An f32 tensor of n values travels as two payload tensors: its values as
``i8`` (n,) and one ``f32`` scale per block of BLOCK values (the last block may
be short). A value is ``q * scale`` of its block. A payload is int8 when its
tensors come in such pairs (``is_int8``). Whether a run uses it, and what a
receiver does with it (widen per sender, hold the run to one format), is
flodl_zmq/wire_format.py's (``INT8``, ``Hop``).

Rules this module keeps:

- Symmetric, per block: ``scale = max|x| / 127`` and ``q = round(x / scale)``
  in [-127, 127] (-128 is never written, so the range is symmetric); an
  all-zero block has scale 0 and q 0.
- Rounding is to nearest, ties to even (``np.rint``). The error it leaves is at
  most half a step (``scale / 2``) per value and deterministic: the same input
  always gives the same bytes. Stochastic rounding would make one round
  unbiased at twice the mean squared error and a random draw per value; with
  error feedback the time average is unbiased anyway, so nearest wins.
- Error feedback (``ErrorFeedback``): each sender keeps what the previous
  quantization lost and adds it to the next tensor it sends, so what arrives,
  summed over rounds, differs from what was meant by at most one round's
  error (the residual still held), and the average over T rounds is
  unbiased to within half a step / T.
- A block with a NaN or an infinity gets a non-finite scale and q 0, so it
  widens to NaN everywhere: a receiver's finite check refuses it, as it would
  the f32 value.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BLOCK = 4096
QMAX = 127
I8 = np.dtype("i1")
F32 = np.dtype("<f4")


def blocks(n: int) -> int:
    """The number of scales of an n-value tensor."""
    return -(-n // BLOCK)


def _pieces(n: int) -> list[tuple[slice, slice, int]]:
    """(values, scales, width) of the full blocks as one 2-D piece, then the short tail block if any."""
    full = n // BLOCK
    out = [(slice(0, full * BLOCK), slice(0, full), BLOCK)] if full else []
    if n > full * BLOCK:
        out.append((slice(full * BLOCK, n), slice(full, full + 1), n - full * BLOCK))
    return out


def quantize(x: np.ndarray, q: np.ndarray, scales: np.ndarray) -> None:
    """Write f32 ``x`` (flat) as int8 ``q`` and f32 ``scales`` (preallocated: x.size and blocks(x.size))."""
    if q.size != x.size or scales.size != blocks(x.size) or q.dtype != I8 or scales.dtype != F32:
        raise ValueError(f"int8 buffers of {q.size} {q.dtype} and {scales.size} {scales.dtype} do not fit "
                         f"{x.size} values ({blocks(x.size)} scales)")
    for vals, scs, width in _pieces(x.size):
        x2 = x[vals].reshape(-1, width)
        s = scales[scs]
        np.max(np.abs(x2), axis=1, out=s)
        s /= np.float32(QMAX)
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(np.isfinite(s) & (s > 0), np.float32(1.0) / s, np.float32(0.0)).astype(F32)
        with np.errstate(invalid="ignore"):  # inf * 0 in a non-finite block: its q is 0 just below
            y = x2 * inv[:, None]
        np.nan_to_num(y, copy=False, nan=0.0)
        np.rint(y, out=y)
        np.clip(y, -QMAX, QMAX, out=y)
        q[vals].reshape(-1, width)[...] = y


def dequantize(q: np.ndarray, scales: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Widen int8 ``q`` with ``scales`` into f32 ``out`` (flat, q.size); returns ``out``."""
    if out.size != q.size or scales.size != blocks(q.size) or out.dtype != F32:
        raise ValueError(f"{q.size} int8 values with {scales.size} scales do not widen into {out.size} {out.dtype}")
    for vals, scs, width in _pieces(q.size):
        with np.errstate(invalid="ignore"):  # 0 * inf: a non-finite block widens to NaN, as it should
            np.multiply(q[vals].reshape(-1, width), scales[scs][:, None], out=out[vals].reshape(-1, width))
    return out


def is_int8(payload: Sequence[np.ndarray]) -> bool:
    """Whether ``payload`` is int8 pairs: (i8 values, f32 scales of the right count), each."""
    if not payload or len(payload) % 2:
        return False
    return all(
        v.dtype == I8 and s.dtype == F32 and v.ndim == 1 and s.ndim == 1 and s.size == blocks(v.size)
        for v, s in zip(payload[::2], payload[1::2], strict=True)
    )


def widen(payload: Sequence[np.ndarray], out: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The f32 tensors of an int8 payload, written into ``out`` (one f32 buffer per pair)."""
    return [dequantize(v, s, o) for v, s, o in zip(payload[::2], payload[1::2], out, strict=True)]


class ErrorFeedback:
    """One sender's int8 encoder: what a quantization loses is added to the next tensor sent.

    ``encode(x, q, scales)`` writes ``x + residual`` in int8 and keeps the new
    residual. The sender owns it for the run: a residual is in the units of
    what it sends (a rank's mass-premultiplied deposit, a host's sum, the
    consensus), so it never moves between senders.
    """

    def __init__(self, n: int) -> None:
        self.residual = np.zeros(n, F32)
        self._sent = np.empty(n, F32)

    def encode(self, x: np.ndarray, q: Sequence[np.ndarray], scales: Sequence[np.ndarray]) -> None:
        """Quantize ``x + residual`` into the (``q``, ``scales``) pairs, consecutive pieces of it (a payload's
        chunks, each starting on a block: the same bytes as one pair); the residual becomes what that lost."""
        if x.size != self.residual.size or sum(v.size for v in q) != x.size:
            raise ValueError(f"error feedback for {self.residual.size} values got {x.size} "
                             f"into {sum(v.size for v in q)}")
        r = self.residual
        r += x.reshape(-1)
        at = 0
        for v, s in zip(q, scales, strict=True):
            part = r[at : at + v.size]
            quantize(part, v, s)
            part -= dequantize(v, s, self._sent[at : at + v.size])
            at += v.size
        if not all(np.isfinite(s).all() for s in scales):
            r[...] = 0.0  # a non-finite tensor is refused downstream; it must not poison every later round


class PayloadEncoder:
    """Error feedback for each tensor of a payload, in order (made on first use, again if the sizes change)."""

    def __init__(self) -> None:
        self._feedback: list[ErrorFeedback] = []

    def encode(self, tensors: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The int8 payload of f32 ``tensors``, in fresh buffers (a zero-copy send may still hold the last)."""
        if [f.residual.size for f in self._feedback] != [t.size for t in tensors]:
            self._feedback = [ErrorFeedback(t.size) for t in tensors]
        out: list[np.ndarray] = []
        for f, t in zip(self._feedback, tensors, strict=True):
            q, scales = np.empty(t.size, I8), np.empty(blocks(t.size), F32)
            f.encode(t.reshape(-1), [q], [scales])
            out += [q, scales]
        return out
