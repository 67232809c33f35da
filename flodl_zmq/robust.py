"""Rules against finite poison, and the robust aggregations (PROTOCOL.md 9.5).

A core: no sockets, no clocks. The fold (flodl_zmq/fold.py) and the reducer
(flodl_zmq/reducer.py) apply the deposit rules to every contribution before
it touches a round; ``aggregate`` is the coordinate-wise rule over a stack of
per-rank deposits.

Rules this module keeps:

- Mass: finite, >= 0, and a positive mass is a normal f32 magnitude (``check_mass``).
- Magnitude: a contribution's largest value, per unit of its mass, may be at
  most MAGNITUDE_RATIO times the largest value of the consensus the tier last
  saw (and at least MAGNITUDE_RATIO itself, so a first round or a model of
  tiny values is not refused). An honest round moves a model by a step of
  its optimizer, never by six orders of magnitude; a finite 1e18 or 1e30
  would replace every rank's model. int8 is checked widened, so a scale
  whose values would pass that bound is refused the same way. Since the
  bound is never below MAGNITUDE_RATIO, the consensus is read only for a
  contribution above that (``MagnitudeBound``): an honest round pays one
  read of each contribution, not one more of every consensus.
- Mass among peers: a mass more than MASS_RATIO times the median of the
  other masses of the round (at least 1) is refused: a rank claiming work
  its host-mates are nowhere near would take the host's weight, and the
  reducer's cap (per host) cannot tell which rank lied.
- Non-finite values are not this module's: the finite checks own them, with
  their own message, so a NaN is never reported as a magnitude.
- The checks are one vectorised read of the contribution (max and min per
  block, in cache), spread over the worker threads. A fold tier need not
  make it a read of its own: the pass that sums a held contribution measures
  each block as it adds it (``block_bound``, flodl_zmq/sums.py: for f32, by
  x.x wherever that shows the block far within every limit) and the tier
  judges it by ``magnitude_refusal`` then, with the same decision.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import numpy as np

from flodl_zmq import int8, threads
from flodl_zmq.errors import PoisonedDeposit, ProtocolError
from flodl_zmq.settings import AGGREGATIONS
from flodl_zmq.tensors import bf16_tops, dtype_name, element_of

# A positive mass must be a normal f32 magnitude: tensors are premultiplied by it
# in f32, so a smaller mass flushes its contribution to zero while still
# counting in the divisor, and the reducer's f32 divide would turn it into NaN.
_F32 = np.finfo(np.float32)
MASS_RANGE = (float(_F32.tiny), float(_F32.max))
MAGNITUDE_RATIO = 1e6
MASS_RATIO = 1024.0
# Elements per block of a magnitude read: 1 MiB of f32, so min reads what max left in cache.
_BLOCK = 1 << 18

# trimmed_mean drops this fraction of the rows at each end of every coordinate (at least one
# row each side when there are three or more), so one rank in four is trimmed away.
TRIM = 0.25


def check_mass(mass: float, who: str, error: type[ProtocolError]) -> float:
    """The mass as a float; anything but 0 or a normal f32 magnitude raises ``error``."""
    m = float(mass)
    if not math.isfinite(m) or m < 0.0:
        raise error(f"{who} carries mass {mass!r}; a realized-work mass must be finite and >= 0")
    if m != 0.0 and not MASS_RANGE[0] <= m <= MASS_RANGE[1]:
        raise error(
            f"{who} carries mass {mass!r}; a positive mass must lie in [{MASS_RANGE[0]:g}, "
            f"{MASS_RANGE[1]:g}] because tensors are premultiplied by it in f32"
        )
    return m


def block_magnitude(x: np.ndarray) -> float:
    """The largest absolute value of one block (f32, f16 or bf16 bits); NaN or inf if one is."""
    if not x.size:
        return 0.0
    if x.dtype == np.uint16:  # bf16 bits, read without a temporary: the magnitude's bits are the low 15
        pos, neg = bf16_tops(x)
        top = max(pos, neg - 0x8000 if neg >= 0x8000 else 0)
        return float(np.array(top << 16, np.uint32).view(np.float32))
    with np.errstate(invalid="ignore"):
        return float(max(np.max(x), -np.min(x)))


# A block whose x.x is at most this has no value above MAGNITUDE_RATIO / 2 (x.x bounds the square
# of each value, with room for the f32 sum's rounding): below every limit, so the root stands in.
_WITHIN_SQ = (MAGNITUDE_RATIO / 2) ** 2


def block_bound(x: np.ndarray) -> float:
    """``block_magnitude``, or for an f32 block whose values are all far within every limit the root of
    x.x (at least the largest value, up to f32 rounding): the fused checks' measure.

    Below every limit no value is refused (``magnitude_refusal``) and no sum of
    two overflows, so the exact value would decide nothing more. x.x is BLAS,
    one pass at about half the cost of a max and a min pass; only a block that
    could matter (or holds a NaN or inf) is read again, exactly.
    """
    if x.dtype == np.float32 and x.size:
        square = float(np.dot(x, x))
        if square <= _WITHIN_SQ:
            return math.sqrt(square)
    return block_magnitude(x)


def magnitude(tensors: Sequence[np.ndarray]) -> float:
    """The largest absolute value in ``tensors`` (f32, f16, bf16 bits, or int8 pairs); NaN if one is NaN."""
    if tensors and int8.is_int8(tensors):  # values never exceed QMAX steps of their block's scale
        return int8.QMAX * magnitude(tensors[1::2])
    work = []
    for t in tensors:
        dtype_name(t)  # refuses a dtype no wire format carries
        flat = t.reshape(-1)
        work += [flat[i : i + _BLOCK] for i in range(0, flat.size, _BLOCK)]
    return largest(threads.each(block_magnitude, work))


def largest(values: Iterable[float]) -> float:
    """The largest of ``values`` (0.0 for none), NaN if one is: a NaN is never hidden behind a finite value."""
    return max(values, key=lambda v: math.inf if math.isnan(v) else v, default=0.0)


def magnitude_limit(reference: float | None) -> float:
    """The largest value per unit of mass a contribution may carry, given the last consensus's ``magnitude``."""
    ref = reference if reference is not None and math.isfinite(reference) else 0.0
    return MAGNITUDE_RATIO * max(1.0, ref)


