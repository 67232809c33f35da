"""Epoch dispatch arithmetic: Sync partitions, redistribution, chunk sizing, final window."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from flodl_zmq.coordinator.dispatch import (
    EpochPlan,
    FinalWindowPlan,
    chunk_batches,
    extend_partition_plans,
    final_window_alloc,
    is_final_window,
    max_crumb,
    partition_sizes,
    probe_chunk_batches,
    refresh_final_window_plan,
    remainder_spans,
    sync_plans,
)
from flodl_zmq.errors import ConfigError, CoordinatorError

ALL = [True, True, True]


def counts_and_alive(most: int) -> st.SearchStrategy[tuple[list[int], list[bool]]]:
    """Per-rank batch counts (0..most) and liveness flags, for a world of 1 to 6 ranks."""
    return st.integers(1, 6).flatmap(
        lambda w: st.tuples(
            st.lists(st.integers(0, most), min_size=w, max_size=w),
            st.lists(st.booleans(), min_size=w, max_size=w),
        )
    )

# --------------------------------------------------------------------------- Sync partitions


def test_dispatch_epoch_partitions_cover_dataset_no_overlap():
    assert sync_plans(0, 10, 2) == [EpochPlan(0, 0, 5), EpochPlan(0, 5, 5)]


def test_equal_partitions_give_the_extra_samples_to_the_first_ranks():
    assert partition_sizes(11, 3) == [4, 4, 3]


def test_dispatch_epoch_honors_explicit_partition_ratios():
    assert sync_plans(2, 12, 2, [1, 3]) == [EpochPlan(2, 0, 3), EpochPlan(2, 3, 9)]


def test_ratio_leftover_goes_to_the_largest_ratios():
    # 10 * [0.25, 0.25, 0.5] floors to [2, 2, 5]; the leftover sample goes to rank 2.
    assert partition_sizes(10, 3, [1, 1, 2]) == [2, 2, 6]


def test_dispatch_epoch_plans_are_the_same_for_the_same_epoch():
    assert sync_plans(4, 1000, 3, [0.5, 0.3, 0.2]) == sync_plans(4, 1000, 3, [0.5, 0.3, 0.2])


@pytest.mark.parametrize(
    "ratios",
    [[1.0], [1.0, 0.0], [1.0, -1.0], [1.0, float("nan")], [1.0, float("inf")]],
)
def test_bad_partition_ratios_are_config_errors(ratios):
    with pytest.raises(ConfigError, match="partition_ratios"):
        partition_sizes(100, 2, ratios)


def test_dispatch_epoch_errors_when_total_samples_zero():
    with pytest.raises(ConfigError, match="total_samples"):
        sync_plans(0, 0, 2)


def test_a_rank_without_data_is_refused_under_sync():
    with pytest.raises(ConfigError, match="without data"):
        partition_sizes(2, 3)
    with pytest.raises(ConfigError, match="without data"):
        partition_sizes(10, 2, [1, 1000])


@given(
    st.integers(1, 8).flatmap(
        lambda w: st.tuples(
            st.integers(w * 1000, 10_000),
            st.just(w),
            st.none() | st.lists(st.floats(1, 100), min_size=w, max_size=w),
        )
    )
)
def test_sync_plans_tile_the_dataset_in_rank_order(case):
    total, world, ratios = case
    plans = sync_plans(7, total, world, ratios)
    assert [p.offset for p in plans] == [0] + [p.offset + p.size for p in plans[:-1]]
    assert plans[-1].offset + plans[-1].size == total
    assert all(p.size > 0 and p.epoch == 7 for p in plans)


# --------------------------------------------------------------------------- dead rank under Sync


def test_dead_rank_remainder_redistributed_via_extend_partition():
    plans = sync_plans(0, 30, 3)
    remainder = remainder_spans([plans[1]], samples_done=0)
    assert remainder == [(10, 10)]
    assert extend_partition_plans(0, remainder, [2, 0]) == [
        (0, EpochPlan(0, 10, 5)),
        (2, EpochPlan(0, 15, 5)),
    ]


def test_remainder_skips_what_the_dead_rank_processed():
    assert remainder_spans([EpochPlan(0, 10, 10)], samples_done=4) == [(14, 6)]
    assert remainder_spans([EpochPlan(0, 10, 10)], samples_done=12) == []


def test_remainder_follows_the_rank_through_its_extensions():
    plans = [EpochPlan(0, 0, 10), EpochPlan(0, 25, 4), EpochPlan(0, 40, 6)]
    assert remainder_spans(plans, samples_done=12) == [(27, 2), (40, 6)]


def test_extend_share_crossing_a_span_boundary_becomes_two_records():
    out = extend_partition_plans(1, [(27, 2), (40, 6)], [0, 1])
    assert out == [(0, EpochPlan(1, 27, 2)), (0, EpochPlan(1, 40, 2)), (1, EpochPlan(1, 42, 4))]


def test_extend_gives_nothing_to_survivors_with_an_empty_share():
    assert extend_partition_plans(0, [(5, 1)], [0, 1, 2]) == [(0, EpochPlan(0, 5, 1))]


def test_extend_without_survivors_hands_nothing_out():
    assert extend_partition_plans(0, [(5, 10)], []) == []


@given(
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20)), max_size=5),
    st.sets(st.integers(0, 7), min_size=1),
)
def test_extend_partition_hands_out_the_remainder_exactly_and_evenly(gaps_sizes, survivors):
    remainder, offset = [], 0
    for gap, size in gaps_sizes:
        remainder.append((offset + gap, size))
        offset += gap + size
    out = extend_partition_plans(0, remainder, sorted(survivors, reverse=True))
    handed = [i for _, p in out for i in range(p.offset, p.offset + p.size)]
    assert handed == [i for o, s in remainder for i in range(o, o + s)]
    per_rank = [sum(p.size for r, p in out if r == s) for s in survivors]
    assert max(per_rank) - min(per_rank) <= 1


# --------------------------------------------------------------------------- chunk sizing


def size(rank=0, **kw):
    args = dict(
        remaining_batches=1000,
        counts=[20, 10],
        window_steps=0,
        barrier_paced=False,
        calibrated=True,
        probe_batches=4,
        min_chunk_batches=8,
        overshoot=0,
        final_window=None,
    )
    args.update(kw)
    return chunk_batches(rank, **args)


def test_empty_pool_sizes_no_chunk():
    assert size(remaining_batches=0) == 0


def test_barrier_paced_chunk_is_one_window():
    assert size(0, barrier_paced=True) == 20
    assert size(1, barrier_paced=True) == 10


def test_uncalibrated_async_uses_the_probe_size():
    assert size(calibrated=False, probe_batches=6) == 6
    assert probe_chunk_batches(total_samples=100_000, world_size=2, batch_size=32) == 156
    assert probe_chunk_batches(total_samples=100, world_size=2, batch_size=32) == 4


def test_calibrated_async_chunk_is_its_share_of_the_remainder_capped_by_budget():
    # share = ceil(1000 * 20 / 30) = 667, capped to budget 20 + overshoot 5 - steps 3.
    assert size(0, overshoot=5, window_steps=3) == 22


def test_calibrated_async_chunk_floors_at_min_chunk_batches():
    assert size(1, remaining_batches=40, counts=[20, 1], overshoot=100) == 8


def test_edge_schedule_caps_at_the_rank_count_and_budget():
    # rem 25 < sum(counts) 30: the edge of the epoch.
    assert size(0, remaining_batches=25) == 20
    assert size(0, remaining_batches=25, window_steps=15) == 5


def test_a_rank_at_its_budget_may_still_take_one_batch_at_the_edge():
    assert size(0, remaining_batches=25, window_steps=20) == 1


def test_pinned_final_window_allocation_bypasses_the_caps():
    plan = FinalWindowPlan(0, (23, 0), (20, 10))
    assert size(0, remaining_batches=23, window_steps=20, final_window=plan) == 23
    assert size(1, remaining_batches=23, final_window=plan) == 0


# --------------------------------------------------------------------------- final window


def test_proportional_split_sums_and_has_no_lone_one():
    assert final_window_alloc(72, [71, 18, 15], ALL) == [49, 13, 10]


@pytest.mark.parametrize("rem", range(2, 21))
def test_tiny_proportional_windows_consolidate(rem):
    alloc = final_window_alloc(rem, [71, 18, 15], ALL)
    assert sum(alloc) == rem
    assert 1 not in alloc


def window_time(alloc, counts):
    """A window's time in units of a schedule: counts are proportional to speed."""
    return max(Fraction(a, c) for a, c in zip(alloc, counts, strict=True) if c)


