"""The reducer service against raw-socket relays: handshake, deaths, recovery, rejections."""

from __future__ import annotations

import logging
import queue
import time

import numpy as np
import pytest
import zmq

from flodl_zmq import int8
from flodl_zmq.links import TAG_BCAST, TAG_DATA, relay_sender
from flodl_zmq.mailbox import IDLE_S
from flodl_zmq.outer import OuterConfig, OuterOptimizer
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_messages import HostRefused, OuterSlice
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.wire import Channel, Codec, Envelope, new_key
from flodl_zmq.wire.records import (
    ConsensusGone,
    ConsensusRequest,
    FrameRequest,
    HostFrame,
    OuterState,
    Probe,
    RankExit,
    RelayDeclareDead,
    RelayHello,
    RelayHelloAck,
    ShardStart,
    SubscriberReady,
)
from flodl_zmq.wire.stream import RESEND_AFTER_S
from flodl_zmq.wire_format import BF16, F32, INT8

from .dataplane_helpers import ROUTE_SECRET, WAIT_S, endpoints, token

pytestmark = pytest.mark.timeout(60)

WORLD = {"a": (0, 1), "b": (2, 3)}


class FakeRelay:
    def __init__(self, ctx, host, key, run_id, eps):
        self.host = host
        self.codec = Codec(key, run_id, relay_sender(host))
        self.decoder = Codec(key, run_id, "test")
        self.data = ctx.socket(zmq.DEALER)
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        for s, ep in ((self.data, eps["data"]), (self.sub, eps["bcast"])):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)

    def send(self, rec, payload=()):
        frames = self.codec.encode(rec, payload, channel=Channel.DATA)
        self.data.send_multipart(frames)
        return frames

    def hello(self):
        self.send(RelayHello(self.host, list(WORLD[self.host]), [], token(self.host)))
        assert self.record().record == RelayHelloAck()

    def record(self, timeout=WAIT_S) -> Envelope:
        """Next message from the reducer on the data socket, decoded by its tag."""
        assert self.data.poll(int(timeout * 1000)), "reducer sent nothing"
        tag, *frames = self.data.recv_multipart()
        ch = {TAG_DATA: Channel.DATA, TAG_BCAST: Channel.BROADCAST}[tag]
        return self.decoder.decode(frames, ch, replay=False)

    def subscribe(self):
        for _ in range(100):
            if self.sub.poll(100):
                env = self.decoder.decode(self.sub.recv_multipart(), Channel.BROADCAST, replay=False)
                if isinstance(env.record, Probe):
                    self.send(SubscriberReady(self.host, env.record.nonce))
                    return
        raise TimeoutError("no probe seen")

    def broadcast(self, timeout=WAIT_S) -> Envelope:
        while True:
            assert self.sub.poll(int(timeout * 1000)), "nothing published"
            env = self.decoder.decode(self.sub.recv_multipart(), Channel.BROADCAST, replay=False)
            if not isinstance(env.record, Probe):
                return env

    def close(self):
        self.data.close(0)
        self.sub.close(0)


class Rig:
    def __init__(self, tmp_path, kind="inproc", outer=None, wire=F32, starts=None, **config):
        self.ctx = zmq.Context()
        self.key, self.run_id = new_key(), bytes(range(16))
        self.eps = eps = endpoints(kind, tmp_path)
        self.svc = ReducerService(
            ReducerConfig(WORLD, self.key, self.run_id, eps["data"], eps["bcast"], probe_interval_s=0.05, wire=wire,
                          route_secret=ROUTE_SECRET, **config),
            self.ctx, outer, starts=starts,
        )
        self.svc.start()
        self.relays = {h: FakeRelay(self.ctx, h, self.key, self.run_id, eps) for h in WORLD}

    def ready(self):
        for r in self.relays.values():
            r.hello()
        for r in self.relays.values():
            r.subscribe()
        assert _settle(lambda: self.svc.subscribed() == {"a", "b"})

    def close(self):
        for r in self.relays.values():
            r.close()
        self.svc.stop()
        self.ctx.destroy(0)


def _settle(pred, tries=500):
    import time

    for _ in range(tries):
        if pred():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture(params=["inproc", "ipc"])
def rig(request, tmp_path):
    r = Rig(tmp_path, request.param)
    yield r
    r.close()


