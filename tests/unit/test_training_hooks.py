"""The training hooks (flodl_zmq/training.py): schedule, clipping, autocast, accumulation, record_scalar.

The rank-level test drives a `RankRuntime`'s training thread directly (its
records go to a list, not a socket): two ranks with different shares of a
window follow the same schedule, the one of the global step.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import flodl_zmq as fz
from flodl_zmq.api import train_alone
from flodl_zmq.errors import ConfigError, TrainingError
from flodl_zmq.job import Job
from flodl_zmq.rank import RankRuntime
from flodl_zmq.rank_link import RankConfig
from flodl_zmq.training import ScalarLog, Stepper, recording, score, split_batch
from flodl_zmq.wire import records as rec

X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
Y = (X.sum(1) > 0).long()
DATA = TensorDataset(X, Y)
LR0 = 0.1


def cosine(total: int):
    return lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)


def step_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def job(**kw) -> Job:
    base = dict(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=LR0),
                train_step=step_fn, dataset=DATA, batch_size=8, epochs=1, quiet=True)
    return Job(**{**base, **kw})


def stepper(j: Job) -> Stepper:
    torch.manual_seed(0)
    model = j.model()
    return Stepper(j, model, j.optimizer(model.parameters()), torch.device("cpu"))


def reference_lrs(total: int, steps: int) -> list[float]:
    """The schedule a single process stepping once per batch sees: the LR of steps 0..steps-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR0)
    sched = cosine(total)(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_the_schedule_jumps_to_the_global_step_and_never_goes_back():
    s = stepper(job(scheduler=cosine(20)))
    ref = reference_lrs(20, 12)
    assert s.follow(0) == pytest.approx(ref[0])  # the first LR is reported
    assert s.follow(0) is None  # unchanged: nothing to report
    assert s.follow(7) == pytest.approx(ref[7])
    assert s.follow(3) is None and s.position == 7  # a torch scheduler only steps forward
    assert s.follow(11) == pytest.approx(ref[11])


def test_without_a_scheduler_only_a_changed_lr_is_reported():
    s = stepper(job())
    assert s.follow(5) == LR0
    assert s.follow(9) is None
    s.optimizer.param_groups[0]["lr"] = 0.01  # e.g. an epoch_fn that lowers the LR
    assert s.follow(10) == 0.01


def test_grad_accumulation_takes_the_step_of_the_whole_batch():
    batch = (X[:10], Y[:10])  # 10 samples in 4 micro-batches of 2-3: uneven weights
    whole, split = stepper(job()), stepper(job(grad_accumulation=4))
    loss_whole, loss_split = whole.step(batch), split.step(batch)
    assert loss_split == pytest.approx(loss_whole, rel=1e-5)
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_max_grad_norm_bounds_the_step():
    # SGD without momentum at lr 1 moves the parameters by exactly the (clipped) gradient.
    j = job(optimizer=lambda p: torch.optim.SGD(p, lr=1.0), train_step=lambda m, b: 100.0 * m(b[0]).pow(2).sum(),
            max_grad_norm=0.5)
    s = stepper(j)
    before = torch.cat([p.detach().flatten().clone() for p in s.model.parameters()])
    s.step((X[:8], Y[:8]))
    after = torch.cat([p.detach().flatten() for p in s.model.parameters()])
    assert float(torch.linalg.vector_norm(after - before)) == pytest.approx(0.5, rel=1e-4)


def test_a_train_step_that_calls_backward_itself_is_told_the_framework_does():
    # torch's "Trying to backward through the graph a second time" named nothing the script's author wrote.
    def clipping(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        loss = model(batch[0]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    with pytest.raises(ConfigError, match=r"train_step called backward\(\).*max_grad_norm"):
        stepper(job(train_step=clipping)).step(next(iter(torch.utils.data.DataLoader(DATA, batch_size=8))))


def test_bf16_autocast_runs_the_forward_in_bf16_on_cpu():
    seen = []

    def probe(model, batch):
        out = model(batch[0])
        seen.append(out.dtype)
        return torch.nn.functional.cross_entropy(out.float(), batch[1])

    s = stepper(job(train_step=probe, autocast=torch.bfloat16))
    assert math.isfinite(s.step((X[:8], Y[:8])))
    assert seen == [torch.bfloat16] and s.scaler is None  # bf16 has f32's range: no scaler
    assert all(p.dtype == torch.float32 for p in s.model.parameters())  # the weights stay f32


def test_f16_autocast_on_cpu_is_refused_naming_autocast():
    with pytest.raises(ConfigError, match="autocast=torch.float16 needs a CUDA device"):
        stepper(job(autocast=torch.float16))


def test_an_optimizer_that_needs_a_closure_is_refused_naming_it():
    # LBFGS.step() without its closure was a TypeError from deep inside the first step.
    with pytest.raises(ConfigError, match="optimizer LBFGS needs a closure"):
        stepper(job(optimizer=lambda p: torch.optim.LBFGS(p)))


def test_reduce_lr_on_plateau_is_refused_naming_the_metric_it_needs():
    # Stepped per global step without a metric: a TypeError at the first step alone, a dead rank on a cluster.
    with pytest.raises(ConfigError, match="scheduler ReduceLROnPlateau needs a metric"):
        stepper(job(scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o)))


@pytest.mark.parametrize("returned", [{"acc": 0.5}, None, "0.5", torch.ones(2), True, np.ones(2)])
def test_an_eval_fn_that_returns_no_single_number_is_refused_naming_eval_fn(returned):
    model = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"eval_fn returned .* must return one number"):
        score(job(eval_dataset=DATA, eval_fn=lambda m, d: returned), model)
    assert model.training  # left in the mode it was in


@pytest.mark.parametrize("returned", [0.5, 1, torch.tensor(0.25), torch.tensor([0.75]), np.float32(0.5),
                                      np.int64(1), np.array(0.25)])
def test_an_eval_fn_returning_a_number_or_a_one_element_tensor_scores_it(returned):
    assert score(job(eval_dataset=DATA, eval_fn=lambda m, d: returned), torch.nn.Linear(4, 2)) == float(returned)


def test_alone_an_eval_fn_that_raises_is_reported_and_the_run_trains_on_and_saves(tmp_path):
    # As on a cluster under on_callback_error='report': one bad metric must not lose the run and its save.
    result = train_alone(job(epochs=2, eval_dataset=DATA, eval_fn=lambda m, d: 1 / 0, save_path=str(tmp_path / "m"),
                             run_dir=str(tmp_path / "run")))
    assert [e["epoch"] for e in result.epochs] == [0, 1] and result.final_eval is None
    assert result.saved is not None and (tmp_path / "m.pt").exists()


def test_alone_an_eval_fn_that_raises_under_stop_ends_the_run_with_training_error(tmp_path):
    with pytest.raises(TrainingError, match="eval_fn failed and on_callback_error='stop'"):
        train_alone(job(eval_dataset=DATA, eval_fn=lambda m, d: 1 / 0, on_callback_error="stop",
                        run_dir=str(tmp_path / "run")))


@pytest.mark.parametrize("dtype", [torch.float16, torch.complex64])
def test_alone_a_model_the_cluster_cannot_average_is_refused_as_on_a_cluster(dtype, tmp_path):
    # It trained alone and was refused only once launched: the same script must fail the same way.
    with pytest.raises(ConfigError, match=f"averages float32 tensors; the model's 'weight' is {dtype}"):
        train_alone(job(model=lambda: torch.nn.Linear(4, 2).to(dtype), run_dir=str(tmp_path / "run")))


def test_alone_a_persistent_minus_inf_mask_is_refused_as_on_a_cluster_and_a_derived_one_trains(tmp_path):
    # Each round refuses a non-finite deposit: on a cluster every rank was dropped as a poisoner.
    def masked(persistent: bool) -> torch.nn.Module:
        model = torch.nn.Linear(4, 2)
        model.register_buffer("mask", torch.full((2,), float("-inf")), persistent=persistent)
        return model

    with pytest.raises(ConfigError, match="float buffer 'mask' holds a NaN or an infinity"):
        train_alone(job(model=lambda: masked(True), run_dir=str(tmp_path / "run")))
    train_alone(job(model=lambda: masked(False), run_dir=str(tmp_path / "derived")))


def test_alone_an_int8_wire_for_a_model_with_running_statistics_is_refused_as_on_a_cluster(tmp_path):
    # It trained and saved alone, then the launched controller refused it (payload.check_wire).
    def bn() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))

    with pytest.raises(ConfigError, match=r"wire_dtype='int8'.*BatchNorm1d '1'"):
        train_alone(job(model=bn, wire_dtype="int8", run_dir=str(tmp_path / "run")))
    train_alone(job(model=bn, wire_dtype="bf16", run_dir=str(tmp_path / "bf16")))


