"""The coordinator state machine, driven directly: the cycle, the gate, deaths, shutdown."""

from __future__ import annotations

import random

import pytest

from flodl_zmq.coordinator.config import CoordinatorConfig, MaxFailure
from flodl_zmq.coordinator.core import Coordinator
from flodl_zmq.coordinator.outputs import (
    CONTROLLER,
    REDUCER,
    EvalsMerged,
    MassBound,
    RoundOpened,
    RunEnded,
    SaveState,
)
from flodl_zmq.errors import CoordinatorError
from flodl_zmq.wire import records as rec


def make(world=2, mode="cadence", total=800, bs=1, **kw):
    cfg = CoordinatorConfig(total_samples=total, batch_size=bs, num_epochs=kw.pop("epochs", 1),
                            mode=mode, **kw)
    c = Coordinator(cfg, world, 0.0)
    return c, c.start(0.0)


def of(outs, kind, dest=None):
    return [o.record for o in outs if isinstance(o.record, kind) and (dest is None or o.dest == dest)]


def batch(c, r, step, t=0.1, ms=10.0):
    return c.on_record(r, rec.Batch(rank=r, step_count=step, batch_ms=[ms], data_ms=[0.0], batch_loss=[1.0]), t)


def done(c, r, epoch, samples, t=0.1):
    return c.on_record(r, rec.EpochMetrics(
        rank=r, epoch=epoch, avg_loss=1.0, batches_processed=samples, samples_processed=samples,
        epoch_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0, scalar_sums={}, scalar_counts={}), t)


def train(c, r, plan, start_step, t=0.1, ms=10.0, metrics=True):
    """Rank r trains a whole chunk (batch size 1); returns every output and the new step count."""
    outs = []
    for i in range(plan.size):
        outs += batch(c, r, start_step + i + 1, t, ms)
    if metrics:
        outs += done(c, r, plan.epoch, plan.size, t)
    return outs, start_step + plan.size


def ack(c, r, rnd, t=0.2):
    return c.on_record(r, rec.SyncAck(rank=r, round=rnd, step_count=0, divergence=0.01,
                                      post_norm=1.0, pre_norm=1.0), t)


def finish(c, rnd, ranks, t=0.2):
    outs = c.on_round_complete(rnd, t)
    for r in ranks:
        outs += ack(c, r, rnd, t)
    return outs


# ------------------------------------------------------------------ the cycle


def test_sync_trigger_throttles_each_rank_before_requesting_params_then_updates_and_sets_global_step():
    c, outs = make(mode="sync", total=20)
    assert [p.plan for p in of(outs, rec.StartEpoch)] == [rec.EpochPlan(0, 0, 10), rec.EpochPlan(0, 10, 10)]
    assert of(batch(c, 0, 1), rec.RequestParams) == []  # rank 1 has not stepped yet
    outs = batch(c, 1, 1)
    assert outs[0].dest is CONTROLLER and outs[0].record == RoundOpened(1, (0, 1))
    # The reducer's mass cap before any request: each rank counted 1 step.
    assert outs[1].dest is REDUCER and outs[1].record == MassBound(1, ((0, 66.0), (1, 66.0)))
    # Throttle first: a rank must not step between its deposit and the barrier.
    assert [(o.dest, type(o.record)) for o in outs[2:]] == [
        (0, rec.Throttle), (0, rec.RequestParams), (1, rec.Throttle), (1, rec.RequestParams)]
    outs = finish(c, 1, [0, 1])
    kinds = [type(o.record) for o in outs]
    assert kinds == [rec.Update, rec.Update, rec.SetGlobalStep, rec.SetGlobalStep]
    assert of(outs, rec.Update, 0) == [rec.Update(round=1, next_plan=None)]
    assert of(outs, rec.SetGlobalStep, 1) == [rec.SetGlobalStep(2)]


def test_a_snapshot_in_the_open_round_raises_that_ranks_mass_bound_to_the_steps_reported_before_it():
    # Async ranks train on past the trigger; a rank reports every step before its deposit (PROTOCOL.md 9.5),
    # so at its SnapshotReady the coordinator's count is its deposit's mass.
    c, _ = make(mode="sync", total=20)
    batch(c, 0, 1)
    outs = batch(c, 1, 1)
    assert of(outs, MassBound) == [MassBound(1, ((0, 66.0), (1, 66.0)))]
    batch(c, 0, 40)  # 39 more steps of rank 0, reported before its snapshot
    outs = c.on_record(0, rec.SnapshotReady(rank=0, round=1), 0.1)
    assert [(o.dest, o.record) for o in outs] == [(REDUCER, MassBound(1, ((0, 2 * 40 + 64.0),)))]
    assert of(c.on_record(1, rec.SnapshotReady(rank=1, round=2), 0.1), MassBound) == []  # not the open round
    assert c.ignored["stale_round"] == 1