class MagnitudeBound:
    """A tier's magnitude bound: ``magnitude_limit`` of the last consensus it saw, read only when needed.

    The bound is never below MAGNITUDE_RATIO, so a contribution within that
    per unit of its mass passes whatever the consensus holds. The consensus is
    therefore measured (a read of the whole model) only when a contribution
    goes above MAGNITUDE_RATIO, which an honest one never does, and then once:
    the round's hot path reads each contribution and never the consensus.
    """

    def __init__(self) -> None:
        self._consensus: Sequence[np.ndarray] = ()
        self._limit: float | None = magnitude_limit(None)

    def seen(self, consensus: Sequence[np.ndarray]) -> None:
        """Bound later contributions by ``consensus``: the caller keeps its arrays unchanged until the next
        ``seen`` (or until ``limit`` has read them), since they are read only then."""
        self._consensus, self._limit = consensus, None

    def limit(self) -> float:
        """The largest value per unit of mass a contribution may carry (MAGNITUDE_RATIO at the least)."""
        if self._limit is None:
            self._limit = magnitude_limit(magnitude(self._consensus))
            self._consensus = ()  # read: the tier need not keep the consensus alive for it
        return self._limit


def magnitude_refusal(top: float, mass: float, bound: MagnitudeBound) -> str | None:
    """Why a contribution whose largest value is ``top`` at ``mass`` is refused under ``bound``; None if not.

    Tensors are premultiplied by the mass, so the bound scales with it (a mass
    below 1 counts as 1: an int8 sender's error feedback ships a residual even
    at mass 0). A non-finite ``top`` is left to the finite checks. A value within
    MAGNITUDE_RATIO per unit of mass is within every limit, so only one above
    it has the consensus measured (``MagnitudeBound``).
    """
    scale = max(1.0, mass)
    if not math.isfinite(top) or top <= MAGNITUDE_RATIO * scale:
        return None
    limit = bound.limit()
    if top <= limit * scale:
        return None
    return (f"carries a value of magnitude {top:.3g} at mass {mass:g}, over {limit:.3g} per unit of mass "
            f"({MAGNITUDE_RATIO:g} times the last consensus's largest value): a diverged or tampered model would "
            "replace every rank's (check the learning rate, or who holds the session key)")


