"""The worker threads (flodl_zmq.threads) and the controller's I/O thread split."""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from flodl_zmq import threads
from flodl_zmq.io_threads import io_affinity


def test_results_come_back_in_item_order():
    assert threads.each(lambda x: x * x, list(range(50))) == [x * x for x in range(50)]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: the pool has one worker")
def test_work_runs_on_several_threads_when_there_are_several_items():
    barrier = threading.Barrier(2, timeout=10)  # two pieces must be in flight at once to pass
    assert threads.each(lambda _: barrier.wait() >= 0, [0, 1]) == [True, True]


def test_work_handed_in_from_a_worker_runs_inline_instead_of_waiting_on_its_own_pool():
    # More nested calls than workers: each would block a worker forever if it queued.
    def outer(i: int) -> int:
        return sum(threads.each(lambda x: x + i, list(range(10))))

    assert threads.each(outer, list(range(threads.MAX_WORKERS * 2))) == [
        45 + 10 * i for i in range(threads.MAX_WORKERS * 2)
    ]


@pytest.mark.parametrize("n", range(1, 9))
def test_io_affinity_gives_the_router_the_pub_and_the_rest_disjoint_threads(n):
    ctx = zmq.Context(io_threads=n)
    try:
        data, pub, other = io_affinity(ctx)
    finally:
        ctx.term()
    if n < 3:
        assert (data, pub, other) == (0, 0, 0)  # any thread: a mask naming none would drop connections
        return
    assert data & pub == data & other == pub & other == 0
    assert data | pub | other == (1 << n) - 1
    assert bin(data).count("1") == bin(pub).count("1") >= 1 and other != 0


def test_a_failing_piece_raises_in_the_caller_after_every_other_piece_has_finished():
    finished = []

    def piece(i: int) -> int:
        if i == 0:
            raise ValueError("piece 0 failed")
        finished.append(i)
        return i

    items = list(range(40))
    with pytest.raises(ValueError, match="piece 0 failed"):
        threads.each(piece, items)
    # The run holding piece 0 stops there; every other run was worked to its end before the raise.
    assert set(finished) >= set(range(40 // threads._cores(), 40))
