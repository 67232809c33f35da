"""The role hand-off to a script run in-process (`api.hosted`): the role and link reach Trainer.run(), os.environ is untouched."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from torch.utils.data import TensorDataset

from flodl_zmq import api, controller_service
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.errors import ConfigError
from flodl_zmq.settings import Settings


def trainer() -> api.Trainer:
    data = TensorDataset(torch.zeros(8, 2), torch.zeros(8, 1))
    return api.Trainer(
        model=lambda: torch.nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train_step=lambda m, b: m(b[0]).sum(), dataset=data, batch_size=4, epochs=1, quiet=True,
    )


def test_a_hosted_role_and_link_reach_trainer_run_without_touching_the_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FLODL_"):
            monkeypatch.delenv(name)
    penv = ProcessEnv(role="controller", controller=ControllerAddress("127.0.0.1", 7300), key=bytes(32),
                      run_id=bytes(16), incarnation=bytes(16), world={"a": (0,), "b": (1,)})
    link = object()
    seen = []
    monkeypatch.setattr(controller_service, "run_controller", lambda job, p, lk: seen.append((p, lk)) or "result")
    before = dict(os.environ)
    with api.hosted(penv, link):  # type: ignore[arg-type]
        assert trainer().run() == "result"
        assert dict(os.environ) == before
    assert seen == [(penv, link)]
    # Outside the block the environment decides again: no FLODL_ROLE, so the process trains alone.
    assert trainer().run().epochs[0]["epoch"] == 0


def test_a_controller_whose_environment_announces_another_wire_format_refuses_to_start(monkeypatch):
    # The relays were told FLODL_WIRE_DTYPE; a Trainer that says otherwise must not start the run.
    penv = ProcessEnv(role="controller", controller=ControllerAddress("127.0.0.1", 7300), key=bytes(32),
                      run_id=bytes(16), incarnation=bytes(16), world={"a": (0,), "b": (1,)}, settings=Settings(wire_dtype="bf16"))
    monkeypatch.setattr(controller_service, "run_controller", lambda job, p, lk: "result")
    with api.hosted(penv), pytest.raises(ConfigError, match="FLODL_WIRE_DTYPE=bf16"):
        trainer().run()
    with api.hosted(replace(penv, settings=Settings(wire_dtype="f32"))):
        assert trainer().run() == "result"
