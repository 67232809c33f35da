"""The controller's copies of each consensus (flodl_zmq/controller_shards.py) over real sockets: its reducer's in
process, and in a sharded run each host shard's PUB over tcp, kept only once a round is whole."""

from __future__ import annotations

import collections
import math
import time

import numpy as np
import pytest
import zmq

from flodl_zmq.controller_shards import ConsensusCopies
from flodl_zmq.coordinator.liveness import ShutdownReason
from flodl_zmq.int8 import BLOCK
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import data_max_frame_bytes, reducer_sender
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.shards import Cut, ShardMap
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import Consensus, Probe

from .dataplane_helpers import WAIT_S

pytestmark = pytest.mark.timeout(60)

LOCAL = "inproc://test-reducer-bcast"


def links(key: bytes, incarnation: bytes) -> ReducerConfig:
    """The controller reducer's configuration, for its links' bounds and beats (ConsensusCopies.connect)."""
    return ReducerConfig({"a": (0,)}, key, incarnation, "inproc://unused", "inproc://unused-bcast",
                         max_frame_bytes=data_max_frame_bytes(1 << 20), link_heartbeat_period_s=1.0,
                         link_silence_s=8.0, route_secret=bytes(32))


class Rig:
    """Shard 0's PUB (in process, as the controller's reducer binds it), and `hosts` host shards' PUBs on tcp."""

    def __init__(self, hosts: int, silence_s: float = math.inf) -> None:
        self.ctx = zmq.Context()
        key, incarnation = new_key(), bytes(range(16))
        self.shards = ShardMap.parse(",".join(f"h{k}=tcp://127.0.0.1:{free_port_base()}" for k in range(hosts)))
        self.codecs = [Codec(key, incarnation, reducer_sender(k)) for k in range(self.shards.count)]  # each shard signs as itself
        self.pubs = [self.ctx.socket(zmq.PUB) for _ in range(self.shards.count)]
        for k, pub in enumerate(self.pubs):
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(LOCAL if k == 0 else self.shards.endpoints(k)[1])
        self.kept: list[tuple[Consensus, list[np.ndarray]]] = []
        self.counts: collections.Counter[str] = collections.Counter()
        # Two blocks of values a shard: every slice is one part of the model's one chunk.
        self.cut = None if hosts == 0 else Cut.of(self.shards, 2 * BLOCK * self.shards.count, 1)
        self.copies = ConsensusCopies(self.ctx, Codec(key, incarnation, "coordinator"),
                                      lambda r, p: self.kept.append((r, [np.array(f) for f in p])), self.counts,
                                      self.cut, silence_s)
        self.copies.connect(LOCAL, self.shards, links(key, incarnation))
        self.poller = zmq.Poller()
        for sock in self.copies.watched:
            self.poller.register(sock, zmq.POLLIN)
        for shard in range(self.shards.count):  # PUB drops what it sends before a subscription arrived
            self._until(lambda k=shard: self._heard(k))

    def _heard(self, shard: int) -> bool:
        """Publish a probe on `shard`'s PUB; True once its SUB got one (read, and ignored by the copies)."""
        self.pubs[shard].send_multipart(self.codecs[shard].encode(Probe(1), channel=Channel.BROADCAST))
        sub = self.copies.sockets[shard]
        if sub.poll(50):
            self.copies.read({sub: zmq.POLLIN}, time.monotonic())
            return True
        return False

    def _read(self) -> bool:
        self.copies.read(dict(self.poller.poll(50)), time.monotonic())
        return False

    @staticmethod
    def _until(pred) -> None:
        deadline = time.monotonic() + WAIT_S
        while not pred():
            assert time.monotonic() < deadline, "timed out"

    def slice(self, shard: int, value: float) -> list[np.ndarray]:
        """`shard`'s slice of a consensus holding `value` throughout (one shard: a frame of 4 values)."""
        lengths = [4] if self.cut is None else [len(part) for part in self.cut.parts[shard]]
        return [np.full(n, value, np.float32) for n in lengths]

    def publish(self, shard: int, round_id: int, mass: float, value: float,
                payload: list[np.ndarray] | None = None) -> None:
        payload = self.slice(shard, value) if payload is None else payload
        self.pubs[shard].send_multipart(self.codecs[shard].encode(Consensus(round_id, mass), payload,
                                                                channel=Channel.BROADCAST))

    def kept_rounds(self, n: int) -> list[tuple[int, float, list[float]]]:
        """Read until `n` consensus were kept: (round, mass, the value of each shard's slice in the kept model)."""
        self._until(lambda: self._read() or len(self.kept) >= n)
        out = []
        for r, payload in self.kept:
            flat = np.concatenate(payload)
            starts = [0] if self.cut is None else [parts[0].start for parts in self.cut.parts]
            out.append((r.round, r.mass, [float(flat[a]) for a in starts]))
        return out

    def close(self) -> None:
        self.copies.close()
        for pub in self.pubs:
            pub.close()
        self.ctx.term()


