"""An epoch's eval scores the first consensus that holds the epoch whole, and a consensus is scored once:
under the overlapped round (cpu-async) epochs shorter than a round's flight end two to
one consensus, which is then scored for the later epoch, and the earlier is told to have none of its own."""

from __future__ import annotations

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.outputs import CONTROLLER, EvalsMerged, Evaluated
from flodl_zmq.coordinator.roles import FINAL_EVAL_ID, EvalLedger
from flodl_zmq.coordinator.sim import RankSpec, SimConfig, Simulation
from flodl_zmq.wire import records as rec

BS, EPOCHS = 8, 4


def _run(total: int, sim: SimConfig) -> tuple[list[Evaluated], list[EvalsMerged]]:
    cfg = CoordinatorConfig(total_samples=total, batch_size=BS, num_epochs=EPOCHS, mode="async",
                            eval_every=1, final_eval=True)
    res = Simulation(cfg, [RankSpec(1.0), RankSpec(1.0)], sim).run()
    assert res.ended is not None and res.ended.reason is None
    notices = [o.record for _, o in res.outputs if o.dest is CONTROLLER]
    return ([n for n in notices if isinstance(n, Evaluated)], [n for n in notices if isinstance(n, EvalsMerged)])


def test_an_epoch_shorter_than_a_round_is_not_scored_twice_with_the_next_and_says_where_it_was_scored():
    # 4 batches an epoch on a pair, rounds of 100 ms: two epochs end during one round's flight, and the
    # next consensus is the first to hold both (it was scored twice, as each). (At 8 batches an epoch, since
    # an epoch trained whole opens its round at once, each epoch got a consensus of its own.)
    total = 32
    scored, merged = _run(total, SimConfig(seed=0, upload_s=0.05, reduce_s=0.05))
    samples = [s.samples for s in scored]
    assert len(set(samples)) == len(samples), [(s.result.epoch, s.samples) for s in scored]
    assert merged, "no consensus held two epochs' ends: the case is not exercised"
    # Every epoch's eval is answered or said to be merged, once; a merged one names a scored consensus.
    answered = [s.result.schedule_id for s in scored if s.result.schedule_id != FINAL_EVAL_ID]
    told = [e for m in merged for e in m.epochs]
    assert sorted(answered + told) == list(range(1, EPOCHS))
    assert all(m.samples in samples for m in merged)
    # Each scored consensus holds the epochs its eval is for.
    for s in scored:
        assert s.samples >= min(s.result.epoch, EPOCHS) * total


def _calls(*epochs: int) -> list[tuple[int, rec.Checkpoint | rec.ExecuteEval]]:
    out: list[tuple[int, rec.Checkpoint | rec.ExecuteEval]] = []
    for e in epochs:
        out.append((0, rec.Checkpoint(version=e, target_rank=0)))
        out.append((0, rec.ExecuteEval(schedule_id=e, epoch=e, target_rank=0, adopt_consensus=True)))
    return out


def test_one_consensus_gets_one_epoch_eval_the_last_and_every_checkpoint():
    ledger = EvalLedger(CoordinatorConfig(total_samples=640, batch_size=BS, num_epochs=6, final_eval=True))
    kept = ledger.one_per_consensus(_calls(2, 3), global_step=30, complete=2)
    assert kept == [_calls(2)[0], *_calls(3), (CONTROLLER, EvalsMerged((2,), 240))]
    ledger.sent(kept[2][1], 30)
    # Its later epochs found whole with no new consensus (no rank stepped): none sent for it again.
    assert ledger.one_per_consensus(_calls(4)[1:], global_step=30, complete=3) == [
        (CONTROLLER, EvalsMerged((4,), 240))]
    # A consensus that holds every epoch is the final eval's.
    assert ledger.one_per_consensus(_calls(5), global_step=40, complete=5) == [
        _calls(5)[0], (CONTROLLER, EvalsMerged((5,), 320))]
    assert ledger.one_per_consensus(_calls(5)[:1], global_step=40, complete=5) == _calls(5)[:1]
