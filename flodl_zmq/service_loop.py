"""One service thread's event loop: its sockets, its mailbox and its timers in one poll (docs/architecture.md,
"Between threads").

A service thread builds a `ServiceLoop`, registers what it serves (a socket
with the handler that reads it, a message type with its handler, a timer),
and calls `run()` until a `Stop` comes through the mailbox. Other threads
reach it only through `put` (and `stop`), so every socket stays owned by the
one thread that runs the loop.

Rules this module keeps:

- **No polling interval** (mailbox.py's rules). A turn sleeps in poll until
  the next timer is due, a socket is readable or something is put, at most
  `mailbox.IDLE_S`; a timer fires on the first turn at or after its due time,
  never a tick later.
- **A timer is read, not stored.** A timer is a pair of functions: when it is
  next due (asked every turn, so a core that re-arms, acknowledges or learns
  of a record moves it without telling the loop) and what to do then. Its
  action must move its due time on: a timer still due after firing fires
  again on the next turn.
- **Typed messages.** A mailbox item is dispatched by its type to the one
  handler registered for it; an item of a type nobody registered is a bug and
  raises in the loop's thread.
- **Stop through the mailbox.** `stop()` puts a `Stop`; the loop ends at the
  turn that drains it, after the items queued before it. Nothing polls a
  stop flag on a timer.
- **Writable only when wanted.** A socket with something queued for it is
  polled for writable too, on the turns its `wanted()` says so (asked every
  turn, like a timer's due time): a thread that must never wait on a send
  sends what the socket takes, when it takes it, without a poll that wakes
  on an idle socket every turn.
- **One turn, one order:** poll; the stall check; the mailbox (what another
  thread decided, a rank's death, applies before the records read this turn);
  readable sockets in the order they were registered; writable ones likewise;
  due timers, earliest first. A turn whose mailbox drain meets a `Stop` reads
  no socket and fires no timer; items queued after the `Stop` are dropped
  (nobody serves them). A `Stop` met by `dispatch_queued` ends the loop after
  that turn.
- **This process's own stall is nobody's silence.** A turn that outlasts its
  poll by `STALL_S` (the time out of poll, plus any overrun of the poll's
  timeout: a SIGSTOP, the GIL held by a long import) is reported to
  the `on_stall` handlers right after the poll, before any handler reads what
  arrived meanwhile: a loop that judges its peers' silence takes the gap off
  their clocks, since what they sent is still on its way in. So is a turn
  whose own handlers held the thread that long (a send through a full
  queue), before its timers fire.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import zmq

from flodl_zmq.mailbox import Mailbox, poll_ms

M = TypeVar("M")

# A turn this much longer than its poll is this process stalled: a turn's own work takes
# milliseconds, and the silence deadlines that care are seconds.
STALL_S = 0.5


@dataclass(frozen=True)
class Stop:
    """Ends the loop that drains it (`ServiceLoop.stop`)."""


class ServiceLoop:
    """One thread's poller, mailbox and timers; `run()` serves them until a `Stop` is drained."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.clock = clock  # what the timers' due times are read against (a service's injectable clock)
        self.mailbox: Mailbox[Any] = Mailbox()
        self._poller = zmq.Poller()
        self._poller.register(self.mailbox, zmq.POLLIN)
        # Each read handler under what poll names its source by: a zmq socket itself, a Mailbox its descriptor.
        self._sockets: list[tuple[zmq.Socket | int, Callable[[], None]]] = []
        self._writers: list[tuple[zmq.Socket, Callable[[], bool], Callable[[], None]]] = []
        self._armed: set[zmq.Socket] = set()  # writers' sockets polled for writable now
        self._handlers: dict[type, Callable[[Any], None]] = {}
        self._timers: list[tuple[Callable[[], float], Callable[[float], None]]] = []
        self._stall_handlers: list[Callable[[float], None]] = []
        self._running = False

    # ------------------------------------------------------------------ setup (the loop's thread, before run)

    def on_socket(self, sock: zmq.Socket | Mailbox[Any], handler: Callable[[], None]) -> None:
        """Call `handler` on every turn `sock` (a socket, or another thread's Mailbox) polls readable (it
        reads what it takes). Poll names a Mailbox by its descriptor: looked up by the object, its
        handler would never run and its wake-up, never cleared, would spin the loop."""
        self._poller.register(sock, zmq.POLLIN)
        self._sockets.append((sock if isinstance(sock, zmq.Socket) else sock.fileno(), handler))

    def on_writable(self, sock: zmq.Socket, wanted: Callable[[], bool], handler: Callable[[], None]) -> None:
        """Call `handler` on every turn `sock` polls writable; it is polled for that only while `wanted()`."""
        self._writers.append((sock, wanted, handler))

    def on_message(self, kind: type[M], handler: Callable[[M], None]) -> None:
        """Dispatch each mailbox item of type `kind` to `handler`."""
        if kind in self._handlers or kind is Stop:
            raise ValueError(f"loop {self.name}: {kind.__name__} already has a handler; register each type once")
        self._handlers[kind] = handler

    def timer(self, due: Callable[[], float], fire: Callable[[float], None]) -> None:
        """Call `fire(now)` on the first turn with `now >= due()` (math.inf: not armed); `fire` must move `due` on."""
        self._timers.append((due, fire))

    def on_stall(self, handler: Callable[[float], None]) -> None:
        """Call `handler(gap)` when a turn outlasted its poll by `gap` > STALL_S seconds (see the rules)."""
        self._stall_handlers.append(handler)

    # ------------------------------------------------------------------ any thread

    def put(self, message: Any) -> bool:
        """Hand `message` to the loop's thread (it wakes at once); False when the loop is closed."""
        return self.mailbox.put(message)

    def stop(self) -> None:
        """End the loop after what is already queued (idempotent; dropped once the loop is closed)."""
        self.mailbox.put(Stop())

    # ------------------------------------------------------------------ the loop's thread

    def run(self) -> None:
        """Serve sockets, messages and timers until a `Stop` is drained; a handler's exception ends it."""
        self._running = True
        # What is due at once goes before anything is served: a relay's hello must precede the
        # host frame its first deposits make, or the reducer refuses that frame as a stranger's.
        self._fire(self.clock())
        turned = self.clock()
        while self._running:
            self._arm_writers()
            polled = self.clock()
            wait_ms = poll_ms(self._next_due() - polled)
            events = dict(self._poller.poll(wait_ms))
            now = self.clock()
            # Out of poll (the last turn's work) plus any overrun of the poll's own timeout.
            gap = (polled - turned) + max(0.0, now - polled - wait_ms / 1000)
            turned = now
            if gap > STALL_S:
                self._stalled(gap)
            if self.mailbox.fileno() in events:
                self._dispatch(self.mailbox.drain())
                if not self._running:
                    break
            for sock, handler in self._sockets:
                if events.get(sock, 0) & zmq.POLLIN:
                    handler()
            for sock, _, handler in self._writers:
                if events.get(sock, 0) & zmq.POLLOUT:
                    handler()
            handled = self.clock()
            if handled - now > STALL_S:
                # This turn's own work held the thread (a send through a full queue): a stall too, taken
                # off before the timers judge anyone's silence, and not counted again next turn.
                self._stalled(handled - now)
                turned = handled
            self._fire(handled)

    def dispatch_queued(self) -> None:
        """Handle what is in the mailbox now, from inside a handler that must not act before it (a command
        put before the record being handled was sent); a `Stop` among it ends the loop after this turn."""
        self._dispatch(self.mailbox.drain())

    def close(self) -> None:
        """Release the mailbox (after `run` returned); later puts are dropped."""
        self.mailbox.close()

    def _dispatch(self, items: list[Any]) -> None:
        for item in items:
            if isinstance(item, Stop):
                self._running = False
                return
            handler = self._handlers.get(type(item))
            if handler is None:
                raise TypeError(f"loop {self.name}: no handler for a {type(item).__name__}; register one "
                                "with on_message before putting it")
            handler(item)

    def _arm_writers(self) -> None:
        """Poll each writer's socket for writable on this turn only if it wants it; the poller is
        touched only when that changes, not on every turn (flags 0 unregisters)."""
        for sock, wanted, _ in self._writers:
            if wanted() == (sock in self._armed):
                continue
            self._armed ^= {sock}
            reading = any(s is sock for s, _ in self._sockets)
            self._poller.register(sock, (zmq.POLLIN if reading else 0) | (zmq.POLLOUT if sock in self._armed else 0))

    def _stalled(self, gap: float) -> None:
        for stalled in self._stall_handlers:
            stalled(gap)

    def _next_due(self) -> float:
        return min((due() for due, _ in self._timers), default=math.inf)

    def _fire(self, now: float) -> None:
        due_now = sorted((due(), i) for i, (due, _) in enumerate(self._timers))
        for at, i in due_now:
            if at > now:
                break
            self._timers[i][1](now)
