"""The dispatch strategies driven directly, without the coordinator."""

from __future__ import annotations

import pytest

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.elche import ElChe
from flodl_zmq.coordinator.liveness import Liveness
from flodl_zmq.coordinator.metrics import EpochReports
from flodl_zmq.coordinator.strategy import ChunkStream, SyncPartitions
from flodl_zmq.errors import CoordinatorError
from flodl_zmq.wire import records as rec


def metrics(rank, epoch, samples):
    return rec.EpochMetrics(
        rank=rank, epoch=epoch, avg_loss=1.0, batches_processed=samples, samples_processed=samples,
        epoch_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0, scalar_sums={}, scalar_counts={})


def sync(world=3, total=30):
    cfg = CoordinatorConfig(total_samples=total, batch_size=1, num_epochs=2, mode="sync")
    liveness = Liveness(world, 30.0, 0.0)
    opened = []
    return SyncPartitions(cfg, liveness, lambda: opened.append(True)), liveness, opened


def stream(mode, world=2, total=40, epochs=2):
    cfg = CoordinatorConfig(total_samples=total, batch_size=1, num_epochs=epochs, mode=mode)
    liveness = Liveness(world, 30.0, 0.0)
    elche = ElChe(cfg.elche_config(world), world)
    s = ChunkStream(cfg, liveness, elche, lambda: None, cfg.mode.barrier_paced, {}, EpochReports(world, 1, total))
    return s, liveness


def test_sync_partitions_tile_the_epoch_and_announce_it_first():
    s, _, opened = sync()
    sends = s.open_epoch(0, [0, 0, 0])
    assert opened == [True]
    assert sends == [(r, rec.StartEpoch(rec.EpochPlan(0, 10 * r, 10))) for r in range(3)]


def test_sync_death_hands_on_only_what_no_consensus_holds():
    s, liveness, _ = sync()
    s.open_epoch(0, [0, 0, 0])
    s.bank(0, 4)  # four steps of batch size 1 in a published consensus; a fifth trained, never deposited
    liveness.fail(0)
    sends = s.on_death(0, step_count=5, deposit=None)
    assert sends == [(1, rec.ExtendPartition(0, 4, 3)), (2, rec.ExtendPartition(0, 7, 3))]
    assert not s.epoch_done(0)
    for r in (1, 2):
        assert s.on_metrics(r, metrics(r, 0, 13), step_count=13)
    assert not s.epoch_done(0)  # reported, in no consensus yet
    for r in (1, 2):
        s.bank(r, 13)
    assert s.epoch_done(0) and s.quiesced(1, last_aggregated=-1)


def test_sync_death_with_a_deposit_in_flight_hands_on_once_its_round_says_what_it_holds():
    s, liveness, _ = sync()
    s.open_epoch(0, [0, 0, 0])
    liveness.fail(0)
    assert s.on_death(0, step_count=6, deposit=6) == [] and not s.epoch_done(0)
    s.bank(0, 6)  # the round published its deposit
    assert s.settle(0) == [(1, rec.ExtendPartition(0, 6, 2)), (2, rec.ExtendPartition(0, 8, 2))]


def test_sync_reports_of_another_epoch_are_late():
    s, _, _ = sync()
    s.open_epoch(1, [0, 0, 0])
    assert not s.on_metrics(0, metrics(0, 0, 10), step_count=10)


def test_sync_reports_beyond_the_partition_raise_and_change_nothing():
    s, _, _ = sync()
    s.open_epoch(0, [0, 0, 0])
    assert s.on_metrics(0, metrics(0, 0, 6), step_count=6)
    with pytest.raises(CoordinatorError, match="beyond the 10 of its partition"):
        s.on_metrics(0, metrics(0, 0, 2**53 - 1), step_count=7)  # repeated, its sums would outgrow any record
    assert s.on_metrics(0, metrics(0, 0, 4), step_count=10) and s.quiesced(0, last_aggregated=-1)


def test_a_chunk_completion_of_the_wrong_size_raises_and_changes_nothing():
    s, _ = stream("cadence")
    plan = s.next_plan(0, window_steps=0, overshoot=0, last_aggregated=-1, now=0.0)
    with pytest.raises(CoordinatorError, match="trained whole"):
        s.on_metrics(0, metrics(0, 0, plan.size - 1), step_count=plan.size - 1)
    assert s.pools[0].in_flight(0) == plan


def test_a_forfeited_chunk_is_redone_first_and_its_late_completion_ignored():
    s, liveness = stream("cadence")
    lost = s.next_plan(0, window_steps=0, overshoot=0, last_aggregated=-1, now=0.0)
    liveness.fail(0)
    s.on_death(0, step_count=0, deposit=None)
    assert not s.on_metrics(0, metrics(0, 0, lost.size), step_count=lost.size)
    assert s.next_plan(1, window_steps=0, overshoot=0, last_aggregated=-1, now=0.0) == lost


