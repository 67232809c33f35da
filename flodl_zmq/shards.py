"""Sharded reduction (PROTOCOL.md 10.9): which shard reduces which chunks, and a consensus made whole again.

One reducer takes every host's whole frame in through its one link and sends
the consensus out once per host through it again: 2 H M bytes a round (H
hosts, M model bytes), H times what a bandwidth-optimal all-reduce moves per
host. With `shards` set (FLODL_SHARDS) the reduce is split by position, as
BytePS places its summation servers: shard 0 is the controller's reducer, and
each listed host runs one more reducer in its relay process. Shard k owns a
contiguous run of the payload's chunks (PROTOCOL.md 3.4); a relay sends each
shard only its chunks of the host frame, each shard reduces and publishes its
chunks alone, and whoever needs the whole consensus (a relay for its ranks,
the controller for its checkpoints) puts the shards' slices of one round
together (`Assembly`). Every host link then carries about 2M a round whatever
H is.

Pure: no sockets, no clocks. The shards' services are reducer_service.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from flodl_zmq.errors import ConfigError, ProtocolError

SETTING = "shards"


def _endpoint(host: str, text: str) -> tuple[str, int]:
    """(address, port) of one shard's `tcp://ADDRESS:PORT`, or a ConfigError naming the entry."""
    where = f"{SETTING} entry {host}={text}"
    if not text.startswith("tcp://"):
        raise ConfigError(f"{where}: a shard's address must be tcp://ADDRESS:PORT (its host's address that every "
                          "other host and the controller reach)")
    address, sep, port = text[len("tcp://"):].rpartition(":")
    if not sep or not address.strip("[]") or not port.isdigit():
        raise ConfigError(f"{where}: a shard's address must be tcp://ADDRESS:PORT, e.g. tcp://10.0.0.2:7400")
    if not 1 <= int(port) <= 65534:
        raise ConfigError(f"{where}: port must be in 1..65534 (the shard also binds the next port, for its PUB)")
    return address, int(port)


@dataclass(frozen=True)
class ShardMap:
    """Which hosts hold a shard, and where: shard 0 the controller's reducer, shard k (k >= 1) the k-th entry's.

    `hosts` pairs each host holding a shard with the address its shard binds:
    the data ROUTER at `tcp://ADDRESS:PORT`, the PUB at PORT + 1.
    """

    hosts: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> ShardMap:
        """`HOST=tcp://ADDRESS:PORT,...` (none or empty: one shard, the controller's reducer)."""
        if not text or not text.strip():
            return cls()
        entries = []
        for item in text.split(","):
            host, sep, address = item.strip().partition("=")
            if not sep or not host.strip():
                raise ConfigError(f"{SETTING} entry {item.strip()!r} must be HOST=tcp://ADDRESS:PORT "
                                  "(a host of the world, and the address its shard binds)")
            _endpoint(host.strip(), address.strip())
            entries.append((host.strip(), address.strip()))
        names = [h for h, _ in entries]
        if len(set(names)) != len(names):
            raise ConfigError(f"{SETTING} names a host twice ({text}): a host holds at most one shard")
        return cls(tuple(entries))

    def __str__(self) -> str:
        return ",".join(f"{h}={a}" for h, a in self.hosts)

    @property
    def count(self) -> int:
        """How many shards reduce a round: the controller's and one per listed host."""
        return 1 + len(self.hosts)

    def shard_of(self, host: str) -> int | None:
        """The shard `host` holds (1 ..), or None."""
        for k, (h, _) in enumerate(self.hosts, start=1):
            if h == host:
                return k
        return None

    def endpoints(self, shard: int) -> tuple[str, str]:
        """(data, broadcast) endpoints of host shard `shard` (k >= 1): to bind on its host, to connect elsewhere."""
        host, text = self.hosts[shard - 1]
        address, port = _endpoint(host, text)
        return f"tcp://{address}:{port}", f"tcp://{address}:{port + 1}"

    def check_world(self, hosts: Sequence[str]) -> None:
        """Every listed host is one of the world's: a shard nobody runs would hang every round."""
        unknown = sorted(h for h, _ in self.hosts if h not in hosts)
        if unknown:
            raise ConfigError(f"{SETTING} lists {', '.join(unknown)}, not hosts of this world ({', '.join(sorted(hosts))}); "
                              "a shard runs in a host's relay, so name hosts that run one")

    def ranges(self, n_chunks: int) -> list[range]:
        """The chunks each shard owns, in shard order: contiguous, as even as whole chunks allow."""
        if n_chunks < self.count:
            raise ConfigError(f"{SETTING}: {self.count} shards for a model of {n_chunks} chunk(s) of 2^21 values: each "
                              f"shard needs at least one; list at most {n_chunks - 1} host(s), or none for a model this "
                              "small (one reducer carries it)")
        cuts = [k * n_chunks // self.count for k in range(self.count + 1)]
        return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def slice_frames(ranges: Sequence[range], per_chunk: int) -> list[int]:
    """How many payload frames each shard's slice has: its chunks', `per_chunk` frames each (`Assembly`'s sizes)."""
    return [len(r) * per_chunk for r in ranges]


def slice_of(payload: Sequence[Any], chunks: range, per_chunk: int) -> list[Any]:
    """A shard's frames of a payload: its chunks' (`per_chunk` frames each: 2 under int8, values and scales)."""
    return list(payload[chunks.start * per_chunk : chunks.stop * per_chunk])


@dataclass(frozen=True)
class Whole:
    """One round's consensus with every shard's slice in: `payload` in chunk order."""

    round_id: int
    mass: float
    payload: list[Any]


class Assembly:
    """The shards' slices of each round, until one round has them all (the newest whole round wins).

    Its mass is shard 0's, which the coordinator's bounds held; but a slice of
    mass 0 (its shard summed no work: the hosts that did were lost between
    their sends to the shards) holds no model, so the whole round then goes out
    with mass 0 and every rank keeps its own state (PROTOCOL.md 9.5).
    """

    def __init__(self, sizes: Sequence[int]) -> None:
        """`sizes`: how many payload frames each shard's slice has (its chunks times frames per chunk)."""
        self.sizes = list(sizes)
        self.last: int | None = None  # the newest round made whole
        self._parts: dict[int, dict[int, tuple[float, list[Any]]]] = {}

    def add(self, shard: int, round_id: int, mass: float, payload: Sequence[Any]) -> Whole | None:
        """Take `shard`'s slice of `round_id`; the whole round once this completes it (None for a stale one)."""
        if not 0 <= shard < len(self.sizes):
            raise ProtocolError(f"a consensus slice from shard {shard}, but the run has {len(self.sizes)} shards")
        if len(payload) != self.sizes[shard]:
            raise ProtocolError(f"shard {shard}'s slice of round {round_id} has {len(payload)} payload frames, "
                                f"its chunks {self.sizes[shard]} (a shard of another shard map or model)")
        if self.last is not None and round_id <= self.last:
            return None
        parts = self._parts.setdefault(round_id, {})
        parts[shard] = (float(mass), list(payload))
        if len(parts) < len(self.sizes):
            return None
        self.last = round_id
        for r in [r for r in self._parts if r <= round_id]:
            del self._parts[r]
        masses = [parts[k][0] for k in range(len(self.sizes))]
        mass = 0.0 if min(masses) == 0.0 else masses[0]
        return Whole(round_id, mass, [f for k in range(len(self.sizes)) for f in parts[k][1]])
