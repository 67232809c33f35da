"""One member silences another: a `relay.hello` naming another host (PROTOCOL.md 10.5 item 3).

Every member holds the session key, so it can sign `relay:<victim>`. Before
host tokens, such a hello from the member's own connection took the victim's
route on the reducer and the controller when it came first, and, when it came
after, its sequence number (2^62) was recorded before the route rule refused
it: every later record of the real relay was then "too old", the victim's
rounds never completed and its ranks were declared dead. A hello now counts
only with its host's token, checked before any ledger or route moves; under
CURVE a host name also stays the key's that first joined it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
import zmq
from transport.dataplane_helpers import ROUTE_SECRET, WAIT_S, token
from transport.test_controller import WORLD as CONTROL_WORLD
from transport.test_controller import ScriptedRelay, job
from transport.test_reducer import WORLD, FakeRelay, Rig, frame

from flodl_zmq.controller_service import ControllerService
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv, SpawnSpec
from flodl_zmq.errors import WireError
from flodl_zmq.join import JoinConfig, JoinWindow
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import RELAY_ROUTE, rank_identity
from flodl_zmq.membership import MembershipService
from flodl_zmq.security import CurveKeys, apply_client, start_gate
from flodl_zmq.settings import Settings
from flodl_zmq.trust import JOIN_RUN_ID, OPEN_JOIN_KEY, TrustMode
from flodl_zmq.wire import PROTOCOL_VERSION, Channel, Codec, new_key
from flodl_zmq.wire import records as rec

pytestmark = pytest.mark.timeout(90)

HUGE_SEQ = 2**62
MEMBERS_TOKEN = token("b")  # what another admitted member holds: its own host's token, not the victim's


def _settle(pred, within_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _burning(codec: Codec, channel: Channel) -> Codec:
    """`codec`, its next sequence number on `channel` 2^62: one record would move the window past everything."""
    codec._seq[channel] = itertools.count(HUGE_SEQ)
    return codec


# ---------------------------------------------------------------------------- the data channel (reducer)


@pytest.fixture
def reducer(tmp_path):
    r = Rig(tmp_path, "ipc")
    yield r
    r.close()


def _round_is_delivered(rig: Rig) -> None:
    """Both hosts deposit round 1; both get the consensus of both, and the round completes."""
    a, b = rig.relays["a"], rig.relays["b"]
    for relay in (a, b):
        relay.subscribe()
    a.send(*frame("a", 1, 1.0, 2.0))
    b.send(*frame("b", 1, 3.0, 6.0))
    env = a.broadcast()
    assert env.record.round == 1 and env.record.mass == 4.0
    assert np.allclose(env.payload[0], (2.0 + 6.0) / 4.0)
    assert rig.svc.completed.get(timeout=WAIT_S).hosts == ("a", "b")


def test_a_members_hello_naming_an_unregistered_host_takes_no_route_at_the_reducer(reducer):
    member = FakeRelay(reducer.ctx, "a", reducer.key, reducer.run_id, reducer.eps)  # signs relay:a with the key
    try:
        member.send(rec.RelayHello("a", list(WORLD["a"]), [], MEMBERS_TOKEN))
        assert _settle(lambda: reducer.svc.counters().get("bad_hello") == 1), reducer.svc.counters()
        reducer.relays["a"].hello()  # the real relay registers: the route was never the member's
        reducer.relays["b"].hello()
        _round_is_delivered(reducer)
        assert not member.data.poll(0), "the member was sent something meant for host a"
    finally:
        member.close()


def test_a_members_hello_with_a_huge_sequence_does_not_lock_the_registered_host_out_of_the_reducer(reducer):
    a, b = reducer.relays["a"], reducer.relays["b"]
    a.hello()
    b.hello()
    member = FakeRelay(reducer.ctx, "a", reducer.key, reducer.run_id, reducer.eps)
    _burning(member.codec, Channel.DATA)
    try:
        member.send(rec.RelayHello("a", list(WORLD["a"]), [], MEMBERS_TOKEN))
        assert _settle(lambda: reducer.svc.counters().get("bad_hello") == 1), reducer.svc.counters()
        # relay:a's ledger did not move: its next records are accepted and its round is delivered.
        a.hello()
        _round_is_delivered(reducer)
    finally:
        member.close()


# ---------------------------------------------------------------------------- the control channel (controller)


@pytest.fixture
def control():
    """A real controller service for host h (ranks 0, 1), its relay (not registered yet) and another member."""
    ctx = zmq.Context()
    key, run_id = new_key(), bytes(range(16))
    address = ControllerAddress("127.0.0.1", free_port_base())
    penv = ProcessEnv(role="controller", controller=address, key=key, run_id=run_id, incarnation=run_id,
                      world=CONTROL_WORLD, settings=Settings(startup_timeout_s=WAIT_S), route_secret=ROUTE_SECRET)
    service = ControllerService(job(), penv)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = service.run()
        except BaseException as exc:  # noqa: BLE001 - the run ends as its ranks leave; how does not matter here
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    endpoint = address.endpoint(Channel.CONTROL)
    relay, member = ScriptedRelay(ctx, endpoint, key, run_id, job()), ScriptedRelay(ctx, endpoint, key, run_id, job())
    yield service, relay, member
    for rank in (0, 1):  # the relay reports its ranks gone: accepted only if its ledger was not burned
        relay.relay_send(rec.RankExit(rank))
    thread.join(WAIT_S)
    relay.sock.close(0)
    member.sock.close(0)
    ctx.term()
    assert not thread.is_alive(), "the controller service outlived its test (the relay's RankExits were refused)"


def _hello(relay: ScriptedRelay, token_: bytes) -> None:
    relay.relay_send(rec.RelayHello(host="h", ranks=[0, 1], model_sigs=[], token=token_))


def _host_h_trains(service, relay: ScriptedRelay, member: ScriptedRelay) -> None:
    """The real relay's hello is acknowledged on its route, its ranks are served there, the member gets nothing."""
    _hello(relay, token("h"))
    relay.wait_for(RELAY_ROUTE, "RelayHelloAck")
    relay.hello(0)
    relay.hello(1)
    relay.wait_for(rank_identity(1), "StartEpoch")
    assert not member.sock.poll(0), "the member was sent something meant for host h"


