"""The controller's side of sharded reduction (flodl_zmq/shards.py): what it refuses, and the whole consensus it keeps.

The controller keeps a copy of each consensus (its checkpoints, the final
model: `Keeper.keep`). With one shard that is what its own reducer publishes,
read in process. With host shards (`shards`, FLODL_SHARDS) its reducer is
shard 0 and publishes only its slice, so the controller also subscribes to
every host shard's PUB and keeps a round once `shards.Assembly` has every
slice of it. A slice it misses (a PUB drops for a subscriber that fell
behind; a shard's link down) leaves the kept model at the last whole round:
the next whole round replaces it, and a checkpoint waits until the kept round
is again the one the coordinator counted finished (`Keeper.consistent`).

The outer step runs per slice, position by position: the controller's
reducer steps slice 0, and each host shard its own from the `ShardStart`
the controller's reducer sends its relay (`shard_starts`, PROTOCOL.md 10.9
item 11); a bundle asks every shard for its slice of the state
(`checkpoints.ShardedOuter`, item 12). A shard's host lost mid-run ends the run
(`shard_lost`): no other process holds its slice. So does a shard whose link
to the controller stays down past the host silence limit (`SilentShards`): a
relay stopped or cut off, which no exit report names.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import zmq

from flodl_zmq.coordinator.liveness import ShutdownReason
from flodl_zmq.errors import AttributionError, ConfigError, ProtocolError, TrainingError, WireError
from flodl_zmq.links import (
    data_max_frame_bytes,
    drain,
    from_reducer,
    keep_alive,
    limit_receive,
    monitor_events,
)
from flodl_zmq.outer import OuterOptimizer
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.shards import SETTING, Assembly, Cut, ShardMap, state_frames
from flodl_zmq.wire import Channel, Codec
from flodl_zmq.wire import records as rec
from flodl_zmq.wire_format import F32, WireFormat

log = logging.getLogger(__name__)


def check_sharded(curve: bool, open_admission: bool) -> None:
    """What `flodl-zmq controller` refuses of a sharded run before any agent joins (a ConfigError naming the fix).

    CURVE: a host shard would need a server keypair whose public key every relay trusts, which no agent has;
    its links would go in the clear. Open admission: the first agent to claim a shard host's name would be
    handed the run's route secret (PROTOCOL.md 10.9 item 8).
    """
    if curve:
        raise ConfigError(f"{SETTING} (FLODL_SHARDS) with CURVE: the links to host shards cannot be encrypted in this "
                          "version; drop --curve-secret on a network you trust, or unset FLODL_SHARDS for one reducer")
    if open_admission:
        raise ConfigError(f"{SETTING} (FLODL_SHARDS) with --open-admission: any agent could claim a shard host's name "
                          "and be handed the run's route secret; give every agent the same FLODL_KEY instead, or unset "
                          "FLODL_SHARDS")


def shard_cut(shards: ShardMap, hosts: Iterable[str], n_values: int, wire: WireFormat) -> Cut:
    """How each round's payload is cut between the shards, every listed host checked to be one of the world's.

    Everything a round computes runs per slice, position by position: sums,
    int8 (each shard's error feedback is over its own positions), a median or
    trimmed mean, the outer step (`shard_starts`), and a resumed or shipped
    start (the controller's reducer serves the starting model whole).
    """
    shards.check_world(list(hosts))
    return Cut.of(shards, n_values, wire.frames_per_chunk)


def sharding(shards: ShardMap, hosts: Iterable[str], n_values: int, wire: WireFormat, outer: OuterOptimizer | None
             ) -> tuple[Cut | None, OuterOptimizer | None, dict[str, tuple[rec.ShardStart, list[np.ndarray]]]]:
    """A run's cut between its shards (None with one shard), the outer step of the controller's reducer (with
    host shards, over slice 0), and what each host shard starts from (`shard_cut`, `shard_starts`)."""
    if shards.count == 1:
        return None, outer, {}
    cut = shard_cut(shards, hosts, n_values, wire)
    return (cut, *shard_starts(shards, cut, outer))


def shard_starts(shards: ShardMap, cut: Cut | None, outer: OuterOptimizer | None
                 ) -> tuple[OuterOptimizer | None, dict[str, tuple[rec.ShardStart, list[np.ndarray]]]]:
    """Shard 0's outer step (over its slice of the run's), and by host what each host shard starts from.

    A host shard takes no host frame into a round before its start (PROTOCOL.md 10.9 item 11): the outer
    step's state over its slice (`shards.state_frames`), or with no outer step a record alone (`cut` is then
    not needed).
    """
    if outer is None:
        return None, {host: (rec.ShardStart(k, "none", 0.0, 0.0, 0), [])
                      for k, (host, _) in enumerate(shards.hosts, start=1)}
    if cut is None:
        raise ValueError("an outer step's starts are cut as the payload is: pass the run's cut")
    starts: dict[str, tuple[rec.ShardStart, list[np.ndarray]]] = {}
    for k, (host, _) in enumerate(shards.hosts, start=1):
        part, config = outer.part(cut.values(k)), outer.config
        starts[host] = (rec.ShardStart(k, config.kind, config.lr, config.momentum, part.stepped),
                        state_frames(part.global_model, part.momentum))
    return outer.part(cut.values(0)), starts


def reducer_frame_bytes(wire: WireFormat, n_values: int, sharded_outer: bool) -> int:
    """The longest frame the controller's data ROUTER takes (PROTOCOL.md 6.1): the run's model in its wire
    format, or in a sharded run with an outer step an f32 chunk, the shards' outer state (10.9 item 12)."""
    return data_max_frame_bytes((F32 if sharded_outer else wire).largest_frame_bytes(n_values))