def frame(host, round_id, mass, value, ranks=None):
    return HostFrame(round_id, host, list(ranks or WORLD[host]), mass), [np.full(8, value, np.float32)]


def test_a_hello_for_a_live_host_from_another_connection_is_refused_and_a_repeated_one_acknowledged_again(
        rig, caplog):
    a = rig.relays["a"]
    with caplog.at_level(logging.INFO, logger="flodl_zmq.reducer_service"):
        a.hello()
        a.hello()  # the same identity again (a re-hello after a reconnect): acknowledged again, nothing changes
    # Said once: a flapping link's repeated hellos logged "registered" four times in a row.
    assert caplog.text.count("reducer: relay a registered with ranks") == 1
    intruder = FakeRelay(rig.ctx, "a", rig.key, rig.run_id, rig.eps)
    for _ in range(10):  # past a's sequence numbers: the refusal must be the route rule, not the replay check
        intruder.codec.encode(RelayHelloAck(), channel=Channel.DATA)
    try:
        intruder.send(RelayHello("a", list(WORLD["a"]), [], token("a")))
        assert not intruder.data.poll(300), "a second connection took a live host's route"
        assert _settle(lambda: rig.svc.counters().get("bad_hello") == 1), rig.svc.counters()
        # Once the registered relay is gone, a new incarnation may take the host.
        a.close()
        for _ in range(50):
            intruder.send(RelayHello("a", list(WORLD["a"]), [], token("a")))
            if intruder.data.poll(100):
                break
        assert intruder.record().record == RelayHelloAck()
    finally:
        intruder.close()


def test_a_relay_is_counted_only_after_answering_a_probe_and_is_served_directly_until_then(rig):
    a, b = rig.relays["a"], rig.relays["b"]
    a.hello()
    b.hello()
    a.subscribe()
    assert _settle(lambda: rig.svc.subscribed() == {"a"})
    a.send(*frame("a", 1, 1.0, 2.0))
    b.send(*frame("b", 1, 3.0, 6.0))
    assert np.allclose(a.broadcast().payload[0], 2.0)
    direct = b.record()  # b never answered a probe: PUB may not reach it
    assert direct.kind == "data.consensus" and np.allclose(direct.payload[0], 2.0)
    assert rig.svc.completed.get(timeout=WAIT_S).hosts == ("a", "b")


def test_each_death_is_forwarded_to_its_relay_once_at_once(rig):
    rig.svc.declare_dead(3)  # before b registered: forwarded on registration
    a, b = rig.relays["a"], rig.relays["b"]
    a.hello()
    b.send(RelayHello("b", [2, 3], [], token("b")))
    assert b.record().record == RelayHelloAck()
    assert b.record().record == RelayDeclareDead(3)
    rig.svc.declare_dead(0)
    rig.svc.declare_dead(0)
    rig.svc.declare_dead(3)
    assert a.record().record == RelayDeclareDead(0)
    a.send(RankExit(1))  # reported by the relay itself: not echoed back
    assert not a.data.poll(300) and not b.data.poll(100)  # (restatements come a resend period later)


def test_a_forwarded_death_is_restated_so_a_lost_one_does_not_wait_for_the_relays_deadline(rig):
    rig.ready()
    a = rig.relays["a"]
    rig.svc.declare_dead(0)
    assert a.record().record == RelayDeclareDead(0)  # say this one is lost in a reset
    # Restated a resend period later (PROTOCOL.md 10.7 item 8): the relay learns of it all the same.
    assert a.record(timeout=RESEND_AFTER_S + WAIT_S).record == RelayDeclareDead(0)
    assert rig.svc.counters()["restated_deaths"] >= 1


@pytest.fixture
def sharded(tmp_path):
    """A controller's reducer whose run has a shard on host b (ReducerConfig.shard_hosts)."""
    r = Rig(tmp_path, shard_hosts=("b",))
    yield r
    r.close()


def test_every_death_also_reaches_each_shard_hosts_relay_once_and_is_restated(sharded):
    # b's shard reduces a slice of a's frames too: a round of it waiting on a dead rank's host would hang.
    a, b = sharded.relays["a"], sharded.relays["b"]
    a.hello()
    b.hello()
    sharded.svc.declare_dead(0)
    assert a.record().record == RelayDeclareDead(0)  # its owner, as in any run
    assert b.record().record == RelayDeclareDead(0)  # the shard host
    a.send(RankExit(1))  # its own relay reported it: not echoed back, but the shard host must hear it
    assert b.record().record == RelayDeclareDead(1)
    sharded.svc.declare_dead(2)  # the shard host's own rank: told once, as its owner
    assert b.record().record == RelayDeclareDead(2)
    assert not a.data.poll(300) and not b.data.poll(100)  # (restatements come a resend period later)
    assert a.record(timeout=RESEND_AFTER_S + WAIT_S).record == RelayDeclareDead(0)
    assert sorted(b.record().record.rank for _ in range(3)) == [0, 1, 2]


