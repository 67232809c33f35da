"""Step timings coalesced into `Batch` records, and the learning rate with them: when a rank reports.

A pure core: no socket, thread or clock; the time comes in as an argument.

Rules this module keeps:

- Steps go out together at least every `period_s`, and at once on `take()`:
  before any other record of the rank and before it stops stepping.
- A changed learning rate goes out with the steps, right after their `Batch`:
  only the last rate noted since the previous report. A schedule changes the
  rate every step; one `LrUpdate` a step (a flush, a wake-up of the I/O
  thread, an encode and a MAC each) cost the digits CNN's ranks about a
  sixth of their time (docs/benchmarks.md, "One report a period, the rate
  with it").
- `reported` is the step count of the last report taken: a heartbeat never
  announces steps whose timings have not gone out.
"""

from __future__ import annotations

from flodl_zmq.wire import records as rec

Report = rec.Batch | rec.LrUpdate


class StepReport:
    """The steps not yet reported, coalesced into one `Batch` record, and the rate not yet reported
    (training thread only).

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
        self._lr: float | None = None  # a rate noted since the last report

    def add(self, batch_ms: float, data_ms: float, loss: float, step_count: int, now: float) -> list[Report]:
        """Note one step; returns the records to send now (none until the report is due)."""
        if not self._batch_ms:
            self._opened = now
        self._batch_ms.append(batch_ms)
        self._data_ms.append(data_ms)
        self._loss.append(loss)
        self._step_count = step_count
        return self.take() if now - self._opened >= self.period_s else []

    def note_lr(self, lr: float) -> None:
        """The rate changed: it goes out with the next report (an earlier unsent one is replaced)."""
        self._lr = lr

    def take(self) -> list[Report]:
        """The pending steps as one `Batch`, then the pending rate as one `LrUpdate` (each only if any)."""
        out: list[Report] = []
        if self._batch_ms:
            out.append(rec.Batch(rank=self.rank, step_count=self._step_count, batch_ms=self._batch_ms,
                                 data_ms=self._data_ms, batch_loss=self._loss))
            self._batch_ms, self._data_ms, self._loss = [], [], []
            self.reported = self._step_count
        if self._lr is not None:
            out.append(rec.LrUpdate(rank=self.rank, lr=self._lr))
            self._lr = None
        return out


__all__ = ["StepReport"]
