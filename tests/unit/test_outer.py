"""The outer optimizer (flodl_zmq/outer.py): its step against hand-computed numbers and torch's SGD,
in the reducer's ledger, in the Job's keywords and in a bundle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_zmq import bundle, int8, payload
from flodl_zmq.checkpoints import Resumed
from flodl_zmq.datasets import digits
from flodl_zmq.demo import cross_entropy_step, mlp, sgd
from flodl_zmq.errors import ConfigError, ProtocolError
from flodl_zmq.job import Job
from flodl_zmq.outer import OuterConfig, OuterOptimizer
from flodl_zmq.reducer import RoundLedger
from flodl_zmq.tensors import bf16_from_f32, f32_from_bf16


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def test_nesterov_steps_match_a_hand_computed_pair_of_rounds():
    outer = OuterOptimizer(OuterConfig("nesterov", 0.7, 0.9), f32(1.0, 2.0))
    avg = f32(0.8, 2.2)
    outer.step([avg])
    # d = (0.2, -0.2); buf = d; update = d + 0.9 d = 1.9 d; global = g0 - 0.7 * 1.9 d
    np.testing.assert_allclose(avg, [0.734, 2.266], rtol=1e-6)
    avg2 = f32(0.7, 2.3)
    outer.step([avg2])
    # d2 = 0.734 - 0.7 = 0.034; buf = 0.9 * 0.2 + 0.034 = 0.214; update = 0.034 + 0.9 * 0.214 = 0.2266
    np.testing.assert_allclose(avg2, [0.734 - 0.7 * 0.2266, 2.266 + 0.7 * 0.2266], rtol=1e-6)
    np.testing.assert_allclose(outer.momentum, [0.214, -0.214], rtol=1e-6)


def test_momentum_step_is_slowmo_heavy_ball():
    outer = OuterOptimizer(OuterConfig("momentum", 1.0, 0.5), f32(1.0))
    a = f32(0.5)
    outer.step([a])  # d = 0.5, buf = 0.5, global = 1 - 0.5
    assert a[0] == pytest.approx(0.5)
    b = f32(0.25)
    outer.step([b])  # d = 0.25, buf = 0.25 + 0.25 = 0.5, global = 0.5 - 0.5
    assert b[0] == pytest.approx(0.0)


@pytest.mark.parametrize("kind", ["nesterov", "momentum"])
def test_outer_steps_equal_torch_sgd_on_the_pseudo_gradient(kind):
    rng = np.random.default_rng(3)
    g0 = rng.standard_normal(1000).astype(np.float32)
    cfg = OuterConfig.of(kind, None, None)
    outer = OuterOptimizer(cfg, g0)
    p = torch.nn.Parameter(torch.from_numpy(g0.copy()))
    opt = torch.optim.SGD([p], lr=cfg.lr, momentum=cfg.momentum, nesterov=kind == "nesterov")
    for _ in range(5):
        avg = (p.detach().numpy() + 0.1 * rng.standard_normal(1000)).astype(np.float32)
        p.grad = p.detach() - torch.from_numpy(avg)
        opt.step()
        outer.step([avg])
        np.testing.assert_allclose(avg, p.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_batchnorm_statistics_take_the_average_and_only_the_parameters_are_stepped():
    """A running variance that falls round after round: stepped with momentum it went below zero (every eval
    then NaN, seen on a 1-D CNN under outer='nesterov'); as the average it stays the ranks' own estimate."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    params = payload.parameter_count(model)
    start = payload.flatten(model).numpy()
    outer = OuterOptimizer(OuterConfig.of("nesterov", None, None), start, stepped=params)
    ref = OuterOptimizer(OuterConfig.of("nesterov", None, None), start[:params])
    variance = slice(start.size - 3, start.size)  # payload order: parameters, running_mean, running_var
    for _ in range(12):
        avg = outer.base + np.float32(0.01)  # every parameter moved by the window
        avg[variance] = outer.base[variance] * np.float32(0.6)  # the batches' variance is below the running one
        expected = avg[params:].copy()
        ref_avg = avg[:params].copy()
        outer.step([avg])
        ref.step([ref_avg])
        np.testing.assert_array_equal(avg[params:], expected)  # the buffers published as averaged
        np.testing.assert_array_equal(avg[:params], ref_avg)  # the parameters stepped as a model without buffers
        assert (avg[variance] > 0).all()
    np.testing.assert_array_equal(outer.momentum[params:], 0.0)
    payload.load_flat(model, torch.from_numpy(avg))
    assert torch.isfinite(model.eval()(torch.randn(5, 4))).all()
    # A shard's slice of buffers alone (PROTOCOL.md 10.9 item 11) steps nothing: it publishes the average.
    buffers = OuterOptimizer(OuterConfig.of("nesterov", None, None), start[params:], stepped=0)
    avg = start[params:] * np.float32(0.5)
    expected = avg.copy()
    buffers.step([avg])
    np.testing.assert_array_equal(avg, expected)
    # A model with no parameter values has nothing to step: refused where the run builds its outer step.
    job = Job(model=lambda: torch.nn.BatchNorm1d(3), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
              train_step=lambda m, b: m(b[0]).sum(), dataset=[(torch.zeros(3),)] * 8, batch_size=8, epochs=1,
              outer="nesterov", quiet=True)
    with pytest.raises(ConfigError, match="outer='none'"):
        Resumed().outer_optimizer(job, start[params:], stepped=0)


