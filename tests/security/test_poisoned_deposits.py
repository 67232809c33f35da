"""Finding 4 (issue 15): one host must not NaN or dominate the consensus.

Each test performs the attack over real sockets (a real reducer and relays in
one process, scripted ranks, and a hand-made relay where the attack is a
HostFrame) and asserts that the round completes without the attacker, with the
honest ranks' exact weighted mean.
"""

from __future__ import annotations

import time

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

from flodl_zmq.errors import FoldError, PoisonedDeposit
from flodl_zmq.fold import FoldStation, check_finite
from flodl_zmq.int8 import BLOCK
from flodl_zmq.links import host_token, relay_sender
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_messages import HostRefused
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.sums import PIECE
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import HostFrame, RankExit, RelayHello
from flodl_zmq.wire_format import INT8, Hop

pytestmark = pytest.mark.timeout(60)

MASS = {0: 1.0, 1: 3.0, 2: 0.5, 3: 2.0}


class World:
    """A reducer and real relays for `real` hosts; `fake` hosts are left for a hand-made relay."""

    def __init__(self, tmp_path, hosts: dict[str, tuple[int, ...]], real: tuple[str, ...], aggregation: str = "mean"):
        self.ctx = zmq.Context()
        self.key, self.run_id = new_key(), bytes(range(16))
        self.eps = eps = endpoints("ipc", tmp_path)
        self.reducer = ReducerService(
            ReducerConfig(hosts, self.key, self.run_id, eps["data"], eps["bcast"], probe_interval_s=0.05,
                          route_secret=ROUTE_SECRET, aggregation=aggregation), self.ctx)
        self.reducer.start()
        self.relays = {}
        for host in real:
            cfg = RelayConfig(host, hosts[host], self.key, self.run_id, eps["control"], eps["data"], eps["bcast"],
                              eps[f"{host}-control"], eps[f"{host}-data"], rank_silence_at_relay_s=30.0,
                              host_token=host_token(ROUTE_SECRET, host), aggregation=aggregation)
            self.relays[host] = Relay(cfg, self.ctx)
            self.relays[host].start()
        self.ranks = {r: FakeRank(self.ctx, r, self.key, self.run_id, eps[f"{h}-control"], eps[f"{h}-data"])
                      for h in real for r in hosts[h]}

    def deposit(self, rank: int, round_id: int, tensors=None, mass: float | None = None) -> None:
        m = MASS[rank] if mass is None else mass
        self.ranks[rank].deposit(round_id, m, tensors if tensors is not None else to_wire(model(rank, round_id), m,
                                                                                            "f32"))

    def close(self) -> None:
        for r in self.ranks.values():
            r.close()
        for relay in self.relays.values():
            relay.stop()
        self.reducer.stop()
        self.ctx.destroy(0)


def honest_mean(round_id: int, ranks) -> list[np.ndarray]:
    return reference([(model(r, round_id), MASS[r]) for r in ranks], "f32")


