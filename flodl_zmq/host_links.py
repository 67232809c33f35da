"""Which admitted hosts still live, and what the membership service reports of them to the controller.

A pure core like join.py (every `now` is an argument): `HostLinks` keeps the
liveness of each admitted host's join link, from the records its agent sends
(`membership.MembershipService` feeds it); the events below are what the
membership service tells the controller service.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flodl_zmq.errors import ConfigError
from flodl_zmq.join import Member


class HostLinks:
    """Liveness of admitted hosts' join links.

    The join link is the controller's first-hand view of a host: a rank exit
    arrives here at once (the fast path to declaring a rank dead), and a host
    whose agent falls silent for `timeout_s` is lost with every rank it had
    not reported. A host is done once every one of its ranks has exited; a
    done host is never reported lost. At a re-form (`reform`) a host's ranks
    of the incarnation before are *retiring*: their exits are expected (the
    agent stops them) and belong to no rank of the new world, which may
    reuse the same numbers on that host; the agent reports them before it
    starts the new ones, so an exit is a retiring rank's while any remains.
    """

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ConfigError(f"host silence timeout must be > 0 seconds (got {timeout_s})")
        self.timeout_s = timeout_s
        self._heard: dict[str, float] = {}
        self._live_ranks: dict[str, set[int]] = {}
        self._retiring: dict[str, set[int]] = {}
        self._closed: set[str] = set()
        self._silent_at: dict[str, float] = {}  # host -> when it was lost to silence (`lost`)

    def add(self, member: Member, now: float) -> None:
        """Watch `member`'s link from `now` (a host that was lost and came back starts over)."""
        self._heard[member.host] = now
        self._silent_at.pop(member.host, None)
        self._live_ranks[member.host] = set(member.ranks)
        self._retiring.pop(member.host, None)
        self._closed.discard(member.host)

    def reform(self, member: Member) -> None:
        """`member`'s host runs the ranks of `member` from now on; its live ones retire first."""
        self._retiring[member.host] = self._live_ranks.get(member.host, set())
        self._live_ranks[member.host] = set(member.ranks)

    def retire(self, host: str, rank: int) -> bool:
        """True when `rank`'s exit is that of a rank retiring at a re-form (and records it)."""
        old = self._retiring.get(host)
        if not old or rank not in old:
            return False
        old.discard(rank)
        return True

    def forget(self, host: str) -> None:
        """`host` is no longer watched (a joiner turned away before it ran anything)."""
        for ledger in (self._heard, self._live_ranks, self._retiring, self._silent_at):
            ledger.pop(host, None)

    def retiring(self) -> list[str]:
        """Hosts still stopping their ranks of the incarnation before a re-form."""
        closed = set(self._closed)  # copies: the join thread changes both while the controller's asks
        return [h for h, old in list(self._retiring.items()) if old and h not in closed]

    def heard(self, host: str, now: float) -> float:
        """`host` spoke at `now`; how long it had been silent (0 for a host not watched)."""
        if host not in self._heard:
            return 0.0
        silent, self._heard[host] = now - self._heard[host], max(self._heard[host], now)
        return silent

    def silent_for(self, host: str, now: float) -> float:
        """How long `host`, watched and neither done nor lost, has been silent (0 for any other)."""
        if host not in self._heard or host in self._closed:
            return 0.0
        return now - self._heard[host]

    def rank_exited(self, host: str, rank: int, now: float) -> bool:
        """Record a reported exit; True when it was the host's last live rank."""
        self.heard(host, now)
        live = self._live_ranks.get(host)
        if live is None or rank not in live:
            return False
        live.discard(rank)
        if not live:
            self._closed.add(host)
            return True
        return False

    def live_ranks(self, host: str) -> tuple[int, ...]:
        return tuple(sorted(self._live_ranks.get(host, ())))

    def state(self, host: str) -> str:
        """`live`, `done` (every rank exited) or `lost` (fell silent with ranks live)."""
        if host not in self._closed:
            return "live"
        return "lost" if self._live_ranks.get(host) else "done"

    def running(self) -> list[str]:
        """Hosts neither done nor lost (safe from another thread: reads copies)."""
        return [h for h in self._heard.copy() if h not in self._closed]

    def next_due(self) -> float | None:
        """When the quietest open host turns lost if it stays silent; None with no open host."""
        heard = [t for h, t in self._heard.items() if h not in self._closed]
        # `lost` is strict (silent for longer than the timeout): due just after.
        return math.nextafter(min(heard) + self.timeout_s, math.inf) if heard else None

    def cut(self, host: str) -> bool:
        """`host` broke the protocol: lost now, as if silent (False when it is not watched or already lost)."""
        if host not in self._heard or host in self._closed:
            return False
        self._closed.add(host)
        return True

    def lost(self, now: float) -> list[str]:
        """Hosts that fell silent since the last call (each reported once)."""
        out = [
            h for h, t in self._heard.items() if h not in self._closed and now - t > self.timeout_s
        ]
        self._closed.update(out)
        self._silent_at.update((h, now) for h in out)
        return out

    def all_silent_together(self) -> bool:
        """Whether every watched host, two or more, was lost to silence within one timeout of the others: more
        likely the controller's own link went down than every host's at once."""
        at = [self._silent_at[h] for h in self._heard if h in self._silent_at]
        return 2 <= len(at) == len(self._heard) and max(at) - min(at) <= self.timeout_s


# What the membership service reports to the controller service about the admitted hosts.


@dataclass(frozen=True)
class RankExitReported:
    host: str
    rank: int
    code: int  # negative: killed by that signal


@dataclass(frozen=True)
class HostLost:
    host: str
    ranks: tuple[int, ...]  # the ranks it had not reported as exited
    why: str = "its agent fell silent"


@dataclass(frozen=True)
class HostDone:
    host: str


@dataclass(frozen=True)
class RelayExitReported:
    host: str
    code: int  # non-zero; negative: killed by that signal


MembershipEvent = RankExitReported | RelayExitReported | HostLost | HostDone
