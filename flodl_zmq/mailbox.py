"""How work crosses between the threads of a service: a Mailbox (docs/architecture.md, "Between threads").

A mailbox is a FIFO queue plus a wake-up file descriptor (an eventfd, or a
pipe where there is none). Any thread may `put`; one thread receives. The
receiving thread registers the mailbox in the `zmq.Poller` it already blocks
in, next to its sockets (`poller.register(mailbox, zmq.POLLIN)`: a mailbox
has a `fileno()`), and calls `drain()` when the poll says it is readable
(the poll names it by its descriptor: `mailbox.fileno() in events`). A
thread with no poller (a test, the main thread waiting for a verdict) calls
`get(timeout)` instead.

Rules this module keeps:

- **No polling interval.** A loop waits in poll until its next timer is due
  or something arrives; a put wakes it at once. A loop that instead woke
  every few milliseconds to look at a queue paid that delay on every hand-off,
  and cost a core's wake-ups when idle.
- **Order comes from the queue, never from a sleep.** Items come out in the
  order they went in; a thread that must act after another has seen
  something waits on the mailbox that carries it.
- **No lost wake-up.** `put` appends, then signals; the receiver clears the
  signal, then takes the items. An item put at any moment is either taken by
  this drain or leaves the descriptor signalled for the next poll.
- **One socket, one thread.** The wake-up is a plain descriptor, not a
  ZeroMQ socket, so putting from any thread breaks no ZeroMQ rule. Each put
  holds a lock only while it appends and writes, so `close` can never pull
  the descriptor from under a put (a closed and reused descriptor number
  would wake some unrelated file).
- **Close once, from the receiving side** (or after it has stopped). It
  releases the descriptor; items already queued can still be drained or got;
  a put after close is dropped and returns False: nobody is left to read it.
"""

from __future__ import annotations

import collections
import math
import os
import queue
import select
import sys
import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")

_READ_BYTES = 4096  # an eventfd read takes 8; a pipe may hold one byte per put

# The longest a loop with no timer due sleeps in poll. Not a polling interval (every
# hand-off wakes the loop at once): a bound, so no wait is unbounded (CONVENTIONS).
IDLE_S = 1.0


def poll_ms(wait_s: float) -> int:
    """The poll timeout (ms) for a wait of `wait_s` seconds, at most IDLE_S.

    Rounded up: a loop woken a fraction of a millisecond before its timer is
    due would find nothing to do and poll again with a zero timeout, spinning.
    """
    return max(0, math.ceil(min(wait_s, IDLE_S) * 1000))


class Mailbox(Generic[T]):
    """A thread-safe FIFO whose receiving thread sleeps in poll on `fileno()` until a `put` wakes it."""

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False
        if hasattr(os, "eventfd"):  # Linux: one descriptor, a counter that never fills
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._rfd, self._wfd = fd, fd
            self._token = (1).to_bytes(8, sys.byteorder)
        else:  # elsewhere a pipe: one byte per put, a full pipe is already signalled
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
            self._token = b"\x01"

    # ------------------------------------------------------------------ any thread

    def put(self, item: T) -> bool:
        """Queue `item` and wake the receiver; False (dropped) if the mailbox is closed."""
        with self._lock:
            if self._closed:
                return False
            self._items.append(item)  # before the signal: a woken receiver must find it
            try:
                os.write(self._wfd, self._token)
            except BlockingIOError:
                pass  # a full pipe: the receiver is already woken
            return True

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ the receiving thread

    def fileno(self) -> int:
        """The descriptor that polls readable while items may be waiting (for `zmq.Poller.register`)."""
        return self._rfd

    def drain(self) -> list[T]:
        """Every item queued now, oldest first; clears the wake-up."""
        self._clear()
        out: list[T] = []
        # Bounded by what is queued now: a producer that never stops must not keep us here.
        for _ in range(len(self._items)):
            out.append(self._items.popleft())
        return out

    def get(self, timeout: float | None = None) -> T:
        """The oldest item, waiting up to `timeout` seconds; raises queue.Empty when none came."""
        if timeout == 0 and not self._items:
            # A look between steps: no descriptor read, which a training loop would pay every step. A put
            # racing this look signals after it appends, and the next waiting get clears that signal.
            raise queue.Empty
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._clear()  # before the look: a put after it leaves the descriptor signalled
            if self._items:
                return self._items.popleft()
            left = None if deadline is None else deadline - time.monotonic()
            if self._closed or (left is not None and left <= 0):
                raise queue.Empty
            waiter = select.poll()
            waiter.register(self._rfd, select.POLLIN)
            waiter.poll(None if left is None else max(1, int(left * 1000) + 1))

    def close(self) -> None:
        """Release the descriptor(s) (idempotent); queued items stay readable, later puts are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._rfd)
            if self._wfd != self._rfd:
                os.close(self._wfd)

    def _clear(self) -> None:
        if self._closed:
            return
        try:
            while os.read(self._rfd, _READ_BYTES):
                pass
        except BlockingIOError:
            pass

    def __len__(self) -> int:
        return len(self._items)
