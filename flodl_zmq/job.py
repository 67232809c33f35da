"""The training job: what the user's script defines, identical in every process.

Rules this module keeps:

- One validated object. Every role (controller, relay, rank) builds the same
  `Job` from the same script, so a value is checked once, here, with a
  message naming the setting and its allowed range.
- Callables are factories or plain functions; nothing here starts a thread or
  touches a device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from flodl_zmq.errors import ConfigError

MODES = ("cpu-sync", "cpu-cadence", "cpu-async")
CALLBACK_ERRORS = ("report", "stop")


@dataclass(frozen=True)
class Job:
    """The run as every process sees it (see `flodl_zmq.api.Trainer` for the meaning of each field)."""

    model: Callable[[], torch.nn.Module]
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    train_step: Callable[[torch.nn.Module, Any], torch.Tensor]
    dataset: Dataset
    batch_size: int
    epochs: int
    mode: str = "cpu-cadence"
    eval_dataset: Dataset | None = None
    eval_fn: Callable[[torch.nn.Module, Dataset], float] | None = None
    eval_every: int = 1
    checkpoint_fn: Callable[[int, torch.nn.Module], None] | None = None
    checkpoint_every: int = 0
    epoch_fn: Callable[[int, torch.nn.Module], None] | None = None
    metrics_fn: Callable[[dict[str, Any]], None] | None = None
    on_callback_error: str = "report"
    save_path: str | None = None
    resume_from: str | None = None
    seed: int = 42
    easgd_alpha: float = 0.5
    torch_threads: int = 1
    quiet: bool = False

    def __post_init__(self) -> None:
        for name in ("model", "optimizer", "train_step"):
            if not callable(getattr(self, name)):
                raise ConfigError(f"{name} must be callable (a factory or a function), got {getattr(self, name)!r}")
        if self.dataset is None or not hasattr(self.dataset, "__len__") or not hasattr(self.dataset, "__getitem__"):
            raise ConfigError("dataset is required and must be a map-style torch Dataset (with __len__ and __getitem__)")
        if len(self.dataset) == 0:  # type: ignore[arg-type]
            raise ConfigError("dataset is empty: there is nothing to train on")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1, got {self.epochs}")
        if self.mode not in MODES:
            raise ConfigError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if (self.eval_fn is None) != (self.eval_dataset is None):
            raise ConfigError("eval_fn and eval_dataset go together: give both or neither")
        if self.eval_every < 0 or self.checkpoint_every < 0:
            raise ConfigError("eval_every and checkpoint_every must be >= 0 (0 turns the callback off)")
        if self.on_callback_error not in CALLBACK_ERRORS:
            raise ConfigError(f"on_callback_error must be one of {CALLBACK_ERRORS}, got {self.on_callback_error!r}")
        if not 0.0 < self.easgd_alpha <= 1.0:
            raise ConfigError(f"easgd_alpha must be in (0, 1], got {self.easgd_alpha}")
        if self.torch_threads < 1:
            raise ConfigError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")

    @property
    def total_samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]
