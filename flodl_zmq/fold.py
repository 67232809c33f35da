"""The host fold station: one relay sums its local ranks' deposits into one HostFrame.

A core: no sockets, no clocks, inputs in and outcomes out. It is not pure: it
keeps reused sum images between rounds, and a large sum is split over the
shared worker threads (flodl_zmq.threads).

The contract of a deposit (realized-work algebra: the consensus is the
mass-weighted mean of the deposits, each mass the rank's realized work): a rank
ships its tensors **already multiplied by its mass** (its realized work this
round) together with that mass. So averaging is three moves: pre-scale at the
source, sum tensors and masses through every fold tier, divide once at the
root. This module is the middle move and keeps these rules:

- The fold NEVER divides. It is a plain sum of tensors and of masses, so any
  number of fold tiers gives the same consensus (no averaging of averages).
- The round's first deposit is held verbatim: a one-rank host ships the very
  objects its rank deposited, byte for byte, and never touches f32.
- Sums are f32: bf16 and f16 are widened before adding and the result is
  encoded back in the round's dtype (bf16 rounds to nearest even), so a fold
  tier never changes the schema. A round that completes with its second
  deposit (the two-rank host) is summed and encoded in one pass, without f32
  sums in memory; otherwise the second deposit promotes to f32 running sums in
  one image allocated once per schema and reused across rounds, and later
  deposits add in place.
- Barrier: the round completes when every roster rank has deposited or is dead.
  A dead rank is out of every later barrier, and work it already deposited
  stays counted (that work was realized). There is no deadline: dropping a
  round silently would break Local SGD, so liveness comes from deaths only.
- Every protocol violation (a round id ahead of the open round, schema drift
  from the round's first deposit, non-finite or negative mass, a rank not on
  the roster) raises FoldError before anything changes (every check comes
  before the first add): the round holds only deposits that passed, and the
  relay makes the violating rank leave, so the round completes without it.
  One rank's broken stream must not take every rank of its host down.
- Round id + rank make a deposit idempotent: a second deposit from one rank in
  the open round (a resend that crossed the original) is dropped and counted,
  never summed twice; a deposit for a round already shipped is late. Either
  way nothing changes (PROTOCOL.md 10.6).
- A deposit with a NaN or infinite element is refused too: the rank is out of
  every barrier, listed in ``refused`` (the relay makes it leave), and the
  round completes without it (one rank must not NaN the consensus of every
  rank). The check rides on the pass that first reads a deposit: the sum of
  the first two (the blocks of sums checked while in cache), or a check of its
  own just before a later one is added in place (which then raises
  PoisonedDeposit, the round untouched). A round's single
  deposit is not summed, so not checked here: the reducer checks every HostFrame.
  Every deposit far above the last consensus, or above its host-mates' mass, is
  refused alike (robust.py), the magnitude of a held one measured by the pass
  that sums it (a single deposit's by a read of its own before it ships), the
  same deposits refused as by a check on arrival. ``unfolded``: deposits are
  held and shipped as they came.
- A deposit from a rank already dead is a late frame: dropped and counted.

Deposits reach this core already authenticated (the wire verifies the MAC
first), as read-only numpy views over the received frames; bf16 arrives as
``uint16``. The tensors of a HostFold are either the single deposit's own
objects or views of the station's reused buffers: ship them before the next
round's second deposit arrives (strict ping-pong guarantees it, since that
deposit needs this round's consensus first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from flodl_zmq import robust, threads
from flodl_zmq.errors import ConfigError, FoldError, PoisonedDeposit, ProtocolError
from flodl_zmq.sums import KERNELS, PIECE, Read, Schema, SumImage, carve
from flodl_zmq.tensors import dtype_name

# Images kept per station: a sync cycle can rotate through a few schemas (e.g.
# parameters, then buffers), and each must find its image already allocated.
IMAGES_KEPT = 3
ENTRIES_KEPT = 3  # output sets kept per schema while sends hold them (ImageCache)


def schema_of(tensors: Sequence[np.ndarray], who: str, error: type[ProtocolError]) -> Schema:
    """The schema of a deposit; an unsupported tensor raises ``error`` naming ``who``."""
    schema = []
    for i, t in enumerate(tensors):
        if not isinstance(t, np.ndarray):
            raise error(f"{who}: tensor[{i}] is a {type(t).__name__}, not a numpy array")
        try:
            name = dtype_name(t)
        except TypeError as e:
            raise error(f"{who}: tensor[{i}]: {e}") from None
        if name not in KERNELS:  # i8: a hop widens int8 payloads before they are summed (flodl_zmq/wire_format.py)
            raise error(f"{who}: tensor[{i}] is {name}, which a fold does not sum: int8 values travel only in "
                        "(values, scales) pairs, and such a payload is widened before it is summed")
        schema.append((name, t.shape))
    return tuple(schema)


def check_schema(expected: Schema, tensors: Sequence[np.ndarray], who: str, error: type[ProtocolError]) -> None:
    """Raise ``error`` unless ``tensors`` match ``expected`` in count, dtype and shape."""
    if len(tensors) != len(expected):
        raise error(f"{who} carries {len(tensors)} tensors; the round's first frame carried {len(expected)} "
                    "(desynced rounds, or ranks built with different models)")
    for i, ((dt, shape), t) in enumerate(zip(expected, tensors, strict=True)):
        got = schema_of((t,), who, error)[0]
        if got[0] != dt:
            raise error(f"{who} tensor[{i}] is {got[0]}, the round's is {dt} "
                        "(ranks disagree on the wire dtype; use one bf16 setting for the whole run)")
        if got[1] != shape:
            raise error(f"{who} tensor[{i}] has shape {got[1]}, the round's is {shape} (different models?)")


def check_finite(tensors: Sequence[np.ndarray], who: str) -> None:
    """Raise PoisonedDeposit unless every element of ``tensors`` is finite.

    One NaN or inf in one deposit would make the whole consensus non-finite on
    every rank (the sum propagates it). Checked in PIECE pieces on the worker
    threads, before the deposit joins the round, so a refused one changes nothing.
    """
    work = []
    for t in tensors:
        flat = t.reshape(-1)
        kernels = KERNELS[dtype_name(t)]
        work += [(kernels, flat[i : i + PIECE]) for i in range(0, flat.size, PIECE)]
    if not all(threads.each(lambda w: w[0].finite_quiet(w[1]), work)):
        raise PoisonedDeposit(
            f"{who} carries a NaN or infinite element; it would poison the consensus of every rank "
            "(a diverged or tampered model: check the learning rate, or who holds the session key)"
        )


@dataclass(frozen=True, eq=False)
class HostFold:
    """A completed host round: ship ``tensors`` and ``mass`` upstream as one HostFrame.

    ``tensors`` are the sum of the contributors' (mass-premultiplied) deposits in
    the round's dtypes; ``verbatim`` says they are the single deposit's own objects.
    """

    round_id: int
    mass: float
    ranks: tuple[int, ...]
    tensors: tuple[np.ndarray, ...]
    verbatim: bool
    masses: tuple[float, ...] = ()  # unfolded: each rank's mass, its deposit its share of ``tensors`` in rank order

    def frames(self) -> list[tuple[tuple[int, ...], float, tuple[np.ndarray, ...]]]:
        """(ranks, mass, tensors) of each HostFrame to ship: the one sum, or each rank's deposit when unfolded."""
        if not self.masses:
            return [(self.ranks, self.mass, self.tensors)]
        k = len(self.tensors) // len(self.ranks)
        return [((r,), m, self.tensors[i * k : (i + 1) * k]) for i, (r, m) in enumerate(zip(self.ranks, self.masses,
                                                                                             strict=True))]


