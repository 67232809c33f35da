"""The relay with same-host ranks that deposit and load by reference (shared memory)."""

from __future__ import annotations

import gc
import os
import time

import msgpack
import numpy as np
import pytest
import zmq

from flodl_zmq.wire import Channel, Codec
from flodl_zmq.wire.records import Consensus, ConsensusRequest, HostFrame, RoundFrame
from flodl_zmq.wire.shm import (
    Segment,
    SegmentMap,
    by_reference,
    host_owner,
    is_by_reference,
    rank_owner,
    run_dir,
)

from .dataplane_helpers import WAIT_S
from .test_relay import Rig

pytestmark = pytest.mark.timeout(60)


class SharedRank:
    """A FakeRank that deposits from its own segment and resolves consensus references."""

    def __init__(self, rig: Rig, rank: int):
        self.fake = rig.ranks[rank]
        self.rank = rank
        self.segment = Segment(rig.key, rig.run_id, rank_owner(rank))
        self.mapped = SegmentMap(rig.run_id, run_dir(rig.key, rig.run_id))
        self.decoder = Codec(rig.key, rig.run_id, "test")

    def place(self, tensors: list[np.ndarray]) -> list[np.ndarray]:
        views = self.segment.layout([t.nbytes for t in tensors])
        placed = [np.frombuffer(v, t.dtype).reshape(t.shape) for v, t in zip(views, tensors, strict=True)]
        for dst, src in zip(placed, tensors, strict=True):
            np.copyto(dst, src)
        return placed

    def deposit_message(self, round_id: int, mass: float, tensors: list[np.ndarray]) -> list:
        return by_reference(self.fake.codec, RoundFrame(round_id, self.rank, mass), self.place(tensors), self.segment)

    def consensus(self, host: str = "a"):
        if not self.fake.data.poll(int(WAIT_S * 1000)):
            raise TimeoutError(f"rank {self.rank}: no consensus")
        msg = self.fake.data.recv_multipart()
        shared = is_by_reference(msg)
        env = self.mapped.decode(self.decoder, msg, host_owner(host), Channel.BROADCAST, replay=False)
        assert isinstance(env.record, Consensus)
        return shared, env

    def close(self):
        self.segment.close()


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path, kind="ipc")
    shared = [SharedRank(r, 0), SharedRank(r, 1)]
    yield r, shared
    for s in shared:
        s.close()
    r.close()


def test_by_reference_deposits_fold_and_only_those_ranks_get_the_consensus_by_reference(rig):
    r, (s0, _) = rig
    r.subscribe()
    x0, x1 = np.arange(100, dtype=np.float32), np.full(100, 0.5, np.float32)
    s0.fake.data.send_multipart(s0.deposit_message(1, 2.0, [x0]))
    r.ranks[1].deposit(1, 3.0, [x1])  # rank 1 deposits frames: it stays on frames
    hf = r.ctl.data_record()
    assert isinstance(hf.record, HostFrame) and hf.record.mass == 5.0 and sorted(hf.record.ranks) == [0, 1]
    np.testing.assert_array_equal(hf.payload[0], x0 + x1)
    mean = (x0 + x1) / 5.0
    r.ctl.publish(1, 5.0, [mean])
    shared, env = s0.consensus()
    assert shared
    np.testing.assert_array_equal(env.payload[0], mean)
    plain = r.ranks[1].consensus()
    np.testing.assert_array_equal(plain.payload[0], mean)


def frames_of(nbytes: int) -> list[zmq.Frame]:
    """Every live ZeroMQ frame of `nbytes` bytes in this process."""
    gc.collect()
    # type(), not isinstance(): some of torch's module objects warn when their __class__ is read.
    return [f for f in gc.get_objects() if issubclass(type(f), zmq.Frame) and len(f) == nbytes]


def test_a_consensus_every_rank_takes_by_reference_is_not_kept_framed_and_a_resend_still_goes_by_reference(rig):
    # At 124M parameters the framed consensus is 0.5 GB: kept for nobody, it is one more copy of the
    # model in the relay while the next round's arrives (docs/benchmarks.md, bench/large.py).
    r, (s0, s1) = rig
    r.subscribe()
    n = 12_347  # a size no other frame of the test has
    x = np.arange(n, dtype=np.float32)
    s0.fake.data.send_multipart(s0.deposit_message(1, 1.0, [x]))
    s1.fake.data.send_multipart(s1.deposit_message(1, 1.0, [x]))
    assert isinstance(r.ctl.data_record().record, HostFrame)
    r.ctl.publish(1, 2.0, [x])
    assert s0.consensus()[0] and s1.consensus()[0]  # both by reference: delivered, and kept as `delivered`
    # The ranks hold their consensus while the relay's handler may still be on its way out (and the
    # broadcast's sender frees its frame on ZeroMQ's own thread): a frame dropped is gone soon, a kept one never.
    deadline = time.monotonic() + WAIT_S
    while frames_of(x.nbytes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert frames_of(x.nbytes) == [], "the relay still holds the framed consensus"
    s0.fake.data.send_multipart(s0.fake.codec.encode(ConsensusRequest(1), channel=Channel.DATA))
    shared, env = s0.consensus()
    assert shared
    np.testing.assert_array_equal(env.payload[0], x)


def test_a_relocated_reference_is_rejected_and_the_round_sums_the_honest_resend(rig):
    r, (s0, s1) = rig
    x0, x1 = np.arange(64, dtype=np.float32), np.ones(64, np.float32)
    msg = s0.deposit_message(1, 1.0, [x0])
    name, frames = msgpack.unpackb(msg[1])
    msg[1] = msgpack.packb([name, [[frames[0][0] + 64, frames[0][1]]]])  # points elsewhere after signing
    s0.fake.data.send_multipart(msg)
    s1.fake.data.send_multipart(s1.deposit_message(1, 1.0, [x1]))
    assert r.ctl.data.poll(300) == 0, "nothing may ship while rank 0's deposit is outstanding"
    assert r.relay.counters()["rejected.local_data"] == 1
    s0.fake.data.send_multipart(s0.deposit_message(1, 1.0, [x0]))  # honest, with a fresh sequence number
    hf = r.ctl.data_record()
    np.testing.assert_array_equal(hf.payload[0], x0 + x1)


def test_a_segment_other_users_may_write_is_refused(rig):
    r, (s0, _) = rig
    msg = s0.deposit_message(1, 1.0, [np.ones(16, np.float32)])
    os.chmod(os.path.join(s0.segment.directory, s0.segment.name), 0o666)
    s0.fake.data.send_multipart(msg)
    assert r.ctl.data.poll(300) == 0
    assert r.relay.counters()["rejected.local_data"] == 1
    assert r.relay.running


def test_a_reference_to_another_ranks_segment_is_rejected(rig):
    r, (s0, s1) = rig
    x = np.ones(16, np.float32)
    # Rank 1 signs a deposit whose payload it points at rank 0's segment.
    s1.fake.data.send_multipart(by_reference(s1.fake.codec, RoundFrame(1, 1, 1.0), s0.place([x]), s0.segment))
    assert r.ctl.data.poll(300) == 0
    assert r.relay.counters()["rejected.local_data"] == 1
    assert r.relay.running
