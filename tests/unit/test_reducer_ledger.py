"""The reducer's round ledger (flodl_zmq.reducer.RoundLedger): sum host folds, divide once, never drop a round.

Contract exercised throughout: ranks deposit ``mass * x`` with ``mass``; relays
sum them (never divide); the ledger divides the total once by the total mass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.errors import ProtocolError
from flodl_zmq.fold import FoldStation, HostFold
from flodl_zmq.reducer import Abandoned, Gone, Reduced, RoundLedger, StartGate
from flodl_zmq.tensors import bf16_from_f32, f32_from_bf16
from flodl_zmq.wire.records import HostFrame, ShardStart


def f32(*values: float) -> np.ndarray:
    a = np.array(values, np.float32)
    a.flags.writeable = False
    return a


def bf16(*values: float) -> np.ndarray:
    return bf16_from_f32(np.array(values, np.float32), np.empty(len(values), np.uint16))


def widen(bits: np.ndarray) -> np.ndarray:
    return f32_from_bf16(bits, np.empty(bits.shape, np.float32))


def two_hosts() -> RoundLedger:
    return RoundLedger({"a": [0, 1], "b": [2]})


def test_two_host_average_of_one_round():
    ledger = RoundLedger({"a": [0], "b": [1]})
    assert ledger.deposit("a", 0, 1.0, [f32(1, 2, 3)]) is None
    out = ledger.deposit("b", 0, 1.0, [f32(3, 4, 5)])
    assert isinstance(out, Reduced)
    np.testing.assert_array_equal(out.tensors[0], [2, 3, 4])
    assert (out.round_id, out.mass, out.hosts) == (0, 2.0, ("a", "b"))


def test_a_reduced_round_names_each_hosts_mass_so_the_run_log_shows_who_trained_in_it():
    ledger = RoundLedger({"a": [0], "b": [1]})
    ledger.deposit("b", 0, 0.0, [f32(0, 0)])  # b's ranks trained nothing this round
    out = ledger.deposit("a", 0, 3.0, [f32(3, 6)])
    assert (out.hosts, out.masses) == (("a", "b"), (3.0, 0.0))


def test_a_reduced_round_names_the_ranks_whose_deposits_it_holds_as_the_frames_named_them():
    # The coordinator counts a rank's work in the consensus only if its deposit is: a rank of host a that died
    # before depositing is not in a's frame, and its work is redone.
    ledger = RoundLedger({"a": [0, 1], "b": [2]})
    ledger.deposit("a", 0, 2.0, [f32(2, 4)], ranks=[0])
    out = ledger.deposit("b", 0, 1.0, [f32(1, 1)], ranks=[2, 7])  # a rank not of b's is nobody's deposit
    assert out.ranks == (0, 2)


def test_divides_once_by_the_mass_of_the_accepted_frames_only():
    ledger = RoundLedger({"a": [0], "b": [1], "c": [2]})
    ledger.declare_dead(1)
    ledger.deposit("a", 0, 3.0, [f32(3, 6)])
    out = ledger.deposit("c", 0, 1.0, [f32(5, 10)])
    np.testing.assert_array_equal(out.tensors[0], [2, 4])
    assert out.mass == 4.0


def test_zero_mass_round_is_not_divided_and_ships_mass_zero():
    ledger = two_hosts()
    ledger.deposit("a", 0, 0.0, [f32(0, 0)])
    out = ledger.deposit("b", 0, 0.0, [f32(0, 0)])
    assert out.mass == 0.0
    np.testing.assert_array_equal(out.tensors[0], [0, 0])
    assert not np.isnan(out.tensors[0]).any()


def test_bf16_round_is_reduced_in_f32_and_encoded_in_bf16():
    ledger = two_hosts()
    ledger.deposit("a", 0, 3.0, [bf16(6, 12)])
    out = ledger.deposit("b", 0, 1.0, [bf16(4, 8)])
    assert out.tensors[0].dtype == np.uint16
    np.testing.assert_array_equal(widen(out.tensors[0]), [2.5, 5.0])


def test_f16_round_is_encoded_in_f16():
    ledger = two_hosts()
    ledger.deposit("a", 0, 1.0, [np.array([1.0], np.float16)])
    out = ledger.deposit("b", 0, 1.0, [np.array([2.0], np.float16)])
    assert out.tensors[0].dtype == np.float16 and out.tensors[0][0] == 1.5


def weighted_round(dtype: str, seed: int) -> tuple[Reduced, np.ndarray]:
    """2 hosts x 2 ranks, each rank premultiplying its tensor by its mass; returns (consensus, f64 reference)."""
    rng = np.random.default_rng(seed)
    xs = [rng.uniform(0.5, 2.0, 1000) for _ in range(4)]
    masses = [3.0, 1.0, 0.5, 7.0]
    hosts = {"h0": [0, 1], "h1": [2, 3]}
    ledger = RoundLedger(hosts)
    out = None
    for host, ranks in hosts.items():
        station = FoldStation(ranks)
        fold = None
        for r in ranks:
            scaled = (masses[r] * xs[r]).astype(np.float32)
            if dtype == "bf16":
                scaled = bf16_from_f32(scaled, np.empty(scaled.shape, np.uint16))
            fold = station.deposit(r, 9, masses[r], [scaled])
        assert isinstance(fold, HostFold)
        out = ledger.deposit(host, 9, fold.mass, list(fold.tensors))
    reference = sum(m * x for m, x in zip(masses, xs, strict=True)) / sum(masses)
    return out, reference


def test_two_hosts_of_two_ranks_give_the_weighted_mean_in_f32():
    out, reference = weighted_round("f32", seed=1)
    assert out.mass == 11.5
    assert np.max(np.abs(out.tensors[0] - reference) / np.abs(reference)) < 1e-6


def test_two_hosts_of_two_ranks_give_the_weighted_mean_within_bf16_precision():
    out, reference = weighted_round("bf16", seed=2)
    got = widen(out.tensors[0])
    # Three bf16 roundings (rank deposit, host fold, consensus), each within half an ulp,
    # i.e. 2^-8 relative; positive terms cannot cancel, so the errors add at most.
    assert np.all(np.abs(got - reference) <= np.abs(reference) * 3 * 2.0**-8 + 1e-6)
    f32_out, _ = weighted_round("f32", seed=2)
    assert np.all(np.abs(got - f32_out.tensors[0]) <= np.abs(f32_out.tensors[0]) * 3 * 2.0**-8)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 2), min_size=1, max_size=6),
    st.lists(st.one_of(st.just(0.0), st.floats(1e-3, 4.0)), min_size=6, max_size=6),
    st.integers(0, 2**16),
)
def test_host_folds_then_reduce_match_a_flat_reduce(placement, masses, seed):
    rng = np.random.default_rng(seed)
    n = len(placement)
    xs = [rng.uniform(-1.0, 1.0, 16).astype(np.float32) for _ in range(n)]
    hosts: dict[str, list[int]] = {}
    for r, h in enumerate(placement):
        hosts.setdefault(f"h{h}", []).append(r)
    ledger = RoundLedger(hosts)
    out = None
    for host, ranks in hosts.items():
        station = FoldStation(ranks)
        for r in ranks:
            fold = station.deposit(r, 0, masses[r], [(masses[r] * xs[r]).astype(np.float32)])
        out = ledger.deposit(host, 0, fold.mass, list(fold.tensors))
    total = sum(masses[:n])
    flat = sum(np.float64(masses[r]) * xs[r] for r in range(n))
    assert math.isclose(out.mass, total, rel_tol=1e-12)
    if total > 0:
        flat = flat / total
    np.testing.assert_allclose(out.tensors[0], flat, rtol=1e-5, atol=1e-6)


# --- the expected set, deaths and forwarding -----------------------------------------


def test_host_with_a_live_rank_is_still_expected():
    ledger = two_hosts()
    ledger.declare_dead(0)
    assert ledger.expected_hosts() == {"a", "b"}
    assert ledger.deposit("b", 0, 1.0, [f32(1)]) is None
    assert isinstance(ledger.deposit("a", 0, 1.0, [f32(3)]), Reduced)


def test_death_of_a_host_last_rank_completes_the_round():
    ledger = two_hosts()
    ledger.deposit("b", 0, 2.0, [f32(4)])
    ledger.declare_dead(0)
    declared = ledger.declare_dead(1)
    assert declared.forward_to == "a"
    assert isinstance(declared.outcome, Reduced)
    np.testing.assert_array_equal(declared.outcome.tensors[0], [2])


def test_host_that_deposited_then_died_stays_counted():
    ledger = two_hosts()
    ledger.deposit("a", 0, 1.0, [f32(2)])
    ledger.declare_dead(0)
    assert ledger.declare_dead(1).outcome is None  # b still expected
    out = ledger.deposit("b", 0, 1.0, [f32(4)])
    assert out.hosts == ("a", "b") and out.mass == 2.0
    np.testing.assert_array_equal(out.tensors[0], [3])


def test_each_death_is_forwarded_exactly_once():
    ledger = two_hosts()
    first = ledger.declare_dead(2)
    again = ledger.declare_dead(2)
    assert (first.rank, first.forward_to) == (2, "b")
    assert (again.forward_to, again.outcome) == (None, None)
    assert ledger.is_dead(2) and not ledger.is_dead(0)
    assert ledger.dead == {2}


def test_declaring_an_unknown_rank_dead_is_refused():
    with pytest.raises(ProtocolError, match="rank 9"):
        two_hosts().declare_dead(9)


def test_every_host_dead_abandons_the_open_round_with_a_reason():
    ledger = two_hosts()
    ledger.deposit("a", 4, 1.0, [f32(1)])
    assert ledger.declare_dead(0).outcome is None
    assert ledger.declare_dead(1).outcome is None  # b is still expected
    out = ledger.declare_dead(2).outcome
    assert isinstance(out, Abandoned) and out.round_id == 4 and "dead" in out.reason
    assert ledger.counters.rounds_abandoned == 1 and ledger.round_id is None
    gone = ledger.recover(4)
    assert isinstance(gone, Gone) and "abandoned" in gone.reason


def test_every_host_dead_between_rounds_is_reported_once():
    ledger = RoundLedger({"a": [0], "b": [1]})
    assert ledger.declare_dead(0).outcome is None
    out = ledger.declare_dead(1).outcome
    assert isinstance(out, Abandoned) and out.round_id is None
    assert ledger.declare_dead(1).outcome is None
    assert ledger.deposit("a", 0, 1.0, [f32(1)]) is None
    assert ledger.counters.dead_host_drops == 1


# --- late and bad frames ---------------------------------------------------------------


def test_frame_from_a_host_whose_ranks_are_all_dead_is_dropped_and_counted():
    ledger = two_hosts()
    ledger.declare_dead(2)
    assert ledger.deposit("b", 0, 1.0, [f32(100)]) is None
    out = ledger.deposit("a", 0, 1.0, [f32(1)])
    np.testing.assert_array_equal(out.tensors[0], [1])
    assert ledger.counters.dead_host_drops == 1


def test_frame_for_a_finished_round_is_dropped_and_counted():
    ledger = two_hosts()
    ledger.deposit("a", 0, 1.0, [f32(1)])
    ledger.deposit("b", 0, 1.0, [f32(1)])
    assert ledger.deposit("b", 0, 1.0, [f32(1)]) is None
    assert ledger.counters.late_drops == 1 and ledger.round_id is None


def test_a_resent_frame_is_counted_once_and_a_missing_one_is_awaited():
    ledger = two_hosts()
    assert ledger.awaits("a", 0) and ledger.awaits("b", 0)
    ledger.deposit("a", 0, 1.0, [f32(2, 4)])
    assert not ledger.awaits("a", 0) and ledger.awaits("b", 0) and not ledger.awaits("b", 1)
    assert ledger.deposit("a", 0, 7.0, [f32(9, 9)]) is None  # a resend that crossed the original
    out = ledger.deposit("b", 0, 1.0, [f32(4, 8)])
    np.testing.assert_array_equal(out.tensors[0], [3, 6])
    assert ledger.counters.duplicate_drops == 1 and not ledger.awaits("b", 0)
    ledger.declare_dead(2)
    assert not ledger.awaits("b", 1)  # nobody left there to load the consensus


@pytest.mark.parametrize(
    ("host", "round_id", "mass", "tensors", "match"),
    [
        ("b", 1, 1.0, [f32(1, 2)], "round 0 is still open"),
        ("z", 0, 1.0, [f32(1, 2)], "unknown host"),
        ("b", 0, 1.0, [f32(1, 2), f32(1)], "carries 2 tensors"),
        ("b", 0, 1.0, [bf16(1, 2)], "is bf16, the round's is f32"),
        ("b", 0, 1.0, [f32(1, 2, 3)], "has shape"),
        ("b", 0, -0.5, [f32(1, 2)], "finite and >= 0"),
        ("b", 0, math.nan, [f32(1, 2)], "finite and >= 0"),
        ("b", 0, 1e-87, [f32(1, 2)], "premultiplied by it in f32"),
    ],
)
def test_protocol_violation_raises_and_changes_nothing(host, round_id, mass, tensors, match):
    ledger = two_hosts()
    ledger.deposit("a", 0, 1.0, [f32(2, 4)])
    with pytest.raises(ProtocolError, match=match):
        ledger.deposit(host, round_id, mass, tensors)
    out = ledger.deposit("b", 0, 1.0, [f32(4, 8)])
    np.testing.assert_array_equal(out.tensors[0], [3, 6])
    assert out.mass == 2.0 and ledger.counters.frames == 2


def test_unsupported_dtype_in_a_first_frame_is_refused():
    with pytest.raises(ProtocolError, match="float64"):
        two_hosts().deposit("a", 0, 1.0, [np.zeros(2)])


@pytest.mark.parametrize(
    ("hosts", "match"),
    [
        ({"a": [0, 1], "b": [1]}, "rank 1 is announced by hosts"),
        ({"a": []}, "no ranks"),
        ({}, "at least one host"),
    ],
)
def test_inconsistent_host_rosters_are_refused(hosts, match):
    with pytest.raises(ProtocolError, match=match):
        RoundLedger(hosts)


# --- recovery of the latest consensus -----------------------------------------------


def test_latest_consensus_is_recoverable_by_round_id():
    ledger = two_hosts()
    assert isinstance(ledger.recover(0), Gone)
    ledger.deposit("a", 0, 1.0, [f32(1)])
    out = ledger.deposit("b", 0, 1.0, [f32(3)])
    assert ledger.recover(0) is out
    future = ledger.recover(1)
    assert isinstance(future, Gone) and future.latest == 0 and "not been reduced" in future.reason


def test_older_consensus_is_reported_gone_with_the_latest_round():
    ledger = two_hosts()
    for rnd in range(2):
        ledger.deposit("a", rnd, 1.0, [f32(1)])
        ledger.deposit("b", rnd, 1.0, [f32(1)])
    gone = ledger.recover(0)
    assert isinstance(gone, Gone) and gone.latest == 1 and "superseded" in gone.reason


@pytest.mark.parametrize("encode", [f32, bf16])
def test_latest_consensus_survives_while_the_next_round_accumulates(encode):
    ledger = two_hosts()
    ledger.deposit("a", 0, 1.0, [encode(2, 2)])
    first = ledger.deposit("b", 0, 1.0, [encode(4, 4)])
    snapshot = first.tensors[0].copy()
    ledger.deposit("a", 1, 1.0, [encode(100, 100)])
    np.testing.assert_array_equal(ledger.recover(0).tensors[0], snapshot)


def test_buffers_are_reused_across_rounds_of_one_schema():
    ledger = two_hosts()
    outs = []
    for rnd in range(2):
        ledger.deposit("a", rnd, 1.0, [f32(rnd, rnd)])
        outs.append(ledger.deposit("b", rnd, 1.0, [f32(rnd, rnd)]))
    assert np.shares_memory(outs[0].tensors[0], outs[1].tensors[0])
    np.testing.assert_array_equal(outs[1].tensors[0], [1, 1])
    c = ledger.counters
    assert (c.frames, c.rounds_reduced, c.bytes_reduced) == (4, 2, 32)


def test_a_round_told_ahead_is_published_only_once_its_trigger_opened_it():
    led = RoundLedger({"a": [0]})
    led.bound_round(1, {0: 100.0}, opens=False)  # the plan that told rank 0 to deposit ahead
    assert led.deposit("a", 1, 80.0, [f32(80.0)]) is None  # complete, but the coordinator has not seen it end
    # The trigger's bound is lower than the plan's; the larger stands, so the honest mass is not refused.
    out = led.bound_round(1, {0: 50.0}, opens=True)
    assert isinstance(out, Reduced) and out.round_id == 1 and out.tensors[0][0] == 1.0


# ---------------------------------------------------------------- a host shard's start (PROTOCOL.md 10.9 item 11)


def test_a_host_shard_keeps_the_newest_frame_of_each_member_and_round_until_its_start():
    gate = StartGate(shard=2)
    assert not gate.started and StartGate(shard=0).started  # the controller's reducer starts from the run
    first, resent = [np.zeros(3, np.float32)], [np.ones(3, np.float32)]
    gate.hold("a", HostFrame(1, "a", [0, 1], 2.0), first)
    gate.hold("b", HostFrame(1, "b", [2], 1.0), first)
    gate.hold("a", HostFrame(1, "a", [0, 1], 2.0), resent)  # a resend after a reset replaces its copy
    gate.hold("a", HostFrame(2, "a", [0, 1], 2.0), first)
    assert [(h, f.round, p is resent) for h, f, p in gate.held] == [("b", 1, False), ("a", 1, True), ("a", 2, False)]
    assert gate.open(ShardStart(2, "none", 0.0, 0.0, 0), []) is None and gate.started


@pytest.mark.parametrize(("start", "payload", "named"), [
    (ShardStart(1, "none", 0.0, 0.0, 0), [], "the start of shard 1: the two hold different shard maps"),
    (ShardStart(2, "none", 0.0, 0.0, 0), [np.zeros(2, np.float32)], "without an outer step came with 1"),
    (ShardStart(2, "adam", 0.7, 0.9, 2), [np.zeros(2, np.float32)] * 2, "names an outer step it cannot take"),
    (ShardStart(2, "nesterov", 0.7, 1.5, 2), [np.zeros(2, np.float32)] * 2, "outer_momentum"),
    (ShardStart(2, "nesterov", 0.7, 0.9, 2), [np.zeros(2, np.float32)], "model then its momentum"),
    (ShardStart(2, "nesterov", 0.7, 0.9, 2), [np.zeros(2, np.float32), np.zeros(3, np.float32)], "model then"),
    (ShardStart(2, "nesterov", 0.7, 0.9, 2), [np.zeros(2, np.float64)] * 2, "f32"),
    (ShardStart(2, "nesterov", 0.7, 0.9, 5), [np.zeros(2, np.float32)] * 2, "more than there are values"),
], ids=["other-shard", "payload-without-outer", "unknown-step", "bad-momentum", "odd-frames", "mismatched-parts",
        "f64", "stepped-over-slice"])
def test_a_start_the_shard_cannot_use_is_refused_naming_what_is_wrong_and_opens_nothing(start, payload, named):
    gate = StartGate(shard=2)
    with pytest.raises(ProtocolError, match=named):
        gate.open(start, payload)
    assert not gate.started


def test_a_start_with_an_outer_step_builds_the_slices_step_from_its_model_and_momentum():
    gate = StartGate(shard=1)
    model, momentum = np.arange(5, dtype=np.float32), np.full(5, 0.5, np.float32)
    outer = gate.open(ShardStart(1, "momentum", 1.0, 0.7, 3), [model[:2], model[2:], momentum[:2], momentum[2:]])
    assert outer is not None and (outer.config.kind, outer.stepped) == ("momentum", 3)
    np.testing.assert_array_equal(outer.global_model, model)
    np.testing.assert_array_equal(outer.momentum, [0.5, 0.5, 0.5, 0.0, 0.0])  # buffers carry no momentum