@dataclass(frozen=True)
class NothingToShip:
    """Every roster rank is dead and no deposit is pending: this host sends no more HostFrames."""

    reason: str


@dataclass
class FoldCounters:
    """Station instrumentation (monotonic)."""

    rounds_shipped: int = 0
    deposits: int = 0
    late_drops: int = 0
    duplicate_drops: int = 0
    bytes_folded: int = 0


class GateCounters(Protocol):
    late_drops: int
    duplicate_drops: int


def round_gate(round_id: int, last_round: int | None, rnd: OpenRound | None, member: object,
               counters: GateCounters, who: str, error: type[ProtocolError]) -> bool:
    """Whether a frame for ``round_id`` from ``member`` may join the open round ``rnd``.

    The one admission rule of a relay's fold and of the reducer. A frame for a
    round already shipped (a resend that crossed the original, or one asked for
    too late) or from a member already held (a resend after the original) is
    dropped and counted, False; one for any other round than the open one means
    the sender's stream is desynced, and raises ``error``.
    """
    if last_round is not None and round_id <= last_round:
        counters.late_drops += 1
        return False
    if rnd is not None and round_id != rnd.round_id:
        raise error(f"{who}: round {rnd.round_id} is still open (the sender's stream is desynced)")
    if rnd is not None and member in rnd.members:
        counters.duplicate_drops += 1
        return False
    return True


