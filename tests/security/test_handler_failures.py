"""A record a service fails on drops its signer only (issue 27, item 5; PROTOCOL.md 8.2).

Each test makes the service's own code raise on one peer's accepted record
(a stand-in for any failure a record can reach: a bug, an overflow the
ranges did not foresee) and checks the one boundary each service keeps
(`links.act_for_peer`): that peer is dropped as for any death, counted
`handler_error.*`, and the service goes on serving the others. Before,
the exception ended the service's thread: one member ended a host or the run.
A rank's link has one peer, the coordinator: a record it fails on stops the
rank with the reason, as a lost coordinator does.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from transport.dataplane_helpers import WAIT_S
from transport.test_rank_link import link  # noqa: F401  (the fixture: a rank's real link, its relay's sockets)
from transport.test_reducer import Rig as ReducerRig
from transport.test_reducer import frame
from transport.test_relay import Rig as RelayRig
from transport.test_relay import settle

from flodl_zmq.links import RELAY_ROUTE, coordinator_sender, rank_identity
from flodl_zmq.rank_link import CoordinatorLost
from flodl_zmq.reducer_messages import HostRefused
from flodl_zmq.relay_core import ReportQueue
from flodl_zmq.trust import JOIN_RUN_ID
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import (
    ConsensusRequest,
    HostFrame,
    JoinAccept,
    LrUpdate,
    RankExit,
    RankExited,
    RelayDeclareDead,
    Shutdown,
)

from .test_join_replay import Run, exchange, hello

pytestmark = pytest.mark.timeout(120)


def injected(*args: object) -> None:
    raise RuntimeError(f"injected failure on {args}")


@pytest.fixture
def relay(tmp_path):
    r = RelayRig(tmp_path)
    yield r
    r.close()


def test_a_rank_record_the_relays_control_thread_fails_on_drops_that_rank_and_the_other_is_still_carried(
        relay, monkeypatch):
    monkeypatch.setattr(ReportQueue, "add", injected)  # rank 1's heartbeat is the only record merged
    relay.ranks[1].heartbeat()
    route, env = relay.ctl.control_message()
    assert route == RELAY_ROUTE and env.record == RankExit(1)  # reported gone, like any rank that leaves
    assert relay.relay.counters()["handler_error.local_control"] == 1
    relay.ranks[0].control.send_multipart(relay.ranks[0].codec.encode(LrUpdate(0, 0.1)))
    route, env = relay.ctl.control_message()
    assert route == rank_identity(0) and env.record == LrUpdate(0, 0.1)  # the control thread serves on
    assert relay.relay.error is None


def test_a_deposit_the_relays_data_thread_fails_on_drops_that_rank_and_the_round_ships_without_it(
        relay, monkeypatch):
    deposit = relay.relay.fold.deposit
    monkeypatch.setattr(relay.relay.fold, "deposit",
                        lambda rank, *rest: injected(rank) if rank == 1 else deposit(rank, *rest))
    relay.ranks[1].deposit(1, 2.0, [np.full(6, 2.0, np.float32)])
    assert relay.ctl.data_record().record == RankExit(1)
    assert settle(lambda: relay.relay.counters().get("handler_error.local_data") == 1)
    relay.ranks[0].deposit(1, 1.0, [np.arange(6, dtype=np.float32)])
    env = relay.ctl.data_record()
    assert isinstance(env.record, HostFrame) and (env.record.round, env.record.ranks) == (1, [0])
    assert relay.relay.error is None


def test_a_relay_record_the_reducer_fails_on_drops_that_host_and_the_round_completes_with_the_other(
        tmp_path, monkeypatch):
    rig = ReducerRig(tmp_path)
    try:
        rig.ready()
        a, b = rig.relays["a"], rig.relays["b"]
        monkeypatch.setattr(rig.svc, "_resend", injected)
        a.send(ConsensusRequest(7))
        assert a.record().record == RelayDeclareDead(0)  # host a's ranks are out of every round
        assert a.record().record == RelayDeclareDead(1)
        refused = rig.svc.completed.get(timeout=WAIT_S)  # the coordinator's word that a's ranks are out
        assert isinstance(refused, HostRefused) and (refused.host, refused.ranks) == ("a", (0, 1))
        b.send(*frame("b", 1, 2.0, 4.0))
        out = rig.svc.completed.get(timeout=WAIT_S)
        assert out.hosts == ("b",) and out.mass == 2.0
        assert rig.svc.counters()["handler_error.data"] == 1 and rig.svc.error is None
    finally:
        rig.close()


def test_an_agent_record_the_membership_fails_on_loses_that_host_and_others_still_join(ctx, monkeypatch):
    key = new_key()
    run = Run(ctx, key)
    try:
        w1 = run.dial()
        _, accept = exchange(w1, Codec(key, JOIN_RUN_ID, "w1"), hello("w1"))
        assert isinstance(accept, JoinAccept)
        monkeypatch.setattr(run.svc.links, "retire", injected)
        w1.send_multipart(Codec(key, run.svc.incarnation, "w1").encode(RankExited(accept.ranks[0], 1), channel=Channel.JOIN))
        deadline = time.monotonic() + WAIT_S
        while any(m.host == "w1" for m in run.svc.window.members) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Lost before the world formed: it leaves the window (its rank a vacancy), and may dial in again.
        assert not any(m.host == "w1" for m in run.svc.window.members)
        assert run.svc.counts["handler_error.join"] == 1
        _, accept2 = exchange(run.dial(), Codec(key, JOIN_RUN_ID, "w2"), hello("w2"))  # the window serves on
        assert isinstance(accept2, JoinAccept)
    finally:
        run.close()


def test_a_coordinator_record_the_ranks_link_fails_on_stops_the_rank_with_the_reason(link, monkeypatch):  # noqa: F811
    lk, control, _data, key, run_id = link
    monkeypatch.setattr(lk._down, "accept", injected)
    control.send_multipart([rank_identity(0), *Codec(key, run_id, coordinator_sender(0)).encode(Shutdown())])
    got = lk.inbox.get(timeout=WAIT_S)  # not an I/O thread gone and a training thread waiting on it
    assert isinstance(got, CoordinatorLost) and "injected" in got.reason
    assert lk.counts["handler_error.upstream"] == 1