def test_a_bf16_consensus_is_stepped_in_f32_and_the_global_model_is_kept_unrounded():
    g0 = f32(1.001, -3.3)
    outer = OuterOptimizer(OuterConfig("nesterov", 0.7, 0.9), g0)
    ref = OuterOptimizer(OuterConfig("nesterov", 0.7, 0.9), g0)
    wire = bf16_from_f32(f32(0.9, -3.1), np.empty(2, np.uint16))
    widened = f32_from_bf16(wire, np.empty(2, np.float32))
    outer.step([wire])
    ref.step([widened])
    np.testing.assert_array_equal(outer.global_model, ref.global_model)
    np.testing.assert_array_equal(wire, bf16_from_f32(ref.global_model, np.empty(2, np.uint16)))


def test_the_ledger_publishes_the_stepped_average_and_keeps_it_for_recovery():
    outer = OuterOptimizer(OuterConfig("nesterov", 0.7, 0.9), f32(1.0, 2.0))
    ledger = RoundLedger({"a": [0], "b": [1]}, outer)
    ledger.deposit("a", 0, 1.0, [f32(0.7, 2.1)])
    out = ledger.deposit("b", 0, 3.0, [f32(2.7, 6.9)])  # average (0.85, 2.25)
    np.testing.assert_allclose(out.tensors[0], [1.0 - 0.7 * 1.9 * 0.15, 2.0 + 0.7 * 1.9 * 0.25], rtol=1e-6)
    assert ledger.recover(0).tensors[0] is out.tensors[0]


def test_a_zero_mass_round_is_not_stepped():
    outer = OuterOptimizer(OuterConfig("nesterov", 0.7, 0.9), f32(1.0))
    ledger = RoundLedger({"a": [0]}, outer)
    out = ledger.deposit("a", 0, 0.0, [f32(0.0)])
    assert out.mass == 0.0
    np.testing.assert_array_equal(outer.momentum, [0.0])
    np.testing.assert_array_equal(outer.global_model, [1.0])


def test_a_frame_of_another_model_size_is_refused_before_it_is_summed():
    ledger = RoundLedger({"a": [0], "b": [1]}, OuterOptimizer(OuterConfig("momentum", 1.0, 0.7), f32(1.0, 2.0)))
    with pytest.raises(ProtocolError, match="another model"):
        ledger.deposit("a", 0, 1.0, [f32(1.0, 2.0, 3.0)])
    assert ledger.round_id is None


