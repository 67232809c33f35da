"""Tensor dtypes of the data plane and the bf16 codec, shared by the wire, the fold and the reducer.

Rules this module keeps:

- Three float wire dtypes: ``f32``, ``bf16`` and ``f16``, and ``i8``, which only
  travels as the values of an int8 payload (flodl_zmq/int8.py). numpy has no bfloat16, so a
  bf16 tensor lives in a ``uint16`` array holding the top half of the f32 bit
  pattern; on the data plane a ``uint16`` array always means bf16. ``ELEMENTS``
  is the one table of them: a name, a numpy dtype, an exact widening to f32 and
  the encoding back; code that treats tensors by element dtype looks it up
  there, never compares names.
- f32 -> bf16 rounds to nearest, ties to even; a NaN stays a NaN (its top half
  with the quiet bit set, so rounding can never carry it into an infinity) and
  an infinity stays an infinity. bf16 -> f32 is exact (a 16-bit shift).
- The converters and ``bf16_sum`` write into arrays the caller preallocated
  and reuses (``out``), so a 100 MB tensor costs no 100 MB temporary and no
  Python per element: each is one vectorized torch operation over zero-copy
  views (``torch_view``); what writes bf16 then rewrites NaNs the protocol's way.
- Little-endian hosts only: the wire carries native element bytes (as floDl does).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class Element:
    """One element dtype of the data plane: its wire name, the numpy dtype holding it, its f32 conversions.

    ``widen(src, out_f32)`` is exact and ``encode(src_f32, out)`` rounds the
    protocol's way (PROTOCOL.md 3.4), each into a preallocated array it returns.
    ``i8`` has neither: its values mean nothing without their block scales, so
    only a whole int8 payload widens (flodl_zmq/wire_format.py).
    """

    name: str
    dtype: np.dtype
    widen: Callable[[np.ndarray, np.ndarray], np.ndarray] | None
    encode: Callable[[np.ndarray, np.ndarray], np.ndarray] | None
    torch: bool = False  # its conversions (and bf16_sum) are torch's: the first use imports it (``preload``)


def _copy(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    np.copyto(out, src, casting="same_kind")
    return out


def _f16_from_f32(src: np.ndarray, out: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # f16 overflow becomes +-inf by IEEE rules; numpy need not warn about it
        return _copy(src, out)


def _flat(array: np.ndarray, dtype: np.dtype, role: str) -> np.ndarray:
    if array.dtype != dtype:
        raise TypeError(f"{role} must be {dtype}, got {array.dtype}")
    if role == "output" and not array.flags.c_contiguous:
        raise ValueError("output must be C-contiguous so it can be written in place")
    return array.reshape(-1)


def bf16_from_f32(src_f32: np.ndarray, out_u16: np.ndarray) -> np.ndarray:
    """Encode ``src_f32`` as bf16 (round to nearest even) into ``out_u16``; returns ``out_u16``.

    torch's vectorized cast does the rounding: for every value but NaN it gives
    the bits of ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` (PROTOCOL.md 3.4),
    three to four times faster than the same formula as numpy passes.
    """
    if src_f32.shape != out_u16.shape:
        raise ValueError(f"shape mismatch: source {src_f32.shape}, output {out_u16.shape}")
    src = _flat(src_f32, DTYPES["f32"], "source")
    out = _flat(out_u16, DTYPES["bf16"], "output")
    torch_view(out).copy_(torch_view(src))
    _protocol_nans(out, lambda nan: src[nan])
    return out_u16


def bf16_sum(a_u16: np.ndarray, b_u16: np.ndarray, out_u16: np.ndarray, finite: bool = False) -> np.ndarray:
    """Encode the f32 sum of bf16 ``a_u16`` and ``b_u16`` as bf16 into ``out_u16``; returns ``out_u16``.

    The bits are those of ``bf16_from_f32(f32_from_bf16(a) + f32_from_bf16(b))``
    in one pass and without the f32 sums: torch adds bf16 in f32 and rounds once
    to nearest even, about a quarter of the time of widen, add and encode.
    ``finite``: the caller measured both inputs finite, so no sum is a NaN and
    the two passes that look for one to rewrite are skipped.
    """
    if not a_u16.shape == b_u16.shape == out_u16.shape:
        raise ValueError(f"shape mismatch: {a_u16.shape} + {b_u16.shape} into {out_u16.shape}")
    a = _flat(a_u16, DTYPES["bf16"], "source")
    b = _flat(b_u16, DTYPES["bf16"], "source")
    out = _flat(out_u16, DTYPES["bf16"], "output")
    import torch

    torch.add(torch_view(a), torch_view(b), out=torch_view(out))
    if not finite:
        _protocol_nans(out, lambda nan: _nan_sums(a[nan], b[nan]))
    return out_u16


def _protocol_nans(out: np.ndarray, exact: Callable[[np.ndarray], np.ndarray]) -> None:
    """Rewrite every NaN torch wrote into ``out`` the protocol's way, from its f32 value ``exact(index)``.

    torch writes NaN as a pattern of its own; the protocol keeps the f32 NaN's
    sign and top payload bits and sets the quiet bit. torch never turns a
    number into a NaN, so the NaNs of ``out`` are exactly those of the source.
    Two 2-byte max passes find any: a positive NaN is above 0x7F80 as int16, a
    negative one above 0xFF80 as uint16 (0x7F80 and 0xFF80 are the infinities).
    """
    if out.size and (out.view(np.int16).max() > 0x7F80 or out.max() > 0xFF80):
        nan = np.flatnonzero((out & np.uint16(0x7FFF)) > 0x7F80)
        out[nan] = (exact(nan).view(np.uint32) >> 16).astype(np.uint16) | np.uint16(0x0040)


def _nan_sums(a_u16: np.ndarray, b_u16: np.ndarray) -> np.ndarray:
    """The f32 sums of the few bf16 pairs whose sum is NaN (a NaN operand, or inf - inf)."""
    a, b = (f32_from_bf16(x, np.empty(x.shape, np.float32)) for x in (a_u16, b_u16))
    with np.errstate(invalid="ignore"):  # inf - inf is a NaN like any other here
        return a + b


def bf16_tops(x_u16: np.ndarray) -> tuple[int, int]:
    """The largest bits of non-empty bf16 ``x_u16`` read as int16 and as uint16.

    The first is the largest positive value's bits; the second, when there is
    a negative, 0x8000 + the largest negative magnitude's bits. Together they
    say what the data plane asks of a bf16 block (a NaN: above 0x7F80 or
    0xFF80; an infinity: equal; its magnitude) in two 2-byte max passes and
    no temporary (a masked copy first costs the round as much again).
    """
    return int(x_u16.view(np.int16).max()), int(x_u16.max())


def f32_from_bf16(src_u16: np.ndarray, out_f32: np.ndarray) -> np.ndarray:
    """Decode bf16 ``src_u16`` exactly into ``out_f32``; returns ``out_f32``."""
    if src_u16.shape != out_f32.shape:
        raise ValueError(f"shape mismatch: source {src_u16.shape}, output {out_f32.shape}")
    src = _flat(src_u16, DTYPES["bf16"], "source")
    out = _flat(out_f32, DTYPES["f32"], "output")
    torch_view(out).copy_(torch_view(src))  # exact; 1.6x numpy's u16 -> u32 cast and shift
    return out_f32


def torch_view(array: np.ndarray) -> Any:
    """A zero-copy torch tensor over ``array``, read-only memory included; ``uint16`` is bfloat16.

    The caller must not write through the tensor of a read-only array.
    """
    import torch

    if not array.flags.writeable:
        _quiet_readonly_warning()
    if array.dtype == DTYPES["bf16"]:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


@functools.cache
def _quiet_readonly_warning() -> None:
    """Ignore torch's warning about wrapping read-only memory, for calls made from this module.

    The data plane wraps received frames and other processes' mapped segments,
    and only reads them. torch warns at most once per process, so the filter
    goes in with the first read-only call, not at import: an import under
    someone's ``warnings.catch_warnings`` (pytest's collection is one) would
    drop it before torch ever warned.
    """
    warnings.filterwarnings(
        "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
    )


def as_numpy(tensor: Any) -> np.ndarray:
    """A zero-copy numpy view of a numpy array or a CPU torch tensor.

    A torch.bfloat16 tensor comes back as its ``uint16`` bit pattern.
    """
    if isinstance(tensor, np.ndarray):
        return tensor
    if not hasattr(tensor, "detach"):  # torch.Tensor, without importing torch for numpy callers
        raise TypeError(f"expected a numpy array or a torch tensor, got {type(tensor).__name__}")
    import torch

    if tensor.device.type != "cpu":
        raise TypeError(
            f"a {tensor.device.type} tensor has no zero-copy numpy view; copy it to a CPU buffer first"
        )
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


# Wire dtype name -> the element: the one table of what each element dtype is.
ELEMENTS: dict[str, Element] = {
    e.name: e
    for e in (
        Element("f32", np.dtype("<f4"), _copy, _copy),
        Element("bf16", np.dtype("<u2"), f32_from_bf16, bf16_from_f32, torch=True),
        Element("f16", np.dtype("<f2"), _copy, _f16_from_f32),
        Element("i8", np.dtype("i1"), None, None),
    )
}
# Wire dtype name -> numpy dtype of the array that holds its elements.
DTYPES: dict[str, np.dtype] = {name: e.dtype for name, e in ELEMENTS.items()}
_BY_DTYPE: dict[np.dtype, Element] = {e.dtype: e for e in ELEMENTS.values()}


def preload(element: Element) -> None:
    """Import torch now, on a thread of its own, when ``element``'s conversions are torch's: a process that
    never imported it (a relay) would otherwise pay the import, about a second, in its first round."""
    if element.torch and "torch" not in sys.modules:
        threading.Thread(target=importlib.import_module, args=("torch",), name="flodl-torch-import").start()


def element_of(array: np.ndarray) -> Element:
    """The element dtype of a numpy array (``uint16`` is bf16); TypeError for any other dtype."""
    element = _BY_DTYPE.get(array.dtype)
    if element is None:
        raise TypeError(
            f"unsupported tensor dtype {array.dtype}: the data plane carries float32, "
            "bfloat16 (as uint16) and float16; convert the tensor before depositing it"
        )
    return element


def dtype_name(array: np.ndarray) -> str:
    """The wire dtype name of a numpy array (``uint16`` is bf16)."""
    return element_of(array).name
