"""The f32 sum images of a fold tier, and the kernels that fill, add and encode them, per element.

A core: no sockets, no clocks. flodl_zmq/fold.py keeps the rounds (who
contributed, which rules a contribution passed); this module keeps what a
round does to the bytes: one f32 image per schema, filled, summed and
encoded in pieces on the worker threads (flodl_zmq.threads), block by block so
what follows a sum reads the block while still in cache. The passes that read
held contributions also check them on the way (``Read``), so a tier pays no
pass of its own over a contribution it sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from flodl_zmq import robust, threads
from flodl_zmq.tensors import ELEMENTS, Element, bf16_sum, bf16_tops, f32_from_bf16, torch_view

# (wire dtype name, shape) of each tensor of a round, in order.
Schema = tuple[tuple[str, tuple[int, ...]], ...]


def carve(shapes: Sequence[tuple[int, ...]], dtype: np.dtype) -> tuple[np.ndarray, list[np.ndarray]]:
    """One flat buffer of ``dtype`` holding every shape, and a shaped view of it per shape."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = np.empty(sum(sizes), dtype)
    views, at = [], 0
    for shape, n in zip(shapes, sizes, strict=True):
        views.append(flat[at : at + n].reshape(shape))
        at += n
    return flat, views


# Elements per piece of an image operation handed to a worker thread (4 MB of f32).
PIECE = 1 << 20
# Elements per block of f32 sums: 1 MiB stays in a core's L2, so what follows the sum
# (its finiteness check, the divide, the encode) reads the block while still in cache.
BLOCK = 1 << 18


# The fused checks: an operation that reads held contributions measures each
# input block before it sums it, and checks the block of sums it wrote unless the
# inputs' magnitudes prove it finite (all in cache, so no extra pass over memory;
# an honest round is never checked twice). It reports a `Read`: whether a sum is
# not finite, and each input's largest magnitude (`robust.block_bound`). NaN and
# inf propagate into a sum, so a non-finite input always shows; so does an
# overflow of finite inputs, which no honest deposit comes near. The tier judges the held
# contributions by it (`OpenRound.judge`): a magnitude over the bound refuses its
# contribution as the check on arrival would have, and a sum not finite has the
# culprit found (`OpenRound.refuse_held`), only on that path.


class Read(NamedTuple):
    """What a fused pass saw: a sum not finite (``bad``), and the largest magnitude of each input (``tops``)."""

    bad: bool
    tops: tuple[float, ...]


# Inputs whose magnitudes add up to at most this sum to a finite f32 or bf16 (both reach 3.4e38).
_SURE_FINITE = 1e37


def _quiet(op: Callable[..., bool | None], args: tuple) -> bool | None:
    # A poisoned input overflows or makes NaN by IEEE rules; the check reports it, numpy need not warn.
    with np.errstate(over="ignore", invalid="ignore"):
        return op(*args)


def _bad(sums: np.ndarray) -> bool:
    return not _SUMS.finite_quiet(sums)


def _checked(written: np.ndarray, inputs: Sequence[np.ndarray], write: Callable[[slice, bool], object],
             bad: Callable[[np.ndarray], bool] = _bad) -> tuple:
    """``write(block, sure)`` block by block, each input's block measured first and the block of ``written``
    checked (``bad``) after, both in cache: (a block was bad, the top of each input), the fused checks'
    report. Inputs measured finite and far from overflow prove their sums finite (``sure``): no check."""
    seen, tops = False, [0.0] * len(inputs)
    for i in range(0, written.size, BLOCK):
        block = slice(i, i + BLOCK)
        measured = [robust.block_bound(x[block]) for x in inputs]
        sure = sum(measured) <= _SURE_FINITE  # NaN compares false
        write(block, sure)
        if not sure:
            seen = bad(written[block]) or seen
        tops = [robust.largest(pair) for pair in zip(tops, measured, strict=True)]
    return seen, *tops


