"""Batches of known indices, produced ahead of the training step (torch DataLoader's knobs).

A rank knows the indices of every span it was dispatched before it trains
it, so its batches can be loaded while earlier ones train: `extend` queues
the index lists in training order, `next` returns the next batch.

Rules this module keeps:

- **Order is the training order.** Batches come out exactly in the order
  their indices went in, whichever worker finished first: a span's samples
  are the coordinator's plan, and the data path must not reorder them.
- **At most `num_workers * prefetch_factor` batches in flight**, so a long
  queue of spans costs no memory until it is near.
- **One pipe per worker, no helper threads.** A task or a result is written
  straight to the worker's pipe (a queue would hand it to a feeder thread
  first: two more wake-ups per batch, which a loaded machine makes slow).
- **Small batches travel by value, large ones in shared memory.** Sharing a
  tensor's memory costs a round trip to the worker per tensor while the
  trainer unpickles it (the worker's thread hands over the descriptor); for a
  batch under `BY_VALUE_BYTES` copying its bytes through the pipe is cheaper.
- **Workers start before any thread does** (the owner builds the pipeline
  before it opens sockets): they are forked, and a fork copies no other
  thread, so a lock held by one would never be released in the child.
- **Every wait is bounded and a dead worker is named.** `next` checks the
  workers while it waits; a worker that died, or a batch slower than
  `BATCH_TIMEOUT_S`, is a `TrainingError` naming the worker. A worker whose
  parent died exits on its own (it polls for that), leaving no orphans.
- **A dataset error surfaces in the training process** with the worker's
  traceback, when its batch's turn comes, as it would without workers.
"""

from __future__ import annotations

import io
import os
import pickle
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing import connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from flodl_zmq.errors import TrainingError

BATCH_TIMEOUT_S = 300.0
BY_VALUE_BYTES = 1 << 20
POLL_S = 0.5  # how often a waiting parent checks its workers, and a waiting worker its parent
CLOSE_S = 2.0

Collate = Callable[[list[Any]], Any]


def load_batch(dataset: Any, indices: np.ndarray, collate_fn: Collate | None) -> Any:
    """The batch of `indices`: sliced in one go from a TensorDataset (default collation), else
    `collate_fn` (torch's default_collate when None) over the items."""
    tensors = getattr(dataset, "tensors", None)
    if tensors is not None and collate_fn is None:
        t = torch.from_numpy(np.ascontiguousarray(indices))
        return tuple(x[t] for x in tensors)
    collate = collate_fn or torch.utils.data.default_collate
    return collate([dataset[int(i)] for i in indices])


