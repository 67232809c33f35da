"""The int8 wire (flodl_zmq/int8.py): round-trip error bounds, error feedback's unbiasedness, the
fold's refusal of loose int8 values, and a rank's deposit (the receivers' side: test_wire_format.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq import int8
from flodl_zmq.errors import ConfigError, FoldError
from flodl_zmq.fold import FoldStation
from flodl_zmq.param_buffers import ParamBuffers
from flodl_zmq.payload import check_wire, flatten
from flodl_zmq.wire import Channel, Codec
from flodl_zmq.wire_format import BF16, F32, INT8


def roundtrip(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q, s = np.empty(x.size, int8.I8), np.empty(int8.blocks(x.size), int8.F32)
    int8.quantize(x, q, s)
    return q, s, int8.dequantize(q, s, np.empty(x.size, np.float32))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3 * int8.BLOCK + 17), st.floats(1e-6, 1e4), st.integers(0, 2**32 - 1))
def test_round_trip_error_is_at_most_half_a_step_of_its_block(n, magnitude, seed):
    x = (np.random.default_rng(seed).standard_normal(n) * magnitude).astype(np.float32)
    q, s, y = roundtrip(x)
    assert q.min() >= -127 and q.max() <= 127
    step = np.repeat(s, int8.BLOCK)[:n]
    # Half a step, plus the f32 rounding of x / scale and q * scale.
    assert np.all(np.abs(x - y) <= step * (0.5 + 1e-5) + np.abs(x) * 1e-6)
    # The largest value of each block is exact up to f32 rounding: it maps to +-127.
    for b in range(s.size):
        blk = np.abs(x[b * int8.BLOCK : (b + 1) * int8.BLOCK])
        assert np.abs(q[b * int8.BLOCK : (b + 1) * int8.BLOCK]).max() == 127 or blk.max() == 0


def test_rounding_is_to_nearest_even_and_zero_blocks_stay_zero():
    x = np.zeros(int8.BLOCK + 3, np.float32)
    x[:4] = [127.0, 0.5, 1.5, -2.5]  # scale 1: ties go to the even neighbour
    q, s, y = roundtrip(x)
    assert s[0] == 1.0 and s[1] == 0.0
    assert list(q[:4]) == [127, 0, 2, -2]
    assert not y[int8.BLOCK:].any()


def test_a_non_finite_value_widens_its_whole_block_to_nan():
    x = np.ones(2 * int8.BLOCK, np.float32)
    x[5] = np.inf
    _, _, y = roundtrip(x)
    assert np.isnan(y[: int8.BLOCK]).all() and np.isfinite(y[int8.BLOCK :]).all()


def test_error_feedback_makes_the_average_of_what_arrives_unbiased():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(10_000).astype(np.float32)
    fb = int8.ErrorFeedback(x.size)
    q, s = np.empty(x.size, int8.I8), np.empty(int8.blocks(x.size), int8.F32)
    rounds, total = 200, np.zeros(x.size, np.float64)
    one = None
    for _ in range(rounds):
        fb.encode(x, [q], [s])
        got = int8.dequantize(q, s, np.empty(x.size, np.float32))
        one = np.abs(got - x).mean() if one is None else one
        total += got
    bias = np.abs(total / rounds - x)
    # Without feedback every round repeats the same rounding error (mean `one`); with it, the
    # sum is off by the one residual still held, so the mean error falls like 1 / rounds.
    assert bias.max() <= s.max() / rounds + 1e-6
    assert bias.mean() < one / 50


def test_the_payload_layout_is_values_then_scales_per_tensor():
    enc = int8.PayloadEncoder()
    a, b = np.ones(5000, np.float32), np.full(3, -2.0, np.float32)
    payload = enc.encode([a, b])
    assert [(t.dtype, t.shape) for t in payload] == [
        (int8.I8, (5000,)), (int8.F32, (2,)), (int8.I8, (3,)), (int8.F32, (1,))]
    assert int8.is_int8(payload) and not int8.is_int8([a]) and not int8.is_int8(payload[:3])
    np.testing.assert_array_equal(int8.widen(payload, [np.empty(5000, np.float32), np.empty(3, np.float32)])[1], b)


def test_the_fold_refuses_int8_values_outside_a_pair():
    station = FoldStation([0, 1])
    with pytest.raises(FoldError, match="int8"):
        station.deposit(0, 0, 1.0, [np.zeros(4, np.int8)])


def test_an_int8_rank_deposits_values_and_scales_and_loads_an_int8_consensus():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 100), torch.nn.Linear(100, 10))
    buf = ParamBuffers(m, wire=INT8)
    q, s = buf.snapshot(2.0)
    assert q.dtype == torch.int8 and q.numel() == buf.numel and s.numel() == int8.blocks(buf.numel)
    sent = int8.widen([q.numpy(), s.numpy()], [np.empty(buf.numel, np.float32)])[0]
    want = (flatten(m) * 2.0).numpy()
    assert np.abs(sent - want).max() <= s.max().item() / 2 + 1e-6
    # What this round lost is carried into the next deposit.
    np.testing.assert_allclose(buf._feedback.residual, want - sent, atol=1e-6)
    consensus = int8.PayloadEncoder().encode([flatten(m).numpy() * 0.5])
    buf.load(consensus)
    np.testing.assert_allclose(flatten(m).numpy(), int8.widen(consensus, [np.empty(buf.numel, np.float32)])[0])


VECTORS = json.loads((Path(__file__).resolve().parents[2] / "protocol/vectors/int8.json").read_text())["vectors"]


@pytest.mark.parametrize("vector", [v for v in VECTORS if "n" in v], ids=lambda v: v["name"])
def test_the_int8_vectors_encode_as_written(vector):
    n = vector["n"]
    x = (np.asarray(vector["values"], np.float32) if "values" in vector
         else ((np.arange(n) * 37 % 255 - 127) / 64).astype(np.float32))
    q, s, _ = roundtrip(x)
    assert s.view("<u4").tolist() == vector["scale_bits"]
    if "q" in vector:
        assert q.tolist() == vector["q"]
    else:
        assert hashlib.sha256(q.tobytes()).hexdigest() == vector["q_sha256"]


def test_the_int8_round_frame_vector_decodes_to_values_and_scales():
    vector = next(v for v in VECTORS if v["name"] == "round_frame")
    source = next(v for v in VECTORS if v["name"] == vector["payload_of"])
    codec = Codec(bytes.fromhex(vector["key"]), bytes.fromhex(vector["incarnation"]), "receiver")
    env = codec.decode([bytes.fromhex(f) for f in vector["frames"]], Channel(vector["channel"]))
    assert env.record.round == vector["record"]["round"] and int8.is_int8(env.payload)
    assert env.payload[0].tolist() == source["q"] and env.payload[1].tolist() == source["scales"]


def test_a_model_with_running_statistics_is_refused_the_int8_wire_which_would_zero_its_small_variances():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3), torch.nn.BatchNorm1d(4), torch.nn.Flatten(),
                                torch.nn.Linear(8, 2))
    with torch.no_grad():
        model[1].running_mean.copy_(torch.tensor([12.0, -3.0, 0.5, 0.1]))
        model[1].running_var.copy_(torch.tensor([10.0, 1.0, 0.05, 0.01]))
    # Why: one block holds the whole payload and its step is 12 / 127: 0.05 loads as 0.094 and 0.01 as zero.
    _, _, loaded = roundtrip(flatten(model).numpy())
    assert loaded[-2] == pytest.approx(12.0 / 127) and loaded[-1] == 0.0
    with pytest.raises(ConfigError, match=r"BatchNorm1d '1'.*wire_dtype='bf16'"):
        check_wire(model, INT8)
    for wire in (F32, BF16):
        check_wire(model, wire)
    for norm in (torch.nn.BatchNorm1d(4, track_running_stats=False), torch.nn.GroupNorm(2, 4)):
        check_wire(torch.nn.Sequential(torch.nn.Conv1d(1, 4, 3), norm), INT8)
