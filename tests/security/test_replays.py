"""Replays over real sockets: genuine messages recorded from a run and sent again are refused and counted.

The attacker sits on the path and holds no key: it records what a genuine
run sends and sends it again later. A consensus rides the broadcast channel,
which waives the sequence check (a resend is byte-identical), so the round
id is its guard (PROTOCOL.md 5.1, 5.2); a control record is refused by its
sequence number. Either way the run goes on as if nothing was sent. (A
relay refusing replayed coordinator records and broadcasts from a scripted
controller: tests/transport/test_relay.py. The controller's own consensus
copy comes from its reducer in process, with no path to replay on.)
"""

from __future__ import annotations

import queue
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from transport.dataplane_helpers import (
    ROUTE_SECRET,
    WAIT_S,
    FakeRank,
    endpoints,
    model,
    reference,
    rel_error,
    to_wire,
)
from transport.test_controller import rig  # noqa: F401  (the fixture: a real controller, a scripted relay)
from transport.test_rank_link import link  # noqa: F401  (the fixture: a rank's real link, its relay's sockets)

from flodl_zmq.coordinator.liveness import RankState
from flodl_zmq.links import coordinator_sender, host_token, rank_identity
from flodl_zmq.rank_link import FromCoordinator
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.records import Consensus

pytestmark = pytest.mark.timeout(60)

MASS = {0: 1.0, 1: 3.0}


class OnPath:
    """A forwarder between the reducer's PUB and a relay's SUB that records every message and can inject.

    It stands where an attacker on the network stands: it sees and repeats
    frames, and it holds no key.
    """

    def __init__(self, ctx: zmq.Context, upstream: str, downstream: str):
        self.recorded: list[list[bytes]] = []
        self._inject: queue.Queue[list[bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._xsub, self._xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
        for s in (self._xsub, self._xpub):
            s.setsockopt(zmq.LINGER, 0)
        self._xpub.bind(downstream)
        self._xsub.connect(upstream)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def inject(self, frames: list[bytes]) -> None:
        self._inject.put(frames)

    def consensus(self, round_id: int) -> list[bytes]:
        """The recorded broadcast of `round_id`'s consensus (what the genuine reducer published)."""
        for frames in list(self.recorded):
            head = msgpack.unpackb(frames[0])  # headers are not secret: the MAC authenticates, it does not hide
            if head["k"] == Consensus.KIND and head["f"]["round"] == round_id:
                return frames
        raise AssertionError(f"no consensus of round {round_id} went by")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xsub, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(10))
            if self._xpub in events:
                self._xsub.send_multipart(self._xpub.recv_multipart())  # subscriptions go up
            if self._xsub in events:
                frames = self._xsub.recv_multipart()
                self.recorded.append(frames)
                self._xpub.send_multipart(frames)
            while not self._inject.empty():
                self._xpub.send_multipart(self._inject.get())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._xsub.close(0)
        self._xpub.close(0)


def test_a_recorded_consensus_replayed_rounds_later_is_refused_and_the_ranks_train_on(tmp_path):
    ctx = zmq.Context()
    key, run_id = new_key(), bytes(range(16))
    eps = endpoints("ipc", tmp_path)
    tapped = f"ipc://{tmp_path}/tapped-bcast"
    reducer = ReducerService(ReducerConfig({"a": (0, 1)}, key, run_id, eps["data"], eps["bcast"],
                                           probe_interval_s=0.05, route_secret=ROUTE_SECRET), ctx)
    reducer.start()
    path = OnPath(ctx, eps["bcast"], tapped)
    relay = Relay(RelayConfig("a", (0, 1), key, run_id, eps["control"], eps["data"], tapped, eps["a-control"],
                              eps["a-data"], rank_silence_at_relay_s=30.0,
                              host_token=host_token(ROUTE_SECRET, "a")), ctx)
    relay.start()
    ranks = {r: FakeRank(ctx, r, key, run_id, eps["a-control"], eps["a-data"]) for r in (0, 1)}

    def play(round_id: int) -> None:
        for r, rank in ranks.items():
            rank.deposit(round_id, MASS[r], to_wire(model(r, round_id), MASS[r], "f32"))
        want = reference([(model(r, round_id), MASS[r]) for r in ranks], "f32")
        for rank in ranks.values():
            env = rank.consensus()
            assert env.record.round == round_id
            assert rel_error([p.astype(np.float64) for p in env.payload], want) < 1e-6

    try:
        play(1)
        play(2)
        for old in (1, 2):  # an older round, and the round just delivered
            path.inject(path.consensus(old))
        for rank in ranks.values():
            assert rank.nothing_within(0.5), "a replayed consensus reached a rank"
        deadline = time.monotonic() + WAIT_S
        while relay.counters().get("stale_consensus.bcast", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        # Both replays counted (a genuine resend the round's recovery asked for may add to them).
        assert relay.counters()["stale_consensus.bcast"] >= 2
        assert relay.running
        play(3)  # the ranks train on: the next round is averaged and delivered as usual
    finally:
        for rank in ranks.values():
            rank.close()
        relay.stop()
        path.close()
        reducer.stop()
        ctx.destroy(0)


def test_a_recorded_rank_control_record_replayed_to_the_controller_is_refused_and_the_rank_stays_live(rig):  # noqa: F811
    service, relay, thread, outcome = rig
    relay.hello(0)
    relay.hello(1)
    relay.wait_for(rank_identity(1), "StartEpoch")
    # What went over the wire for rank 0: recorded by someone on the path between relay and controller.
    recorded = relay.ranks[0].encode(rec.Heartbeat(rank=0, step_count=3), channel=Channel.CONTROL)
    relay.sock.send_multipart([rank_identity(0), *recorded])
    before = service.counts.get("duplicate.control", 0)
    for _ in range(3):
        relay.sock.send_multipart([rank_identity(0), *recorded])
    deadline = time.monotonic() + WAIT_S
    while service.counts.get("duplicate.control", 0) < before + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.counts["duplicate.control"] == before + 3  # refused by the window, as a resend would be
    assert thread.is_alive() and "error" not in outcome
    assert 0 not in service.deaths, "a replay must not cost the honest rank its place"
    assert service.core.liveness.state(0) is RankState.LIVE
    # The honest rank's next record is still accepted: the replays never moved its ledger.
    relay.send(0, rec.Exiting(rank=0))
    deadline = time.monotonic() + WAIT_S
    while service.core.liveness.state(0) is RankState.LIVE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.core.liveness.state(0) is RankState.EXITED
    assert service.counts["duplicate.control"] == before + 3


def test_a_recorded_coordinator_record_replayed_to_a_rank_never_reaches_its_training(link):  # noqa: F811
    lk, control, _data, key, run_id = link
    recorded = Codec(key, run_id, coordinator_sender(0)).encode(rec.SetGlobalStep(global_step=7))
    for _ in range(3):  # once genuine, then twice replayed by someone on the relay's path
        control.send_multipart([rank_identity(0), *recorded])
    assert lk.inbox.get(timeout=WAIT_S) == FromCoordinator(rec.SetGlobalStep(global_step=7))
    with pytest.raises(queue.Empty):
        lk.inbox.get(timeout=0.3)
    assert lk.duplicates == 2 and lk.rejected == 0  # refused by the window (a resend looks the same)
