"""The job both interop ranks train and the controller runs: tests/interop/test_spec_rank.py."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

SAMPLES, BATCH, EPOCHS = 48, 4, 2


def dataset() -> TensorDataset:
    """Sample i is ([2i, 2i + 1], 0, i): its id travels with it, so a rank can log what it trained."""
    return TensorDataset(torch.arange(2.0 * SAMPLES).reshape(SAMPLES, 2), torch.zeros(SAMPLES, 1),
                         torch.arange(SAMPLES))


def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return ((model(batch[0]) - batch[1]) ** 2).mean()


def job(step=loss, mode: str = "cpu-cadence", lr: float = 0.0) -> dict[str, Any]:
    """Trainer keywords; with lr 0 (test_spec_rank.py) our rank deposits exactly the model it holds."""
    return dict(model=lambda: torch.nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                train_step=step, dataset=dataset(), batch_size=BATCH, epochs=EPOCHS, quiet=True, mode=mode,
                eval_dataset=dataset(), eval_fn=mean_param, checkpoint_fn=lambda version, model: None,
                checkpoint_every=1, epoch_fn=lambda epoch, model: None)


def mean_param(model: torch.nn.Module, _dataset: Any) -> float:
    """The evaluation both kinds of rank compute alike: the mean of the flat model."""
    return float(torch.cat([p.detach().flatten() for p in model.parameters()]).mean())