@pytest.fixture
def rig(request):
    r = Rig(request.param)
    yield r
    r.close()


@pytest.mark.parametrize("rig", [0], indirect=True)
def test_with_one_shard_each_consensus_of_the_reducer_is_kept_as_it_comes(rig):
    rig.publish(0, 1, 2.0, 1.0)
    rig.publish(0, 2, 2.0, 3.0)
    assert rig.kept_rounds(2) == [(1, 2.0, [1.0]), (2, 2.0, [3.0])]


@pytest.mark.parametrize("rig", [2], indirect=True)
def test_a_sharded_round_is_kept_whole_in_chunk_order_once_every_shard_published_its_slice(rig):
    # One chunk cut between 3 shards; the host shards' slices arrive first, over tcp.
    rig.publish(2, 1, 4.0, 3.0)
    rig.publish(1, 1, 4.0, 2.0)
    rig.publish(0, 1, 4.0, 1.0)
    assert rig.kept_rounds(1) == [(1, 4.0, [1.0, 2.0, 3.0])]
    assert [f.size for f in rig.kept[0][1]] == [6 * BLOCK]  # the model's one chunk, as a rank's payload has it


@pytest.mark.parametrize("rig", [2], indirect=True)
def test_a_reduce_stall_names_the_host_shard_whose_slice_never_came_where_the_controllers_reducer_published(rig):
    # The shard's relay kept its link up (a silent link ends the run sooner), so only the stall ends the run.
    rig.publish(0, 1, 2.0, 1.0)
    rig.publish(1, 1, 2.0, 1.0)
    rig.publish(2, 1, 2.0, 1.0)
    rig.publish(0, 2, 2.0, 2.0)
    rig.publish(1, 2, 2.0, 2.0)  # shard 2 (host h1's relay) sends nothing of round 2
    assert [r for r, _, _ in rig.kept_rounds(1)] == [1]
    rig._until(lambda: rig._read() or rig.copies.assembly.waiting() == (2, [2]))
    assert rig.copies.stalled(ShutdownReason.REDUCE_STALL) == (
        "; the controller has no slice of round 2 from reducer shard 2 (the relay of host h1), though its own reducer "
        "published one: a relay whose link stays up while its shard finishes nothing (its threads hung?) holds every "
        "round; its host's relay log says why")
    assert rig.copies.stalled(ShutdownReason.ALL_RANKS_LOST) == ""  # a round its dead ranks left unfinished


@pytest.mark.parametrize("rig", [1], indirect=True)
def test_a_reduce_stall_that_the_controllers_own_reducer_waited_for_too_names_no_shard(rig):
    rig.publish(1, 1, 2.0, 1.0)  # the host shard finished round 1; the controller's reducer did not
    rig._until(lambda: rig._read() or rig.copies.assembly.waiting() == (1, [0]))
    assert rig.copies.stalled(ShutdownReason.REDUCE_STALL) == ""


@pytest.mark.parametrize("rig", [1], indirect=True)
def test_a_round_whose_slice_the_controller_missed_is_not_kept_and_the_next_whole_one_is(rig):
    rig.publish(0, 1, 2.0, 1.0)
    rig.publish(1, 1, 2.0, 1.0)
    rig.publish(1, 2, 2.0, 2.0)  # shard 0's slice of round 2 never came (a PUB drop)
    rig.publish(0, 3, 2.0, 3.0)
    rig.publish(1, 3, 2.0, 3.0)
    assert [r for r, _, _ in rig.kept_rounds(2)] == [1, 3]  # the kept model stayed at round 1 until round 3


