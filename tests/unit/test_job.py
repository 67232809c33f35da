"""The job's validation of the run settings (flodl_zmq.job): every bad value is a ConfigError naming it."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import TensorDataset

from flodl_zmq.api import Trainer
from flodl_zmq.coordinator.config import MaxFailure
from flodl_zmq.errors import ConfigError
from flodl_zmq.job import Job, coordinator_config
from flodl_zmq.settings import Settings

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


@pytest.mark.parametrize("value", [0, -3, float("inf"), float("nan"), "30", True])
def test_a_rank_silence_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(ConfigError, match="rank_silence_at_coordinator_s"):
        coordinator_config(job(rank_silence_at_coordinator_s=value))


@pytest.mark.parametrize("value", [0.5, 0.25])
def test_a_rank_silence_the_ranks_heartbeat_outlasts_is_refused_naming_both(value):
    with pytest.raises(ConfigError, match=r"rank_silence_at_coordinator_s .* FLODL_RANK_HEARTBEAT_PERIOD"):
        job(rank_silence_at_coordinator_s=value).check_settings(Settings(rank_heartbeat_period_s=0.5))
    job(rank_silence_at_coordinator_s=value).check_settings(Settings(rank_heartbeat_period_s=value / 2))


def test_heartbeat_timeout_reaches_the_coordinator():
    assert coordinator_config(job(rank_silence_at_coordinator_s=7.5)).rank_silence_at_coordinator_s == 7.5


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
    assert job().blend == 0.5  # the default mode is cpu-async
    assert job(mode="cpu-cadence").blend is None
    assert job(mode="cpu-sync").blend is None


@pytest.mark.parametrize("outer", ["nesterov", "momentum"])
def test_with_an_outer_step_an_async_rank_takes_the_stepped_model_whole_unless_told_otherwise(outer):
    # Half a correction would leave each rank's own drift in the next average, and the outer momentum
    # would build from a pseudo-gradient smaller than the window's change (docs/guide.md, "Slow links").
    assert job(mode="cpu-async", outer=outer).blend == 1.0
    assert job(mode="cpu-async", outer=outer, easgd_alpha=0.3).blend == 0.3
    assert job(mode="cpu-cadence", outer=outer).blend is None


def test_trainer_passes_the_knobs_to_the_job():
    t = Trainer(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                train_step=lambda m, b: m(b[0]).sum(), dataset=DATA, batch_size=8, epochs=1, mode="cpu-async",
                wire_dtype="bf16", max_failures="50%", rank_silence_at_coordinator_s=5.0, easgd_alpha=0.25)
    j = t.job
    assert (j.wire_dtype, j.max_failures, j.rank_silence_at_coordinator_s, j.easgd_alpha) == ("bf16", "50%", 5.0, 0.25)


# --------------------------------------------------------------------------- hooks, data and scheduling


def trainer(**kw) -> Trainer:
    """What a user builds: `Trainer()` checks the job and every scheduling setting."""
    return Trainer(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                   train_step=lambda m, b: m(b[0]).sum(), dataset=DATA, batch_size=8, epochs=1, **kw)


@pytest.mark.parametrize(("keywords", "named"), [
    ({"scheduler": 3}, "scheduler"),
    ({"collate_fn": "stack"}, "collate_fn"),
    ({"max_grad_norm": 0}, "max_grad_norm"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm"),
    ({"autocast": torch.float32}, "autocast"),
    ({"autocast": "bf16"}, "autocast"),
    ({"grad_accumulation": 0}, "grad_accumulation"),
    ({"grad_accumulation": 9}, "grad_accumulation"),  # more micro-batches than samples in a batch
    ({"num_workers": -1}, "num_workers"),
    ({"prefetch_factor": 0}, "prefetch_factor"),
    ({"pin_memory": "yes"}, "pin_memory"),
    ({"anchor": 0}, "anchor"),
    ({"overhead_target": 0.9}, "overhead_target"),
    ({"max_batch_diff": -1}, "max_batch_diff"),
    ({"mode": "cpu-cadence", "relax_up": True}, "relax_up"),  # barrier-paced windows never relax up
    ({"guard": "strict"}, "guard"),
    ({"divergence_threshold": -0.1}, "divergence_threshold"),
    ({"guard": "msf", "divergence_threshold": 0.1}, "divergence_threshold"),
    ({"msf_thresholds": (1e-3, 1e-2)}, "msf_thresholds"),  # the default guard is trend
    ({"guard": "msf", "msf_thresholds": (1e-2, 1e-3)}, "msf_thresholds"),
    ({"guard": "msf", "msf_thresholds": (0.0, 1e-3)}, "msf_thresholds"),
    ({"partition_ratios": [1, 1]}, "partition_ratios"),  # the default (cpu-async) sizes chunks from speed
    ({"mode": "cpu-sync", "partition_ratios": [1, -1]}, "partition_ratios"),
    ({"mode": "cpu-sync", "partition_ratios": 0.5}, "partition_ratios"),
    ({"callback_rank": "slowest"}, "callback_rank"),
    ({"callback_rank": -1}, "callback_rank"),
])
def test_a_bad_hook_data_or_scheduling_setting_is_a_config_error_naming_it(keywords, named):
    with pytest.raises(ConfigError, match=named):
        trainer(**keywords)


@pytest.mark.parametrize(("name", "value"), [
    ("batch_size", "8"), ("batch_size", None), ("epochs", "1"), ("eval_every", "1"), ("eval_every", 1.5),
    ("eval_every", None), ("eval_every_samples", 1.5), ("checkpoint_every", 1.5), ("seed", "a"), ("seed", None),
    ("torch_threads", 1.5), ("torch_threads", True), ("reports_per_epoch", "2"), ("quiet", "yes"), ("quiet", 1),
    ("ship_start", "x"), ("eval_fn", 3), ("checkpoint_fn", 3), ("epoch_fn", 3), ("metrics_fn", 3),
    ("save_path", 3), ("save_path", ""), ("resume_from", 3), ("resume_from", ""), ("run_dir", 3),
    ("aggregation", "x"), ("aggregation", 3),
])
def test_a_setting_of_the_wrong_type_is_a_config_error_naming_it_and_its_value(name, value):
    # A user's first mistake (a string from argv, a float from arithmetic, a truthy flag) must be
    # refused by name when the Trainer is built, not fail as a TypeError deep inside, nor pass.
    keywords = {"model": lambda: torch.nn.Linear(4, 2), "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
                "train_step": lambda m, b: m(b[0]).sum(), "dataset": DATA, "batch_size": 8, "epochs": 1,
                "eval_dataset": DATA if name == "eval_fn" else None, name: value}
    with pytest.raises(ConfigError, match=rf"^{name} must .* got {re.escape(repr(value))}"):
        Trainer(**keywords)


def test_a_path_setting_takes_a_pathlib_path(tmp_path):
    assert trainer(save_path=tmp_path / "model", run_dir=tmp_path).job.save_path == tmp_path / "model"


def test_an_iterable_dataset_is_refused_saying_why():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(ConfigError, match="IterableDataset.*needs indices"):
        Job(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            train_step=lambda m, b: m(b).sum(), dataset=Stream(), batch_size=1, epochs=1)


def test_scheduling_settings_reach_the_coordinator():
    from flodl_zmq.coordinator.convergence import MsfGuard
    from flodl_zmq.coordinator.feedback import make_guard

    cfg = coordinator_config(job(mode="cpu-async", anchor=4, overhead_target=0.1, max_batch_diff=3, relax_up=True,
                                 guard="msf", msf_thresholds=(0.002, 0.02), callback_rank=1))
    assert (cfg.anchor, cfg.overhead_target, cfg.max_batch_diff, cfg.relax_up) == (4, 0.1, 3, True)
    assert cfg.callback_rank == 1
    guard = make_guard(cfg)
    assert isinstance(guard, MsfGuard) and (guard.suppress_threshold, guard.nudge_threshold) == (0.002, 0.02)
    sync = coordinator_config(job(mode="cpu-sync", partition_ratios=[3, 1], guard="none"))
    assert sync.partition_ratios == (3, 1) and sync.guard.value == "none"
    assert coordinator_config(job()).callback_rank is None  # "fastest"
    assert coordinator_config(job(guard="trend", divergence_threshold=0.2)).guard_threshold == 0.2


def test_world_dependent_settings_are_checked_when_the_world_forms():
    cfg = coordinator_config(job(mode="cpu-sync", partition_ratios=[1, 1, 2], callback_rank=1))
    cfg.check_world(3)
    with pytest.raises(ConfigError, match="partition_ratios has 3 entries"):
        cfg.check_world(2)
    with pytest.raises(ConfigError, match="callback_rank = 2 is outside a world of 2"):
        coordinator_config(job(callback_rank=2)).check_world(2)


def test_reports_per_epoch_is_refused_under_sync_and_reaches_the_coordinator():
    with pytest.raises(ConfigError, match="reports_per_epoch"):
        trainer(mode="cpu-sync", reports_per_epoch=4)
    with pytest.raises(ConfigError, match="reports_per_epoch"):
        trainer(reports_per_epoch=-1)
    assert coordinator_config(job(reports_per_epoch=4)).reports_per_epoch == 4


def test_reports_per_epoch_hands_metrics_fn_partial_rows_alone():
    from flodl_zmq.api import train_alone

    rows = []
    train_alone(job(reports_per_epoch=4, quiet=True, metrics_fn=rows.append))
    assert [(r["epoch"], r.get("fraction")) for r in rows] == [(0, 0.25), (0, 0.5), (0, 0.75), (0, None)]


def test_a_renamed_keyword_is_refused_with_its_new_name():
    with pytest.raises(TypeError, match=r"'heartbeat_timeout_s' \(did you mean 'rank_silence_at_coordinator_s'\?\)"):
        Job.from_keywords(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          train_step=lambda m, b: m(b[0]).sum(), dataset=DATA, batch_size=8, epochs=1,
                          heartbeat_timeout_s=10.0)


def test_an_aggregation_the_relays_are_not_told_is_refused_and_int8_is_refused_with_a_robust_one():
    job(aggregation="median").check_settings(Settings(aggregation="median"))
    job().check_settings(Settings(aggregation="median"))  # None: the run's setting, whatever it is
    with pytest.raises(ConfigError, match="FLODL_AGGREGATION"):
        job(aggregation="median").check_settings(Settings())
    with pytest.raises(ConfigError, match="int8"):
        job(wire_dtype="int8").check_settings(Settings(aggregation="trimmed_mean"))
    with pytest.raises(ConfigError, match="aggregation"):
        Settings(aggregation="mode")
