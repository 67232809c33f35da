"""The training job: what the user's script defines, identical in every process.

Rules this module keeps:

- One validated object. Every role (controller, relay, rank) builds the same
  `Job` from the same script, so a value is checked once, here, with a
  message naming the setting and its allowed range.
- Callables are factories or plain functions; nothing here starts a thread or
  touches a device.
- The coordinator's configuration is built from a `Job` in one place,
  `coordinator_config`: `Trainer()` builds it in every process to run its
  checks, the controller to schedule.
- The keywords are defined once, here: `Trainer(**keywords)` builds a `Job`
  with `Job.from_keywords`, and an unknown keyword is refused with the
  closest real ones named (a typo must not silently train with a default).
"""

from __future__ import annotations

import difflib
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from flodl_zmq import bundle
from flodl_zmq.coordinator.config import RANK_SILENCE_AT_COORDINATOR_S, CoordinatorConfig, Mode
from flodl_zmq.errors import ConfigError, TrainingError
from flodl_zmq.outer import OuterConfig
from flodl_zmq.settings import (
    AGGREGATIONS,
    DEFAULT_MODE,
    MODE_NAMES,
    MaxFailure,
    Settings,
)
from flodl_zmq.wire_format import WireFormat, named

MODES = {name: Mode(name.removeprefix("cpu-")) for name in MODE_NAMES}
CALLBACK_ERRORS = ("report", "stop")
AUTOCAST_DTYPES = (None, torch.bfloat16, torch.float16)
# Integer settings and their minimum (0 turns eval_every, eval_every_samples, checkpoint_every and
# reports_per_epoch off); bool is refused, though an int to Python, since True is no count.
INTEGERS = {
    "batch_size": 1, "epochs": 1, "eval_every": 0, "eval_every_samples": 0, "checkpoint_every": 0, "seed": 0,
    "torch_threads": 1, "grad_accumulation": 1, "num_workers": 0, "prefetch_factor": 1, "reports_per_epoch": 0,
}
CALLBACKS = ("eval_fn", "checkpoint_fn", "epoch_fn", "metrics_fn", "scheduler", "collate_fn")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")


# cpu-async's blend when the script sets none: half of each correction, floDl's own default. Against
# 1 (the whole correction) it reached the digits jobs' targets sooner, with fewer samples in most, in 12
# of 15 paired comparisons (docs/benchmarks.md, "Half of each correction"). With an outer step a rank takes
# the stepped model whole, or the outer momentum builds from a pseudo-gradient that is too small.
DEFAULT_EASGD_ALPHA = 0.5
OUTER_EASGD_ALPHA = 1.0


# Keywords that took a new name (issue 28: one name per setting): a script using the old one is told the new.
RENAMED = {"heartbeat_timeout_s": "rank_silence_at_coordinator_s"}


