"""Callback roles: which rank runs eval, checkpoint and epoch_fn, and when.

Three sticky roles: the checkpoint role, the eval role and the epoch-callback
role. Policy `Fastest` (`policy_rank=None`) gives them to the live rank with
the lowest smoothed ms/batch; `Rank(n)` pins them to rank n.

Rules this module keeps:

- **Sticky.** A role moves only on the first calibration (Fastest: the
  uncalibrated default, rank 0, is replaced by the real fastest), on the
  death of its holder, or on a checkpoint failure. Callbacks may keep
  per-rank state, so roles must not flap with timing noise.
- **Rank(n) fails over only the checkpoint role** (to the lowest live rank):
  a checkpoint must be written by somebody, whereas eval and epoch_fn stay
  pinned where the user put them.
- **Checkpoint failover.** A failed checkpoint of version v is retried on the
  lowest live rank that has not tried v; when every live rank has tried, v is
  given up (max_failure governs the run's health, not the callback). A
  success clears v's tried set and makes that rank the role.
- **Epoch-role changes are announced.** `epoch_dirty` stays set until the
  coordinator has broadcast `SetEpochCallbackRole`.
- **Callback cost is measured** with an EWMA (alpha 0.3) per callback kind
  (`checkpoint_ms`, `eval_ms`, `epoch_fn_ms`), for the record: no scheduling
  decision reads it yet. (The ledger already keeps callback time out of the
  window's timing.)

Cadence (`EpochCallbacks`): eval and checkpoint fire at the boundary *into*
epoch e (e > 0) when e is a multiple of their cadence; version e means "the
state after epoch e - 1". Each is held until a finished consensus contains
every sample of epoch e - 1, so the rank scores or saves the first consensus
that holds that epoch whole; its target is resolved only then, after any
failover. That consensus need not hold epoch e - 1 alone: under Async the
ranks train on through a round, and epochs shorter than a round's flight end
two or more to one consensus. Rules (`EvalLedger.one_per_consensus`):

- **One eval per consensus.** Of the epochs' evals due on one consensus,
  only the last epoch's is sent; none when that consensus holds every epoch
  (the final eval scores it) or an eval was sent for it already (its epochs
  were found whole only after the round). One model scored twice would read
  as two results, the same number for two epochs.
- **An epoch left out is said so.** The controller hears which epochs have
  no eval of their own and the samples of the consensus that was scored
  (`EvalsMerged`); their rows point there (`eval_merged`) rather than
  repeating a number.
- Checkpoints are not merged: each version is saved, as its cadence asks.

Evals within an epoch (`SampleCadence`, `EvalLedger`; `eval_every_samples`):
the consensus is scored each time it holds another `every` samples, counted
as its steps times the batch size. Rules:

- **Only a finished consensus is scored**, at the round's finish before the
  Updates, so the eval rank scores the consensus it just loaded (a blending
  rank keeps a copy of it).
- **Async scores at the due point.** Its rounds stop no rank, so a due
  point opens one (`awaits_round`), as an epoch's eval does: the score lands
  on about the due point's samples, not a full window later. Cadence and
  Sync hold their ranks at a round, so they score the first round past it.
- **One eval per due consensus**, however many multiples it crossed; an
  epoch's eval of the same consensus counts for the cadence (never two of
  one consensus).
- **None lost, none doubled.** Every eval sent is open until its rank
  answers; a rank that dies with one open hands it (same schedule id) to the
  next finished consensus, scored by the heir. A second answer, or one to a
  request never sent, is not a result.
- **Schedule ids never collide:** an epoch's eval has the epoch's number, the
  final eval `FINAL_EVAL_ID`, the cadence's the numbers after the last epoch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.outputs import CONTROLLER, EvalsMerged, Target
from flodl_zmq.wire import records as rec

EWMA_ALPHA = 0.3

EpochCall = tuple[int | Target, rec.Checkpoint | rec.ExecuteEval | EvalsMerged]
"""An epoch boundary's call and its destination: a rank, or the controller for `EvalsMerged`."""