def test_split_batch_splits_tensors_in_tuples_and_dicts_and_keeps_other_leaves():
    batch = {"x": torch.arange(5), "pair": (torch.arange(5) * 2, "tag")}
    pieces = split_batch(batch, 2)
    assert [n for _, n in pieces] == [2, 3] or [n for _, n in pieces] == [3, 2]
    assert torch.equal(torch.cat([p["x"] for p, _ in pieces]), torch.arange(5))
    assert all(p["pair"][1] == "tag" for p, _ in pieces)
    assert [n for _, n in split_batch((torch.zeros(1, 3),), 4)] == [1]  # never an empty micro-batch


def test_record_scalar_is_a_per_epoch_mean_and_ignores_non_finite_values():
    fz.record_scalar("outside", 1.0)  # no run: nothing happens
    log = ScalarLog()
    with recording(log):
        for v in (1.0, 2.0, torch.tensor(5.0), True, float("nan")):  # a bool counts as 0 or 1: its mean a rate
            fz.record_scalar("m", v)
    assert log.take() == ({"m": 9.0}, {"m": 4})
    assert log.take() == ({}, {})


@pytest.mark.parametrize("value", ["abc", torch.ones(3), [1.0], None])
def test_record_scalar_of_anything_but_one_number_names_the_call_and_the_fix(value):
    # Was float()'s ValueError or TypeError ("could not convert string to float"), naming neither.
    with pytest.raises(ConfigError, match=r"record_scalar\('x', \.\.\.\): the value must be one number.*t\.mean\(\)"):
        fz.record_scalar("x", value)


