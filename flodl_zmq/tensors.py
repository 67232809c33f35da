"""Tensor dtypes of the data plane and the bf16 codec, shared by the wire, the fold and the reducer.

Rules this module keeps:

- Three wire dtypes: ``f32``, ``bf16`` and ``f16``. numpy has no bfloat16, so a
  bf16 tensor lives in a ``uint16`` array holding the top half of the f32 bit
  pattern; on the data plane a ``uint16`` array always means bf16.
- f32 -> bf16 rounds to nearest, ties to even; a NaN stays a NaN (its top half
  with the quiet bit set, so rounding can never carry it into an infinity) and
  an infinity stays an infinity. bf16 -> f32 is exact (a 16-bit shift).
- The converters write into arrays the caller preallocated and reuse (``out``);
  they work through the tensor in cache-sized blocks with numpy ``out=`` calls,
  so a 100 MB tensor costs no 100 MB temporary and no Python per element.
- Little-endian hosts only: the wire carries native element bytes (as floDl does).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Wire dtype name -> numpy dtype of the array that holds its elements.
DTYPES: dict[str, np.dtype] = {
    "f32": np.dtype("<f4"),
    "bf16": np.dtype("<u2"),
    "f16": np.dtype("<f2"),
}
_NAMES: dict[np.dtype, str] = {dt: name for name, dt in DTYPES.items()}

# Elements per block of the blocked converters: 1 MiB of u32 work stays in a
# core's L2, which is what makes the several passes per block nearly free.
BLOCK = 1 << 18


def dtype_name(array: np.ndarray) -> str:
    """The wire dtype name of a numpy array (``uint16`` is bf16)."""
    name = _NAMES.get(array.dtype)
    if name is None:
        raise TypeError(
            f"unsupported tensor dtype {array.dtype}: the data plane carries float32, "
            "bfloat16 (as uint16) and float16; convert the tensor before depositing it"
        )
    return name


def _flat(array: np.ndarray, dtype: np.dtype, role: str) -> np.ndarray:
    if array.dtype != dtype:
        raise TypeError(f"{role} must be {dtype}, got {array.dtype}")
    if role == "output" and not array.flags.c_contiguous:
        raise ValueError("output must be C-contiguous so it can be written in place")
    return array.reshape(-1)


def _scratch(scratch: np.ndarray | None, n: int) -> np.ndarray:
    if scratch is None:
        return np.empty(max(1, min(n, BLOCK)), np.uint32)
    if scratch.dtype != np.uint32 or scratch.ndim != 1 or scratch.size == 0:
        raise TypeError("scratch must be a non-empty 1-D uint32 array")
    return scratch


def bf16_from_f32(
    src_f32: np.ndarray, out_u16: np.ndarray, scratch: np.ndarray | None = None
) -> np.ndarray:
    """Encode ``src_f32`` as bf16 (round to nearest even) into ``out_u16``; returns ``out_u16``.

    ``scratch`` is an optional reusable 1-D uint32 work array (its size sets the
    block size); without it one block of at most ``BLOCK`` elements is allocated.
    """
    if src_f32.shape != out_u16.shape:
        raise ValueError(f"shape mismatch: source {src_f32.shape}, output {out_u16.shape}")
    src = _flat(src_f32, DTYPES["f32"], "source")
    out = _flat(out_u16, DTYPES["bf16"], "output")
    bits = src.view(np.uint32)
    work = _scratch(scratch, bits.size)
    step = work.size
    for i in range(0, bits.size, step):
        s = bits[i : i + step]
        w = work[: s.size]
        o = out[i : i + step]
        # bits16 = (bits + 0x7FFF + lsb(bits >> 16)) >> 16: add just under half an
        # ulp, plus one when the kept part is odd, so exact ties go to even.
        np.right_shift(s, 16, out=w)
        np.bitwise_and(w, 1, out=w)
        np.add(w, 0x7FFF, out=w)
        np.add(w, s, out=w)
        np.right_shift(w, 16, out=o, casting="unsafe")
        # max() propagates NaN, so one cache-hot pass tells whether the block
        # needs the NaN fix-up (the rounding above could carry a NaN to +-inf or
        # across the sign bit).
        if np.isnan(src[i : i + step].max()):
            nan = np.flatnonzero(np.isnan(src[i : i + step]))
            o[nan] = (s[nan] >> 16).astype(np.uint16) | np.uint16(0x0040)
    return out_u16


def f32_from_bf16(src_u16: np.ndarray, out_f32: np.ndarray) -> np.ndarray:
    """Decode bf16 ``src_u16`` exactly into ``out_f32``; returns ``out_f32``."""
    if src_u16.shape != out_f32.shape:
        raise ValueError(f"shape mismatch: source {src_u16.shape}, output {out_f32.shape}")
    src = _flat(src_u16, DTYPES["bf16"], "source")
    out = _flat(out_f32, DTYPES["f32"], "output")
    bits = out.view(np.uint32)
    # Widen into the output itself, then shift in place: no temporary at all;
    # blocked so the second pass finds the block still in cache.
    for i in range(0, bits.size, BLOCK):
        b = bits[i : i + BLOCK]
        np.copyto(b, src[i : i + BLOCK])
        np.left_shift(b, 16, out=b)
    return out_f32


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
