"""The data order every process agrees on: one permutation per epoch, spans of it by offset.

Rules this module keeps:

- **Only offsets travel.** Epoch `e` trains on one global permutation of
  `range(total_samples)`, drawn from `(seed, e)` alone. The coordinator ships
  spans `[offset, offset + size)` of that permutation (`EpochPlan`); every rank
  recomputes the same permutation locally, so a plan is a few integers however
  large the dataset.
- **The permutation is reproducible across hosts and versions.** It is the
  stable argsort of `total_samples` raw 64-bit draws of numpy's PCG64 bit
  generator seeded with the integer `seed + epoch`. We rely only on the bit
  generator's raw stream and `SeedSequence` seeding, which numpy keeps stable
  across releases (NEP 19); `Generator.permutation` is explicitly *not*
  stream-stable, and two hosts with different numpy versions must still agree.
"""

from __future__ import annotations

import numpy as np

from flodl_zmq.errors import ConfigError, TrainingError
from flodl_zmq.wire.records import EpochPlan

SHUFFLE_BASE_SEED = 42
"""The default shuffle seed (floDl's `SHUFFLE_BASE_SEED`)."""


def epoch_permutation(seed: int, epoch: int, total_samples: int) -> np.ndarray:
    """The permutation of `range(total_samples)` that epoch `epoch` trains on (int64 array).

    Deterministic in `(seed + epoch, total_samples)`: stable argsort of
    `PCG64(seed + epoch).random_raw(total_samples)`. Ranks should compute it
    once per epoch and slice it with `plan_indices`.
    """
    if seed < 0 or epoch < 0:
        raise ConfigError(f"shuffle seed ({seed}) and epoch ({epoch}) must be >= 0")
    if total_samples < 0:
        raise ConfigError(f"total_samples must be >= 0, got {total_samples}")
    keys = np.random.PCG64(seed + epoch).random_raw(total_samples)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def plan_indices(permutation: np.ndarray, plan: EpochPlan) -> np.ndarray:
    """The sample indices of `plan` (a view into `permutation`), in training order."""
    if plan.offset < 0 or plan.size < 0 or plan.offset + plan.size > len(permutation):
        # Only a dataset-size disagreement between the controller and this rank
        # can produce such a plan; training on a clamped slice would silently
        # skip or repeat data.
        raise TrainingError(
            f"plan [{plan.offset}, {plan.offset + plan.size}) of epoch {plan.epoch} does not fit "
            f"a dataset of {len(permutation)} samples: every rank and the controller must see "
            f"the same dataset length"
        )
    return permutation[plan.offset : plan.offset + plan.size]
