"""Sharded reduction over real sockets in one process (PROTOCOL.md 10.9): the controller's reducer and a
shard in each of two relays, four scripted ranks; each shard reduces its slice, every rank gets the whole."""

from __future__ import annotations

import queue
import socket
import time

import numpy as np
import pytest
import zmq

from flodl_zmq.controller_shards import shard_starts
from flodl_zmq.errors import ConfigError
from flodl_zmq.outer import OuterConfig, OuterOptimizer
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_messages import OuterSlice
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.shards import Cut, OuterGather, ShardMap
from flodl_zmq.wire import new_key
from flodl_zmq.wire_format import F32, WireFormat, named

from .dataplane_helpers import ROUTE_SECRET, WAIT_S, FakeRank, endpoints, model, reference, token
from .test_round import HOSTS, MASS, check_consensus

pytestmark = pytest.mark.timeout(60)

# One chunk (PROTOCOL.md 3.4) of 4 blocks, the last short: cut between the 3 shards, a block or so each.
SIZES = (3 * 4096 + 7,)


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 now (a shard binds both)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65534:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


class ShardedCluster:
    def __init__(self, tmp_path, wire: WireFormat = F32, outer: OuterOptimizer | None = None,
                 starts: bool = True):
        """`outer`: the run's outer step over the whole model, cut as the controller cuts it (shard_starts);
        `starts`: False, the controller's reducer sends the host shards no start (a build of another version)."""
        self.ctx = zmq.Context()
        self.key, self.run_id = new_key(), bytes(range(16))
        eps = endpoints("ipc", tmp_path)
        self.shards = ShardMap(tuple((h, f"tcp://127.0.0.1:{free_port_pair()}") for h in HOSTS))
        self.cut = Cut.of(self.shards, sum(SIZES), wire.frames_per_chunk)
        outer0, shard_start = shard_starts(self.shards, self.cut, outer)
        self.reducer = ReducerService(
            ReducerConfig(HOSTS, self.key, self.run_id, eps["data"], eps["bcast"], probe_interval_s=0.05, wire=wire,
                          route_secret=ROUTE_SECRET, shard_hosts=tuple(HOSTS)),
            self.ctx, outer0, starts=shard_start if starts else None,
        )
        self.reducer.start()
        self.relays: dict[str, Relay] = {}
        for host, ranks in HOSTS.items():
            cfg = RelayConfig(host, ranks, self.key, self.run_id, eps["control"], eps["data"], eps["bcast"],
                              eps[f"{host}-control"], eps[f"{host}-data"], consensus_wait_at_relay_s=0.3, wire=wire,
                              host_token=token(host), shards=self.shards)
            data, bcast = self.shards.endpoints(self.shards.shard_of(host))
            shard = ReducerConfig(HOSTS, self.key, self.run_id, data, bcast, probe_interval_s=0.05, wire=wire,
                                  route_secret=ROUTE_SECRET, shard=self.shards.shard_of(host))
            self.relays[host] = Relay(cfg, self.ctx, shard=shard)
            self.relays[host].start()
        self.ranks = {r: FakeRank(self.ctx, r, self.key, self.run_id, eps[f"{h}-control"], eps[f"{h}-data"])
                      for h, rs in HOSTS.items() for r in rs}

    def round(self, round_id: int, dtype: str, ranks=None) -> dict:
        contribs = {}
        for r in self.ranks if ranks is None else ranks:
            params = model(r, round_id, SIZES)
            wire = [(p * MASS[r]).astype(np.float32) for p in params]
            if dtype == "bf16":
                from .dataplane_helpers import to_wire
                wire = to_wire(params, MASS[r], dtype)
            self.ranks[r].deposit(round_id, MASS[r], wire, dtype)
            contribs[r] = (params, MASS[r])
        return contribs

    def close(self) -> None:
        for r in self.ranks.values():
            r.close()
        for relay in self.relays.values():
            relay.stop()
        self.reducer.stop()
        self.ctx.destroy(0)


