"""The progressive chunk pool: one epoch's samples, handed out in window-sized chunks.

A `ChunkPool` owns the offsets `[0, size)` of one epoch's permutation, where
`size` is the dataset length rounded down to whole batches (the sub-batch tail
is dropped before allocation so the pool drains to exactly zero; the next
epoch's permutation draws a different tail). Every offset is always in exactly
one of four places:

    residue    a rank's reservation span not yet handed out
    reclaimed  ranges given back (a dead rank's chunk, a failed send, a resume hole)
    in flight  the one chunk a rank is training on
    done       completed, or the first batches of a dead rank's chunk that a consensus holds (what no
               consensus holds of a completion its rank leaves with is reclaimed)

Rules this module keeps:

- **Reservation spans.** At creation each rank gets a contiguous span, in rank
  order, sized in whole batches in proportion to `shares` (ElChe's batch counts
  once calibrated, equal before), leftover batches one each round-robin.
- **Take order.** A take serves, in order: the oldest reclaimed range (so a
  dead rank's work is redone first, not at the end of the epoch); the front of
  the rank's own span; the *back* of the other span with the largest residue
  (lowest rank on ties). Owner eats front to back, thieves back to front, so
  they never cross. A take is one contiguous range, possibly shorter than asked.
- **One chunk in flight per rank.** A worker has a single pending-plan slot: a
  second dispatch would overwrite the first and its samples would never
  complete, wedging the epoch. Taking while a chunk is in flight is a
  `CoordinatorError`.
- **Nothing lost, nothing twice.** A completion moves the in-flight chunk to
  done; a failed send puts it back where it came from (a ghost in-flight chunk
  would keep the epoch from ever finishing); a death puts it in reclaimed, less
  its first `kept` samples, which a consensus holds (they are done); a
  completion from a rank with nothing in flight (reported after it was
  declared dead and its chunk forfeited) is ignored, since a survivor redoes
  that chunk.
- **Done means covered.** `is_done()` is true exactly when every offset is done.
  In-flight chunks count as uncovered: their gradients are not in the
  consensus yet.
- **Resume is coverage-exact.** `from_coverage` rebuilds a pool from the done
  spans saved in a checkpoint and serves exactly the holes, each once.

How the coordinator uses this:

- At epoch start (progressive policies): `ChunkPool(epoch, total_samples,
  batch_size, shares)`; keep one pool per epoch, never re-create the pool of an
  already aggregated epoch.
- To dispatch: size the chunk with `dispatch.chunk_batches(...)` from
  `remaining() // batch_size`, then `take(rank, batches * batch_size)`; send the
  returned `EpochPlan`. `rollback(rank)` undoes a take whose send failed, as
  if it never happened; the coordinator itself fails a rank it cannot reach,
  and its `forfeit` queues the chunk to be redone first.
- On a chunk's completion report: `complete(rank)`; the epoch is ready to
  aggregate when `is_done()`.
- On a rank's death: `forfeit(rank)` on every pool, then wake idle survivors
  (the reclaimed range needs a dispatch kick).
- At a checkpoint: save `covered()` per live pool; on resume,
  `ChunkPool.from_coverage(...)` with the same dataset length and batch size.

The pool enforces one chunk in flight per rank *within this pool*; a rank
streaming ahead into the next epoch's pool is the coordinator's to hold back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from flodl_zmq.errors import CoordinatorError, TrainingError
from flodl_zmq.wire.records import EpochPlan

Span = tuple[int, int]
"""(offset, size) of a contiguous run of permutation offsets."""


class _Reservation:
    """A rank's span [start, end); its residue is [cursor, tail)."""

    __slots__ = ("start", "end", "cursor", "tail")

    def __init__(self, start: int, end: int) -> None:
        self.start = self.cursor = start
        self.end = self.tail = end

    @property
    def residue(self) -> int:
        return self.tail - self.cursor