def int8_wire(x: np.ndarray, encoder: int8.PayloadEncoder) -> tuple[list[np.ndarray], np.ndarray]:
    """``x`` through one sender's int8 encoder: (the payload, what the receiver widens it to)."""
    payload = encoder.encode([x])
    return payload, int8.widen(payload, [np.empty(x.size, np.float32)])[0]


def test_the_pseudo_gradient_is_measured_from_the_consensus_as_published():
    outer = OuterOptimizer(OuterConfig("momentum", 1.0, 0.5), f32(1.0, 2.0))
    avg = f32(0.5, 1.5)
    outer.step([avg])  # d = 0.5, global = (0.5, 1.5)
    # The int8 wire re-encodes it: the ranks load (0.5, 1.5) rounded to the block's step (1.5 / 127).
    payload, loaded = int8_wire(avg, int8.PayloadEncoder())
    outer.published(payload)
    np.testing.assert_array_equal(outer.base, loaded)
    nxt = loaded - f32(0.25, 0.25)  # the window moved each value by -0.25 from where the ranks started
    outer.step([nxt])
    # d = 0.25 (not 0.25 plus the rounding), buf = 0.5 * 0.5 + 0.25, global = 0.5 - 0.5
    np.testing.assert_allclose(outer.momentum, [0.5, 0.5], rtol=1e-6)
    np.testing.assert_allclose(outer.global_model, [0.0, 1.0], rtol=1e-6)
    with pytest.raises(ProtocolError, match="not an int8 payload"):
        outer.published([f32(1.0, 2.0)])


def rounds_through_the_wire(p0: np.ndarray, changes: list[np.ndarray], deposits: bool, consensus: bool,
                            published: bool = True) -> tuple[list[np.ndarray], OuterOptimizer]:
    """Rounds of 4 ranks on 2 hosts with an outer Nesterov step, the window's change of each rank given
    (so that only the wire differs between two runs). Deposits and host frames go int8 when
    ``deposits``, the consensus when ``consensus``; returns what the ranks load each round."""
    outer = OuterOptimizer(OuterConfig.of("nesterov", None, None), p0)
    senders = [int8.PayloadEncoder() for _ in range(7)]  # 4 ranks, 2 relays, the reducer
    start, loaded = p0.copy(), []
    for change in changes:
        sent = [int8_wire(x, senders[i])[1] if deposits else x
                for i, x in enumerate((start + c) * np.float32(0.25) for c in change)]
        hosts = [sent[0] + sent[1], sent[2] + sent[3]]
        avg = sum(int8_wire(h, senders[4 + i])[1] if deposits else h for i, h in enumerate(hosts))
        outer.step([avg])
        if consensus:
            payload, avg = int8_wire(avg, senders[6])
            if published:
                outer.published(payload)
        start = avg
        loaded.append(start.copy())
    return loaded, outer


def window_changes(n: int, rounds: int, seed: int = 0) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """An initial model and each round's per-rank change: a shared drift plus each rank's own noise."""
    rng = np.random.default_rng(seed)
    p0 = rng.uniform(-0.05, 0.05, n).astype(np.float32)
    drift = rng.normal(0, 2e-4, n).astype(np.float32)
    return p0, [[(drift + rng.normal(0, 1e-3, n)).astype(np.float32) for _ in range(4)] for _ in range(rounds)]


def test_the_consensus_rounding_never_enters_the_outer_step():
    # f32 deposits, int8 consensus: the ranks start each window from the rounded consensus, and
    # the outer step must see only what the window changed. Its global model then equals the
    # all-f32 run's; measured from its own unrounded copy instead, it drifts away round by round.
    p0, changes = window_changes(2 * int8.BLOCK, 60)
    ref, ref_outer = rounds_through_the_wire(p0, changes, deposits=False, consensus=False)
    _, outer = rounds_through_the_wire(p0, changes, deposits=False, consensus=True)
    np.testing.assert_allclose(outer.global_model, ref_outer.global_model, rtol=0, atol=1e-6)
    _, unpublished = rounds_through_the_wire(p0, changes, deposits=False, consensus=True, published=False)
    assert np.abs(unpublished.global_model - ref_outer.global_model).max() > 1e-4