@pytest.fixture
def sharded(request, tmp_path):
    dtype = request.node.callspec.params.get("dtype", "f32") if hasattr(request.node, "callspec") else "f32"
    c = ShardedCluster(tmp_path, named(dtype))
    yield c
    c.close()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_three_shards_each_reduce_their_slice_and_every_rank_gets_the_whole_weighted_mean(sharded, dtype):
    for round_id in (1, 2, 3):
        contribs = sharded.round(round_id, dtype)
        for rank in sharded.ranks.values():
            env = rank.consensus()
            assert env.record.round == round_id
            assert [a.size for a in env.payload] == list(SIZES)
            check_consensus(env, contribs, dtype)
        out = sharded.reducer.completed.get(timeout=WAIT_S)
        assert (out.round_id, out.hosts) == (round_id, ("a", "b"))
    # Each shard summed its own values only, a part of the one chunk each: a block, a block, and the rest.
    assert [t.size for t in sharded.reducer.ledger.latest.tensors] == [4096]
    assert [t.size for t in sharded.relays["a"].shard.ledger.latest.tensors] == [4096]
    assert [t.size for t in sharded.relays["b"].shard.ledger.latest.tensors] == [4103]


def test_a_slice_a_host_shard_failed_to_broadcast_is_asked_for_and_the_round_completes(sharded):
    sharded.round(1, "f32")
    for rank in sharded.ranks.values():
        rank.consensus()
    sharded.relays["b"].shard.drop_broadcast(2)
    contribs = sharded.round(2, "f32")
    for rank in sharded.ranks.values():
        env = rank.consensus()
        assert env.record.round == 2
        check_consensus(env, contribs, "f32")
    assert sharded.relays["b"].shard.counters()["broadcasts_dropped_on_purpose"] == 1
    assert all(relay.counters()["consensus_requests"] >= 1 for relay in sharded.relays.values())


def test_a_death_the_coordinator_declares_reaches_every_shard_so_none_waits_for_a_dead_host(sharded):
    contribs = sharded.round(1, "f32", ranks=[0, 1])
    with pytest.raises(queue.Empty):
        sharded.reducer.completed.get(timeout=0.3)
    sharded.reducer.declare_dead(2)
    sharded.reducer.declare_dead(3)
    assert sharded.reducer.completed.get(timeout=WAIT_S).hosts == ("a",)
    for r in (0, 1):
        check_consensus(sharded.ranks[r].consensus(), contribs, "f32")
    assert sharded.relays["a"].shard.ledger.is_dead(2) and sharded.relays["a"].shard.ledger.is_dead(3)


def test_each_relay_takes_its_host_shards_outcomes_so_its_loop_sleeps_between_rounds(sharded):
    # The relay's loop watches its shard's outcomes (the shard's failure ends the relay). Left unread, the
    # outcome's wake-up stays set and the relay's data thread spins: a core per relay, which on 2 cores
    # made bench/topology.py's 8-host sharded round CPU-bound.
    for round_id in (1, 2):
        sharded.round(round_id, "f32")
        for rank in sharded.ranks.values():
            rank.consensus()
    deadline = time.monotonic() + WAIT_S
    shards = [relay.shard for relay in sharded.relays.values()]
    while any(len(shard.completed) for shard in shards) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [len(shard.completed) for shard in shards] == [0, 0], "a relay left its shard's outcomes unread"


def test_a_run_whose_ranks_all_left_ends_its_shards_without_a_warning(sharded, caplog):
    # Every rank gone is the run's normal end: each shard closes its books ("no round open"), and a user
    # reading the log of a run that went well must not find a relay warning that a round was abandoned.
    sharded.round(1, "f32")
    for rank in sharded.ranks.values():
        rank.consensus()
    shards = [relay.shard for relay in sharded.relays.values()]
    with caplog.at_level("INFO"):
        for rank in sharded.ranks:
            sharded.reducer.declare_dead(rank)
        deadline = time.monotonic() + WAIT_S
        # The controller's reducer and both host shards end; then both relays take their shard's end.
        while sum("no round open" in r.getMessage() for r in caplog.records) < 3 or any(
                len(shard.completed) for shard in shards):
            assert time.monotonic() < deadline, caplog.text[-2000:]
            time.sleep(0.01)
        for relay in sharded.relays.values():
            relay.stop()  # its loop has logged all it will about the outcomes it took
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "abandoned" in r.getMessage()] == []