class BatchPipeline:
    """Loads queued index batches of `dataset`, in order, in `num_workers` processes (0: inline).

    `device`: where `next` puts the batch; with `pin_memory` and a CUDA
    device the batch is pinned first so the copy is asynchronous.
    """

    def __init__(
        self,
        dataset: Any,
        device: torch.device,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        collate_fn: Collate | None = None,
    ) -> None:
        self.dataset = dataset
        self.device = device
        self.collate_fn = collate_fn
        self.pin = pin_memory and device.type == "cuda"
        self._todo: deque[np.ndarray] = deque()
        self._ready: dict[int, Any] = {}
        self._submitted = 0  # sequence number of the next batch handed to a worker
        self._taken = 0  # sequence number of the next batch `next` returns
        self._limit = num_workers * prefetch_factor
        self._workers: list[Any] = []
        self._pipes: list[Any] = []  # our end of each worker's duplex pipe
        if num_workers:
            ctx = mp.get_context("fork")
            for i in range(num_workers):
                ours, theirs = ctx.Pipe()
                w = ctx.Process(
                    target=_worker, args=(dataset, collate_fn, theirs, os.getpid()),
                    name=f"flodl-loader-{i}", daemon=True,
                )
                w.start()
                theirs.close()  # the worker holds it now; a dead worker then reads as EOF here
                self._workers.append(w)
                self._pipes.append(ours)

    def extend(self, batches: Iterable[np.ndarray]) -> None:
        """Queue index batches, in training order, and start loading the nearest ones."""
        self._todo.extend(batches)
        self._top_up()

    def __len__(self) -> int:
        """Batches queued and not yet returned."""
        return len(self._todo) + self._submitted - self._taken

    def next(self) -> Any:
        """The next batch, on the device (waits for its worker, bounded)."""
        if not self._workers:
            if not self._todo:
                raise TrainingError("no batch is queued: extend the pipeline before asking for one")
            return self._to_device(load_batch(self.dataset, self._todo.popleft(), self.collate_fn))
        if self._taken == self._submitted:
            raise TrainingError("no batch is queued: extend the pipeline before asking for one")
        seq = self._taken
        deadline = time.monotonic() + BATCH_TIMEOUT_S
        while seq not in self._ready:
            readable = connection.wait(self._pipes, timeout=POLL_S)
            for pipe in readable:
                try:
                    got, batch, error = pickle.loads(pipe.recv_bytes())
                except (EOFError, OSError):
                    break  # its worker died: named just below
                self._ready[got] = (batch, error)
            if seq not in self._ready:
                self._check_workers(seq, deadline)
        batch, error = self._ready.pop(seq)
        self._taken += 1
        if error is not None:  # raised in its turn: the batches before it train first
            raise TrainingError(f"the dataset raised in a loader worker (batch {seq}):\n{error}")
        self._top_up()
        return self._to_device(batch)

    def close(self) -> None:
        """Stop the workers (bounded; a worker that does not stop is killed)."""
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except OSError:  # a worker already gone: the join below finds it ended
                pass
        end = time.monotonic() + CLOSE_S
        for w in self._workers:
            w.join(max(0.0, end - time.monotonic()))
            if w.is_alive():
                w.kill()
                w.join(CLOSE_S)
        for pipe in self._pipes:
            pipe.close()
        self._workers, self._pipes = [], []

    def _top_up(self) -> None:
        while self._workers and self._todo and self._submitted - self._taken < self._limit:
            seq = self._submitted
            self._pipes[seq % len(self._pipes)].send((seq, self._todo.popleft()))
            self._submitted += 1

    def _check_workers(self, seq: int, deadline: float) -> None:
        for w in self._workers:
            if not w.is_alive():
                raise TrainingError(
                    f"loader worker {w.name} (pid {w.pid}) died with exit code {w.exitcode} while batch "
                    f"{seq} was loading: the dataset crashed it (out of memory, or a native library)"
                )
        if time.monotonic() > deadline:
            raise TrainingError(
                f"batch {seq} took over {BATCH_TIMEOUT_S:.0f} s in loader worker "
                f"{self._workers[seq % len(self._workers)].name}: the dataset's __getitem__ hangs"
            )

    def _to_device(self, batch: Any) -> Any:
        if self.device.type == "cpu":
            return batch
        return _move(batch, self.device, self.pin)


def _move(batch: Any, device: torch.device, pin: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return (batch.pin_memory() if pin else batch).to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_move(b, device, pin) for b in batch)
    if isinstance(batch, dict):
        return {k: _move(v, device, pin) for k, v in batch.items()}
    return batch


def _worker(dataset: Any, collate_fn: Collate | None, pipe: Any, parent: int) -> None:
    """A loader process: load each (seq, indices) task, answer (seq, batch, error)."""
    torch.set_num_threads(1)  # workers run side by side; one thread each keeps them off the trainer's cores
    while True:
        if not pipe.poll(POLL_S):
            if os.getppid() != parent:
                return  # the training process is gone: nobody reads what we would load
            continue
        try:
            task = pipe.recv()
        except EOFError:
            return  # the trainer closed its end
        if task is None:
            return
        seq, indices = task
        try:
            pipe.send_bytes(_dumps((seq, load_batch(dataset, indices, collate_fn), None)))
        except Exception:
            pipe.send_bytes(_dumps((seq, None, traceback.format_exc())))


def _dumps(message: Any) -> bytes:
    """`message` pickled: its tensors by value when they are small, else in shared memory."""
    if _nbytes(message) > BY_VALUE_BYTES:
        return bytes(ForkingPickler.dumps(message))
    buf = io.BytesIO()
    _ByValue(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buf.getvalue()


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(v) for v in obj)
    return 0


class _ByValue(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays (their bytes, no shared memory)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad:
            try:
                return torch.from_numpy, (obj.numpy(),)
            except (TypeError, RuntimeError):  # bfloat16 and other dtypes numpy lacks: torch's own pickling
                return NotImplemented
        return NotImplemented
