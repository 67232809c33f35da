"""`fz.Session`, the loop a user keeps: alone it is Trainer's loop (same order, same steps, same result),
the guide's converted loop runs verbatim, misuse is named, and every rank starts from the controller's model."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import flodl_zmq as fz
from flodl_zmq import bundle, controller_service, rank, session
from flodl_zmq.api import Trainer
from flodl_zmq.coordinator.outputs import EpochProgress, EvalsMerged, Evaluated
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import DECLARED_DEAD_EXIT, UNPLAYED_EXIT, ProcessEnv, raise_lost_signal
from flodl_zmq.errors import ConfigError, SessionError
from flodl_zmq.job import Job
from flodl_zmq.mailbox import Mailbox
from flodl_zmq.payload import flatten
from flodl_zmq.rank_link import ConsensusIn, FromCoordinator
from flodl_zmq.wire import records as rec

ROOT = Path(__file__).resolve().parents[2]
N = 40  # samples: batch 8 -> 5 steps an epoch


pytestmark = pytest.mark.usefixtures("alone")  # tests/conftest.py: no role, runs under tmp_path


def data() -> TensorDataset:
    # Each sample's feature is its own index, so a batch says which samples it holds.
    return TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1), torch.arange(N) % 2)


def net() -> torch.nn.Module:
    return torch.nn.Linear(1, 2)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def loss_of(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0] / N), batch[1])


def halving(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def test_a_session_alone_trains_trainers_batches_in_trainers_order_and_schedule_to_trainers_model():
    seen_by_trainer: list[list[int]] = []

    def step(model, batch):
        seen_by_trainer.append(batch[0].flatten().long().tolist())
        return loss_of(model, batch)

    expected = Trainer(model=net, optimizer=sgd, train_step=step, dataset=data(), batch_size=8, epochs=3,
                       scheduler=halving, quiet=True).run()
    torch.manual_seed(42)  # Trainer's seed, so the two start from the same weights
    model = net()
    optimizer = sgd(model.parameters())
    seen, epochs = [], []
    with fz.Session(model, optimizer, data(), batch_size=8, epochs=3, scheduler=halving, quiet=True) as s:
        for batch in s.batches():
            seen.append(batch[0].flatten().long().tolist())
            epochs.append(s.epoch)
            optimizer.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            optimizer.step()
            s.step(loss)
    assert seen == seen_by_trainer
    assert epochs == [e for e in range(3) for _ in range(N // 8)]
    for e in range(3):  # every sample of each epoch once
        assert sorted(i for b in seen[e * 5:(e + 1) * 5] for i in b) == list(range(N))
    assert optimizer.param_groups[0]["lr"] == 0.01 * 0.5 ** (14 // 3)  # stepped to the 15th step, not by hand
    assert torch.equal(flatten(s.result.model), flatten(expected.model))
    assert [r["avg_loss"] for r in s.result.epochs] == pytest.approx([r["avg_loss"] for r in expected.epochs])


def test_the_guides_converted_loop_runs_verbatim():
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide[guide.index("## Bring your own loop"):]
    code = re.search(r"The same loop, converted.*?```python\n(.*?)```", section, re.S).group(1)
    scope: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, "guide.md", "exec"), scope)
    result = scope["s"].result
    assert [r["epoch"] for r in result.epochs] == [0, 1, 2, 3, 4]
    assert result.final_eval > 0.5  # three classes: well above chance


def test_a_batch_not_reported_with_step_is_a_session_error_naming_the_fix():
    model = net()
    with pytest.raises(SessionError, match=r"call s.step\(loss\) once after each batch"):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            for _ in s.batches():
                pass


@pytest.mark.parametrize(("replica", "named"), [
    (lambda m: dict(model=net, optimizer=sgd(m.parameters())),
     r"Session\(model=...\) got function: it takes the model the loop uses, built \(a torch\.nn\.Module\); "
     r"Trainer is the one that takes a factory"),
    (lambda m: dict(model=m, optimizer=sgd),
     r"Session\(optimizer=...\) got function: .* built \(a torch\.optim\.Optimizer\)"),
    (lambda m: dict(model=m, optimizer=sgd(net().parameters())),
     r"holds none of the model's parameters, so its steps would never change the model: build it from this model"),
], ids=["model-factory", "optimizer-factory", "another-models-optimizer"])
def test_a_session_refuses_a_replica_its_loop_cannot_train_naming_the_fix(replica, named):
    # Factories (Trainer's way) failed deep inside with an AttributeError; an optimizer over another
    # model's parameters ran to "completed" with the model never changed.
    model = net()
    with pytest.raises(ConfigError, match=named):
        fz.Session(**replica(model), dataset=data(), batch_size=8, epochs=1)


def test_a_session_refuses_the_keywords_its_loop_owns():
    model = net()
    with pytest.raises(TypeError, match="max_grad_norm, train_step: a Session's loop does that itself"):
        fz.Session(model, sgd(model.parameters()), data(), batch_size=8, train_step=loss_of, max_grad_norm=1.0)


def test_breaking_out_alone_keeps_the_finished_epochs_and_saves_the_model_as_stopped(tmp_path):
    model = net()
    optimizer = sgd(model.parameters())
    steps = 0
    with fz.Session(model, optimizer, data(), batch_size=8, epochs=4, quiet=True,
                    save_path=str(tmp_path / "m")) as s:
        for batch in s.batches():
            optimizer.zero_grad()
            loss_of(model, batch).backward()
            optimizer.step()
            s.step()  # no loss: the loop reports none
            steps += 1
            if steps == 7:  # in the second epoch
                break
    assert [r["epoch"] for r in s.result.epochs] == [0]
    assert np.isnan(s.result.epochs[0]["avg_loss"])
    state, meta = bundle.load(str(tmp_path / "m"))
    assert meta["reason"] == "stopped" and meta["epoch"] == 1
    assert torch.equal(state["weight"], model.state_dict()["weight"])
    # The result and the run log say so too, as the bundle does: a loop left early did not complete the run.
    assert s.result.reason == "stopped"
    ends = [e for e in map(json.loads, next(Path.cwd().glob("runs/*/events.jsonl")).read_text().splitlines())
            if e["kind"] == "end"]
    assert [e["reason"] for e in ends] == ["stopped"]


def test_a_lone_loop_left_within_an_epoch_resumes_after_the_batches_it_trained(tmp_path):
    # The bundle named the epoch only, and a resume trained its first batches twice.
    def run(epochs: int, stop_at: int | None, **kw: Any) -> list[int]:
        model = net()
        optimizer = sgd(model.parameters())
        seen: list[int] = []
        with fz.Session(model, optimizer, data(), batch_size=8, epochs=epochs, quiet=True, **kw) as s:
            for batch in s.batches():
                optimizer.zero_grad()
                loss_of(model, batch).backward()
                optimizer.step()
                s.step()
                seen += batch[0].squeeze(1).long().tolist()
                if len(seen) == stop_at:
                    break
        return seen

    first = run(2, stop_at=N + 16, save_path=str(tmp_path / "m"))  # two batches into epoch 1
    assert bundle.load(str(tmp_path / "m"))[1]["epoch_batches"] == 2
    rest = run(2, stop_at=None, resume_from=str(tmp_path / "m"))
    assert sorted(first[N:] + rest) == list(range(N))  # epoch 1: every sample once


def test_a_built_model_for_trainers_factory_is_refused_naming_the_fix():
    # Called as a factory, the model ran its forward() with no input: "forward() missing 1 required argument".
    with pytest.raises(ConfigError, match=r"model must be a factory that builds the model, got a built Linear: "
                                          r"pass model=lambda: net"):
        Trainer(model=net(), optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=1)


def test_resuming_alone_past_the_runs_epochs_is_refused_as_on_a_cluster(tmp_path):
    # Alone it trained nothing, scored nothing and said `completed`; a cluster refuses it.
    Trainer(model=net, optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=2, quiet=True,
            save_path=str(tmp_path / "m")).run()
    with pytest.raises(ConfigError, match=r"holds 2 epochs, more than this run's 1; raise epochs"):
        Trainer(model=net, optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=1, quiet=True,
                resume_from=str(tmp_path / "m")).run()


def test_resuming_a_finished_run_alone_with_its_epochs_scores_its_model_as_a_cluster_does(tmp_path):
    # Alone it trained nothing and returned final_eval None; a cluster scores the resumed consensus.
    def mean_output(model: torch.nn.Module, dataset: TensorDataset) -> float:
        return float(model(dataset.tensors[0]).mean())

    run = dict(model=net, optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=2, quiet=True,
               eval_dataset=data(), eval_fn=mean_output)
    first = Trainer(**run, save_path=str(tmp_path / "m")).run()
    again = Trainer(**run, resume_from=first.saved).run()  # its meta file's path: the bundle it names
    assert again.epochs == [] and again.final_eval == pytest.approx(first.final_eval)
    assert again.evals[0]["samples"] == 2 * len(data())
    # A save_path that ends in .pt is a stem like any other (it wrote n.pt.pt): resumed by that name as well.
    dotted = Trainer(**run, save_path=str(tmp_path / "n.pt")).run()
    assert Trainer(**run, resume_from=str(tmp_path / "n.pt")).run().final_eval == pytest.approx(dotted.final_eval)


def test_metrics_fn_on_the_controller_gets_each_epochs_row_with_its_eval_in_order(tmp_path):
    # A cluster's eval is scored on a rank and lands after the epoch's row: metrics_fn was called with the
    # row at once and never again, so a metrics_fn=wandb.log user lost every eval of a cluster run.
    rows: list[dict[str, Any]] = []
    job = Job(model=net, optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=3, quiet=True,
              eval_dataset=data(), eval_fn=lambda model, dataset: 1.0, reports_per_epoch=2,
              metrics_fn=rows.append, run_dir=str(tmp_path / "run"))
    service = controller_service.ControllerService(job, penv("controller", route_secret=bytes(32)))

    def aggregated(epoch: int) -> rec.EpochAggregated:
        return rec.EpochAggregated(epoch=epoch, avg_loss=0.5, epoch_ms=10.0, per_rank_throughput=[1.0, 1.0],
                                   per_rank_batch_share=[0.5, 0.5], per_rank_loss=[0.5, 0.5],
                                   per_rank_samples=[8, 8], scalars={})

    def scored(epoch: int, metric: float, error: str | None = None) -> Evaluated:
        return Evaluated(rec.EvalResult(rank=1, schedule_id=epoch, epoch=epoch + 1, metric=metric, elapsed_ms=1.0,
                                        error=error), samples=16 * (epoch + 1), within_epoch=False)

    service._on_effect(aggregated(0))
    service._on_effect(EpochProgress(epoch=1, fraction=0.5, metrics=aggregated(1)))
    assert rows == []  # epoch 0's eval is owed: its row waits, and what came after it waits behind it
    service._on_effect(scored(0, 0.75))
    assert [(r["epoch"], r.get("eval"), r.get("fraction")) for r in rows] == [(0, 0.75, None), (1, None, 0.5)]
    service._on_effect(aggregated(1))
    service._on_effect(EvalsMerged(epochs=(2,), samples=48))  # epoch 1 has none of its own
    service._on_effect(aggregated(2))
    service._on_effect(scored(2, 0.5, error="eval_fn raised"))  # none will come for epoch 2 either
    assert [(r["epoch"], r.get("eval"), r.get("eval_merged")) for r in rows[2:]] == [(1, None, 48), (2, None, None)]
    service.report.finish(0.0)
    assert len(rows) == 4


def test_ctrl_c_alone_ends_the_run_log_interrupted_and_says_nothing_was_saved(tmp_path, capsys):
    # The log ended with no end line, and a save_path the user believed written was silently not.
    model = net()
    optimizer = sgd(model.parameters())
    with pytest.raises(KeyboardInterrupt):
        with fz.Session(model, optimizer, data(), batch_size=8, epochs=2, quiet=True,
                        save_path=str(tmp_path / "m"), run_dir=str(tmp_path / "run")) as s:
            for i, batch in enumerate(s.batches()):
                optimizer.zero_grad()
                loss_of(model, batch).backward()
                optimizer.step()
                s.step()
                if i == 2:
                    raise KeyboardInterrupt
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["kind"] == "end" and events[-1]["reason"] == "interrupted", events[-1]
    assert not list(tmp_path.glob("m*"))
    said = capsys.readouterr().out
    assert f"interrupted: nothing was saved to {tmp_path / 'm'}" in said and "leave a Session's loop" in said, said


def test_an_epoch_row_alone_has_the_fields_a_clusters_row_has_with_the_same_meaning():
    # Alone, a row lacked samples, per_rank_samples and round (guide.md's TrainResult table): a script
    # reading r.epochs[-1]["samples"] worked on a cluster and raised KeyError alone.
    result = Trainer(model=net, optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=2,
                     quiet=True).run()
    for row in result.epochs:
        assert row["samples"] == N and row["per_rank_samples"] == [N] and row["batch_share"] == [1.0]
        assert row["round"] == -1 and row["reconnects"] == 0  # no consensus, no link: alone
    logged = [json.loads(line) for line in next(Path.cwd().glob("runs/*/events.jsonl")).read_text().splitlines()]
    assert [e["samples"] for e in logged if e["kind"] == "epoch"] == [N, N]


def test_a_partial_row_alone_has_every_field_of_its_epochs_row():
    # metrics_fn's partial rows (reports_per_epoch) lacked `round` and `reconnects`, which the epoch's
    # own row had: a script reading them from every row raised KeyError on the first partial one.
    rows: list[dict[str, Any]] = []
    Trainer(model=net, optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=1, quiet=True,
            reports_per_epoch=4, metrics_fn=rows.append).run()
    *partial, whole = rows
    assert partial and all(set(row) == {*whole, "fraction"} for row in partial)
    assert [(row["round"], row["reconnects"]) for row in partial] == [(-1, 0)] * len(partial)


def test_a_partial_row_on_the_controller_has_every_field_of_its_epochs_row_with_the_latest_round(tmp_path):
    rows: list[dict[str, Any]] = []
    job = Job(model=net, optimizer=sgd, train_step=loss_of, dataset=data(), batch_size=8, epochs=1, quiet=True,
              reports_per_epoch=4, metrics_fn=rows.append, run_dir=str(tmp_path / "run"))
    service = controller_service.ControllerService(job, penv("controller", route_secret=bytes(32)))
    so_far = rec.EpochAggregated(epoch=0, avg_loss=0.5, epoch_ms=10.0, per_rank_throughput=[1.0, 1.0],
                                 per_rank_batch_share=[0.5, 0.5], per_rank_loss=[0.5, 0.5], per_rank_samples=[8, 8],
                                 scalars={})
    service.kept.round = 3  # the latest consensus kept
    service.router.reconnects_this_epoch = 1  # a relay's link came back on a new connection
    service._on_effect(EpochProgress(epoch=0, fraction=0.5, metrics=so_far))
    service._on_effect(so_far)
    service.report.finish(0.0)
    partial, whole = rows
    assert set(partial) == {*whole, "fraction"}
    assert (partial["round"], partial["reconnects"]) == (whole["round"], whole["reconnects"]) == (3, 1)


@pytest.mark.parametrize("loss", ["abc", torch.ones(8), [1.0], True], ids=["text", "per-sample", "list", "bool"])
def test_a_loss_that_is_not_one_number_is_a_session_error_naming_the_fix(loss):
    model = net()
    with pytest.raises(SessionError, match=r"the loss must be one number .* e\.g\. loss\.mean\(\)"):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            for _batch in s.batches():
                s.step(loss)


def penv(role: str, **kw: Any) -> ProcessEnv:
    return ProcessEnv(role=role, controller=ControllerAddress("127.0.0.1", 7300), key=bytes(32), run_id=bytes(16),
                      incarnation=bytes(16), world={"a": (0,), "b": (1,)}, **kw)


def test_the_controller_of_a_session_ships_its_own_model_as_every_ranks_start(monkeypatch):
    torch.manual_seed(1)
    model = net()
    jobs = []
    monkeypatch.setattr(controller_service, "run_controller", lambda job, p, lk: jobs.append(job) or "result")
    with session.hosted(penv("controller")):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            assert list(s.batches()) == []  # the run is over when the block's body starts: nothing to train here
    assert s.result == "result"
    (job,) = jobs
    assert job.ship_start  # the reducer serves the controller's model as round 0 (PROTOCOL.md 13)
    assert torch.equal(flatten(job.model()), flatten(model))


def test_a_session_inside_another_under_a_role_is_a_session_error_not_a_second_run(monkeypatch):
    # Nested under launch, the inner Session played the role again: the controller waited for ranks
    # that never came and the ranks for acknowledgements, until launch was killed (a hang).
    runs = []
    monkeypatch.setattr(controller_service, "run_controller", lambda job, p, lk: runs.append(job) or "result")
    model, other = net(), net()
    with session.hosted(penv("controller")):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True):
            with pytest.raises(SessionError, match=r"inside another Session's with block: a process plays its role "
                                                   r"\(rank, controller, relay\) once; train both models in one"):
                with fz.Session(other, sgd(other.parameters()), data(), batch_size=8, quiet=True):
                    pass
        assert len(runs) == 1
        with fz.Session(other, sgd(other.parameters()), data(), batch_size=8, quiet=True) as after:
            pass  # the block left, the role is free again
    assert after.result == "result" and len(runs) == 2


def test_a_role_the_script_never_played_is_an_unplayed_exit_that_names_the_missing_call(monkeypatch, capsys):
    # Exiting 0 left `flodl-zmq launch` ending 0 after a script that built a Trainer and never ran it.
    monkeypatch.setattr(controller_service, "run_controller", lambda job, p, lk: "result")
    with session.hosted(penv("rank", **RANK_1)) as idle:
        Trainer(model=net, optimizer=sgd, train_step=lambda m, b: m(b[0]).sum(), dataset=data(), batch_size=8, epochs=1)
    assert session.unplayed(idle) == UNPLAYED_EXIT != 0
    err = capsys.readouterr().err
    assert "(rank 1 on b)" in err and "never called Trainer(...).run() nor entered a Session" in err
    model = net()
    with session.hosted(penv("controller")) as played:
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True):
            pass
    assert session.unplayed(played) == 0 and capsys.readouterr().err == ""


class FakeLink:
    """A rank's link with no sockets: an inbox the test fills, and the records the rank sent."""

    def __init__(self) -> None:
        self.inbox: Mailbox[Any] = Mailbox()
        self.sent: list[Any] = []
        self.lingered: bool | None = None  # how it was closed (None: not yet)

    def send(self, record: Any, *a: Any, **k: Any) -> None:
        self.sent.append(record)

    def note_lr(self, lr: float) -> None:
        pass

    def step(self, *a: Any) -> None:
        pass

    def flush_steps(self) -> None:
        pass

    def close(self, linger: bool = True) -> None:
        self.lingered = linger