def test_cadence_gate_fires_on_batch_counts_even_with_pathological_slow_ms():
    c, outs = make()
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    assert [p.size for p in plans] == [10, 10]  # anchor 10 before calibration
    out0, _ = train(c, 0, plans[0], 0, ms=1e9)
    out1, _ = train(c, 1, plans[1], 0, ms=1e9)
    assert of(out0, RoundOpened) == []
    assert of(out1, RoundOpened) == [RoundOpened(1, (0, 1))]


def test_cadence_gate_does_not_fire_below_batch_counts():
    c, outs = make()
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    train(c, 0, plans[0], 0)
    out, _ = train(c, 1, plans[1], 0, metrics=False)  # 10 steps, chunk not reported done
    assert of(out, rec.RequestParams) == []
    for step in range(11, 15):  # steps beyond the window do not bypass the chunk rule either
        assert of(batch(c, 0, step), rec.RequestParams) == []


def test_cpu_gate_blocks_while_cycle_in_flight():
    c, outs = make(mode="sync", total=20)
    batch(c, 0, 1)
    assert len(of(batch(c, 1, 1), rec.RequestParams)) == 2
    for step in range(2, 6):
        assert of(batch(c, 0, step) + batch(c, 1, step), rec.RequestParams) == []
    outs = finish(c, 1, [0, 1])
    # Re-armed by the finish alone: the steps taken during the round open the gate again.
    assert of(outs, RoundOpened) == [RoundOpened(2, (0, 1))]


def test_update_carries_the_next_chunk_after_a_cadence_reduce():
    c, outs = make()
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    train(c, 0, plans[0], 0)
    train(c, 1, plans[1], 0)
    outs = finish(c, 1, [0, 1])
    nxt = [u.next_plan for u in of(outs, rec.Update)]
    assert all(p is not None and p.epoch == 0 for p in nxt)
    assert of(outs, rec.StartEpoch) == []  # dispatch rides in the Update, no second message


def test_counters_are_snapshotted_at_the_trigger():
    c, outs = make(mode="async", total=4000)
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    step = [0, 0]
    for r in (0, 1):
        for _ in range(10):
            step[r] += 1
            batch(c, r, step[r])
    assert c.cycle is not None
    for _ in range(3):  # Async keeps training while the round is in flight
        step[0] += 1
        batch(c, 0, step[0])
    finish(c, 1, [0, 1])
    assert c.global_step == 20
    assert c.window_steps == [3, 0]
    assert plans


def test_sync_ack_step_count_is_ignored():
    c, _ = make(mode="sync", total=20)
    batch(c, 0, 1)
    batch(c, 1, 1)
    c.on_round_complete(1, 0.2)
    c.on_record(0, rec.SyncAck(rank=0, round=1, step_count=999, divergence=0.0, post_norm=1.0,
                               pre_norm=1.0), 0.2)
    ack(c, 1, 1)
    assert c.window_steps == [0, 0] and c.global_step == 2


def test_quiesced_rank_does_not_block_the_reduce():
    c, outs = make(total=25, bs=1)  # spans 13/12; after one window 5 + ... left
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    step = [0, 0]
    out, step[0] = train(c, 0, plans[0], step[0])
    out, step[1] = train(c, 1, plans[1], step[1])
    outs = finish(c, 1, [0, 1])
    nxt = {o.dest: o.record.next_plan for o in outs if isinstance(o.record, rec.Update)}
    # The final window's allocation gives both ranks work or one all of it; a
    # rank given nothing must not hold the gate.
    working = [r for r, p in nxt.items() if p is not None]
    out = []
    for r in working:
        o, step[r] = train(c, r, nxt[r], step[r])
        out += o
    assert of(out, RoundOpened) == [RoundOpened(2, (0, 1))]
    assert sum(p.size for p in nxt.values() if p is not None) == 5


def test_abandoned_round_retries_without_crediting_steps():
    c, _ = make(mode="sync", total=20)
    batch(c, 0, 1)
    batch(c, 1, 1)
    outs = c.on_round_abandoned(1, 0.2)
    assert of(outs, rec.RequestParams) and of(outs, RoundOpened)[0].round == 2
    assert c.global_step == 0 and c.window_steps == [1, 1]


def test_repeated_abandoned_rounds_end_the_run_with_reduce_stall():
    c, _ = make(mode="sync", total=20)
    batch(c, 0, 1)
    batch(c, 1, 1)
    outs = []
    for rnd in (1, 2, 3):
        outs += c.on_round_abandoned(rnd, 0.2)
    assert of(outs, rec.ShutdownWithSave, 0) == [rec.ShutdownWithSave("reduce_stall")]