FINAL_EVAL_ID = rec.MAX_COUNT
"""`ExecuteEval.schedule_id` of the one canonical eval of the final consensus: the largest id a
`Count` holds (PROTOCOL.md 3.3), never an epoch's."""


def is_due(epoch: int, every: int) -> bool:
    """Whether a callback with cadence `every` (0 = off) fires on entering `epoch`."""
    return every > 0 and epoch > 0 and epoch % every == 0


def final_eval(rank: int, num_epochs: int) -> rec.ExecuteEval:
    """The one canonical eval of the final consensus, on `rank` (epoch evals are scheduled by epoch)."""
    return rec.ExecuteEval(
        schedule_id=FINAL_EVAL_ID, epoch=num_epochs, target_rank=rank, adopt_consensus=True
    )


def fastest_live(smoothed_ms: Sequence[float | None], live: Sequence[bool]) -> int | None:
    """The live rank with the lowest smoothed ms/batch; the lowest live rank if none has a sample."""
    timed = [(ms, r) for r, ms in enumerate(smoothed_ms) if live[r] and ms is not None and ms > 0]
    if timed:
        return min(timed)[1]
    return next((r for r, a in enumerate(live) if a), None)


class _Ewma:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - EWMA_ALPHA) * self.value + EWMA_ALPHA * x


class CallbackRoles:
    """The three role holders for a world; see the module docstring."""

    def __init__(self, world_size: int, policy_rank: int | None) -> None:
        self.world_size = world_size
        self.policy_rank = policy_rank
        initial = 0 if policy_rank is None else min(policy_rank, world_size - 1)
        self.checkpoint = initial
        self.eval = initial
        self.epoch = initial
        self.epoch_dirty = True  # announced once before the first dispatch
        self._resolved = False
        self._tried: dict[int, set[int]] = {}
        self.checkpoint_ms = _Ewma()
        self.eval_ms = _Ewma()
        self.epoch_fn_ms = _Ewma()

    @property
    def fastest_policy(self) -> bool:
        return self.policy_rank is None

    def on_calibrated(self, smoothed_ms: Sequence[float | None], live: Sequence[bool]) -> None:
        """First calibration: Fastest roles move from the default to the real fastest rank."""
        if self._resolved:
            return
        self._resolved = True
        if self.fastest_policy:
            self._assign_all(fastest_live(smoothed_ms, live))

    def on_death(self, rank: int, smoothed_ms: Sequence[float | None], live: Sequence[bool]) -> None:
        """`rank` left: re-home the roles it held (Rank(n): the checkpoint role only)."""
        heir = fastest_live(smoothed_ms, live) if self.fastest_policy else _lowest(live)
        if heir is None:
            return
        if self.checkpoint == rank:
            self.checkpoint = heir
        if self.fastest_policy:
            if self.eval == rank:
                self.eval = heir
            if self.epoch == rank:
                self.epoch = heir
                self.epoch_dirty = True

    def checkpoint_failed(self, version: int, rank: int, live: Sequence[bool]) -> int | None:
        """`rank` failed checkpoint `version`: the next rank to try, or None (given up)."""
        tried = self._tried.setdefault(version, set())
        tried.add(rank)
        nxt = next((r for r, a in enumerate(live) if a and r not in tried), None)
        if nxt is None:
            del self._tried[version]
            return None
        self.checkpoint = nxt
        return nxt

    def checkpoint_succeeded(self, version: int, rank: int) -> None:
        self._tried.pop(version, None)
        self.checkpoint = rank

    def on_result(
        self,
        rank: int,
        m: rec.EvalResult | rec.CheckpointResult | rec.EpochFnElapsed,
        live: Sequence[bool],
    ) -> rec.Checkpoint | None:
        """A callback on `rank` finished: measure its cost; a failed checkpoint's retry, if any."""
        if isinstance(m, rec.EvalResult):
            self.eval_ms.update(m.elapsed_ms)
        elif isinstance(m, rec.EpochFnElapsed):
            self.epoch_fn_ms.update(m.elapsed_ms)
        elif m.error is None:
            self.checkpoint_ms.update(m.elapsed_ms)
            self.checkpoint_succeeded(m.version, rank)
        else:
            nxt = self.checkpoint_failed(m.version, rank, live)
            if nxt is not None:
                return rec.Checkpoint(version=m.version, target_rank=nxt)
        return None

    def tried(self, version: int) -> int:
        return len(self._tried.get(version, ()))

    def _assign_all(self, rank: int | None) -> None:
        if rank is None:
            return
        self.checkpoint = self.eval = rank
        if self.epoch != rank:
            self.epoch = rank
            self.epoch_dirty = True