def test_a_shard_host_that_registers_after_a_death_hears_of_it_at_the_next_restatement(sharded):
    a, b = sharded.relays["a"], sharded.relays["b"]
    a.hello()
    sharded.svc.declare_dead(0)
    assert a.record().record == RelayDeclareDead(0)
    b.hello()
    assert b.record(timeout=RESEND_AFTER_S + WAIT_S).record == RelayDeclareDead(0)


def test_a_shard_hosts_relay_gets_its_start_at_its_first_hello_and_again_only_a_while_later(tmp_path):
    # Hellos a relay repeated while the controller was not up arrive at once: each must not bring the (model-
    # sized) start again; one that still comes RESEND_AFTER_S later does, as its start may have been lost.
    start = (ShardStart(1, "none", 0.0, 0.0, 0), [])
    rig = Rig(tmp_path, starts={"b": start}, shard_hosts=("b",))
    try:
        b = rig.relays["b"]
        b.send(RelayHello("b", list(WORLD["b"]), [], token("b")))
        assert [b.record().record for _ in range(2)] == [start[0], RelayHelloAck()]
        for _ in range(3):
            b.send(RelayHello("b", list(WORLD["b"]), [], token("b")))
            assert b.record().record == RelayHelloAck()
        time.sleep(RESEND_AFTER_S)
        b.send(RelayHello("b", list(WORLD["b"]), [], token("b")))
        assert [b.record().record for _ in range(2)] == [start[0], RelayHelloAck()]
        rig.relays["a"].hello()  # a host that runs no shard gets no start
    finally:
        rig.close()


def test_an_outer_state_is_taken_only_from_the_relay_of_the_shard_it_names(sharded):
    a, b = sharded.relays["a"], sharded.relays["b"]
    a.hello()
    b.hello()
    state = [np.zeros(4, np.float32), np.ones(4, np.float32)]
    a.send(OuterState(1, 5), state)  # shard 1 is b's: a relay speaks for its own shard only
    b.send(OuterState(1, 6), state)
    out = sharded.svc.completed.get(timeout=WAIT_S)
    assert isinstance(out, OuterSlice) and (out.shard, out.round_id) == (1, 6)
    np.testing.assert_array_equal(out.payload[1], state[1])
    assert sharded.svc.counters()["forged_sender"] == 1


def test_a_command_wakes_the_idle_service_at_once_not_after_a_poll_tick(rig):
    rig.ready()  # every relay subscribed: no probe due, the loop sleeps until told something
    a = rig.relays["a"]
    time.sleep(0.2)  # let it fall asleep in poll
    t0 = time.perf_counter()
    rig.svc.declare_dead(0)
    assert a.record().record == RelayDeclareDead(0)
    assert time.perf_counter() - t0 < IDLE_S / 2, "the command must wake the loop, not its idle bound"


def test_late_corrupt_forged_and_replayed_frames_are_rejected_and_the_round_is_right(rig):
    rig.ready()
    a, b = rig.relays["a"], rig.relays["b"]
    rec, t = frame("a", 1, 1.0, 2.0)
    genuine = a.codec.encode(rec, t, channel=Channel.DATA)
    bad = [bytes(f) for f in genuine]
    bad[1] = bytes(8) + bad[1][8:]
    a.data.send_multipart(bad)  # corrupt payload
    b.data.send_multipart(Codec(new_key(), rig.run_id, "relay:b").encode(*frame("b", 1, 9.0, 99.0),
                                                                        channel=Channel.DATA))  # wrong key
    b.data.send_multipart(Codec(rig.key, rig.run_id, "relay:a").encode(*frame("a", 1, 9.0, 99.0),
                                                                      channel=Channel.DATA))  # b as a
    a.data.send_multipart(genuine)
    a.data.send_multipart(genuine)  # replay
    b.send(*frame("b", 1, 3.0, 6.0))
    env = a.broadcast()
    assert env.record.round == 1 and env.record.mass == 4.0
    assert np.allclose(env.payload[0], (2.0 + 6.0) / 4.0)
    a.send(*frame("a", 1, 1.0, 2.0))  # late: round 1 is finished
    assert _settle(lambda: rig.svc.counters().get("late_frames") == 1)
    c = rig.svc.counters()
    assert c["rejected"] == 3 and c["forged_sender"] == 1 and c["rounds_reduced"] == 1