def test_a_members_hello_naming_an_unregistered_host_takes_no_route_at_the_controller(control):
    service, relay, member = control
    _hello(member, MEMBERS_TOKEN)
    assert _settle(lambda: service.counts["bad_hello.control"] == 1), dict(service.counts)
    _host_h_trains(service, relay, member)


def test_a_members_hello_with_a_huge_sequence_neither_moves_a_registered_route_nor_burns_it(control):
    service, relay, member = control
    _hello(relay, token("h"))
    relay.wait_for(RELAY_ROUTE, "RelayHelloAck")
    _burning(member.codec, Channel.CONTROL)
    _hello(member, MEMBERS_TOKEN)
    assert _settle(lambda: service.counts["bad_hello.control"] == 1), dict(service.counts)
    _host_h_trains(service, relay, member)  # its re-hello is accepted: relay:h's ledger did not move
    assert service.counts["duplicate.control"] == 0


# ---------------------------------------------------------------------------- CURVE: a name is its key's


class CurveJoiner:
    """A bare agent: one join exchange under open admission, over CURVE with its own client key."""

    def __init__(self, ctx: zmq.Context, endpoint: str, server: CurveKeys) -> None:
        public, secret = zmq.curve_keypair()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        apply_client(self.sock, CurveKeys(public, secret, server=server.public))
        self.sock.connect(endpoint)
        self.codecs: dict[str, Codec] = {}

    def join(self, host: str) -> object:
        """The membership's answer to a hello for `host`: a JoinAccept or a JoinReject."""
        codec = self.codecs.setdefault(host, Codec(OPEN_JOIN_KEY, JOIN_RUN_ID, host))  # one sequence per signer
        self.sock.send_multipart(codec.encode(rec.ChallengeRequest(os.urandom(16)), channel=Channel.JOIN))
        challenge = self._reply()
        hello = rec.JoinHello(host, ["cpu:0", "cpu:1"], bytes(32), PROTOCOL_VERSION, None, challenge.nonce)
        self.sock.send_multipart(codec.encode(hello, channel=Channel.JOIN))
        return self._reply()

    def _reply(self) -> object:
        """The next pre-admission record (what an admitted link carried before, under the session key, is skipped)."""
        deadline = time.monotonic() + WAIT_S
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            try:
                return Codec(OPEN_JOIN_KEY, JOIN_RUN_ID, "joiner").decode(self.sock.recv_multipart(), Channel.JOIN).record
            except WireError:
                continue
        raise AssertionError("the membership did not answer")

    def close(self) -> None:
        self.sock.close(0)


def test_under_curve_another_key_cannot_take_a_departed_hosts_name():
    ctx = zmq.Context()
    server = CurveKeys(*zmq.curve_keypair())
    gate, auth = start_gate(ctx, server)
    window = JoinWindow(JoinConfig(min_ranks=2, target_ranks=2, join_window_s=30, join_cap_s=60),
                        opened_at=time.monotonic())
    service = MembershipService(
        window, endpoint="tcp://127.0.0.1:*", trust=TrustMode.OPEN, session_key=new_key(), run_id=bytes(16),
        incarnation=bytes(16), spawn=SpawnSpec(("train.py",)), context=ctx, curve=server, gate=gate,
        join_heartbeat_period_s=0.1, host_silence_at_controller_s=1.0,
    )
    service.start()
    first, other = CurveJoiner(ctx, service.endpoint, server), CurveJoiner(ctx, service.endpoint, server)
    try:
        assert isinstance(first.join("h"), rec.JoinAccept)  # the world forms with h; its agent then falls silent
        assert _settle(lambda: any(m.host == "h" for m in service.window.departed)), "h never departed"
        refused = other.join("h")
        assert isinstance(refused, rec.JoinReject) and "belongs to another CURVE key" in refused.reason
        back = first.join("h")  # the key that joined it may still come back under its name
        assert isinstance(back, rec.JoinAccept)
    finally:
        first.close()
        other.close()
        service.close()
        auth.stop()
        ctx.destroy(0)