def test_train_alone_reports_scalars_and_follows_the_schedule_per_batch():
    lrs: list[float] = []

    def probe(model, batch):
        fz.record_scalar("n", float(len(batch[0])))
        return step_fn(model, batch)

    j = job(train_step=probe, epochs=2, scheduler=cosine(16),
            epoch_fn=lambda e, m: None, metrics_fn=lambda row: lrs.append(row["scalars"]["n"]))
    result = train_alone(j)
    assert [row["scalars"] for row in result.epochs] == [{"n": 8.0}, {"n": 8.0}]
    assert lrs == [8.0, 8.0]


# --------------------------------------------------------------------------- rank level


class Sent(list):
    """The rank's link, keeping what the training thread hands it (step timings aside)."""

    def step(self, batch_ms, data_ms, loss, step_count):
        pass

    def flush_steps(self):
        pass

    def note_lr(self, lr):
        self.append(rec.LrUpdate(rank=0, lr=lr))  # the link sends it with the next step report

    def send(self, record, payload=(), tracked_by=None):
        self.append(record)
        if tracked_by is not None:
            tracked_by.hold_until_sent(None)  # "sent" at once: the next snapshot may overwrite it


def rank(r: int, j: Job) -> RankRuntime:
    cfg = RankConfig(rank=r, local_rank=r, world_size=2, host="h", key=b"k" * 32, incarnation=b"r" * 16,
                     control_endpoint="tcp://127.0.0.1:1", data_endpoint="tcp://127.0.0.1:2")
    rt = RankRuntime(j, cfg, torch.device("cpu"))
    rt.link = Sent()
    return rt


def lr_updates(rt: RankRuntime) -> list[float]:
    return [x.lr for x in rt.link if isinstance(x, rec.LrUpdate)]


def train_round(rt: RankRuntime, round_id: int, offset: int, steps: int, global_step_after: int,
                in_flight: int = 0) -> list[float]:
    """`steps` batches of a span, a deposit, SetGlobalStep before the consensus (as it can
    arrive), `in_flight` more steps, the consensus; returns the LR each step used."""
    used = []
    rt._on_control(rec.StartEpoch(rec.EpochPlan(0, offset, (steps + in_flight) * rt.job.batch_size)))
    for i in range(steps + in_flight):
        if i == steps:
            rt._on_control(rec.RequestParams(round=round_id))
            rt._on_control(rec.SetGlobalStep(global_step=global_step_after))
        train_one(rt)
        used.append(rt.optimizer.param_groups[0]["lr"])
    if not in_flight:
        rt._on_control(rec.RequestParams(round=round_id))
        rt._on_control(rec.SetGlobalStep(global_step=global_step_after))
    rt._on_consensus(SimpleNamespace(record=rec.Consensus(round=round_id, mass=0.0), payload=[]))
    return used