class Sending(Protocol):
    """A send that reads buffers without a copy (zmq.MessageTracker): ``done`` once the socket let go of them."""

    @property
    def done(self) -> bool: ...


class _Entry:
    """One sum image and its output buffers, and the sends that still read the outputs."""

    def __init__(self, image: SumImage, outputs: list[np.ndarray]) -> None:
        self.image, self.outputs = image, outputs
        self.sends: list[Sending] = []

    def held(self) -> bool:
        self.sends = [s for s in self.sends if not s.done]
        return bool(self.sends)


class ImageCache:
    """Reused sum images and output buffers for the last IMAGES_KEPT schemas.

    Parameter and buffer rounds alternate schemas; keeping both avoids first-touch
    page faults (several times slower than the fold itself) every round. Outputs
    that a send still reads without a copy (``hold``) are not handed out again:
    a subscriber that reads late (the controller's own copy comes by reference,
    over inproc) or a slow link must not get the next round's values under this
    round's MAC. The next round then takes another of the schema's entries, made
    anew when all ENTRIES_KEPT are held (the oldest is let go: its send keeps it).
    """

    def __init__(self, make: Callable[[Schema], tuple[SumImage, list[np.ndarray]]]) -> None:
        self._make = make
        self._entries: OrderedDict[Schema, list[_Entry]] = OrderedDict()  # per schema, the current one first

    def get(self, schema: Schema) -> tuple[SumImage, list[np.ndarray]]:
        """The schema's current entry; another one when sends still read it (between rounds only: a round's
        outputs are held once they are sent, after its last ``get``)."""
        entries = self._entries.setdefault(schema, [])
        self._entries.move_to_end(schema)
        while len(self._entries) > IMAGES_KEPT:
            self._entries.popitem(last=False)
        if not entries or entries[0].held():
            free = next((e for e in entries if not e.held()), None)
            if free is None:
                free = _Entry(*self._make(schema))
                if len(entries) >= ENTRIES_KEPT:
                    entries.pop()
            else:
                entries.remove(free)
            entries.insert(0, free)
        return entries[0].image, entries[0].outputs

    def hold(self, outputs: Sequence[np.ndarray], sending: Sending) -> None:
        """``outputs`` (as ``get`` handed them out) go out without a copy: not handed out again until
        ``sending`` is done. Buffers of no entry (a verbatim frame, int8's fresh ones) are not ours: ignored."""
        for entry in (e for entries in self._entries.values() for e in entries):
            if outputs and entry.outputs and entry.outputs[0] is outputs[0]:
                entry.sends.append(sending)
                return


def _fold_outputs(schema: Schema) -> tuple[SumImage, list[np.ndarray]]:
    image = SumImage(schema)
    # f32 ships from the sums; bf16 and f16 results need buffers of their own: one 2-byte allocation.
    kernels = [KERNELS[dt] for dt, _ in schema]
    _, halves = carve([shape for k, (_, shape) in zip(kernels, schema, strict=True) if not k.sums_out],
                      np.dtype("<u2"))
    rest = iter(halves)
    outputs = [acc if k.sums_out else next(rest).view(k.element.dtype)
               for k, acc in zip(kernels, image.sums, strict=True)]
    return image, outputs


