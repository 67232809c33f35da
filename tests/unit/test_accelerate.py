"""The Accelerate adapter (flodl_zmq/accelerate.py) in one process: alone, and under a role handed over with `hosted`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import accelerate
import pytest
import torch
import torch.nn.functional as F
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, TensorDataset

from flodl_zmq import accelerate as fz_accelerate
from flodl_zmq import controller_service, session
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.errors import ConfigError
from flodl_zmq.result import TrainResult
from flodl_zmq.session import hosted
from flodl_zmq.settings import Settings


@pytest.fixture(autouse=True)
def no_role(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FLODL_") or name in fz_accelerate.DISTRIBUTED_VARIABLES:
            monkeypatch.delenv(name)


def role(name: str, epochs: int | None = 3) -> ProcessEnv:
    rank = {"rank": 0, "local_rank": 0, "host": "a"} if name == "rank" else {}
    return ProcessEnv(role=name, controller=ControllerAddress("127.0.0.1", 7300), key=bytes(32), run_id=bytes(16),
                      incarnation=bytes(16), world={"a": (0, 1)}, settings=Settings(accelerate_epochs=epochs), **rank)


def parts(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=4, shuffle=True)


def train(accelerator: accelerate.Accelerator, epochs: int = 2) -> torch.nn.Module:
    """A stock Accelerate loop."""
    model, optimizer, loader = accelerator.prepare(*parts())
    torch.manual_seed(1)  # the shuffle
    for _ in range(epochs):
        for x, y in loader:
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.unwrap_model(model)


def test_alone_it_trains_exactly_as_accelerates_own_accelerator() -> None:
    ours, theirs = train(fz_accelerate.Accelerator()), train(accelerate.Accelerator())
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True))
    assert fz_accelerate.Accelerator().is_main_process


@pytest.mark.parametrize("name", ["WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"])
def test_a_torch_distributed_variable_in_a_flodl_process_is_refused_by_name(monkeypatch, name) -> None:
    monkeypatch.setenv(name, "2")
    with hosted(role("rank")), pytest.raises(ConfigError, match=f"{name}: under flodl-zmq each process"):
        fz_accelerate.Accelerator()
    # Alone, the variable is Accelerate's to read, as without flodl-zmq: ours does what Accelerate's own does
    # with it (on a CPU, LOCAL_RANK alone makes it start torch.distributed, which then wants RANK).
    assert outcome(accelerate.Accelerator) is outcome(fz_accelerate.Accelerator)


def outcome(make: Any) -> type[BaseException] | None:
    """The type of what `make()` raised, or None, from a fresh Accelerate state (a process-wide singleton
    that an earlier construction, failed or not, leaves behind)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        make()
    except Exception as exc:
        return type(exc)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    return None


def test_under_a_role_prepare_refuses_to_start_without_the_loops_epochs() -> None:
    with hosted(role("controller", epochs=None)), pytest.raises(ConfigError, match="FLODL_ACCELERATE_EPOCHS"):
        fz_accelerate.Accelerator().prepare(*parts())


def test_on_the_controller_prepare_runs_the_run_and_leaves_its_model_in_the_users(monkeypatch, tmp_path) -> None:
    final = torch.nn.Linear(4, 3)
    monkeypatch.setattr(controller_service, "run_controller", lambda job, penv, link: TrainResult(model=final))
    with hosted(role("controller")):
        accelerator = fz_accelerate.Accelerator()
        model, optimizer, loader = accelerator.prepare(*parts())
        assert [list(loader) for _ in range(3)] == [[], [], []]  # the loop's body never runs here
        assert torch.equal(model.weight, final.weight)
        assert accelerator.is_main_process
        accelerator.save(model.state_dict(), tmp_path / "model.pt")
        # The run is over and its Session left: the process may run another (it held the role for good,
        # and every Session after it in the process, a test's too, was taken for one nested in it).
        assert not session._PLAYING.get()
    assert (tmp_path / "model.pt").exists()


class FakeSession:
    """A rank's Session: batches tagged with their epoch; it records the steps and ends as a rank does."""

    epochs_of_batches = [0, 0, 2, 2, 2]  # this rank got nothing of epoch 1
    made: list[FakeSession] = []

    def __init__(self, model: Any, optimizer: Any, dataset: Any, batch_size: int, epochs: int, **kw: Any) -> None:
        self.epochs, self.result, self.epoch, self.steps = epochs, None, None, []
        FakeSession.made.append(self)

    def __enter__(self) -> FakeSession:
        return self

    def batches(self) -> Iterator[Any]:
        for i, epoch in enumerate(self.epochs_of_batches):
            self.epoch = epoch
            yield (torch.full((4, 4), float(i)), torch.zeros(4, dtype=torch.long))

    def step(self, loss: torch.Tensor) -> None:
        self.steps.append(float(loss))

    def __exit__(self, *exc: Any) -> None:
        raise SystemExit(0)


def test_on_a_rank_each_pass_over_the_loader_is_the_next_epoch_and_each_step_is_reported(monkeypatch, capsys) -> None:
    monkeypatch.setattr(fz_accelerate, "Session", FakeSession)
    FakeSession.made.clear()
    passes: list[list[float]] = []
    with hosted(role("rank")):
        accelerator = fz_accelerate.Accelerator()
        model, optimizer, loader = accelerator.prepare(*parts())
        assert not accelerator.is_main_process
        accelerator.print("the main process's line")
        assert capsys.readouterr().out == ""
        with pytest.raises(SystemExit):  # the last epoch's end ends the rank, as the Session's goodbye does
            for _ in range(3):
                passes.append([])
                for x, y in loader:
                    passes[-1].append(float(x[0, 0]))
                    accelerator.backward(F.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
    assert passes == [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    session = FakeSession.made[0]
    assert session.epochs == 3 and len(session.steps) == 5 and all(s > 0 for s in session.steps)
