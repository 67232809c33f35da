"""Reliable, ordered control streams between the coordinator and one rank (PROTOCOL.md 10.7).

A connection reset loses what was inside it, and a lost control record (a
plan, an update, a rank's metrics or goodbye) would stall or corrupt a run.
So every control record of one direction of one (coordinator, rank) pair
belongs to a stream whose sequence numbers count 1, 2, 3... with no gap:

- the sender keeps each record's frames until the receiver acknowledges it,
  and sends them again, byte-identical, while unacknowledged (`Outstream`);
- the receiver's anti-replay window (codec) refuses a copy that did arrive,
  and `InOrder` hands records on in sequence order, holding one that overtook
  a lost one until the gap is filled, and names the highest gap-free number
  for the acknowledgement (the `ack` field of both heartbeats).

Pure: the caller passes the time and does the sending.
"""

from __future__ import annotations

import math
from typing import Any

from flodl_zmq.wire.codec import REPLAY_WINDOW, Codec
from flodl_zmq.wire.records import Channel

# Twice the slower heartbeat (the coordinator's beacon, 1 s): an acknowledgement
# normally comes well before, so only a record that was really lost goes twice.
RESEND_AFTER_S = 2.0


class Outstream:
    """The sending half: encodes on `codec`'s control channel, keeps until acknowledged.

    It must be the only encoder of its codec's control channel: then the n-th
    record it keeps carries sequence number n, and the stream has no gap.
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self._sent = 0
        self._kept: dict[int, tuple[float, list[Any]]] = {}  # seq -> (last sent, frames), in seq order
        # No resend is due before this (it may be early after an ack: a wasted look, never a late resend).
        self._due_at = math.inf

    def send(self, record: Any, now: float) -> list[Any]:
        """Encode `record`, keep it, and return the frames to send now."""
        frames = [bytes(f) for f in self.codec.encode(record, channel=Channel.CONTROL)]
        self._sent += 1
        self._kept[self._sent] = (now, frames)
        self._due_at = min(self._due_at, now + RESEND_AFTER_S)
        if len(self._kept) > REPLAY_WINDOW:  # the receiver's window refuses it as too old anyway
            del self._kept[next(iter(self._kept))]
        return frames

    def ack(self, n: int) -> int:
        """The receiver has every record up to `n`: forget them; how many that was (0: no news)."""
        before = len(self._kept)
        while self._kept and next(iter(self._kept)) <= n:
            del self._kept[next(iter(self._kept))]
        return before - len(self._kept)

    def due(self, now: float) -> list[list[Any]]:
        """Frames unacknowledged for `RESEND_AFTER_S` since last sent, in order; marked sent now."""
        if now < self._due_at:  # the common case, cheap: called on every turn of a service loop
            return []
        out = []
        for seq, (at, frames) in self._kept.items():
            if now - at >= RESEND_AFTER_S:
                self._kept[seq] = (now, frames)
                out.append(frames)
        self._due_at = min((at for at, _ in self._kept.values()), default=math.inf) + RESEND_AFTER_S
        return out

    def due_at(self) -> float:
        """The earliest moment a resend may fall due (inf: nothing kept)."""
        return self._due_at

    def forget(self) -> None:
        """Stop keeping: the peer is dead or gone, and must not receive its old records again."""
        self._kept.clear()
        self._due_at = math.inf

    def __len__(self) -> int:
        return len(self._kept)


class InOrder:
    """The receiving half: hands records on in sequence order; `acked` is the acknowledgement."""

    def __init__(self) -> None:
        self.acked = 0
        self._waiting: dict[int, Any] = {}

    def accept(self, seq: int, item: Any) -> list[Any]:
        """`item` came with `seq`; returns what may be handed on now, in order.

        A copy of a record already held or handed on is dropped, and so is one
        beyond the window: the codec's window refuses both for a record that
        came alone, but one merged by a relay (`relay.reports`) never met it,
        and a rank's resend after a reset may be merged twice.
        """
        if seq <= self.acked or seq in self._waiting or seq > self.acked + REPLAY_WINDOW:
            return []
        self._waiting[seq] = item
        out = []
        while self.acked + 1 in self._waiting:
            self.acked += 1
            out.append(self._waiting.pop(self.acked))
        return out


class Outage:
    """The resends over one link, logged once per outage rather than once per pass.

    While a link is down every pass (each RESEND_AFTER_S) resends to each of its
    streams; a warning per pass and stream buried the log (about 130 lines per
    busy reset). The caller warns when `resent_on` opens an outage, and logs the
    summary `settled` returns once every stream that needed a resend has been
    acknowledged again (or is gone).
    """

    def __init__(self) -> None:
        self.since: float | None = None
        self.resent = 0
        self._waiting: set[int] = set()

    def resent_on(self, stream: int, records: int, now: float) -> bool:
        """`records` of `stream` were just sent again; True when this opens an outage."""
        opened = self.since is None
        if opened:
            self.since, self.resent = now, 0
        self.resent += records
        self._waiting.add(stream)
        return opened

    def settled(self, stream: int, now: float) -> tuple[int, float] | None:
        """`stream` is acknowledged again (or gone); (records resent, seconds) when that ends the outage."""
        if stream not in self._waiting:
            return None
        self._waiting.discard(stream)
        if self._waiting or self.since is None:
            return None
        summary = (self.resent, now - self.since)
        self.since = None
        return summary
