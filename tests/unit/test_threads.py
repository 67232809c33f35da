"""The worker threads (flodl_zmq.threads)."""

from __future__ import annotations

import os
import threading

import pytest

from flodl_zmq import threads


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
