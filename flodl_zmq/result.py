"""What a run produced, and how each epoch is reported: the same on the controller and alone."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainResult:
    """What a run produced (on the controller, or a single process)."""

    model: torch.nn.Module
    epochs: list[dict[str, Any]] = field(default_factory=list)
    # Every eval in the order scored: metric, eval_at_s (from training's start), samples the model had
    # trained on, epoch (the one it ended, or the one in progress when within_epoch). Time to target is read here.
    evals: list[dict[str, Any]] = field(default_factory=list)
    final_eval: float | None = None
    batch_share: list[float] = field(default_factory=list)
    saved: str | None = None
    wall_s: float = 0.0
    round_ms: list[float] = field(default_factory=list)  # trigger -> consensus published, per round
    reason: str = "completed"
    resumed_from: str | None = None  # the bundle or checkpoint this run continued
    incarnation: int = 1  # 1 + the restarts before it (a restarted controller resumes a checkpoint)
    # Each re-formed world (hosts joined mid-run): epoch it starts at, checkpoint, world before and after.
    world_changes: list[dict[str, Any]] = field(default_factory=list)


def epoch_row(epoch: int, avg_loss: float, epoch_ms: float, batch_share: list[float], throughput: list[float],
              scalars: dict[str, float], *, per_rank_samples: list[int], round: int, reconnects: int) -> dict[str, Any]:
    """One row of `TrainResult.epochs` (what `format_epoch`, `metrics_fn` and the run report read), or of a part
    of an epoch (`reports_per_epoch`, which adds `fraction`): one shape alone and on a cluster, so that a script
    reading a row's field works in both.

    `per_rank_samples`: the samples each rank trained in the epoch (its sum is
    what `format_epoch` checks for a covered epoch); alone, the one process's.
    `round`: the latest consensus when the row was made (-1 before the first,
    and alone, where no round ever closes). `reconnects`: how often a relay's
    link came back on a new connection in the epoch so far (0 alone: no link).
    """
    return {"epoch": epoch, "avg_loss": avg_loss, "epoch_ms": epoch_ms, "batch_share": batch_share,
            "samples": int(sum(per_rank_samples)), "per_rank_samples": per_rank_samples, "throughput": throughput,
            "scalars": scalars, "round": round, "reconnects": reconnects}


def format_epoch(row: dict[str, Any], epochs: int) -> str:
    """One line per epoch: loss, eval (when there is one), each rank's batch share, wall time, reconnects."""
    head = f"epoch {row['epoch'] + 1}/{epochs}"
    evaluated = f"eval {row['eval']:.4f}" if row.get("eval") is not None and not math.isnan(row["eval"]) else None
    if row.get("samples") == 0:
        # A resumed run's first epoch, fully covered before it stopped: no loss, share or time to show.
        return " | ".join([f"{head}: covered before the resume", *([evaluated] if evaluated else [])])
    parts = [head, f"loss {row['avg_loss']:.4f}"]
    if evaluated:
        parts.append(evaluated)
    share = row.get("batch_share") or []
    if len(share) > 1:
        parts.append("share " + " ".join(f"r{i}:{s * 100:.0f}%" for i, s in enumerate(share)))
    parts.append(f"{row['epoch_ms'] / 1000.0:.2f}s")
    if row.get("reconnects"):  # a link flapped during the epoch: it cost time, not samples
        parts.append(f"{row['reconnects']} reconnect(s)")
    if row.get("world_change"):  # the first epoch of a re-formed world
        parts.append(f"world {row['world_change']}")
    return " | ".join(parts)