def test_a_window_that_is_its_whole_epoch_keeps_the_slow_ranks_lone_batch():
    # 5 batches at 1 : 3 speed: [4, 1] ends with the fast rank's 4th batch; [5, 0]
    # (floDl's rule, kept for an epoch's later windows) a batch later, with the slow
    # rank idle every epoch.
    two = [True, True]
    assert final_window_alloc(5, [12, 4], two, whole_epoch=True) == [4, 1]
    assert final_window_alloc(5, [12, 4], two) == [5, 0]
    assert window_time([4, 1], [12, 4]) < window_time([5, 0], [12, 4])


def test_in_a_whole_epoch_window_a_lone_batch_moves_where_it_stretches_the_window_a_tenth_at_most():
    two = [True, True]
    # [2, 1]: the slow rank's one batch takes as long as three of the fast rank's.
    assert final_window_alloc(3, [12, 4], two, whole_epoch=True) == [3, 0]
    # [19, 1] at 19 : 1 speed: a 20th batch stretches the fast rank's window by a
    # twentieth; [9, 1] at 8 : 1, a 10th by more than a tenth.
    assert final_window_alloc(20, [190, 10], two, whole_epoch=True) == [20, 0]
    assert final_window_alloc(10, [80, 10], two, whole_epoch=True) == [9, 1]


