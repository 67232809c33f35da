"""The host fold station (flodl_zmq.fold): a plain sum of mass-premultiplied deposits, never divided.

Contract exercised throughout: a rank deposits ``mass * x`` together with
``mass``; the fold sums both; only the reducer divides.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.errors import FoldError
from flodl_zmq.fold import ENTRIES_KEPT, FoldStation, HostFold, ImageCache, NothingToShip
from flodl_zmq.sums import PIECE, SumImage
from flodl_zmq.tensors import bf16_from_f32, f32_from_bf16


def f32(*values: float) -> np.ndarray:
    a = np.array(values, np.float32)
    a.flags.writeable = False  # deposits are read-only views over received frames
    return a


def bf16(*values: float) -> np.ndarray:
    out = bf16_from_f32(np.array(values, np.float32), np.empty(len(values), np.uint16))
    out.flags.writeable = False
    return out


def widen(bits: np.ndarray) -> np.ndarray:
    return f32_from_bf16(bits, np.empty(bits.shape, np.float32))


def test_one_rank_host_ships_the_very_same_buffers():
    station = FoldStation([4])
    tensors = [f32(1, 2, 3), bf16(0.5, 0.25)]
    out = station.deposit(4, 0, 2.0, tensors)
    assert isinstance(out, HostFold) and out.verbatim
    assert all(a is b for a, b in zip(out.tensors, tensors, strict=True))
    assert (out.round_id, out.mass, out.ranks) == (0, 2.0, (4,))


def test_fold_sums_tensors_and_masses_without_dividing():
    station = FoldStation([1, 2])
    assert station.deposit(1, 7, 3.0, [f32(1, 2)]) is None
    out = station.deposit(2, 7, 1.0, [f32(10, 20)])
    assert isinstance(out, HostFold) and not out.verbatim
    np.testing.assert_array_equal(out.tensors[0], [11, 22])
    assert (out.mass, out.ranks) == (4.0, (1, 2))


def test_fold_of_premultiplied_deposits_then_one_divide_is_the_weighted_mean():
    xs = [np.array([1.0, -2.0, 4.0]), np.array([3.0, 0.5, -1.0]), np.array([0.25, 8.0, 2.0])]
    masses = [3.0, 1.0, 0.5]
    station = FoldStation([0, 1, 2])
    out = None
    for r, (x, m) in enumerate(zip(xs, masses, strict=True)):
        out = station.deposit(r, 0, m, [(m * x).astype(np.float32)])
    expected = sum(m * x for m, x in zip(masses, xs, strict=True)) / sum(masses)
    np.testing.assert_allclose(out.tensors[0] / out.mass, expected, rtol=1e-6)


def test_shaped_tensors_keep_their_shapes():
    station = FoldStation([0, 1])
    a = np.ones((2, 3), np.float32)
    b = np.full((4,), 2, np.uint16)
    station.deposit(0, 0, 1.0, [a, b])
    out = station.deposit(1, 0, 1.0, [a, b])
    assert [t.shape for t in out.tensors] == [(2, 3), (4,)]
    assert [t.dtype for t in out.tensors] == [np.float32, np.uint16]


def test_bf16_deposits_accumulate_in_f32():
    ranks = range(512)
    station = FoldStation(ranks)
    one = bf16(1.0, 1.0)
    out = None
    for r in ranks:
        out = station.deposit(r, 0, 1.0, [one])
    # 512 x 1.0 is exact in f32 and in bf16; a bf16 accumulator would stall at 256.
    np.testing.assert_array_equal(widen(out.tensors[0]), [512.0, 512.0])


def test_bf16_result_is_rounded_to_nearest_even():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 1.0, [bf16(1.0)])
    out = station.deposit(1, 0, 1.0, [bf16(2.0**-8)])
    # 1 + 2^-8 is an exact tie between bf16 neighbours 1.0 and 1.0078125: even wins.
    assert out.tensors[0][0] == 0x3F80


def test_f16_deposits_fold_back_to_f16():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 1.0, [np.array([1.5, 60000.0], np.float16)])
    out = station.deposit(1, 0, 1.0, [np.array([0.25, 10000.0], np.float16)])
    assert out.tensors[0].dtype == np.float16
    np.testing.assert_array_equal(out.tensors[0], np.array([1.75, np.inf], np.float16))


@st.composite
def fold_cases(draw):
    n = draw(st.integers(2, 5))
    values = draw(
        st.lists(st.lists(st.integers(-32, 32), min_size=3, max_size=3), min_size=n, max_size=n)
    )
    masses = draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    dead = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    events = [("deposit", r) for r in range(n) if r not in dead] + [("dead", r) for r in dead]
    orders = [draw(st.permutations(events)) for _ in range(2)]
    return values, masses, dead, orders, draw(st.sampled_from(["f32", "bf16"]))


@settings(max_examples=80, deadline=None)
@given(fold_cases())
def test_fold_is_independent_of_deposit_and_death_order(case):
    values, masses, dead, orders, dtype = case
    # Small integers and their sums are exact in f32 and bf16, so every order must give the same bytes.
    encode = (lambda v: f32(*v)) if dtype == "f32" else (lambda v: bf16(*v))
    shipped = []
    for events in orders:
        station = FoldStation(range(len(values)))
        outs = [
            station.deposit(r, 3, float(masses[r]), [encode(values[r])])
            if kind == "deposit"
            else station.mark_dead(r)
            for kind, r in events
        ]
        assert outs[:-1] == [None] * (len(outs) - 1)  # exactly the last event completes the round
        shipped.append(outs[-1])
    contributors = [r for r in range(len(values)) if r not in dead]
    for out in shipped:
        assert out.ranks == tuple(contributors)
        assert out.mass == sum(masses[r] for r in contributors)
        got = out.tensors[0] if dtype == "f32" else widen(out.tensors[0])
        np.testing.assert_array_equal(got, np.sum([values[r] for r in contributors], axis=0))
    np.testing.assert_array_equal(shipped[0].tensors[0], shipped[1].tensors[0])


def test_image_is_allocated_once_and_reused_across_rounds():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 1.0, [f32(1, 1)])
    first = station.deposit(1, 0, 1.0, [f32(2, 2)]).tensors[0]
    station.deposit(0, 1, 1.0, [f32(5, 5)])
    second = station.deposit(1, 1, 1.0, [f32(6, 6)]).tensors[0]
    assert np.shares_memory(first, second)
    np.testing.assert_array_equal(second, [11, 11])


def test_image_promotion_overwrites_the_previous_round_completely():
    station = FoldStation([0, 1, 2])
    for r in range(3):
        station.deposit(r, 0, 1.0, [bf16(100.0)])
    station.deposit(0, 1, 1.0, [bf16(1.0)])
    station.mark_dead(2)
    out = station.deposit(1, 1, 1.0, [bf16(2.0)])
    np.testing.assert_array_equal(widen(out.tensors[0]), [3.0])


@pytest.mark.parametrize("roster", [2, 3])
def test_a_bf16_round_ships_the_encoded_f32_sum_however_it_was_summed(roster):
    """Two ranks: summed and encoded in one pass at completion. Three: the image, promoted early."""
    rng = np.random.default_rng(5)
    n = PIECE + 3
    deposits = [bf16_from_f32(rng.standard_normal(n).astype(np.float32), np.empty(n, np.uint16))
                for _ in range(roster)]
    station = FoldStation(range(roster))
    for r in range(roster - 1):
        assert station.deposit(r, 0, 1.0, [deposits[r]]) is None
    out = station.deposit(roster - 1, 0, float(roster), [deposits[-1]])
    total = np.sum([widen(d) for d in deposits], axis=0, dtype=np.float32)
    np.testing.assert_array_equal(out.tensors[0], bf16_from_f32(total, np.empty(n, np.uint16)))
    assert out.mass == roster - 1 + roster and not out.verbatim


def test_rounds_with_different_schemas_each_fold_correctly():
    station = FoldStation([0, 1])
    for rnd, make in enumerate([lambda: [f32(1, 2)], lambda: [bf16(1.0)], lambda: [f32(1, 2)]]):
        station.deposit(0, rnd, 1.0, make())
        out = station.deposit(1, rnd, 1.0, make())
        assert out.round_id == rnd
    np.testing.assert_array_equal(out.tensors[0], [2, 4])


def test_counters_track_rounds_deposits_drops_and_bytes():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 1.0, [f32(1, 2)])
    station.deposit(1, 0, 1.0, [f32(1, 2)])
    station.mark_dead(1)
    station.deposit(1, 1, 1.0, [f32(1, 2)])
    station.deposit(0, 1, 1.0, [f32(1, 2)])
    c = station.counters
    assert (c.rounds_shipped, c.deposits, c.late_drops, c.bytes_folded) == (2, 3, 1, 24)


# --- deaths ---------------------------------------------------------------------------


def test_dead_rank_does_not_park_the_fold():
    station = FoldStation([0, 1])
    assert station.deposit(1, 0, 1.5, [f32(4)]) is None
    out = station.mark_dead(0)
    assert isinstance(out, HostFold)
    np.testing.assert_array_equal(out.tensors[0], [4])
    assert (out.mass, out.ranks) == (1.5, (1,))


def test_rank_dead_before_the_round_is_out_of_the_barrier():
    station = FoldStation([0, 1, 2])
    assert station.mark_dead(2) is None
    station.deposit(0, 0, 1.0, [f32(1)])
    out = station.deposit(1, 0, 1.0, [f32(2)])
    assert out.ranks == (0, 1)


def test_work_merged_before_a_death_stays_counted():
    station = FoldStation([0, 1, 2])
    station.deposit(0, 0, 2.0, [f32(2)])
    station.deposit(1, 0, 1.0, [f32(1)])
    assert station.mark_dead(0) is None  # rank 0 died after depositing
    out = station.mark_dead(2)
    np.testing.assert_array_equal(out.tensors[0], [3])
    assert (out.mass, out.ranks) == (3.0, (0, 1))


def test_death_after_the_round_shipped_only_shrinks_the_next_barrier():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 1.0, [f32(1)])
    assert isinstance(station.deposit(1, 0, 1.0, [f32(1)]), HostFold)
    assert station.mark_dead(1) is None
    out = station.deposit(0, 1, 1.0, [f32(5)])
    assert out.verbatim and out.ranks == (0,)


def test_mark_dead_is_idempotent():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 1.0, [f32(1)])
    assert isinstance(station.mark_dead(1), HostFold)
    assert station.mark_dead(1) is None
    assert station.dead == {1}


def test_late_deposit_from_a_dead_rank_is_dropped_and_counted():
    station = FoldStation([0, 1])
    station.mark_dead(1)
    assert station.deposit(1, 0, 1.0, [f32(99)]) is None
    out = station.deposit(0, 0, 1.0, [f32(1)])
    np.testing.assert_array_equal(out.tensors[0], [1])
    assert station.counters.late_drops == 1


def test_every_rank_dead_before_any_deposit_ships_nothing():
    station = FoldStation([0, 1])
    assert station.mark_dead(0) is None
    out = station.mark_dead(1)
    assert isinstance(out, NothingToShip) and "dead" in out.reason
    assert station.mark_dead(1) is None
    assert station.counters.rounds_shipped == 0


def test_every_rank_dead_after_a_deposit_ships_the_deposit():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 1.0, [f32(7)])
    station.mark_dead(0)
    out = station.mark_dead(1)
    assert isinstance(out, HostFold) and out.ranks == (0,)
    assert isinstance(FoldStation([5]).mark_dead(5), NothingToShip)


def test_mark_dead_for_a_foreign_rank_is_refused():
    with pytest.raises(FoldError, match="not on this host's roster"):
        FoldStation([0, 1]).mark_dead(9)


# --- protocol violations: refused before they touch the round ---------------------------


def opened() -> FoldStation:
    station = FoldStation([0, 1, 2])
    station.deposit(0, 5, 1.0, [f32(1, 2), bf16(1.0)])
    return station


@pytest.mark.parametrize(
    ("rank", "round_id", "mass", "tensors", "match"),
    [
        (1, 6, 1.0, [f32(1, 2), bf16(1.0)], "round 5 is still open"),
        (1, 5, 1.0, [f32(1, 2)], "carries 1 tensors"),
        (1, 5, 1.0, [f32(1, 2), f32(1.0)], r"tensor\[1\] is f32, the round's is bf16"),
        (1, 5, 1.0, [f32(1, 2, 3), bf16(1.0)], r"tensor\[0\] has shape \(3,\)"),
        (1, 5, 1.0, [np.zeros(2), bf16(1.0)], "float64"),
        (1, 5, -1.0, [f32(1, 2), bf16(1.0)], "finite and >= 0"),
        (1, 5, math.nan, [f32(1, 2), bf16(1.0)], "finite and >= 0"),
        (1, 5, math.inf, [f32(1, 2), bf16(1.0)], "finite and >= 0"),
        (1, 5, 1e-40, [f32(1, 2), bf16(1.0)], "premultiplied by it in f32"),
        (1, 5, 1e39, [f32(1, 2), bf16(1.0)], "premultiplied by it in f32"),
        (7, 5, 1.0, [f32(1, 2), bf16(1.0)], "not on this host's roster"),
    ],
)
def test_a_protocol_violation_raises_and_leaves_the_round_as_it_was(rank, round_id, mass, tensors, match):
    # It used to poison the station, and the relay stopped: one rank's broken stream took its whole host
    # down. Every check comes before the first add, so the round holds only what passed.
    station = opened()
    with pytest.raises(FoldError, match=match):
        station.deposit(rank, round_id, mass, tensors)
    assert station.round_id == 5 and station.counters.deposits == 1
    if rank in station.roster:
        assert station.mark_dead(rank) is None  # the relay makes it leave
    else:
        station.deposit(1, 5, 1.0, [f32(1, 2), bf16(1.0)])
    out = station.deposit(2, 5, 2.0, [f32(3, 4), bf16(2.0)])
    assert out is not None and out.round_id == 5 and rank not in out.ranks
    assert out.tensors[0].tolist() == ([4.0, 6.0] if rank in station.roster else [5.0, 8.0])


def test_unsupported_dtype_in_a_first_deposit_is_refused():
    with pytest.raises(FoldError, match="float64"):
        FoldStation([0]).deposit(0, 0, 1.0, [np.zeros(3)])


def test_a_resent_deposit_is_counted_once_and_a_late_one_is_dropped():
    station = FoldStation([0, 1])
    assert station.awaits(0, 4) and station.awaits(1, 4)
    station.deposit(0, 4, 1.0, [f32(1)])
    assert not station.awaits(0, 4) and station.awaits(1, 4)
    assert station.deposit(0, 4, 5.0, [f32(9)]) is None  # the resend crossed the original
    out = station.deposit(1, 4, 2.0, [f32(2)])
    assert out.mass == 3.0 and out.tensors[0].tolist() == [3.0]
    assert station.deposit(1, 4, 2.0, [f32(2)]) is None  # shipped: late, never a second frame
    assert station.counters.duplicate_drops == 1 and station.counters.late_drops == 1
    assert not station.awaits(1, 4) and station.awaits(1, 5)


def test_zero_mass_deposits_fold_like_any_other():
    station = FoldStation([0, 1])
    station.deposit(0, 0, 0.0, [f32(0, 0)])
    out = station.deposit(1, 0, 0.0, [f32(0, 0)])
    assert out.mass == 0.0
    np.testing.assert_array_equal(out.tensors[0], [0, 0])


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_one_pass_promotion_and_divide_encode_match_the_step_by_step_result(dtype):
    """fill_sum == fill then add; encode_into(divisor) == divide the sums then encode."""
    rng = np.random.default_rng(7)
    n = 300_001  # more than one bf16 block, and not a multiple of one
    f = [rng.standard_normal(n).astype(np.float32) * 100 for _ in range(2)]
    if dtype == "bf16":
        xs = [bf16_from_f32(x, np.empty(n, np.uint16)) for x in f]
    else:
        xs = [x.astype(np.float32 if dtype == "f32" else np.float16) for x in f]
    schema = ((dtype, (n,)),)
    fused, steps = SumImage(schema), SumImage(schema)
    fused.fill_sum([xs[0]], [xs[1]])
    steps.fill([xs[0]])
    steps.add([xs[1]])
    np.testing.assert_array_equal(fused.flat, steps.flat)
    out_dt = {"f32": np.float32, "bf16": np.uint16, "f16": np.float16}[dtype]
    got, want = np.empty(n, out_dt), np.empty(n, out_dt)
    fused.encode_into([got], 3.0)
    np.divide(steps.flat, np.float32(3.0), out=steps.flat)
    steps.encode_into([want])
    np.testing.assert_array_equal(got, want)
    # The two-contribution round: encode_sum_into == fill_sum then encode_into.
    for divisor in (None, 3.0):
        fused.fill_sum([xs[0]], [xs[1]])
        fused.encode_into([want], divisor)
        SumImage(schema).encode_sum_into([xs[0]], [xs[1]], [got], divisor)
        np.testing.assert_array_equal(got, want)


def test_an_image_worked_in_pieces_on_worker_threads_equals_whole_array_numpy():
    """Every element summed and encoded exactly once, at its own offset, whatever the piece boundaries."""
    rng = np.random.default_rng(11)
    big = 2 * PIECE + 5  # three pieces, the last one short
    schema = (("f32", (big,)), ("bf16", (3, big // 3)), ("f16", (7,)), ("bf16", (big,)), ("f32", ()))
    wide = [[rng.standard_normal(s).astype(np.float32) * 50 for _, s in schema] for _ in range(3)]
    encode = {"f32": lambda x: x.copy(), "f16": lambda x: x.astype(np.float16),
              "bf16": lambda x: bf16_from_f32(x, np.empty(x.shape, np.uint16))}
    decoded = {"f32": lambda x: x, "f16": lambda x: x.astype(np.float32),
               "bf16": lambda x: f32_from_bf16(x, np.empty(x.shape, np.float32))}
    deposits = [[encode[dt](x) for (dt, _), x in zip(schema, d, strict=True)] for d in wide]
    image = SumImage(schema)
    image.fill_sum(deposits[0], deposits[1])
    image.add(deposits[2])
    totals = []
    for k, (dt, _) in enumerate(schema):
        totals.append(decoded[dt](deposits[0][k]) + decoded[dt](deposits[1][k]))
        totals[k] += decoded[dt](deposits[2][k])
        np.testing.assert_array_equal(image.sums[k], totals[k])
    outputs = [np.empty(s, np.uint16 if dt == "bf16" else np.float16 if dt == "f16" else np.float32)
               for dt, s in schema]
    image.encode_into(outputs, 3.0)
    for k, (dt, _) in enumerate(schema):
        np.testing.assert_array_equal(outputs[k], encode[dt](totals[k] / np.float32(3.0)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=4, max_size=12), st.integers(1, 4))
def test_resent_deposits_in_any_order_give_the_same_host_frame_as_one_copy_each(arrivals, rounds):
    """Round id + rank make a deposit idempotent: copies before or after the original never count twice."""
    once, again = FoldStation([0, 1, 2, 3]), FoldStation([0, 1, 2, 3])
    for round_id in range(1, rounds + 1):
        deposit = {r: (float(r + 1), [f32(r + round_id, 2.0 * r)]) for r in range(4)}
        want = None
        for r in range(4):
            want = once.deposit(r, round_id, *deposit[r]) or want
        got = None
        for r in [*arrivals, 0, 1, 2, 3]:  # copies of some ranks, then every rank at least once
            got = again.deposit(r, round_id, *deposit[r]) or got
        for r in arrivals[:3]:  # copies that arrive after the round shipped: late
            assert again.deposit(r, round_id, *deposit[r]) is None
        assert got.round_id == want.round_id == round_id and got.mass == want.mass
        assert got.ranks == want.ranks
        np.testing.assert_array_equal(got.tensors[0], want.tensors[0])


class Send:
    """A zero-copy send as fold.Sending sees it: done once the socket let go."""

    def __init__(self) -> None:
        self.done = False


def test_outputs_a_send_still_reads_are_not_handed_out_again_until_it_is_done():
    made = []
    cache = ImageCache(lambda schema: made.append(schema) or (object(), [np.zeros(4, np.float32)]))
    schema = (("f32", (4,)),)
    _, first = cache.get(schema)
    assert cache.get(schema)[1] is first  # not sent: the same buffers, round after round (and within one)
    sending = Send()
    cache.hold(first, sending)
    _, second = cache.get(schema)
    assert second[0] is not first[0] and cache.get(schema)[1] is second  # the next round writes elsewhere
    cache.hold([np.zeros(4, np.float32)], Send())  # buffers of no entry (int8's fresh ones): nothing held
    sending.done = True
    cache.hold(second, Send())
    assert cache.get(schema)[1] is first  # let go: reused, no new allocation
    assert len(made) == 2


def test_when_every_kept_entry_is_held_a_new_one_is_made_and_the_oldest_let_go():
    cache = ImageCache(lambda schema: (object(), [np.zeros(4, np.float32)]))
    schema = (("f32", (4,)),)
    held = []
    for _ in range(ENTRIES_KEPT + 2):
        _, outputs = cache.get(schema)
        assert all(outputs[0] is not h[0] for h in held)  # never one a send still reads
        cache.hold(outputs, Send())
        held.append(outputs)