def test_the_latest_consensus_is_resent_on_request_and_older_ones_are_gone(rig):
    rig.ready()
    a, b = rig.relays["a"], rig.relays["b"]
    for round_id in (1, 2):
        rig.svc.drop_broadcast(2)
        a.send(*frame("a", round_id, 1.0, round_id))
        b.send(*frame("b", round_id, 1.0, round_id))
        rig.svc.completed.get(timeout=WAIT_S)
    assert a.broadcast().record.round == 1
    assert not a.sub.poll(200) or isinstance(a.broadcast(0.2).record, Probe)
    a.send(ConsensusRequest(2))
    got = a.record()
    assert got.record.round == 2 and np.allclose(got.payload[0], 2.0)
    a.send(ConsensusRequest(1))
    assert a.record().record == ConsensusGone(1, 2)
    a.send(*frame("a", 3, 1.0, 3.0))
    a.send(ConsensusRequest(3))  # not reduced yet (b's frame is missing): no answer, the broadcast will come
    assert not a.data.poll(200)


def test_a_desynced_relay_is_declared_dead_and_the_round_completes_without_it(rig):
    rig.ready()
    a, b = rig.relays["a"], rig.relays["b"]
    a.send(*frame("a", 1, 1.0, 2.0))
    a.send(*frame("a", 1, 5.0, 9.0))  # a resend that crossed the original: counted once
    a.send(*frame("a", 2, 1.0, 2.0))  # a round ahead of the open one: a protocol violation
    assert a.record().record == RelayDeclareDead(0)
    assert a.record().record == RelayDeclareDead(1)
    refused = rig.svc.completed.get(timeout=WAIT_S)  # the coordinator hears it at once, not from a's relay
    assert isinstance(refused, HostRefused) and (refused.host, refused.ranks) == ("a", (0, 1))
    assert "round 2" in refused.reason
    with pytest.raises(queue.Empty):
        rig.svc.completed.get(timeout=0.2)
    b.send(*frame("b", 1, 2.0, 4.0))
    out = rig.svc.completed.get(timeout=WAIT_S)
    # The ledger summed a's first (valid) frame; the copy and the desynced one never counted.
    assert out.hosts == ("a", "b") and out.mass == 3.0
    counters = rig.svc.counters()
    assert counters["protocol_violations"] == 1 and counters["duplicate_frames"] == 1


def test_a_reducer_told_the_wire_format_refuses_a_host_frame_of_another_by_name_at_the_first(tmp_path, caplog):
    rig = Rig(tmp_path, wire=BF16)
    try:
        rig.ready()
        a, b = rig.relays["a"], rig.relays["b"]
        a.send(*frame("a", 1, 1.0, 2.0))  # f32: the run's wire_dtype is bf16
        assert a.record().record == RelayDeclareDead(0)
        assert a.record().record == RelayDeclareDead(1)
        assert rig.svc.counters()["protocol_violations"] == 1
        assert "host 'a' is f32, but the run's wire_dtype is bf16" in caplog.text
        refused = rig.svc.completed.get(timeout=WAIT_S)
        assert isinstance(refused, HostRefused) and "wire_dtype is bf16" in refused.reason
        b.send(HostFrame(1, "b", list(WORLD["b"]), 2.0), [np.full(8, 0x4080, np.uint16)])  # 4.0 in bf16
        out = rig.svc.completed.get(timeout=WAIT_S)
        assert out.hosts == ("b",) and out.mass == 2.0
    finally:
        rig.close()


