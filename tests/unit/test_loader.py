"""The batch pipeline (flodl_zmq/loader.py): order, collation, errors and dead workers, for real."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from flodl_zmq.errors import TrainingError
from flodl_zmq.loader import BatchPipeline

CPU = torch.device("cpu")


class Items(Dataset):
    """Item i is (i as a float tensor, i); item `bad` raises; `slow` sleeps per item."""

    def __init__(self, n: int = 40, bad: int | None = None, slow_s: float = 0.0) -> None:
        self.n, self.bad, self.slow_s = n, bad, slow_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"item {i} is corrupt")
        if self.slow_s:
            time.sleep(self.slow_s)
        return torch.tensor([float(i)]), i


def batches(n: int = 40, size: int = 4, seed: int = 0) -> list[np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    return [perm[i : i + size] for i in range(0, n, size)]


@pytest.mark.parametrize("workers", [0, 3])
def test_batches_come_out_in_the_order_their_indices_went_in(workers):
    p = BatchPipeline(Items(slow_s=0.001), CPU, num_workers=workers, prefetch_factor=2)
    try:
        plan = batches()
        p.extend(plan[:4])  # a span, then another: prefetch runs across both
        p.extend(plan[4:])
        got = [p.next() for _ in range(len(plan))]
        assert len(p) == 0
    finally:
        p.close()
    for idx, (x, y) in zip(plan, got, strict=True):
        assert y.tolist() == idx.tolist() and x.squeeze(1).tolist() == [float(i) for i in idx]


def test_collate_fn_builds_the_batch_in_the_workers():
    def as_dict(items):
        return {"ids": [i for _, i in items]}

    p = BatchPipeline(Items(), CPU, num_workers=2, collate_fn=as_dict)
    try:
        p.extend(batches()[:2])
        assert p.next() == {"ids": batches()[0].tolist()}
    finally:
        p.close()


def test_a_dataset_error_in_a_worker_reaches_the_trainer_with_its_traceback():
    p = BatchPipeline(Items(bad=7), CPU, num_workers=2)
    try:
        p.extend([np.array([1, 2]), np.array([6, 7])])
        p.next()
        with pytest.raises(TrainingError, match=r"(?s)raised in a loader worker.*item 7 is corrupt"):
            p.next()
    finally:
        p.close()


def test_a_killed_worker_is_named_while_the_trainer_waits():
    p = BatchPipeline(Items(slow_s=0.5), CPU, num_workers=1)
    try:
        p.extend([np.arange(20)])
        os.kill(p._workers[0].pid, signal.SIGKILL)
        with pytest.raises(TrainingError, match=r"loader worker flodl-loader-0 \(pid \d+\) died with exit code -9"):
            p.next()
    finally:
        p.close()
    assert not p._workers


def test_workers_of_a_killed_trainer_exit_on_their_own(tmp_path):
    # The trainer is SIGKILLed (no close): its workers notice the lost parent and leave.
    script = textwrap.dedent("""
        import sys, time, torch
        from flodl_zmq.loader import BatchPipeline
        from torch.utils.data import TensorDataset
        p = BatchPipeline(TensorDataset(torch.zeros(8)), torch.device("cpu"), num_workers=2)
        print(" ".join(str(w.pid) for w in p._workers), flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait(10)
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Wide(Dataset):
    """Items of `width` floats (a batch of 8 is 8 * width * 4 bytes), in `dtype`."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float32) -> None:
        self.width, self.dtype = width, dtype

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int):
        return torch.full((self.width,), float(i), dtype=self.dtype)


@pytest.mark.parametrize(("width", "dtype"), [(4, torch.float32), (4, torch.bfloat16), (65536, torch.float32)])
def test_small_batches_go_by_value_and_large_ones_in_shared_memory_alike(width, dtype, recwarn):
    # 8 x 65536 floats is 2 MiB, past BY_VALUE_BYTES; bfloat16 has no numpy dtype.
    p = BatchPipeline(Wide(width, dtype), CPU, num_workers=2)
    try:
        p.extend([np.arange(8), np.arange(8, 16)])
        a, b = p.next(), p.next()
    finally:
        p.close()
    assert a.dtype == dtype and a.shape == (8, width) and float(b[7, -1]) == 15.0
    a.add_(1)  # a batch is the trainer's to change
    assert not [w for w in recwarn if "not writable" in str(w.message)]