# ------------------------------------------------------------------ liveness


def test_heartbeat_stale_declares_rank_dead_and_unblocks_the_gate():
    c, outs = make(rank_silence_at_coordinator_s=1.0)
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    train(c, 0, plans[0], 0, t=0.9)
    outs = c.on_tick(1.5)  # rank 1 never spoke: stale after 1 s
    assert [o.record for o in outs if o.dest in (REDUCER, CONTROLLER) and not isinstance(o.record, MassBound)] == [
        rec.DeclareDead(1), RoundOpened(1, (0,))]
    assert of(outs, rec.RequestParams) == []  # rank 0 deposited at its chunk's end, as its plan said
    assert of(outs, rec.DeclareDead, 1) == [rec.DeclareDead(1)]  # back from its stall, it stops at once
    assert c.liveness.failures == 1


def test_a_rank_reported_dead_is_told_so_that_a_process_still_running_stops():
    # The relay expelled it (a poisoned deposit, a violation): the process may still run and hold its device.
    c, _ = make(world=3)
    outs = c.on_rank_death(1, "the relay on h0 saw it leave", 0.1)
    assert of(outs, rec.DeclareDead, 1) == [rec.DeclareDead(1)]
    assert of(outs, rec.DeclareDead, REDUCER) == [rec.DeclareDead(1)]
    assert of(outs, rec.DeclareDead, 0) == of(outs, rec.DeclareDead, 2) == []  # nothing for the others to do


def test_clean_exit_is_not_a_failure_and_never_goes_stale():
    c, _ = make(world=3, rank_silence_at_coordinator_s=1.0, max_failure=MaxFailure.absolute(1))
    outs = c.on_record(2, rec.Exiting(rank=2), 0.5)
    assert [o.record for o in outs if o.dest is REDUCER] == [rec.DeclareDead(2)]
    assert of(outs, rec.DeclareDead, 2) == []  # it is leaving already
    for r in (0, 1):
        c.on_record(r, rec.Heartbeat(rank=r, step_count=0), 1.9)
    outs = c.on_tick(2.0)
    assert of(outs, rec.ShutdownWithSave) == [] and of(outs, rec.DeclareDead) == []
    assert c.liveness.failures == 0


def test_duplicate_death_reports_are_counted_once():
    c, _ = make(world=3)
    c.on_rank_death(1, "exit code 137", 0.1)
    outs = c.on_rank_death(1, "exit code 137", 0.2)
    assert outs == [] and c.ignored["duplicate_death"] == 1 and c.liveness.failures == 1


def test_records_from_a_dead_rank_are_ignored_and_counted():
    c, _ = make()
    c.on_rank_death(1, "exit", 0.1)
    assert batch(c, 1, 1) == []
    assert c.ignored["from_departed"] == 1


def test_dead_rank_remainder_redistributed_via_extend_partition():
    c, _ = make(world=3, mode="sync", total=30)
    outs = c.on_rank_death(0, "exit", 0.1)
    ext = [(o.dest, o.record) for o in outs if isinstance(o.record, rec.ExtendPartition)]
    assert ext == [(1, rec.ExtendPartition(0, 0, 5)), (2, rec.ExtendPartition(0, 5, 5))]


@pytest.mark.parametrize("mode", ["sync", "cadence"])
def test_a_rank_absent_at_start_keeps_its_number_gets_nothing_and_the_live_ranks_cover_the_epoch(mode):
    cfg = CoordinatorConfig(total_samples=30, batch_size=1, num_epochs=1, mode=mode)
    c = Coordinator(cfg, 3, 0.0)
    outs = c.start(0.0, absent=[1])
    assert of(outs, rec.DeclareDead, REDUCER) == [rec.DeclareDead(rank=1)]
    assert not [o for o in outs if o.dest == 1]
    assert c.liveness.live == (0, 2) and c.liveness.failures == 1
    if mode == "sync":  # two partitions of the whole epoch, nothing for rank 1
        plans = sorted((o.record.plan.offset, o.record.plan.size) for o in outs if isinstance(o.record, rec.StartEpoch))
        assert plans == [(0, 15), (15, 15)]


def test_dead_sync_rank_hands_on_only_what_no_consensus_holds():
    # Its first step is in round 1's consensus; the two it took since left with its replica.
    c, _ = make(world=2, mode="sync", total=20)
    batch(c, 0, 1)
    batch(c, 1, 1)
    finish(c, 1, [0, 1])
    for s in (2, 3):
        batch(c, 0, s)
    outs = c.on_rank_death(0, "exit", 0.1)
    assert of(outs, rec.ExtendPartition) == [rec.ExtendPartition(0, 1, 9)]


