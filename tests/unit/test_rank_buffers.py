"""The rank's snapshot / consensus-load machinery (flodl_zmq.param_buffers), control handling and cores (flodl_zmq.rank), on CPU."""

from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from flodl_zmq import int8
from flodl_zmq.errors import ConfigError, TrainingError
from flodl_zmq.job import Job
from flodl_zmq.mailbox import Mailbox
from flodl_zmq.param_buffers import ParamBuffers
from flodl_zmq.payload import (
    check_model,
    copy_unaveraged,
    flatten,
    load_flat,
    model_signature,
    parameter_count,
    payload_tensors,
    refresh_estimates,
)
from flodl_zmq.rank import RankRuntime, core_share, epoch_fns_due, keep_to_share
from flodl_zmq.rank_link import ConsensusIn, FromCoordinator, RankConfig
from flodl_zmq.tensors import as_numpy, bf16_from_f32, f32_from_bf16
from flodl_zmq.wire import new_key
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.shm import Segment, rank_owner
from flodl_zmq.wire_format import BF16, CHUNK_MAX_BYTES, CHUNK_VALUES, F32, INT8


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)
    )


def test_payload_is_parameters_then_float_buffers_without_integer_counters():
    m = net()
    tensors = payload_tensors(m)
    assert (
        len(tensors) == len(list(m.parameters())) + 2
    )  # BN running mean and var, not num_batches_tracked
    assert all(t.dtype == torch.float32 for t in tensors)


def test_float64_model_is_refused_naming_the_tensor_and_the_fix():
    with pytest.raises(ConfigError, match="the model's '1.weight' is torch.float64 .*float32"):
        payload_tensors(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2).double()))


