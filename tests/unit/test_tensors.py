"""The data-plane dtypes and the bf16 codec (flodl_zmq.tensors)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.tensors import DTYPES, as_numpy, bf16_from_f32, bf16_sum, dtype_name, f32_from_bf16


def encode_bits(*bits: int) -> list[int]:
    src = np.array(bits, dtype=np.uint32).view(np.float32)
    out = np.empty(src.shape, np.uint16)
    bf16_from_f32(src, out)
    return [int(b) for b in out]


def torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_exact_tie_rounds_to_even_down():
    assert encode_bits(0x3F808000) == [0x3F80]  # 1.0 + half an ulp -> 1.0


def test_just_above_tie_rounds_up():
    assert encode_bits(0x3F808001) == [0x3F81]


def test_tie_with_odd_kept_part_rounds_up_to_even():
    assert encode_bits(0x3F818000) == [0x3F82]


def test_infinities_are_kept():
    assert encode_bits(0x7F800000, 0xFF800000) == [0x7F80, 0xFF80]


def test_largest_finite_f32_rounds_to_infinity():
    assert encode_bits(0x7F7FFFFF) == [0x7F80]


@pytest.mark.parametrize(
    "bits", [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001, 0x7FBF8000]
)
def test_nan_stays_nan_with_its_sign(bits):
    (out,) = encode_bits(bits)
    assert out == ((bits >> 16) | 0x0040)
    decoded = np.array([out << 16], np.uint32).view(np.float32)
    assert np.isnan(decoded[0])


def test_nan_fix_up_leaves_the_values_around_each_nan_rounded():
    bits = [0x3F808001, 0x7F800001, 0x3F800000, 0xFFFFFFFF, 0x40000000, 0x7FBFFFFF, 0x3F808000]
    expected = [0x3F81, 0x7FC0, 0x3F80, 0xFFFF, 0x4000, 0x7FFF, 0x3F80]
    assert encode_bits(*bits) == expected


def test_every_non_nan_bf16_survives_decode_then_encode():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = f32_from_bf16(every, np.empty(every.shape, np.float32))
    back = bf16_from_f32(wide, np.empty(every.shape, np.uint16))
    finite_or_inf = ~np.isnan(wide)
    np.testing.assert_array_equal(back[finite_or_inf], every[finite_or_inf])
    assert np.isnan(
        f32_from_bf16(back[~finite_or_inf], np.empty(int((~finite_or_inf).sum()), np.float32))
    ).all()


def test_decode_is_the_exact_top_half_of_the_f32_pattern():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = f32_from_bf16(every, np.empty(every.shape, np.float32))
    np.testing.assert_array_equal(wide.view(np.uint32), every.astype(np.uint32) << 16)


def spec_bits(x: np.ndarray) -> np.ndarray:
    """PROTOCOL.md 3.4, written from the text: (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, NaN aside."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=300))
def test_encode_is_the_spec_formula_for_every_non_nan(values):
    x = np.array(values, np.float32)
    np.testing.assert_array_equal(bf16_from_f32(x, np.empty(x.shape, np.uint16)), spec_bits(x))


def test_encode_is_the_spec_formula_over_random_bit_patterns():
    # Subnormals, ties, the largest finites and every exponent, far more than hypothesis draws.
    bits = np.random.default_rng(3).integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    out = bf16_from_f32(x, np.empty(x.shape, np.uint16))
    ok = ~np.isnan(x)
    np.testing.assert_array_equal(out[ok], spec_bits(x)[ok])
    np.testing.assert_array_equal(out[~ok], (bits[~ok] >> 16).astype(np.uint16) | np.uint16(0x0040))


def test_converters_keep_shapes_and_write_into_the_given_buffer():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    out16 = np.empty((2, 3, 4), np.uint16)
    assert bf16_from_f32(x, out16) is out16
    out32 = np.empty((2, 3, 4), np.float32)
    assert f32_from_bf16(out16, out32) is out32
    np.testing.assert_array_equal(out16, torch_bf16_bits(x.reshape(-1)).reshape(2, 3, 4))


def test_empty_tensors_convert_to_empty_tensors():
    assert bf16_from_f32(np.empty(0, np.float32), np.empty(0, np.uint16)).size == 0
    assert f32_from_bf16(np.empty(0, np.uint16), np.empty(0, np.float32)).size == 0


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="shape mismatch"):
        bf16_from_f32(np.zeros(4, np.float32), np.empty(5, np.uint16))
    with pytest.raises(ValueError, match="shape mismatch"):
        f32_from_bf16(np.zeros(4, np.uint16), np.empty((2, 2), np.float32))


