"""The magnitude bound checked by the pass that sums held contributions (flodl_zmq/sums.py, fold.OpenRound.judge).

What is refused, and the reason given, are those of a check on arrival
(robust.check_magnitude); only when it is found moves, to the pass that first
reads a held contribution. An honest round then reads each held one once.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq import robust, sums, tensors
from flodl_zmq.errors import PoisonedDeposit
from flodl_zmq.fold import FoldStation, HostFold, NothingToShip
from flodl_zmq.reducer import RoundLedger
from flodl_zmq.sums import BLOCK
from flodl_zmq.tensors import bf16_from_f32, f32_from_bf16

N = 2 * BLOCK + 5  # more than one block per piece, and a ragged last block


def wire(values: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_from_f32(values, np.empty(values.size, np.uint16)) if dtype == "bf16" else values


def deposit(mass: float, dtype: str, poison: float | None = None, at: int = N - 1) -> list[np.ndarray]:
    """A mass-premultiplied deposit of honest values, one element ``poison`` (times the mass) when given."""
    x = np.full(N, 0.25 * mass, np.float32)
    if poison is not None:
        x[at] = poison * mass
    return [wire(x, dtype), wire(np.full(3, 0.5 * mass, np.float32), dtype)]


def arrival_reason(tensors: list[np.ndarray], mass: float, bound: robust.MagnitudeBound) -> str:
    """The reason the check on arrival gives, without the name of who sent it."""
    with pytest.raises(PoisonedDeposit) as refused:
        robust.check_magnitude(tensors, mass, bound, "WHO")
    return str(refused.value).removeprefix("WHO ")


def values(tensors: tuple[np.ndarray, ...], dtype: str) -> list[float]:
    flat = tensors[0] if dtype == "f32" else f32_from_bf16(tensors[0], np.empty(tensors[0].size, np.float32))
    return sorted(set(flat.tolist()))


@pytest.fixture
def unmeasured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any contribution is measured by a pass of its own (``robust.magnitude``)."""
    def measured(_tensors: object) -> float:
        raise AssertionError("a contribution was read by a magnitude pass of its own")
    monkeypatch.setattr(robust, "magnitude", measured)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("roster", [2, 3])  # the round completes with the second (encode_sum) or stays open (fill_sum)
def test_an_honest_held_pair_is_measured_by_the_pass_that_sums_it_not_by_one_of_its_own(unmeasured, dtype, roster):
    station = FoldStation(range(roster))
    station.deposit(0, 1, 1.0, deposit(1.0, dtype))
    out = station.deposit(1, 1, 2.0, deposit(2.0, dtype))
    if roster == 3:
        assert out is None and station.round_id == 1
        out = station.mark_dead(2)
    assert out is not None and out.ranks == (0, 1) and values(out.tensors, dtype) == [0.75]
    ledger = RoundLedger({"a": (0,), "b": (1,)})
    ledger.deposit("a", 1, 1.0, out.tensors)
    reduced = ledger.deposit("b", 1, 3.0, out.tensors)
    assert reduced is not None and reduced.hosts == ("a", "b") and not ledger.refused


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("roster", [2, 3])
def test_an_honest_pair_is_summed_with_no_check_of_the_sums_and_f32_measured_by_one_dot_product_each(
        unmeasured, monkeypatch, dtype, roster):
    # Values far within every limit prove the sums finite (no read of them, no NaN to rewrite), and an f32
    # block's x.x shows them so (no max and min pass).
    def read_again(_x: object, *_rest: object) -> object:
        raise AssertionError("an honest block was read again")
    for kernels in {sums.KERNELS["f32"], sums.KERNELS[dtype]}:  # f32 sums, and the bf16 ones of a bf16 pair
        monkeypatch.setattr(kernels, "finite", read_again)
    def sum_of_finite(a: np.ndarray, b: np.ndarray, out: np.ndarray, finite: bool = False) -> np.ndarray:
        assert finite, "an honest block's bf16 sums were searched for a NaN"
        return tensors.bf16_sum(a, b, out, finite)
    monkeypatch.setattr(sums, "bf16_sum", sum_of_finite)
    if dtype == "f32":
        monkeypatch.setattr(robust, "block_magnitude", read_again)
    test_an_honest_held_pair_is_measured_by_the_pass_that_sums_it_not_by_one_of_its_own(None, dtype, roster)


@pytest.mark.parametrize("top", [0.9e6, 1.1e6])
@pytest.mark.parametrize("everywhere", [False, True])
def test_f32_values_near_the_limit_are_judged_exactly(top, everywhere):
    # Over half the smallest limit (1e6 at mass 1), a block is read exactly: 1.1e6 is refused, 0.9e6 passes,
    # alone in a block or in every element of it.
    station = FoldStation((0, 1))
    near = deposit(1.0, "f32", poison=top)
    if everywhere:
        near[0][:] = top
    station.deposit(0, 1, 1.0, near)
    out = station.deposit(1, 1, 1.0, deposit(1.0, "f32"))
    assert [r for r, _ in station.refused] == ([0] if top > 1e6 else [])
    assert out is not None and out.ranks == ((1,) if top > 1e6 else (0, 1))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("roster", [2, 3])