def test_ranks_with_different_shares_follow_the_schedule_of_the_global_step():
    # Rank 0 takes 3 of each window's 4 steps, rank 1 one: the global step advances by 4 a
    # round on both, so the LR at rank 1's next step is the one of global step 4, not 1.
    j = job(batch_size=2, scheduler=cosine(12), epochs=1)
    fast, slow = rank(0, j), rank(1, j)
    ref = reference_lrs(12, 12)
    try:
        assert train_round(fast, 1, 0, 3, 4) == pytest.approx(ref[0:3])
        assert train_round(slow, 1, 6, 1, 4) == pytest.approx(ref[0:1])
        # A step taken while the round is in flight (cpu-async) continues the rank's own count:
        # the new global step counts only once the consensus that holds those steps is loaded.
        assert train_round(fast, 2, 8, 3, 8, in_flight=1) == pytest.approx(ref[4:8])
        assert train_round(slow, 2, 16, 1, 8) == pytest.approx(ref[4:5])
        assert train_round(fast, 3, 18, 1, 12) == pytest.approx(ref[9:10])  # 8 + the in-flight step
    finally:
        fast.pipeline.close()
        slow.pipeline.close()
    # Each LR change is reported (LrUpdate), once, for the meta-controller.
    assert lr_updates(fast) == pytest.approx([ref[i] for i in (0, 1, 2, 4, 5, 6, 7, 9)])
    assert lr_updates(slow) == pytest.approx([ref[i] for i in (0, 4)])


def test_a_rank_reports_record_scalar_with_its_chunk():
    def probe(model, batch):
        fz.record_scalar("label_mean", batch[1].float().mean())
        return step_fn(model, batch)

    rt = rank(0, job(train_step=probe, batch_size=4))
    try:
        with recording(rt.scalars):
            rt._on_control(rec.StartEpoch(rec.EpochPlan(0, 0, 8)))
            train_one(rt)
            train_one(rt)
    finally:
        rt.pipeline.close()
    (m,) = [x for x in rt.link if isinstance(x, rec.EpochMetrics)]
    assert m.scalar_counts == {"label_mean": 2}
    assert np.isfinite(m.scalar_sums["label_mean"])


def train_one(rt: RankRuntime) -> None:
    """One step as the rank's loop takes it: the next batch, the job's step, its report."""
    rt.step(rt.stepper.step(rt._take_batch()))


def test_a_span_whose_plan_names_a_round_is_deposited_at_its_end_unasked_and_once():
    rt = rank(0, job(batch_size=2))
    try:
        rt._on_control(rec.StartEpoch(rec.EpochPlan(0, 0, 4, deposit=1)))
        train_one(rt)
        assert not any(isinstance(x, rec.RoundFrame) for x in rt.link)
        train_one(rt)  # the window ends here: the deposit goes before the chunk's report
        kinds = [type(x) for x in rt.link if not isinstance(x, rec.LrUpdate)]
        assert kinds[-3:] == [rec.SnapshotReady, rec.RoundFrame, rec.EpochMetrics]
        assert [x.mass for x in rt.link if isinstance(x, rec.RoundFrame)] == [2.0]
        rt._on_control(rec.RequestParams(round=1))  # a request crossing the deposit: nothing twice
        assert sum(isinstance(x, rec.RoundFrame) for x in rt.link) == 1
    finally:
        rt.pipeline.close()


def test_an_update_and_what_follows_it_wait_for_the_pending_consensus():
    rt = rank(0, job(batch_size=2))
    try:
        rt._on_control(rec.StartEpoch(rec.EpochPlan(0, 0, 2)))
        train_one(rt)
        rt._on_control(rec.RequestParams(round=1))  # deposited in round 1; its consensus is still on its way
        rt._on_control(rec.Update(round=1, next_plan=rec.EpochPlan(0, 2, 2)))
        rt._on_control(rec.StartEpoch(rec.EpochPlan(0, 4, 2)))
        # Training either before the load would throw its steps away with the pre-consensus replica.
        assert not rt._can_train()
        rt._on_consensus(SimpleNamespace(record=rec.Consensus(round=1, mass=0.0), payload=[]))
        assert [len(s.indices) for s in rt._spans] == [2, 2] and rt._can_train()
        assert [type(x) for x in rt.link][-1] is rec.SyncAck
    finally:
        rt.pipeline.close()


@pytest.mark.parametrize(("returned", "named"), [
    (lambda m, b: step_fn(m, b).item(), "train_step returned float"),
    (lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1], reduction="none"),
     r"train_step returned a tensor of shape \(8,\)"),
    (lambda m, b: step_fn(m, b).detach(), "does not require grad"),
])
def test_a_train_step_that_returns_no_steppable_loss_is_refused_naming_the_fix(returned, named):
    # Before, torch's own words ("'float' object has no attribute 'backward'", "grad can be implicitly
    # created only for scalar outputs") with no cause or fix; alone and on every rank alike.
    s = stepper(job(train_step=returned))
    with pytest.raises(ConfigError, match=named) as refused:
        s.step(next(iter(torch.utils.data.DataLoader(DATA, batch_size=8))))
    assert "one-element tensor" in str(refused.value) or "backward()" in str(refused.value)
