"""The data order: one reproducible permutation per epoch, and plans as spans of it."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_zmq.errors import ConfigError, TrainingError
from flodl_zmq.sampling import epoch_permutation, plan_indices
from flodl_zmq.wire.records import EpochPlan


def test_permutation_is_pinned_to_pcg64_raw_stream():
    # A test vector: another host (or another implementation) must draw exactly this.
    assert epoch_permutation(42, 0, 10).tolist() == [4, 8, 1, 9, 3, 6, 0, 7, 2, 5]
    assert epoch_permutation(42, 1, 10).tolist() == [2, 1, 5, 7, 8, 9, 4, 0, 6, 3]


def test_permutation_depends_only_on_seed_plus_epoch():
    assert np.array_equal(epoch_permutation(41, 1, 100), epoch_permutation(42, 0, 100))


@given(st.integers(0, 2**32), st.integers(0, 500), st.integers(0, 300))
def test_permutation_is_a_permutation_and_deterministic(seed, epoch, total):
    perm = epoch_permutation(seed, epoch, total)
    assert perm.dtype == np.int64
    assert sorted(perm.tolist()) == list(range(total))
    assert np.array_equal(perm, epoch_permutation(seed, epoch, total))


def test_epochs_shuffle_differently():
    assert not np.array_equal(epoch_permutation(42, 0, 1000), epoch_permutation(42, 1, 1000))


def test_negative_seed_is_a_config_error():
    with pytest.raises(ConfigError, match="seed"):
        epoch_permutation(-1, 0, 10)


def test_plan_indices_slice_the_permutation():
    perm = epoch_permutation(42, 3, 50)
    assert plan_indices(perm, EpochPlan(3, 10, 5)).tolist() == perm[10:15].tolist()


def test_plan_past_the_dataset_is_a_dataset_mismatch():
    with pytest.raises(TrainingError, match="same dataset length"):
        plan_indices(epoch_permutation(42, 0, 50), EpochPlan(0, 45, 10))
