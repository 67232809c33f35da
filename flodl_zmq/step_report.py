"""Step timings coalesced into `Batch` records: when a rank's steps are reported.

A pure core: no socket, thread or clock; the time comes in as an argument.

Rules this module keeps:

- Steps go out together at least every `period_s`, and at once on `take()`:
  before any other record of the rank and before it stops stepping.
- `reported` is the step count of the last report taken: a heartbeat never
  announces steps whose timings have not gone out.
"""

from __future__ import annotations

from flodl_zmq.wire import records as rec


class StepReport:
    """The steps not yet reported, coalesced into one `Batch` record (training thread only).

    One record per step (a wake-up of the I/O thread, encode and MAC, the
    relay's and the controller's decode) cost a small model's rank about as
    much as its step. Steps now go out together at least every `period_s`,
    and at once before any other record of the rank and before it stops
    stepping (a chunk done, a deposit, a throttle: the edges of a window), so
    the coordinator's gate and ElChe see the same steps in the same order.
    """

    def __init__(self, rank: int, period_s: float) -> None:
        self.rank = rank
        self.period_s = period_s
        self.reported = 0  # the step count of the last report taken
        self._step_count = 0
        self._batch_ms: list[float] = []
        self._data_ms: list[float] = []
        self._loss: list[float] = []
        self._opened = 0.0

    def add(self, batch_ms: float, data_ms: float, loss: float, step_count: int, now: float) -> rec.Batch | None:
        """Note one step; returns the report when it is due."""
        if not self._batch_ms:
            self._opened = now
        self._batch_ms.append(batch_ms)
        self._data_ms.append(data_ms)
        self._loss.append(loss)
        self._step_count = step_count
        return self.take() if now - self._opened >= self.period_s else None

    def take(self) -> rec.Batch | None:
        """The pending steps as one record (None when there are none)."""
        if not self._batch_ms:
            return None
        report = rec.Batch(rank=self.rank, step_count=self._step_count, batch_ms=self._batch_ms,
                           data_ms=self._data_ms, batch_loss=self._loss)
        self._batch_ms, self._data_ms, self._loss = [], [], []
        self.reported = self._step_count
        return report


__all__ = ["StepReport"]