def test_a_rank_that_leaves_mid_round_takes_its_step_along_from_the_global_step_and_the_consensus():
    # Round 2 opens on both ranks' second steps; rank 0 leaves before depositing. The consensus holds rank 1's
    # step alone: the global step (the schedule's, the evals' samples) counts 3, and rank 0's second sample
    # is trained again, by rank 1 once that round is over.
    c, _ = make(world=2, mode="sync", total=20)
    for r in (0, 1):
        batch(c, r, 1)
    finish(c, 1, [0, 1])
    for r in (0, 1):
        batch(c, r, 2)
    assert c.cycle is not None and c.cycle.round == 2
    assert of(c.on_rank_death(0, "exit", 0.3), rec.ExtendPartition) == []  # not before the round says what it holds
    outs = c.on_round_complete(2, 0.4, ranks=[1]) + ack(c, 1, 2, 0.4)
    assert c.global_step == 3
    assert of(outs, rec.ExtendPartition) == [rec.ExtendPartition(0, 1, 9)]


def test_death_forfeits_the_in_flight_chunk_to_a_survivor():
    c, outs = make(total=40)
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    train(c, 1, plans[1], 0)
    outs = c.on_rank_death(0, "exit", 0.2)
    # Rank 1 sits at the reduce; the round runs with it alone, then it redoes rank 0's chunk first.
    assert of(outs, RoundOpened) == [RoundOpened(1, (1,))]
    outs = finish(c, 1, [1])
    nxt = of(outs, rec.Update, 1)[0].next_plan
    assert (nxt.epoch, nxt.offset, nxt.size) == (plans[0].epoch, plans[0].offset, plans[0].size)


def test_max_failure_threshold_breach_dispatches_shutdown_with_save():
    c, _ = make(world=3, max_failure=MaxFailure.absolute(1))
    outs = c.on_rank_death(2, "exit", 0.1)
    assert [o.dest for o in outs if isinstance(o.record, rec.ShutdownWithSave)] == [0, 1]
    assert of(outs, rec.ShutdownWithSave)[0].reason == "max_failure_exceeded"
    save = of(outs, SaveState, CONTROLLER)[0]
    assert save.state["world_size"] == 3 and of(outs, RunEnded)[0].reason.value == "max_failure_exceeded"
    assert c.finished
    assert c.on_rank_death(1, "exit", 0.2) == []  # latched: no second save


def test_all_ranks_lost_shuts_down_with_save():
    c, _ = make(world=2)
    c.on_rank_death(0, "exit", 0.1)
    outs = c.on_rank_death(1, "exit", 0.2)
    assert of(outs, SaveState)[0].reason.value == "all_ranks_lost"


def test_reduce_stall_past_ceiling_escalates():
    c, _ = make(mode="sync", total=20, rank_silence_at_coordinator_s=10.0)
    batch(c, 0, 1)
    batch(c, 1, 1)
    outs = []
    for t in range(5, 300, 5):  # ranks stay alive, the round never completes
        for r in (0, 1):
            c.on_record(r, rec.Heartbeat(rank=r, step_count=1), float(t))
        outs += c.on_tick(float(t))
    assert of(outs, rec.ShutdownWithSave) == []
    outs = c.on_tick(300.5)
    assert of(outs, rec.ShutdownWithSave, 0) == [rec.ShutdownWithSave("reduce_stall")]


def test_coordinator_beacons_every_second():
    c, _ = make(rank_silence_at_coordinator_s=100.0)
    outs = []
    for i in range(1, 26):
        outs += c.on_tick(i / 10)
    assert len(of(outs, rec.CoordHeartbeat, 0)) == 3  # at 0.1, 1.1 and 2.1


def test_next_due_names_the_next_beacon_and_the_moment_the_quietest_rank_turns_stale():
    c, _ = make(rank_silence_at_coordinator_s=3.0)
    assert c.next_due() <= 0.1  # no beacon sent yet: one is owed now
    c.on_tick(0.1)
    assert c.next_due() == 1.1  # the next beacon
    c.on_tick(1.1)
    c.on_record(0, rec.Heartbeat(rank=0, step_count=0), 2.0)
    c.on_tick(2.1)
    c.on_record(0, rec.Heartbeat(rank=0, step_count=0), 2.9)
    due = c.next_due()  # rank 1 silent since 0.0: stale just after 3.0, before the beacon at 3.1
    assert 3.0 < due < 3.0001
    assert of(c.on_tick(3.0), rec.DeclareDead) == []
    assert of(c.on_tick(due), rec.DeclareDead, REDUCER) == [rec.DeclareDead(1)]


