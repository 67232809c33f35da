"""Epoch dispatch arithmetic: the permutation, Sync partitions, chunk sizing, the final window.

Everything here is a pure function of its arguments (plus two frozen
dataclasses). The coordinator calls it; ranks turn the offsets they are sent
into sample indices with flodl_zmq/sampling.py.

Rules this module keeps:

- **Partitions tile the dataset.** Sync partitions are contiguous, in rank
  order, and their sizes sum to `total_samples`; every rank gets at least one
  sample, because a Sync rank with no data never steps and would park the
  averaging gate forever.
- **A dead rank's unfinished data is handed on, never dropped.** Under Sync the
  remainder of its partition (everything after the samples it has processed)
  is split into contiguous `ExtendPartition` spans across the survivors.
- **A final window leaves a rank at exactly one step only to save time.** A
  one-step rank has no marginal (delivered) timing sample, and since the two
  timing scales are never mixed in one window (timing.py), it forces the
  whole window's ElChe feed back to the compute scale. Its batch moves to a
  peer, as in floDl, except in a window that is its whole epoch, where that
  would leave the rank nothing to do every epoch (an epoch of a few batches:
  the cohort is then slower than its fastest rank alone): there it moves
  only if the window stretches by a tenth at most.
- **An epoch's tail crumb rides in its last full window.** A remainder of up to
  `max_crumb` batches past one full schedule is folded into that window
  instead of getting a window of its own: a crumb window costs a whole
  average for a few batches and leaves the slow ranks idle through it.

How the coordinator uses this:

- Sync, at each epoch: `sync_plans(epoch, total, world, ratios, batch)` → one
  `StartEpoch` per rank (the plans are deterministic, so re-dispatching an
  epoch yields the same plans). On a rank's death:
  `remainder_spans(its_plans, steps_done * batch_size)` then
  `extend_partition_plans(epoch, remainder, survivors)` → `ExtendPartition`
  records.
- Progressive (Cadence/Async), before sizing each window:
  `refresh_final_window_plan(...)` pins or keeps the epoch's final-window plan;
  then `chunk_batches(...)` says how many batches rank `r` gets next, and the
  coordinator takes `batches * batch_size` samples from the epoch's
  `ChunkPool` (see chunk_pool.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from flodl_zmq.errors import ConfigError, CoordinatorError
from flodl_zmq.wire.records import EpochPlan  # one plan type: the wire carries it as is

# --------------------------------------------------------------------------- Sync partitions


def partition_sizes(
    total_samples: int, world_size: int, ratios: Sequence[float] | None = None, batch_size: int = 1
) -> list[int]:
    """Per-rank Sync partition sizes summing to `total_samples`, in whole batches.

    The epoch's whole batches are split: without ratios equally (the first
    `batches % world` ranks get one more), with ratios `floor(batches * ratio
    / sum)` each and the leftover batches one each to the largest ratios
    (lowest rank on ties). The short last batch goes to the last rank, so the
    world steps `ceil(total / batch_size)` times an epoch, as one process
    does: partitions of samples each ended in a short batch of their own, a
    step more per rank for a schedule counted in a process's steps (a
    `OneCycleLR` stepped past its end), and a batch of one sample that
    BatchNorm refuses. An epoch of fewer whole batches than ranks is split by
    samples (each rank one short batch).
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if total_samples <= 0:
        raise ConfigError(f"total_samples must be > 0 to dispatch an epoch, got {total_samples}")
    batches, tail = divmod(total_samples, batch_size)
    if batches < world_size:
        batches, tail, batch_size = total_samples, 0, 1
    if ratios is None:
        base, extra = divmod(batches, world_size)
        sizes = [(base + (1 if r < extra else 0)) * batch_size for r in range(world_size)]
    else:
        sizes = [n * batch_size for n in _ratio_sizes(batches, world_size, ratios)]
    sizes[-1] += tail
    if min(sizes) == 0:
        raise ConfigError(
            f"partition sizes {sizes} leave a rank without data ({total_samples} samples over "
            f"{world_size} ranks): under Sync an idle rank blocks every average; use fewer ranks "
            f"or larger partition_ratios"
        )
    return sizes