@pytest.mark.parametrize("rig", [1], indirect=True)
def test_a_slice_of_another_size_is_refused_and_counted_not_kept(rig):
    rig.publish(1, 1, 2.0, 1.0, [np.full(BLOCK, 1.0, np.float32)])  # half of shard 1's values: another map or model
    rig.publish(0, 2, 2.0, 1.0)
    rig.publish(1, 2, 2.0, 3.0)
    assert rig.kept_rounds(1) == [(2, 2.0, [1.0, 3.0])]
    assert rig.counts["rejected.bcast"] == 1


@pytest.mark.parametrize("rig", [1], indirect=True)
def test_a_slice_signed_as_another_shard_is_refused_each_shard_speaks_for_its_own_chunks(rig):
    # Shard 0's name on shard 1's PUB (a replayed or misdirected slice): attribution refuses it.
    rig.pubs[1].send_multipart(rig.codecs[0].encode(Consensus(1, 2.0), rig.slice(1, 9.0),
                                                    channel=Channel.BROADCAST))
    rig.publish(0, 1, 2.0, 1.0)
    rig.publish(1, 1, 2.0, 3.0)
    assert rig.kept_rounds(1) == [(1, 2.0, [1.0, 3.0])]
    assert rig.counts["forged_route.bcast"] == 1


def test_a_host_shards_pub_gone_past_the_silence_limit_ends_the_run_naming_it_and_one_back_in_time_does_not():
    rig = Rig(1, silence_s=30.0)
    try:
        endpoint = rig.shards.endpoints(1)[1]
        assert rig.copies.lost(time.monotonic()) is None  # the world formed: judged from here
        rig._until(lambda: rig._read() or rig.copies.silence.due_at() == math.inf)  # its handshake, seen
        rig.pubs[1].close()  # its relay gone from the link (stopped: heartbeats time out; here its socket closes)
        rig._until(lambda: rig._read() or rig.copies.silence.due_at() < math.inf)
        assert rig.copies.lost(rig.copies.silence.due_at() - 0.01) is None  # not yet past the limit
        rig.pubs[1] = rig.ctx.socket(zmq.PUB)
        rig.pubs[1].setsockopt(zmq.LINGER, 0)
        rig.pubs[1].bind(endpoint)  # back: the SUB re-dials and its handshake is made
        rig._until(lambda: rig._read() or rig.copies.silence.due_at() == math.inf)
        assert rig.copies.lost(time.monotonic() + 600.0) is None
        rig.pubs[1].close()
        rig._until(lambda: rig._read() or rig.copies.silence.due_at() < math.inf)
        error = rig.copies.lost(rig.copies.silence.due_at())
        assert error is not None and "reducer shard 1 ran in the relay of host h0, which fell silent" in str(error)
        assert "FLODL_HOST_SILENCE" in str(error)
    finally:
        rig.close()


def test_a_host_shards_pub_never_reached_ends_the_run_naming_its_address_once_the_world_formed():
    ctx = zmq.Context()
    key, incarnation = new_key(), bytes(16)
    shards = ShardMap.parse(f"h0=tcp://127.0.0.1:{free_port_base()}")  # nothing ever listens there
    unreached = ConsensusCopies(ctx, Codec(key, incarnation, "coordinator"), lambda r, p: None, collections.Counter(),
                                Cut.of(shards, 4 * BLOCK, 1), 30.0)
    unreached.connect("inproc://no-local-reducer", shards, links(key, incarnation))
    try:
        assert unreached.lost(100.0) is None  # the world formed at 100 s: judged from here
        error = unreached.lost(130.001)
        address = shards.endpoints(1)[1]
        assert error is not None and "reducer shard 1 ran in the relay of host h0, which never answered" in str(error)
        assert f"its link to that shard's broadcast at {address} was not made within 30 s" in str(error)
    finally:
        unreached.close()
        ctx.term()
