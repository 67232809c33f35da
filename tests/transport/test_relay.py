"""The relay against a raw-socket controller: routing, liveness, fold, fan-out, recovery, rejections."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import pytest
import zmq

from flodl_zmq.links import RELAY_ROUTE, rank_identity
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.relay_core import ConsensusWatch, Departures, HelloRetry, RankLiveness, SendQueue
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import (
    RESUME_ROUND,
    Batch,
    ConsensusRequest,
    CoordHeartbeat,
    Heartbeat,
    HostFrame,
    HostReports,
    LrUpdate,
    Probe,
    RankExit,
    RelayDeclareDead,
    RelayHello,
    RoundFrame,
    SubscriberReady,
)
from flodl_zmq.wire_format import BF16, INT8

from .dataplane_helpers import WAIT_S, FakeController, FakeRank, endpoints, token

pytestmark = pytest.mark.timeout(60)


class Rig:
    def __init__(self, tmp_path, kind="inproc", reducer_rcvhwm=1000, **timing):
        self.ctx = zmq.Context()
        self.key, self.run_id = new_key(), bytes(16)
        eps = endpoints(kind, tmp_path)
        self.ctl = FakeController(self.ctx, self.key, self.run_id, eps, data_rcvhwm=reducer_rcvhwm)
        timing.setdefault("rank_silence_at_relay_s", 30.0)
        timing.setdefault("consensus_wait_at_relay_s", 30.0)
        self.cfg = RelayConfig("a", (0, 1), self.key, self.run_id, eps["control"], eps["data"], eps["bcast"],
                               eps["a-control"], eps["a-data"], host_token=token("a"), **timing)
        self.relay = Relay(self.cfg, self.ctx)
        self.relay.start()
        self.ranks = [FakeRank(self.ctx, r, self.key, self.run_id, eps["a-control"], eps["a-data"]) for r in (0, 1)]
        self.eps = eps
        hello = self.ctl.data_record()
        assert isinstance(hello.record, RelayHello) and hello.record.ranks == [0, 1]
        route, hello = self.ctl.control_message()
        assert route == RELAY_ROUTE and isinstance(hello.record, RelayHello)

    def subscribe(self):
        """Publish probes until the relay answers: its SUB is then proven to receive."""
        for nonce in range(1, 200):
            self.ctl.pub.send_multipart(self.ctl.codec.encode(Probe(nonce), channel=Channel.BROADCAST))
            if self.ctl.data.poll(50):
                env = self.ctl.data_record(skip=())
                assert isinstance(env.record, SubscriberReady) and env.record.host == "a"
                return
        raise TimeoutError("relay never answered a probe")

    def rogue(self, rank: int, key: bytes | None = None, endpoint: str = "a-data") -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, rank_identity(rank))
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.eps[endpoint])
        return s

    def close(self):
        for r in self.ranks:
            r.close()
        self.relay.stop()
        self.ctl.close()
        self.ctx.destroy(0)


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def settle(pred, timeout=WAIT_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def corrupt(frames, index=1):
    out = [bytes(f) for f in frames]
    b = bytearray(out[index])
    b[len(b) // 2] ^= 0x40
    out[index] = bytes(b)
    return out


# ---------------------------------------------------------------------- pure helpers


def test_liveness_gives_a_silent_rank_its_deadline_and_a_quiet_newcomer_longer():
    live = RankLiveness([0, 1, 2], start=0.0, heartbeat_deadline=1.5, first_contact_deadline=10.0)
    live.seen(0, 1.0)
    live.seen(1, 1.0)
    assert live.expired(2.4) == []
    live.seen(1, 2.4)
    assert live.expired(2.6) == [0]
    assert live.expired(9.0) == [1]
    assert live.expired(10.1) == [2]
    assert live.leave(2) is False  # death is permanent and reported once


def test_liveness_does_not_count_the_relays_own_stall_as_its_ranks_silence():
    live = RankLiveness([0, 1], start=0.0, heartbeat_deadline=1.5, first_contact_deadline=10.0)
    live.seen(0, 1.0)
    live.stalled(3.0)  # stopped from 1.2 to 4.2: nothing the ranks sent could be read
    assert live.expired(4.3) == []
    assert live.expired(5.6) == [0]  # 1.5 s of silence heard after the stall
    assert live.expired(13.1) == [1]  # its first contact's 10 s, stall excluded


def test_liveness_is_next_due_at_the_first_silent_ranks_deadline_stall_excluded():
    live = RankLiveness([0, 1], start=0.0, heartbeat_deadline=1.5, first_contact_deadline=10.0)
    assert live.next_due() == 10.0  # nobody spoke yet: first contact
    live.seen(0, 0.5)
    assert live.next_due() == 2.0
    live.stalled(3.0)  # the service loop saw this process stall (tests/transport/test_service_loop.py)
    assert live.next_due() == 5.0
    assert live.expired(5.0) == []
    assert live.expired(5.1) == [0]
    assert live.next_due() == 13.0


def test_departures_are_restated_together_every_resend_period_for_the_rest_of_the_run():
    gone = Departures()
    assert gone.due(100.0) == []
    assert gone.due_at == math.inf
    gone.add(3, 0.0)
    gone.add(1, 1.0)
    assert gone.due_at == 2.0  # the service loop wakes then
    assert gone.due(1.9) == []
    assert gone.due(2.0) == [3, 1]
    assert gone.due_at == 4.0
    assert gone.due(3.9) == []
    assert gone.due(4.0) == [3, 1]


def test_consensus_watch_asks_for_overtaken_and_silent_rounds_and_refuses_replays():
    w = ConsensusWatch(deadline=1.0)
    assert w.next_due() == math.inf
    w.shipped(1, 0.0)
    w.shipped(2, 0.5)
    assert w.next_due() == 1.0  # the service loop wakes then
    assert w.accept(2, 0.6) == (True, [1])
    assert w.next_due() == pytest.approx(2.6)
    assert w.due(1.7) == []  # the overtaken round was just asked for at 0.6: its next wait is 2 s
    assert w.due(2.7) == [1]
    assert w.accept(1, 2.8) == (True, [])
    assert w.accept(1, 2.9) == (False, [])  # a replay of a delivered round
    assert w.accept(2, 2.9) == (False, [])


def test_a_round_its_shard_says_is_gone_is_asked_for_no_more_not_at_its_wait_nor_when_overtaken_nor_on_reconnect():
    # A relay stopped past the run's limits came back having missed round 1: asked again at every later consensus,
    # each answer an error logged at the shard and at the relay, for the rest of the run.
    w = ConsensusWatch(deadline=1.0)
    w.shipped(1, 0.0)
    w.shipped(2, 0.5)
    assert w.accept(3, 0.6) == (True, [1, 2])
    w.gone(1)
    assert w.pending == [2]
    assert w.accept(4, 0.7) == (True, [2])
    assert w.reconnected(0.8) == [2]
    assert w.due(100.0) == [2]


def test_a_hello_is_due_at_once_then_every_retry_until_acknowledged():
    hello = HelloRetry(retry_s=1.0)
    assert hello.next_due() == 0.0 and hello.due(5.0)
    assert hello.next_due() == 6.0 and not hello.due(5.9)
    hello.acked()
    assert hello.next_due() == math.inf and not hello.due(100.0)


def test_consensus_watch_backs_off_so_a_slow_link_is_not_filled_with_copies_of_one_consensus():
    # At 20 Mbit/s a 10 MB consensus takes 4 s to arrive: asking every 2 s put a new copy on the link each time.
    w = ConsensusWatch(deadline=2.0)
    w.shipped(1, 0.0)
    asked = [t / 10 for t in range(0, 1000) if w.due(t / 10)]
    assert asked[:4] == [2.1, 6.2, 14.3, 30.4]  # waits of 2, 4, 8, 16 s
    assert [round(b - a, 1) for a, b in zip(asked[3:-1], asked[4:], strict=True)] == [16.1] * (len(asked) - 4)  # capped
    assert w.accept(1, 100.0) == (True, [])


def test_consensus_watch_waits_twice_the_last_rounds_latency_before_asking_so_a_large_model_is_not_asked_again():
    # A 124M-parameter consensus took ~7 s to arrive on a loaded machine: asked for at 2, 6 and 14 s, each
    # answer one more 0.5 GB message on the link and in the relay (docs/benchmarks.md, bench/large.py).
    w = ConsensusWatch(deadline=2.0)
    w.shipped(1, 0.0)
    assert w.due(2.1) == [1]  # the first round knows no better than the deadline
    assert w.accept(1, 7.0) == (True, [])
    w.shipped(2, 10.0)
    assert w.due(23.9) == []  # 2 x 7 s
    assert w.accept(2, 16.0) == (True, [])  # 6 s: no request went
    w.shipped(3, 20.0)
    assert w.next_due() == pytest.approx(32.0)
    assert w.due(32.1) == [3]  # a consensus lost is still asked for, after 2 x 6 s


def test_consensus_watch_waits_past_eight_deadlines_when_the_link_showed_a_round_takes_longer():
    # One reducer, 4 hosts x 100M parameters at 1 Gbit/s: a round's consensus came 25 s after the host
    # frame went up, past 8 deadlines (16 s), and every relay asked for it again on the saturated link.
    w = ConsensusWatch(deadline=2.0)
    w.shipped(1, 0.0)
    w.accept(1, 25.0)
    w.shipped(2, 30.0)
    assert w.due(79.9) == []  # 2 x 25 s: a slow but working round costs no request
    assert w.due(80.1) == [2]  # a lost one is still asked for
    assert w.next_due() == pytest.approx(130.1)  # and again after the same wait, not twice it
    assert w.accept(2, 90.0) == (True, [])
    w.shipped(3, 100.0)
    assert w.next_due() == pytest.approx(100.0 + 2 * 25.0)  # the link showed 25 s; the 60 s round was a lost one's


def test_a_reconnect_asks_at_once_for_every_pending_round_and_then_backs_off_as_any_request():
    w = ConsensusWatch(deadline=2.0)
    assert w.reconnected(0.0) == []  # the first connection: nothing shipped, nothing to ask
    w.shipped(1, 0.0)
    w.accept(1, 30.0)  # a slow round: the next one waits 60 s
    w.shipped(2, 31.0)
    assert w.reconnected(32.0) == [2]  # what the old connection carried is lost: asking cannot wait a minute
    assert w.due(33.0) == []  # a request went: the next waits as after any other
    assert w.accept(2, 33.0) == (True, [])
    assert w.reconnected(34.0) == []


def test_a_round_that_waited_out_a_hold_does_not_delay_asking_for_the_next_rounds_lost_consensus():
    # CI: a flapped host's round spanned the run's hold; the next round's consensus was lost, and its relay
    # waited twice the held round (then doubled) before asking again, past the run's end: its rank sat at its
    # barrier for the last 3 epochs. One slow round says nothing of the link; every round of a slow link is slow.
    w = ConsensusWatch(deadline=2.0)
    for r, t in enumerate((0.0, 1.0, 2.0), start=1):
        w.shipped(r, t)
        assert w.accept(r, t + 0.2) == (True, [])
    w.shipped(4, 10.0)
    assert w.accept(4, 40.0) == (True, [])  # the other hosts' ranks were held for 30 s
    w.shipped(5, 41.0)  # and this consensus never comes
    asked = [t / 10 for t in range(410, 1000) if w.due(t / 10)]
    assert asked[:4] == [43.1, 47.2, 55.3, 71.4]  # waits of 2, 4, 8, 16 s, as on any fast link


def test_consensus_watch_asks_for_a_lost_consensus_within_its_link_cap_however_slow_the_last_round():
    w = ConsensusWatch(deadline=2.0)
    w.shipped(1, 0.0)
    w.accept(1, 1000.0)
    w.shipped(2, 1000.0)
    assert w.next_due() == pytest.approx(1000.0 + ConsensusWatch.LINK_CAP * 2.0)


# ---------------------------------------------------------------------- control channel


def test_the_send_queue_is_judged_by_progress_and_drops_everything_once_nothing_went_for_its_timeout():
    q = SendQueue(timeout_s=1.0)
    assert q.next_due() == math.inf and q.expire(100.0) == 0  # nothing waits: never stuck
    assert q.put(["a"], 0.0) and q.put(["b"], 0.5)
    assert q.next_due() == 1.0  # from when the queue stopped being empty, not from each record's arrival
    q.went(0.9)  # progress: "a" went, so the peer reads, however long "b" has waited
    assert q.head == ["b"] and q.expire(1.5) == 0 and q.next_due() == 1.9
    q.put(["c"], 1.8)
    assert q.expire(1.9) == 2 and q.head is None and q.next_due() == math.inf  # both dropped at once


def test_the_send_queue_refuses_a_record_past_its_bound():
    q = SendQueue(timeout_s=1.0)
    assert all(q.put([i], 0.0) for i in range(SendQueue.MAX_RECORDS))
    assert not q.put(["one more"], 0.0) and len(q) == SendQueue.MAX_RECORDS and q.head == [0]


def test_rank_records_go_up_verbatim_and_replies_come_back_to_the_addressed_rank(rig):
    frames = rig.ranks[1].codec.encode(_lr(1))
    rig.ranks[1].control.send_multipart(frames)
    route, env = rig.ctl.control_message()
    assert route == rank_identity(1) and env.sender == "rank:1"
    reply = rig.ctl.coordinator(1).encode(CoordHeartbeat())
    rig.ctl.to_rank(1, reply)
    assert rig.ranks[1].control.poll(int(WAIT_S * 1000))
    assert rig.ranks[1].control.recv_multipart() == [bytes(f) for f in reply]
    assert not rig.ranks[0].control.poll(100)


def _lr(rank):
    """A rank record the relay forwards verbatim (not one it merges: PROTOCOL.md 9.4)."""
    return LrUpdate(rank, 0.1)


def test_a_hosts_step_reports_and_heartbeats_go_up_as_one_record_that_keeps_each_ranks_sequence(rig):
    rig.ranks[0].control.send_multipart(rig.ranks[0].codec.encode(Batch(0, 2, [1.0, 2.0], [0.1, 0.2], [0.5, 0.4])))
    rig.ranks[0].control.send_multipart(rig.ranks[0].codec.encode(Heartbeat(0, 2, ack=3)))
    rig.ranks[1].control.send_multipart(rig.ranks[1].codec.encode(Batch(1, 1, [9.0], [0.0], [0.7])))
    route, env = rig.ctl.control_message()
    assert route == RELAY_ROUTE and env.sender == "relay:a" and isinstance(env.record, HostReports)
    assert sorted(env.record.unmerge(), key=lambda i: (i[1].rank, i[0])) == [  # every rank's numbers, each under its own seq
        (1, Batch(0, 2, [1.0, 2.0], [0.1, 0.2], [0.5, 0.4])), (2, Heartbeat(0, 2, 3)), (1, Batch(1, 1, [9.0], [0.0], [0.7])),
    ]
    assert not rig.ctl.control.poll(100)


def test_a_record_the_relay_does_not_merge_goes_up_after_the_reports_it_holds(rig):
    rig.ranks[0].control.send_multipart(rig.ranks[0].codec.encode(Batch(0, 1, [1.0], [0.0], [0.5])))
    rig.ranks[0].control.send_multipart(rig.ranks[0].codec.encode(_lr(0)))  # rank 1 never reported
    route, env = rig.ctl.control_message()  # held alone, so it goes as it came: verbatim
    assert route == rank_identity(0) and env.sender == "rank:0" and env.seq == 1 and env.kind == "timing.batch"
    route, env = rig.ctl.control_message()
    assert route == rank_identity(0) and env.sender == "rank:0" and env.seq == 2 and env.record == _lr(0)


def test_a_lone_ranks_report_is_not_held_past_the_merge_period(rig):
    rig.ranks[1].heartbeat()  # rank 0 stays silent: the queue stops waiting for it after a period
    route, env = rig.ctl.control_message()
    while isinstance(env.record, RelayHello):  # repeated until acknowledged; this controller never does
        route, env = rig.ctl.control_message()
    assert route == rank_identity(1) and env.record == Heartbeat(1, 0)  # alone: verbatim, under its own MAC


def test_a_report_naming_another_rank_is_never_merged(rig):
    # Signed by rank 1 but naming rank 0: merged, it would count in rank 0's stream. Attribution refuses it.
    rig.ranks[1].control.send_multipart(rig.ranks[1].codec.encode(Heartbeat(0, 5)))
    rig.ranks[0].heartbeat()
    rig.ranks[1].heartbeat()
    route, env = rig.ctl.control_message()
    while isinstance(env.record, RelayHello):  # repeated until acknowledged; this controller never does
        route, env = rig.ctl.control_message()
    assert route == RELAY_ROUTE and sorted(r.rank for _, r in env.record.unmerge()) == [0, 1]
    assert rig.relay.counters()["forged_route.local_control"] == 1


def test_records_for_or_from_unknown_ranks_are_dropped_and_counted(rig):
    rig.ranks[0].heartbeat()
    rig.ctl.control_message()
    rig.ctl.to_rank(5, rig.ctl.coordinator(5).encode(CoordHeartbeat()))
    stranger = rig.rogue(9, endpoint="a-control")
    stranger.send_multipart(Codec(rig.key, rig.run_id, "rank:9").encode(_lr(9)))
    assert settle(lambda: rig.relay.counters().get("unknown_rank.upstream_control") == 1
                  and rig.relay.counters().get("unknown_rank.local_control") == 1)
    assert not rig.ctl.control.poll(100)
    stranger.close(0)


def test_corrupt_and_forged_control_records_are_rejected_on_both_legs_and_resends_pass(rig):
    frames = rig.ranks[0].codec.encode(_lr(0))
    rig.ranks[0].control.send_multipart(corrupt(frames, 0))
    impostor = rig.ranks[1].control  # rank 1's socket speaking as rank 0, then with a wrong key
    impostor.send_multipart(Codec(rig.key, rig.run_id, "rank:0").encode(_lr(0)))
    impostor.send_multipart(Codec(new_key(), rig.run_id, "rank:1").encode(_lr(1)))
    # The genuine one, then a byte-identical resend: the relay forwards both (no sequence
    # check there: a resend whose first copy was lost upstream must pass, PROTOCOL.md 10.7).
    rig.ranks[0].control.send_multipart(frames)
    rig.ranks[0].control.send_multipart(frames)
    for _ in range(2):
        route, env = rig.ctl.control_message()
        assert route == rank_identity(0) and env.seq == 1
    reply = rig.ctl.coordinator(0).encode(CoordHeartbeat())
    rig.ctl.to_rank(0, corrupt(reply, 0))
    rig.ctl.to_rank(0, rig.ctl.coordinator(1).encode(CoordHeartbeat()))  # rank 1's stream, routed to rank 0
    rig.ctl.to_rank(0, reply)
    rig.ctl.to_rank(0, reply)
    for _ in range(2):
        assert rig.ranks[0].control.poll(int(WAIT_S * 1000))
        assert rig.ranks[0].control.recv_multipart() == [bytes(f) for f in reply]
    assert settle(lambda: rig.relay.counters().get("rejected.upstream_control") == 1
                  and rig.relay.counters().get("forged_route.upstream_control") == 1)
    c = rig.relay.counters()
    assert c["rejected.local_control"] == 2 and c["forged_route.local_control"] == 1
    assert not rig.ctl.control.poll(100) and not rig.ranks[0].control.poll(100)


def test_a_control_record_not_signed_by_the_coordinator_is_not_forwarded(rig):
    rig.ranks[0].heartbeat()
    rig.ctl.control_message()
    # Good key, wrong signer: the reducer (or anyone holding the key) may not speak as the coordinator.
    rig.ctl.to_rank(0, rig.ctl.codec.encode(CoordHeartbeat()))
    genuine = rig.ctl.coordinator(0).encode(CoordHeartbeat())
    rig.ctl.to_rank(0, genuine)
    assert rig.ranks[0].control.poll(int(WAIT_S * 1000))
    assert rig.ranks[0].control.recv_multipart() == [bytes(f) for f in genuine]
    assert settle(lambda: rig.relay.counters().get("forged_route.upstream_control") == 1)
    assert not rig.ranks[0].control.poll(100)


# ---------------------------------------------------------------------- data channel


def test_bad_deposits_are_rejected_and_the_host_frame_is_still_the_sum(rig):
    t0, t1 = [np.arange(6, dtype=np.float32)], [np.full(6, 2.0, np.float32)]
    frames = rig.ranks[0].deposit(1, 1.0, t0)
    rig.ranks[0].data.send_multipart(frames)  # replay
    rig.ranks[1].data.send_multipart(corrupt(rig.ranks[1].codec.encode(RoundFrame(1, 1, 2.0), t1)))
    impostor = rig.ranks[1].data  # rank 1's socket depositing as rank 0, then with a wrong key
    impostor.send_multipart(Codec(rig.key, rig.run_id, "rank:0").encode(RoundFrame(1, 0, 9.0), t1))
    impostor.send_multipart(Codec(new_key(), rig.run_id, "rank:1").encode(RoundFrame(1, 1, 9.0), t1))
    assert settle(lambda: rig.relay.counters().get("rejected.local_data") == 3)
    rig.ranks[1].deposit(1, 2.0, t1)
    env = rig.ctl.data_record()
    assert isinstance(env.record, HostFrame)
    assert (env.record.round, env.record.ranks, env.record.mass) == (1, [0, 1], 3.0)
    assert np.array_equal(env.payload[0], t0[0] + t1[0])
    assert rig.relay.counters()["forged_route.local_data"] == 1


def test_a_second_deposit_in_one_round_is_counted_once_and_the_relay_goes_on(rig):
    t = [np.ones(4, np.float32)]
    rig.ranks[0].deposit(1, 1.0, t)
    rig.ranks[0].deposit(1, 5.0, [np.full(4, 9.0, np.float32)])  # a resend that crossed the original
    # Rank 1 deposits on its own socket: only once the copy is in is the round still open for it.
    assert settle(lambda: rig.relay.fold.counters.duplicate_drops == 1)
    rig.ranks[1].deposit(1, 2.0, [np.full(4, 2.0, np.float32)])
    env = rig.ctl.data_record()
    assert isinstance(env.record, HostFrame) and env.record.mass == 3.0
    assert env.payload[0].tolist() == [3.0] * 4
    assert rig.relay.running and rig.relay.fold.counters.duplicate_drops == 1


@pytest.mark.parametrize("told", [BF16, INT8])
def test_a_relay_told_the_wire_format_refuses_a_deposit_of_another_by_name_at_the_first(tmp_path, told, caplog):
    rig = Rig(tmp_path, wire=told)
    try:
        # f32, not the run's format: that rank leaves at its first deposit, its host-mate's round goes on
        # (it used to stop the relay, and with it every rank of the host: PROTOCOL.md 8.2).
        with caplog.at_level(logging.ERROR):
            rig.ranks[0].deposit(1, 1.0, [np.ones(4, np.float32)])
            assert rig.ctl.data_record().record == RankExit(0)
        assert f"rank 0 is f32, but the run's wire_dtype is {told.name}" in caplog.text
        assert rig.relay.fold.counters.deposits == 0  # refused before the fold saw it
        if told is BF16:
            rig.ranks[1].deposit(1, 2.0, [np.full(4, 0x4000, np.uint16)], "bf16")
        else:
            good = told.resume_payload(np.full(4, 2.0, np.float32))
            rig.ranks[1].data.send_multipart(rig.ranks[1].codec.encode(RoundFrame(1, 1, 2.0), good))
        env = rig.ctl.data_record()
        assert isinstance(env.record, HostFrame) and (env.record.ranks, env.record.mass) == ([1], 2.0)
        assert rig.relay.running and rig.relay.counters()["protocol_violations.local_data"] == 1
    finally:
        rig.close()


def test_a_relay_not_told_the_wire_format_holds_the_run_to_its_first_deposits(tmp_path, caplog):
    # No hello retries among the records asserted on: the first bf16 sum of a process imports torch
    # (tensors.bf16_sum), about a second, and a retry came between the host frame and the rank's exit.
    rig = Rig(tmp_path, wire=None, hello_retry_s=3600.0)
    try:
        rig.ranks[0].deposit(1, 1.0, [np.full(4, 0x3F80, np.uint16)], "bf16")  # 1.0: the run is bf16
        rig.ranks[1].deposit(1, 2.0, [np.full(4, 0x3F80, np.uint16)], "bf16")
        env = rig.ctl.data_record()
        assert isinstance(env.record, HostFrame) and env.payload[0].tolist() == [0x4000] * 4  # 2.0
        int8 = INT8.resume_payload(np.ones(4, np.float32))
        with caplog.at_level(logging.ERROR):
            rig.ranks[0].data.send_multipart(rig.ranks[0].codec.encode(RoundFrame(2, 0, 1.0), int8))
            assert rig.ctl.data_record().record == RankExit(0)  # that rank leaves; the relay serves on
        assert "rank 0 is int8, but the run's first payload was bf16" in caplog.text
        assert "not told the run's wire_dtype" in caplog.text and rig.relay.running
    finally:
        rig.close()


def test_a_rank_depositing_out_of_step_leaves_and_its_host_mates_round_ships_without_it(rig):
    # A fold protocol violation used to stop the relay: one rank whose stream was desynced (a frame for
    # round 2 while round 1 is open) took every rank of its host down. Now only that rank leaves.
    rig.ranks[0].deposit(1, 1.0, [np.ones(4, np.float32)])
    assert settle(lambda: rig.relay.fold.counters.deposits == 1)
    rig.ranks[1].deposit(2, 2.0, [np.full(4, 2.0, np.float32)])
    records = [rig.ctl.data_record().record for _ in range(2)]
    assert RankExit(1) in records
    (frame,) = [r for r in records if isinstance(r, HostFrame)]
    assert (frame.round, frame.ranks, frame.mass) == (1, [0], 1.0)
    assert rig.relay.running and rig.relay.counters()["protocol_violations.local_data"] == 1


def test_goodbye_leaves_the_barrier_and_is_reported_on_both_upstream_legs(rig):
    t = [np.ones(4, np.float32)]
    rig.ranks[0].deposit(1, 1.0, t)
    rig.ranks[1].goodbye()
    route, env = rig.ctl.control_message()
    assert route == rank_identity(1) and env.kind == "timing.exiting"  # forwarded first
    route, env = rig.ctl.control_message()
    assert route == RELAY_ROUTE and env.record == RankExit(1)
    # The death and rank 0's deposit travel on different sockets: either may reach the fold first.
    records = [rig.ctl.data_record().record for _ in range(2)]
    assert RankExit(1) in records
    (frame,) = [r for r in records if isinstance(r, HostFrame)]
    assert frame.ranks == [0] and frame.mass == 1.0


def test_a_departed_rank_is_restated_upstream_so_a_lost_rank_exit_is_not_waited_for(rig):
    rig.ranks[1].goodbye()
    seen = []
    deadline = time.monotonic() + WAIT_S
    while seen.count(RankExit(1)) < 2 and time.monotonic() < deadline:
        route, env = rig.ctl.control_message()
        if route == RELAY_ROUTE:
            seen.append(env.record)
    # The first report, then the same again a resend period later (PROTOCOL.md 10.7): had the
    # first been lost in a reset, the controller would still hear of the exit at once.
    assert seen.count(RankExit(1)) == 2, seen
    assert rig.relay.counters()["restated_exit.upstream_control"] >= 1


def test_a_rank_sending_a_coordinator_record_is_refused_and_reported_gone(rig):
    # Authentic and from rank 1 itself, but a kind only the coordinator sends.
    rig.ranks[1].control.send_multipart(rig.ranks[1].codec.encode(CoordHeartbeat()))
    route, env = rig.ctl.control_message()
    assert route == RELAY_ROUTE and env.record == RankExit(1)  # not forwarded: the rank is out
    assert rig.relay.counters()["illegal_kind.local_control"] == 1
    assert RankExit(1) in [rig.ctl.data_record().record]  # its fold stops waiting for it too


def test_a_silent_rank_is_out_within_the_deadline(tmp_path):
    rig = Rig(tmp_path, rank_silence_at_relay_s=0.4)
    try:
        rig.ranks[0].heartbeat()
        rig.ranks[1].heartbeat()
        rig.ranks[0].deposit(1, 1.0, [np.ones(4, np.float32)])
        start = time.monotonic()
        frame = None
        while frame is None and time.monotonic() - start < WAIT_S:
            rig.ranks[0].heartbeat()
            if rig.ctl.data.poll(50):
                frame = rig.ctl.data_record()
        assert isinstance(frame.record, HostFrame) and frame.record.ranks == [0]
        assert time.monotonic() - start < 2.0
    finally:
        rig.close()


def test_declare_dead_from_the_controller_unblocks_the_fold_and_a_restatement_is_a_no_op(rig):
    rig.ranks[1].deposit(1, 2.0, [np.ones(4, np.float32)])
    assert not rig.ctl.data.poll(200)
    rig.ctl.to_relay(RelayDeclareDead(0))
    env = rig.ctl.data_record()
    assert isinstance(env.record, HostFrame) and env.record.ranks == [1] and env.record.mass == 2.0
    rig.ctl.to_relay(RelayDeclareDead(0))  # the reducer restates its deaths (PROTOCOL.md 10.7 item 8)
    rig.ranks[1].deposit(2, 1.0, [np.ones(4, np.float32)])
    env = rig.ctl.data_record()  # the next round ships as before: rank 0 stays out, nothing torn down
    assert isinstance(env.record, HostFrame) and env.record.round == 2 and env.record.ranks == [1]
    assert rig.relay.counters()["restated_death.upstream_data"] == 1


# ---------------------------------------------------------------------- fan-out and recovery


def test_consensus_reaches_every_live_rank_and_bad_broadcasts_do_not(rig):
    rig.subscribe()
    t = [np.arange(5, dtype=np.float32)]
    for r in rig.ranks:
        r.deposit(1, 1.0, t)
    assert isinstance(rig.ctl.data_record().record, HostFrame)
    genuine = rig.ctl.codec.encode(_consensus(1), t, channel=Channel.BROADCAST)
    rig.ctl.pub.send_multipart(corrupt(genuine))
    rig.ctl.pub.send_multipart(Codec(new_key(), rig.run_id, "reducer").encode(_consensus(1), t,
                                                                              channel=Channel.BROADCAST))
    rig.ctl.pub.send_multipart(Codec(rig.key, rig.run_id, "rank:0").encode(_consensus(1), t,
                                                                           channel=Channel.BROADCAST))
    rig.ctl.pub.send_multipart(genuine)
    rig.ctl.pub.send_multipart(genuine)  # replay: already delivered
    rig.ctl.resend(genuine)  # a resend of a delivered round, point to point
    rig.ctl.data.send_multipart([rig.ctl.data_route, b"junk", *genuine])
    for r in rig.ranks:
        env = r.consensus()
        assert env.record.round == 1 and np.array_equal(env.payload[0], t[0])
        assert r.nothing_within(0.2)
    c = rig.relay.counters()
    assert c["rejected.bcast"] == 2 and c["forged_route.bcast"] == 1
    # Three genuine copies (PUB, its replay, a resend on the data socket) race: one is delivered.
    assert c.get("stale_consensus.bcast", 0) + c.get("stale_consensus.upstream_data", 0) == 2
    assert c["rejected.upstream_data"] == 1


def _consensus(round_id):
    from flodl_zmq.wire.records import Consensus

    return Consensus(round_id, 2.0)


def test_silence_after_shipping_asks_for_the_consensus_and_the_resend_is_delivered(tmp_path):
    rig = Rig(tmp_path, consensus_wait_at_relay_s=0.2)
    try:
        t = [np.ones(3, np.float32)]
        for r in rig.ranks:
            r.deposit(4, 1.0, t)
        assert isinstance(rig.ctl.data_record().record, HostFrame)
        ask = rig.ctl.data_record()
        assert ask.record == ConsensusRequest(4)
        rig.ctl.resend(rig.ctl.codec.encode(_consensus(4), t, channel=Channel.BROADCAST))
        for r in rig.ranks:
            assert r.consensus().record.round == 4
    finally:
        rig.close()


def test_a_first_connection_made_after_a_round_shipped_asks_for_nothing(tmp_path):
    # launch starts relays before the controller binds its data ports: a round shipped meanwhile waits in the
    # DEALER, and the links' first handshakes replaced no connection. They were taken for reconnects: every
    # other launch logged "reconnected; asking again for rounds [1]" and asked for a consensus not yet made.
    ctx = zmq.Context()
    key, run_id = new_key(), bytes(16)
    eps = endpoints("ipc", tmp_path)
    cfg = RelayConfig("a", (0, 1), key, run_id, eps["control"], eps["data"], eps["bcast"], eps["a-control"],
                      eps["a-data"], host_token=token("a"), rank_silence_at_relay_s=30.0, consensus_wait_at_relay_s=30.0)
    relay = Relay(cfg, ctx)
    relay.start()
    ranks = [FakeRank(ctx, r, key, run_id, eps["a-control"], eps["a-data"]) for r in (0, 1)]
    ctl = None
    try:
        for r in ranks:
            r.deposit(1, 1.0, [np.ones(3, np.float32)])
        assert settle(lambda: relay.counters().get("rounds_shipped") == 1)
        ctl = FakeController(ctx, key, run_id, eps)  # binds now: both links connect for the first time
        seen = [ctl.data_record().record for _ in range(2)]
        assert sorted(type(r).__name__ for r in seen) == ["HostFrame", "RelayHello"], seen
        assert not ctl.data.poll(500), ctl.data_record().record  # no ConsensusRequest(1)
        assert relay.counters().get("consensus_requests", 0) == 0
    finally:
        for r in ranks:
            r.close()
        relay.stop()
        if ctl is not None:
            ctl.close()
        ctx.destroy(0)


def test_a_resumed_hosts_ranks_asking_for_their_starting_model_make_one_request_upstream(rig):
    # PROTOCOL.md 13: each rank asks for round RESUME_ROUND; the relay asks the reducer once for all of
    # them (repeats back off, 10.3), or a slow link would carry one copy of the model per rank and ask.
    for _ in range(3):
        for r in rig.ranks:
            r.data.send_multipart(r.codec.encode(ConsensusRequest(RESUME_ROUND), channel=Channel.DATA))
    assert rig.ctl.data_record().record == ConsensusRequest(RESUME_ROUND)
    assert rig.ctl.data.poll(300) == 0  # nothing more: the other five asks were answered by the one
    assert rig.relay.counters()["consensus_requests"] == 1
    rig.ctl.resend(rig.ctl.codec.encode(_consensus(RESUME_ROUND), [np.ones(3, np.float32)],
                                        channel=Channel.BROADCAST))
    for r in rig.ranks:
        assert r.consensus().record.round == RESUME_ROUND


def test_forged_declare_dead_is_rejected(rig):
    rig.ranks[0].deposit(1, 1.0, [np.ones(2, np.float32)])
    forged = Codec(new_key(), rig.run_id, "reducer").encode(RelayDeclareDead(1), channel=Channel.DATA)
    rig.ctl.data.send_multipart([rig.ctl.data_route, b"data", *forged])
    by_rank = Codec(rig.key, rig.run_id, "rank:0").encode(RelayDeclareDead(1), channel=Channel.DATA)
    rig.ctl.data.send_multipart([rig.ctl.data_route, b"data", *by_rank])
    ok = settle(lambda: rig.relay.counters().get("rejected.upstream_data") == 1
                and rig.relay.counters().get("forged_route.upstream_data") == 1)
    assert ok, rig.relay.counters()
    assert not rig.ctl.data.poll(200)  # rank 1 is still awaited


# ---------------------------------------------------------------------- a reducer that stops reading


def stalled_reducer(tmp_path, peer_send_timeout_s):
    """A rig whose reducer holds one record and reads only when the test does, so the relay's
    sends back up at its second or third; rank 1 is dead, so each of rank 0's deposits ships at once,
    as the very frames it came in (no fold buffer reused under a frame still waiting to go)."""
    rig = Rig(tmp_path, reducer_rcvhwm=1, data_hwm_records=1, hello_retry_s=3600.0,
              peer_send_timeout_s=peer_send_timeout_s)
    rig.ctl.to_relay(RelayDeclareDead(1))
    assert settle(lambda: 1 in rig.relay.fold.dead)
    return rig


def test_a_reducer_that_stops_reading_does_not_stop_the_relay_and_what_waited_goes_up_in_order(tmp_path):
    rig = stalled_reducer(tmp_path, peer_send_timeout_s=3600.0)  # nothing is dropped while this test runs
    try:
        sent = [[np.full(4, float(r), np.float32)] for r in range(1, 7)]
        for r, t in enumerate(sent, 1):
            rig.ranks[0].deposit(r, 1.0, t)
        # Six host frames, and the reducer's queue takes two: the relay folded every deposit all the same.
        assert settle(lambda: rig.relay.counters()["rounds_shipped"] == 6), rig.relay.counters()
        # And it still reads what comes down the link it cannot send on: the consensus reaches the rank.
        rig.ctl.resend(rig.ctl.codec.encode(_consensus(1), sent[0], channel=Channel.BROADCAST))
        assert rig.ranks[0].consensus().record.round == 1
        # The reducer reads again: every frame arrives, in the order shipped, as deposited.
        for r, t in enumerate(sent, 1):
            env = rig.ctl.data_record()
            assert isinstance(env.record, HostFrame) and env.record.round == r
            assert np.array_equal(env.payload[0], t[0])
        assert "send_timeout.upstream_data" not in rig.relay.counters()
    finally:
        rig.close()


def test_host_frames_waiting_to_go_up_keep_their_own_sums_while_later_rounds_fold(tmp_path):
    """Two ranks: each round is summed into the fold's buffers, which a frame still queued or in the
    socket reads by reference; the next rounds must sum elsewhere (on a slow link they fold meanwhile)."""
    rig = Rig(tmp_path, reducer_rcvhwm=1, data_hwm_records=1, hello_retry_s=3600.0, peer_send_timeout_s=3600.0)
    try:
        n = 1 << 16  # 256 kB: sent without a copy (pyzmq copies frames under 64 kB)
        for r in range(1, 5):
            for rank in (0, 1):
                rig.ranks[rank].deposit(r, 1.0, [np.full(n, 10.0 * r + rank, np.float32)])
            # Shipped (queued) before the next round's deposits: two sockets keep no order between them.
            assert settle(lambda r=r: rig.relay.counters().get("rounds_shipped") == r), rig.relay.counters()
        for r in range(1, 5):
            env = rig.ctl.data_record()  # a WireError (MAC) when a later round's sum overwrote it
            assert isinstance(env.record, HostFrame) and env.record.round == r
            assert np.all(env.payload[0] == 20.0 * r + 1.0)
    finally:
        rig.close()


def test_a_reducer_that_never_reads_has_all_that_waited_dropped_at_once_and_counted_and_the_relay_serves_on(tmp_path):
    rig = stalled_reducer(tmp_path, peer_send_timeout_s=1.0)
    try:
        for r in range(1, 7):
            rig.ranks[0].deposit(r, 1.0, [np.full(4, float(r), np.float32)])
        assert settle(lambda: rig.relay.counters().get("send_timeout.upstream_data", 0) > 0), rig.relay.counters()
        dropped = rig.relay.counters()["send_timeout.upstream_data"]  # the first drop: judged by progress, at once
        assert rig.relay.counters()["rounds_shipped"] == 6
        # Not stopped: the relay delivers a consensus, and what it ships next goes up once the reducer reads.
        rig.ctl.resend(rig.ctl.codec.encode(_consensus(1), [np.ones(4, np.float32)], channel=Channel.BROADCAST))
        assert rig.ranks[0].consensus().record.round == 1
        rig.ranks[0].deposit(7, 1.0, [np.ones(4, np.float32)])
        rounds = []
        while 7 not in rounds:
            rounds.append(rig.ctl.data_record().record.round)
        # What went before the drop, in order, then round 7: every frame that had not gone was dropped at
        # the first timeout, not one per timeout while the relay waited on each.
        assert rounds == sorted(rounds) and dropped + len(rounds) - 1 == 6, (dropped, rounds)
        assert rig.relay.running
    finally:
        rig.close()