def test_next_due_includes_the_reduce_stall_ceiling_and_is_none_once_the_run_is_over():
    c, _ = make(mode="sync", total=20, rank_silence_at_coordinator_s=10.0)
    batch(c, 0, 1)
    batch(c, 1, 1)  # the round opens at 0.1
    stall = 0.1 + c.config.reduce_stall_s
    for t in [*range(5, int(stall), 5), stall - 0.5]:  # the last beacon half a second before the ceiling
        for r in (0, 1):
            c.on_record(r, rec.Heartbeat(rank=r, step_count=1), float(t))
        c.on_tick(float(t))
    due = c.next_due()
    assert stall < due < stall + 1e-6
    assert of(c.on_tick(due), rec.ShutdownWithSave, 0) == [rec.ShutdownWithSave("reduce_stall")]
    assert c.next_due() is None
    assert make()[0].next_due() is not None and Coordinator(c.config, 2, 0.0).next_due() is None  # before start


# ------------------------------------------------------------------ failed sends


def test_failed_start_epoch_returns_the_chunk_to_the_pool_and_fails_the_rank():
    c, outs = make(total=40)
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    pool = c.dispatch.pools[0]
    outs = c.on_send_failed(1, rec.StartEpoch(plan=plans[1]), 0.01)
    assert pool.in_flight(1) is None and pool.remaining() == 40 - plans[0].size
    assert [o.record for o in outs if o.dest is REDUCER] == [rec.DeclareDead(1)]
    assert c.liveness.failures == 1 and c.lost_sends["StartEpoch"] == 1


def test_the_survivor_trains_a_chunk_whose_send_failed():
    c, outs = make(total=40)
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    c.on_send_failed(1, rec.StartEpoch(plan=plans[1]), 0.01)
    trained, step, plan, rnd = [], 0, plans[0], 0
    while plan is not None:
        outs, step = train(c, 0, plan, step)
        trained.append((plan.offset, plan.size))
        if of(outs, RoundOpened):
            rnd += 1
            outs = finish(c, rnd, [0])
            plan = of(outs, rec.Update, 0)[0].next_plan
        else:
            plan = next((p.plan for p in of(outs, rec.StartEpoch, 0)), None)
    ends = [0] + [o + n for o, n in sorted(trained)]
    assert [o for o, _ in sorted(trained)] == ends[:-1] and ends[-1] == 40  # [0, 40) tiled once
    assert c.last_aggregated == 0


def test_failed_update_rolls_its_next_plan_back():
    c, outs = make(total=60)
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    train(c, 0, plans[0], 0)
    train(c, 1, plans[1], 0)
    update = of(finish(c, 1, [0, 1]), rec.Update, 0)[0]
    remaining = c.dispatch.pools[0].remaining()
    outs = c.on_send_failed(0, update, 0.3)
    assert c.dispatch.pools[0].in_flight(0) is None
    assert c.dispatch.pools[0].remaining() == remaining + update.next_plan.size
    assert of(outs, rec.DeclareDead, REDUCER) == [rec.DeclareDead(0)]


def test_failed_extend_partition_is_handed_on_with_the_rest_of_the_partition():
    c, _ = make(world=3, mode="sync", total=30)
    c.on_rank_death(0, "exit", 0.1)  # rank 1 gets (0, 5), rank 2 gets (5, 5)
    outs = c.on_send_failed(1, rec.ExtendPartition(0, 0, 5), 0.11)
    ext = [(o.dest, o.record) for o in outs if isinstance(o.record, rec.ExtendPartition)]
    assert ext == [(2, rec.ExtendPartition(0, 10, 10)), (2, rec.ExtendPartition(0, 0, 5))]


def test_failed_sync_start_epoch_hands_the_whole_partition_on():
    c, _ = make(world=2, mode="sync", total=20)
    outs = c.on_send_failed(1, rec.StartEpoch(plan=rec.EpochPlan(0, 10, 10)), 0.01)
    assert of(outs, rec.ExtendPartition, 0) == [rec.ExtendPartition(0, 10, 10)]


def test_a_failed_send_counts_towards_max_failure():
    c, _ = make(world=3, max_failure=MaxFailure.absolute(1))
    outs = c.on_send_failed(2, rec.SetGlobalStep(global_step=0), 0.1)
    assert of(outs, rec.ShutdownWithSave)[0].reason == "max_failure_exceeded"