@pytest.fixture
def rank_links(monkeypatch) -> list[FakeLink]:
    """A Session's rank gets a FakeLink (no sockets) in place of its RankLink; the list holds it."""
    links: list[FakeLink] = []

    def start(rt: rank.RankRuntime) -> None:
        rt.link = FakeLink()
        links.append(rt.link)

    monkeypatch.setattr(rank.RankRuntime, "start", start)
    return links


def start_rank(link: FakeLink, shipped: np.ndarray, samples: int) -> None:
    """What the controller sends first: the epoch's span, and (by the relay) the shipped start."""
    link.inbox.put(FromCoordinator(rec.StartEpoch(plan=rec.EpochPlan(epoch=0, offset=0, size=samples))))
    link.inbox.put(ConsensusIn(SimpleNamespace(record=rec.Consensus(round=rec.RESUME_ROUND, mass=1.0),
                                               payload=[shipped])))


RANK_1 = {"host": "b", "rank": 1, "local_rank": 0}


def test_a_sessions_rank_trains_from_the_controllers_model_not_the_one_it_built(rank_links):
    torch.manual_seed(2)
    model = net()  # not the controller's: another seed
    shipped = np.arange(flatten(model).numel(), dtype=np.float32)
    at_first_batch = []
    with pytest.raises(SystemExit) as ended, session.hosted(penv("rank", **RANK_1)):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            start_rank(rank_links[0], shipped, 8)
            for batch in s.batches():
                at_first_batch.append(flatten(model).clone())
                s.step(loss_of(model, batch))
                rank_links[0].inbox.put(FromCoordinator(rec.Shutdown()))
    assert ended.value.code == 0
    assert torch.equal(at_first_batch[0], torch.from_numpy(shipped))
    assert isinstance(rank_links[0].sent[-1], rec.Exiting)  # the rank said goodbye on leaving the block


