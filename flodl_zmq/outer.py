"""The outer optimizer: a step the reducer takes on each consensus (DiLoCo, SlowMo).

A core: no sockets, no clocks. It holds the global model and its momentum
(both f32, flat, in payload order) and turns each round's weighted average
into the next global model, in place:

    d      = base - average                  (the pseudo-gradient: what the window undid)
    buf    = momentum * buf + d
    update = d + momentum * buf              ("nesterov", DiLoCo) or buf ("momentum", SlowMo)
    global = global - lr * update
    base   = global as the wire carries it   (what the ranks start the next window from)

With lr 1 and momentum 0 the average itself is the new global model, which is
what ``outer="none"`` does without this object. torch's ``SGD(nesterov=True)``
gives the same numbers (its first buffer is ``d``, which ``0 * 0 + d`` is too).

Rules this module keeps:

- The state is f32 whatever the wire carries: a bf16 average is widened,
  stepped and encoded back, and the kept global is never rounded, so wire
  rounding does not accumulate in the global model.
- The pseudo-gradient is measured from ``base``, the model the ranks started
  the window from: the consensus as they widened it (bf16, or int8 with the
  reducer's error feedback, given by ``published``), not the unrounded
  global. Measured from the global, each round's downlink rounding would
  enter the pseudo-gradient as if the ranks had trained it, and the outer
  momentum would carry it on for rounds. With an f32 wire both are equal.
- The global model starts as the run's initial model (or the resumed one): the
  first round's pseudo-gradient is then the first window's change, as in the
  paper, not a step skipped.
- A consensus that does not have the model's size is refused (ProtocolError):
  the step must never mix two models.
- Only the model's parameters are stepped (the first ``stepped`` values, in
  payload order, flodl_zmq/payload.py). Its float buffers take the round's
  average: BatchNorm's running statistics are estimates of the data, not a
  descent direction, and extrapolating them (momentum, or an lr above 1) drives
  a running variance below zero, after which every eval reads NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from flodl_zmq.errors import ConfigError, ProtocolError
from flodl_zmq.shards import state_of
from flodl_zmq.tensors import ELEMENTS, element_of
from flodl_zmq.wire_format import INT8

if TYPE_CHECKING:
    from flodl_zmq.wire.records import ShardStart

F32_ELEMENT = ELEMENTS["f32"]

OUTERS = ("none", "nesterov", "momentum")
# DiLoCo's (Douillard et al. 2023) outer Nesterov; SlowMo's (Wang et al. 2020) slow
# momentum with its slow learning rate 1 and a momentum in its best range (0.6-0.8).
DEFAULTS: dict[str, tuple[float, float]] = {"nesterov": (0.7, 0.9), "momentum": (1.0, 0.7)}


@dataclass(frozen=True)
class OuterConfig:
    """Which outer step and its hyperparameters (``lr`` > 0, 0 <= ``momentum`` < 1)."""

    kind: str
    lr: float
    momentum: float

    def __post_init__(self) -> None:
        if self.kind not in DEFAULTS:
            raise ConfigError(f"outer = {self.kind!r}: an outer step is one of {sorted(DEFAULTS)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"outer_lr = {self.lr!r}: must be a finite number > 0")
        if not (math.isfinite(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ConfigError(f"outer_momentum = {self.momentum!r}: must be in [0, 1)")

    @classmethod
    def of(cls, kind: str, lr: float | None, momentum: float | None) -> OuterConfig | None:
        """The configuration of ``outer=kind`` (None for "none"), defaults filled in per kind."""
        if kind not in OUTERS:
            raise ConfigError(f"outer = {kind!r}: must be one of {OUTERS}")
        if kind == "none":
            if lr is not None or momentum is not None:
                raise ConfigError(
                    "outer_lr and outer_momentum need an outer step: set outer='nesterov' or "
                    "outer='momentum', or drop them"
                )
            return None
        d_lr, d_mom = DEFAULTS[kind]
        return cls(kind, d_lr if lr is None else float(lr), d_mom if momentum is None else float(momentum))


def outer_from_start(start: ShardStart, payload: Sequence[np.ndarray], who: str) -> OuterOptimizer:
    """A host shard's outer step from its start (PROTOCOL.md 10.9 item 11): the fields name the step, the
    frames hold the slice's global model then its momentum (`shards.state_frames`); a ProtocolError for a start
    that does not (the controller's reducer signed it: two builds that disagree on the spec)."""
    try:
        config = OuterConfig(start.outer, start.lr, start.momentum)
    except ConfigError as exc:
        raise ProtocolError(f"{who}: its start names an outer step it cannot take: {exc}") from None
    state = state_of(payload)
    if state is None:
        raise ProtocolError(f"{who}: its start's {len(payload)} payload frames are not the slice's model then its "
                            "momentum, f32, 1-D, the same shapes frame by frame")
    try:
        return OuterOptimizer(config, *state, start.stepped)
    except ConfigError as exc:
        raise ProtocolError(f"{who}: its start: {exc}") from None


class OuterOptimizer:
    """The global model and its momentum; ``step`` turns a round's average into the next global model."""

    def __init__(self, config: OuterConfig, global_model: np.ndarray, momentum: np.ndarray | None = None,
                 stepped: int | None = None) -> None:
        """`stepped`: how many leading values are parameters (`payload.parameter_count`); None: all of them.
        A shard's slice may hold none (0): its values are buffers, averaged."""
        self.config = config
        self.global_model = np.array(global_model, dtype=np.float32).reshape(-1)
        self.stepped = self.global_model.size if stepped is None else stepped
        self.momentum = np.zeros_like(self.global_model) if momentum is None else (
            np.array(momentum, dtype=np.float32).reshape(-1))
        if self.momentum.size != self.global_model.size:
            raise ConfigError(
                f"outer momentum has {self.momentum.size} values for a model of {self.global_model.size}: "
                "it was saved for another model; resume with the model it was saved with"
            )
        if not 0 <= self.stepped <= self.global_model.size:
            raise ConfigError(f"outer step over {self.stepped} parameter values of {self.global_model.size}: "
                              "more than there are values")
        self.momentum[self.stepped:] = 0.0  # the buffers are averaged, never stepped
        self.base = self.global_model.copy()  # the ranks start from the run's initial (or resumed) model
        self._scratch = np.empty_like(self.global_model)
        self._lookahead = np.empty_like(self.global_model) if config.kind == "nesterov" else None

    def part(self, values: range) -> OuterOptimizer:
        """The outer step over `values` of this model, from its global model and momentum: a reducer shard's
        at the run's start, when the base is the global model (PROTOCOL.md 10.9 item 11). Position by
        position, so the shards' steps are this one's, value for value."""
        stepped = min(max(self.stepped - values.start, 0), len(values))
        return OuterOptimizer(self.config, self.global_model[values.start : values.stop],
                              self.momentum[values.start : values.stop], stepped)

    def step(self, consensus: Sequence[np.ndarray]) -> None:
        """Replace ``consensus`` (the round's weighted average, f32 or bf16) with the next global model."""
        sizes = [t.size for t in consensus]
        if sum(sizes) != self.global_model.size:
            raise ProtocolError(
                f"outer step: the consensus has {sum(sizes)} values but the model {self.global_model.size}"
            )
        offset = 0
        for t, n in zip(consensus, sizes, strict=True):
            part = slice(offset, offset + n)
            offset += n
            d = self._scratch[part]
            flat = t.reshape(-1)
            element = element_of(t)
            if element.widen is None or element.encode is None:
                raise ProtocolError(f"outer step: a {element.name} consensus cannot be stepped (an int8 "
                                    "payload is widened to f32 first)")
            base = self.base[part]
            # An f32 consensus is read as it is: widening it would be one more pass over the model.
            np.subtract(base, flat if element is F32_ELEMENT else element.widen(flat, d), out=d)
            cut = min(max(self.stepped - part.start, 0), n)  # this chunk's parameter values
            if cut:
                self._apply(d[:cut], self.global_model[part][:cut], self.momentum[part][:cut],
                            slice(part.start, part.start + cut))
            np.subtract(base[cut:], d[cut:], out=self.global_model[part][cut:])  # the buffers: the average
            # The ranks load the consensus in its element: measure the next pseudo-gradient from that.
            element.encode(self.global_model[part], flat)
            element.widen(flat, base)

    def published(self, payload: Sequence[np.ndarray]) -> None:
        """The stepped consensus as the int8 wire re-encoded it (values, scales per tensor): the ranks
        load it widened, so the next pseudo-gradient is measured from that."""
        if not INT8.is_payload(payload) or INT8.numel(payload) != self.base.size:
            raise ProtocolError(f"outer step: the published consensus is not an int8 payload of the model's "
                                f"{self.base.size} values")
        INT8.widen(payload, self.base)

    def _apply(self, d: np.ndarray, g: np.ndarray, buf: np.ndarray, part: slice) -> None:
        """``g -= lr * update`` for pseudo-gradient ``d`` (overwritten), momentum ``buf`` updated."""
        mu, lr = np.float32(self.config.momentum), np.float32(self.config.lr)
        buf *= mu
        buf += d
        if self._lookahead is not None:
            ahead = self._lookahead[part]
            np.multiply(buf, mu, out=ahead)
            d += ahead
        else:
            np.copyto(d, buf)
        d *= lr
        g -= d

