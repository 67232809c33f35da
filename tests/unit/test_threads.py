"""The worker threads (flodl_zmq.threads) and the controller's I/O thread split."""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from flodl_zmq import threads
from flodl_zmq.reducer_service import io_affinity


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


def test_io_affinity_gives_the_router_and_the_pub_disjoint_halves_of_the_io_threads():
    for n, want in {1: (0, 0), 2: (0b01, 0b10), 3: (0b001, 0b110), 4: (0b0011, 0b1100)}.items():
        ctx = zmq.Context(io_threads=n)
        try:
            assert io_affinity(ctx) == want
        finally:
            ctx.term()


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
