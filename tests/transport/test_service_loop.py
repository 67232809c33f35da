"""One thread's event loop (flodl_zmq.service_loop): timers on time and in order, typed dispatch, stop through the
mailbox, a put that wakes it at once, and this process's own stall reported."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import pytest
import zmq

from flodl_zmq.mailbox import IDLE_S, Mailbox
from flodl_zmq.service_loop import STALL_S, ServiceLoop

WAIT_S = 10.0


@dataclass(frozen=True)
class Ping:
    n: int


@dataclass(frozen=True)
class Pong:
    n: int


class Running:
    """A loop on its own thread; `error` holds what ended it, if anything did."""

    def __init__(self, loop: ServiceLoop):
        self.loop = loop
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        try:
            self.loop.run()
        except BaseException as exc:
            self.error = exc
        finally:
            self.loop.close()

    def stop(self) -> None:
        self.loop.stop()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


def test_timers_fire_in_due_order_on_time_never_early():
    loop = ServiceLoop("t")
    start = time.monotonic()
    fired: list[tuple[str, float]] = []
    due = {"late": start + 0.3, "early": start + 0.1, "middle": start + 0.2}

    def arm(name: str) -> None:
        def fire(now: float) -> None:
            fired.append((name, now))
            due[name] = math.inf  # moved on: fired once
            if all(at == math.inf for at in due.values()):
                loop.stop()
        loop.timer(lambda: due[name], fire)

    for name in ("late", "early", "middle"):
        arm(name)
    loop.run()
    loop.close()
    assert [name for name, _ in fired] == ["early", "middle", "late"]
    for name, now in fired:
        at = {"early": 0.1, "middle": 0.2, "late": 0.3}[name]
        assert at <= now - start < at + 0.1, (name, now - start)


def test_due_times_are_read_against_the_loops_clock():
    offset = 1e6  # a clock far from time.monotonic: a due time read against the wrong one fires at once or never
    loop = ServiceLoop("t", clock=lambda: time.monotonic() + offset)
    start = loop.clock()
    fired: list[float] = []

    def fire(now: float) -> None:
        fired.append(now)
        loop.stop()

    loop.timer(lambda: start + 0.1 if not fired else math.inf, fire)
    running = Running(loop)
    running.thread.join(WAIT_S)
    assert running.error is None
    assert len(fired) == 1 and 0.1 <= fired[0] - start < 0.2


def test_a_due_time_moved_by_its_owner_is_read_on_the_next_turn():
    loop = ServiceLoop("t")
    state = {"due": math.inf, "fired": 0.0}

    def fire(now: float) -> None:
        state["fired"], state["due"] = now, math.inf
        loop.stop()

    loop.timer(lambda: state["due"], fire)
    loop.on_message(Ping, lambda _: state.update(due=time.monotonic() + 0.05))
    running = Running(loop)
    put_at = time.monotonic()
    loop.put(Ping(1))  # arms the timer from the loop's own thread
    running.thread.join(WAIT_S)
    assert running.error is None
    assert 0.05 <= state["fired"] - put_at < 0.05 + IDLE_S / 2


def test_messages_are_dispatched_by_type_in_order_and_a_stop_ends_the_loop():
    loop = ServiceLoop("t")
    got: list[object] = []
    loop.on_message(Ping, got.append)
    loop.on_message(Pong, got.append)
    running = Running(loop)
    for item in (Ping(1), Pong(2), Ping(3)):
        loop.put(item)
    running.stop()
    assert running.error is None
    assert got == [Ping(1), Pong(2), Ping(3)]
    assert not loop.put(Ping(4))  # closed once stopped: nobody is left to read it


def test_a_message_of_a_type_without_a_handler_ends_the_loop_naming_it():
    loop = ServiceLoop("t")
    running = Running(loop)
    loop.put(Pong(1))
    running.thread.join(WAIT_S)
    assert isinstance(running.error, TypeError) and "Pong" in str(running.error)


def test_a_type_registers_once():
    loop = ServiceLoop("t")
    loop.on_message(Ping, lambda _: None)
    with pytest.raises(ValueError, match="Ping"):
        loop.on_message(Ping, lambda _: None)
    loop.close()


def test_a_put_wakes_an_idle_loop_at_once():
    loop = ServiceLoop("t")
    woke = threading.Event()
    loop.on_message(Ping, lambda _: woke.set())
    running = Running(loop)
    time.sleep(0.1)  # asleep in poll: no timer, so up to IDLE_S
    put_at = time.monotonic()
    loop.put(Ping(1))
    assert woke.wait(WAIT_S)
    assert time.monotonic() - put_at < IDLE_S / 4
    running.stop()


@pytest.fixture
def pipe():
    """A connected PULL socket and the PUSH that feeds it (inproc)."""
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    endpoint = f"inproc://service-loop-{id(pull)}"
    pull.bind(endpoint)
    push.connect(endpoint)
    yield pull, push
    pull.close(0)
    push.close(0)


def test_a_readable_socket_calls_its_handler_which_reads_it(pipe):
    pull, push = pipe
    loop = ServiceLoop("t")
    got: list[bytes] = []

    def read() -> None:
        got.append(pull.recv())
        loop.stop()

    loop.on_socket(pull, read)
    push.send(b"hi")
    loop.run()
    loop.close()
    assert got == [b"hi"]


def test_another_threads_mailbox_calls_its_handler_which_drains_it():
    # A relay's loop watches its host shard's outcomes so. Poll names a mailbox by its descriptor: a handler
    # looked up by the object was never called, and the wake-up left set spun the loop (a core per relay).
    loop = ServiceLoop("t")
    outcomes: Mailbox[str] = Mailbox()
    got: list[str] = []
    drained = threading.Event()

    def read() -> None:
        got.extend(outcomes.drain())
        drained.set()

    loop.on_socket(outcomes, read)
    running = Running(loop)
    outcomes.put("round 1 reduced")
    assert drained.wait(WAIT_S), "the mailbox's handler never ran"
    running.stop()
    assert got == ["round 1 reduced"] and running.error is None


def test_a_timer_due_at_once_fires_before_a_socket_already_readable_is_served(pipe):
    # A relay's hello is due at once; deposits waiting when its loop starts must not go up before it.
    pull, push = pipe
    push.send(b"waiting")
    assert pull.poll(int(WAIT_S * 1000))
    loop = ServiceLoop("t")
    order: list[str] = []
    due = [0.0]

    def hello(now: float) -> None:
        order.append("hello")
        due[0] = math.inf

    def read() -> None:
        order.append(pull.recv().decode())
        loop.stop()

    loop.on_socket(pull, read)
    loop.timer(lambda: due[0], hello)
    loop.run()
    loop.close()
    assert order == ["hello", "waiting"]


def test_a_stall_of_the_loops_own_thread_is_reported_with_its_length():
    loop = ServiceLoop("t")
    gaps: list[float] = []
    loop.on_stall(gaps.append)
    loop.on_message(Ping, lambda _: time.sleep(STALL_S + 0.3))  # a turn far longer than its poll
    loop.on_message(Pong, lambda _: loop.stop())
    running = Running(loop)
    loop.put(Ping(1))
    time.sleep(0.05)
    loop.put(Pong(2))
    running.thread.join(WAIT_S)
    assert running.error is None
    assert len(gaps) == 1 and STALL_S + 0.2 < gaps[0] < STALL_S + 1.0


def test_a_turn_whose_own_handler_held_the_thread_reports_the_stall_before_its_timers_judge():
    # A relay's send blocked on a full queue: what its ranks sent meanwhile is still unread, so the
    # silence timers must see the stall first (else the relay declares live ranks dead).
    loop = ServiceLoop("t")
    seen: list[str] = []
    due = [math.inf]

    def fire(now: float) -> None:
        seen.append("timer")
        due[0] = math.inf
        loop.stop()

    def block(_: Ping) -> None:
        due[0] = time.monotonic() + 0.1  # due while this handler still holds the thread
        time.sleep(STALL_S + 0.3)

    loop.on_stall(lambda gap: seen.append("stall"))
    loop.timer(lambda: due[0], fire)
    loop.on_message(Ping, block)
    running = Running(loop)
    loop.put(Ping(1))
    running.thread.join(WAIT_S)
    assert running.error is None
    assert seen == ["stall", "timer"]


def test_a_handler_may_take_the_messages_queued_before_it_acts():
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)]
    first, push_first, second, push_second = socks
    try:
        for n, (pull, push) in enumerate(((first, push_first), (second, push_second))):
            pull.bind(f"inproc://service-loop-test-queued-{n}")
            push.connect(f"inproc://service-loop-test-queued-{n}")
        loop = ServiceLoop("t")
        order: list[object] = []

        def read_first() -> None:
            first.recv()
            loop.put(Ping(1))  # queued during the turn, after the mailbox was drained

        def read_second() -> None:
            loop.dispatch_queued()  # the Ping is seen before the frame is used
            order.append(second.recv())
            loop.stop()

        loop.on_socket(first, read_first)
        loop.on_socket(second, read_second)
        loop.on_message(Ping, order.append)
        push_first.send(b"a")
        push_second.send(b"b")
        time.sleep(0.05)  # both readable in one poll
        loop.run()
        loop.close()
        assert order == [Ping(1), b"b"]
    finally:
        for s in socks:
            s.close(0)


def test_a_socket_is_polled_for_writable_only_while_its_owner_has_something_queued():
    # A relay's data thread sends upstream only what the socket takes; it must neither wait on a full
    # queue nor wake on every turn for an idle socket that is always writable.
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.setsockopt(zmq.RCVHWM, 1)
    push.setsockopt(zmq.SNDHWM, 1)
    endpoint = f"inproc://service-loop-writable-{id(pull)}"
    pull.bind(endpoint)
    push.connect(endpoint)
    loop = ServiceLoop("t")
    queued: list[bytes] = []
    flushes = [0]
    seen: list[int] = []
    handled = threading.Semaphore(0)

    def flush() -> None:
        flushes[0] += 1
        while queued:
            try:
                push.send(queued[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            queued.pop(0)

    def ping(p: Ping) -> None:
        queued.extend(str(i).encode() for i in range(p.n))
        seen.append(flushes[0])
        handled.release()

    loop.on_writable(push, lambda: bool(queued), flush)
    loop.on_message(Ping, ping)
    running = Running(loop)
    try:
        for _ in range(3):  # nothing queued: the writable socket is never served
            loop.put(Ping(0))
            assert handled.acquire(timeout=WAIT_S)
        assert seen == [0, 0, 0]
        loop.put(Ping(6))  # more than the socket takes at once: the rest goes as the reader makes room
        assert handled.acquire(timeout=WAIT_S)
        got = []
        while len(got) < 6 and pull.poll(int(WAIT_S * 1000)):
            got.append(pull.recv())
        assert got == [str(i).encode() for i in range(6)]
        for _ in range(2):  # queue empty again: not served on the turns that follow
            loop.put(Ping(0))
            assert handled.acquire(timeout=WAIT_S)
        assert seen[-1] == seen[-2] > 0
    finally:
        running.stop()
        pull.close(0)
        push.close(0)
    assert running.error is None