def test_failed_sends_to_departed_ranks_and_after_the_end_are_ignored():
    c, _ = make(world=3)
    c.on_rank_death(2, "exit", 0.1)
    assert c.on_send_failed(2, rec.CoordHeartbeat(), 0.2) == []
    assert c.ignored["send_to_departed"] == 1 and c.liveness.failures == 1
    c.on_rank_death(1, "exit", 0.3)
    c.on_rank_death(0, "exit", 0.3)
    assert c.on_send_failed(0, rec.Shutdown(), 0.4) == []
    assert c.ignored["after_end"] == 1


def test_failed_send_before_start_raises():
    c = Coordinator(CoordinatorConfig(total_samples=10, batch_size=1, num_epochs=1), 2, 0.0)
    with pytest.raises(CoordinatorError, match="before start"):
        c.on_send_failed(0, rec.CoordHeartbeat(), 0.1)


# ------------------------------------------------------------------ the end of the run


def test_shutdown_waits_for_the_in_flight_cycle():
    c, outs = make(total=20)
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    train(c, 0, plans[0], 0)
    outs, _ = train(c, 1, plans[1], 0)
    # Every chunk is trained, and in no consensus yet: the epoch aggregates once the round holds it.
    assert of(outs, RoundOpened) and not of(outs, rec.EpochAggregated)
    assert of(outs, rec.Shutdown) == []
    outs = finish(c, 1, [0, 1])
    assert of(outs, rec.EpochAggregated) and of(outs, rec.Update) and len(of(outs, rec.Shutdown)) == 2
    assert of(outs, RunEnded) == [RunEnded(None)]


def test_final_reduce_happens_only_with_trailing_steps():
    c, outs = make(mode="sync", total=2)
    outs = batch(c, 0, 1) + done(c, 0, 0, 1)
    assert of(outs, rec.Shutdown) == []
    outs = batch(c, 1, 1) + done(c, 1, 0, 1)
    assert of(outs, rec.RequestParams)  # the last steps are averaged before the end
    outs = finish(c, 1, [0, 1])
    assert len(of(outs, rec.Shutdown)) == 2
    assert c.avg_count == 1


def test_final_canonical_eval_precedes_shutdown():
    c, outs = make(total=20, final_eval=True)
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    train(c, 0, plans[0], 0)
    train(c, 1, plans[1], 0)
    outs = finish(c, 1, [0, 1])
    ev = of(outs, rec.ExecuteEval)
    assert len(ev) == 1 and ev[0].epoch == 1 and of(outs, rec.Shutdown) == []
    outs = c.on_record(ev[0].target_rank, rec.EvalResult(
        rank=ev[0].target_rank, schedule_id=ev[0].schedule_id, epoch=1, metric=0.9,
        elapsed_ms=3.0, error=None), 0.3)
    assert of(outs, rec.EvalBroadcast) and len(of(outs, rec.Shutdown)) == 2


# ------------------------------------------------------------------ roles


def test_checkpoint_failure_fails_over_to_the_next_untried_rank():
    c, _ = make(world=3)
    outs = c.on_record(0, rec.CheckpointResult(rank=0, version=2, elapsed_ms=5.0, error="disk full"), 0.1)
    assert [(o.dest, o.record) for o in outs] == [(1, rec.Checkpoint(version=2, target_rank=1))]
    assert c.roles.tried(2) == 1
    c.on_record(1, rec.CheckpointResult(rank=1, version=2, elapsed_ms=5.0, error=None), 0.2)
    assert c.roles.tried(2) == 0 and c.roles.checkpoint == 1


# ------------------------------------------------------------------ illegal and late inputs


def test_a_record_the_coordinator_does_not_consume_raises_naming_it():
    c, _ = make()
    with pytest.raises(CoordinatorError, match="RequestParams"):
        c.on_record(0, rec.RequestParams(round=1), 0.1)


def test_a_record_claiming_another_rank_raises():
    c, _ = make()
    with pytest.raises(CoordinatorError, match="claims rank 1"):
        c.on_record(0, rec.Heartbeat(rank=1, step_count=0), 0.1)


def test_inputs_before_start_raise():
    cfg = CoordinatorConfig(total_samples=10, batch_size=1, num_epochs=1)
    c = Coordinator(cfg, 2, 0.0)
    with pytest.raises(CoordinatorError, match="before start"):
        c.on_record(0, rec.Heartbeat(rank=0, step_count=0), 0.1)


def test_late_and_duplicate_sync_acks_are_ignored_and_counted():
    c, _ = make(mode="sync", total=20)
    batch(c, 0, 1)
    batch(c, 1, 1)
    ack(c, 0, 1)
    ack(c, 0, 1)
    ack(c, 1, 7)
    assert c.ignored["duplicate_ack"] == 1 and c.ignored["stale_round"] == 1


# ------------------------------------------------------------------ resume