@dataclass(frozen=True)
class Job:
    """The run as every process sees it: the keywords of `flodl_zmq.Trainer`.

    model: factory returning a fresh `nn.Module` (called once per process).
    optimizer: factory `params -> torch.optim.Optimizer`.
    train_step: `(model, batch) -> loss`; the framework runs backward and the step.
    dataset: a map-style torch Dataset, identical on every rank (checked by signature).
    batch_size: per-rank batch size. epochs: passes over the dataset.
    mode: "cpu-async" (the default: ElChe windows, no rank waits at an average,
        the consensus applied as a correction), "cpu-cadence" (ElChe windows, ranks
        wait at each average), "cpu-sync" (equal partitions, average every step of
        the slowest). The default is what bench/tta.py measured soonest to target.
    eval_dataset, eval_fn: `eval_fn(model, eval_dataset) -> float`, run on the
        elected (fastest) rank on the consensus every `eval_every` epochs and once
        at the end.
    eval_every_samples: also score the model within epochs, each time it has trained
        on that many more samples (0, the default: off): on a cluster the first
        finished consensus that holds them (cpu-async opens a round for it),
        alone the model after the step that reaches them. Each eval is a row of
        `TrainResult.evals` with its time and samples, where time to target is read.
    checkpoint_fn, checkpoint_every: `checkpoint_fn(version, model)` on the elected rank.
    epoch_fn: `epoch_fn(epoch, model)` on the epoch-callback rank before each epoch.
    metrics_fn: `metrics_fn(epoch_metrics_dict)` on the controller after each epoch.
    on_callback_error: "report" (log it with the rank and traceback, keep training)
        or "stop" (end the run with TrainingError).
    save_path: stem of the final bundle (`<stem>.pt` + `<stem>.meta.json`), also
        written by a shutdown-with-save. resume_from: a bundle stem to continue from.
    seed: shuffle and initialisation seed. torch_threads: threads per rank.
    quiet: no progress bar and no per-epoch lines.
    run_dir: where the controller (or the process alone) writes `events.jsonl`
        for `flodl-zmq report` (flodl_zmq/runlog.py); None: `--run-dir` /
        FLODL_RUN_DIR, else a fresh `runs/<time>-<id>`.
    wire_dtype: what a round carries, "f32", "bf16" (half the bytes) or "int8"
        (a quarter, with per-block scales and error feedback); ranks keep f32
        weights and the saved model is f32. Validated into `Job.wire`, the
        object every process hands downstream; a relay (which runs none of
        the script) is told it by FLODL_WIRE_DTYPE when the run sets it.
    max_failures: rank failures that end the run (with a save): a count, or a
        percent of the world such as "25%"; None (default) trains on while any rank lives.
    rank_silence_at_coordinator_s: rank silence at the coordinator: a rank silent this long
        (seconds, more than the ranks' heartbeat period) is declared dead. The other
        silences and periods are process settings (flodl_zmq/settings.py).
    easgd_alpha: cpu-async only: how far a rank moves towards each consensus
        (0 < a <= 1; None = 0.5, or 1 with an outer step: `Job.blend`).

    Training hooks (docs/guide.md, "Training hooks", says what each means under Local SGD):
    scheduler: factory `optimizer -> torch.optim.lr_scheduler.LRScheduler`, stepped to the
        global step (every rank's steps counted together), so every rank follows one schedule.
    max_grad_norm: clip the gradients' total norm to this before each step (None: no clipping).
    autocast: torch.bfloat16 (CPU or CUDA) or torch.float16 (CUDA only, with a GradScaler).
    grad_accumulation: run each batch as this many micro-batches (one optimizer step per batch).

    Data (as torch's DataLoader): num_workers loader processes produce a dispatched span's
    batches ahead of the step (0: in the training thread); prefetch_factor batches in flight
    per worker; pin_memory (CUDA ranks); collate_fn (default torch's default_collate).

    Scheduling (None: the coordinator's floDl default; flodl_zmq/coordinator/config.py):
    anchor, max_anchor, overhead_target, max_batch_diff: ElChe's initial window (and floor; None = 10),
        its ceiling (None = 1000; a DiLoCo-style run sets both to hundreds of inner steps), overhead
        share, per-update move.
    relax_up: cpu-async grows the window by one on each stable verdict.
    guard: "none", "trend" or "msf"; divergence_threshold (trend), msf_thresholds (msf).
    partition_ratios: cpu-sync, one share per rank. callback_rank: "fastest" or a rank.
    reports_per_epoch: n > 1 also hands metrics_fn a partial row at each n-th of an epoch.

    outer: the step the controller takes on each round's average: "none" (the
        average is the new model), "nesterov" (DiLoCo) or "momentum" (SlowMo);
        outer_lr and outer_momentum default to 0.7 / 0.9 (nesterov) and 1.0 / 0.7
        (momentum). See docs/guide.md for when to pick one.
    aggregation: how the reducer combines a round's deposits: "mean", "trimmed_mean"
        or "median" (robust to a minority of poisoning ranks; docs/guide.md). The
        relays read it from the run's setting (FLODL_AGGREGATION, --aggregation),
        so a value here must equal that setting; None: the setting, whatever it is.
    ship_start: every rank starts from the controller's model, shipped as round 0's
        consensus before its first step (PROTOCOL.md 13), not from its own `model()`.
        Set by `Session`, whose model each process's script builds itself (seeded or not).
    """

    model: Callable[[], torch.nn.Module]
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    train_step: Callable[[torch.nn.Module, Any], torch.Tensor]
    dataset: Dataset
    batch_size: int
    epochs: int
    mode: str = DEFAULT_MODE
    eval_dataset: Dataset | None = None
    eval_fn: Callable[[torch.nn.Module, Dataset], float] | None = None
    eval_every: int = 1
    eval_every_samples: int = 0
    checkpoint_fn: Callable[[int, torch.nn.Module], None] | None = None
    checkpoint_every: int = 0
    epoch_fn: Callable[[int, torch.nn.Module], None] | None = None
    metrics_fn: Callable[[dict[str, Any]], None] | None = None
    on_callback_error: str = "report"
    save_path: str | None = None
    resume_from: str | None = None
    seed: int = 42
    easgd_alpha: float | None = None
    torch_threads: int = 1
    quiet: bool = False
    wire_dtype: str = "f32"
    max_failures: int | str | None = None
    rank_silence_at_coordinator_s: float = RANK_SILENCE_AT_COORDINATOR_S
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    max_grad_norm: float | None = None
    autocast: torch.dtype | None = None
    grad_accumulation: int = 1
    num_workers: int = 0
    prefetch_factor: int = 2
    pin_memory: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None
    anchor: int | None = None
    max_anchor: int | None = None
    overhead_target: float | None = None
    max_batch_diff: int | None = None
    relax_up: bool = False
    guard: str | None = None
    divergence_threshold: float | None = None
    msf_thresholds: tuple[float, float] | None = None
    partition_ratios: Sequence[float] | None = None
    callback_rank: int | str = "fastest"
    reports_per_epoch: int = 0
    outer: str = "none"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    run_dir: str | None = None
    aggregation: str | None = None
    ship_start: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.model, torch.nn.Module):  # callable too: called, it failed inside torch's forward()
            raise ConfigError(
                f"model must be a factory that builds the model, got a built {type(self.model).__name__}: pass "
                "model=lambda: net (every process builds its own replica), or hand the built model to a "
                "fz.Session(net, optimizer, ...)")
        for name in ("model", "optimizer", "train_step"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be callable (a factory or a function), got {getattr(self, name)!r}")
        if isinstance(self.dataset, IterableDataset):
            raise ConfigError(
                "dataset is an IterableDataset: each rank trains exact index spans of the epoch's "
                "permutation (that is how every sample is seen once per epoch, across deaths and "
                "rebalancing), which needs indices; wrap it in a map-style Dataset (__len__ and __getitem__)"
            )
        if self.dataset is None or not hasattr(self.dataset, "__len__") or not hasattr(self.dataset, "__getitem__"):
            raise ConfigError("dataset is required and must be a map-style torch Dataset (with __len__ and __getitem__)")
        if len(self.dataset) == 0:  # type: ignore[arg-type]
            raise ConfigError("dataset is empty: there is nothing to train on")
        self._check_types()
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if (self.eval_fn is None) != (self.eval_dataset is None):
            raise ConfigError("eval_fn and eval_dataset go together: give both or neither")
        if self.on_callback_error not in CALLBACK_ERRORS:
            raise ConfigError(f"on_callback_error must be one of {CALLBACK_ERRORS}, got {self.on_callback_error!r}")
        if self.easgd_alpha is not None:
            if not (_real(self.easgd_alpha) and 0.0 < self.easgd_alpha <= 1.0):
                raise ConfigError(f"easgd_alpha must be a number in (0, 1] (1 = overwrite), got {self.easgd_alpha!r}")
            if self.mode != "cpu-async":
                raise ConfigError(
                    f"easgd_alpha only applies to mode='cpu-async' (mode is {self.mode!r}, where ranks "
                    f"overwrite with the consensus): drop easgd_alpha or switch the mode"
                )
        named(self.wire_dtype)  # raises on anything but a wire format's name
        self.max_failure()  # raises on a malformed max_failures
        self.outer_config()  # raises on an unknown outer step or a bad outer_lr / outer_momentum
        for name in ("anchor", "max_anchor"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a number of batches >= 1 (or None for ElChe's default), got {value!r}")
        if self.anchor is not None and self.max_anchor is not None and self.max_anchor < self.anchor:
            raise ConfigError(f"max_anchor ({self.max_anchor}) is below anchor ({self.anchor}): raise max_anchor")
        self._check_hooks()

    def stop_on_callback_error(self, what: str, detail: str) -> TrainingError | None:
        """The error that ends the run when `what` (a user callback) failed, under on_callback_error="stop";
        None under "report" (it is logged and training goes on). Alone and on a cluster alike."""
        if self.on_callback_error != "stop":
            return None
        return TrainingError(f"{what} failed and on_callback_error='stop': {detail}")

    def _check_types(self) -> None:
        """Each setting's type and range, by name: a wrong type must be refused here, naming the
        setting, not fail later as a TypeError deep in a rank (or be taken as truthy)."""
        for name, minimum in INTEGERS.items():
            value = getattr(self, name)
            if not _int(value) or value < minimum:
                raise ConfigError(f"{name} must be an integer (a Python int) >= {minimum}, got {value!r}")
        for name in ("quiet", "pin_memory", "relax_up", "ship_start"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in CALLBACKS:
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be a function (or None to leave it out), got {getattr(self, name)!r}")
        for name in ("save_path", "resume_from", "run_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value).strip()):
                raise ConfigError(f"{name} must be a path (a str or pathlib.Path; None to leave it out), got {value!r}")
        if self.resume_from is not None:
            object.__setattr__(self, "resume_from", bundle.stem_of(self.resume_from))
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be one of {', '.join(AGGREGATIONS)} (or None: the run's setting), "
                              f"got {self.aggregation!r}")

    def _check_hooks(self) -> None:
        if self.max_grad_norm is not None and not (_real(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ConfigError(f"max_grad_norm must be a finite number > 0 (None: no clipping), got {self.max_grad_norm!r}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ConfigError(
                f"autocast must be torch.bfloat16, torch.float16 (CUDA only) or None, got {self.autocast!r}"
            )
        if self.grad_accumulation > self.batch_size:
            raise ConfigError(
                f"grad_accumulation ({self.grad_accumulation}) must not exceed batch_size ({self.batch_size}): "
                "each micro-batch needs at least one sample"
            )
        if self.relax_up and self.mode != "cpu-async":
            raise ConfigError(
                f"relax_up only applies to mode='cpu-async' (mode is {self.mode!r}, where windows are "
                "barrier-paced and the setting would be ignored): drop relax_up or switch the mode"
            )
        if self.callback_rank != "fastest" and not (_int(self.callback_rank) and self.callback_rank >= 0):
            raise ConfigError(f"callback_rank must be 'fastest' or a rank (an integer >= 0), got {self.callback_rank!r}")

    @classmethod
    def from_keywords(cls, *args: Any, **keywords: Any) -> Job:
        """`Job(*args, **keywords)`, refusing an unknown keyword by name with the closest real ones."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(keywords) - set(known))
        if unknown:
            hints = []
            for name in unknown:
                close = [RENAMED[name]] if name in RENAMED else difflib.get_close_matches(name, known, n=3)
                hints.append(f"{name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
            raise TypeError(
                f"Trainer()/Session() got unknown keyword(s) {', '.join(hints)}; the keywords are {', '.join(known)} "
                "(documented in flodl_zmq.job.Job)"
            )
        return cls(*args, **keywords)

    def build_model(self) -> torch.nn.Module:
        """The model as every process of the run builds it: torch's, numpy's and random's global generators seeded
        with `seed` first, so a factory drawing its initial weights from any of them gives every replica the
        same (a generator of its own must be seeded by the factory: `Job.ship_start` otherwise)."""
        seed_generators(self.seed)
        return self.model()

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The optimizer factory's optimizer over `model`'s parameters, handed as a list: a factory that reads
        them twice (weight-decay groups: matrices, then the rest) got a spent generator the second time."""
        return self.optimizer(list(model.parameters()))

    @property
    def blend(self) -> float | None:
        """None: a rank overwrites its replica with each consensus; under cpu-async, the EASGD alpha
        scaling the correction it adds (it trained on while the round was in flight): `easgd_alpha`,
        or its default for the run's outer step."""
        if self.mode != "cpu-async":
            return None
        if self.easgd_alpha is not None:
            return self.easgd_alpha
        return DEFAULT_EASGD_ALPHA if self.outer_config() is None else OUTER_EASGD_ALPHA

    @property
    def wire(self) -> WireFormat:
        """The run's wire format, `wire_dtype` as the object every process hands downstream
        (flodl_zmq/wire_format.py): the rank's buffers, the kept consensus, the reducer."""
        return named(self.wire_dtype)

    def check_settings(self, settings: Settings) -> None:
        """Refuse a job the run's settings contradict: another wire format or aggregation announced to the
        relays (FLODL_WIRE_DTYPE, FLODL_AGGREGATION), int8 under a robust aggregation, or a rank silence the
        ranks' own heartbeat would outlast."""
        if not self.rank_silence_at_coordinator_s > settings.rank_heartbeat_period_s:
            raise ConfigError(
                f"rank_silence_at_coordinator_s ({self.rank_silence_at_coordinator_s:g} s) must exceed the ranks' "
                f"heartbeat period ({settings.rank_heartbeat_period_s:g} s, FLODL_RANK_HEARTBEAT_PERIOD): a rank "
                f"that beats on time would be declared dead; raise it (the default is "
                f"{RANK_SILENCE_AT_COORDINATOR_S:g} s)"
            )
        if self.aggregation is not None and self.aggregation != settings.aggregation:
            raise ConfigError(
                f"Trainer(aggregation={self.aggregation!r}) but the run's aggregation setting is "
                f"{settings.aggregation!r}: the relays read the setting, so set FLODL_AGGREGATION (or the controller's "
                f"--aggregation) to {self.aggregation!r} too, or drop the keyword"
            )
        if settings.aggregation != "mean" and self.wire.packed:
            raise ConfigError(
                f"aggregation={settings.aggregation!r} with wire_dtype={self.wire_dtype!r}: a robust aggregation needs "
                f"each rank's deposit as sent, and int8 error feedback is kept per sender; use f32 or bf16"
            )
        announced = settings.wire
        if announced is not None and announced is not self.wire:
            raise ConfigError(
                f"Trainer(wire_dtype={self.wire_dtype!r}) but the run's environment announces "
                f"FLODL_WIRE_DTYPE={announced.name} to its relays: every process of a run uses one wire_dtype; "
                f"set both to the same value (or unset FLODL_WIRE_DTYPE)"
            )

    @property
    def total_samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def outer_config(self) -> OuterConfig | None:
        """The outer step the controller takes on each consensus, or None for plain averaging."""
        return OuterConfig.of(self.outer, self.outer_lr, self.outer_momentum)

    def max_failure(self) -> MaxFailure | None:
        """`max_failures` as the coordinator's threshold: a count, a fraction of the world, or None."""
        m = self.max_failures
        if m is None:
            return None
        if isinstance(m, int) and not isinstance(m, bool) and m >= 0:
            return MaxFailure.absolute(m)
        match = _PERCENT.match(m) if isinstance(m, str) else None
        if match is None or float(match.group(1)) > 100.0:
            raise ConfigError(
                f"max_failures must be a count of ranks (an integer >= 0) or a percent of the world "
                f"such as '25%' (0% to 100%), got {m!r}"
            )
        return MaxFailure.percent(float(match.group(1)) / 100.0)


def seed_generators(seed: int, stream: int = 0) -> None:
    """Seed torch's, numpy's and random's global generators: with `seed` for stream 0 (every process's model
    factory, a lone run's training), with a seed derived from both for another stream (a rank's own
    randomness once its replica is built: dropout masks and augmentations differ from rank to rank, as a
    DistributedDataParallel script that seeds each rank with its rank gets)."""
    if stream:
        seed = int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def coordinator_config(job: Job) -> CoordinatorConfig:
    """The coordinator's configuration for `job`; its checks name the setting (`Trainer()` runs them)."""
    has_eval = job.eval_fn is not None
    optional = {
        name: getattr(job, name)
        for name in ("anchor", "max_anchor", "overhead_target", "guard", "msf_thresholds")
        if getattr(job, name) is not None
    }
    return CoordinatorConfig(
        total_samples=job.total_samples,
        batch_size=job.batch_size,
        num_epochs=job.epochs,
        mode=MODES[job.mode],
        seed=job.seed,
        eval_every=job.eval_every if has_eval else 0,
        eval_every_samples=job.eval_every_samples if has_eval else 0,
        checkpoint_every=job.checkpoint_every if job.checkpoint_fn is not None else 0,
        final_eval=has_eval,
        rank_silence_at_coordinator_s=job.rank_silence_at_coordinator_s,
        max_failure=job.max_failure(),
        callback_rank=None if job.callback_rank == "fastest" else job.callback_rank,
        max_batch_diff=job.max_batch_diff,
        relax_up=job.relax_up,
        reports_per_epoch=job.reports_per_epoch,
        partition_ratios=job.partition_ratios,
        divergence_threshold=job.divergence_threshold,
        **optional,
    )


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
