"""The cross-thread mailbox (flodl_zmq.mailbox): a queue whose receiver sleeps in zmq.Poller next to its sockets."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import zmq

from flodl_zmq.mailbox import Mailbox

WAIT_S = 10.0


@pytest.fixture
def box():
    b: Mailbox[int] = Mailbox()
    yield b
    b.close()


def test_a_put_wakes_a_poller_blocked_with_a_long_timeout_at_once(box):
    ctx = zmq.Context.instance()
    idle = ctx.socket(zmq.PULL)  # a real socket beside it, as in a service loop
    try:
        idle.bind("inproc://mailbox-test-idle")
        poller = zmq.Poller()
        poller.register(idle, zmq.POLLIN)
        poller.register(box, zmq.POLLIN)
        put_at: list[float] = []

        def later() -> None:
            time.sleep(0.05)
            put_at.append(time.perf_counter())
            box.put(7)

        t = threading.Thread(target=later)
        t.start()
        events = dict(poller.poll(int(WAIT_S * 1000)))
        woke = time.perf_counter()
        t.join()
        assert box.fileno() in events and idle not in events  # poll names a plain fd by its number
        assert woke - put_at[0] < 0.5, "the put must wake the poll, not its timeout"
        assert box.drain() == [7]
        assert not dict(poller.poll(0)), "a drained mailbox must not poll readable"
    finally:
        idle.close(0)


def test_items_come_out_in_the_order_they_went_in(box):
    for i in range(1000):
        box.put(i)
    assert box.drain() == list(range(1000))
    assert box.drain() == []


def test_puts_from_many_threads_all_arrive_each_thread_in_order(box):
    threads, per = 8, 500
    go = threading.Barrier(threads, timeout=WAIT_S)

    def producer(t: int) -> None:
        go.wait()
        for i in range(per):
            box.put(t * per + i)

    workers = [threading.Thread(target=producer, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    got: list[int] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < threads * per and time.monotonic() < deadline:
        try:
            got.append(box.get(timeout=1.0))
        except queue.Empty:
            pass
        got.extend(box.drain())
    for w in workers:
        w.join(WAIT_S)
    assert sorted(got) == list(range(threads * per))
    for t in range(threads):
        mine = [x for x in got if x // per == t]
        assert mine == sorted(mine), f"thread {t}'s items were reordered"


def test_get_waits_for_a_put_and_times_out_without_one(box):
    with pytest.raises(queue.Empty):
        box.get(timeout=0.05)
    threading.Timer(0.05, box.put, args=(3,)).start()
    assert box.get(timeout=WAIT_S) == 3


def test_a_look_at_an_empty_mailbox_reads_no_descriptor_and_loses_no_later_item(box, monkeypatch):
    # A rank's training thread looks at its inbox between steps: that look must cost no system call.
    import flodl_zmq.mailbox as mailbox

    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(mailbox.os, "read", lambda fd, n: reads.append(fd) or real_read(fd, n))
    with pytest.raises(queue.Empty):
        box.get(0)
    assert reads == []
    box.put(1)
    assert box.get(0) == 1  # an item is taken, the signal cleared
    with pytest.raises(queue.Empty):
        box.get(0.05)  # nothing left: a waiting get does not return on a stale signal
    box.put(2)
    assert box.get(WAIT_S) == 2


def test_close_keeps_queued_items_drops_later_puts_and_releases_the_descriptor():
    box: Mailbox[str] = Mailbox()
    fd = box.fileno()
    assert box.put("kept")
    box.close()
    box.close()  # idempotent
    assert box.closed
    assert not box.put("dropped")
    assert box.get(timeout=0) == "kept"
    with pytest.raises(queue.Empty):
        box.get(timeout=WAIT_S)  # closed and empty: no wait at all
    with pytest.raises(OSError):
        os.fstat(fd)


def test_many_mailboxes_leak_no_descriptors():
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    for _ in range(200):
        b: Mailbox[int] = Mailbox()
        b.put(1)
        b.close()
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) <= before