@pytest.mark.parametrize("culprit", [0, 1])
def test_a_held_deposit_over_the_bound_is_refused_with_the_reason_a_check_on_arrival_gives(dtype, roster, culprit):
    station = FoldStation(range(roster))
    bad = deposit(2.0, dtype, poison=3e9)
    outs = [station.deposit(rank, 1, 2.0, bad if rank == culprit else deposit(2.0, dtype)) for rank in (0, 1)]
    assert station.refused == [(culprit, "its deposit " + arrival_reason(bad, 2.0, robust.MagnitudeBound()))]
    out = outs[1] if roster == 2 else station.mark_dead(2)  # the round completes with the honest one alone
    assert out is not None and out.ranks == (1 - culprit,) and values(out.tensors, dtype) == [0.5]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_later_add_over_the_bound_is_refused_before_it_touches_the_sums_with_the_same_reason(dtype):
    station = FoldStation((0, 1, 2))
    station.deposit(0, 1, 1.0, deposit(1.0, dtype))
    station.deposit(1, 1, 1.0, deposit(1.0, dtype))
    bad = deposit(1.0, dtype, poison=3e9, at=0)
    with pytest.raises(PoisonedDeposit) as refused:
        station.deposit(2, 1, 1.0, bad)
    assert str(refused.value) == f"relay fold: rank 2 (round 1) {arrival_reason(bad, 1.0, robust.MagnitudeBound())}"
    out = station.mark_dead(2)
    assert out is not None and out.ranks == (0, 1) and values(out.tensors, dtype) == [0.5]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("hosts", [1, 2])  # a one-host round fills its image from the frame; two are summed
def test_the_reducer_refuses_a_host_frame_over_the_bound_found_by_its_summing_pass(dtype, hosts):
    ledger = RoundLedger({"a": (0,), "b": (1,)})
    bad = deposit(1.0, dtype, poison=3e9)
    if hosts == 1:
        ledger.declare_dead(1)
    first = ledger.deposit("a", 1, 1.0, bad)
    assert first is None or hosts == 1
    out = ledger.deposit("b", 1, 1.0, deposit(1.0, dtype)) if hosts == 2 else None
    assert ledger.refused == [("a", "its deposit " + arrival_reason(bad, 1.0, robust.MagnitudeBound()))]
    if hosts == 2:
        assert out is not None and out.hosts == ("b",) and values(out.tensors, dtype) == [0.25]


def test_a_held_deposit_with_a_nan_and_a_huge_value_is_refused_as_non_finite_as_before():
    station = FoldStation((0, 1))
    bad = deposit(1.0, "f32", poison=3e9)
    bad[1][0] = np.nan
    station.deposit(0, 1, 1.0, bad)
    out = station.deposit(1, 1, 1.0, deposit(1.0, "f32"))
    assert [r for r, _ in station.refused] == [0] and "NaN" in station.refused[0][1]
    assert out is not None and out.ranks == (1,)


def test_a_one_rank_host_still_refuses_its_deposit_over_the_bound_before_shipping_it():
    station = FoldStation((0,))
    assert isinstance(station.deposit(0, 1, 1.0, deposit(1.0, "bf16", poison=3e9)), NothingToShip)
    assert [r for r, why in station.refused if "magnitude" in why] == [0]


def test_a_mass_outlier_is_judged_only_against_deposits_that_pass_the_bound():
    # On arrival the huge deposit would have been refused at once, so the heavy one met no peer: it stays.
    station = FoldStation((0, 1))
    station.deposit(0, 1, 1.0, deposit(1.0, "f32", poison=3e9))
    out = station.deposit(1, 1, 5000.0, deposit(5000.0, "f32"))
    assert [r for r, why in station.refused if "magnitude" in why] == [0] and len(station.refused) == 1
    assert out is not None and out.ranks == (1,) and out.mass == 5000.0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, 2e6, 3e9]), st.floats(0.5, 4.0)), min_size=1, max_size=4),
       st.sampled_from(["f32", "bf16"]), st.randoms(use_true_random=False))
def test_a_station_refuses_exactly_the_deposits_a_check_on_arrival_refuses(deposits, dtype, rng):
    station = FoldStation(range(len(deposits)))
    station.consensus_seen([np.full(4, 4.0, np.float32)])  # the limit: 4e6 per unit of mass
    order = list(range(len(deposits)))
    rng.shuffle(order)
    expected, out = [], None
    for rank in order:
        poison, mass = deposits[rank]
        tensors = deposit(mass, dtype, poison=poison)
        if robust.magnitude(tensors) > 4e6 * max(1.0, mass):
            expected.append(rank)
        try:
            out = station.deposit(rank, 1, mass, tensors) or out
        except PoisonedDeposit:  # a later add, refused before it is added: the relay makes it leave
            station.refused.append((rank, "raised"))
            out = station.mark_dead(rank) or out
    assert sorted(r for r, _ in station.refused) == sorted(expected)
    honest = sorted(set(range(len(deposits))) - set(expected))
    assert (out.ranks if isinstance(out, HostFold) else ()) == tuple(honest)
