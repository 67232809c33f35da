"""Whole rounds over real sockets in one process: two relays, one reducer, four scripted ranks."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import torch
import zmq

from flodl_zmq.io_threads import CONTROLLER_IO_THREADS
from flodl_zmq.param_buffers import ParamBuffers
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.wire import new_key
from flodl_zmq.wire_format import CHUNK_MAX_BYTES, CHUNK_VALUES, F32, WireFormat, named

from .dataplane_helpers import (
    ROUTE_SECRET,
    WAIT_S,
    FakeRank,
    endpoints,
    from_wire,
    model,
    reference,
    rel_error,
    tiered_bf16_reference,
    to_wire,
    token,
)

pytestmark = pytest.mark.timeout(60)

HOSTS = {"a": (0, 1), "b": (2, 3)}
MASS = {0: 1.0, 1: 3.0, 2: 0.5, 3: 2.0}


class Cluster:
    def __init__(self, kind: str, tmp_path, rank_silence_at_relay_s: float = 30.0, consensus_wait_at_relay_s: float = 0.3,
                 io_threads: int = 1, wire: WireFormat = F32):
        self.ctx = zmq.Context(io_threads=io_threads)
        self.key, self.run_id = new_key(), bytes(range(16))
        eps = endpoints(kind, tmp_path)
        self.reducer = ReducerService(
            ReducerConfig(HOSTS, self.key, self.run_id, eps["data"], eps["bcast"], probe_interval_s=0.05, wire=wire,
                          route_secret=ROUTE_SECRET),
            self.ctx,
        )
        self.reducer.start()
        self.relays = {}
        for host, ranks in HOSTS.items():
            cfg = RelayConfig(host, ranks, self.key, self.run_id, eps["control"], eps["data"], eps["bcast"],
                              eps[f"{host}-control"], eps[f"{host}-data"],
                              rank_silence_at_relay_s=rank_silence_at_relay_s, consensus_wait_at_relay_s=consensus_wait_at_relay_s,
                              wire=wire, host_token=token(host))
            self.relays[host] = Relay(cfg, self.ctx)
            self.relays[host].start()
        self.ranks = {r: FakeRank(self.ctx, r, self.key, self.run_id, eps[f"{h}-control"], eps[f"{h}-data"])
                      for h, rs in HOSTS.items() for r in rs}

    def round(self, round_id: int, dtype: str, ranks=None):
        ranks = list(self.ranks) if ranks is None else ranks
        contribs = {}
        for r in ranks:
            params = model(r, round_id)
            self.ranks[r].deposit(round_id, MASS[r], to_wire(params, MASS[r], dtype), dtype)
            contribs[r] = (params, MASS[r])
        return contribs

    def outcome(self):
        return self.reducer.completed.get(timeout=WAIT_S)

    def close(self):
        for r in self.ranks.values():
            r.close()
        for relay in self.relays.values():
            relay.stop()
        self.reducer.stop()
        self.ctx.destroy(0)


@pytest.fixture(params=["inproc", "ipc", f"ipc-{CONTROLLER_IO_THREADS}-io-threads"])
def cluster(request, tmp_path):
    # With the controller's I/O threads the reducer pins its data ROUTER and PUB to threads of their own.
    kind, _, threads = request.param.partition("-")
    # A test parametrized by `dtype` runs a world told that wire format.
    dtype = request.node.callspec.params.get("dtype", "f32") if hasattr(request.node, "callspec") else "f32"
    c = Cluster(kind, tmp_path, io_threads=int(threads.split("-")[0]) if threads else 1, wire=named(dtype))
    yield c
    c.close()


def check_consensus(env, contribs, dtype):
    """f32: relative error < 1e-6 against the float64 weighted mean of the wire values.

    bf16: the consensus (and each host's fold, which keeps the schema) is itself
    bf16, so it is compared with the exact-arithmetic result of those roundings:
    equal except for rare one-ulp flips where f32 accumulation lands on the other
    side of a bf16 rounding boundary.
    """
    got = from_wire(env.payload, env.dtypes)
    assert env.record.mass == pytest.approx(sum(m for _, m in contribs.values()))
    if dtype == "f32":
        assert rel_error(got, reference(list(contribs.values()), dtype)) < 1e-6
        return
    tiers = [[contribs[r] for r in ranks if r in contribs] for ranks in HOSTS.values()]
    for g, w in zip(got, tiered_bf16_reference([t for t in tiers if t]), strict=True):
        off = np.abs(g - w) > 0
        assert np.all(np.abs(g - w) <= 2.0**-7 * np.abs(w)), "more than one bf16 ulp off"
        assert np.count_nonzero(off) <= max(1, g.size // 100)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_two_hosts_of_two_ranks_produce_the_weighted_mean(cluster, dtype):
    for round_id in (1, 2, 3):
        contribs = cluster.round(round_id, dtype)
        for rank in cluster.ranks.values():
            env = rank.consensus()
            assert env.record.round == round_id
            check_consensus(env, contribs, dtype)
        out = cluster.outcome()
        assert (out.round_id, out.hosts) == (round_id, ("a", "b"))


def test_dropped_broadcast_is_recovered_point_to_point(cluster):
    cluster.round(1, "f32")
    for rank in cluster.ranks.values():
        rank.consensus()
    cluster.reducer.drop_broadcast(2)
    contribs = cluster.round(2, "f32")
    for rank in cluster.ranks.values():
        env = rank.consensus()
        assert env.record.round == 2
        check_consensus(env, contribs, "f32")
    assert cluster.reducer.counters()["broadcasts_dropped_on_purpose"] == 1
    assert all(relay.counters()["consensus_requests"] >= 1 for relay in cluster.relays.values())


def test_a_host_whose_ranks_are_all_declared_dead_is_not_awaited(cluster):
    contribs = cluster.round(1, "f32", ranks=[0, 1])
    with pytest.raises(queue.Empty):
        cluster.reducer.completed.get(timeout=0.3)
    cluster.reducer.declare_dead(2)
    cluster.reducer.declare_dead(3)
    out = cluster.outcome()
    assert (out.round_id, out.hosts) == (1, ("a",))
    for r in (0, 1):
        check_consensus(cluster.ranks[r].consensus(), contribs, "f32")


def test_declare_dead_unblocks_a_relay_fold(cluster):
    contribs = cluster.round(1, "f32", ranks=[0, 1, 2])
    with pytest.raises(queue.Empty):
        cluster.reducer.completed.get(timeout=0.3)
    cluster.reducer.declare_dead(3)
    out = cluster.outcome()
    assert out.hosts == ("a", "b")
    assert out.mass == pytest.approx(MASS[0] + MASS[1] + MASS[2])
    for r in (0, 1, 2):
        check_consensus(cluster.ranks[r].consensus(), contribs, "f32")
    assert cluster.ranks[3].nothing_within(0.2)  # a dead rank is not fanned out to


def test_a_rank_that_stops_heartbeating_leaves_the_barrier(tmp_path):
    c = Cluster("inproc", tmp_path, rank_silence_at_relay_s=0.5)
    try:
        for rank in c.ranks.values():
            rank.heartbeat()
        contribs = c.round(1, "f32", ranks=[0, 1, 2])
        # Ranks 0-2 keep heartbeating while they wait; rank 3 falls silent.
        envs = {}
        for _ in range(100):
            for r in (0, 1, 2):
                c.ranks[r].heartbeat()
                if r not in envs and c.ranks[r].data.poll(50):
                    envs[r] = c.ranks[r].consensus()
            if len(envs) == 3:
                break
        assert sorted(envs) == [0, 1, 2]
        for env in envs.values():
            check_consensus(env, contribs, "f32")
        assert c.outcome().mass == pytest.approx(MASS[0] + MASS[1] + MASS[2])
        # The relay reported the death upstream (just after shipping the fold), so
        # the reducer's ledger knows it within a moment of the round.
        deadline = time.monotonic() + 5
        while not c.reducer.ledger.is_dead(3) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.reducer.ledger.is_dead(3)
        assert not any(c.reducer.ledger.is_dead(r) for r in (0, 1, 2))
    finally:
        c.close()


def test_one_rank_host_ships_its_deposit_verbatim(tmp_path):
    """A host whose other rank is dead forwards its single deposit's bytes unchanged (re-signed)."""
    c = Cluster("inproc", tmp_path)
    try:
        c.reducer.declare_dead(1)
        params = [np.arange(10, dtype=np.float64) + 0.1]
        t = to_wire(params, 2.0, "f32")
        c.ranks[0].deposit(1, 2.0, t)
        for r in (2, 3):
            c.ranks[r].deposit(1, 0.0, to_wire(params, 0.0, "f32"))
        env = c.ranks[0].consensus()
        assert np.array_equal(from_wire(env.payload, env.dtypes)[0], t[0].astype(np.float64) / 2.0)
    finally:
        c.close()


class Flat(torch.nn.Module):
    """A model whose parameters are `values`, in one tensor."""

    def __init__(self, values: np.ndarray) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.from_numpy(values))


def test_a_model_over_a_chunk_goes_through_relays_and_reducer_in_chunks_and_averages_exactly(tmp_path):
    c = Cluster("ipc", tmp_path)
    try:
        n = CHUNK_VALUES + 4321  # a chunk and a bit
        contribs = {}
        for r in c.ranks:
            params = np.random.default_rng(r).random(n, dtype=np.float32) * (1 + r)
            deposit = ParamBuffers(Flat(params)).snapshot(MASS[r])  # the rank's own cut
            c.ranks[r].deposit(1, MASS[r], [t.numpy() for t in deposit])
            contribs[r] = ([params.astype(np.float64)], MASS[r])
        want = reference(list(contribs.values()), "f32")
        for rank in c.ranks.values():
            env = rank.consensus()
            assert env.record.round == 1 and len(env.payload) == 2
            assert all(f.nbytes <= CHUNK_MAX_BYTES for f in env.payload)
            assert rel_error([np.concatenate(env.payload).astype(np.float64)], want) < 1e-6
        assert c.outcome().round_id == 1
    finally:
        c.close()
