"""The job's validation of the run settings (flodl_zmq.job): every bad value is a ConfigError naming it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from flodl_zmq.api import Trainer
from flodl_zmq.controller_service import coordinator_config
from flodl_zmq.coordinator.config import MaxFailure
from flodl_zmq.errors import ConfigError
from flodl_zmq.job import Job

DATA = TensorDataset(torch.zeros(64, 4), torch.zeros(64, dtype=torch.long))


def job(**kw) -> Job:
    return Job(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
               train_step=lambda m, b: m(b[0]).sum(), dataset=DATA, batch_size=8, epochs=1, **kw)


@pytest.mark.parametrize("value", ["f16", "float32", None, "BF16"])
def test_wire_dtype_other_than_f32_or_bf16_is_refused(value):
    with pytest.raises(ConfigError, match="wire_dtype"):
        job(wire_dtype=value)


@pytest.mark.parametrize("value", [-1, 1.5, True, "25", "x%", "101%", "-5%", [1]])
def test_malformed_max_failures_is_refused(value):
    with pytest.raises(ConfigError, match="max_failures"):
        job(max_failures=value)


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), (0, MaxFailure(count=0)), (2, MaxFailure(count=2)),
    ("25%", MaxFailure(fraction=0.25)), (" 100 % ", MaxFailure(fraction=1.0)), ("12.5%", MaxFailure(fraction=0.125)),
])
def test_max_failures_reaches_the_coordinator_as_a_count_or_a_fraction(value, expected):
    assert coordinator_config(job(max_failures=value)).max_failure == expected


@pytest.mark.parametrize("value", [1.0, 0.5, 0, -3, float("inf"), float("nan"), "30", True])
def test_heartbeat_timeout_of_a_second_or_less_or_not_a_number_is_refused(value):
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        job(heartbeat_timeout_s=value)


def test_heartbeat_timeout_reaches_the_coordinator():
    assert coordinator_config(job(heartbeat_timeout_s=7.5)).heartbeat_timeout_s == 7.5


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, float("nan"), "0.5"])
def test_easgd_alpha_outside_zero_one_is_refused(value):
    with pytest.raises(ConfigError, match="easgd_alpha"):
        job(mode="cpu-async", easgd_alpha=value)


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-cadence"])
def test_easgd_alpha_outside_async_is_refused_naming_the_mode(mode):
    with pytest.raises(ConfigError, match="easgd_alpha only applies to mode='cpu-async'"):
        job(mode=mode, easgd_alpha=0.3)


def test_ranks_blend_by_easgd_alpha_under_async_and_overwrite_otherwise():
    assert job(mode="cpu-async", easgd_alpha=0.3).blend == 0.3
    assert job(mode="cpu-async").blend == 0.5
    assert job(mode="cpu-cadence").blend == 1.0
    assert coordinator_config(job(mode="cpu-async", easgd_alpha=0.3)).effective_easgd_alpha == 0.3


def test_trainer_passes_the_knobs_to_the_job():
    t = Trainer(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                train_step=lambda m, b: m(b[0]).sum(), dataset=DATA, batch_size=8, epochs=1, mode="cpu-async",
                wire_dtype="bf16", max_failures="50%", heartbeat_timeout_s=5.0, easgd_alpha=0.25)
    j = t.job
    assert (j.wire_dtype, j.max_failures, j.heartbeat_timeout_s, j.easgd_alpha) == ("bf16", "50%", 5.0, 0.25)
