"""The progressive chunk pool: spans, steals, one chunk in flight, reclaim, rollback, coverage."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from flodl_zmq.coordinator.chunk_pool import ChunkPool
from flodl_zmq.errors import CoordinatorError, TrainingError
from flodl_zmq.wire.records import EpochPlan


def pool(total=100, world=2, batch_size=1, shares=None, epoch=0):
    return ChunkPool(epoch, total, batch_size, shares or [1] * world)


# --------------------------------------------------------------------------- spans and takes


def test_chunk_pool_basic():
    p = pool(1000)
    assert p.take(0, 100) == EpochPlan(0, 0, 100)
    assert p.take(1, 100) == EpochPlan(0, 500, 100)
    assert p.remaining() == 800


def test_spans_follow_shares_in_whole_batches():
    p = pool(400, batch_size=10, shares=[3, 1])
    assert p.take(1, 1000) == EpochPlan(0, 300, 100)
    assert p.take(0, 1000) == EpochPlan(0, 0, 300)


def test_leftover_batches_go_round_robin():
    p = pool(10, world=3)
    assert [p.take(r, 10).size for r in range(3)] == [4, 3, 3]


def test_pool_drops_the_sub_batch_tail():
    p = pool(105, world=1, batch_size=10)
    assert (p.size, p.dropped, p.remaining()) == (100, 5, 100)


def test_chunk_pool_exhaustion():
    p = pool(100, world=1)
    assert p.take(0, 60) == EpochPlan(0, 0, 60)
    p.complete(0)
    assert p.take(0, 60) == EpochPlan(0, 60, 40)
    p.complete(0)
    assert p.take(0, 60) is None


def test_take_steals_largest_residue_tail_when_span_exhausted():
    p = pool(300, world=3)
    p.take(0, 100)
    p.complete(0)
    p.take(1, 30)  # rank 1 residue 70
    p.take(2, 70)  # rank 2 residue 30
    assert p.take(0, 10) == EpochPlan(0, 190, 10)  # back of rank 1's span


def test_owner_and_thief_never_cross():
    p = pool(20, world=2)
    p.take(1, 10)
    p.complete(1)
    assert p.take(1, 6) == EpochPlan(0, 4, 6)  # thief takes the back of rank 0's span
    assert p.take(0, 10) == EpochPlan(0, 0, 4)  # owner gets only the front that is left


def test_take_size_zero_serves_nothing():
    p = pool()
    assert p.take(0, 0) is None
    assert p.in_flight(0) is None


def test_take_must_be_whole_batches():
    with pytest.raises(CoordinatorError, match="multiple of the batch size 4"):
        pool(100, batch_size=4).take(0, 6)


def test_taking_with_a_chunk_in_flight_is_refused():
    p = pool()
    p.take(0, 10)
    with pytest.raises(CoordinatorError, match="already has chunk"):
        p.take(0, 10)


def test_rank_outside_the_world_is_refused():
    with pytest.raises(CoordinatorError, match="outside the world"):
        pool(world=2).take(2, 10)


def test_shares_must_have_a_positive_sum():
    with pytest.raises(CoordinatorError, match="shares"):
        pool(shares=[0, 0])


def test_zero_total_samples_is_done_at_once():
    p = pool(0)
    assert p.is_done()
    assert p.take(0, 10) is None


def test_single_rank_takes_everything():
    p = pool(50, world=1)
    assert p.take(0, 50) == EpochPlan(0, 0, 50)
    p.complete(0)
    assert p.is_done()


def test_chunk_pool_no_overlap():
    p = pool(500, world=3)
    seen: list[int] = []
    for turn in range(1000):
        plan = p.take(turn % 3, 7)
        if plan is None:
            break
        seen.extend(range(plan.offset, plan.offset + plan.size))
        p.complete(turn % 3)
    assert sorted(seen) == list(range(500))


# --------------------------------------------------------------------------- completion


def test_chunk_pool_is_epoch_done():
    p = pool(100)
    p.take(0, 50)
    p.take(1, 50)
    assert not p.is_done()
    p.complete(0)
    p.complete(1)
    assert p.is_done()


def test_chunk_pool_incremental_completion():
    p = pool(100)
    p.take(0, 50)
    p.complete(0)
    p.take(1, 50)
    assert not p.is_done() and p.remaining() == 0
    assert p.complete(1) == EpochPlan(0, 50, 50)
    assert p.is_done()


def test_in_flight_tracking():
    p = pool(100)
    plan = p.take(1, 20)
    assert p.in_flight(1) == plan and p.in_flight(0) is None
    p.complete(1)
    assert p.in_flight(1) is None


def test_completion_without_a_chunk_in_flight_is_ignored():
    assert pool().complete(0) is None


# --------------------------------------------------------------------------- death


def test_forfeit_reclaims_in_flight():
    p = pool(100)
    p.take(0, 20)
    assert p.forfeit(0) == EpochPlan(0, 0, 20)
    assert p.remaining() == 100
    # The reclaimed chunk is served first, before rank 1's own span.
    assert p.take(1, 50) == EpochPlan(0, 0, 20)


def test_forfeit_split_reclaim():
    p = pool(300, world=3)
    p.take(0, 50)
    p.forfeit(0)
    assert p.take(1, 20) == EpochPlan(0, 0, 20)
    assert p.take(2, 40) == EpochPlan(0, 20, 30)


def test_forfeit_keeps_the_first_samples_a_consensus_holds_done_and_reclaims_the_rest():
    p = pool(100)
    p.take(0, 20)
    p.forfeit(0, kept=8)
    assert p.covered() == [(0, 8)] and p.remaining() == 92
    assert p.take(1, 50) == EpochPlan(0, 8, 12)  # the rest, first
    with pytest.raises(CoordinatorError, match="cannot keep 30 samples"):
        p.take(0, 20)
        p.forfeit(0, kept=30)


def test_forfeit_is_idempotent():
    p = pool()
    p.take(0, 10)
    p.forfeit(0)
    assert p.forfeit(0) is None
    assert p.remaining() == 100


def test_dead_ranks_residue_is_stolen_by_survivors():
    p = pool(100)
    p.forfeit(0)
    p.take(1, 50)
    p.complete(1)
    assert p.take(1, 30) == EpochPlan(0, 20, 30)


def test_death_after_take_reclaims_and_completes_exactly_once():
    p = pool(100)
    p.take(0, 50)
    p.take(1, 50)
    p.forfeit(0)
    p.complete(1)
    assert p.take(1, 50) == EpochPlan(0, 0, 50)
    p.complete(1)
    assert p.is_done()
    assert p.covered() == [(0, 100)]


def test_completion_after_forfeit_clamps():
    p = pool(100)
    p.take(0, 50)
    p.forfeit(0)
    # A falsely declared dead rank reports late: a survivor redoes the chunk, so it does not count.
    assert p.complete(0) is None
    assert p.covered() == []


# --------------------------------------------------------------------------- failed sends


def test_rollback_take_rewinds_cursor():
    p = pool(100)
    p.take(0, 10)
    assert p.rollback(0) == EpochPlan(0, 0, 10)
    assert p.remaining() == 100
    assert p.take(0, 10) == EpochPlan(0, 0, 10)


def test_rollback_of_a_steal_restores_the_victims_tail():
    p = pool(100)
    p.take(1, 50)
    p.complete(1)
    p.take(1, 10)
    p.rollback(1)
    assert p.take(0, 50) == EpochPlan(0, 0, 50)


def test_rollback_of_a_detached_chunk_reclaims_it_first():
    p = pool(300, world=3)
    p.take(0, 50)
    p.forfeit(0)
    p.take(1, 20)  # (0, 20) from the reclaimed queue, not touching any residue
    p.take(2, 10)  # (20, 10) from what is left of it
    p.rollback(1)
    assert p.take(1, 100) == EpochPlan(0, 0, 20)


def test_rollback_take_unknown_chunk_is_noop():
    p = pool()
    assert p.rollback(0) is None
    assert p.remaining() == 100


# --------------------------------------------------------------------------- coverage and resume


def test_uncovered_ranges_tail_only_on_fresh_pool():
    assert pool(100).uncovered() == [(0, 100)]


def test_uncovered_ranges_excludes_completed_includes_inflight_and_tail():
    p = pool(100, world=1)
    p.take(0, 30)
    p.complete(0)
    p.take(0, 20)
    assert p.uncovered() == [(30, 70)]
    assert p.covered() == [(0, 30)]


def test_uncovered_ranges_includes_reclaimed():
    p = pool(100)
    p.take(0, 50)
    p.take(1, 20)
    p.complete(1)
    p.forfeit(0)
    assert p.uncovered() == [(0, 50), (70, 30)]


def test_from_coverage_dispatches_only_holes_each_once():
    p = ChunkPool.from_coverage(5, 100, 1, 2, [(0, 30), (66, 10)])
    assert p.remaining() == 60
    served = []
    while (plan := p.take(0, 20)) is not None:
        served.append((plan.offset, plan.size))
        p.complete(0)
    assert served == [(30, 20), (50, 16), (76, 20), (96, 4)]
    assert p.is_done()


def test_from_coverage_empty_holes_is_done():
    p = ChunkPool.from_coverage(0, 100, 10, 2, [(0, 50), (50, 50)])
    assert p.is_done() and p.remaining() == 0


def test_coverage_round_trips_through_a_resume():
    p = pool(200, world=2, batch_size=10)
    p.take(0, 30)
    p.complete(0)
    p.take(1, 50)
    resumed = ChunkPool.from_coverage(0, 200, 10, 2, p.covered())
    assert resumed.covered() == p.covered() == [(0, 30)]
    assert resumed.remaining() == 170


@pytest.mark.parametrize("covered", [[(90, 20)], [(0, 15)], [(0, 30), (20, 10)], [(-10, 10)]])
def test_coverage_from_another_dataset_is_refused(covered):
    with pytest.raises(TrainingError, match="batch size the checkpoint was written with"):
        ChunkPool.from_coverage(0, 100, 10, 2, covered)


# --------------------------------------------------------------------------- property


class PoolMachine(RuleBasedStateMachine):
    """Any interleaving of takes, completions, failed sends, deaths and resumes.

    The model keeps the set of completed samples across resumes: a sample
    completed twice is a duplicate; a pool that is done while the set is
    incomplete has lost one; the final drain must complete every sample.
    """

    @initialize(
        world=st.integers(1, 4),
        batches=st.integers(0, 30),
        batch_size=st.integers(1, 4),
        shares=st.lists(st.integers(0, 5), min_size=4, max_size=4),
    )
    def setup(self, world, batches, batch_size, shares):
        shares = shares[:world] if any(shares[:world]) else [1] * world
        self.world, self.batch_size = world, batch_size
        self.total = batches * batch_size + batch_size // 2  # a sub-batch tail to drop
        self.pool = ChunkPool(3, self.total, batch_size, shares)
        self.alive = set(range(world))
        self.flying: dict[int, EpochPlan] = {}
        self.completed: set[int] = set()

    @rule(rank=st.integers(0, 3), batches=st.integers(0, 6))
    def take(self, rank, batches):
        if rank not in self.alive:
            return
        if rank in self.flying:
            with pytest.raises(CoordinatorError):
                self.pool.take(rank, batches * self.batch_size)
            return
        plan = self.pool.take(rank, batches * self.batch_size)
        if plan is None:
            assert batches == 0 or self.pool.remaining() == 0
            return
        assert plan.epoch == 3 and 0 < plan.size <= batches * self.batch_size
        assert plan.offset % self.batch_size == 0 and plan.size % self.batch_size == 0
        self.flying[rank] = plan

    @rule(rank=st.integers(0, 3))
    def complete(self, rank):
        if rank >= self.world:
            return
        done = self.pool.complete(rank)
        assert done == self.flying.pop(rank, None)
        if done is not None:
            samples = set(range(done.offset, done.offset + done.size))
            assert not samples & self.completed, "a sample was completed twice"
            self.completed |= samples

    @rule(rank=st.integers(0, 3))
    def failed_send(self, rank):
        if rank < self.world:
            assert self.pool.rollback(rank) == self.flying.pop(rank, None)

    @rule(rank=st.integers(0, 3))
    def die(self, rank):
        if rank in self.alive:
            assert self.pool.forfeit(rank) == self.flying.pop(rank, None)
            self.alive.discard(rank)

    @rule()
    def resume(self):
        # The whole world restarts from the last checkpoint: in-flight work is lost.
        self.pool = ChunkPool.from_coverage(
            3, self.total, self.batch_size, self.world, self.pool.covered()
        )
        self.alive = set(range(self.world))
        self.flying = {}

    @invariant()
    def every_sample_is_in_exactly_one_place(self):
        covered = {i for o, n in self.pool.covered() for i in range(o, o + n)}
        assert covered == self.completed
        flying = sum(p.size for p in self.flying.values())
        assert self.pool.remaining() + flying + len(covered) == self.pool.size
        for rank, plan in self.flying.items():
            assert self.pool.in_flight(rank) == plan
        uncovered = [i for o, n in self.pool.uncovered() for i in range(o, o + n)]
        assert sorted([*uncovered, *covered]) == list(range(self.pool.size))

    @invariant()
    def done_exactly_when_every_sample_is_covered(self):
        assert self.pool.is_done() == (len(self.completed) == self.pool.size)

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for rank in list(self.flying):
            self.complete(rank)
        if not self.alive:
            self.resume()
        while self.pool.remaining():
            for rank in sorted(self.alive):
                self.take(rank, 3)
                self.complete(rank)
        assert self.pool.is_done()
        assert self.completed == set(range(self.pool.size))


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_pool_never_loses_or_duplicates_a_sample = PoolMachine.TestCase
