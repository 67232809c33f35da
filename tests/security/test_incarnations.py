"""Issue 27, item 1: messages recorded in one incarnation of a run, replayed to the next.

A controller restarted with `--resume`, and a world re-formed after a
mid-run join, keep the run id and the session key, and every process of the
new incarnation starts its sequence ledgers empty. While the header's `run`
was the run id, a recording of the incarnation before was therefore fresh to
every ledger: a replayed relay hello took the host's route (and the genuine
relay was refused), a replayed host frame was reduced, a replayed rank exit
on a join link declared a live rank gone. Now every controller start and
every re-form draws a fresh incarnation id, the header's `run`, and a
receiver refuses any other (PROTOCOL.md 4.1, 7 step 15: IncarnationError).

The attacker holds no key: it replays bytes the genuine processes of the
incarnation before sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
import zmq
from transport.dataplane_helpers import ROUTE_SECRET, WAIT_S, endpoints, token
from transport.test_controller import WORLD, ScriptedRelay, job
from transport.test_reducer import WORLD as REDUCER_WORLD
from transport.test_reducer import FakeRelay, frame

from flodl_zmq.controller_service import ControllerService
from flodl_zmq.datasets import dataset_signature
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv, SpawnSpec
from flodl_zmq.host_links import RankExitReported
from flodl_zmq.join import JoinConfig, JoinWindow
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import RELAY_ROUTE, rank_identity, rank_sender, relay_sender
from flodl_zmq.membership import MembershipService
from flodl_zmq.payload import model_signature
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.settings import Settings
from flodl_zmq.trust import JOIN_RUN_ID, TrustMode
from flodl_zmq.wire import PROTOCOL_VERSION, Channel, Codec, new_incarnation, new_key
from flodl_zmq.wire import records as rec

pytestmark = pytest.mark.timeout(90)

RUN_ID = bytes(range(16))  # the run's id: the same in both incarnations, as after a restart or a re-form


def until(done: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for an event the test cannot be told of directly."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"not within {WAIT_S:g} s: {what}"
        time.sleep(0.01)


def recorded_hellos(key: bytes, incarnation: bytes) -> list[list[bytes]]:
    """What the genuine relay of `incarnation` sent to the controller: its hello, then its ranks' hellos."""
    j = job()
    torch.manual_seed(j.seed)  # the replica every process of the run starts from
    sigs = {"model_sig": model_signature(j.model()), "dataset_sig": dataset_signature(j.dataset)}
    relay = Codec(key, incarnation, relay_sender("h"))
    out = [[RELAY_ROUTE, *relay.encode(rec.RelayHello(host="h", ranks=[0, 1], model_sigs=[], token=token("h")),
                                       channel=Channel.CONTROL)]]
    for r in WORLD["h"]:
        hello = rec.RankHello(rank=r, world_size=2, host="h", **sigs)
        out.append([rank_identity(r), *Codec(key, incarnation, rank_sender(r)).encode(hello, channel=Channel.CONTROL)])
    return out


def test_hellos_of_the_incarnation_before_take_no_route_and_form_no_world():
    key, before, now = new_key(), new_incarnation(), new_incarnation()
    recorded = recorded_hellos(key, before)
    ctx = zmq.Context()
    address = ControllerAddress("127.0.0.1", free_port_base())
    # The controller of the next incarnation: the same run id and key, a fresh incarnation id.
    penv = ProcessEnv(role="controller", controller=address, key=key, run_id=RUN_ID, incarnation=now, world=WORLD,
                      settings=Settings(startup_timeout_s=WAIT_S), route_secret=ROUTE_SECRET)
    j = job()
    service = ControllerService(j, penv)
    thread = threading.Thread(target=lambda: _quietly(service.run), daemon=True)
    thread.start()
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(address.endpoint(Channel.CONTROL))
    relay = ScriptedRelay(ctx, address.endpoint(Channel.CONTROL), key, now, j)
    try:
        for frames in recorded:
            attacker.send_multipart(frames)
        until(lambda: service.router.rejected["unknown"]["IncarnationError"] == 3,
              f"the replays refused by their incarnation ({dict(service.router.rejected)})")
        assert service.counts["rejected.control"] == 3 and not service.started
        # The genuine relay of this incarnation still takes its host and forms the world.
        relay.relay_send(rec.RelayHello(host="h", ranks=[0, 1], model_sigs=[], token=token("h")))
        relay.wait_for(RELAY_ROUTE, "RelayHelloAck")
        relay.hello(0)
        relay.hello(1)
        relay.wait_for(rank_identity(1), "StartEpoch")
        assert service.counts["bad_hello.control"] == 0  # not refused as a takeover of a route the replay took
        assert not attacker.poll(0), "the replayer was answered"
    finally:
        for rank in (0, 1):  # the relay reports its ranks gone: the run ends, the service returns
            relay.relay_send(rec.RankExit(rank))
        thread.join(WAIT_S)
        attacker.close(0)
        relay.sock.close(0)
        ctx.term()
    assert not thread.is_alive(), "the controller service outlived its test"


def _quietly(run: Callable[[], object]) -> None:
    try:
        run()
    except Exception:  # noqa: BLE001 - the run ends with every rank gone; the test judges the service, not that
        pass