def test_a_rank_depositing_a_nan_leaves_and_the_round_completes_without_it(tmp_path):
    w = World(tmp_path, {"a": (0, 1), "b": (2, 3)}, real=("a", "b"))
    try:
        poisoned = to_wire(model(1, 1), MASS[1], "f32")
        poisoned[0][123] = np.nan  # one element is enough to NaN every rank's model
        w.deposit(0, 1)
        w.deposit(1, 1, poisoned)
        w.deposit(2, 1)
        w.deposit(3, 1)
        out = w.reducer.completed.get(timeout=WAIT_S)
        assert (out.round_id, out.hosts) == (1, ("a", "b"))
        assert out.mass == pytest.approx(MASS[0] + MASS[2] + MASS[3])
        for r in (0, 2, 3):
            env = w.ranks[r].consensus()
            got = [p.astype(np.float64) for p in env.payload]
            assert all(np.isfinite(p).all() for p in got)
            assert rel_error(got, honest_mean(1, (0, 2, 3))) < 1e-6
        assert w.relays["a"].running, "one rank's bad deposit must not stop its host's relay"
        assert w.relays["a"].counters()["poisoned.local_data"] == 1
        deadline = time.monotonic() + WAIT_S
        while not w.reducer.ledger.is_dead(1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert w.reducer.ledger.is_dead(1), "the relay reports the rank gone (RankExit)"
        # The next round goes on without it.
        for r in (0, 2, 3):
            w.deposit(r, 2)
        assert w.reducer.completed.get(timeout=WAIT_S).round_id == 2
    finally:
        w.close()


def wait_dead(w: World, rank: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while not w.reducer.ledger.is_dead(rank) and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_rank_claiming_mass_1e30_leaves_alone_and_its_honest_host_mate_is_reduced(tmp_path):
    w = World(tmp_path, {"a": (0, 1), "b": (2, 3)}, real=("a", "b"))
    try:
        # The coordinator counted 10 steps for each rank at the trigger (MassBound: 2 * 10 + 64).
        w.reducer.bound_round(1, {r: 84.0 for r in range(4)})
        liar = 1e30
        w.deposit(1, 1, to_wire(model(1, 1), liar, "f32"), mass=liar)  # finite, premultiplied, huge; first
        w.deposit(0, 1)
        w.deposit(2, 1)
        w.deposit(3, 1)
        out = w.reducer.completed.get(timeout=WAIT_S)
        assert (out.round_id, out.hosts, out.mass) == (1, ("a", "b"), MASS[0] + MASS[2] + MASS[3])
        env = w.ranks[0].consensus()
        assert rel_error([p.astype(np.float64) for p in env.payload], honest_mean(1, (0, 2, 3))) < 1e-6
        assert w.relays["a"].counters()["poisoned.local_data"] == 1
        wait_dead(w, 1)
        assert w.reducer.ledger.is_dead(1) and not w.reducer.ledger.is_dead(0)
    finally:
        w.close()


@pytest.mark.parametrize("value", [1e30, 1e18])
def test_a_rank_depositing_finite_huge_parameters_leaves_named_and_its_host_mate_is_unaffected(tmp_path, caplog,
                                                                                              value):
    w = World(tmp_path, {"a": (0, 1), "b": (2, 3)}, real=("a", "b"))
    try:
        for r in range(4):  # a first round, so the tiers hold a consensus to measure against
            w.deposit(r, 1)
        assert w.reducer.completed.get(timeout=WAIT_S).round_id == 1
        for r in range(4):
            w.ranks[r].consensus()
        poisoned = to_wire(model(1, 2), MASS[1], "f32")
        poisoned[0][:] = value * MASS[1]  # finite: the NaN check lets it by
        w.deposit(0, 2)
        w.deposit(1, 2, poisoned)
        w.deposit(2, 2)
        w.deposit(3, 2)
        out = w.reducer.completed.get(timeout=WAIT_S)
        assert (out.round_id, out.hosts, out.mass) == (2, ("a", "b"), MASS[0] + MASS[2] + MASS[3])
        env = w.ranks[0].consensus()
        got = [p.astype(np.float64) for p in env.payload]
        assert rel_error(got, honest_mean(2, (0, 2, 3))) < 1e-6, "the honest host-mate's deposit is reduced"
        assert max(float(np.abs(p).max()) for p in got) < 1e3, "its next consensus is sane"
        assert w.relays["a"].counters()["poisoned.local_data"] == 1
        assert any("rank 1 leaves" in m and "magnitude" in m for m in caplog.messages), caplog.messages
        wait_dead(w, 1)
        assert w.reducer.ledger.is_dead(1) and not w.reducer.ledger.is_dead(0)
    finally:
        w.close()


def test_a_refused_rank_is_reported_gone_to_the_controller_at_once(tmp_path):
    # The coordinator must hear it on the control channel, or it keeps the rank live and
    # waits on work whose deposits no round will take (a run stalled for seconds per round).
    w = World(tmp_path, {"a": (0, 1), "b": (2, 3)}, real=("a", "b"))
    controller = w.ctx.socket(zmq.ROUTER)
    controller.bind(w.eps["control"])
    try:
        poisoned = to_wire(model(1, 1), MASS[1], "f32")
        poisoned[0][:] = 1e30
        w.deposit(1, 1, poisoned)
        w.deposit(0, 1)  # held for the sum with its host-mate's: the pass that sums them refuses it
        codec, deadline, gone = Codec(w.key, w.run_id, "controller"), time.monotonic() + WAIT_S, None
        while gone is None and time.monotonic() < deadline:
            if controller.poll(100):
                frames = controller.recv_multipart()
                env = codec.decode(frames[2:], Channel.CONTROL)
                if isinstance(env.record, RankExit):
                    gone = (env.sender, env.record.rank)
        assert gone == (relay_sender("a"), 1), "the relay reports the refused rank upstream on the control channel"
    finally:
        controller.close(0)
        w.close()


def test_a_host_frame_with_a_nan_or_too_much_mass_is_refused_and_the_round_completes_without_it(tmp_path):
    hosts = {"a": (0, 1), "b": (2,), "c": (3,)}
    w = World(tmp_path, hosts, real=("a",))
    fakes = {}
    try:
        for host in ("b", "c"):  # key holders running their own relay code
            sock = w.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(w.eps["data"])
            codec = Codec(w.key, w.run_id, relay_sender(host))
            sock.send_multipart(codec.encode(RelayHello(host, list(hosts[host]), [], host_token(ROUTE_SECRET, host)), channel=Channel.DATA))
            fakes[host] = (sock, codec)
        w.reducer.bound_round(1, {r: 84.0 for r in range(4)})
        for sock, _ in fakes.values():
            assert sock.poll(int(WAIT_S * 1000)), "no RelayHelloAck"
            sock.recv_multipart()
        nan = to_wire(model(2, 1), MASS[2], "f32")
        nan[1][0] = np.inf
        sock, codec = fakes["b"]
        sock.send_multipart(codec.encode(HostFrame(1, "b", [2], MASS[2]), nan, channel=Channel.DATA))
        sock, codec = fakes["c"]
        heavy = to_wire(model(3, 1), 1e6, "f32")
        sock.send_multipart(codec.encode(HostFrame(1, "c", [3], 1e6), heavy, channel=Channel.DATA))
        w.deposit(0, 1)
        w.deposit(1, 1)
        outcomes = [w.reducer.completed.get(timeout=WAIT_S) for _ in range(3)]
        # Each refused host is the coordinator's to hear at once (its relay, a liar here, is not asked to);
        # the heavy one once its bound has not risen for MASS_WAIT_S.
        refused = {(o.host, o.ranks): o.reason for o in outcomes if isinstance(o, HostRefused)}
        assert refused.keys() == {("b", (2,)), ("c", (3,))} and "exceeds" in refused["c", (3,)]
        [out] = [o for o in outcomes if not isinstance(o, HostRefused)]
        assert (out.round_id, out.hosts, out.mass) == (1, ("a",), MASS[0] + MASS[1])
        env = w.ranks[0].consensus()
        assert rel_error([p.astype(np.float64) for p in env.payload], honest_mean(1, (0, 1))) < 1e-6
        assert w.reducer.counters()["poisoned_frames"] == 2
    finally:
        for sock, _ in fakes.values():
            sock.close(0)
        w.close()


@pytest.mark.parametrize("bits", [0x7FC0, 0x7F80, 0xFF80, 0xFFC1])  # NaN, +inf, -inf, negative NaN
def test_a_bf16_deposit_with_a_non_finite_element_is_refused_and_the_round_ships_without_it(bits):
    bad = np.full(3 * PIECE + 5, 0x3F80, np.uint16)  # 1.0 in bf16, over several pieces
    bad[-1] = bits
    ok = np.full(bad.size, 0x4000, np.uint16)  # 2.0
    # Two ranks: the bad deposit is found by the pass that sums the pair.
    station = FoldStation((0, 1))
    assert station.deposit(0, 1, 1.0, [bad]) is None
    out = station.deposit(1, 1, 2.0, [ok])
    assert out is not None and out.ranks == (1,) and out.mass == 2.0 and out.verbatim
    assert [r for r, _ in station.refused] == [0] and 0 in station.dead
    # Three ranks: the third deposit goes into the running sums, checked before it touches them.
    station = FoldStation((0, 1, 2))
    station.deposit(0, 1, 1.0, [ok])
    station.deposit(1, 1, 1.0, [ok])
    with pytest.raises(PoisonedDeposit, match="NaN or infinite"):
        station.deposit(2, 1, 1.0, [bad])
    out = station.mark_dead(2)
    assert out is not None and out.ranks == (0, 1) and out.mass == 2.0
    assert np.array_equal(out.tensors[0], np.full(bad.size, 0x4080, np.uint16))  # 2 + 2 = 4.0


def test_finite_f16_and_f32_deposits_whose_sum_overflows_are_not_refused():
    check_finite([np.full(1000, 60000, np.float16), np.full(1000, 3e38, np.float32)], "test")
    with pytest.raises(PoisonedDeposit):
        check_finite([np.full(1000, 60000, np.float16), np.array([np.inf], np.float16)], "test")


def test_an_int8_deposit_whose_scale_is_1e30_is_refused_and_its_host_mate_ships_alone():
    n = 2 * BLOCK
    hop = Hop("relay a", INT8, FoldError)
    ok = INT8.layout(n)
    good = [np.empty(size, dtype) for dtype, size in ok]
    INT8.encode_into(np.full(n, 0.5, np.float32), good, INT8.feedback(n))
    bad = [np.full(n, 50, np.int8), np.array([1e-2, 1e30], np.float32)]  # 50 * 1e30 = 5e31 in the second block
    station = FoldStation((0, 1))
    assert station.deposit(0, 1, 1.0, hop.take(0, good)) is None
    out = station.deposit(1, 1, 1.0, hop.take(1, bad))  # held: the pass that sums the pair refuses it
    assert [r for r, why in station.refused if "magnitude" in why] == [1]
    assert out is not None and out.ranks == (0,) and out.mass == 1.0
    assert float(np.abs(out.tensors[0]).max()) < 1.0


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean"])
@pytest.mark.parametrize("attack", ["scaled", "garbage"])
def test_with_a_robust_aggregation_one_poisoning_rank_of_four_stays_inside_the_honest_range(tmp_path, aggregation,
                                                                                            attack):
    w = World(tmp_path, {"a": (0, 1), "b": (2, 3)}, real=("a", "b"), aggregation=aggregation)
    try:
        honest = {r: model(r, 1) for r in (0, 2, 3)}
        if attack == "scaled":  # -10x its own model: finite, and small enough to pass the magnitude bound
            poison = [-10.0 * p for p in model(1, 1)]
        else:  # large finite garbage just under the magnitude bound
            poison = [np.full(p.shape, 9e5) for p in model(1, 1)]
        w.deposit(1, 1, to_wire(poison, MASS[1], "f32"))
        for r in (0, 2, 3):
            w.deposit(r, 1)
        out = w.reducer.completed.get(timeout=WAIT_S)
        assert (out.round_id, out.hosts) == (1, ("a", "b"))
        for r in range(4):
            got = w.ranks[r].consensus().payload
            for i, g in enumerate(got):
                stack = np.stack([honest[h][i] for h in honest]).astype(np.float32)
                assert (stack.min(axis=0) <= g).all() and (g <= stack.max(axis=0)).all(), (r, i)
    finally:
        w.close()
