"""Worker threads for the data plane's bulk work: the payload MAC and the f32 sums.

AES-GCM (flodl_zmq.wire.mac) and numpy's element loops run without the GIL, so
a 40 MB frame authenticated or summed in pieces on every core takes a fraction
of one core's time. The controller's reduce (verify every host frame, sum,
divide, sign) is the one step of a round no other process can share; this is
what shortens it.

Rules this module keeps:

- One pool per process, made again after a fork: a forked child (a DataLoader
  worker forks the rank) has none of its parent's threads, and work handed to
  them would wait forever.
- The items are cut into one run of consecutive items per core. The caller
  works runs too, and takes any run no worker has started yet, so a call costs
  a handful of thread wake-ups (not one per item) and never waits on a worker
  that is slow to wake.
- Work handed in from one of the pool's own threads runs inline, so a piece
  never waits on the pool it runs in.
- Results come back in the order of the items.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

MAX_WORKERS = 4
_NAME = "flodl-worker"

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _cores() -> int:
    return min(MAX_WORKERS, os.cpu_count() or 1)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(_cores(), _NAME))
        return _pool[1]


def each(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``fn`` over ``items``, results in order, spread over the cores when there is more than one item."""
    runs = min(len(items), _cores())
    if runs < 2 or threading.current_thread().name.startswith(_NAME):
        return [fn(item) for item in items]
    bounds = [len(items) * i // runs for i in range(runs + 1)]
    unclaimed = list(range(runs))
    claim = threading.Lock()
    done: list[list[R]] = [[] for _ in range(runs)]

    def work() -> None:
        while True:
            with claim:
                if not unclaimed:
                    return
                i = unclaimed.pop(0)
            done[i] = [fn(item) for item in items[bounds[i] : bounds[i + 1]]]

    helpers = [_executor().submit(work) for _ in range(runs - 1)]
    try:
        work()
    finally:  # no helper may still write into the caller's arrays once this returns or raises
        failed = [e for e in (helper.exception() for helper in helpers) if e is not None]
    if failed:
        raise failed[0]
    return [r for run in done for r in run]