class Kernels:
    """A fold's operations on flat pieces of one element dtype, its sums in f32 (``KERNELS``).

    This class is what numpy's floats need (f16: numpy adds them in f32
    directly); ``_F32`` and ``_BF16`` specialize it. ``fill``, ``fill_sum``
    and ``encode_sum`` return ``(bad, top of each input)``: True when a block of
    the sums they wrote is not finite, and what each input holds at most (the
    fused checks above); ``encode(acc, out, d)`` writes ``acc / d``
    (or ``acc``) in this element into ``out``. ``sums_out``: a fold's output
    in this element is its f32 sums themselves, with no buffer of its own.
    """

    sums_out = False

    def __init__(self, element: Element) -> None:
        assert element.widen is not None and element.encode is not None, f"a fold cannot sum {element.name}"
        self.element = element
        self._widen, self._encode = element.widen, element.encode

    def finite(self, x: np.ndarray) -> bool:
        # One read, no allocation: NaN and inf propagate into the sum. A result that
        # overflows from finite elements is settled by the exact check.
        return math.isfinite(float(np.add.reduce(x, dtype=np.float32))) or bool(np.isfinite(x).all())

    def finite_quiet(self, x: np.ndarray) -> bool:
        with np.errstate(all="ignore"):
            return self.finite(x)

    def fill(self, acc: np.ndarray, x: np.ndarray) -> tuple[bool, float]:
        return _checked(acc, (x,), lambda k, _: self._widen(x[k], acc[k]))

    def fill_sum(self, acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[bool, float, float]:
        # f16 inputs add in f32, never in f16.
        return _checked(acc, (a, b), lambda k, _: np.add(a[k], b[k], out=acc[k], dtype=np.float32))

    def add(self, acc: np.ndarray, x: np.ndarray) -> None:
        np.add(acc, x, out=acc)

    def encode(self, acc: np.ndarray, out: np.ndarray, d: np.float32 | None) -> None:
        if d is not None:
            np.divide(acc, d, out=acc)
        self._encode(acc, out)

    def encode_sum(self, acc: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray,
                   d: np.float32 | None) -> tuple[bool, float, float]:
        """``fill_sum`` then ``encode``, block by block, so each block is encoded while still in cache."""
        seen = []
        sums = out if self.sums_out else acc  # f32 sums may be summed and divided in the output itself
        for i in range(0, sums.size, BLOCK):
            block = slice(i, i + BLOCK)
            seen.append(self.fill_sum(sums[block], a[block], b[block]))
            self.encode(sums[block], out[block], d)
        return any(s[0] for s in seen), robust.largest(s[1] for s in seen), robust.largest(s[2] for s in seen)


class _F32(Kernels):
    sums_out = True

    def finite(self, x: np.ndarray) -> bool:
        # x.x is BLAS, the fastest reduction numpy has (values above ~1e19 overflow it: the exact check).
        return math.isfinite(float(np.dot(x, x))) or bool(np.isfinite(x).all())

    def encode(self, acc: np.ndarray, out: np.ndarray, d: np.float32 | None) -> None:
        if d is not None:
            np.divide(acc, d, out=out)
        elif not np.may_share_memory(out, acc):  # the f32 output of a fold is its sums
            np.copyto(out, acc)


class _BF16(Kernels):
    """bf16 adds into f32 sums by torch's mixed add: widened exactly as added (the bits of widen, then add)."""

    def finite(self, x: np.ndarray) -> bool:
        # Non-finite iff the exponent is all ones: +inf 0x7F80, -inf 0xFF80, NaNs above either.
        pos, neg = bf16_tops(x) if x.size else (0, 0)
        return pos < 0x7F80 and neg < 0xFF80

    def fill_sum(self, acc: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[bool, float, float]:
        return _checked(acc, (a, b), lambda k, _: torch_view(f32_from_bf16(a[k], acc[k])).add_(torch_view(b[k])))

    def add(self, acc: np.ndarray, x: np.ndarray) -> None:
        torch_view(acc).add_(torch_view(x))

    def encode_sum(self, acc: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray,
                   d: np.float32 | None) -> tuple[bool, float, float]:
        if d is not None:
            return super().encode_sum(acc, a, b, out, d)
        # No f32 sums at all: the bf16 sums are checked.
        return _checked(out, (a, b), lambda k, sure: bf16_sum(a[k], b[k], out[k], finite=sure),
                        lambda x: not self.finite_quiet(x))


_SUMS = _F32(ELEMENTS["f32"])
# Schema dtype name -> its kernels: the one table a fold dispatches through. i8 is not here:
# int8 values are widened with their scales before any fold sees them.
KERNELS: dict[str, Kernels] = {
    k.element.name: k for k in (_SUMS, _BF16(ELEMENTS["bf16"]), Kernels(ELEMENTS["f16"]))
}


class SumImage:
    """The f32 running sums of one schema (one allocation), filled and added in place.

    ``sums`` are shaped f32 views of the single ``flat`` image. Every operation
    runs in pieces of PIECE elements on the worker threads (flodl_zmq.threads):
    numpy releases the GIL, and the reducer's sum is the one step of a round no
    other process shares. bf16 tensors are widened as they are added (``_BF16``).
    """

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.flat, self.sums = carve([shape for _, shape in schema], np.dtype(np.float32))

    def _pieces(self, op: Callable[[Kernels], Callable[..., tuple | None]], *tensor_lists: Sequence[np.ndarray],
                extra: tuple = ()) -> list:
        """``op(kernels)(sums piece, piece of each tensor list..., *extra)`` over every tensor, piece by
        piece, with the kernels of its dtype; what each piece returned."""
        work = []
        for k, ((dt, _), acc) in enumerate(zip(self.schema, self.sums, strict=True)):
            run = op(KERNELS[dt])
            flats = [acc.reshape(-1)] + [ts[k].reshape(-1) for ts in tensor_lists]
            for i in range(0, flats[0].size, PIECE):
                work.append((run, (*(f[i : i + PIECE] for f in flats), *extra)))
        return threads.each(lambda w: _quiet(*w), work)

    def _read(self, op: Callable[[Kernels], Callable[..., tuple]], inputs: Sequence[Sequence[np.ndarray]],
              *rest: Sequence[np.ndarray], extra: tuple = ()) -> Read:
        """A checking operation over ``inputs`` (then ``rest``) by ``_pieces``, its pieces' reports made one."""
        seen = self._pieces(op, *inputs, *rest, extra=extra)
        return Read(any(s[0] for s in seen), tuple(robust.largest(s[1 + j] for s in seen) for j in range(len(inputs))))

    def fill(self, tensors: Sequence[np.ndarray]) -> Read:
        """Overwrite the sums with ``tensors`` widened to f32, measuring it (``Read``)."""
        return self._read(lambda k: k.fill, [tensors])

    def fill_sum(self, first: Sequence[np.ndarray], second: Sequence[np.ndarray]) -> Read:
        """Overwrite the sums with ``first + second`` (widened to f32), in one pass over each that measures
        both (``Read``)."""
        return self._read(lambda k: k.fill_sum, [first, second])

    def add(self, tensors: Sequence[np.ndarray]) -> None:
        """Add ``tensors`` (widened to f32) into the sums, in place."""
        self._pieces(lambda k: k.add, tensors)

    def encode_into(self, outputs: Sequence[np.ndarray], divisor: float | None = None) -> None:
        """Encode the sums, divided by ``divisor`` when given, in the schema's dtypes into ``outputs``.

        The divide and the encode share one pass (block by block for bf16), so the
        sums are read once. Without a divisor, an output that IS its sum is skipped.
        """
        self._pieces(lambda k: k.encode, outputs, extra=(None if divisor is None else np.float32(divisor),))

    def encode_sum_into(self, first: Sequence[np.ndarray], second: Sequence[np.ndarray],
                        outputs: Sequence[np.ndarray], divisor: float | None = None) -> Read:
        """``fill_sum(first, second)`` then ``encode_into(outputs, divisor)`` in one pass over the inputs that
        measures both (``Read``; when a sum is not finite, the outputs are meaningless).

        The sums never go to memory and back: bf16 without a divisor is summed
        and rounded in one operation; otherwise each block of sums is divided
        and encoded while still in cache (f32 in the output itself).
        """
        return self._read(lambda k: k.encode_sum, [first, second], outputs,
                          extra=(None if divisor is None else np.float32(divisor),))
