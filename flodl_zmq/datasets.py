"""The handwritten-digits dataset shipped with the package, and dataset signatures.

Rules this module keeps:

- The digits (1797 images of 8x8 pixels, values 0..16, ten classes; the UCI
  "Optical Recognition of Handwritten Digits" test set as scikit-learn ships
  it, CC BY 4.0) live in ``flodl_zmq/data/digits.npz``: no scikit-learn and no
  download at run time, so the demo and the tests run offline.
- The train/test split is a pure function of ``test_fraction`` and ``seed``:
  the stable argsort of numpy's PCG64 raw stream (stable across numpy
  releases, see coordinator/dispatch.py), so every rank on every host builds
  the same split.
- ``dataset_signature`` is cheap (length plus at most 16 items) and
  deterministic. It exists to stop a run whose ranks load different data
  before a single step is trained, not to prove two datasets identical.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

SIGNATURE_BYTES = 32
_SAMPLED_ITEMS = 16


def _load_arrays() -> tuple[np.ndarray, np.ndarray]:
    with resources.files("flodl_zmq").joinpath("data/digits.npz").open("rb") as fh:
        data = np.load(fh)
        return data["images"], data["labels"]


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) TensorDatasets of (float32 pixels / 16 in a 64-vector, int64 label)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    images, labels = _load_arrays()
    order = np.argsort(np.random.PCG64(seed).random_raw(len(labels)), kind="stable")
    n_test = int(round(len(labels) * test_fraction))
    x = torch.from_numpy(images.astype(np.float32) / 16.0)
    y = torch.from_numpy(labels.astype(np.int64))
    test_idx = torch.from_numpy(order[:n_test])
    train_idx = torch.from_numpy(order[n_test:])
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[test_idx], y[test_idx])


def _feed(h: Any, item: Any) -> None:
    """Hash one dataset item: tensors and arrays by dtype, shape and bytes; sequences recursively."""
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu().contiguous().numpy()
    if isinstance(item, np.ndarray):
        h.update(f"{item.dtype.str}{item.shape}".encode())
        h.update(np.ascontiguousarray(item).tobytes())
    elif isinstance(item, (tuple, list)):
        h.update(f"seq{len(item)}".encode())
        for part in item:
            _feed(h, part)
    elif isinstance(item, dict):
        for key in sorted(item):
            h.update(repr(key).encode())
            _feed(h, item[key])
    else:
        h.update(repr(item).encode())


def dataset_signature(dataset: Dataset) -> bytes:
    """A 32-byte digest of the dataset's length and of up to 16 evenly spaced items."""
    n = len(dataset)  # type: ignore[arg-type]
    h = hashlib.sha256(f"flodl-dataset-v1:{n}".encode())
    for i in sorted({int(i) for i in np.linspace(0, n - 1, num=min(n, _SAMPLED_ITEMS))} if n else ()):
        _feed(h, dataset[i])
    return h.digest()