class OpenRound:
    """The open round of a fold tier (relay or reducer): who contributed, the summed mass, the tensors.

    The first two contributions are ``held`` verbatim. A tier whose round stays
    open after the second calls ``promote``: the two are summed into its reused
    f32 image in one pass, and later ones add in place. A round that completes
    with two held is encoded straight from them (``SumImage.encode_sum_into``).
    Contributions come in through ``contribute``, which checks mass and schema first.

    Values: a contribution added to the image (or kept) is checked before (passes
    of its own, from the third contribution on); held ones are checked by the
    operation that first reads them, in the same pass, which the tier hands to
    ``judge``: the culprits leave the round (``refused``) and the tier
    recomputes without them. The bound does not move while a round is open (a
    tier sees a consensus between rounds), so a held contribution is refused
    exactly when the check on its arrival would have refused it.
    """

    def __init__(self, round_id: int, schema: Schema, bound: robust.MagnitudeBound, keep: bool = False) -> None:
        self.round_id = round_id
        self.schema = schema
        self.bound = bound
        self.keep = keep  # every contribution stays held, never summed (robust aggregation: robust.py)
        self.members: list = []
        self.masses: list[float] = []
        self.mass = 0.0
        self.held: list[tuple[np.ndarray, ...]] = []
        self.image: SumImage | None = None
        self.refused: list[tuple[object, str]] = []  # (member, why), for the tier to drain

    def add(self, member: object, mass: float, tensors: Sequence[np.ndarray], images: ImageCache) -> None:
        """Count ``member``'s mass-premultiplied ``tensors`` and its ``mass`` in the round."""
        self.promote(images)
        if self.image is None:
            self.held.append(tuple(tensors))
        else:
            self.image.add(tensors)
        self.members.append(member)
        self.masses.append(mass)
        self.mass += mass

    def promote(self, images: ImageCache) -> None:
        """Sum two held contributions into the tier's image (no-op otherwise); a non-finite one is refused."""
        if len(self.held) == 2 and not self.keep:
            image = images.get(self.schema)[0]
            if self.judge(image.fill_sum(*self.held)):
                return
            self.image = image
            self.held = []

    def judge(self, read: Read) -> bool:
        """Refuse the held contributions ``read`` found over the magnitude bound, else (a sum not finite)
        those with a non-finite element; True if any was refused (sum again without it)."""
        over = {i: f"its deposit {why}" for i, (top, mass) in enumerate(zip(read.tops, self.masses, strict=True))
                if (why := robust.magnitude_refusal(top, mass, self.bound)) is not None}
        if over:
            self.refuse(over)
        elif read.bad:
            self.refuse_held()
        return bool(over) or read.bad

    def judge_unread(self) -> bool:
        """``judge`` the held contributions by a read of their own (no summing pass reads them)."""
        return self.judge(Read(False, tuple(robust.magnitude(h) for h in self.held)))

    def refuse_mass_outliers(self) -> None:
        """Refuse the held contributions whose mass is far above the others' (``robust.mass_outliers``), once
        those the magnitude bound refuses are out: such a deposit was never in the round to compare with."""
        if robust.mass_outliers(self.masses) and not self.keep:  # kept ones were measured on arrival
            self.judge_unread()
        self.refuse({i: robust.mass_refusal(self.masses[i]) for i in robust.mass_outliers(self.masses)})

    def refuse_held(self) -> None:
        """Take the held contributions with a non-finite element out of the round (into ``refused``).

        Held ones are the round's first members. When none has one, their sum
        overflowed f32 from finite elements, which no honest deposit comes near
        (values ~1e38): all of them are refused.
        """
        bad = [i for i, h in enumerate(self.held) if not _all_finite(h)] or list(range(len(self.held)))
        self.refuse(dict.fromkeys(bad, "its deposit carries a NaN or infinite element (or values so large "
                                       "the f32 sum overflows); it would poison every rank's consensus"))

    def refuse(self, whys: dict[int, str]) -> None:
        """Take the held contributions at the indices of ``whys`` out of the round, each with its why."""
        for i in sorted(whys, reverse=True):
            member, _ = self.members.pop(i), self.masses.pop(i)
            del self.held[i]
            self.refused.append((member, whys[i]))
        self.mass = sum(self.masses)  # in arrival order, as it was added up


