"""A resumed world's ranks get their starting model over the wire (PROTOCOL.md 13): reducer, relay, rank on ipc."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from flodl_zmq.rank_link import ConsensusIn, RankConfig, RankLink
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.tensors import DTYPES, bf16_from_f32
from flodl_zmq.wire import new_key
from flodl_zmq.wire.records import RESUME_ROUND, RoundFrame
from flodl_zmq.wire_format import named, of_payload

from .dataplane_helpers import ROUTE_SECRET, WAIT_S, FakeRank, endpoints, token

pytestmark = pytest.mark.timeout(60)

N = 5000  # values of the model: more than one int8 block


def widened(payload: list[np.ndarray]) -> np.ndarray:
    """The f32 model a rank loads from a consensus payload in any wire format."""
    wire = of_payload(payload)
    return wire.widen(payload, np.empty(wire.numel(payload), np.float32))


def resume_payload(consensus: np.ndarray, wire_dtype: str) -> list[np.ndarray]:
    return named(wire_dtype).resume_payload(consensus)


def checkpoint_consensus(wire_dtype: str) -> np.ndarray:
    """A checkpoint's consensus as a run on `wire_dtype` keeps it: a widened broadcast."""
    x = np.random.default_rng(7).standard_normal(N).astype(np.float32)
    return widened(resume_payload(x, wire_dtype))


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16", "int8"])
def test_the_starting_consensus_is_the_checkpoint_in_the_wire_dtype(wire_dtype):
    ckpt = checkpoint_consensus(wire_dtype)
    got = widened(resume_payload(ckpt, wire_dtype))
    if wire_dtype == "int8":  # quantized afresh: the same int8 values, scales within an f32 rounding
        x = np.random.default_rng(7).standard_normal(N).astype(np.float32)
        assert np.array_equal(resume_payload(ckpt, "int8")[0], resume_payload(x, "int8")[0])
        assert np.allclose(got, ckpt, rtol=1e-6, atol=0)
    else:
        assert np.array_equal(got, ckpt)
    if wire_dtype == "bf16":
        assert resume_payload(ckpt, "bf16")[0].dtype == DTYPES["bf16"]


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16"])
def test_a_resumed_rank_asks_its_relay_and_loads_the_checkpoint_consensus_then_rounds_go_on(tmp_path, wire_dtype):
    ctx = zmq.Context()
    key, run_id = new_key(), bytes(range(16))
    eps = endpoints("ipc", tmp_path)
    ckpt = checkpoint_consensus(wire_dtype)
    wire_format = named(wire_dtype)
    reducer = ReducerService(ReducerConfig({"a": (0, 1)}, key, run_id, eps["data"], eps["bcast"],
                                           probe_interval_s=0.05, wire=wire_format, route_secret=ROUTE_SECRET), ctx,
                             resumed=(RESUME_ROUND, wire_format.resume_payload(ckpt)))
    reducer.start()
    relay = Relay(RelayConfig("a", (0, 1), key, run_id, eps["control"], eps["data"], eps["bcast"],
                              eps["a-control"], eps["a-data"], consensus_wait_at_relay_s=0.5, wire=wire_format,
                              host_token=token("a")), ctx)
    relay.start()
    cfg = RankConfig(rank=0, local_rank=0, world_size=2, host="a", key=key, incarnation=run_id,
                     control_endpoint=eps["a-control"], data_endpoint=eps["a-data"],
                     consensus_wait_at_relay_s=0.5, coordinator_first_contact_at_rank_s=WAIT_S * 6, resumed=True)
    link = RankLink(cfg, ctx, 0.0)
    other = FakeRank(ctx, 1, key, run_id, eps["a-control"], eps["a-data"])
    try:
        link.start()
        got = link.inbox.get(WAIT_S)
        assert isinstance(got, ConsensusIn) and got.env.record.round == RESUME_ROUND
        env = got.env
        assert np.array_equal(widened(list(env.payload)), ckpt)  # the checkpoint, bit for bit
        assert reducer.counters()["consensus_requests"] >= 1
        # The next round is the checkpoint's + 1 and above: the reducer, which began at round 0, takes it.
        wire = np.ones(N, np.float32)
        if wire_dtype == "bf16":
            wire = bf16_from_f32(wire, np.empty(N, DTYPES["bf16"]))
        link.send(RoundFrame(round=5, rank=0, mass=1.0), [wire])
        other.deposit(5, 1.0, [wire], wire_dtype)
        assert reducer.completed.get(timeout=WAIT_S).round_id == 5
        while True:  # rank 1 may or may not have been connected when the relay delivered round 0
            env = link.inbox.get(WAIT_S).env
            if env.record.round == 5:
                break
        assert np.array_equal(widened(list(env.payload)), np.ones(N, np.float32))
    finally:
        link.close()
        other.close()
        relay.stop()
        reducer.stop()
        ctx.destroy(0)