def _ratio_sizes(total_samples: int, world_size: int, ratios: Sequence[float]) -> list[int]:
    if len(ratios) != world_size:
        raise ConfigError(
            f"partition_ratios has {len(ratios)} entries but the world has {world_size} ranks; "
            f"give one ratio per rank"
        )
    if not all(math.isfinite(x) and x > 0 for x in ratios):
        raise ConfigError(
            f"partition_ratios {list(ratios)} must all be finite and > 0 "
            f"(a zero share would leave a rank idle under Sync)"
        )
    norm = math.fsum(ratios)
    sizes = [math.floor(total_samples * x / norm) for x in ratios]
    leftover = total_samples - sum(sizes)
    for r in sorted(range(world_size), key=lambda r: (-ratios[r], r))[:leftover]:
        sizes[r] += 1
    return sizes


def sync_plans(
    epoch: int, total_samples: int, world_size: int, ratios: Sequence[float] | None = None, batch_size: int = 1
) -> list[EpochPlan]:
    """One contiguous plan per rank, in rank order, tiling `[0, total_samples)` in whole batches."""
    plans = []
    offset = 0
    for size in partition_sizes(total_samples, world_size, ratios, batch_size):
        plans.append(EpochPlan(epoch, offset, size))
        offset += size
    return plans


def remainder_spans(plans: Sequence[EpochPlan], samples_done: int) -> list[tuple[int, int]]:
    """What a dead Sync rank left unprocessed: its spans after the first `samples_done` samples.

    `plans` is the rank's partition in the order it trains it: its `StartEpoch`
    plan followed by any `ExtendPartition` spans it received. `samples_done`
    is its steps this epoch times the batch size.
    """
    out = []
    skip = max(samples_done, 0)
    for plan in plans:
        used = min(skip, plan.size)
        skip -= used
        if plan.size > used:
            out.append((plan.offset + used, plan.size - used))
    return out


def extend_partition_plans(
    epoch: int, remainder: Sequence[tuple[int, int]], survivors: Sequence[int], batch_size: int = 1
) -> list[tuple[int, EpochPlan]]:
    """Split a dead rank's remainder across `survivors` as `(rank, plan)` ExtendPartition records.

    The remainder (all its spans laid end to end) is cut into equal contiguous
    shares of whole batches in ascending survivor order, the first `batches % n`
    survivors taking one more, the last any short batch (each share ending in a
    short batch of its own would be a step more each); a share that crosses a
    span boundary becomes two records. Survivors with an empty share get
    nothing. With no survivors it returns nothing: the run is lost and the
    coordinator's all-ranks-lost check ends it.
    """
    order = sorted(survivors)
    total = sum(size for _, size in remainder)
    if not order or total == 0:
        return []
    batches, tail = divmod(total, batch_size)
    base, extra = divmod(batches, len(order))
    shares = [(base + (1 if i < extra else 0)) * batch_size for i in range(len(order))]
    shares[-1] += tail
    out: list[tuple[int, EpochPlan]] = []
    spans = [list(span) for span in remainder if span[1] > 0]
    for rank, share in zip(order, shares, strict=True):
        while share > 0:
            offset, size = spans[0]
            cut = min(share, size)
            out.append((rank, EpochPlan(epoch, offset, cut)))
            share -= cut
            if cut == size:
                spans.pop(0)
            else:
                spans[0] = [offset + cut, size - cut]
    return out


# --------------------------------------------------------------------------- chunk sizing


