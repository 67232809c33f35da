"""One optimizer step with the job's hooks, and `record_scalar`: the same alone and on a rank.

Rules this module keeps:

- **The schedule follows the global step.** A rank's scheduler sits at the
  cluster's global step (every rank's optimizer steps in the last consensus,
  `SetGlobalStep`) plus its own steps since: a rank with twice the share does
  not run through the schedule twice as fast, and the whole run sees the
  schedule a single process training the same batches would. A torch
  scheduler only steps forward, so the position never moves back; it only
  catches up.
- **grad_accumulation splits a batch, not the window.** A batch runs as n
  micro-batches whose gradients add up to the whole batch's (each loss
  weighted by its share of the samples), then one optimizer step: the
  windows, the global step, the schedule and the averaging mass count the
  same steps as without it, and no snapshot ever falls inside a step.
- **Clip after unscaling.** Under float16 the gradients carry the
  GradScaler's factor; clipping them scaled would clip nothing.
- **float16 needs a GradScaler, bfloat16 does not**: f16 gradients underflow
  (5 exponent bits), bf16 has f32's range. f16 autocast is CUDA only here.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import itertools
import math
import numbers
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flodl_zmq.errors import ConfigError
from flodl_zmq.job import Job


@dataclass
class ScalarLog:
    """`record_scalar` values since the last `take`: (sum, count) per name."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, value: float) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + value
        self.counts[name] = self.counts.get(name, 0) + 1

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        """The sums and counts so far; the log starts empty again."""
        out = (self.sums, self.counts)
        self.sums, self.counts = {}, {}
        return out


_SCALARS: contextvars.ContextVar[ScalarLog | None] = contextvars.ContextVar("flodl_scalars", default=None)


def record_scalar(name: str, value: float | torch.Tensor) -> None:
    """Record a named value for this epoch (from `train_step` or a callback, on any rank).

    Each epoch reports the mean of a name's values on each rank, and across
    ranks the batch-weighted mean of those means (floDl's rule), in the epoch
    row `metrics_fn` receives (`row["scalars"]`). Outside a run it does nothing.
    """
    v = float(value) if isinstance(value, bool) else one_number(value)
    if v is None:  # float() of it raised a ValueError naming neither the call nor the name
        raise ConfigError(f"record_scalar({name!r}, ...): the value must be one number (a float, or a one-element "
                          f"tensor or array), got {type(value).__name__}; record a tensor's mean, e.g. t.mean()")
    log = _SCALARS.get()
    if log is None:
        return
    if not math.isfinite(v):
        return  # one NaN would poison the epoch's mean, as a non-finite loss would
    log.add(str(name), v)


@contextlib.contextmanager
def recording(log: ScalarLog) -> Iterator[ScalarLog]:
    """Within the block, `record_scalar` adds to `log`."""
    token = _SCALARS.set(log)
    try:
        yield log
    finally:
        _SCALARS.reset(token)