def half_trained() -> tuple[Coordinator, dict]:
    """Two ranks, 40 samples: each trained the front half of its span of epoch 0; the state then."""
    c, outs = make(total=40, epochs=3)
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    train(c, 0, plans[0], 0)
    train(c, 1, plans[1], 0)
    finish(c, 1, [0, 1])
    return c, c.state_dict()


def test_state_dict_round_trips_into_a_resumed_coordinator():
    c, state = half_trained()
    # Each rank trained the front of its span: [0, 10) and [20, 30).
    assert state["coverage"] == {"0": [[0, 10], [20, 10]]} and state["global_step"] == 20
    r = Coordinator(c.config, 2, 0.0, resume=state)
    outs = r.start(0.0)
    served = sorted((p.plan.offset, p.plan.size) for p in of(outs, rec.StartEpoch))
    assert served == [(10, 10), (30, 10)]  # exactly the holes
    assert r.global_step == 20 and r.avg_count == 1


def test_a_re_form_after_an_epochs_last_round_starts_the_new_world_at_the_next_epoch():
    # Two windows an epoch. The round epoch 0's last report triggers holds it whole. Labelled by the rows at
    # its trigger (epoch 0 not yet among them), a re-form state never matched the aggregated rows with one
    # round an epoch, and a joiner never got in; an epoch now aggregates at the release that holds it.
    c, outs = make(total=40, epochs=3)
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    steps = {0: 0, 1: 0}
    for rnd in (1, 2):
        for r in (0, 1):
            _, steps[r] = train(c, r, plans[r], steps[r])
        assert c.state_dict(held_whole=True) == c.state_dict()  # mid-epoch (round 1), or before its finish (round 2)
        outs = finish(c, rnd, [0, 1])
        plans = {o.dest: o.record.next_plan for o in outs if isinstance(o.record, rec.Update)}
    assert c.last_aggregated == 0 and c.state_dict()["epoch"] == 1
    state = c.state_dict(held_whole=True)
    assert state == c.state_dict()
    assert state["epoch"] == 1 and state["coverage"] == {} and state["global_step"] == 40
    served = of(Coordinator(c.config, 3, 0.0, resume=state).start(0.0), rec.StartEpoch)
    assert {p.plan.epoch for p in served} == {1} and sum(p.plan.size for p in served) <= 40


def test_resume_into_a_smaller_world_is_refused():
    c, _ = make(total=40)
    with pytest.raises(Exception, match="world_size"):
        Coordinator(c.config, 1, 0.0, resume=c.state_dict())


def test_a_resume_into_a_grown_world_covers_the_holes_with_every_rank_and_the_new_one_starts_cold():
    c, state = half_trained()
    r = Coordinator(c.config, 3, 0.0, resume=state)  # a host with rank 2 joined at the re-form
    assert r.elche.smoothed_ms_per_batch(2) is None and r.elche.smoothed_ms_per_batch(0) is not None  # rank 2 cold
    outs = r.start(0.0)
    served = [(p.plan.offset, p.plan.size) for p in of(outs, rec.StartEpoch)]
    assert {o.dest for o in outs if isinstance(o.record, rec.StartEpoch)} == {0, 1, 2}  # the new rank trains too
    served_samples = [x for off, n in served for x in range(off, off + n)]
    assert len(set(served_samples)) == len(served_samples)  # nothing twice
    assert set(served_samples) <= set(range(10, 20)) | set(range(30, 40))  # only what the consensus lacks
    assert r.global_step == 20 and r.avg_count == 1


def test_what_a_relay_lets_a_rank_send_is_exactly_what_the_controller_consumes():
    # The relay refuses every other control kind from a rank (RANK_CONTROL_RECORDS); the
    # controller service takes RankHello, the coordinator the rest. One list, checked here.
    assert set(Coordinator._HANDLERS) | {rec.RankHello} == rec.RANK_CONTROL_RECORDS


