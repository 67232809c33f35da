"""Issue 15, finding 7: join messages replayed across runs, and strangers answered.

Before admission every join message carries the zero run id, so under a
pre-shared key a recorded hello or status request used to be good in any
later run: a replayed hello admitted a phantom host (and the real one was then
refused as a duplicate), a replayed status request was answered, and a
stranger sending a wrong-version frame got a `join.reject` signed with the
key. Now each hello or status request carries a challenge nonce the
membership issued to that connection, consumed on use, and the membership
verifies the MAC before it answers anything (PROTOCOL.md 10.4).
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import msgpack
import pytest
import zmq

from flodl_zmq.agent import Agent
from flodl_zmq.agent_rules import AgentConfig
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import SpawnSpec
from flodl_zmq.errors import MembershipError
from flodl_zmq.join import Challenges, JoinConfig, JoinWindow
from flodl_zmq.membership import MembershipService
from flodl_zmq.trust import JOIN_RUN_ID, TrustMode
from flodl_zmq.wire import PROTOCOL_VERSION, Channel, Codec, new_key
from flodl_zmq.wire.mac import compute_mac
from flodl_zmq.wire.records import (
    ChallengeRequest,
    JoinAccept,
    JoinHello,
    StatusReply,
    StatusRequest,
)

pytestmark = pytest.mark.timeout(60)

SIG = bytes([7]) * 32
SILENT_MS = 1500  # how long a replay or a stranger is given to draw an answer



class Run:
    """One run's membership service under the pre-shared `key` (a fresh run id each time)."""

    def __init__(self, ctx: zmq.Context, key: bytes, join_cap_s: float = 30.0):
        window = JoinWindow(JoinConfig(min_ranks=2, join_window_s=join_cap_s, join_cap_s=join_cap_s), opened_at=time.monotonic())
        self.svc = MembershipService(
            window, endpoint="tcp://127.0.0.1:*", trust=TrustMode.PRE_SHARED, session_key=key,
            run_id=new_key()[:16], incarnation=new_key()[:16], spawn=SpawnSpec(("-c", "pass"), {}), context=ctx,
            join_heartbeat_period_s=0.1, host_silence_at_controller_s=60.0,
        )
        self.svc.start()
        self.ctx, self.key, self.endpoint = ctx, key, self.svc.endpoint
        self.address = ControllerAddress("127.0.0.1", int(self.endpoint.rsplit(":", 1)[1]) - 3)

    def dial(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        return s

    def members(self) -> list[str]:
        return [m.host for m in self.svc.window.members]

    def close(self) -> None:
        self.svc.close()


def exchange(sock: zmq.Socket, codec: Codec, make: Any) -> tuple[list[bytes], Any]:
    """An honest client's exchange: challenge, then `make(nonce)` signed; (its frames, the answer)."""
    sock.send_multipart(codec.encode(ChallengeRequest(b"c" * 16), channel=Channel.JOIN))
    assert sock.poll(5000), "no challenge"
    challenge = codec.decode(sock.recv_multipart(), Channel.JOIN).record
    frames = codec.encode(make(challenge.nonce), channel=Channel.JOIN)
    sock.send_multipart(frames)
    assert sock.poll(5000), "no answer to an honest request"
    return frames, codec.decode(sock.recv_multipart(), Channel.JOIN).record


def hello(host: str) -> Any:
    return lambda nonce: JoinHello(host, ["cpu:0"], SIG, PROTOCOL_VERSION, None, nonce)


def silent(sock: zmq.Socket) -> bool:
    """True if nothing comes back on `sock` within SILENT_MS."""
    return not answered([sock])


def answered(socks: list[zmq.Socket]) -> list[int]:
    """The indexes of `socks` that drew an answer within SILENT_MS, all given that time together; closes them."""
    time.sleep(SILENT_MS / 1000)  # an answer waits in its socket until read
    got = [i for i, s in enumerate(socks) if s.poll(0)]
    for s in socks:
        s.close(0)
    return got


def real_agent_joins(run: Run, host: str) -> bool:
    """A real agent with the run's key dials and is admitted (then aborted)."""
    config = AgentConfig(run.address, host, ("cpu:0",), key=run.key, join_reply_timeout_s=5.0,
                         join_heartbeat_period_s=0.1, controller_silence_at_agent_s=5.0, kill_grace_s=1.0)
    agent = Agent(config, context=run.ctx, out=io.StringIO())

    def join() -> None:
        try:
            agent.join()
        except MembershipError:
            pass  # aborted once admitted: the admission is what counts

    t = threading.Thread(target=join, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and host not in run.members():
        time.sleep(0.02)
    admitted = host in run.members()
    run.svc.abort("test over")
    t.join(10)
    agent.close()
    return admitted


def test_a_captured_hello_replayed_admits_no_phantom_in_this_run_or_the_next(ctx):
    key = new_key()
    first = Run(ctx, key)
    try:
        # The attacker records an honest host's hello (its bytes are all it needs).
        codec = Codec(key, JOIN_RUN_ID, "worker-1")
        captured, answer = exchange(first.dial(), codec, hello("worker-1"))
        assert isinstance(answer, JoinAccept)
        dropped = first.svc.dropped
        # Replayed on a new connection of the same run: nothing, and nobody new.
        replay = first.dial()
        replay.send_multipart(captured)
        assert silent(replay), "a replayed hello was answered"
        assert first.members() == ["worker-1"]
        assert first.svc.dropped == dropped + 1
    finally:
        first.close()
    # A later run under the same pre-shared key: the replay comes first, then the real host.
    second = Run(ctx, key)
    try:
        replay = second.dial()
        replay.send_multipart(captured)
        assert silent(replay), "a hello of an earlier run was answered"
        assert second.members() == [], "a replayed hello admitted a phantom host"
        assert real_agent_joins(second, "worker-1"), "the real host was not admitted after the replay"
    finally:
        second.close()


def test_a_stranger_gets_no_answer_at_all(ctx):
    run = Run(ctx, new_key())
    try:
        stranger = Codec(new_key(), JOIN_RUN_ID, "stranger")  # a key of its own
        sent: list[tuple[zmq.Socket, str]] = []
        for rec in (ChallengeRequest(b"s" * 16), JoinHello("x", ["cpu:0"], SIG, PROTOCOL_VERSION, None, bytes(16)),
                    StatusRequest(bytes(16))):
            s = run.dial()
            s.send_multipart(stranger.encode(rec, channel=Channel.JOIN))
            sent.append((s, f"a stranger's {rec.KIND}"))
        # Another protocol version, with a wrong key and with garbage for a MAC: the version
        # is read before the MAC, and used to draw a join.reject signed with the run's key.
        header, *_ = stranger.encode(ChallengeRequest(b"s" * 16), channel=Channel.JOIN)
        head = msgpack.unpackb(header)
        head["v"] = PROTOCOL_VERSION + 1
        header = msgpack.packb(head, use_bin_type=True)
        for tag in (compute_mac(new_key(), header, []), b"\0" * 32, b"junk"):
            s = run.dial()
            s.send_multipart([header, tag])
            sent.append((s, f"a stranger's wrong-version frame with MAC {tag[:4]!r}"))
        # All six at once, given SILENT_MS together: a service that answers any of them does so within it.
        drew = [sent[i][1] for i in answered([s for s, _ in sent])]
        assert not drew, f"answered: {drew}"
        assert run.svc.dropped == 6
        assert run.members() == []
    finally:
        run.close()


def test_a_captured_status_request_replayed_later_gets_no_answer(ctx):
    key = new_key()
    run = Run(ctx, key)
    try:
        codec = Codec(key, JOIN_RUN_ID, "status")
        captured, answer = exchange(run.dial(), codec, StatusRequest)
        assert isinstance(answer, StatusReply)
        replay = run.dial()
        replay.send_multipart(captured)
        assert silent(replay), "a replayed status request was answered"
    finally:
        run.close()
    later = Run(ctx, key)
    try:
        replay = later.dial()
        replay.send_multipart(captured)
        assert silent(replay), "a status request of an earlier run was answered"
    finally:
        later.close()


def test_a_nonce_is_good_once_on_its_own_connection_and_the_outstanding_ones_are_capped():
    c = Challenges(ttl_s=10.0, cap=3)
    n = c.issue(b"a", 0.0)
    assert c.take(b"b", n, 1.0) == "unknown"  # another connection
    assert c.take(b"a", n, 1.0) == "ok"
    assert c.take(b"a", n, 1.0) == "unknown"  # used
    late = c.issue(b"a", 0.0)
    assert c.take(b"a", late, 10.0) == "expired"
    for i in range(10):
        c.issue(bytes([i]), float(i))
    assert len(c) == 3
    c.issue(b"z", 100.0)  # the expired go first
    assert len(c) == 1


def test_a_challenge_answers_only_a_well_formed_request_and_its_nonce_is_the_one_taken():
    # One exchange for the membership and the status server (Challenges.answer).
    c = Challenges(ttl_s=10.0)
    assert c.answer(b"a", ChallengeRequest(bytes(15)), 0.0) is None  # dropped unanswered
    challenge = c.answer(b"a", ChallengeRequest(bytes(16)), 0.0)
    assert challenge.client_nonce == bytes(16) and challenge.ttl_s == 10.0
    assert c.take(b"a", challenge.nonce, 1.0) == "ok"