def test_wrong_buffer_dtypes_are_refused():
    with pytest.raises(TypeError, match="source"):
        bf16_from_f32(np.zeros(4, np.float64), np.empty(4, np.uint16))
    with pytest.raises(TypeError, match="output"):
        f32_from_bf16(np.zeros(4, np.uint16), np.empty(4, np.float64))


def test_non_contiguous_output_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        bf16_from_f32(np.zeros(4, np.float32), np.empty(8, np.uint16)[::2])


def test_read_only_sources_convert():
    x = np.ones(5, np.float32)
    x.flags.writeable = False
    bits = bf16_from_f32(x, np.empty(5, np.uint16))
    bits.flags.writeable = False
    np.testing.assert_array_equal(f32_from_bf16(bits, np.empty(5, np.float32)), x)


def test_read_only_sources_convert_without_a_warning():
    # torch warns once per process, so only a fresh interpreter shows whether it would.
    code = (
        "import numpy as np\n"
        "from flodl_zmq.tensors import bf16_sum, f32_from_bf16\n"
        "x = np.ones(4, np.uint16); x.flags.writeable = False\n"
        "f32_from_bf16(x, np.empty(4, np.float32)); bf16_sum(x, x, np.empty(4, np.uint16))\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize(("name", "imported"), [("bf16", True), ("f32", False)])
def test_preload_imports_torch_ahead_only_where_the_elements_conversions_are_torchs(name, imported):
    # A relay never imports torch for f32 (its memory and start), and has it before its first bf16 round.
    code = (
        "import sys, threading\n"
        "from flodl_zmq.tensors import ELEMENTS, preload\n"
        f"preload(ELEMENTS[{name!r}])\n"
        "for t in threading.enumerate():\n"
        "    if t is not threading.main_thread(): t.join()\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(imported)


def widen(u16: np.ndarray) -> np.ndarray:
    """PROTOCOL.md 3.4's decode, written from the text: the bf16 bits are the top half of the f32."""
    return (u16.astype(np.uint32) << 16).view(np.float32)


def check_sum(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out`` is the bf16 encoding of the f32 sum of bf16 ``a`` and ``b`` (spec formula, NaN rule).

    A NaN sum keeps the sign and top payload bits of a NaN operand, quiet bit set
    (of either one when both are NaN: IEEE 754 leaves that choice to the hardware);
    inf - inf gives some NaN.
    """
    with np.errstate(all="ignore"):
        s = widen(a) + widen(b)
    ok = ~np.isnan(s)
    np.testing.assert_array_equal(out[ok], spec_bits(s[ok]))
    quiet_a, quiet_b = a | np.uint16(0x0040), b | np.uint16(0x0040)
    nan_a, nan_b = np.isnan(widen(a)), np.isnan(widen(b))
    np.testing.assert_array_equal(out[nan_a & ~nan_b], quiet_a[nan_a & ~nan_b])
    np.testing.assert_array_equal(out[nan_b & ~nan_a], quiet_b[nan_b & ~nan_a])
    both = nan_a & nan_b
    assert ((out[both] == quiet_a[both]) | (out[both] == quiet_b[both])).all()
    assert np.isnan(widen(out[~ok])).all() and (out[~ok] & 0x0040).all()


@pytest.mark.parametrize("pairing", ["independent", "close", "cancelling"])
def test_bf16_sum_is_the_encoded_f32_sum_over_random_bit_patterns(pairing):
    # Every exponent, subnormals, infinities and NaNs of both signs; "close" pairs share
    # an exponent (ties), "cancelling" pairs have opposite signs (exact zeros, inf - inf).
    rng = np.random.default_rng(7)
    a = rng.integers(0, 1 << 16, 2_000_000, dtype=np.uint32).astype(np.uint16)
    b = {
        "independent": rng.integers(0, 1 << 16, a.size, dtype=np.uint32).astype(np.uint16),
        "close": a ^ rng.integers(0, 1 << 7, a.size, dtype=np.uint32).astype(np.uint16),
        "cancelling": a ^ np.uint16(0x8000) ^ rng.integers(0, 1 << 4, a.size, dtype=np.uint32).astype(np.uint16),
    }[pairing]
    check_sum(a, b, bf16_sum(a, b, np.empty(a.shape, np.uint16)))


def test_bf16_sum_rewrites_each_nan_the_protocol_way():
    a = np.array([0x7F81, 0xFFC1, 0x7F80, 0x3F80, 0x3F80, 0x7F80], np.uint16)  # NaN, -NaN, +inf, 1, 1, +inf
    b = np.array([0x3F80, 0x3F80, 0xFF80, 0x7FA5, 0x3F80, 0x3F80], np.uint16)  # 1, 1, -inf, NaN, 1, 1
    out = bf16_sum(a, b, np.empty(6, np.uint16))
    check_sum(a, b, out)
    assert [int(x) for x in out[[0, 1, 3, 4, 5]]] == [0x7FC1, 0xFFC1, 0x7FE5, 0x4000, 0x7F80]
    assert int(out[2]) & 0x7FFF > 0x7F80  # inf - inf


def test_bf16_sum_takes_read_only_inputs_and_writes_the_given_buffer():
    a = bf16_from_f32(np.linspace(-2, 2, 12, dtype=np.float32), np.empty(12, np.uint16)).reshape(3, 4)
    a.flags.writeable = False
    out = np.empty((3, 4), np.uint16)
    assert bf16_sum(a, a, out) is out
    np.testing.assert_array_equal(widen(out), 2 * widen(a))
    with pytest.raises(ValueError, match="shape mismatch"):
        bf16_sum(a, a, np.empty(12, np.uint16))
    with pytest.raises(TypeError, match="source"):
        bf16_sum(a, np.zeros((3, 4), np.float32), out)


def test_dtype_names_follow_the_wire():
    assert [dtype_name(np.zeros(1, DTYPES[n])) for n in ("f32", "bf16", "f16")] == [
        "f32",
        "bf16",
        "f16",
    ]
    with pytest.raises(TypeError, match="float64"):
        dtype_name(np.zeros(1, np.float64))


def test_as_numpy_returns_numpy_arrays_unchanged():
    a = np.zeros(3, np.float32)
    assert as_numpy(a) is a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_as_numpy_views_torch_memory_without_copying(dtype):
    t = torch.arange(6, dtype=dtype).reshape(2, 3)
    a = as_numpy(t)
    t[0, 0] = 42
    assert a[0, 0] == 42 and a.shape == (2, 3)


def test_as_numpy_shows_bfloat16_as_its_uint16_bits():
    t = torch.tensor([1.0, -2.5, float("inf")], dtype=torch.bfloat16, requires_grad=True)
    a = as_numpy(t)
    assert a.dtype == np.uint16
    np.testing.assert_array_equal(f32_from_bf16(a, np.empty(3, np.float32)), [1.0, -2.5, np.inf])
    with torch.no_grad():
        t[0] = 3.0
    assert a[0] == 0x4040


def test_as_numpy_refuses_tensors_off_the_cpu():
    with pytest.raises(TypeError, match="CPU"):
        as_numpy(torch.zeros(2, device="meta"))


def test_as_numpy_refuses_other_objects():
    with pytest.raises(TypeError, match="list"):
        as_numpy([1.0, 2.0])
