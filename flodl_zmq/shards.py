"""Sharded reduction (PROTOCOL.md 10.9): which shard reduces which values, and a consensus made whole again.

One reducer takes every host's whole frame in through its one link and sends
the consensus out once per host through it again: 2 H M bytes a round (H
hosts, M model bytes), H times what a bandwidth-optimal all-reduce moves per
host. With `shards` set (FLODL_SHARDS) the reduce is split by position, as
BytePS places its summation servers: shard 0 is the controller's reducer, and
each listed host runs one more reducer in its relay process. Shard k owns a
contiguous, even share of the flat vector, cut at int8 blocks; a relay sends
each shard only its values of the host frame (the parts of the payload's
chunks inside them, PROTOCOL.md 3.4), each shard reduces and publishes its
slice alone, and whoever needs the whole consensus (a relay for its ranks,
the controller for its checkpoints) puts the shards' slices of one round back
into chunks (`Assembly`, `Cut`). Every host link then carries about 2M a
round whatever H is.

Pure: no sockets, no clocks. The shards' services are reducer_service.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flodl_zmq import int8
from flodl_zmq.errors import ConfigError, ProtocolError
from flodl_zmq.wire_format import CHUNK_VALUES, chunks

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

    def ranges(self, n_values: int) -> list[range]:
        """The values each shard owns, in shard order: contiguous, as even as whole int8 blocks allow.

        Cut at blocks of 4096 values (PROTOCOL.md 3.6), not at chunks: whole chunks split 12 over 9
        shards gave three of them twice the others' slice, and their links set every round's pace.
        """
        n_blocks = int8.blocks(n_values)
        if n_blocks < self.count:
            raise ConfigError(f"{SETTING}: {self.count} shards for a model of {n_values} values ({n_blocks} block(s) "
                              f"of {int8.BLOCK}): each shard needs at least one; list at most {n_blocks - 1} "
                              "host(s), or none for a model this small (one reducer carries it)")
        cuts = [min(n_values, k * n_blocks // self.count * int8.BLOCK) for k in range(self.count + 1)]
        return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def parts(values: range) -> list[range]:
    """The payload frames of a slice of `values`: the part of each chunk (PROTOCOL.md 3.4) inside it, in order."""
    return [range(max(a, values.start), min(b, values.stop))
            for a, b in chunks(values.stop) if b > values.start]


@dataclass(frozen=True)
class Cut:
    """A round's payload cut between the shards (PROTOCOL.md 10.9 item 2), and put back together.

    `parts[k]`: the flat vector's ranges that shard k's payload frames hold,
    one each (under int8 two: the part's values, then its blocks' scales).
    """

    parts: tuple[tuple[range, ...], ...]
    per_chunk: int  # payload frames per chunk, and per part: 2 under int8

    @classmethod
    def of(cls, shards: ShardMap, n_values: int, per_chunk: int) -> Cut:
        return cls(tuple(tuple(parts(r)) for r in shards.ranges(n_values)), per_chunk)

    @property
    def n_values(self) -> int:
        """The flat vector's length: where the last shard's last part ends."""
        return self.parts[-1][-1].stop

    def values(self, shard: int) -> range:
        """The flat vector's values shard `shard` owns: from its first part's start to its last part's stop."""
        return range(self.parts[shard][0].start, self.parts[shard][-1].stop)

    def frames(self, shard: int) -> int:
        """How many payload frames shard `shard`'s slice has."""
        return len(self.parts[shard]) * self.per_chunk

    def slices(self, payload: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
        """Each shard's frames of a payload in chunk layout, in shard order: views of its parts, no copy; a
        ProtocolError for a payload of another model (a host frame built from a rank's deposit of another size)."""
        lengths = [len(values) for values in payload[:: self.per_chunk]]
        if sum(lengths) != self.n_values or len(lengths) != len(chunks(self.n_values)):
            raise ProtocolError(f"a payload of {sum(lengths)} values in {len(lengths)} chunks, where this run's "
                                f"shards cut {self.n_values} values (ranks built with different models?)")
        return [self._slice(payload, shard_parts) for shard_parts in self.parts]

    def _slice(self, payload: Sequence[np.ndarray], shard_parts: Sequence[range]) -> list[np.ndarray]:
        out = []
        for part in shard_parts:
            chunk = part.start // CHUNK_VALUES
            lo, hi = part.start - chunk * CHUNK_VALUES, part.stop - chunk * CHUNK_VALUES
            out.append(payload[chunk * self.per_chunk][lo:hi])
            if self.per_chunk == 2:  # the part starts on a block: its scales are the chunk's own
                out.append(payload[chunk * 2 + 1][lo // int8.BLOCK : int8.blocks(hi)])
        return out

    def check(self, shard: int, payload: Sequence[np.ndarray]) -> str | None:
        """What is wrong with `payload` as shard `shard`'s slice (its frames' count or shapes), or None."""
        if len(payload) != self.frames(shard):
            return f"has {len(payload)} payload frames, its parts {self.frames(shard)}"
        for i, part in enumerate(self.parts[shard]):
            frames = payload[i * self.per_chunk : (i + 1) * self.per_chunk]
            want = [(len(part),)] + ([(int8.blocks(len(part)),)] if self.per_chunk == 2 else [])
            if [np.shape(f) for f in frames] != want:
                return (f"has frames of shape {[np.shape(f) for f in frames]} for values {part.start} to "
                        f"{part.stop}, which take {want}")
        return None

    def join(self, slices: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
        """The payload in chunk layout from every shard's slice, in shard order: a chunk cut between shards is
        copied into one, a chunk inside one slice is passed on as it is."""
        by_chunk: dict[int, list[Sequence[np.ndarray]]] = {}
        for shard, payload in enumerate(slices):
            for i, part in enumerate(self.parts[shard]):
                by_chunk.setdefault(part.start // CHUNK_VALUES, []).append(
                    payload[i * self.per_chunk : (i + 1) * self.per_chunk])
        out: list[np.ndarray] = []
        for chunk in sorted(by_chunk):
            pieces = by_chunk[chunk]
            for j in range(self.per_chunk):
                out.append(pieces[0][j] if len(pieces) == 1 else np.concatenate([p[j] for p in pieces]))
        return out


@dataclass(frozen=True)
class Whole:
    """One round's consensus with every shard's slice in: `payload` in chunk layout."""

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

    def __init__(self, cut: Cut) -> None:
        self.cut = cut
        self.last: int | None = None  # the newest round made whole
        self._parts: dict[int, dict[int, tuple[float, list[Any]]]] = {}

    def add(self, shard: int, round_id: int, mass: float, payload: Sequence[Any]) -> Whole | None:
        """Take `shard`'s slice of `round_id`; the whole round once this completes it (None for a stale one)."""
        shards = len(self.cut.parts)
        if not 0 <= shard < shards:
            raise ProtocolError(f"a consensus slice from shard {shard}, but the run has {shards} shards")
        wrong = self.cut.check(shard, payload)
        if wrong is not None:
            raise ProtocolError(f"shard {shard}'s slice of round {round_id} {wrong} (a shard of another shard map "
                                "or model)")
        if self.last is not None and round_id <= self.last:
            return None
        parts = self._parts.setdefault(round_id, {})
        parts[shard] = (float(mass), list(payload))
        if len(parts) < shards:
            return None
        self.last = round_id
        for r in [r for r in self._parts if r <= round_id]:
            del self._parts[r]
        masses = [parts[k][0] for k in range(shards)]
        mass = 0.0 if min(masses) == 0.0 else masses[0]
        return Whole(round_id, mass, self.cut.join([parts[k][1] for k in range(shards)]))

    def waiting(self) -> tuple[int, list[int]] | None:
        """The oldest round that some shards sent their slice of and not all: (round, the shards it waits for)."""
        if not self._parts:
            return None
        round_id = min(self._parts)
        return round_id, [k for k in range(len(self.cut.parts)) if k not in self._parts[round_id]]


def state_frames(model: np.ndarray, momentum: np.ndarray) -> list[np.ndarray]:
    """A shard's outer state as frames (PROTOCOL.md 10.9 items 11 and 12): its slice's global model, then its
    momentum, each in pieces of at most a chunk's values, so no frame is longer than an f32 chunk's (6.1)."""
    return [x[a : a + CHUNK_VALUES] for x in (model, momentum) for a in range(0, x.size, CHUNK_VALUES)]


def state_of(payload: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """(global model, momentum) from a shard's outer state frames (`state_frames`: the model's, then the
    momentum's, f32 and 1-D, the same shapes frame by frame), or None for frames that are not such."""
    half = len(payload) // 2
    models, momenta = payload[:half], payload[half:]
    if not half or len(payload) % 2 or any(g.dtype != np.float32 or m.dtype != np.float32 or g.ndim != 1
                                           or g.shape != m.shape for g, m in zip(models, momenta, strict=True)):
        return None
    return np.concatenate(models), np.concatenate(momenta)


class OuterGather:
    """The shards' outer state of one round made whole, for a sharded run's bundles (PROTOCOL.md 10.9 item 12).

    Each shard sends its slice's (global model, momentum) after the step of a round; `whole` is the newest
    round every shard's slice came for, as (round, global model, momentum), f32 and flat.
    """

    def __init__(self, cut: Cut) -> None:
        self.cut = cut
        self.whole: tuple[int, np.ndarray, np.ndarray] | None = None
        self._round = -1
        self._slices: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def add(self, shard: int, round_id: int, payload: Sequence[np.ndarray]) -> None:
        """Take `shard`'s state of `round_id` (an older round's is dropped); a ProtocolError for a payload that is
        not its slice's model and momentum, f32."""
        shards = len(self.cut.parts)
        if not 0 <= shard < shards:
            raise ProtocolError(f"an outer state from shard {shard}, but the run has {shards} shards")
        n, state = len(self.cut.values(shard)), state_of(payload)
        if state is None or state[0].size != n:
            raise ProtocolError(f"shard {shard}'s outer state of round {round_id} is not its slice's {n} values of "
                                "model then momentum, f32 (a shard of another shard map or model)")
        if round_id < self._round:
            return
        if round_id > self._round:
            self._round, self._slices = round_id, {}
        self._slices[shard] = state
        if len(self._slices) == shards:
            pieces = [self._slices[k] for k in range(shards)]
            self.whole = (round_id, np.concatenate([g for g, _ in pieces]), np.concatenate([m for _, m in pieces]))
            self._slices = {}