def _all_finite(tensors: Sequence[np.ndarray]) -> bool:
    try:
        check_finite(tensors, "")
    except PoisonedDeposit:
        return False
    return True


def contribute(
    rnd: OpenRound | None,
    round_id: int,
    member: object,
    mass: float,
    tensors: Sequence[np.ndarray],
    images: ImageCache,
    who: str,
    error: type[ProtocolError],
    bound: robust.MagnitudeBound,
    keep: bool = False,
) -> OpenRound:
    """Add one contribution to ``rnd``, or open round ``round_id`` with its schema; returns the round.

    The mass, the schema and the values (all finite, none over ``bound``'s limit
    per unit of mass: flodl_zmq/robust.py) are checked before anything is added, so a
    refused contribution leaves the round as it was; the values of one held for
    a sum are checked by the pass that sums it (``OpenRound.judge``).
    """
    m = robust.check_mass(mass, who, error)
    schema = schema_of(tensors, who, error) if rnd is None else None
    if rnd is not None:
        check_schema(rnd.schema, tensors, who, error)
    if keep or (rnd is not None and (rnd.image is not None or len(rnd.held) == 2)):
        check_finite(tensors, who)  # it goes into the image (or is kept whole): checked before it touches it
        robust.check_magnitude(tensors, m, bound, who)
    if rnd is None:
        rnd = OpenRound(round_id, schema, bound, keep)
    rnd.add(member, m, tensors, images)
    return rnd