@pytest.mark.parametrize("rem", range(2, 21))
def test_whole_epoch_windows_keep_lone_ones_only_where_moving_them_stretches_the_window(rem):
    counts = [71, 18, 15]
    alloc = final_window_alloc(rem, counts, ALL, whole_epoch=True)
    assert sum(alloc) == rem
    for r in (r for r in range(3) if alloc[r] == 1):
        peer = min((p for p in range(3) if p != r and alloc[p] >= 1), key=lambda p: (alloc[p], p))
        moved = list(alloc)
        moved[peer], moved[r] = moved[peer] + 1, 0
        assert window_time(moved, counts) > window_time(alloc, counts) * Fraction(11, 10)


def test_fold_band_pads_slow_ranks_not_the_fastest():
    alloc = final_window_alloc(106, [71, 18, 15], ALL)
    assert alloc == [71, 19, 16]
    assert alloc[1] + alloc[2] == 35


def test_fold_band_crumb_wraps_round_robin_over_the_slow_ranks():
    assert final_window_alloc(10 + 5 + 5 + 2, [10, 5, 5], ALL) == [10, 6, 6]
    assert final_window_alloc(10 + 5 + 4 + 2, [10, 5, 4], ALL) == [10, 6, 5]


@pytest.mark.parametrize(
    "rem, counts, expected",
    [(3, [5, 5, 5], [0, 3, 0]), (4, [2, 1, 1], [2, 0, 2]), (5, [2, 2, 1], [3, 2, 0])],
)
def test_consolidate_examples(rem, counts, expected):
    assert final_window_alloc(rem, counts, ALL) == expected


def test_dead_rank_gets_nothing():
    alloc = final_window_alloc(50, [71, 18, 15], [True, False, True])
    assert alloc[1] == 0 and sum(alloc) == 50


def test_fastest_rank_skips_dead():
    # Rank 0 is dead, so rank 1 is the fastest live rank and is never padded.
    assert final_window_alloc(35, [71, 18, 15], [False, True, True]) == [0, 18, 17]


def test_a_lone_live_rank_takes_everything():
    assert final_window_alloc(73, [71, 18, 15], [True, False, False]) == [73, 0, 0]


def test_irreducible_lone_one_is_left_for_the_fallback():
    assert sorted(final_window_alloc(1, [71, 18, 15], ALL)) == [0, 0, 1]


def test_final_window_without_a_live_rank_is_refused():
    with pytest.raises(CoordinatorError, match="no live rank"):
        final_window_alloc(5, [3, 3], [False, False])


@given(
    counts_and_alive(80),
    st.integers(1, 600),
)
def test_final_window_sums_to_the_remainder_without_lone_ones(case, rem):
    counts, alive = case
    if not any(c > 0 and a for c, a in zip(counts, alive, strict=True)):
        return
    alloc = final_window_alloc(rem, counts, alive)
    assert sum(alloc) == rem
    assert all(x == 0 for x, a in zip(alloc, alive, strict=True) if not a)
    assert rem == 1 or 1 not in alloc


def test_final_window_is_the_last_window_with_its_crumb():
    # 104 live batches per window: a crumb of up to 10 (a tenth) rides along.
    assert is_final_window(114, [71, 18, 15], ALL)
    assert not is_final_window(115, [71, 18, 15], ALL)
    assert not is_final_window(0, [71, 18, 15], ALL)
    assert is_final_window(35, [71, 18, 15], [False, True, True])


def test_small_schedules_still_fold_any_crumb_below_the_world_size():
    assert max_crumb(12, 3) == 2
    assert is_final_window(14, [4, 4, 4], ALL)
    assert not is_final_window(15, [4, 4, 4], ALL)
    assert max_crumb(169, 3) == 16


def test_a_four_batch_crumb_folds_into_the_last_window_instead_of_its_own():
    # The simulator's 12/3/1 ms schedule: 680 batches = 4 x 169 + 4.
    counts = [10, 40, 119]
    assert is_final_window(169 + 4, counts, ALL)
    assert final_window_alloc(169 + 4, counts, ALL) == [10, 41, 122]


def test_wide_crumb_stretches_every_window_alike():
    # Proportional: each rank's window grows by about the same fraction of its
    # count, rather than piling whole batches onto the slowest rank.
    alloc = final_window_alloc(114, [71, 18, 15], ALL)
    assert alloc == [78, 20, 16]
    assert all(a >= c for a, c in zip(alloc, [71, 18, 15], strict=True))