def test_the_int8_path_tracks_the_f32_path_over_many_rounds():
    # Every hop int8 with error feedback (rank, relay, reducer): what the ranks load stays within a
    # few quantization steps of the f32 run's model, with no drift over 150 rounds of outer Nesterov.
    p0, changes = window_changes(2 * int8.BLOCK, 150)
    ref, _ = rounds_through_the_wire(p0, changes, deposits=False, consensus=False)
    got, _ = rounds_through_the_wire(p0, changes, deposits=True, consensus=True)
    steps = [np.abs(g - r).max() / (np.abs(r).max() / int8.QMAX) for g, r in zip(got, ref, strict=True)]
    assert max(steps) < 8
    assert np.mean(steps[-40:]) < 1.5 * np.mean(steps[40:80])  # bounded, not a random walk


def job(**kw) -> Job:
    train, _ = digits()
    return Job(model=mlp, optimizer=sgd, train_step=cross_entropy_step, dataset=train, batch_size=32, epochs=1, **kw)


def test_job_keywords_fill_the_paper_defaults_and_refuse_nonsense():
    assert job().outer_config() is None
    assert job(outer="nesterov").outer_config() == OuterConfig("nesterov", 0.7, 0.9)
    assert job(outer="momentum", outer_lr=0.5).outer_config() == OuterConfig("momentum", 0.5, 0.7)
    with pytest.raises(ConfigError, match="outer = 'adam'"):
        job(outer="adam")
    with pytest.raises(ConfigError, match="need an outer step"):
        job(outer_lr=0.7)
    with pytest.raises(ConfigError, match="outer_momentum"):
        job(outer="nesterov", outer_momentum=1.0)
    with pytest.raises(ConfigError, match="max_anchor"):
        job(anchor=200, max_anchor=100)


def test_a_bundle_keeps_the_outer_momentum(tmp_path):
    stem = tmp_path / "run"
    momentum = torch.arange(5, dtype=torch.float32)
    bundle.save(stem, {"w": torch.zeros(5)}, {"outer": "nesterov"}, momentum)
    assert torch.equal(bundle.load_outer(stem), momentum)
    assert bundle.load_outer(tmp_path / "other") is None


def test_a_shards_part_steps_its_int8_slice_as_the_whole_model_steps_those_values():
    # Under int8 a shard publishes its slice re-encoded with its own error feedback, and measures the next
    # pseudo-gradient from that (PROTOCOL.md 10.9 item 11): over a part that starts on a block, its step and
    # its base are the whole model's for those values.
    n, values = 5 * int8.BLOCK + 9, range(2 * int8.BLOCK, 5 * int8.BLOCK + 9)
    rng = np.random.default_rng(3)
    start = rng.standard_normal(n).astype(np.float32)
    config = OuterConfig("nesterov", 0.7, 0.9)
    whole, part = OuterOptimizer(config, start), OuterOptimizer(config, start).part(values)
    for _ in range(3):
        avg = (whole.base + rng.standard_normal(n).astype(np.float32) * np.float32(0.01)).astype(np.float32)
        mine = avg[values.start:values.stop].copy()
        whole.step([avg])
        part.step([mine])
        np.testing.assert_array_equal(mine, avg[values.start:values.stop])
        whole.published(int8_payload(avg))  # what a reducer puts on the wire: block scales from its start
        part.published(int8_payload(mine))
        np.testing.assert_array_equal(part.base, whole.base[values.start:values.stop])
    np.testing.assert_array_equal(part.momentum, whole.momentum[values.start:values.stop])


def int8_payload(x: np.ndarray) -> list[np.ndarray]:
    q, scales = np.empty(x.size, np.int8), np.empty(int8.blocks(x.size), np.float32)
    int8.quantize(x, q, scales)
    return [q, scales]
