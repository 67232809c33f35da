"""The window ledger: per-rank steps, timings and loss between two reduces.

Every ``Batch`` record a rank sends lands here: one step, its compute time
(``batch_ms``) and its delivered cost (``batch_ms + data_ms``, i.e. including
waiting for data). At the reduce the ledger turns the window into a
:class:`WindowReport`, the only input ElChe calibrates from.

Rules this module keeps:

* **Two scales, never mixed in one window.** The *delivered* scale (marginal
  cost of batches 2..n: what a rank really sustains, data starvation
  included) is fed only when the policy allows it *and every live rank that
  stepped* has a delivered sample (at least two steps). Otherwise every rank
  feeds the compute scale for that window. Why: mixing compute-only ms for one
  rank with delivered ms for another once made a data-starved GPU look fast;
  it was handed most of the steps and the run diverged to NaN.
* **The first batch is fill, not rate.** Its delivered cost minus the marginal
  rate is the window's fill excess (pipeline refill after a sync), which
  ElChe counts as fixed overhead rather than per-batch cost.
* **Callback time is not training time.** Eval, checkpoint and epoch_fn wall
  time is subtracted (clamped at 0) from the rank's compute and delivered
  accumulators, so a rank that spent 2 s checkpointing does not look slow.
* **These steps count Batch records, not the gate's steps.** They pair each
  rank's milliseconds with the batches that took them; the averaging gate
  counts each rank's own ``step_count`` instead, so a lost ``Batch`` cannot
  wedge it. Steps, timing, fill and loss all reset at each finished reduce; a
  round the reducer tears down leaves them to accumulate into the next window.
* An out-of-range rank is ignored, never raised: a straggler record must not
  crash the coordinator tick (the codec already rejects malformed ranks).

How it is used: ``WindowFeedback`` (feedback.py) owns the ledger. The
coordinator calls ``record_batch`` for every Batch record and
``absorb_callback_cost`` for every EvalResult / CheckpointResult /
EpochFnElapsed; at each finished reduce ``WindowFeedback.close`` calls
``report(live, delivered_feed, sync_ms)`` → ``ElChe.report_window``, then
``reset_steps`` and ``reset_timing``. The other queries (``steps``,
``cohort_step_stats``, ``mean_loss``) serve tests and logs; the guard's
``k_used`` / ``k_max`` come from the coordinator's step snapshot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flodl_zmq.errors import CoordinatorError

__all__ = ["WindowLedger", "WindowReport"]


@dataclass(frozen=True)
class WindowReport:
    """One reduce window's timing, as ElChe consumes it (one entry per rank).

    ``wall_ms``/``steps`` are the compute scale, ``delivered_ms``/
    ``delivered_batches`` the marginal delivered scale; ``delivered_coherent``
    says which one this window feeds (see :meth:`feed`). ``fill_ms`` is each
    rank's first-batch excess, ``sync_ms`` the duration of the sync that
    closed the *previous* window (the one a window must amortize; it is only
    known one cycle late).
    """

    wall_ms: tuple[float, ...]
    steps: tuple[int, ...]
    delivered_ms: tuple[float, ...]
    delivered_batches: tuple[int, ...]
    fill_ms: tuple[float, ...]
    delivered_coherent: bool
    sync_ms: float

    def __post_init__(self) -> None:
        n = len(self.wall_ms)
        for name in ("steps", "delivered_ms", "delivered_batches", "fill_ms"):
            if len(getattr(self, name)) != n:
                raise CoordinatorError(
                    f"WindowReport.{name} has {len(getattr(self, name))} entries but wall_ms "
                    f"has {n}; every per-rank field needs one entry per rank"
                )

    @property
    def world_size(self) -> int:
        return len(self.wall_ms)

    def feed(self) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """The (ms, batches) pairs ElChe calibrates from: all delivered, or all compute."""
        if self.delivered_coherent:
            return self.delivered_ms, self.delivered_batches
        return self.wall_ms, self.steps


class WindowLedger:
    """Per-rank accumulators for the current reduce window (see module docstring)."""

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise CoordinatorError(f"WindowLedger world_size = {world_size}: must be >= 1")
        self.world_size = world_size
        self._steps = [0] * world_size
        self._reset_timing()

    def _reset_timing(self) -> None:
        w = self.world_size
        self._compute_ms = [0.0] * w
        self._first_ms: list[float | None] = [None] * w
        self._delivered_ms = [0.0] * w
        self._delivered_batches = [0] * w
        self._loss_sum = 0.0
        self._loss_count = 0

    def _valid(self, rank: int) -> bool:
        return 0 <= rank < self.world_size

    # -- inputs ------------------------------------------------------------

    def record_batch(
        self, rank: int, batch_ms: float, data_ms: float, loss: float | None = None
    ) -> None:
        """One Batch record: a step, its compute time, its delivered cost, its loss."""
        if not self._valid(rank):
            return
        self._steps[rank] += 1
        self._compute_ms[rank] += batch_ms
        delivered = batch_ms + data_ms
        if self._first_ms[rank] is None:
            # The first batch after a sync carries pipeline refill; keep it
            # out of the marginal rate and report its excess as fill.
            self._first_ms[rank] = delivered
        else:
            self._delivered_ms[rank] += delivered
            self._delivered_batches[rank] += 1
        # One NaN loss must not turn the whole window's mean into NaN.
        if loss is not None and math.isfinite(loss):
            self._loss_sum += loss
            self._loss_count += 1

    def absorb_callback_cost(self, rank: int, elapsed_ms: float) -> None:
        """Remove a callback's wall time from the rank's window (clamped at 0)."""
        if not self._valid(rank) or not math.isfinite(elapsed_ms) or elapsed_ms <= 0.0:
            return
        self._compute_ms[rank] = max(0.0, self._compute_ms[rank] - elapsed_ms)
        self._delivered_ms[rank] = max(0.0, self._delivered_ms[rank] - elapsed_ms)

    def reset_steps(self) -> None:
        """Zero the window's Batch counts (at each finished reduce, with ``reset_timing``)."""
        self._steps = [0] * self.world_size

    def reset_timing(self) -> None:
        """Zero compute, delivered, fill and loss accumulators (end of every reduce)."""
        self._reset_timing()

    # -- queries -----------------------------------------------------------

    def steps(self, rank: int) -> int:
        return self._steps[rank] if self._valid(rank) else 0

    @property
    def window_steps(self) -> tuple[int, ...]:
        return tuple(self._steps)

    def compute_ms(self, rank: int) -> float:
        return self._compute_ms[rank] if self._valid(rank) else 0.0

    def delivered(self, rank: int) -> tuple[float, int]:
        """(marginal delivered ms, marginal batches) for one rank."""
        if not self._valid(rank):
            return 0.0, 0
        return self._delivered_ms[rank], self._delivered_batches[rank]

    def fill_excess(self, rank: int) -> float:
        """First-batch delivered cost above the marginal rate; 0 without a marginal sample."""
        if not self._valid(rank):
            return 0.0
        first, n = self._first_ms[rank], self._delivered_batches[rank]
        if first is None or n == 0:
            return 0.0
        return max(0.0, first - self._delivered_ms[rank] / n)

    def mean_loss(self) -> float | None:
        """Mean finite loss over every batch of the window; None before the first."""
        return self._loss_sum / self._loss_count if self._loss_count else None

    def cohort_step_stats(self, live: Sequence[bool] | None = None) -> tuple[int, int]:
        """(k_used, k_max): total and largest per-rank steps over live ranks."""
        steps = [s for r, s in enumerate(self._steps) if live is None or live[r]]
        return sum(steps), max(steps, default=0)

    def movers_delivered_complete(self, live: Sequence[bool]) -> bool:
        """Every live rank that stepped has a delivered sample (idle and dead ranks don't count)."""
        self._check_live(live)
        return all(
            self._delivered_batches[r] >= 1
            for r in range(self.world_size)
            if live[r] and self._steps[r] > 0
        )

    def report(self, live: Sequence[bool], delivered_feed: bool, sync_ms: float) -> WindowReport:
        """Build the window's report; ``delivered_feed`` is whether the policy allows that scale.

        Dead ranks report zeros: their half-window must not drive the schedule
        (ElChe counts the miss and forgets them after a few).
        """
        self._check_live(live)
        w = range(self.world_size)
        return WindowReport(
            wall_ms=tuple(self._compute_ms[r] if live[r] else 0.0 for r in w),
            steps=tuple(self._steps[r] if live[r] else 0 for r in w),
            delivered_ms=tuple(self._delivered_ms[r] if live[r] else 0.0 for r in w),
            delivered_batches=tuple(self._delivered_batches[r] if live[r] else 0 for r in w),
            fill_ms=tuple(self.fill_excess(r) if live[r] else 0.0 for r in w),
            delivered_coherent=delivered_feed and self.movers_delivered_complete(live),
            sync_ms=sync_ms,
        )

    def _check_live(self, live: Sequence[bool]) -> None:
        if len(live) != self.world_size:
            raise CoordinatorError(
                f"live mask has {len(live)} entries for a world of {self.world_size}; "
                "pass one flag per rank"
            )