def _lowest(live: Sequence[bool]) -> int | None:
    return next((r for r, a in enumerate(live) if a), None)


class SampleCadence:
    """When the model is due a score by samples trained: every `every` samples (0 = off), one eval per
    due point however many multiples it crossed. The cluster's coordinator and a lone run share it."""

    def __init__(self, every: int, samples: int = 0) -> None:
        self.every = every
        self.next_at = 0
        self.scored(samples)

    def due(self, samples: int) -> bool:
        return self.every > 0 and samples >= self.next_at

    def scored(self, samples: int) -> None:
        """A model holding `samples` samples was scored (by this cadence or an epoch's eval)."""
        if self.every > 0:
            self.next_at = (samples // self.every + 1) * self.every


class EvalLedger:
    """Every eval sent and not yet answered, with the samples its consensus holds (module docstring)."""

    def __init__(self, config: CoordinatorConfig, global_step: int = 0) -> None:
        self.batch_size = config.batch_size
        self.num_epochs = config.num_epochs
        self.final_eval = config.final_eval
        self.run_samples = config.num_epochs * config.total_samples
        self.cadence = SampleCadence(config.eval_every_samples, global_step * self.batch_size)
        self._first_id = self._next_id = self.num_epochs + 1  # the cadence's ids: after every epoch's
        self._last_sent: int | None = None  # the samples of the last consensus an eval was sent for
        self._open: dict[int, tuple[rec.ExecuteEval, int]] = {}  # schedule id -> (request, samples)
        self._orphans: list[rec.ExecuteEval] = []  # open when their rank died: sent again at the next finish

    def sent(self, request: rec.ExecuteEval, global_step: int) -> rec.ExecuteEval:
        """`request` goes out to score the consensus of `global_step` steps (each counts its batch's samples,
        a short last batch whole)."""
        samples = global_step * self.batch_size
        self._open[request.schedule_id] = (request, samples)
        self._last_sent = samples
        self.cadence.scored(samples)
        return request

    def one_per_consensus(
        self, calls: list[tuple[int, rec.Checkpoint | rec.ExecuteEval]], global_step: int, complete: int
    ) -> list[EpochCall]:
        """The epochs' `calls` due on the consensus of `global_step` steps (epochs through `complete`
        whole), with one eval at most: the last epoch's, or none when an eval was sent for this
        consensus already or the final eval scores it (it holds every epoch). The epochs whose eval is
        left out are told to the controller: one model scored twice would read as two results."""
        samples = global_step * self.batch_size
        evals = [r for _, r in calls if isinstance(r, rec.ExecuteEval)]
        scored = samples == self._last_sent or (self.final_eval and complete + 1 >= self.num_epochs)
        keep = None if scored or not evals else evals[-1]
        out: list[EpochCall] = [
            (t, r) for t, r in calls if not isinstance(r, rec.ExecuteEval) or r is keep]
        merged = tuple(r.epoch for r in evals if r is not keep)
        return out + [(CONTROLLER, EvalsMerged(merged, samples))] if merged else out

    def final(self, rank: int, global_step: int) -> rec.ExecuteEval:
        """The final eval, on `rank`, of the final consensus (`global_step` steps)."""
        return self.sent(final_eval(rank, self.num_epochs), global_step)

    def at_finish(self, global_step: int, epochs_whole: int, target: int) -> list[rec.ExecuteEval]:
        """A round finished, its consensus holding `global_step` steps and `epochs_whole` whole epochs: the
        evals due on it, for `target` (an orphan's epoch stays its own)."""
        due = [replace(r, target_rank=target) for r in self._orphans]
        self._orphans = []
        if not due and self.cadence.due(global_step * self.batch_size):
            due.append(rec.ExecuteEval(
                schedule_id=self._next_id, epoch=epochs_whole, target_rank=target, adopt_consensus=True))
            self._next_id += 1
        return [self.sent(r, global_step) for r in due]

    def awaits_round(self, global_step: int) -> bool:
        """Async: whether a model of `global_step` steps is due a score that a round opened now would give at
        its due point. Not the run's last model: the final eval scores that one."""
        samples = global_step * self.batch_size
        return self.cadence.due(samples) and samples < self.run_samples

    def answered(self, schedule_id: int, rank: int) -> int | None:
        """`rank` answered `schedule_id`: the samples its consensus held; None unless it was open on `rank`."""
        request, samples = self._open.get(schedule_id, (None, 0))
        if request is None or request.target_rank != rank:
            return None
        del self._open[schedule_id]
        return samples

    def on_death(self, rank: int) -> None:
        """`rank` left: the evals it had not answered are due again at the next finished consensus."""
        for sid, (request, _) in list(self._open.items()):
            if request.target_rank == rank:
                del self._open[sid]
                self._orphans.append(request)

    @property
    def owed(self) -> bool:
        """Whether an eval was sent and not answered yet, or waits to be sent again."""
        return bool(self._open or self._orphans)

    def within_epoch(self, schedule_id: int) -> bool:
        """Whether `schedule_id` is the cadence's (not an epoch's, not the final eval)."""
        return self._first_id <= schedule_id < FINAL_EVAL_ID


class EpochCallbacks:
    """Eval and checkpoint calls due at epoch boundaries, held until a consensus holds the epoch."""

    def __init__(self, checkpoint_every: int, eval_every: int) -> None:
        self.checkpoint_every = checkpoint_every
        self.eval_every = eval_every
        self._pending: list[tuple[str, int]] = []  # ("checkpoint" | "eval", epoch), in order

    def entering(self, epoch: int) -> None:
        """The run enters `epoch`: queue the callbacks its cadence makes due."""
        if is_due(epoch, self.checkpoint_every):
            self._pending.append(("checkpoint", epoch))
        if is_due(epoch, self.eval_every):
            self._pending.append(("eval", epoch))

    def first_epoch(self) -> int | None:
        """The earliest epoch a pending call is due on entering (None when none is pending)."""
        return min((e for _, e in self._pending), default=None)

    def release(
        self, complete_through: int, roles: CallbackRoles
    ) -> list[tuple[int, rec.Checkpoint | rec.ExecuteEval]]:
        """The calls whose epoch ended at or before `complete_through`, with their target ranks.

        Held until then, not merely until the cycle is idle: under Sync the
        cycle is almost never idle. Targets resolve now, after any failover.
        """
        due = [(k, e) for k, e in self._pending if e - 1 <= complete_through]
        self._pending = [c for c in self._pending if c not in due]
        out: list[tuple[int, rec.Checkpoint | rec.ExecuteEval]] = []
        for kind, epoch in due:
            if kind == "checkpoint":
                target = roles.checkpoint
                out.append((target, rec.Checkpoint(version=epoch, target_rank=target)))
            else:
                # Always score the consensus: the live model may be mid-window
                # or an EASGD blend.
                target = roles.eval
                out.append((target, rec.ExecuteEval(
                    schedule_id=epoch, epoch=epoch, target_rank=target, adopt_consensus=True)))
        return out