def probe_chunk_batches(total_samples: int, world_size: int, batch_size: int) -> int:
    """Chunk size (batches) for Async before ElChe is calibrated: a tenth of a rank's share, >= 4."""
    return max(total_samples // (world_size * 10 * batch_size), 4)


def chunk_batches(
    rank: int,
    *,
    remaining_batches: int,
    counts: Sequence[int],
    window_steps: int,
    barrier_paced: bool,
    calibrated: bool,
    probe_batches: int,
    min_chunk_batches: int,
    overshoot: int,
    final_window: FinalWindowPlan | None,
) -> int:
    """How many batches rank `rank` gets in its next progressive chunk; 0 means none.

    `remaining_batches` is `pool.remaining() // batch_size`; `counts` are
    ElChe's per-rank batch counts; `window_steps` is the rank's steps since the
    last average; `barrier_paced` is true for Cadence (one chunk is one
    window), false for Async; `overshoot` is Async's `max_overshoot` (0 for
    barrier-paced policies); `final_window` is the epoch's pinned plan, if any.
    """
    if remaining_batches <= 0:
        return 0
    if final_window is not None:
        # The pinned allocation bypasses the caps: it was sized so the whole
        # remainder lands in one coherent window with no one-step rank.
        return min(final_window.alloc[rank], remaining_batches)
    count = counts[rank]
    budget = count + overshoot if count > 0 else 0

    def cap_to_budget(x: int) -> int:
        # A rank never runs past its window budget; it may still take one batch
        # so a rank already at its budget is not starved of the edge of an epoch.
        return min(x, max(1, budget - window_steps)) if budget > 0 else x

    total = sum(counts)
    if remaining_batches < total:
        return cap_to_budget(min(count, remaining_batches))
    if barrier_paced:
        return min(count, remaining_batches)
    if not calibrated:
        return min(probe_batches, remaining_batches)
    share = math.ceil(remaining_batches * count / total)
    return cap_to_budget(min(remaining_batches, max(min_chunk_batches, share)))


# --------------------------------------------------------------------------- final window


@dataclass(frozen=True)
class FinalWindowPlan:
    """The pinned allocation of an epoch's final window (barrier-paced policies only).

    `alloc[r]` batches go to rank `r` (0: it sits the window out, and the gate
    treats it as quiesced). `pinned_counts` are the live batch counts the plan
    was computed from: if ElChe changes them mid-tail, the plan is stale and is
    re-pinned (a stale plan demanded steps from a rank it gave nothing, and
    the gate deadlocked upstream).
    """

    epoch: int
    alloc: tuple[int, ...]
    pinned_counts: tuple[int, ...]


def _live_counts(counts: Sequence[int], alive: Sequence[bool]) -> tuple[int, ...]:
    return tuple(c if a else 0 for c, a in zip(counts, alive, strict=True))


def max_crumb(live_total: int, world_size: int) -> int:
    """The largest crumb (batches past one full schedule) folded into an epoch's last window.

    Upstream folds only crumbs below `W`; we also fold any crumb up to a tenth
    of the schedule. Spread in proportion to the counts (see
    `final_window_alloc`), such a crumb stretches every rank's last window by
    the same <= 10%, so nobody waits longer at the barrier, whereas a window of
    its own costs a whole average for a few batches and idles the slow ranks
    (simulator, 12/3/1 ms per batch, 680 batches = 4 x 169 + 4: 196-200
    rounds instead of 161 over 40 epochs). The cap keeps the stretched window
    close to the one ElChe sized; its timing is per batch, so it stays valid.
    """
    return max(world_size - 1, live_total // 10)


def is_final_window(remaining_batches: int, counts: Sequence[int], alive: Sequence[bool]) -> bool:
    """True when the epoch's remainder fits in one window: `0 < rem <= S + max_crumb(S, W)`.

    `S` is the sum of the live counts; see `max_crumb` for the fold band.
    """
    total = sum(_live_counts(counts, alive))
    return 0 < remaining_batches <= total + max_crumb(total, len(counts))


def final_window_alloc(
    remaining_batches: int, counts: Sequence[int], alive: Sequence[bool], *, whole_epoch: bool = False
) -> list[int]:
    """Split the last `remaining_batches` of an epoch into one window, one-step ranks consolidated.

    Narrow fold band (`sum <= rem < sum + W`, sum of live counts): every live
    rank gets its full count and the crumb `rem - sum` (< W batches) goes one
    batch at a time to the live ranks other than the fastest (largest count,
    lowest rank on ties), smallest count first, round-robin (upstream's rule);
    a lone live rank takes everything. Otherwise, below the schedule or with a
    wider crumb (`max_crumb`): proportional, `floor(rem * c / sum)` plus one
    each to the largest fractional parts; above the schedule every live rank
    then gets at least its count and the crumb lands where it stretches every
    rank's window alike (round-robin onto the slow ranks would make the
    slowest rank's window the longest by whole batches). All bands then
    consolidate (`_consolidate`): a rank left at exactly 1 moves its batch to
    the live peer with the smallest non-zero allocation, unless the window is
    the `whole_epoch` and the move stretches it by over a tenth. Dead ranks
    get 0 and the sum is exactly `rem`; a lone 1 survives then and when
    `rem == 1`.
    """
    live = _live_counts(counts, alive)
    ranks = [r for r, a in enumerate(alive) if a]
    if not ranks or sum(live) == 0:
        raise CoordinatorError(
            f"final window of {remaining_batches} batches has no live rank with a positive "
            f"batch count (counts {list(counts)}, alive {list(alive)}); the coordinator must "
            f"end the run (all ranks lost) before planning dispatch"
        )
    total = sum(live)
    alloc = [0] * len(counts)
    if total <= remaining_batches < total + len(counts):
        for r in ranks:
            alloc[r] = live[r]
        fastest = min(ranks, key=lambda r: (-live[r], r))
        padded = sorted((r for r in ranks if r != fastest), key=lambda r: (live[r], r)) or [fastest]
        for i in range(remaining_batches - total):
            alloc[padded[i % len(padded)]] += 1
    else:
        fractions = []
        for r in ranks:
            whole, frac = divmod(remaining_batches * live[r], total)
            alloc[r] = whole
            fractions.append((-frac, r))
        for _, r in sorted(fractions)[: remaining_batches - sum(alloc)]:
            alloc[r] += 1
    _consolidate(alloc, live, ranks, whole_epoch)
    return alloc


def _consolidate(alloc: list[int], counts: Sequence[int], ranks: Sequence[int], whole_epoch: bool) -> None:
    """Move each lone batch onto the smallest non-zero live peer (in place).

    Except in a window that is its whole epoch, where the batch stays unless
    the move stretches the window by a tenth at most (the stretch `max_crumb`
    accepts): otherwise the rank would get nothing in the epoch, every epoch.
    Counts are proportional to speed, so `alloc[r] / counts[r]` is rank r's
    time in the window (an epoch of 5 batches at 1 : 3 speed: [4, 1], which
    floDl makes [5, 0], a window a quarter longer with the slow rank idle).
    """

    def time(r: int, batches: int) -> Fraction | float:
        return Fraction(batches, counts[r]) if counts[r] else (math.inf if batches else 0)

    limit = max(time(r, alloc[r]) for r in ranks) * Fraction(11, 10) if whole_epoch else math.inf
    moved = True
    while moved:
        moved = False
        for r in ranks:
            peers = [p for p in ranks if p != r and alloc[p] >= 1]
            if alloc[r] != 1 or not peers:
                continue
            target = min(peers, key=lambda p: (alloc[p], p))
            if time(target, alloc[target] + 1) <= limit:
                alloc[target] += 1
                alloc[r] = 0
                moved = True


def refresh_final_window_plan(
    plan: FinalWindowPlan | None,
    *,
    epoch: int,
    remaining_batches: int,
    counts: Sequence[int],
    alive: Sequence[bool],
    whole_epoch: bool = False,
) -> FinalWindowPlan | None:
    """The final-window plan to use for `epoch` now: keep, re-pin, pin or drop.

    Call it at the start of each window of a barrier-paced epoch, before sizing
    that window's chunks. A plan for this epoch whose live counts still match is
    kept as it is (its allocation covers the remainder it was pinned for); a
    stale one (other epoch, or live counts changed by ElChe or a death) is
    replaced; a new plan is pinned when the remainder fits in one window.
    `whole_epoch`: nothing of the epoch is handed out yet.
    """
    live = _live_counts(counts, alive)
    if plan is not None and plan.epoch == epoch and plan.pinned_counts == live:
        return plan
    if not is_final_window(remaining_batches, counts, alive):
        return None
    alloc = final_window_alloc(remaining_batches, counts, alive, whole_epoch=whole_epoch)
    return FinalWindowPlan(epoch, tuple(alloc), live)