def shard_lost(shards: ShardMap, host: str, what: str) -> TrainingError | None:
    """The run's end when `host`, whose relay ran a reducer shard, is gone (`what` happened), else None.

    No other process holds that shard's slice of the consensus, so every later round would wait
    for them for ever: the run stops at once, naming the shard (PROTOCOL.md 10.9 item 9).
    """
    k = shards.shard_of(host)
    if k is None:
        return None
    return TrainingError(f"reducer shard {k} ran in the relay of host {host}, which {what}: no other process holds "
                         "its slice of the consensus, so the run stops (this version re-homes no shard); start the "
                         "run again, or without FLODL_SHARDS")


class SilentShards:
    """Which host shards' links to the controller stayed down past the host silence limit (pure: time passed in).

    The controller's SUB to each host shard's PUB beats (`keep_alive`): a connection silent for link_silence_s is
    closed and re-dialled, and one reset is re-dialled at once, so a link down and not made again (no handshake)
    for `limit_s` is a shard's relay stopped or its host cut off, for as long as the controller waits for a silent
    host (host_silence_at_controller_s). No exit report comes for a process that is stopped, not dead, and every
    later round would wait for that shard's slice until the reduce-stall ceiling (5 minutes at least), which names
    no shard. Judged from the world's formation (`judge_from`): a shard's relay starts with its host's ranks, which
    formation waits for; one not connected by then is down from then.
    """

    def __init__(self, shards: Iterable[int], limit_s: float) -> None:
        self.limit_s = limit_s
        self._up = dict.fromkeys(shards, False)
        self._down_since: dict[int, float] = {}  # judged shards whose link is down, since when
        self._judging = False
        # Shards whose address accepted a TCP connection at least once: a relay there, stopped or not (the kernel
        # accepts for a stopped process), not an address the controller cannot reach.
        self.reached: set[int] = set()

    def judge_from(self, now: float) -> None:
        """The world formed (the first call counts): every shard not connected now is down from `now`."""
        if not self._judging:
            self._judging = True
            self._down_since = {k: now for k, up in self._up.items() if not up}

    def connected(self, shard: int) -> None:
        """A TCP connection to `shard`'s PUB was made (its handshake may still not come)."""
        self.reached.add(shard)

    def up(self, shard: int) -> None:
        """A handshake with `shard`'s PUB was made."""
        self._up[shard] = True
        self.reached.add(shard)
        self._down_since.pop(shard, None)

    def down(self, shard: int, now: float) -> None:
        """`shard`'s connection closed at `now` (silence past link_silence_s, a reset, its relay's exit)."""
        if self._up[shard] and self._judging:
            self._down_since[shard] = now
        self._up[shard] = False

    def due_at(self) -> float:
        """When the link down longest is down past the limit (just after it); math.inf: none down."""
        since = min(self._down_since.values(), default=math.inf)
        return math.nextafter(since + self.limit_s, math.inf)

    def silent(self, now: float) -> int | None:
        """The shard whose link has been down longest, if longer than the limit at `now`, else None. Each is
        named once (the run stops on the first): a wait no longer comes due for it."""
        since, shard = min(((t, k) for k, t in self._down_since.items()), default=(math.inf, None))
        if shard is None or now - since <= self.limit_s:
            return None
        del self._down_since[shard]
        return shard


