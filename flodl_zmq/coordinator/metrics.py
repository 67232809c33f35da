"""Per-epoch metrics aggregation: many `EpochMetrics` reports in, one `EpochAggregated` out.

Ranks report once per epoch under Sync and once per chunk under the
progressive modes; this module does not care which: it sums whatever an epoch
received.

Rules this module keeps:

- **Loss is batch-weighted**: `avg_loss = sum(loss * batches) / sum(batches)`,
  so a rank that trained two batches does not weigh as much as one that
  trained two hundred. A rank with no batches has loss None, never 0.
- **A non-finite loss never poisons the epoch**: such a report still counts
  its batches and samples, but not its loss.
- **Batch share is realized work** (each rank's batches over the epoch's
  total), not the schedule: it is what the operator needs to see whether the
  balancer delivered. (floDl reports ElChe's schedule here; we changed it
  because the schedule hides a rank that was starved.)
- **Throughput** is samples per millisecond of the rank's own chunk time;
  the epoch's wall time is the slowest rank's, unless the caller knows the
  pool's wall clock (progressive modes) and passes it.
- **Scalars**: per rank mean = sum / count; cohort value = batch-weighted mean
  of the rank means.
- **Progress slices only grow** (`reports_per_epoch`): an epoch's n-th slice
  is reported once, when its batches cross it; the last is the epoch's own
  record, never a slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from flodl_zmq.coordinator.outputs import EpochProgress
from flodl_zmq.wire.records import EpochAggregated, EpochMetrics


def aggregate_epoch(
    epoch: int,
    reports: Iterable[EpochMetrics],
    world_size: int,
    wall_ms: float | None = None,
) -> EpochAggregated:
    """Fold one epoch's reports (any number per rank) into the record broadcast to ranks."""
    batches = [0] * world_size
    samples = [0] * world_size
    loss_sum = [0.0] * world_size
    loss_batches = [0] * world_size
    ms = [0.0] * world_size
    scalar_sum: list[dict[str, float]] = [{} for _ in range(world_size)]
    scalar_cnt: list[dict[str, int]] = [{} for _ in range(world_size)]
    for m in reports:
        r = m.rank
        batches[r] += m.batches_processed
        samples[r] += m.samples_processed
        ms[r] += m.epoch_ms
        if math.isfinite(m.avg_loss) and m.batches_processed > 0:
            loss_sum[r] += m.avg_loss * m.batches_processed
            loss_batches[r] += m.batches_processed
        for k, v in m.scalar_sums.items():
            scalar_sum[r][k] = scalar_sum[r].get(k, 0.0) + v
            scalar_cnt[r][k] = scalar_cnt[r].get(k, 0) + m.scalar_counts.get(k, 0)

    total_batches = sum(batches)
    total_loss_batches = sum(loss_batches)
    avg_loss = sum(loss_sum) / total_loss_batches if total_loss_batches else math.nan
    per_rank_loss = [
        loss_sum[r] / loss_batches[r] if loss_batches[r] else None for r in range(world_size)
    ]
    throughput = [samples[r] / ms[r] if ms[r] > 0 else 0.0 for r in range(world_size)]
    share = [
        b / total_batches if total_batches else 1.0 / world_size for b in batches
    ]
    return EpochAggregated(
        epoch=epoch,
        avg_loss=avg_loss,
        epoch_ms=wall_ms if wall_ms is not None else max(ms, default=0.0),
        per_rank_throughput=throughput,
        per_rank_batch_share=share,
        per_rank_loss=per_rank_loss,
        per_rank_samples=samples,
        scalars=_cohort_scalars(scalar_sum, scalar_cnt, batches),
    )


def _cohort_scalars(
    sums: list[dict[str, float]], counts: list[dict[str, int]], batches: list[int]
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in sorted({k for d in sums for k in d}):
        num = den = 0.0
        for r, d in enumerate(sums):
            c = counts[r].get(name, 0)
            if name in d and c > 0:
                weight = batches[r] if batches[r] > 0 else 1
                num += weight * d[name] / c
                den += weight
        if den > 0:
            out[name] = num / den
    return out


class EpochReports:
    """Each open epoch's `EpochMetrics` until it is aggregated, and the progress slices reported."""

    def __init__(self, world_size: int, reports_per_epoch: int, batches_per_epoch: int) -> None:
        self.world_size = world_size
        self.reports_per_epoch = reports_per_epoch
        self.batches_per_epoch = batches_per_epoch
        self._reports: dict[int, list[EpochMetrics]] = {}
        self._progress: dict[int, int] = {}  # epoch -> EpochProgress slices emitted

    def add(self, m: EpochMetrics, last_aggregated: int) -> EpochProgress | None:
        """Keep `m`; the `EpochProgress` it completes, if it crosses one n-th of the epoch's batches."""
        reports = self._reports.setdefault(m.epoch, [])
        reports.append(m)
        n = self.reports_per_epoch
        if n < 2 or m.epoch <= last_aggregated:
            return None
        done = sum(x.batches_processed for x in reports)
        k = min(done * n // max(self.batches_per_epoch, 1), n - 1)  # the n-th is the epoch record
        if k <= self._progress.get(m.epoch, 0):
            return None
        self._progress[m.epoch] = k
        return EpochProgress(m.epoch, k / n, aggregate_epoch(m.epoch, reports, self.world_size))

    def credit(self, m: EpochMetrics) -> None:
        """Keep `m`, the coordinator's report of what a consensus holds of a chunk its rank left unfinished."""
        self._reports.setdefault(m.epoch, []).append(m)

    def withdraw(self, m: EpochMetrics) -> None:
        """Forget report `m`: its chunk is redone (its rank left before any consensus held it)."""
        reports = self._reports.get(m.epoch, [])
        reports[:] = [r for r in reports if r is not m]

    def close(self, epoch: int, wall_ms: float | None) -> EpochAggregated:
        """The epoch's record, from every report it received; the epoch is forgotten."""
        self._progress.pop(epoch, None)
        return aggregate_epoch(epoch, self._reports.pop(epoch, []), self.world_size, wall_ms)

