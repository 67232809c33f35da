"""Evals within an epoch (`eval_every_samples`): the coordinator scores each finished consensus that holds
another N samples, before the round's Updates, each once across a death; a lone run is scored as often."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import flodl_zmq as fz
from flodl_zmq.api import Trainer
from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.core import Coordinator
from flodl_zmq.coordinator.outputs import CONTROLLER, Evaluated, RoundOpened
from flodl_zmq.coordinator.roles import EvalLedger
from flodl_zmq.coordinator.sim import RankSpec, SimConfig, Simulation
from flodl_zmq.wire import records as rec

TOTAL, BS = 1440, 8
EVERY = TOTAL // 4


def _evals_of(res):
    outs = [o for _, o in res.outputs]
    asked = [(i, o) for i, o in enumerate(outs) if isinstance(o.record, rec.ExecuteEval)]
    scored = [o.record for o in outs if o.dest is CONTROLLER and isinstance(o.record, Evaluated)]
    return outs, asked, scored


@pytest.mark.parametrize("mode", ["cadence", "async", "sync"])
def test_the_consensus_is_scored_every_n_samples_before_its_rounds_updates_each_once(mode):
    cfg = CoordinatorConfig(total_samples=TOTAL, batch_size=BS, num_epochs=2, mode=mode, eval_every=1,
                            eval_every_samples=EVERY, final_eval=True)
    res = Simulation(cfg, [RankSpec(4.0), RankSpec(1.0)], SimConfig(seed=0)).run()
    assert res.ended is not None and res.ended.reason is None
    outs, asked, scored = _evals_of(res)
    within = [s for s in scored if s.within_epoch]
    assert within, "no eval within an epoch"
    # No finished consensus crosses a due point (a multiple of EVERY) unscored; one crossing several is
    # scored once.
    finished = [o.record.global_step * BS for o in outs if o.dest == 0 and isinstance(o.record, rec.SetGlobalStep)]
    for s in finished:
        last = max((e.samples for e in scored if e.samples <= s), default=0)
        assert last == s or last // EVERY == s // EVERY, (s, last)
    # Each request answered once; ids never collide with an epoch's or the final eval's.
    ids = [r.schedule_id for _, o in asked for r in [o.record]]
    assert sorted(ids) == sorted(s.result.schedule_id for s in scored) and len(set(ids)) == len(ids)
    assert all(2 < s.result.schedule_id < rec.MAX_COUNT for s in within)
    # Every scored consensus is a new one: samples strictly grow.
    assert [s.samples for s in scored] == sorted({s.samples for s in scored})
    for i, o in asked:
        if o.record.schedule_id in (1, rec.MAX_COUNT):
            continue
        # Out at a round's finish, before that round's Updates: the consensus exists, and the eval rank
        # has loaded it and not yet trained past it.
        # (A round opens at the controller's notice: under Cadence most ranks deposit unasked.)
        opened = max(r.record.round for r in outs[:i] if isinstance(r.record, RoundOpened))
        nxt = next(r.record for r in outs[i:] if isinstance(r.record, (rec.Update, RoundOpened)))
        assert isinstance(nxt, rec.Update) and nxt.round == opened, (i, o.record)


def test_async_opens_a_round_at_each_due_point_so_the_model_is_scored_there_not_a_window_later():
    """The overlapped round stops no rank, so a due point gets a round of its own: a score a window late
    (the hetero pair's windows hold hundreds of samples here) is a time to target late by as much."""
    cfg = CoordinatorConfig(total_samples=TOTAL, batch_size=BS, num_epochs=2, mode="async", eval_every=1,
                            eval_every_samples=EVERY, final_eval=True)
    res = Simulation(cfg, [RankSpec(4.0), RankSpec(1.0)], SimConfig(seed=0)).run()
    _, _, scored = _evals_of(res)
    within = [s.samples for s in scored if s.within_epoch]
    # The last model is the final eval's, scored once; so are points due in the run's last half window, which
    # the final round takes whole (a round there would leave it a few steps of one rank).
    window = sum(res.coordinator.elche.batch_counts) * BS
    due = list(range(EVERY, 2 * TOTAL, EVERY))[:len(within)]
    assert due and due[-1] + EVERY >= 2 * TOTAL - window, (within, due, window)
    assert all(0 <= s - d < EVERY // 4 for s, d in zip(within, due, strict=True)), (within, due)
    assert scored[-1].result.schedule_id == rec.MAX_COUNT and scored[-1].samples == 2 * TOTAL


def _finish(c, rnd, ranks, t):
    outs = c.on_round_complete(rnd, t)
    for r in ranks:
        outs += c.on_record(r, rec.SyncAck(rank=r, round=rnd, step_count=0, divergence=0.01, post_norm=1.0,
                                           pre_norm=1.0), t)
    return outs


def _round(c, plans, steps, ranks, rnd, t):
    """Each of `ranks` trains its plan (batch 1); round `rnd` opens and finishes. Its outputs."""
    for r in ranks:
        for _ in range(plans[r].size):
            steps[r] += 1
            c.on_record(r, rec.Batch(rank=r, step_count=steps[r], batch_ms=[10.0], data_ms=[0.0],
                                     batch_loss=[1.0]), t)
        c.on_record(r, rec.EpochMetrics(
            rank=r, epoch=plans[r].epoch, avg_loss=1.0, batches_processed=plans[r].size,
            samples_processed=plans[r].size, epoch_ms=1.0, compute_only_ms=1.0, data_starve_ms=0.0,
            scalar_sums={}, scalar_counts={}), t)
    outs = _finish(c, rnd, ranks, t + 0.05)
    for o in outs:
        if isinstance(o.record, rec.Update) and o.record.next_plan is not None:
            plans[o.dest] = o.record.next_plan
    return outs


def _answer(c, rank, request, t):
    return c.on_record(rank, rec.EvalResult(rank=rank, schedule_id=request.schedule_id, epoch=request.epoch,
                                            metric=0.5, elapsed_ms=1.0, error=None), t)


def test_an_eval_whose_rank_dies_unanswered_is_scored_once_by_the_heir_at_the_next_consensus():
    cfg = CoordinatorConfig(total_samples=600, batch_size=1, num_epochs=1, mode="cadence",
                            eval_every_samples=20, final_eval=True)
    c = Coordinator(cfg, 3, 0.0)
    plans = {o.dest: o.record.plan for o in c.start(0.0) if isinstance(o.record, rec.StartEpoch)}
    steps = [0, 0, 0]
    outs = _round(c, plans, steps, [0, 1, 2], 1, 0.1)
    (first,) = [o.record for o in outs if isinstance(o.record, rec.ExecuteEval)]
    dead = first.target_rank
    c.on_rank_death(dead, "killed", 0.2)
    assert _answer(c, dead, first, 0.25) == [] and c.ignored["from_departed"] == 1  # too late: not a result
    heirs = [r for r in range(3) if r != dead]
    outs = _round(c, plans, steps, heirs, 2, 0.3)
    again = [o for o in outs if isinstance(o.record, rec.ExecuteEval)]
    # Sent again, once, under its own id, to a live rank, scoring this (later) consensus.
    assert [(o.record.schedule_id, o.dest) for o in again] == [(first.schedule_id, c.roles.eval)]
    assert c.roles.eval in heirs
    (other,) = [r for r in heirs if r != c.roles.eval]
    assert _answer(c, other, again[0].record, 0.35) == [] and c.ignored["unasked_eval"] == 1  # not asked of it
    scored = [o.record for o in _answer(c, c.roles.eval, again[0].record, 0.4) if isinstance(o.record, Evaluated)]
    assert [(s.result.schedule_id, s.samples) for s in scored] == [(first.schedule_id, c.global_step)]
    assert _answer(c, c.roles.eval, again[0].record, 0.45) == [] and c.ignored["unasked_eval"] == 2  # once only


N = 40  # samples: batch 8 -> 5 steps an epoch


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.arange(N) % 2)


def _step(model, batch):
    return F.cross_entropy(model(batch[0] / N), batch[1])


def test_a_lone_run_is_scored_every_n_samples_within_epochs_and_once_at_each_epochs_end(alone):
    modes: list[bool] = []

    def score(model, dataset):
        modes.append(model.training)
        return 0.5

    result = Trainer(model=lambda: torch.nn.Linear(1, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                     train_step=_step, dataset=_data(), batch_size=8, epochs=2, eval_dataset=_data(),
                     eval_fn=score, eval_every_samples=16, quiet=True).run()
    rows = result.evals
    # Within an epoch after the steps reaching 16 and 32 samples; at each epoch's end once (the epoch's eval
    # counts for the cadence: the next is due at 48, not at 40 and 48); 80 is both, scored once.
    assert [(r["samples"], r["within_epoch"]) for r in rows] == [
        (16, True), (32, True), (40, False), (48, True), (64, True), (80, False)]
    assert [r["epoch"] for r in rows] == [0, 0, 0, 1, 1, 1]
    times = [r["eval_at_s"] for r in rows]
    assert times == sorted(times) and not any(modes)  # each in eval mode, and when it was taken
    assert [row.get("eval") for row in result.epochs] == [0.5, 0.5] and result.final_eval == 0.5


def test_a_sessions_model_is_back_in_training_mode_after_an_eval_within_an_epoch(alone):
    model = torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.Dropout(0.1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training = []
    with fz.Session(model, optimizer, _data(), batch_size=8, eval_dataset=_data(),
                    eval_fn=lambda m, d: 0.5, eval_every_samples=8, quiet=True) as s:
        for batch in s.batches():
            training.append(model.training)
            _step(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad()
            s.step()
    assert all(training) and len(s.result.evals) == 5


def test_an_eval_is_owed_from_its_request_to_its_answer_and_again_once_its_rank_died():
    ledger = EvalLedger(CoordinatorConfig(total_samples=TOTAL, batch_size=BS, num_epochs=2, eval_every_samples=EVERY))
    assert not ledger.owed
    assert len(ledger.at_finish(global_step=EVERY // BS, epochs_whole=0, target=1)) == 1
    assert ledger.owed  # a re-form now would lose its score (join.ReformGate)
    ledger.on_death(1)
    assert ledger.owed  # an orphan, sent again at the next finish
    [again] = ledger.at_finish(global_step=EVERY // BS + 1, epochs_whole=0, target=0)
    assert ledger.answered(again.schedule_id, 0) is not None and not ledger.owed


def test_a_lone_run_with_eval_every_0_is_scored_once_at_the_end_as_a_cluster_is(alone):
    # eval_every=0 turns the epochs' evals off, not the final one: a cluster's final eval scores its last model
    # whatever the cadence, and the same script alone gave no final_eval at all.
    result = Trainer(model=lambda: torch.nn.Linear(1, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                     train_step=_step, dataset=_data(), batch_size=8, epochs=3, eval_dataset=_data(),
                     eval_fn=lambda model, dataset: 0.25, eval_every=0, quiet=True).run()
    assert [(r["epoch"], r["samples"]) for r in result.evals] == [(2, 120)]
    assert result.final_eval == 0.25 and [row.get("eval") for row in result.epochs] == [None, None, 0.25]