def test_a_host_frame_of_the_incarnation_before_is_never_reduced(tmp_path):
    key, before, now = new_key(), new_incarnation(), new_incarnation()
    eps = endpoints("inproc", tmp_path)
    ctx = zmq.Context()
    # What host a's relay of the incarnation before sent the reducer: its hello, then its frame of round 1.
    old = Codec(key, before, relay_sender("a"))
    recorded = [old.encode(rec.RelayHello("a", list(REDUCER_WORLD["a"]), [], token("a")), channel=Channel.DATA),
                old.encode(*frame("a", 1, 1.0, 99.0), channel=Channel.DATA)]
    svc = ReducerService(ReducerConfig(REDUCER_WORLD, key, now, eps["data"], eps["bcast"], probe_interval_s=0.05,
                                       route_secret=ROUTE_SECRET), ctx)
    svc.start()
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(eps["data"])
    relays = {h: FakeRelay(ctx, h, key, now, eps) for h in REDUCER_WORLD}
    try:
        for frames in recorded:
            attacker.send_multipart(frames)
        until(lambda: svc.counters().get("rejected") == 2, f"the replays refused ({svc.counters()})")
        for r in relays.values():
            r.hello()  # acknowledged: the replayed hello took no route
        for r in relays.values():
            r.subscribe()
        until(lambda: svc.subscribed() == {"a", "b"}, "both relays subscribed")
        relays["a"].send(*frame("a", 1, 1.0, 2.0))
        relays["b"].send(*frame("b", 1, 3.0, 6.0))
        consensus = relays["a"].broadcast()
        assert consensus.record.round == 1 and np.allclose(consensus.payload[0], (2.0 + 6.0) / 4.0)
        assert svc.completed.get(timeout=WAIT_S).hosts == ("a", "b")
        assert svc.counters().get("bad_hello", 0) == 0 and not attacker.poll(0), "the replayer was answered"
    finally:
        attacker.close(0)
        for r in relays.values():
            r.close()
        svc.stop()
        ctx.destroy(0)


class Membership:
    """One controller start's membership service under the pre-shared `key`: `incarnation` is that start's."""

    def __init__(self, ctx: zmq.Context, key: bytes, incarnation: bytes):
        window = JoinWindow(JoinConfig(min_ranks=2, join_window_s=30.0, join_cap_s=30.0), opened_at=time.monotonic())
        self.svc = MembershipService(
            window, endpoint="tcp://127.0.0.1:*", trust=TrustMode.PRE_SHARED, session_key=key, run_id=RUN_ID,
            incarnation=incarnation, spawn=SpawnSpec(("-c", "pass"), {}), context=ctx,
            join_heartbeat_period_s=0.1, host_silence_at_controller_s=60.0,
        )
        self.svc.start()
        self.ctx, self.key = ctx, key

    def admit(self, host: str) -> tuple[zmq.Socket, rec.JoinAccept]:
        """An honest agent's join exchange on a fresh connection; the connection and the accept."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.svc.endpoint)
        codec = Codec(self.key, JOIN_RUN_ID, host)
        sock.send_multipart(codec.encode(rec.ChallengeRequest(b"c" * 16), channel=Channel.JOIN))
        assert sock.poll(int(WAIT_S * 1000)), "no challenge"
        nonce = codec.decode(sock.recv_multipart(), Channel.JOIN).record.nonce
        hello = rec.JoinHello(host, ["cpu:0"], bytes([7]) * 32, PROTOCOL_VERSION, None, nonce)
        sock.send_multipart(codec.encode(hello, channel=Channel.JOIN))
        while True:  # heartbeats may come first once admitted
            assert sock.poll(int(WAIT_S * 1000)), "no answer to an honest hello"
            answer = codec.decode(sock.recv_multipart(), Channel.JOIN, replay=False).record
            if isinstance(answer, rec.JoinAccept):
                return sock, answer


def test_a_rank_exit_recorded_on_a_join_link_before_a_restart_reports_no_rank_gone():
    key = new_key()
    ctx = zmq.Context()
    first = Membership(ctx, key, new_incarnation())
    try:
        link, accept = first.admit("worker-1")
        # What the agent sent on its admitted link: rank 0 killed (recorded by the attacker).
        recorded = Codec(key, accept.incarnation, "worker-1").encode(rec.RankExited(accept.ranks[0], -9),
                                                                      channel=Channel.JOIN)
        link.close(0)
    finally:
        first.svc.close()
    # The controller restarts (same run id and key, a fresh incarnation) and takes the host back.
    second = Membership(ctx, key, new_incarnation())
    try:
        link, accept = second.admit("worker-1")
        assert accept.run_id == RUN_ID and accept.ranks == [0]
        dropped = second.svc.dropped
        link.send_multipart(recorded)  # inserted into the agent's connection by an attacker on the path
        # Then the agent's own report, on the same connection, after it: rank 0 ended cleanly.
        genuine = Codec(key, accept.incarnation, "worker-1")
        link.send_multipart(genuine.encode(rec.RankExited(0, 0), channel=Channel.JOIN))
        event = second.svc.events.get(timeout=WAIT_S)
        assert event == RankExitReported("worker-1", 0, 0), f"the replayed exit was reported: {event}"
        assert second.svc.dropped == dropped + 1
        link.close(0)
    finally:
        second.svc.close()
        ctx.term()