def check_magnitude(tensors: Sequence[np.ndarray], mass: float, bound: MagnitudeBound, who: str) -> None:
    """Raise PoisonedDeposit if ``tensors`` hold a finite value above ``bound``'s limit per unit of ``mass``
    (``magnitude_refusal``)."""
    why = magnitude_refusal(magnitude(tensors), mass, bound)
    if why is not None:
        raise PoisonedDeposit(f"{who} {why}")


def mass_outlier(mass: float, others: Sequence[float]) -> bool:
    """Whether ``mass`` is over MASS_RATIO times the median of ``others`` (at least 1)."""
    return bool(others) and mass > MASS_RATIO * max(1.0, statistics.median(others))


def mass_outliers(masses: Sequence[float]) -> list[int]:
    """Indices of the masses over MASS_RATIO times the median of the others."""
    return [i for i, m in enumerate(masses) if mass_outlier(m, [*masses[:i], *masses[i + 1:]])]


def mass_refusal(mass: float) -> str:
    """Why a mass found by ``mass_outliers`` is refused."""
    return (f"its mass {mass:g} is over {MASS_RATIO:g} times the median of its host-mates' in the round "
            "(claimed work no peer is near: a tampered or desynced rank)")


def trimmed(n: int) -> int:
    """Rows trimmed at each end of a coordinate under ``trimmed_mean`` from ``n`` rows."""
    return max(1, int(n * TRIM)) if n >= 3 else 0


def aggregate(rows: np.ndarray, rule: str) -> np.ndarray:
    """The coordinate-wise ``rule`` over ``rows`` (n, d) f32: one row per rank, each its own model.

    ``mean`` is today's average (for rows already divided by their mass);
    ``trimmed_mean`` sorts each coordinate, drops ``trimmed(n)`` rows at each
    end and averages the rest; ``median`` is the coordinate-wise median. A
    minority of arbitrary rows moves neither outside the honest rows' range.
    """
    if rows.ndim != 2 or not rows.shape[0]:
        raise ValueError(f"aggregate needs a non-empty (ranks, values) stack, got shape {rows.shape}")
    if rule == "median":
        return np.median(rows, axis=0).astype(np.float32, copy=False)
    if rule not in ("mean", "trimmed_mean"):
        raise ValueError(f"aggregation {rule!r} is not one of {AGGREGATIONS}")
    k = trimmed(rows.shape[0]) if rule == "trimmed_mean" else 0
    kept = np.sort(rows, axis=0)[k : rows.shape[0] - k] if k else rows
    # Summed in f64: the f32 result then never leaves the range of the values averaged.
    return np.mean(kept, axis=0, dtype=np.float64).astype(np.float32)


def combine(deposits: Sequence[Sequence[np.ndarray]], masses: Sequence[float], rule: str,
            outputs: Sequence[np.ndarray]) -> None:
    """``rule`` over the ranks' models, written into ``outputs`` (the consensus, in their elements).

    Each deposit is premultiplied by its mass, so its model is the deposit
    divided by it; a deposit of mass 0 did no work and holds no model (all of
    them: the consensus is zeros, which a mass-0 round's receivers ignore).
    The models are widened into one (ranks, values) f32 stack: a robust rule
    needs every rank's value of each coordinate at once.
    """
    worked = [(d, m) for d, m in zip(deposits, masses, strict=True) if m > 0.0]
    total = sum(o.size for o in outputs)
    rows = np.empty((len(worked), total), np.float32)
    for row, (tensors, m) in zip(rows, worked, strict=True):
        at = 0
        for t in tensors:
            part = row[at : at + t.size]
            element_of(t).widen(t.reshape(-1), part)
            np.divide(part, np.float32(m), out=part)
            at += t.size
    consensus = aggregate(rows, rule) if worked else np.zeros(total, np.float32)
    at = 0
    for o in outputs:
        element_of(o).encode(consensus[at : at + o.size], o.reshape(-1))
        at += o.size