def sigtermed_rank(rank_links: list[FakeLink]) -> int:
    """A rank's Session SIGTERMed after its first step, as its agent tears the host down; its exit code."""
    model = net()
    with pytest.raises(SystemExit) as ended, session.hosted(penv("rank", **RANK_1)):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            start_rank(rank_links[0], flatten(model).numpy().copy(), N)
            for batch in s.batches():
                s.step(loss_of(model, batch))
                signal.raise_signal(signal.SIGTERM)  # its agent tears the host down (a re-form, a stop)
    return ended.value.code


def test_a_rank_stopped_by_sigterm_says_goodbye_without_awaiting_its_acknowledgement(rank_links):
    assert sigtermed_rank(rank_links) == 143
    link = rank_links[0]
    assert isinstance(link.sent[-1], rec.Exiting) and link.lingered is False  # the agent reports the exit


def test_a_rank_blocks_stop_handlers_end_with_it_so_a_stop_that_fired_stops_no_later_rank_here(rank_links):
    # CI: a rank SIGTERMed in a test left its fired handler installed, and every rank trained later in that
    # pytest process raised RankTerminated at its first step (`raise_lost_signal`).
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
    assert sigtermed_rank(rank_links) == 143
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == before
    raise_lost_signal()  # nothing to raise again


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="a Linux host of 2+ cores")
def test_a_rank_trains_on_its_share_of_the_cores_and_its_block_gives_the_process_its_cores_back(rank_links):
    # Host b runs two ranks: this one, its first, keeps to the first half of the cores the process may use.
    before = os.sched_getaffinity(0)
    model, during = net(), []
    env = dataclasses.replace(penv("rank", **RANK_1), world={"a": (0,), "b": (1, 2)})
    with pytest.raises(SystemExit) as ended, session.hosted(env):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            start_rank(rank_links[0], flatten(model).numpy().copy(), N)
            for batch in s.batches():
                s.step(loss_of(model, batch))
                during.append(os.sched_getaffinity(0))
                break
    assert ended.value.code == 0
    assert during == [set(sorted(before)[:len(before) // 2])]
    assert os.sched_getaffinity(0) == before  # the next test, or rank, run here is not held to it


def test_a_rank_declared_dead_stops_at_once_with_an_error_even_while_it_awaits_a_consensus(rank_links, caplog):
    # Its relay refused its deposit (a NaN, say): no consensus of that round will ever reach it.
    model = net()
    with pytest.raises(SystemExit) as ended, session.hosted(penv("rank", **RANK_1)):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            link = rank_links[0]
            start_rank(link, flatten(model).numpy().copy(), 8)
            for batch in s.batches():
                s.step(loss_of(model, batch))
                for record in (rec.RequestParams(round=1), rec.Update(round=1, next_plan=None),
                               rec.DeclareDead(rank=0), rec.DeclareDead(rank=1), rec.Shutdown()):
                    link.inbox.put(FromCoordinator(record))
    # Not the clean exit the Shutdown behind it would give, and not a crash's 1: its agent reads 5 as
    # "the run goes on without this rank" and brings the host back with fresh ranks (agent.py).
    assert ended.value.code == DECLARED_DEAD_EXIT == 5
    assert isinstance(link.sent[-2], rec.RoundFrame) and isinstance(link.sent[-1], rec.Exiting)
    assert link.lingered is False  # the coordinator acknowledges nothing from a dead rank
    assert "rank 1: lost: the coordinator declared this rank dead" in caplog.text


def test_a_rank_that_breaks_out_of_its_loop_says_goodbye_and_exits_cleanly(rank_links):
    model = net()
    after_the_block = []
    with pytest.raises(SystemExit) as ended, session.hosted(penv("rank", **RANK_1)):
        with fz.Session(model, sgd(model.parameters()), data(), batch_size=8, quiet=True) as s:
            start_rank(rank_links[0], flatten(model).numpy().copy(), N)
            for batch in s.batches():
                s.step(loss_of(model, batch))
                break
        after_the_block.append(True)
    assert ended.value.code == 0 and not after_the_block  # only the controller and a lone process get past it
    assert rank_links[0].lingered  # a clean exit waits for the coordinator to have its goodbye
    sent = rank_links[0].sent
    assert isinstance(sent[-1], rec.Exiting)
    assert not any(isinstance(r, rec.EpochMetrics) for r in sent)  # 1 of its 5 batches: its span is not done