def test_a_host_frame_never_received_is_asked_for_when_its_relay_asks_for_the_consensus(rig):
    rig.ready()
    a, b = rig.relays["a"], rig.relays["b"]
    b.send(*frame("b", 1, 2.0, 4.0))
    a.send(ConsensusRequest(1))  # a's frame of round 1 was lost in a reset
    assert a.record().record == FrameRequest(1)
    b.send(ConsensusRequest(1))  # b's frame is here: the round is just not finished
    assert not b.data.poll(200)
    a.send(*frame("a", 1, 1.0, 2.0))
    out = rig.svc.completed.get(timeout=WAIT_S)
    assert out.hosts == ("a", "b") and out.mass == 3.0
    a.send(*frame("a", 1, 1.0, 2.0))  # a second resend arriving after the round closed: late
    assert _settle(lambda: rig.svc.counters()["late_frames"] == 1) and rig.svc.counters()["frame_requests"] == 1


def test_a_hello_that_disagrees_with_the_world_is_refused(rig):
    a = rig.relays["a"]
    a.send(RelayHello("a", [0, 1, 2], [], token("a")))
    assert not a.data.poll(200)
    assert rig.svc.counters()["bad_hello"] == 1


def test_an_int8_consensus_after_an_outer_step_is_where_the_next_pseudo_gradient_starts(tmp_path):
    # The ranks load the int8 consensus widened; the outer step must measure the next round from
    # exactly that, not from its own unrounded global model.
    n = int8.BLOCK + 5
    outer = OuterOptimizer(OuterConfig("nesterov", 0.7, 0.9), np.zeros(n, np.float32))
    rig = Rig(tmp_path, outer=outer, wire=INT8)
    try:
        rig.ready()
        encoders = {h: int8.PayloadEncoder() for h in WORLD}
        rng = np.random.default_rng(5)
        for round_id in (1, 2, 3):
            for h, relay in rig.relays.items():
                relay.send(HostFrame(round_id, h, list(WORLD[h]), 1.0),
                           encoders[h].encode([rng.standard_normal(n).astype(np.float32)]))
            env = rig.relays["a"].broadcast()
            assert env.record.round == round_id and int8.is_int8(env.payload)
            loaded = int8.widen(env.payload, [np.empty(n, np.float32)])[0]
            assert _settle(lambda loaded=loaded: np.array_equal(outer.base, loaded))
            assert not np.array_equal(outer.global_model, loaded)  # the kept global is the unrounded one
    finally:
        rig.close()


def test_a_frame_over_its_mass_bound_waits_for_the_bound_to_rise_and_is_taken_when_it_does(rig):
    # An async rank trains on past the trigger: the coordinator had counted none of its steps (a bound of 64),
    # and hears them with its snapshot, on the control path, while its frame travels the data path. Refused at
    # once, an honest host was declared dead (3 of 4 runs of a 2-agent MLP beside two busy loops).
    rig.ready()
    a, b = rig.relays["a"], rig.relays["b"]
    rig.svc.bound_round(1, {0: 64.0, 1: 64.0, 2: 64.0})
    a.send(*frame("a", 1, 150.0, 2.0))  # over a's bound of 128
    b.send(*frame("b", 1, 10.0, 4.0))
    with pytest.raises(queue.Empty):
        rig.svc.completed.get(timeout=0.3)  # held, neither refused nor summed
    rig.svc.bound_round(1, {0: 2 * 60 + 64.0})  # rank 0's snapshot: its bound rises to what it did
    out = rig.svc.completed.get(timeout=WAIT_S)
    assert not isinstance(out, HostRefused) and out.hosts == ("a", "b") and out.mass == 160.0
    assert rig.svc.counters().get("poisoned_frames", 0) == 0


def test_a_published_consensus_is_not_overwritten_by_the_next_round_before_a_subscriber_reads_it(rig):
    """The controller's own copy comes over inproc, by reference: the next round's reduce must not write
    into what a subscriber has not read yet (nor into what the PUB is still sending to a relay)."""
    rig.ready()
    a, b = rig.relays["a"], rig.relays["b"]
    n = 1 << 16  # 256 kB a frame: sent without a copy (pyzmq copies frames under 64 kB)
    for round_id, value in ((1, 2.0), (2, 5.0)):
        for relay in (a, b):
            relay.send(HostFrame(round_id, relay.host, list(WORLD[relay.host]), 1.0), [np.full(n, value, np.float32)])
        assert rig.svc.completed.get(timeout=WAIT_S).round_id == round_id  # published, not yet read by a
    first, second = a.broadcast(), a.broadcast()  # a WireError (MAC) when the bytes under round 1 changed
    assert (first.record.round, second.record.round) == (1, 2)
    assert np.all(first.payload[0] == 2.0) and np.all(second.payload[0] == 5.0)
