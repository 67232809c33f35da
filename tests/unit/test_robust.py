"""The rules against finite poison and the robust aggregations (flodl_zmq/robust.py), as a pure core."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from flodl_zmq import robust
from flodl_zmq.errors import PoisonedDeposit
from flodl_zmq.fold import FoldStation
from flodl_zmq.reducer import RoundLedger
from flodl_zmq.tensors import bf16_from_f32

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(1, 9), st.integers(1, 6), st.sampled_from(robust.AGGREGATIONS))
def test_every_aggregation_is_independent_of_the_order_of_the_ranks(data, n, d, rule):
    rows = data.draw(arrays(np.float32, (n, d), elements=finite))
    order = data.draw(st.permutations(range(n)))
    a, b = robust.aggregate(rows, rule), robust.aggregate(rows[list(order)], rule)
    if rule == "mean":  # f32 sums round in the order they are added
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)
    else:
        assert np.array_equal(a, b)


arbitrary = st.floats(allow_nan=False, allow_infinity=False, width=32)


def inside_the_honest_range(honest: np.ndarray, bad: np.ndarray, rule: str) -> bool:
    got = robust.aggregate(np.concatenate([honest, bad]), rule)
    return bool((honest.min(axis=0) <= got).all() and (got <= honest.max(axis=0)).all())


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(1, 7), st.integers(1, 5))
def test_the_median_with_fewer_arbitrary_rows_than_honest_ones_stays_inside_the_honest_range(data, honest_n, d):
    bad_n = data.draw(st.integers(0, honest_n - 1))
    honest = data.draw(arrays(np.float32, (honest_n, d), elements=finite))
    bad = data.draw(arrays(np.float32, (bad_n, d), elements=arbitrary))
    assert inside_the_honest_range(honest, bad, "median")


@settings(max_examples=80, deadline=None)
@given(st.data(), st.integers(3, 12), st.integers(1, 5))
def test_the_trimmed_mean_with_at_most_its_trim_of_arbitrary_rows_stays_inside_the_honest_range(data, n, d):
    bad_n = data.draw(st.integers(0, robust.trimmed(n)))
    honest = data.draw(arrays(np.float32, (n - bad_n, d), elements=finite))
    bad = data.draw(arrays(np.float32, (bad_n, d), elements=arbitrary))
    assert inside_the_honest_range(honest, bad, "trimmed_mean")


def test_an_unknown_rule_is_refused_by_name():
    with pytest.raises(ValueError, match="mode"):
        robust.aggregate(np.zeros((2, 2), np.float32), "mode")


def test_magnitude_reads_f32_bf16_and_int8_pairs():
    x = np.array([0.5, -3.0, 2.0], np.float32)
    assert robust.magnitude([x]) == 3.0
    assert robust.magnitude([bf16_from_f32(x, np.empty(3, np.uint16))]) == 3.0
    assert robust.magnitude([np.array([1, -2], np.int8), np.array([0.5], np.float32)]) == 127 * 0.5
    assert np.isnan(robust.magnitude([np.array([1.0, np.nan], np.float32)]))


def test_a_deposit_far_above_the_last_consensus_is_refused_and_one_near_it_is_not():
    station = FoldStation((0, 1, 2))
    station.consensus_seen([np.full(4, 2.0, np.float32)])
    station.deposit(0, 1, 3.0, [np.full(4, 3.0 * 2.5, np.float32)])
    station.deposit(1, 1, 1.0, [np.full(4, 2.1e6 * 2.0, np.float32)])  # held: refused by the pass that sums it
    assert [r for r, why in station.refused if "magnitude" in why] == [1]
    out = station.deposit(2, 1, 1.0, [np.full(4, 2.0, np.float32)])
    assert out is not None and out.ranks == (0, 2) and out.mass == 4.0


class Unread(list):
    """A consensus that fails the test when anything reads its arrays."""

    def __iter__(self):
        raise AssertionError("the consensus was read")

    def __getitem__(self, index):
        raise AssertionError("the consensus was read")


def test_an_honest_round_never_reads_the_consensus_its_deposits_are_bounded_by():
    # Every bound is at least MAGNITUDE_RATIO, so deposits within it pass unread: no pass over the model.
    station = FoldStation((0, 1))
    station.consensus_seen(Unread([np.full(4, 2.0, np.float32)]))
    station.deposit(0, 1, 1.0, [np.full(4, 3.0, np.float32)])
    out = station.deposit(1, 1, 2.0, [np.full(4, 0.9e6 * 2.0, np.float32)])
    assert out is not None and out.ranks == (0, 1)
    # One above MAGNITUDE_RATIO has the consensus measured, once, and is judged by it.
    bound = robust.MagnitudeBound()
    bound.seen([np.full(4, 3.0, np.float32)])
    robust.check_magnitude([np.full(4, 2.5e6, np.float32)], 1.0, bound, "rank 0")
    with pytest.raises(PoisonedDeposit, match="over 3e\\+06 per unit of mass"):
        robust.check_magnitude([np.full(4, 3.5e6, np.float32)], 1.0, bound, "rank 0")


def test_a_mass_far_above_its_host_mates_is_refused_whichever_arrives_first():
    station = FoldStation((0, 1))
    assert station.deposit(1, 1, 1e30, [np.full(4, 1e30, np.float32)]) is None
    out = station.deposit(0, 1, 2.0, [np.full(4, 2.0, np.float32)])
    assert out is not None and out.ranks == (0,) and out.mass == 2.0
    assert [r for r, _ in station.refused] == [1]
    assert robust.mass_outliers([3.0, 40.0, 900.0]) == []  # honest ranks of unequal speed


def test_an_unfolded_station_ships_each_ranks_deposit_in_rank_order():
    station = FoldStation((4, 5), unfolded=True)
    station.deposit(5, 1, 2.0, [np.full(3, 4.0, np.float32)])
    out = station.deposit(4, 1, 1.0, [np.full(3, 1.0, np.float32)])
    assert [(ranks, mass, float(t[0][0])) for ranks, mass, t in out.frames()] == [((4,), 1.0, 1.0), ((5,), 2.0, 4.0)]


def test_a_median_ledger_waits_for_every_live_rank_and_takes_each_ones_model():
    ledger = RoundLedger({"a": (0, 1), "b": (2,)}, aggregation="median")
    assert ledger.deposit("a", 1, 1.0, [np.full(2, 1.0, np.float32)], [0]) is None
    assert ledger.awaits("a", 1) and ledger.awaits("b", 1)
    assert ledger.deposit("b", 1, 2.0, [np.full(2, 2.0 * 3.0, np.float32)], [2]) is None
    out = ledger.deposit("a", 1, 4.0, [np.full(2, 4.0 * -50.0, np.float32)], [1])
    assert out is not None and out.hosts == ("a", "b") and out.mass == 7.0
    assert out.tensors[0].tolist() == [1.0, 1.0]  # median of the models 1, 3 and -50
    with pytest.raises(Exception, match="each of its ranks"):
        ledger.deposit("a", 2, 1.0, [np.full(2, 1.0, np.float32)], [0, 1])