@given(
    counts_and_alive(200),
    st.integers(0, 40),
)
def test_fold_band_gives_every_live_rank_at_least_its_count(case, crumb):
    counts, alive = case
    live = [c if a else 0 for c, a in zip(counts, alive, strict=True)]
    total = sum(live)
    if total == 0 or crumb > max_crumb(total, len(counts)):
        return
    alloc = final_window_alloc(total + crumb, counts, alive)
    assert sum(alloc) == total + crumb
    # A count of 1 may be consolidated away (no lone one-step rank); every
    # other live rank does at least its schedule.
    assert all(a >= c for a, c in zip(alloc, live, strict=True) if c >= 2)
    assert all(a == 0 for a, x in zip(alloc, alive, strict=True) if not x)


def test_final_window_plan_is_pinned_then_kept_while_counts_hold():
    plan = refresh_final_window_plan(
        None, epoch=3, remaining_batches=72, counts=[71, 18, 15], alive=ALL
    )
    assert plan == FinalWindowPlan(3, (49, 13, 10), (71, 18, 15))
    # Ranks taking their shares drain the pool; the pinned allocation stays.
    again = refresh_final_window_plan(
        plan, epoch=3, remaining_batches=23, counts=[71, 18, 15], alive=ALL
    )
    assert again is plan


def test_stale_final_window_plan_repins_when_counts_change():
    plan = refresh_final_window_plan(
        None, epoch=3, remaining_batches=72, counts=[71, 18, 15], alive=ALL
    )
    repinned = refresh_final_window_plan(
        plan, epoch=3, remaining_batches=72, counts=[60, 30, 15], alive=ALL
    )
    assert repinned == FinalWindowPlan(
        3, tuple(final_window_alloc(72, [60, 30, 15], ALL)), (60, 30, 15)
    )


def test_final_window_plan_repins_when_a_rank_dies():
    plan = refresh_final_window_plan(
        None, epoch=3, remaining_batches=72, counts=[71, 18, 15], alive=ALL
    )
    alive = [True, False, True]
    repinned = refresh_final_window_plan(
        plan, epoch=3, remaining_batches=72, counts=[71, 18, 15], alive=alive
    )
    assert repinned is not None and repinned.alloc[1] == 0 and sum(repinned.alloc) == 72


def test_no_final_window_plan_outside_the_last_window_or_for_another_epoch():
    assert (
        refresh_final_window_plan(
            None, epoch=0, remaining_batches=500, counts=[71, 18, 15], alive=ALL
        )
        is None
    )
    old = FinalWindowPlan(3, (49, 13, 10), (71, 18, 15))
    assert (
        refresh_final_window_plan(
            old, epoch=4, remaining_batches=500, counts=[71, 18, 15], alive=ALL
        )
        is None
    )


def test_sync_partitions_are_whole_batches_so_the_world_steps_as_one_process_does():
    # Partitions of samples each ended in a short batch: 3588 samples over 4 ranks of batch 32 were 4 x 897 =
    # 4 x (28 x 32 + 1), 116 steps an epoch where one process takes 113 (a OneCycleLR counted for 113 raised),
    # and four batches of one sample, which BatchNorm refuses in training.
    assert partition_sizes(3588, 4, batch_size=32) == [896, 896, 896, 900]
    assert partition_sizes(3600, 3, [1, 1, 2], batch_size=32) == [896, 896, 1808]
    assert partition_sizes(40, 4, batch_size=16) == [10, 10, 10, 10]  # fewer whole batches than ranks: by samples


@given(st.integers(1, 8), st.integers(1, 64), st.integers(1, 5000))
def test_sync_partitions_step_as_many_times_as_one_process_and_only_the_last_is_short(world, batch, total):
    assume(total >= world)
    sizes = partition_sizes(total, world, batch_size=batch)
    assert sum(sizes) == total and min(sizes) > 0
    if total // batch >= world:
        assert all(s % batch == 0 for s in sizes[:-1])
        assert sum(-(-s // batch) for s in sizes) == -(-total // batch)


def test_a_dead_ranks_remainder_goes_to_the_survivors_in_whole_batches():
    # 64 samples in batches of 16 over three survivors were 22 + 21 + 21: three short batches, two steps more
    # than the four the dead rank would have taken.
    plans = extend_partition_plans(1, [(64, 64)], [0, 2, 3], batch_size=16)
    assert [(r, p.offset, p.size) for r, p in plans] == [(0, 64, 32), (2, 96, 16), (3, 112, 16)]
    tail = extend_partition_plans(1, [(64, 40)], [0, 2], batch_size=16)
    assert [(r, p.offset, p.size) for r, p in tail] == [(0, 64, 16), (2, 80, 24)]