@pytest.mark.parametrize("kind", ["nesterov", "momentum"])
def test_with_an_outer_step_each_shard_steps_its_slice_and_the_ranks_get_the_whole_models_step(tmp_path, kind):
    # The controller's reducer and two host shards each step their own slice, from the start the controller
    # cut; every rank gets what one reducer stepping the whole model gives, value for value. The last
    # 7 values are buffers: averaged, never stepped.
    n = sum(SIZES)
    start = np.linspace(-2, 2, n, dtype=np.float32)
    config = OuterConfig.of(kind, None, None)
    whole = OuterOptimizer(config, start, np.full(n, 0.01, dtype=np.float32), stepped=n - 7)
    c = ShardedCluster(tmp_path, outer=OuterOptimizer(config, start, whole.momentum, stepped=n - 7))
    try:
        for round_id in (1, 2, 3):
            contribs = c.round(round_id, "f32")
            expected = reference(list(contribs.values()), "f32")[0].astype(np.float32)
            whole.step([expected])
            for rank in c.ranks.values():
                env = rank.consensus()
                assert env.record.round == round_id
                np.testing.assert_allclose(env.payload[0], expected, rtol=1e-5, atol=1e-5)
            c.reducer.completed.get(timeout=WAIT_S)
        assert whole.momentum[:n - 7].any() and not whole.momentum[n - 7:].any()
        for relay in c.relays.values():  # each host shard steps its slice from its start: not an average
            assert relay.shard.ledger.outer is not None and relay.shard.ledger.outer.config == config
        # A bundle asks every shard for its slice of the state (PROTOCOL.md 10.9 item 12): the controller's
        # reducer puts its own and each host shard's, sent through its relay, on its outcomes.
        gather = OuterGather(c.cut)
        c.reducer.want_state(3)
        deadline = time.monotonic() + WAIT_S
        while gather.whole is None:
            assert time.monotonic() < deadline, "the shards' outer state never came whole"
            for out in c.reducer.completed.drain():
                if isinstance(out, OuterSlice):
                    gather.add(out.shard, out.round_id, out.payload)
            time.sleep(0.01)
        round_id, model, momentum = gather.whole
        assert round_id == 3
        np.testing.assert_allclose(model, whole.global_model, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(momentum, whole.momentum, rtol=1e-5, atol=1e-6)
    finally:
        c.close()


def test_a_host_shard_holds_the_frames_that_come_before_its_start_and_sums_them_once_it_has_it(tmp_path):
    # The controller's reducer here sends no start: both host shards hold every host frame, and no round ends.
    c = ShardedCluster(tmp_path, starts=False)
    try:
        contribs = c.round(1, "f32")
        deadline = time.monotonic() + WAIT_S
        shards = [relay.shard for relay in c.relays.values()]
        while any(s.counters().get("frames_before_start", 0) < 2 for s in shards):
            assert time.monotonic() < deadline, [s.counters() for s in shards]
            time.sleep(0.01)
        with pytest.raises(TimeoutError):
            c.ranks[0].consensus(timeout=0.5)
        # The relays' hellos to the controller's reducer go on unacknowledged, waiting for the start; a relay's
        # request for the round is no sign of a lost frame before it (no frame is asked for again).
        assert all(relay.counters()["hello_ack_before_start"] >= 1 for relay in c.relays.values())
        assert all(not any(k.startswith("frames_resent") for k in relay.counters()) for relay in c.relays.values())
        # Now the start comes, as the relay hands it over: the held frames are summed, the round ends.
        _, starts = shard_starts(c.shards, c.cut, None)
        for host, relay in c.relays.items():
            relay.shard.start_from(*starts[host])
        for rank in c.ranks.values():
            check_consensus(rank.consensus(), contribs, "f32")
    finally:
        c.close()


def test_a_start_for_another_shard_fails_the_host_shard_and_its_relay_naming_the_shard_maps(tmp_path):
    c = ShardedCluster(tmp_path, starts=False)
    try:
        _, starts = shard_starts(c.shards, c.cut, None)
        relay = c.relays["a"]
        relay.shard.start_from(*starts["b"])  # shard 2's start, to shard 1
        deadline = time.monotonic() + WAIT_S
        while relay.error is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert "sent the start of shard 2" in str(relay.error) and "FLODL_SHARDS" in str(relay.error)
    finally:
        c.close()


def test_a_relay_whose_host_the_shard_map_lists_refuses_to_start_without_its_shard(tmp_path):
    eps = endpoints("ipc", tmp_path)
    shards = ShardMap((("a", "tcp://127.0.0.1:7400"),))
    cfg = RelayConfig("a", (0, 1), new_key(), bytes(16), eps["control"], eps["data"], eps["bcast"], eps["a-control"],
                      eps["a-data"], host_token=token("a"), shards=shards)
    with pytest.raises(ConfigError, match="lists this host, so its relay must run that shard"):
        Relay(cfg)
