"""The resume point: what a checkpoint records of the scheduler, written and checked in one place.

`Coordinator.state_dict` writes a `ResumeState` as a JSON-able dict (the
checkpoint meta); a resumed `Coordinator` reads it back with `from_dict`.

Rules this module keeps:

- **As of the last finished consensus.** The epoch, global step, round count
  and coverage describe the consensus that was saved, never work in flight,
  so a resume trains exactly the samples that consensus lacks.
- **A resume must match the run it continues.** The coverage is in sample
  offsets of one permutation, so the seed, the dataset size and the batch
  size must equal this run's; anything else raises `ConfigError` naming the
  key, before any state is adopted. The epoch must lie within this run's
  epochs. The world may have grown (hosts joined at a re-form, PROTOCOL.md
  13.1): ranks numbered past the checkpoint's start cold in ElChe; it may
  never shrink (rank numbers are never reused, so a smaller world is
  another run).
- **Only open epochs' coverage is kept.** Epochs before the saved epoch are
  whole in the consensus; their spans would only be noise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flodl_zmq.coordinator.chunk_pool import Span
from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.elche import ElCheState
from flodl_zmq.errors import ConfigError


@dataclass(frozen=True)
class ResumeState:
    """The scheduler's part of a checkpoint (see the module docstring).

    `epoch` is the first epoch not aggregated in the saved consensus,
    `round` the rounds finished, `coverage` the done spans of open epochs.
    """

    epoch: int
    global_step: int
    round: int
    elche: ElCheState
    coverage: dict[int, list[Span]]

    def to_dict(self, config: CoordinatorConfig, world_size: int) -> dict[str, Any]:
        """The checkpoint meta (JSON-able), with what `from_dict` checks a resume against."""
        return {
            "world_size": world_size,
            "mode": config.mode.value,
            "seed": config.seed,
            "total_samples": config.total_samples,
            "batch_size": config.batch_size,
            "epoch": self.epoch,
            "global_step": self.global_step,
            "round": self.round,
            "elche": self.elche.to_dict(),
            "coverage": {
                str(e): [list(s) for s in spans]
                for e, spans in sorted(self.coverage.items())
                if e >= self.epoch
            },
        }

    @classmethod
    def from_dict(
        cls, state: Mapping[str, Any], config: CoordinatorConfig, world_size: int
    ) -> ResumeState:
        """Read a checkpoint meta back; `ConfigError` if this run and world cannot continue it."""
        saved = state.get("world_size")
        if not isinstance(saved, int) or not 1 <= saved <= world_size:
            raise ConfigError(
                f"resume: the checkpoint has world_size = {saved!r} but this run has {world_size}; a world "
                "may only grow (hosts join with new ranks): resume with at least the checkpoint's ranks"
            )
        for key, want in (
            ("seed", config.seed),
            ("total_samples", config.total_samples),
            ("batch_size", config.batch_size),
        ):
            if state.get(key) != want:
                raise ConfigError(
                    f"resume: the checkpoint has {key} = {state.get(key)!r} but this run has "
                    f"{want!r}; resume with the same {key} (the data coverage depends on it)"
                )
        elche = ElCheState.from_dict(state["elche"]).grown(world_size)
        global_step = int(state["global_step"])
        rounds = int(state["round"])
        epoch = int(state["epoch"])
        if not 0 <= epoch <= config.num_epochs:
            raise ConfigError(
                f"resume: checkpoint epoch {epoch} is outside this run's {config.num_epochs} "
                f"epochs; raise epochs (Trainer(epochs=...)) to continue training"
            )
        coverage = {
            int(e): [(int(o), int(n)) for o, n in spans]
            for e, spans in state.get("coverage", {}).items()
        }
        return cls(epoch, global_step, rounds, elche, coverage)
