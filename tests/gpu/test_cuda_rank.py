"""The rank's CUDA path, on a real GPU: skipped (with the reason) where there is none.

What the CPU suite cannot reach: snapshot buffers pinned for the device-to-host
copy, the non-blocking copies fenced once per snapshot, the consensus loaded
back through a pinned staging buffer (overwrite and EASGD blend, twice in a
row, so the second load waits for the first copy out of the buffer), and two
ranks sharing one GPU in a real cluster run. `scripts/gpu-check.sh` runs this
file and a short `bench/round.py --device cuda`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flodl_zmq.launch import Cluster
from flodl_zmq.param_buffers import ParamBuffers
from flodl_zmq.payload import flatten, payload_tensors
from flodl_zmq.rank import pick_device
from flodl_zmq.tensors import bf16_from_f32
from flodl_zmq.wire_format import named

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU and a CUDA build of torch (torch.cuda.is_available() is False)"
)
JOB = str(Path(__file__).with_name("cuda_job.py"))


def net(device: str = "cuda") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10)).to(device)


def test_a_rank_picks_its_local_gpu():
    assert pick_device(0) == torch.device("cuda", 0)
    assert pick_device(torch.cuda.device_count()) == torch.device("cuda", 0)  # two ranks may share one GPU


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16"])
def test_snapshot_buffers_are_pinned_and_hold_the_device_payload_times_the_mass(wire_dtype):
    model = net()
    buf = ParamBuffers(model, wire=named(wire_dtype))
    assert buf.cuda and buf.snap.is_pinned() and buf._recv is not None and buf._recv.is_pinned()
    deposit = buf.snapshot(3.0)[0]
    expected = flatten(model).cpu() * 3.0
    assert torch.equal(buf.snap, expected)  # the non-blocking copies were fenced before the multiply
    if wire_dtype == "bf16":
        want = bf16_from_f32(expected.numpy(), np.empty(expected.numel(), np.uint16))
        assert np.array_equal(deposit.view(torch.int16).numpy().view(np.uint16), want)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # training on must not touch the deposit
    assert torch.equal(buf.snap, expected)


def test_consensus_load_writes_the_device_parameters_and_reports_the_divergence():
    model = net()
    buf = ParamBuffers(model)
    buf.snapshot(2.0)
    before = flatten(model).cpu()
    for shift in (0.5, -0.25):  # twice: the second load waits for the first copy out of the staging buffer
        consensus = (before + shift).numpy()
        divergence, post, pre = buf.load([consensus])
        torch.cuda.synchronize()
        assert torch.equal(flatten(model).cpu(), torch.from_numpy(consensus))
        assert post == pytest.approx(float(np.linalg.norm(consensus)), rel=1e-5)
        assert pre == pytest.approx(float(before.norm()), rel=1e-5)  # measured before the mass
    assert divergence is not None and divergence > 0


def test_async_load_adds_the_blended_correction_to_the_device_parameters_keeping_later_steps():
    model = net()
    buf = ParamBuffers(model)
    start = flatten(model).cpu()
    buf.snapshot(2.0)
    with torch.no_grad():
        for t in payload_tensors(model):
            t.add_(0.5)  # steps taken while the round was in flight
    target = torch.zeros_like(start)
    buf.load([target.numpy()], blend=0.25)
    torch.cuda.synchronize()
    assert torch.allclose(flatten(model).cpu(), start * 0.75 + 0.5, atol=1e-6)


@pytest.mark.cluster
@pytest.mark.timeout(240)
@pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")
def test_two_ranks_on_one_gpu_train_the_digits_together():
    lines: list[str] = []
    cluster = Cluster(argv=[JOB], hosts=1, ranks_per_host=2, sink=lines.append, grace_s=3.0,
                      env_for={"h0:0": {"CUDA_VISIBLE_DEVICES": "0"}, "h0:1": {"CUDA_VISIBLE_DEVICES": "0"}})
    cluster.start()
    code = cluster.wait(200)
    out = cluster.output()
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("[controller] RESULT "))
    result = json.loads(line.split("RESULT ", 1)[1])
    assert result["accuracy"] >= 0.9, result
    assert len(result["batch_share"]) == 2 and min(result["batch_share"]) > 0.2, result