class FoldStation:
    """The fold barrier of one host: deposits and deaths in, at most one HostFold per round out.

    Feed it from the relay's data channel: ``deposit`` for each authenticated
    RoundFrame, ``mark_dead`` for each local rank exit or DeclareDead from the
    reducer. Either call returns the HostFold to ship when it completes the
    round, NothingToShip once every rank is dead with nothing pending, else None.
    """

    def __init__(self, roster: Iterable[int], unfolded: bool = False) -> None:
        self.unfolded = unfolded  # ship each rank's deposit as it came, at the barrier (a robust aggregation)
        self.roster = frozenset(int(r) for r in roster)
        if not self.roster:
            raise ConfigError("a fold station needs at least one local rank: give the relay a non-empty rank list")
        self.dead: set[int] = set()
        self.refused: list[tuple[int, str]] = []  # (rank, why) refused for a poisoned deposit: the relay drains it
        self.counters = FoldCounters()
        self.last_round: int | None = None
        self._round: OpenRound | None = None
        self.bound = robust.MagnitudeBound()  # largest value per unit of mass a deposit may carry (robust.py)
        # Images and 2-byte output buffers by schema (f32 tensors ship straight from the sums).
        self._images = ImageCache(_fold_outputs)

    @property
    def round_id(self) -> int | None:
        """The round being folded, or None between rounds."""
        return self._round.round_id if self._round else None

    def consensus_seen(self, tensors: Sequence[np.ndarray]) -> None:
        """Bound later deposits by the consensus the ranks now hold (read only if one needs it: keep it as is)."""
        self.bound.seen(tensors)

    def deposit(self, rank: int, round_id: int, mass: float,
                tensors: Sequence[np.ndarray]) -> HostFold | NothingToShip | None:
        """Fold one rank's authenticated, mass-premultiplied deposit for ``round_id``; FoldError (the
        station unchanged) for a deposit that breaks a rule of the round (module docstring)."""
        who = f"relay fold: rank {rank} (round {round_id})"
        if rank not in self.roster:
            raise FoldError(f"{who}: rank is not on this host's roster {sorted(self.roster)}")
        if rank in self.dead:
            # A frame that raced its rank's death: the barrier already let go of it.
            self.counters.late_drops += 1
            return None
        rnd = self._round
        if not round_gate(round_id, self.last_round, rnd, rank, self.counters, who, FoldError):
            return None
        if rnd is not None and (rnd.image is not None or len(rnd.held) == 2) and \
                robust.mass_outlier(float(mass), rnd.masses):
            raise PoisonedDeposit(f"{who}: {robust.mass_refusal(float(mass))}")  # it would go into the sums
        self._round = contribute(rnd, round_id, rank, mass, tensors, self._images, who, FoldError, self.bound,
                                 self.unfolded)
        if self._round.image is None:  # the held pair is judged together: either may be the liar
            self._round.refuse_mass_outliers()
        self.counters.deposits += 1
        self.counters.bytes_folded += sum(t.nbytes for t in tensors)
        self._note_refused(self._round)
        done = self._take_if_complete()
        if done is None and self._round is not None:
            self._round.promote(self._images)  # sum while the other ranks compute
            if self._note_refused(self._round):
                done = self._take_if_complete()
        return done

    def _note_refused(self, rnd: OpenRound) -> bool:
        """Move ``rnd``'s refused ranks out of every barrier and into ``refused``; True if there were any."""
        for rank, why in rnd.refused:
            self.dead.add(rank)
            self.refused.append((rank, why))
        got = bool(rnd.refused)
        rnd.refused.clear()
        return got

    def awaits(self, rank: int, round_id: int) -> bool:
        """Whether live ``rank``'s deposit for unshipped ``round_id`` is missing (lost: ask for it again)."""
        if rank not in self.roster or rank in self.dead:
            return False
        if self.last_round is not None and round_id <= self.last_round:
            return False
        rnd = self._round
        return rnd is None or (rnd.round_id == round_id and rank not in rnd.members)

    def hold(self, outputs: Sequence[np.ndarray], sending: Sending) -> None:
        """A HostFold's ``outputs`` go up without a copy: later rounds sum into other buffers until ``sending``
        is done (ImageCache.hold)."""
        self._images.hold(outputs, sending)

    def mark_dead(self, rank: int) -> HostFold | NothingToShip | None:
        """Take ``rank`` out of every later barrier (idempotent); its merged work stays counted."""
        if rank not in self.roster:
            raise FoldError(f"relay fold: DeclareDead for rank {rank}, which is not on this host's roster "
                            f"{sorted(self.roster)} (controller and relay disagree on the world)")
        if rank in self.dead:
            return None
        self.dead.add(rank)
        return self._take_if_complete()

    def _take_if_complete(self) -> HostFold | NothingToShip | None:
        while True:  # again after a refusal: the round is then computed without the culprit
            rnd = self._round
            if rnd is None:
                if self.dead == self.roster:
                    return NothingToShip(f"every local rank {sorted(self.roster)} is gone (left or dead); "
                                         "no round is pending")
                return None
            if any(r not in self.dead and r not in rnd.members for r in self.roster):
                return None
            if rnd.keep and rnd.members:
                order = sorted(range(len(rnd.members)), key=rnd.members.__getitem__)
                self._round, self.last_round = None, rnd.round_id
                self.counters.rounds_shipped += 1
                return HostFold(rnd.round_id, rnd.mass, tuple(rnd.members[i] for i in order),
                                tuple(t for i in order for t in rnd.held[i]), True, tuple(rnd.masses[i] for i in order))
            image, outputs = self._images.get(rnd.schema) if len(rnd.held) != 1 else (None, [])
            if len(rnd.held) == 2 and rnd.judge(image.encode_sum_into(*rnd.held, outputs)) or \
                    len(rnd.held) == 1 and rnd.judge_unread():  # shipped unread, but measured as on arrival
                self._note_refused(rnd)
                continue
            if not rnd.members:  # every deposit of the round was refused
                self._round, self.last_round = None, rnd.round_id
                continue
            self._round = None
            self.last_round = rnd.round_id
            self.counters.rounds_shipped += 1
            ranks = tuple(sorted(rnd.members))
            if len(rnd.held) == 1:
                # Unread here, so unchecked: the reducer checks it, and refusing this host
                # there refuses the one live rank that deposited it.
                return HostFold(rnd.round_id, rnd.mass, ranks, rnd.held[0], verbatim=True)
            assert image is not None
            if not rnd.held:
                image.encode_into(outputs)
            return HostFold(rnd.round_id, rnd.mass, ranks, tuple(outputs), verbatim=False)