class ChunkPool:
    """One epoch's samples, dispatched progressively; see the module docstring."""

    def __init__(
        self, epoch: int, total_samples: int, batch_size: int, shares: Sequence[int]
    ) -> None:
        if batch_size < 1:
            raise CoordinatorError(f"batch_size must be >= 1, got {batch_size}")
        if total_samples < 0:
            raise CoordinatorError(f"total_samples must be >= 0, got {total_samples}")
        if not shares or min(shares) < 0 or sum(shares) == 0:
            raise CoordinatorError(
                f"pool shares {list(shares)} must be one non-negative weight per rank with a "
                f"positive sum (ElChe batch counts, or 1 per rank before calibration)"
            )
        self.epoch = epoch
        self.batch_size = batch_size
        batches = total_samples // batch_size
        # Whole batches only, so the pool drains to exactly zero; `dropped` is the
        # sub-batch tail (a different one each epoch, since the permutation changes).
        self.size = batches * batch_size
        self.dropped = total_samples - self.size
        self._spans: list[_Reservation] = []
        offset = 0
        for n in _split_batches(batches, shares):
            self._spans.append(_Reservation(offset, offset + n * batch_size))
            offset += n * batch_size
        self._reclaimed: deque[Span] = deque()
        self._in_flight: dict[int, Span] = {}
        self._done: list[Span] = []  # kept sorted and coalesced

    @classmethod
    def from_coverage(
        cls,
        epoch: int,
        total_samples: int,
        batch_size: int,
        world_size: int,
        covered: Iterable[Span],
    ) -> ChunkPool:
        """Rebuild a pool for resume: `covered` spans are done; every hole is served once.

        All reservation spans start exhausted and the holes are staged as
        reclaimed ranges, so the pool serves exactly the holes. The dataset
        length and batch size must be the ones the coverage was saved with.
        """
        pool = cls(epoch, total_samples, batch_size, [1] * world_size)
        end = 0
        for offset, size in sorted(covered):
            # A span that overlaps, leaves the pool or splits a batch cannot come
            # from this dataset and batch size; serving around it would skip or
            # repeat samples.
            if (
                offset < end
                or size < 0
                or offset + size > pool.size
                or offset % batch_size
                or size % batch_size
            ):
                raise TrainingError(
                    f"checkpoint coverage span ({offset}, {size}) of epoch {epoch} does not fit a "
                    f"pool of {pool.size} samples in batches of {batch_size} (or overlaps another "
                    f"span): resume with the dataset and batch size the checkpoint was written with"
                )
            end = offset + size
        done = _coalesce(covered)
        for span in pool._spans:
            span.cursor = span.tail = span.end
        pool._done = done
        pool._reclaimed.extend(_complement(done, pool.size))
        return pool

    # ----------------------------------------------------------------- inputs

    def take(self, rank: int, size: int) -> EpochPlan | None:
        """Hand rank `rank` up to `size` samples (a multiple of the batch size).

        Returns the chunk, now in flight, or None when the pool has nothing left
        to hand out (or `size` is 0).
        """
        self._check_rank(rank)
        if size < 0 or size % self.batch_size:
            raise CoordinatorError(
                f"take of {size} samples for rank {rank}: chunk sizes must be a non-negative "
                f"multiple of the batch size {self.batch_size} (batches * batch_size)"
            )
        if rank in self._in_flight:
            offset, n = self._in_flight[rank]
            raise CoordinatorError(
                f"rank {rank} already has chunk ({offset}, {n}) of epoch {self.epoch} in flight; "
                f"complete, roll back or forfeit it before dispatching another"
            )
        if size == 0:
            return None
        chunk = self._take_range(rank, size)
        if chunk is None:
            return None
        self._in_flight[rank] = chunk
        return EpochPlan(self.epoch, chunk[0], chunk[1])

    def _take_range(self, rank: int, size: int) -> Span | None:
        if self._reclaimed:
            offset, n = self._reclaimed.popleft()
            if n > size:
                self._reclaimed.appendleft((offset + size, n - size))
            return offset, min(n, size)
        own = self._spans[rank]
        if own.residue > 0:
            n = min(size, own.residue)
            own.cursor += n
            return own.cursor - n, n
        victim = max(self._spans, key=lambda s: s.residue)  # first maximum: lowest rank
        if victim.residue == 0:
            return None
        n = min(size, victim.residue)
        victim.tail -= n
        return victim.tail, n

    def complete(self, rank: int) -> EpochPlan | None:
        """Rank `rank` finished its chunk: it becomes done. Returns it, or None if none was in flight."""
        self._check_rank(rank)
        chunk = self._in_flight.pop(rank, None)
        if chunk is None:
            return None
        self._done = _coalesce([*self._done, chunk])
        return EpochPlan(self.epoch, chunk[0], chunk[1])

    def rollback(self, rank: int) -> EpochPlan | None:
        """The send of rank `rank`'s chunk failed: return the chunk to the pool, as if never taken.

        A chunk that touches the residue it was cut from goes back into it (the
        owner gets it again, in order); otherwise it goes to the front of the
        reclaimed queue. Returns the chunk, or None if none was in flight.
        """
        self._check_rank(rank)
        chunk = self._in_flight.pop(rank, None)
        if chunk is None:
            return None
        offset, n = chunk
        for span in self._spans:
            if span.cursor == offset + n and offset >= span.start:
                span.cursor = offset
                break
            if span.tail == offset and offset + n <= span.end:
                span.tail = offset + n
                break
        else:
            self._reclaimed.appendleft(chunk)
        return EpochPlan(self.epoch, offset, n)

    def forfeit(self, rank: int, kept: int = 0) -> EpochPlan | None:
        """Rank `rank` died: its in-flight chunk goes to the reclaimed queue, less its first `kept` samples,
        which are done (a consensus holds them, or may: its deposit was taken mid-chunk). Idempotent.

        Its untouched residue stays in its span, where survivors steal it.
        Returns the forfeited chunk, or None if none was in flight.
        """
        self._check_rank(rank)
        chunk = self._in_flight.pop(rank, None)
        if chunk is None:
            return None
        offset, n = chunk
        if not 0 <= kept <= n:
            raise CoordinatorError(f"cannot keep {kept} samples of rank {rank}'s chunk {chunk} of epoch {self.epoch}")
        if kept:
            self._done = _coalesce([*self._done, (offset, kept)])
        if kept < n:
            self._reclaimed.append((offset + kept, n - kept))
        return EpochPlan(self.epoch, offset, n)

    def reclaim(self, span: Span) -> None:
        """A done `span` is in no consensus after all (its rank left before depositing it): it goes to the
        reclaimed queue, to be redone first, and is no longer done."""
        remaining = _subtract(self._done, [span])
        if sum(n for _, n in self._done) - sum(n for _, n in remaining) != span[1]:
            raise CoordinatorError(f"span {span} of epoch {self.epoch} is not done: only a done span is reclaimed")
        self._done = remaining
        self._reclaimed.append(span)

    # ----------------------------------------------------------------- queries

    @property
    def world_size(self) -> int:
        return len(self._spans)

    def remaining(self) -> int:
        """Samples not yet handed out: span residues plus reclaimed ranges."""
        return sum(s.residue for s in self._spans) + sum(n for _, n in self._reclaimed)

    def in_flight(self, rank: int) -> EpochPlan | None:
        """The chunk rank `rank` is training on, if any."""
        chunk = self._in_flight.get(rank)
        return None if chunk is None else EpochPlan(self.epoch, chunk[0], chunk[1])

    def is_done(self) -> bool:
        """True exactly when every sample of the pool is done."""
        return self._done == ([(0, self.size)] if self.size else [])

    def covered(self, excluding: Iterable[Span] = (), held: Iterable[Span] = ()) -> list[Span]:
        """Done samples as sorted, coalesced (offset, size) spans, less `excluding` (done spans in no
        consensus yet), with `held` (the first samples of chunks in flight that a consensus holds): what a
        checkpoint saves."""
        return _coalesce([*_subtract(self._done, excluding), *held])

    def uncovered(self) -> list[Span]:
        """Everything not done (residues, reclaimed, in flight), sorted and coalesced."""
        return _complement(self._done, self.size)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self._spans):
            raise CoordinatorError(
                f"rank {rank} is outside the world of {len(self._spans)} ranks of epoch "
                f"{self.epoch}'s pool"
            )