class _MaskedNet(torch.nn.Module):
    """A causal self-attention model's shape: a float -inf mask buffer beside BatchNorm's statistics."""

    def __init__(self, persistent: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1), persistent=persistent)
        self.register_buffer("rotary", torch.linspace(0.1, 1.0, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) @ (self.mask.exp() + self.rotary)


def test_a_non_persistent_buffer_never_travels_so_a_minus_inf_mask_trains_on_a_cluster():
    # A -inf causal mask registered persistent=False (the transformer's usual shape) went into every
    # deposit, and the reducer dropped each rank as a poisoner: the run failed with all_ranks_lost.
    m = _MaskedNet(persistent=False)
    check_model(m, F32)
    assert [tuple(t.shape) for t in payload_tensors(m)] == [(4, 4), (4,), (4,), (4,), (4,), (4,)]
    assert torch.isfinite(flatten(m)).all()
    plain = torch.nn.Module()
    plain.body = m.body
    assert model_signature(m) == model_signature(plain)  # the derived buffers are not in the layout
    loaded = _MaskedNet(persistent=False)
    loaded.mask.zero_()
    load_flat(loaded, flatten(m))
    copy_unaveraged(loaded, m)  # a copy of the consensus scores with the rank's own derived buffers
    assert torch.equal(loaded.mask, m.mask) and torch.equal(loaded.rotary, m.rotary)


@pytest.mark.parametrize("norm", [torch.nn.utils.spectral_norm, torch.nn.utils.parametrizations.spectral_norm])
def test_a_spectral_norm_averaged_into_short_vectors_is_estimated_again_before_it_is_scored(norm):
    # An average of unit singular vectors is shorter than one, and eval mode reads the norm off them as they
    # stand: a cpu-async consensus scored an MSE of 3.6 where one power iteration gave 0.30.
    torch.manual_seed(0)
    layer = norm(torch.nn.Linear(8, 6))
    for _ in range(30):
        layer(torch.randn(4, 8))  # training mode: each forward runs one power iteration
    shrunk = flatten(layer)
    at = parameter_count(layer)
    shrunk[at:] *= 0.4  # the averaged u and v: the buffers after the parameters
    load_flat(layer, shrunk)
    layer.eval()
    x = torch.randn(3, 8)
    weight = layer.parametrizations.weight.original if hasattr(layer, "parametrizations") else layer.weight_orig
    exact = x @ (weight / torch.linalg.matrix_norm(weight, 2)).T + layer.bias
    assert not torch.allclose(layer(x), exact, atol=1e-3)
    refresh_estimates(layer)
    assert torch.allclose(layer(x), exact, atol=1e-3)


def test_a_persistent_non_finite_buffer_is_refused_before_training_naming_it_and_the_fix():
    with pytest.raises(ConfigError, match="float buffer 'mask' holds a NaN or an infinity.*persistent=False"):
        check_model(_MaskedNet(persistent=True), F32)


def test_a_lazy_model_is_refused_with_the_fix_and_works_once_a_forward_pass_has_shaped_it():
    m = torch.nn.Sequential(torch.nn.LazyLinear(3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with pytest.raises(ConfigError, match="uninitialized parameter .*run one forward pass"):
        payload_tensors(m)
    m(torch.zeros(1, 5))
    assert [tuple(t.shape) for t in payload_tensors(m)] == [(3, 5), (3,), (2, 3), (2,)]


def test_snapshot_is_the_flat_payload_times_the_mass():
    m = net()
    buf = ParamBuffers(m)
    snap = buf.snapshot(3.0)[0]
    assert torch.equal(snap, flatten(m) * 3.0)
    assert buf.pre_norm == pytest.approx(float(flatten(m).norm()))


def test_snapshot_reuses_one_buffer_across_rounds():
    m = net()
    buf = ParamBuffers(m)
    first = buf.snapshot(1.0)[0].data_ptr()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    assert buf.snapshot(2.0)[0].data_ptr() == first


def test_snapshot_is_a_copy_so_training_on_does_not_change_a_deposit():
    m = net()
    buf = ParamBuffers(m)
    before = buf.snapshot(1.0)[0].clone()
    with torch.no_grad():
        next(m.parameters()).add_(5.0)
    assert torch.equal(buf.snap, before)


def test_load_overwrites_parameters_and_float_buffers():
    m = net()
    buf = ParamBuffers(m)
    target = torch.arange(buf.numel, dtype=torch.float32).numpy()
    target.setflags(write=False)  # received frames are read-only
    buf.load([target])
    assert np.array_equal(flatten(m).numpy(), target)
    assert torch.equal(m[1].running_mean, torch.from_numpy(target[-6:-3].copy()))


def train_on(m: torch.nn.Module, by: float) -> torch.Tensor:
    """Stand-in for steps taken after a snapshot: every payload value moves by `by`; returns the move."""
    with torch.no_grad():
        for t in payload_tensors(m):
            t.add_(by)
    return torch.full((sum(t.numel() for t in payload_tensors(m)),), by)


@pytest.mark.parametrize("mass", [3.0, 0.0])
def test_a_consensus_applied_mid_window_as_a_correction_keeps_the_steps_taken_since_the_snapshot(mass):
    # Overlapped (cpu-async): the rank deposited, trained on, then the consensus landed.
    m = net()
    buf = ParamBuffers(m)
    buf.snapshot(mass)
    moved = train_on(m, 0.25)
    consensus = torch.linspace(-1.0, 1.0, buf.numel)
    buf.load([consensus.numpy()], blend=1.0)
    assert torch.allclose(flatten(m), consensus + moved, atol=1e-6)  # the consensus, plus no step lost


def test_a_blend_under_one_moves_that_share_of_the_way_and_keeps_the_steps_since():
    m = net()
    buf = ParamBuffers(m)
    snap = flatten(m)
    buf.snapshot(2.0)
    moved = train_on(m, -0.5)
    consensus = torch.zeros(buf.numel)
    buf.load([consensus.numpy()], blend=0.5)
    assert torch.allclose(flatten(m), snap + 0.5 * (consensus - snap) + moved, atol=1e-6)


def test_a_correction_with_no_step_since_the_snapshot_lands_on_the_consensus():
    m = net()
    buf = ParamBuffers(m)
    buf.snapshot(5.0)
    consensus = flatten(m) * 0.9 + 0.1
    buf.load([consensus.numpy()], blend=1.0)
    assert torch.allclose(flatten(m), consensus, atol=1e-6)


def test_divergence_is_relative_distance_between_snapshot_and_consensus():
    m = net()
    buf = ParamBuffers(m)
    pre = flatten(m)
    buf.snapshot(4.0)
    cons = pre * 1.1
    divergence, post, pre_norm = buf.load([cons.numpy()])
    assert post == pytest.approx(float(cons.norm()), rel=1e-6)
    assert pre_norm == pytest.approx(float(pre.norm()), rel=1e-6)
    assert divergence == pytest.approx(float((pre - cons).norm() / cons.norm()), rel=1e-4)


def _flat_model_vectors(buf: ParamBuffers) -> set[int]:
    """The distinct model-sized float32 host vectors the buffers allocated (by address; not the consensus loaded)."""
    return {t.data_ptr() for t in vars(buf).values() if isinstance(t, torch.Tensor) and t is not buf.consensus
            and t.dtype == torch.float32 and t.numel() == buf.numel}


def test_an_overwriting_round_holds_one_flat_model_vector_and_keeps_the_divergence():
    # A 124M-parameter model: every extra flat vector is 0.5 GB per rank (docs/benchmarks.md, bench/large.py).
    m = net()
    buf = ParamBuffers(m)
    pre = flatten(m)
    buf.snapshot(2.0)
    cons = pre + 0.25
    divergence, _, _ = buf.load([cons.numpy()])
    assert divergence == pytest.approx(float((pre - cons).norm() / cons.norm()), rel=1e-4)
    assert np.array_equal(flatten(m).numpy(), cons.numpy())
    assert len(_flat_model_vectors(buf)) == 1  # the snapshot (the deposit), no scratch
    buf.load([cons.numpy()], blend=1.0)  # a blend still gets its correction buffer
    assert len(_flat_model_vectors(buf)) == 2


def test_zero_mass_snapshot_reports_no_divergence():
    m = net()
    buf = ParamBuffers(m)
    buf.snapshot(0.0)
    divergence, _, _ = buf.load([flatten(m).numpy()])
    assert divergence is None


def test_consensus_of_another_model_is_refused():
    buf = ParamBuffers(net())
    with pytest.raises(TrainingError, match="same model"):
        buf.load([np.zeros(buf.numel + 1, np.float32)])


# ---------------------------------------------------------------------------- bf16 wire


def _bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def test_bf16_snapshot_is_the_round_to_nearest_even_encoding_of_the_premultiplied_payload():
    m = net()
    buf = ParamBuffers(m, wire=BF16)
    wire = buf.snapshot(3.0)[0]
    assert wire.dtype == torch.bfloat16 and wire.numel() == buf.numel
    expected = np.empty(buf.numel, np.uint16)
    bf16_from_f32((flatten(m) * 3.0).numpy(), expected)
    assert np.array_equal(_bf16_bits(wire), expected)
    assert torch.equal(buf.snap, flatten(m) * 3.0)  # the f32 snapshot stays for the divergence


def test_a_nan_parameter_goes_on_the_bf16_wire_as_the_protocol_s_quiet_nan():
    m = net()
    with torch.no_grad():
        first = next(m.parameters())
        first.view(-1)[0] = float("nan")
        first.view(-1)[1] = -float("nan")
    bits = flatten(m).numpy().view(np.uint32)[:2]
    wire = _bf16_bits(ParamBuffers(m, wire=BF16).snapshot(1.0)[0])
    np.testing.assert_array_equal(wire[:2], (bits >> 16).astype(np.uint16) | np.uint16(0x0040))


def test_bf16_snapshot_and_consensus_reuse_their_buffers_across_rounds():
    m = net()
    buf = ParamBuffers(m, wire=BF16)
    deposit = buf.snapshot(1.0)[0]
    wire, snap = deposit.data_ptr(), buf.snap.data_ptr()
    buf.load([_bf16_bits(deposit).copy()])
    widened = buf.consensus[0].data_ptr()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    deposit = buf.snapshot(2.0)[0]
    assert deposit.data_ptr() == wire and buf.snap.data_ptr() == snap
    buf.load([_bf16_bits(deposit).copy()])
    assert buf.consensus[0].data_ptr() == widened


def test_bf16_round_trip_loads_the_model_within_bf16_precision():
    m = net()
    before = flatten(m)
    buf = ParamBuffers(m, wire=BF16)
    frame = _bf16_bits(buf.snapshot(1.0)[0]).copy()
    frame.setflags(write=False)  # received frames are read-only
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(-3.0)
    divergence, _, _ = buf.load([frame])
    after = flatten(m)
    assert torch.allclose(after, before, rtol=2**-8, atol=0.0)  # bf16 keeps 8 significant bits
    assert divergence is not None and divergence <= 2**-8


def test_bf16_buffers_refuse_an_f32_consensus_naming_the_wire_dtype():
    buf = ParamBuffers(net(), wire=BF16)
    with pytest.raises(TrainingError, match="wire_dtype"):
        buf.load([np.zeros(buf.numel, np.float32)])


class FakeTracker:
    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def wait(self, timeout: float) -> None:
        self.waited = True
        self.done = True


def test_snapshot_waits_until_zeromq_released_the_previous_deposit():
    buf = ParamBuffers(net())
    buf.snapshot(1.0)[0]
    buf.mark_queued()
    tracker = FakeTracker()
    buf.hold_until_sent(tracker)
    buf.snapshot(1.0)[0]
    assert tracker.waited


def test_flatten_and_load_flat_round_trip():
    a, b = net(), net()
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(-2.0)
    load_flat(b, flatten(a))
    assert torch.equal(flatten(a), flatten(b))


def test_model_signature_tells_architectures_apart():
    assert model_signature(net()) == model_signature(net())
    assert model_signature(net()) != model_signature(torch.nn.Linear(4, 2))


def _runtime(rank: int = 0, **job: Any) -> RankRuntime:
    data = TensorDataset(torch.randn(64, 4), torch.zeros(64, dtype=torch.long))
    keywords: dict[str, Any] = dict(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    job = Job(train_step=lambda m, b: m(b[0]).sum(), dataset=data, batch_size=8, epochs=1, **{**keywords, **job})
    cfg = RankConfig(rank=rank, local_rank=0, world_size=2, host="h", key=b"k" * 32, incarnation=b"r" * 16,
                     control_endpoint="tcp://127.0.0.1:1", data_endpoint="tcp://127.0.0.1:2")
    return RankRuntime(job, cfg, device=torch.device("cpu"))


class _NumpyInit(torch.nn.Module):
    """A model whose factory draws its initial weights from numpy's global generator, not torch's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.from_numpy(np.random.randn(2, 4).astype(np.float32)))
        self.bias = torch.nn.Parameter(torch.zeros(2))


def _decay_groups(params: Any) -> torch.optim.Optimizer:
    """nanoGPT's optimizer factory: it reads its parameters twice, matrices decayed, the rest not."""
    return torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=0.1)


def test_every_rank_builds_the_same_replica_and_optimizer_then_draws_random_numbers_of_its_own():
    # Seeded by torch alone, a factory drawing from numpy gave each rank its own start; the optimizer
    # factory got a spent generator on its second read (biases never trained); and every rank drew the
    # same dropout masks step after step.
    np.random.seed(7)  # what the process drew before does not matter
    first = _runtime(rank=0, model=_NumpyInit, optimizer=_decay_groups)
    first_draw = torch.rand(4)
    np.random.seed(8)
    second = _runtime(rank=1, model=_NumpyInit, optimizer=_decay_groups)
    assert torch.equal(first.model.weight, second.model.weight)
    assert [len(g["params"]) for g in second.optimizer.param_groups] == [1, 1]
    assert not torch.equal(first_draw, torch.rand(4))


def test_new_data_does_not_release_a_throttled_rank_only_an_update_does():
    rt = _runtime()
    rt._on_control(rec.Throttle())
    rt._on_control(rec.StartEpoch(plan=rec.EpochPlan(epoch=0, offset=0, size=16)))
    rt._on_control(rec.ExtendPartition(epoch=0, offset=16, size=16))
    assert not rt._can_train()  # running ahead would train on a replica the consensus overwrites
    rt._on_control(rec.Update(round=1, next_plan=None))
    assert rt._can_train()


def test_a_consensus_for_a_round_not_awaited_is_refused_and_counted():
    # The broadcast channel waives the sequence check: a replayed or duplicate consensus is
    # refused by its round, before anything of it is loaded (PROTOCOL.md 5.2).
    rt = _runtime()
    before = [p.detach().clone() for p in rt.model.parameters()]
    for round_id in (1, 7):  # nothing deposited: no round is awaited
        rt._on_consensus(SimpleNamespace(record=rec.Consensus(round_id, 1.0), payload=[]))
    assert rt.stale_consensus == 2
    assert all(torch.equal(a, b) for a, b in zip(before, rt.model.parameters(), strict=True))


def _resumed_runtime(**cfg: Any) -> RankRuntime:
    """A rank of a resumed world whose job names a bundle no worker can read."""
    data = TensorDataset(torch.zeros(64, 4), torch.zeros(64, dtype=torch.long))
    job = Job(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
              train_step=lambda m, b: m(b[0]).sum(), dataset=data, batch_size=8, epochs=1,
              resume_from="/nonexistent/on/this/host/ckpt-r000000007")
    rc = RankConfig(rank=0, local_rank=0, world_size=1, host="h", key=b"k" * 32, incarnation=b"r" * 16,
                    control_endpoint="tcp://127.0.0.1:1", data_endpoint="tcp://127.0.0.1:2", resumed=True, **cfg)
    return RankRuntime(job, rc, device=torch.device("cpu"))


def test_a_resumed_rank_never_opens_a_file_and_starts_from_the_consensus_it_is_sent(monkeypatch):
    # PROTOCOL.md 13: only the controller reads checkpoints; a worker's host may not even have one.
    def no_file(*args: Any, **kw: Any) -> Any:
        raise AssertionError(f"a rank opened a file: {args!r}")

    # open() patched where our modules look it up, not in builtins: torch imports lazily during the
    # test, and the import system (pytest's rewriting hook too) opens files of its own.
    for name, module in list(sys.modules.items()):
        if name == "flodl_zmq" or name.startswith("flodl_zmq."):
            monkeypatch.setattr(module, "open", no_file, raising=False)
    monkeypatch.setattr(torch, "load", no_file)
    monkeypatch.setattr(np, "load", no_file)
    rt = _resumed_runtime()
    start = np.arange(rt.buffers.numel, dtype=np.float32)
    rt.link = SimpleNamespace(inbox=Mailbox())
    # Control records that come before the starting model wait for it, in order.
    rt.link.inbox.put(FromCoordinator(rec.StartEpoch(plan=rec.EpochPlan(epoch=0, offset=0, size=16))))
    rt.link.inbox.put(ConsensusIn(SimpleNamespace(record=rec.Consensus(round=9, mass=1.0), payload=[start * 0])))
    rt.link.inbox.put(ConsensusIn(SimpleNamespace(record=rec.Consensus(round=rec.RESUME_ROUND, mass=1.0),
                                                  payload=[start])))
    rt._load_start()
    assert torch.equal(flatten(rt.model), torch.from_numpy(start))
    assert rt.stale_consensus == 1 and rt._can_train() and rt._pending_round is None


def test_a_resumed_rank_whose_starting_model_never_comes_fails_by_name():
    rt = _resumed_runtime(coordinator_first_contact_at_rank_s=0.3)
    rt.link = SimpleNamespace(inbox=Mailbox())
    with pytest.raises(TrainingError, match=r"starting model .* did not come from the controller's reducer"):
        rt._load_start()


def test_an_async_rank_trains_on_while_its_round_travels_and_the_consensus_loses_none_of_those_steps():
    rt = _runtime(mode="cpu-async", easgd_alpha=1.0)
    sent: list[Any] = []
    rt.link = SimpleNamespace(send=lambda record, *a, **k: sent.append(record), step=lambda *a: None,
                              note_lr=lambda lr: None, flush_steps=lambda: None)
    rt._on_control(rec.StartEpoch(plan=rec.EpochPlan(epoch=0, offset=0, size=64)))
    for _ in range(2):
        train_one(rt)
    rt._on_control(rec.RequestParams(round=1))
    deposit = next(r for r in sent if isinstance(r, rec.RoundFrame))
    at_snapshot = flatten(rt.model)
    assert deposit.mass == 2.0 and rt._can_train()  # no stop for the round
    for _ in range(3):
        train_one(rt)
    moved = flatten(rt.model) - at_snapshot
    assert float(moved.abs().sum()) > 0
    consensus = at_snapshot * 0.5 + 1.0
    rt._on_consensus(SimpleNamespace(record=rec.Consensus(round=1, mass=4.0), payload=[consensus.numpy()]))
    assert torch.allclose(flatten(rt.model), consensus + moved, atol=1e-6)
    assert rt.steps_since_avg == 3  # the steps in flight weigh in the next deposit
    assert isinstance(sent[-1], rec.SyncAck) and sent[-1].round == 1


def train_one(rt: RankRuntime) -> None:
    """One step as the rank's loop takes it: the next batch, the job's step, its report."""
    rt.step(rt.stepper.step(rt._take_batch()))


# ---------------------------------------------------------------------------- chunked payloads (PROTOCOL.md 3.4)


class Straddling(torch.nn.Module):
    """2 chunks and a bit: its first tensor crosses the first chunk's end, its second the next one's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Parameter(torch.randn(3, CHUNK_VALUES // 2 + 7))
        self.b = torch.nn.Parameter(torch.randn(CHUNK_VALUES // 2 + 4321) * 1e-3)


def _flat_encoding(wire, flat: np.ndarray) -> np.ndarray:
    """What `flat` is after the wire's rounding, computed over the vector as one piece (no chunks)."""
    if wire is F32:
        return flat
    out = np.empty(flat.size, np.float32)
    if wire is BF16:
        return f32_from_bf16(bf16_from_f32(flat, np.empty(flat.size, np.uint16)), out)
    q, scales = np.empty(flat.size, np.int8), np.empty(int8.blocks(flat.size), np.float32)
    int8.quantize(flat, q, scales)
    return int8.dequantize(q, scales, out)


@pytest.mark.parametrize("wire", [F32, BF16, INT8], ids=lambda w: w.name)
def test_a_deposit_over_a_chunk_goes_in_frames_of_at_most_a_chunk_and_loads_back_exactly(wire):
    m = Straddling()
    buf = ParamBuffers(m, wire=wire)
    frames = [as_numpy(f) for f in buf.snapshot(2.0)]
    assert len(frames) == 3 * (2 if wire is INT8 else 1)
    assert all(f.nbytes <= CHUNK_MAX_BYTES for f in frames)
    assert wire.fits(frames, buf.numel)
    want = _flat_encoding(wire, flatten(m).numpy() * 2.0)
    assert np.array_equal(wire.widen(frames, np.empty(buf.numel, np.float32)), want)
    other = Straddling()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    consensus = [f.copy() for f in frames]  # as received: never the deposit's own memory
    ParamBuffers(other, wire=wire).load(consensus)
    assert np.array_equal(flatten(other).numpy(), want)
    buf.load(consensus)  # the depositor itself: its divergence is measured against its snapshot, chunk by chunk
    assert np.array_equal(flatten(m).numpy(), want)


@pytest.mark.parametrize("wire", [BF16, INT8], ids=lambda w: w.name)
def test_an_overwriting_bf16_or_int8_round_widens_the_consensus_into_the_spent_snapshot(wire):
    # No widened f32 copy of the consensus beside the snapshot (0.5 GB per rank at 124M parameters,
    # docs/benchmarks.md bench/large.py), over several chunks, with the divergence as before.
    m = Straddling()
    buf = ParamBuffers(m, wire=wire)
    pre = flatten(m).numpy()
    consensus = [as_numpy(f).copy() for f in buf.snapshot(2.0)]  # as received
    divergence, _, _ = buf.load(consensus)
    want = _flat_encoding(wire, pre * 2.0)
    assert np.array_equal(flatten(m).numpy(), want)
    assert divergence == pytest.approx(float(np.linalg.norm(pre - want) / np.linalg.norm(want)), rel=1e-4)
    assert len(_flat_model_vectors(buf)) == 1  # the snapshot, whose memory the consensus's chunks are
    assert torch.equal(torch.cat(buf.consensus), torch.from_numpy(want))
    buf.load(consensus, blend=1.0)  # a blend keeps its consensus apart from the snapshot, and its correction
    assert len(_flat_model_vectors(buf)) == 3


def test_a_tensor_cut_by_a_chunk_end_loads_across_it_contiguous_or_not():
    m = torch.nn.Linear(3, 4)
    with torch.no_grad():
        m.weight.data = torch.zeros(3, 4).t()  # a non-contiguous parameter (as channels_last makes them)
    flat = torch.arange(16, dtype=torch.float32)
    load_flat(m, [flat[:5], flat[5:9], flat[9:]])  # chunk ends inside the weight and inside the bias
    assert torch.equal(flatten(m), flat)


@pytest.mark.parametrize("wire", [F32, INT8], ids=lambda w: w.name)
def test_a_deposit_by_reference_lays_each_chunk_as_a_frame_of_the_segment(wire, tmp_path):
    m = Straddling()
    segment = Segment(new_key(), bytes(range(16)), rank_owner(0), str(tmp_path))
    try:
        frames = ParamBuffers(m, segment=segment, wire=wire).snapshot(1.0)
        assert len(frames) == 3 * (2 if wire is INT8 else 1)
        assert [n for _, n in segment.frames] == [f.nbytes for f in as_numpy_list(frames)]
        with open(tmp_path / segment.name, "rb") as f:
            data = f.read()
        for (offset, nbytes), frame in zip(segment.frames, as_numpy_list(frames), strict=True):
            assert data[offset : offset + nbytes] == frame.tobytes()
        want = _flat_encoding(wire, flatten(m).numpy())
        assert np.array_equal(wire.widen(as_numpy_list(frames), np.empty(want.size, np.float32)), want)
    finally:
        segment.close()


def as_numpy_list(frames):
    return [as_numpy(f) for f in frames]


def test_a_copy_of_the_consensus_takes_the_ranks_own_integer_buffers_which_no_round_averages():
    # Under cpu-async the evals score a copy of the consensus built fresh from the factory: a model's counters
    # (BatchNorm's num_batches_tracked, a running count) read their initial zeros there, and an input
    # normaliser that divides by its count scored 0.38 where the rank's own model scored 0.92.
    torch.manual_seed(0)
    live, copy = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
    live.register_buffer("seen", torch.zeros((), dtype=torch.long))
    copy.register_buffer("seen", torch.zeros((), dtype=torch.long))
    live.train()
    for _ in range(5):
        live(torch.randn(8, 3))
        live.seen += 8
    load_flat(copy, flatten(live))
    copy_unaveraged(copy, live)
    assert int(copy.num_batches_tracked) == 5 and int(copy.seen) == 40
    assert torch.equal(copy.running_var, live.running_var)  # the float buffers are the consensus's, loaded


def test_the_epoch_role_runs_epoch_fn_for_each_epoch_it_trained_no_batch_of_before_its_next_one():
    # A rank of a small share can get no batch of an epoch: its epoch_fn was silently skipped (1 epoch in 30).
    assert list(epoch_fns_due(set(), 0)) == [0]
    assert list(epoch_fns_due({0, 1}, 2)) == [2]
    assert list(epoch_fns_due({0, 1}, 4)) == [2, 3, 4]
    assert list(epoch_fns_due({4}, 7)) == [5, 6, 7]
    assert list(epoch_fns_due({0, 1, 2, 3}, 2)) == []  # a late chunk of an earlier epoch: it ran already
    assert list(epoch_fns_due(set(), 5)) == [5]  # a rank new to the role (a resume, an heir) starts where it is


def test_a_hosts_ranks_share_its_cores_equally_in_order_the_rest_left_to_the_services():
    assert [core_share({0, 1}, r, 2, 1) for r in (0, 1)] == [{0}, {1}]
    assert [core_share(range(16), r, 3, 1) for r in range(3)] == [{0, 1, 2, 3, 4}, {5, 6, 7, 8, 9}, {10, 11, 12, 13, 14}]
    assert core_share({9, 3, 7, 5}, 1, 2, 2) == {7, 9}  # the cores a cpuset allows, whichever they are
    assert core_share(range(16), 0, 1, 1) == set(range(16))


def test_a_rank_is_left_where_the_scheduler_puts_it_when_its_share_would_not_hold_its_threads():
    assert core_share({0}, 0, 2, 1) is None  # more ranks than cores
    assert core_share({0, 1}, 0, 2, 2) is None  # a core each, but two torch threads (or a loader worker) each
    assert core_share({0, 1}, 2, 2, 1) is None  # not a rank of this host


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="a Linux host of 2+ cores")
def test_a_rank_kept_to_its_share_takes_the_threads_it_starts_with_it():
    seen: dict[str, Any] = {}

    def rank_thread() -> None:  # affinity is a thread's: the test's own thread keeps its cores
        seen["before"] = os.sched_getaffinity(0)
        seen["returned"] = keep_to_share(1, 2, 1)
        started = threading.Thread(target=lambda: seen.update(started=os.sched_getaffinity(0)))
        started.start()
        started.join()
        seen["again"] = keep_to_share(0, 1, 1)  # a share of all it has: nothing changes

    thread = threading.Thread(target=rank_thread)
    thread.start()
    thread.join()
    cores = sorted(seen["before"])
    assert seen["returned"] == seen["before"]
    assert seen["started"] == set(cores[len(cores) // 2:2 * (len(cores) // 2)])
    assert seen["again"] is None
