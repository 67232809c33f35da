"""The packaged digits dataset and dataset signatures."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from flodl_zmq.datasets import SIGNATURE_BYTES, dataset_signature, digits


def test_digits_split_is_deterministic_and_complete():
    train, test = digits()
    train2, test2 = digits()
    assert len(train) + len(test) == 1797
    assert len(test) == round(1797 * 0.2)
    assert torch.equal(train.tensors[0], train2.tensors[0])
    assert torch.equal(test.tensors[1], test2.tensors[1])
    x, y = train[0]
    assert x.shape == (64,) and x.dtype == torch.float32 and 0.0 <= float(x.max()) <= 1.0
    assert y.dtype == torch.int64 and set(train.tensors[1].tolist()) == set(range(10))


def test_signature_is_stable_and_32_bytes():
    train, _ = digits()
    assert len(dataset_signature(train)) == SIGNATURE_BYTES
    assert dataset_signature(train) == dataset_signature(digits()[0])


def test_signature_differs_for_other_data_or_length():
    train, test = digits()
    assert dataset_signature(train) != dataset_signature(test)
    x, y = train.tensors
    shifted = TensorDataset(x.clone(), y.clone())
    shifted.tensors[0][0, 0] += 1.0
    assert dataset_signature(shifted) != dataset_signature(train)
    assert dataset_signature(TensorDataset(x[:-1], y[:-1])) != dataset_signature(train)