class ConsensusCopies:
    """The controller's SUB to each shard's PUB (shard 0: its reducer's, in process), fed to its `keep`.

    `cut`: how a round is cut between the shards (`shard_cut`), None with one
    shard, whose consensus is kept as it comes. Each host shard's link is
    watched for silence past `silence_s` (`SilentShards`, `lost`). One thread:
    the controller's loop, which polls `watched` and hands its events to `read`.
    """

    _LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

    def __init__(self, ctx: zmq.Context, codec: Codec, keep: Callable[[rec.Consensus, list[Any]], None],
                 counts: collections.Counter[str], cut: Cut | None = None, silence_s: float = math.inf) -> None:
        self.codec, self.keep, self.counts = codec, keep, counts
        self.assembly = None if cut is None else Assembly(cut)
        self.sockets = [ctx.socket(zmq.SUB) for _ in range(1 if cut is None else len(cut.parts))]
        for sub in self.sockets:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
        self.silence = SilentShards(range(1, len(self.sockets)), silence_s)
        self.monitors: dict[zmq.Socket, int] = {}  # a host shard's SUB's handshakes and disconnections -> the shard
        self.shards = ShardMap()

    @property
    def watched(self) -> list[zmq.Socket]:
        """What the controller's loop polls for this: the SUBs and their monitors."""
        return [*self.sockets, *self.monitors]

    def connect(self, local_bcast: str, shards: ShardMap, links: ReducerConfig) -> None:
        """Shard 0 in process (no TCP copy, no CURVE); each host shard's PUB over tcp, bounded and watched as the
        controller's reducer's links are (`links`: its configuration), its monitor made before it dials."""
        self.shards = shards
        self.sockets[0].connect(local_bcast)
        for k, sub in enumerate(self.sockets[1:], start=1):
            bcast = shards.endpoints(k)[1]
            limit_receive(sub, links.max_frame_bytes)  # a slice's frames are parts of the model's chunks, none longer
            keep_alive(sub, bcast, links.link_heartbeat_period_s, links.link_silence_s)
            self.monitors[sub.get_monitor_socket(self._LINK_EVENTS)] = k
            sub.connect(bcast)

    def read(self, events: dict[Any, int], now: float) -> None:
        """Handle what the ready SUBs hold (a bounded batch each: the control socket must not wait), and what
        came of each host shard's connection."""
        for shard, sub in enumerate(self.sockets):
            if sub in events:
                drain(sub, lambda frames, k=shard: self._on_broadcast(k, frames), copy=False, budget=16)
        for monitor, shard in self.monitors.items():
            for event in monitor_events(monitor) if monitor in events else ():
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.silence.up(shard)
                elif event["event"] == zmq.EVENT_CONNECTED:
                    self.silence.connected(shard)
                else:
                    self.silence.down(shard, now)

    def lost(self, now: float) -> TrainingError | None:
        """The run's end when a host shard's link has been down past the silence limit (`SilentShards`), else None.
        Asked once the world formed: the first call starts the judging."""
        self.silence.judge_from(now)
        shard = self.silence.silent(now)
        if shard is None:
            return None
        limit = f"{self.silence.limit_s:g} s (--host-silence, FLODL_HOST_SILENCE)"
        what = (f"fell silent: the controller's link to that shard closed and was not made again within {limit}; find "
                "what stopped that relay or cut its host off" if shard in self.silence.reached else
                f"never answered the controller: its link to that shard's broadcast at {self.shards.endpoints(shard)[1]} "
                f"was not made within {limit} of the world's formation; check that the controller reaches that "
                "address (FLODL_SHARDS) through any firewall")
        return shard_lost(self.shards, self.shards.hosts[shard - 1][0], what)

    def stalled(self, reason: ShutdownReason) -> str:
        """What a run stopped by its reduce-stall ceiling adds to its error: the host shards whose slice of the
        oldest unfinished round never came while the controller's own reducer published its slice ("" otherwise:
        the controller's reducer waited too, so the round lacked hosts' frames, not a shard's work).

        Their links stayed up (a silent one ends the run sooner, `lost`): the relay's process answers on the
        wire while its shard finishes nothing, as when its threads hang.
        """
        if self.assembly is None or reason is not ShutdownReason.REDUCE_STALL or (waiting := self.assembly.waiting()) is None:
            return ""
        round_id, missing = waiting
        if 0 in missing:  # the controller's own reducer waited too
            return ""
        named = ", ".join(f"reducer shard {k} (the relay of host {self.shards.hosts[k - 1][0]})" for k in missing)
        return (f"; the controller has no slice of round {round_id} from {named}, though its own reducer published "
                "one: a relay whose link stays up while its shard finishes nothing (its threads hung?) holds every "
                "round; its host's relay log says why")

    def close(self) -> None:
        for sub in self.sockets[1:] if self.monitors else ():
            sub.disable_monitor()
        for sock in (*self.monitors, *self.sockets):
            sock.close(0)

    def _on_broadcast(self, shard: int, frames: list[Any]) -> None:
        try:
            env = self.codec.decode_from(frames, Channel.BROADCAST, from_reducer(shard), replay=False)
        except AttributionError as exc:
            self.counts["forged_route.bcast"] += 1
            log.warning("controller: dropped: %s", exc)
            return
        except WireError as exc:
            self.counts["rejected.bcast"] += 1
            log.warning("controller: rejected a broadcast record of shard %d: %s", shard, exc)
            return
        if not isinstance(env.record, rec.Consensus):
            return
        if self.assembly is None:
            self.keep(env.record, env.payload)
            return
        try:
            whole = self.assembly.add(shard, env.record.round, env.record.mass, env.payload)
        except ProtocolError as exc:  # a shard of another map or model: its slice is not ours to keep
            self.counts["rejected.bcast"] += 1
            log.warning("controller: %s", exc)
            return
        if whole is not None:
            self.keep(rec.Consensus(round=whole.round_id, mass=whole.mass), whole.payload)