@pytest.mark.parametrize("seed", range(4))
def test_async_averages_as_soon_as_an_epoch_an_eval_waits_for_is_trained_whole(seed):
    # Ranks train on through an async round, so an epoch's eval need not wait for the next
    # full window: once the epoch is trained whole, a round is in flight (or its eval went out, or its
    # consensus, the first to hold a later epoch too, was scored for that one), except in the run's last
    # stretch, which goes whole into the final round (its evals merged into the final eval).
    rng = random.Random(seed)
    c, outs = make(mode="async", total=60, epochs=4, eval_every=1, max_overshoot=100)
    plans = [(o.dest, o.record.plan) for o in outs if isinstance(o.record, rec.StartEpoch)]
    steps, evals = [0, 0], []
    while plans:
        r, plan = plans.pop(rng.randrange(len(plans)))
        got, steps[r] = train(c, r, plan, steps[r])
        if c.cycle is not None and rng.random() < 0.5:
            got += finish(c, c.cycle.round, [0, 1])
        evals += [e.epoch for e in of(got, rec.ExecuteEval)] + [e for m in of(got, EvalsMerged) for e in m.epochs]
        waiting = [e for e in range(1, 4) if e not in evals and c.dispatch.done_through(c.last_aggregated) >= e - 1]
        tail = c.dispatch.in_run_tail(c.last_aggregated)
        assert not waiting or c.cycle is not None or tail, f"epoch {waiting[0] - 1} is trained but no round is in flight"
        plans += [(o.dest, o.record.plan) for o in got if isinstance(o.record, rec.StartEpoch)]
        plans += [(o.dest, o.record.next_plan) for o in got if isinstance(o.record, rec.Update) and o.record.next_plan]


# ------------------------------------------------------------------ the round's hops (PROTOCOL.md 10.1)


def test_a_cadence_chunk_that_fills_the_window_names_the_next_round_and_its_rank_is_not_asked():
    c, outs = make()
    # Each chunk's mass bound reaches the reducer before the plan that tells the deposit.
    assert [(o.dest, type(o.record)) for o in outs if isinstance(o.record, (MassBound, rec.StartEpoch))][:2] == [
        (REDUCER, MassBound), (0, rec.StartEpoch)]
    assert of(outs, MassBound)[0] == MassBound(1, ((0, 84.0),), opens=False)
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    assert [p.deposit for p in plans] == [1, 1]
    train(c, 0, plans[0], 0)
    outs, _ = train(c, 1, plans[1], 0)
    assert of(outs, RoundOpened) == [RoundOpened(1, (0, 1))]
    assert of(outs, MassBound) == [MassBound(1, ((0, 84.0), (1, 84.0)))]  # the trigger's: it opens the round
    assert of(outs, rec.RequestParams) == []  # both deposited at their chunk's end


def test_the_update_rides_beside_the_consensus_and_the_next_window_waits_for_the_acks():
    c, outs = make()
    plans = [p.plan for p in of(outs, rec.StartEpoch)]
    train(c, 0, plans[0], 0)
    train(c, 1, plans[1], 0)
    outs = c.on_round_complete(1, 0.2)  # published: the plans go out now, not after the acks
    nxt = {o.dest: o.record.next_plan for o in outs if isinstance(o.record, rec.Update)}
    assert sorted(nxt) == [0, 1] and all(p is not None and p.deposit == 2 for p in nxt.values())
    assert len(of(outs, rec.SetGlobalStep)) == 2
    # The next windows are trained before the acks arrive: the guard has not judged round 1 yet.
    train(c, 0, nxt[0], 10, t=0.3)
    outs, _ = train(c, 1, nxt[1], 10, t=0.3)
    assert of(outs, RoundOpened) == []
    assert of(ack(c, 0, 1, t=0.4), RoundOpened) == []
    assert of(ack(c, 1, 1, t=0.4), RoundOpened) == [RoundOpened(2, (0, 1))]


def test_a_snapshot_notice_of_a_deposit_told_ahead_is_not_stale():
    c, outs = make()
    c.on_record(0, rec.SnapshotReady(rank=0, round=1), 0.1)  # round 1 is not triggered yet
    assert c.ignored["stale_round"] == 0


def test_an_async_rank_refused_a_chunk_at_its_budget_gets_one_when_the_verdict_widens_the_budget():
    # Protocol 7: the next plans go out at publication, the guard judges at the acks. A rank that used up
    # its budget before the verdict, which raised Async's overshoot, must be offered the wider budget;
    # otherwise it idles while the gate waits for it (a launched cpu-async run hung so).
    c, outs = make(mode="async", total=400, bs=1, epochs=1, anchor=4, max_anchor=4)
    plans = {o.dest: o.record.plan for o in outs if isinstance(o.record, rec.StartEpoch)}
    _, s0 = train(c, 0, plans[0], 0)
    train(c, 1, plans[1], 0)
    nxt = {o.dest: o.record.next_plan for o in c.on_round_complete(1, 0.2) if isinstance(o.record, rec.Update)}
    assert nxt[0] is not None
    refused, _ = train(c, 0, nxt[0], s0, t=0.25)  # its whole budget, before the acks
    assert of(refused, rec.StartEpoch, 0) == []
    before = c.feedback.overshoot
    judged = ack(c, 0, 1, 0.3) + ack(c, 1, 1, 0.3)
    assert c.feedback.overshoot > before
    assert of(judged, rec.StartEpoch, 0), "the idle rank was not offered its wider budget"