def _split_batches(batches: int, shares: Sequence[int]) -> list[int]:
    """`batches` in proportion to `shares`, leftover one each round-robin over positive shares."""
    total = sum(shares)
    out = [batches * s // total for s in shares]
    positive = [r for r, s in enumerate(shares) if s > 0]
    for i in range(batches - sum(out)):
        out[positive[i % len(positive)]] += 1
    return out


def _coalesce(spans: Iterable[Span]) -> list[Span]:
    """Sort spans and merge touching ones; overlapping spans are a bug and raise."""
    out: list[Span] = []
    for offset, size in sorted(s for s in spans if s[1] > 0):
        if out and offset < out[-1][0] + out[-1][1]:
            raise CoordinatorError(
                f"span ({offset}, {size}) overlaps ({out[-1][0]}, {out[-1][1]}): a sample would "
                f"be counted twice"
            )
        if out and offset == out[-1][0] + out[-1][1]:
            out[-1] = (out[-1][0], out[-1][1] + size)
        else:
            out.append((offset, size))
    return out


def _subtract(spans: Sequence[Span], cut: Iterable[Span]) -> list[Span]:
    """Sorted, coalesced `spans` less every span of `cut`."""
    out = list(spans)
    for c_off, c_n in cut:
        c_end = c_off + c_n
        kept: list[Span] = []
        for off, n in out:
            end = off + n
            if end <= c_off or off >= c_end:
                kept.append((off, n))
                continue
            if off < c_off:
                kept.append((off, c_off - off))
            if end > c_end:
                kept.append((c_end, end - c_end))
        out = kept
    return out


def _complement(done: Sequence[Span], size: int) -> list[Span]:
    """The holes of sorted, coalesced `done` within [0, size)."""
    holes = []
    cursor = 0
    for offset, n in done:
        if offset > cursor:
            holes.append((cursor, offset - cursor))
        cursor = offset + n
    if cursor < size:
        holes.append((cursor, size - cursor))
    return holes