def test_cadence_never_opens_an_epoch_before_its_predecessor_is_aggregated_async_may():
    for mode, ahead in (("cadence", False), ("async", True)):
        s, _ = stream(mode, world=1, total=8)
        plan = s.next_plan(0, window_steps=0, overshoot=3, last_aggregated=-1, now=0.0)
        assert plan == rec.EpochPlan(0, 0, 8)
        s.on_metrics(0, metrics(0, 0, 8), step_count=8)
        assert s.done_through(-1) == 0 and not s.epoch_done(0)  # trained, in no consensus yet
        s.bank(0, 8)
        assert s.epoch_done(0)
        nxt = s.next_plan(0, window_steps=0, overshoot=3, last_aggregated=-1, now=0.0)
        assert (nxt is not None and nxt.epoch == 1) is ahead, mode
        assert s.quiesced(0, last_aggregated=-1) is not ahead


def test_a_chunk_ends_its_window_when_full_or_when_it_takes_the_rest_of_a_pinned_final_window():
    s, _ = stream("cadence", total=400, epochs=1)
    plan = s.next_plan(0, 0, 0, -1, 0.0)  # opens the epoch: 400 batches, far more than a window of 10 + 10
    assert s.ends_window(0, plan, 10) and not s.ends_window(0, plan, 9)
    small, _ = stream("cadence", total=20, epochs=1)
    plan = small.next_plan(0, 0, 0, -1, 0.0)  # the whole epoch fits one window: pinned, 10 + 10
    # Its pinned allocation taken whole, the rank has nothing more to take, however short its window.
    assert plan.size == 10 and small.ends_window(0, plan, 3)


def test_a_ranks_chunks_in_no_consensus_are_redone_when_it_leaves_and_their_reports_withdrawn():
    # A chunk reported done lives only in its rank's replica until a published round holds the rank's deposit
    # of it: a rank that left before took it along, and a resume from that consensus must not skip it.
    s, liveness, reports = reported_stream()
    first = s.next_plan(0, 0, 0, -1, 0.0)
    s.on_metrics(0, metrics(0, 0, first.size), step_count=first.size)
    second = s.next_plan(0, 0, 100, -1, 0.0)
    report = metrics(0, 0, second.size)
    reports.add(report, -1)
    s.on_metrics(0, report, step_count=first.size + second.size)
    s.bank(0, first.size)  # a round holds the first chunk only
    assert s.coverage() == {0: [(first.offset, first.size)]}
    liveness.fail(0)
    s.on_death(0, step_count=first.size + second.size, deposit=None)
    assert reports.close(0, None).per_rank_samples == [0, 0]  # its report withdrawn
    assert s.next_plan(1, 0, 100, -1, 0.0) == second  # redone first


def reported_stream() -> tuple[ChunkStream, Liveness, EpochReports]:
    """An async stream of 40 samples in batches of 1 over 2 ranks, with the epoch reports it keeps."""
    cfg = CoordinatorConfig(total_samples=40, batch_size=1, num_epochs=1, mode="async")
    liveness = Liveness(2, 30.0, 0.0)
    reports = EpochReports(2, 1, 40)
    return ChunkStream(cfg, liveness, ElChe(cfg.elche_config(2), 2), lambda: None, False, {}, reports), liveness, reports


@pytest.mark.parametrize("published", [True, False])
def test_the_first_batches_of_a_chunk_a_consensus_holds_are_covered_and_never_redone(published):
    # A rank deposits mid-chunk: the consensus holds the chunk's first batches. A checkpoint then, or the rank's
    # death, redid the whole chunk: every resume or death with a chunk in flight trained a few steps twice.
    s, liveness, reports = reported_stream()
    chunk = s.next_plan(0, 0, 100, -1, 0.0)
    assert chunk.size == 4  # its probe chunk: 4 batches of 1 sample
    s.bank(0, 1)  # a round holds its deposit of its first step
    assert s.coverage() == {0: [(chunk.offset, 1)]}
    liveness.fail(0)
    s.on_death(0, step_count=3, deposit=2)  # its deposit of 2 steps is in a round not yet published
    assert s.next_plan(1, 0, 100, -1, 0.0) == rec.EpochPlan(0, chunk.offset + 2, 2)  # the rest, first
    if published:
        s.bank(0, 2)
    s.settle(0)
    held = 2 if published else 1
    assert s.coverage() == {0: [(chunk.offset, held)]}
    assert reports.close(0, None).per_rank_samples == [held, 0]  # counted once, reported by the coordinator
    if not published:  # the step only its lost deposit held is redone too
        s.on_metrics(1, metrics(1, 0, 2), step_count=2)
        assert s.next_plan(1, 0, 100, -1, 0.0) == rec.EpochPlan(0, chunk.offset + 1, 1)