class Stepper:
    """The job's training step on one replica: autocast, accumulation, clipping, step, schedule."""

    def __init__(self, job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        self.job = job
        self.model = model
        self.optimizer = optimizer
        self.device = device
        if job.autocast is torch.float16 and device.type != "cuda":
            raise ConfigError(
                f"autocast=torch.float16 needs a CUDA device (this replica runs on {device.type}): "
                "use torch.bfloat16 on CPU"
            )
        if _needs_closure(optimizer):
            raise ConfigError(
                f"optimizer {type(optimizer).__name__} needs a closure in step() (as LBFGS does): the framework steps "
                "once per batch with step(), after train_step's backward; use a first-order optimizer (SGD, Adam, ...)"
            )
        self.scaler = torch.amp.GradScaler(device.type) if job.autocast is torch.float16 else None
        self.scheduler = job.scheduler(optimizer) if job.scheduler is not None else None
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "scheduler ReduceLROnPlateau needs a metric in step(metric), and the scheduler is stepped once per "
                "global step without one: use a step-based scheduler (StepLR, CosineAnnealingLR, LambdaLR), or lower "
                "the learning rate from epoch_fn"
            )
        self.position = 0  # the global step the scheduler is at
        self._reported_lr: float | None = None

    def follow(self, global_step: int) -> float | None:
        """Advance the schedule to `global_step`; returns the learning rate when it changed."""
        if self.scheduler is not None and global_step > self.position:
            with warnings.catch_warnings():
                # A rank that joins late starts mid-schedule, before its first optimizer step.
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                for _ in range(global_step - self.position):
                    self.scheduler.step()
            self.position = global_step
        lr = float(self.optimizer.param_groups[0]["lr"])
        if lr == self._reported_lr:
            return None
        self._reported_lr = lr
        return lr

    def step(self, batch: Any) -> float:
        """One optimizer step on `batch`; returns its loss (the mean over its micro-batches)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        pieces = split_batch(batch, self.job.grad_accumulation)
        total = sum(n for _, n in pieces)
        loss_value = 0.0
        for piece, n in pieces:
            with self._autocast():
                loss = self.job.train_step(self.model, piece)
            check_loss(loss)
            weighted = loss * (n / total) if len(pieces) > 1 else loss
            try:
                (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
            except RuntimeError as exc:  # torch's own words name no cause a train_step's author would see
                if "backward through the graph a second time" not in str(exc):
                    raise
                raise ConfigError(
                    "train_step called backward() on its loss, and the framework runs it again (it calls zero_grad, "
                    "backward and step around train_step): return the loss without calling backward; clip "
                    "gradients with max_grad_norm=..., or write the step yourself in a Session loop (docs/guide.md)"
                ) from exc
            loss_value += float(weighted.detach())
        if self.job.max_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.job.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return loss_value

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.job.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.job.autocast)


def score(job: Job, model: torch.nn.Module) -> float:
    """`job.eval_fn` on `model` in eval mode without gradients, the model left in the mode it was in;
    the metric must be one number, since the controller compares, logs and plots it as one."""
    assert job.eval_fn is not None
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            metric = job.eval_fn(model, job.eval_dataset)
    finally:
        model.train(training)
    value = one_number(metric)
    if value is not None:
        return value
    raise TypeError(
        f"eval_fn returned {type(metric).__name__} {metric!r:.80}: it must return one number (a float or a "
        "one-element tensor), such as the accuracy; return one metric and record others with fz.record_scalar"
    )


def check_loss(loss: Any) -> None:
    """Refuse what `train_step` returned unless backward() can step from it: one element, in autograd's graph."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"train_step returned {what}: it must return the batch's loss as a one-element tensor "
                          "(e.g. F.cross_entropy(model(x), y), or loss.mean() over per-sample losses; a float or "
                          ".item() has no gradient)")
    if not loss.requires_grad:
        raise ConfigError("train_step returned a loss that does not require grad: it was computed under "
                          "torch.no_grad(), detached, or from no trainable parameter, so backward() has nothing "
                          "to step")


def one_number(value: Any) -> float | None:
    """`value` as a float when it is one number (a real, numpy's scalars too, or a one-element tensor or
    array), else None: an eval's metric and a Session's loss are each logged, compared and plotted as one."""
    if isinstance(value, torch.Tensor | np.ndarray) and math.prod(value.shape) == 1:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` has a required argument (LBFGS's closure): it cannot be called as step()."""
    try:
        parameters = inspect.signature(optimizer.step).parameters.values()
    except (TypeError, ValueError):
        return False  # no signature to read (a C extension): let step() speak for itself
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def split_batch(batch: Any, parts: int) -> list[tuple[Any, int]]:
    """`batch` as up to `parts` micro-batches with their sample counts: tensors are split along
    dim 0 (inside tuples, lists and dicts); other leaves go whole to every micro-batch."""
    size = _batch_len(batch)
    if parts <= 1 or size is None or size < 2:
        return [(batch, size or 1)]
    bounds = [round(i * size / min(parts, size)) for i in range(min(parts, size) + 1)]
    return [(_slice(batch, a, b), b - a) for a, b in itertools.pairwise(bounds)]


def _batch_len(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        n = _batch_len(item)
        if n is not None:
            return n
    return None


def _slice(batch: Any, a: int, b: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[a:b] if batch.dim() > 0 else batch
    if isinstance(batch, dict):
        return {k: _slice(v, a, b) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_slice(v, a, b) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(v, a, b) for v in batch)
    return batch
