"""Tensor dtypes of the data plane and the bf16 codec, shared by the wire, the fold and the reducer.

Rules this module keeps:

- Three wire dtypes: ``f32``, ``bf16`` and ``f16``. numpy has no bfloat16, so a
  bf16 tensor lives in a ``uint16`` array holding the top half of the f32 bit
  pattern; on the data plane a ``uint16`` array always means bf16.
- f32 -> bf16 rounds to nearest, ties to even; a NaN stays a NaN (its top half
  with the quiet bit set, so rounding can never carry it into an infinity) and
  an infinity stays an infinity. bf16 -> f32 is exact (a 16-bit shift).
- The converters write into arrays the caller preallocated and reuse (``out``),
  so a 100 MB tensor costs no 100 MB temporary and no Python per element:
  widening works in cache-sized blocks of numpy ``out=`` calls, narrowing is
  torch's vectorized cast plus a NaN fix-up.
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


def bf16_from_f32(src_f32: np.ndarray, out_u16: np.ndarray) -> np.ndarray:
    """Encode ``src_f32`` as bf16 (round to nearest even) into ``out_u16``; returns ``out_u16``.

    torch's vectorized cast does the rounding: for every value but NaN it gives
    the bits of ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16`` (PROTOCOL.md 3.4),
    three to four times faster than the same formula as numpy passes. NaNs are
    then rewritten the protocol's way, keeping their sign and top payload bits.
    """
    import torch

    if src_f32.shape != out_u16.shape:
        raise ValueError(f"shape mismatch: source {src_f32.shape}, output {out_u16.shape}")
    src = _flat(src_f32, DTYPES["f32"], "source")
    out = _flat(out_u16, DTYPES["bf16"], "output")
    if not src.flags.writeable:
        src = src.copy()  # torch warns on read-only memory; every data-plane caller passes its own buffer
    torch.from_numpy(out).view(torch.bfloat16).copy_(torch.from_numpy(src))
    if src.size and np.isnan(src.max()):  # max() propagates NaN: one pass says whether any is there
        nan = np.flatnonzero(np.isnan(src))
        out[nan] = (src.view(np.uint32)[nan] >> 16).astype(np.uint16) | np.uint16(0x0040)
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
