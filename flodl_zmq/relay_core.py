"""The relay's rules as plain objects: liveness, consensus recovery, hellos, merged reports (sans-I/O).

The ZeroMQ service that drives them is ``relay.Relay``; every method here
takes the current time as an argument and touches no socket, thread or clock.

Rules this module keeps:

- Liveness (the wheels have no ROUTER_NOTIFY): a rank is dead when it says
  goodbye, when no control record arrived from it within its heartbeat
  deadline (or its first-contact deadline before its first one), or when the
  controller declares it dead. Death is permanent: membership only shrinks.
  A stall of the relay's own process is nobody's silence.
- A rank reported gone is restated every RESEND_AFTER_S for the rest of the
  run: a RankExit lost in a reset must not leave the controller waiting for a
  timeout, and a repeat changes nothing (PROTOCOL.md 10.7).
- A consensus is delivered once. A shipped round whose consensus did not
  come (a later round came first, or silence past the deadline) is requested
  again, each request doubling the wait up to a cap, and at once when an
  upstream link reconnects (PROTOCOL.md 10.3).
- A RelayHello is repeated until acknowledged.
- A host's mergeable rank records go up as one `relay.reports` per period,
  or at once when every live local rank has one held (PROTOCOL.md 9.4).
- The data thread never waits on a send upstream: its records queue, in
  order, and are dropped together once none has gone for the peer send
  timeout (PROTOCOL.md 10.5 item 6).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from flodl_zmq.wire.records import HostReports
from flodl_zmq.wire.stream import RESEND_AFTER_S

# How long the relay holds its ranks' mergeable records to send them up as one: a rank's own report
# period (PROTOCOL.md 9.3, timing.batch), so a host's ranks make one record per period.
MERGE_PERIOD_S = 0.05


class RankLiveness:
    """Local rank liveness from records and goodbyes (pure: the caller passes the time).

    A rank is alive until it says goodbye, is declared dead, or stays silent
    past its deadline: `heartbeat_deadline` after its last record, or
    `first_contact_deadline` after `start` if it never spoke (process start-up
    is slower than a heartbeat). Death is permanent: membership only shrinks.
    A stall of this process (a SIGSTOP, the GIL held by torch's import at a
    run's first bf16 fold; the service loop measures it) is not its ranks'
    silence: `stalled` takes it off every clock, since what they sent
    meanwhile is still on its way in.
    """

    def __init__(self, roster: Iterable[int], start: float, heartbeat_deadline: float, first_contact_deadline: float):
        self.roster = frozenset(roster)
        self.heartbeat_deadline = heartbeat_deadline
        self.first_contact_deadline = first_contact_deadline
        self._start = start
        self._last: dict[int, float] = {}
        self.dead: set[int] = set()

    def seen(self, rank: int, now: float) -> None:
        """A record from `rank` arrived at `now`."""
        self._last[rank] = now

    def leave(self, rank: int) -> bool:
        """Mark `rank` dead; True when it was alive."""
        if rank in self.dead or rank not in self.roster:
            return False
        self.dead.add(rank)
        return True

    def stalled(self, gap: float) -> None:
        """This process heard nothing for `gap` seconds of its own making: no rank's silence grows by it."""
        self._start += gap
        for rank in self._last:
            self._last[rank] += gap

    def expired(self, now: float) -> list[int]:
        """Ranks whose deadline passed at `now`; they are marked dead."""
        out = []
        for rank in sorted(self.roster - self.dead):
            if now - self._heard(rank) > self._limit(rank):
                self.dead.add(rank)
                out.append(rank)
        return out

    def next_due(self) -> float:
        """When the next live rank's deadline passes if it stays silent (math.inf: none left)."""
        return min((self._heard(r) + self._limit(r) for r in self.roster - self.dead), default=math.inf)

    def _heard(self, rank: int) -> float:
        return self._last.get(rank, self._start)

    def _limit(self, rank: int) -> float:
        return self.heartbeat_deadline if rank in self._last else self.first_contact_deadline


class Departures:
    """The ranks reported gone, and when to restate them (pure; PROTOCOL.md 10.7).

    Each is restated every RESEND_AFTER_S for the rest of the run: a RankExit
    lost in a reset must not leave the controller waiting for a heartbeat
    timeout, and a repeat changes nothing there.
    """

    def __init__(self) -> None:
        self.ranks: list[int] = []
        self.due_at = math.inf  # when the next restatement is due

    def add(self, rank: int, now: float) -> None:
        """`rank` was reported gone at `now`."""
        self.ranks.append(rank)
        self.due_at = min(self.due_at, now + RESEND_AFTER_S)

    def due(self, now: float) -> list[int]:
        """Every rank gone so far when a restatement is due at `now` (the next one is then armed), else none."""
        if now < self.due_at:
            return []
        self.due_at = now + RESEND_AFTER_S
        return list(self.ranks)


class ConsensusWatch:
    """Which shipped rounds still await their consensus, and when to ask for one (pure).

    `shipped` arms a round; `accept` says whether a consensus is new (deliver
    it) and which older shipped rounds it overtook (ask for those now); `gone`
    drops a round its shard no longer holds (asked again at every later
    consensus, it would bring an error on both sides each time); `due`
    returns rounds silent past their wait and re-arms them, so a request
    that is itself lost is repeated; `reconnected` returns every pending
    round at once, after an upstream connection was made anew. Each request
    for a round doubles its wait (up to `BACKOFF_CAP` deadlines): on a slow link a consensus may take
    longer than the deadline to arrive, and every early request would put one
    more full copy of it on that link (PROTOCOL.md 10.3). For the same reason
    a round's wait is at least twice what the link showed: the shortest time
    from shipping to consensus among the last `LATENCY_ROUNDS` rounds
    delivered, past `BACKOFF_CAP` deadlines too: a large model's rounds take
    seconds longer than a small one's, and one reducer's link carrying every
    host's frame takes longer than 8 deadlines (4 hosts x 100M parameters at
    1 Gbit/s: 28 requests over 3 rounds, each answer one more model-sized
    message on that saturated link; docs/benchmarks.md bench/topology.py).
    The shortest, not the last: a slow link slows every round, but one round
    that waited on other hosts (a straggler, ranks held, a link flap) says
    nothing of this link, and taken as its latency it once left a lost
    consensus unasked for longer than the rest of the run while the host's
    rank waited at its barrier. `LINK_CAP` deadlines bound it, so a lost
    consensus is still asked for in bounded time even after a run of slow
    rounds.
    """

    BACKOFF_CAP = 8
    LINK_CAP = 64
    LATENCY_ROUNDS = 3

    def __init__(self, deadline: float):
        self.deadline = deadline
        # round -> (armed or last asked at, wait, shipped at)
        self._pending: dict[int, tuple[float, float, float]] = {}
        self._high = 0  # highest round shipped or delivered
        # shipping to consensus, of the last rounds delivered (their shortest is the link's latency)
        self._latencies: deque[float] = deque(maxlen=self.LATENCY_ROUNDS)

    @property
    def pending(self) -> list[int]:
        return sorted(self._pending)

    def _latency(self) -> float:
        """What the link showed: the shortest shipping-to-consensus time of the last rounds delivered."""
        return min(self._latencies, default=0.0)

    def _cap(self) -> float:
        """The longest wait: 8 deadlines, or twice what the link showed (at most `LINK_CAP` deadlines)."""
        return max(self.BACKOFF_CAP * self.deadline, min(2.0 * self._latency(), self.LINK_CAP * self.deadline))

    def shipped(self, round_id: int, now: float) -> None:
        wait = min(max(self.deadline, 2.0 * self._latency()), self._cap())
        self._pending[round_id] = (now, wait, now)
        self._high = max(self._high, round_id)

    def accept(self, round_id: int, now: float) -> tuple[bool, list[int]]:
        """(deliver, overtaken rounds to request) for a consensus of `round_id`."""
        if round_id in self._pending:
            self._latencies.append(now - self._pending.pop(round_id)[2])
        elif round_id > self._high:
            self._high = round_id  # a round this host had nothing for; its live ranks still adopt it
        else:
            return False, []  # already delivered: a replay or a duplicate resend
        gaps = [r for r in sorted(self._pending) if r < round_id]
        for r in gaps:
            self._asked(r, now)
        return True, gaps

    def gone(self, round_id: int) -> None:
        """The shard answered that `round_id` was superseded: no request can bring its consensus any more."""
        self._pending.pop(round_id, None)

    def next_due(self) -> float:
        """When the first pending round's wait runs out (math.inf: none pending)."""
        return min((t + wait for t, wait, _ in self._pending.values()), default=math.inf)

    def reconnected(self, now: float) -> list[int]:
        """Every pending round, asked for now: a connection that was replaced lost what it carried
        (a broadcast, a resend, a request), and waiting out a backed-off wait for it starves the host."""
        out = self.pending
        for r in out:
            self._asked(r, now)
        return out

    def due(self, now: float) -> list[int]:
        out = [r for r, (t, wait, _) in sorted(self._pending.items()) if now - t > wait]
        for r in out:
            self._asked(r, now)
        return out

    def _asked(self, round_id: int, now: float) -> None:
        _, wait, shipped_at = self._pending[round_id]
        self._pending[round_id] = (now, min(2 * wait, self._cap()), shipped_at)


class HelloRetry:
    """When a relay (re)sends its RelayHello on one upstream link (pure: the caller passes the time).

    Due at once, then every `retry_s` until acknowledged: a hello lost in a
    connection reset must not leave the host unregistered. The controller and
    the reducer accept a repeated hello from the same identity idempotently.
    """

    def __init__(self, retry_s: float):
        self.retry_s = retry_s
        self._next: float | None = 0.0  # None: acknowledged

    def due(self, now: float) -> bool:
        if self._next is None or now < self._next:
            return False
        self._next = now + self.retry_s
        return True

    def next_due(self) -> float:
        """When the hello is next due (math.inf: acknowledged)."""
        return math.inf if self._next is None else self._next

    def acked(self) -> None:
        self._next = None


class ReportQueue:
    """The host's rank records waiting to go up as one `relay.reports` (pure; PROTOCOL.md 9.4).

    Forwarded one by one, a host of R ranks cost the controller R decodes and
    R records' bytes per report period; merged, one. A lone held record goes
    up as it came: there is nothing to merge it with. The queue is due when
    every live local rank has a record in it (one rank: at once, no added
    latency), or `period_s` after the first; the relay also empties it before
    any other record of the host goes up, so a rank's next stream record never
    waits at the coordinator behind one the relay still holds.
    """

    def __init__(self, ranks: Iterable[int], period_s: float):
        self.period_s = period_s
        self.due_at = math.inf
        self._live = set(ranks)
        self._items: list[tuple[int, Any, list[Any]]] = []
        self._from: set[int] = set()

    def add(self, seq: int, record: Any, frames: list[Any], now: float) -> None:
        """Hold `record` (sequence number `seq` of its rank's stream), which came as `frames`."""
        if not self._items:
            self.due_at = now + self.period_s
        self._items.append((seq, record, frames))
        self._from.add(record.rank)
        if self._from >= self._live:
            self.due_at = now

    def leave(self, rank: int) -> None:
        """`rank` left: the queue no longer waits for it."""
        self._live.discard(rank)
        if self._items and self._from >= self._live:
            self.due_at = 0.0  # due at once

    def take(self) -> HostReports | list[Any] | None:
        """What is held: several records as one HostReports; a lone one as the frames it came in
        (nothing to merge it with: verbatim, it is smaller and costs no signature); None when nothing is."""
        items, self._items, self._from, self.due_at = self._items, [], set(), math.inf
        if len(items) <= 1:
            return items[0][2] if items else None
        return HostReports.merge([(seq, record) for seq, record, _ in items])


class SendQueue:
    """A relay's data records waiting for its upstream socket to take them, in the order queued (pure).

    The data thread never waits on a send: waiting, it would read nothing, and
    a connecting socket that stops reading while model-sized consensus copies
    arrive on it has its heartbeat time out and reconnects, which libzmq can
    abort on (its issues #3937 and #3596; docs/benchmarks.md, bench/topology.py).
    The queue is judged by progress, not by a wait: once nothing in it has
    gone for `timeout_s` the peer stopped reading, and everything queued is
    dropped at once (`expire`), as a send that timed out was; the reducer's
    requests and the relay's retries recover what it carried, as any lost
    record (PROTOCOL.md 10.5 item 6, 10.6). At most `MAX_RECORDS` wait (`put`):
    the protocol queues one round's host frames and a few small records, and
    a payload is held by reference (the fold's buffers), so the count bounds
    the memory too.
    """

    MAX_RECORDS = 64

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._items: deque[Sequence[Any]] = deque()
        self._since = 0.0  # the last progress: a record went, or the queue stopped being empty

    def __len__(self) -> int:
        return len(self._items)

    @property
    def head(self) -> Sequence[Any] | None:
        """The record to send next (None: nothing waits)."""
        return self._items[0] if self._items else None

    def put(self, frames: Sequence[Any], now: float) -> bool:
        """Queue `frames` after the rest; False (not queued) when `MAX_RECORDS` wait already."""
        if len(self._items) >= self.MAX_RECORDS:
            return False
        if not self._items:
            self._since = now
        self._items.append(frames)
        return True

    def went(self, now: float) -> None:
        """The socket took the head at `now`: progress."""
        self._items.popleft()
        self._since = now

    def next_due(self) -> float:
        """When the queue is judged stuck (math.inf: nothing waits)."""
        return self._since + self.timeout_s if self._items else math.inf

    def expire(self, now: float) -> int:
        """Drop everything queued if nothing went for `timeout_s`; how many records were dropped."""
        if now < self.next_due():
            return 0
        dropped = len(self._items)
        self._items.clear()
        return dropped
