"""Records to ZeroMQ multipart messages and back: `[header, payload..., mac]`.

Rules this module keeps (normative text: protocol/PROTOCOL.md):

- The header is one msgpack map; tensor bytes are never inside it. Each
  payload frame is described in the header (dtype, shape, byte length) and
  travels as its own frame, sent from and received into the caller's buffers
  without a copy.
- Decoding checks, in this order, and raises on the first failure: frame
  count, header size, msgpack well-formedness under limits, protocol version,
  header schema, payload descriptors against the frames (count, length,
  shape), limits, then
    1. the MAC (AuthError),
    2. incarnation (the header's `run`), channel, record kind and fields,
    3. attribution: the authenticated signer is the one the frame's route
       names (AttributionError; `decode_from` only),
    4. the sequence (ReplayError).
  Cheap structural checks come before the MAC so a flood of junk costs no
  hashing. Attribution comes after the MAC, so a forgery is reported as the
  MAC failure it is, not blamed on a peer; the sequence comes last, so
  neither a forger nor a peer speaking for another can advance a sender's
  ledger and lock the honest sender out. Every receiver that knows who a
  frame must be from calls `Codec.decode_from`, which keeps this order in
  one place (`_open`).
- Sequence numbers are per sender and per channel, start at 1 and strictly
  increase at the sender. A receiver keeps an anti-replay window per sender
  (`ReplayWindow`): an unseen number within the window is accepted (a resend
  of a lost record, or a reorder), a seen one or one older than the window is
  refused. Only an accepted frame moves it.
- No pickle, no object hooks: msgpack decodes to plain types only.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack
import numpy as np

from flodl_zmq.errors import (
    AttributionError,
    FramingError,
    IncarnationError,
    LimitError,
    ReplayError,
    SchemaError,
    VersionError,
)
from flodl_zmq.tensors import DTYPES, as_numpy, dtype_name
from flodl_zmq.wire import mac as _mac
from flodl_zmq.wire.fields import from_fields, to_fields
from flodl_zmq.wire.records import REGISTRY, Channel, spec_of

PROTOCOL_VERSION = 10
RUN_ID_BYTES = 16  # the run id, and every incarnation id (the header's `run`, PROTOCOL.md 4.1)
SALT_BYTES = 16
MAX_SEQ = 2**63 - 1
MAX_SENDER_CHARS = 256  # the header's `from`, in code points (PROTOCOL.md 3.2)
REPLAY_WINDOW = 4096  # sequence numbers below a sender's highest that may still arrive (PROTOCOL.md 5.1)



def new_incarnation() -> bytes:
    """A fresh incarnation id (PROTOCOL.md 4.1), drawn by whatever starts an incarnation of a run.

    From the OS CSPRNG, never a counter kept in a checkpoint: a resume from an
    older checkpoint would draw a value an earlier incarnation already signed with.
    """
    return os.urandom(RUN_ID_BYTES)


HEADER_KEYS = ("v", "k", "run", "ch", "from", "salt", "seq", "f", "p")
_HEADER_KEYSET = frozenset(HEADER_KEYS)
_HEADER_TYPES = {
    "k": str, "run": bytes, "ch": str, "from": str, "salt": bytes, "seq": int, "f": dict, "p": list,
}


@dataclass(frozen=True)
class Limits:
    """Bounds a receiver enforces before trusting a message (PROTOCOL.md, Limits)."""

    max_header_bytes: int = 1 << 20
    max_payload_frames: int = 65_536
    max_payload_bytes: int = 1 << 32
    max_dims: int = 8
    max_depth: int = 8
    max_str_bytes: int = 1 << 20
    max_items: int = 1 << 20

    def unpack_kwargs(self) -> dict[str, int]:
        return {
            "max_str_len": self.max_str_bytes,
            "max_bin_len": self.max_str_bytes,
            "max_array_len": self.max_items,
            "max_map_len": self.max_items,
            "max_ext_len": 0,
        }


@dataclass
class Envelope:
    """A decoded, authenticated message."""

    record: Any
    kind: str
    channel: Channel
    sender: str
    seq: int
    incarnation: bytes  # the header's `run`
    payload: list[np.ndarray]  # read-only views over the received frames
    dtypes: list[str]
    # As received, for verbatim forwarding; empty for a by-reference message, which cannot leave its host.
    frames: list[Any] = field(repr=False)


class ReplayWindow:
    """Which sequence numbers of one (channel, sender) were accepted: an anti-replay window (pure).

    Keeps the highest accepted number `top` and a bitmap of the `size` numbers
    at and below it. A number above `top`, or an unseen one within the window,
    is accepted: a record resent after a connection reset, or overtaken by a
    later one, must not be refused. A number already accepted is a replay, and
    one at or below `top - size` can no longer be told from one: both refused.
    """

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"a replay window holds at least 1 sequence number, got {size}")
        self.size = size
        self.top = 0
        self._seen = 0  # bit i: top - i was accepted

    def refusal(self, seq: int) -> str | None:
        """Why `seq` must be refused (a replay, or too old), or None when it is fresh."""
        if seq > self.top:
            return None
        behind = self.top - seq
        if behind >= self.size:
            return f"is {behind} behind the highest accepted ({self.top}), outside the window of {self.size}"
        if self._seen >> behind & 1:
            return "was already accepted: a replayed frame"
        return None

    def accept(self, seq: int) -> None:
        """Record `seq` as accepted (call only after `refusal(seq)` said None)."""
        if seq > self.top:
            shift = seq - self.top
            self._seen = ((self._seen << shift) | 1) & ((1 << self.size) - 1) if shift < self.size else 1
            self.top = seq
        else:
            self._seen |= 1 << (self.top - seq)


@dataclass(frozen=True)
class Attribution:
    """Who must have signed a frame, as the receiver knows it from where the frame arrived.

    The route (a rank's connection, a relay's routing id, the reducer's socket)
    names the signer; a frame's own `from` is believed only when it matches, so
    one key holder cannot speak, deposit or burn sequence numbers for another.
    Build one with `signed_by`, `nobody` or `anyone`.
    """

    route: str  # where the frame arrived, as an error message names it
    signer: str | None  # the one signer the route names; None: it names nobody (an unknown peer)
    rank: int | None = None  # a record with a `rank` field must name this rank: a rank speaks for itself only
    any_signer: bool = False  # a join link before admission: the hello introduces its sender
    scope: str = ""  # the sequence ledger is kept per (scope, signer), so one connection cannot burn another's
    why: str = ""  # why the route names nobody, when the receiver knows more than "no hello registered it"

    @classmethod
    def signed_by(cls, signer: str, route: str, *, rank: int | None = None, scope: str = "") -> Attribution:
        """Frames on `route` must be signed by `signer` (and name `rank`, when their record has one)."""
        return cls(route, signer, rank, False, scope)

    @classmethod
    def nobody(cls, route: str, why: str = "") -> Attribution:
        """`route` names no signer (no hello registered it, or `why`): every frame on it is refused."""
        return cls(route, None, why=why)

    @classmethod
    def anyone(cls, route: str, *, scope: str) -> Attribution:
        """Any signer, its sequence kept per `scope` (the connection) and signer."""
        return cls(route, None, None, True, scope)

    def check(self, kind: str, signer: str, record: Any) -> None:
        """Raise AttributionError unless `signer` (and the record's rank) is what this route names."""
        if self.any_signer:
            return
        if self.signer is None and self.why:
            raise AttributionError(f"{kind} signed by {signer!r} arrived on {self.route}: {self.why}",
                                   kind=kind, signer=signer, expected=None)
        if self.signer is None:
            raise AttributionError(
                f"{kind} signed by {signer!r} arrived on {self.route}, which no peer registered: a peer that "
                "never said hello, or one of another run; start every process of the run from the same launch",
                kind=kind, signer=signer, expected=None,
            )
        if signer != self.signer:
            raise AttributionError(
                f"{kind} signed by {signer!r} arrived on {self.route}, which only {self.signer!r} may use: a "
                "process is speaking for another; check that no two processes share a rank or host name",
                kind=kind, signer=signer, expected=self.signer,
            )
        named = getattr(record, "rank", self.rank)
        if self.rank is not None and named != self.rank:
            raise AttributionError(
                f"{kind} signed by {signer!r} on {self.route} names rank {named}: a rank may only speak for "
                f"itself ({self.rank}); the sending process is misconfigured or forging",
                kind=kind, signer=signer, expected=self.signer,
            )

    def ledger_name(self, signer: str) -> str:
        """The name the sequence ledger keeps `signer`'s numbers under on this route."""
        return f"{self.scope}/{signer}" if self.scope else signer


# Who a frame must be from: fixed by its route, or a rule the decoded record
# completes (a hello names the host it speaks for before any route knows it).
Sender: TypeAlias = Attribution | Callable[[Any], Attribution]


def _map(pairs: list[tuple[Any, Any]]) -> dict[str, Any]:
    """A msgpack map as a dict, refusing a key that is not a str or that appears twice (PROTOCOL.md 3.2).

    The MAC covers the bytes, not their meaning: decoders that kept different
    copies of a repeated key would read one signed header two ways.
    """
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"a map repeats a key ({len(pairs)} entries, {len(out)} distinct keys)")
    for k in out:
        if type(k) is not str:
            raise ValueError(f"map keys must be str, got {type(k).__name__}")
    return out


def _depth(obj: dict | list, limit: int, level: int = 1) -> None:
    """Refuse a container (map or array) at a level above `limit`; the header map is level 1, scalars count not."""
    if level > limit:
        raise SchemaError(f"header nests deeper than {limit} levels")
    for v in obj.values() if isinstance(obj, dict) else obj:
        if isinstance(v, dict | list):
            _depth(v, limit, level + 1)


def tensor_view(t: Any) -> tuple[memoryview, str, list[int]]:
    """Zero-copy (bytes view, wire dtype, shape) of a CPU torch tensor or numpy array.

    A numpy uint16 array is a bf16 payload (its bit pattern), as everywhere in the data plane.
    """
    try:
        arr = as_numpy(t)
        name = dtype_name(arr)
    except TypeError as exc:
        raise SchemaError(f"cannot send this payload: {exc}") from None
    if not arr.flags.c_contiguous:
        raise SchemaError("payloads must be C-contiguous to be sent without a copy (snapshot into a contiguous buffer)")
    return memoryview(arr).cast("B") if arr.size else memoryview(b""), name, list(arr.shape)


class Codec:
    """Encodes this sender's records and decodes (and authenticates) everyone's.

    One Codec per process role and session key. `encode` is safe to call from
    one thread per channel (each channel has its own counter); `decode` and
    `decode_from` keep the replay ledger and belong to the thread that owns the
    receiving socket.
    """

    def __init__(
        self,
        key: bytes,
        incarnation: bytes,
        sender: str,
        limits: Limits | None = None,
        max_ledger: int | None = None,
        *,
        salt: bytes | None = None,
    ):
        """`max_ledger` caps the replay ledger's entries, oldest forgotten first (None: unbounded).

        `salt` is this incarnation's header salt (PROTOCOL.md 3.2, 4.2): 16 bytes
        drawn from the OS CSPRNG for each Codec unless given (test vectors only).
        It keeps the payload MAC's one-time keys unique even when a restarted
        process reuses a sender name, incarnation id and session key: two
        encoders never sign the same header, so never share a (GCM key, nonce) pair.

        `incarnation` is the header's `run` (PROTOCOL.md 4.1): the id of the run's
        incarnation this process belongs to, fresh at every controller start and
        re-form, so nothing signed in an earlier one is accepted here.

        A codec whose ledger names come from strangers (the join socket before
        admission, scoped per connection) needs it: else every new routing id
        grows it for good. A forgotten entry only reopens that connection's
        pre-admission replay window.
        """
        self.key = _mac.check_key(key)
        if len(incarnation) != RUN_ID_BYTES:
            raise SchemaError(f"incarnation id must be {RUN_ID_BYTES} bytes, got {len(incarnation)}")
        self.incarnation = bytes(incarnation)
        if salt is None:
            salt = os.urandom(SALT_BYTES)
        if not isinstance(salt, bytes | bytearray) or len(salt) != SALT_BYTES:
            raise SchemaError(f"header salt must be {SALT_BYTES} bytes")
        self.salt = bytes(salt)
        self.sender = sender
        self.limits = limits or Limits()
        self._unpack_kwargs = self.limits.unpack_kwargs()
        self._seq = {ch: itertools.count(1) for ch in Channel}
        self._windows: dict[tuple[str, str], ReplayWindow] = {}
        self._max_ledger = max_ledger

    # ------------------------------------------------------------------ encode

    def encode(
        self,
        rec: Any,
        payload: Sequence[Any] = (),
        *,
        channel: Channel | None = None,
        dtypes: Sequence[str] | None = None,
    ) -> list[Any]:
        """Frames `[header, payload..., mac]` for `rec`; payload buffers are referenced, not copied.

        `dtypes`, when given, states what each payload must hold; a mismatch is refused
        rather than sent, so a caller's schema drift shows at the sender.
        """
        header, views = self._header(rec, payload, channel, dtypes)
        return [header, *views, _mac.compute_mac(self.key, header, views)]

    def encode_reference(
        self,
        rec: Any,
        payload: Sequence[Any],
        locator: bytes,
        *,
        channel: Channel | None = None,
        dtypes: Sequence[str] | None = None,
    ) -> tuple[bytes, bytes]:
        """`(header, mac)` of `rec` whose payload lies where `locator` says (PROTOCOL.md 3.5).

        The MAC covers the header (which describes every payload frame) and the
        locator, not the payload bytes: those are guarded by the segment's owner
        and mode, which the receiver checks.
        """
        header, _ = self._header(rec, payload, channel, dtypes)
        return header, _mac.reference_mac(self.key, header, locator)

    def _header(
        self, rec: Any, payload: Sequence[Any], channel: Channel | None, dtypes: Sequence[str] | None
    ) -> tuple[bytes, list[memoryview]]:
        spec = spec_of(rec)
        ch = channel or spec.channels[0]
        if ch not in spec.channels:
            raise SchemaError(f"{spec.kind} does not travel on the {ch.value} channel")
        if bool(payload) and not spec.carries_payload:
            raise SchemaError(f"{spec.kind} carries no tensor payload")
        views, descs = [], []
        for i, t in enumerate(payload):
            view, name, shape = tensor_view(t)
            if dtypes is not None and dtypes[i] != name:
                raise SchemaError(f"payload {i} declared {dtypes[i]} but holds {name}")
            views.append(view)
            descs.append([name, shape, view.nbytes])
        header = msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "k": spec.kind,
                "run": self.incarnation,
                "ch": ch.value,
                "from": self.sender,
                "salt": self.salt,
                "seq": next(self._seq[ch]),
                "f": to_fields(rec),
                "p": descs,
            },
            use_bin_type=True,
        )
        return header, views

    # ------------------------------------------------------------------ decode

    def decode(self, frames: Sequence[Any], channel: Channel, *, replay: bool = True) -> Envelope:
        """Authenticate and decode one message received on `channel`; raises a WireError subclass.

        Believes the message's own sender name: a receiver that knows who a
        message must be from calls `decode_from` instead.
        """
        return self._decode(frames, channel, None, replay)

    def decode_from(self, frames: Sequence[Any], channel: Channel, sender: Sender, *, replay: bool = True) -> Envelope:
        """Authenticate, attribute and decode one message that must come from `sender`.

        The order is fixed: MAC (AuthError), then incarnation, channel, kind and fields,
        then the signer against `sender` (AttributionError), then the sequence
        window (ReplayError). A rejected message never moves the sequence ledger, so
        the genuine sender's next message is still accepted. `sender` is an
        Attribution, or a rule that builds one from the decoded record.
        `replay=False` skips only the sequence (broadcasts: PROTOCOL.md 5.1).
        """
        return self._decode(frames, channel, sender, replay)

    def authentic(self, frames: Sequence[Any]) -> bool:
        """Whether `frames` carry a valid MAC under this codec's key, in the version their header claims.

        `decode` refuses another version before the MAC (VersionError); a receiver
        that must not answer, or believe, anyone it cannot authenticate asks this
        next. The MAC is checked under the labels of the claimed version
        (PROTOCOL.md 12), so a genuine peer of another version is told apart
        from a stranger and refused by name instead of met with silence.
        """
        try:
            bufs = [_mac.byte_view(f) for f in frames]
            if bufs[0].nbytes > self.limits.max_header_bytes:
                return False
            head = msgpack.unpackb(bufs[0], raw=False, strict_map_key=True, **self._unpack_kwargs)
            version = head.get("v") if isinstance(head, dict) else None
            if type(version) is not int or version < 1:
                return False
            _mac.verify_mac(self.key, bufs[0], bufs[1:-1], bufs[-1], version)
            return True
        except Exception:  # any malformed input is simply not authentic
            return False

    def _decode(self, frames: Sequence[Any], channel: Channel, sender: Sender | None, replay: bool) -> Envelope:
        lim = self.limits
        if len(frames) < 2:
            raise FramingError(f"a message has at least 2 frames (header, mac); got {len(frames)}")
        if len(frames) - 2 > lim.max_payload_frames:
            raise LimitError(f"{len(frames) - 2} payload frames exceed the limit of {lim.max_payload_frames}")
        bufs = [_mac.byte_view(f) for f in frames]
        header_buf, payload_bufs, tag = bufs[0], bufs[1:-1], bufs[-1]
        if header_buf.nbytes > lim.max_header_bytes:
            raise LimitError(f"header of {header_buf.nbytes} bytes exceeds the limit of {lim.max_header_bytes}")
        head = self._unpack_header(header_buf)
        descs = self._check_payload(head["p"], payload_bufs)
        _mac.verify_mac(self.key, header_buf, payload_bufs, tag)
        return self._open(head, descs, payload_bufs, channel, sender, replay, frames)

    def decode_reference(
        self,
        header: Any,
        locator: Any,
        tag: Any,
        resolve: Callable[[memoryview], list[memoryview]],
        channel: Channel,
        *,
        sender: Sender | None = None,
        replay: bool = True,
    ) -> Envelope:
        """Authenticate and decode a by-reference message (PROTOCOL.md 3.5).

        The MAC over header and locator is checked before `resolve` maps the
        locator to the payload views, so an unauthenticated locator opens nothing.
        With `sender`, the signer is attributed as in `decode_from`, in the same order.
        """
        header_buf, locator_buf, tag_buf = _mac.byte_view(header), _mac.byte_view(locator), _mac.byte_view(tag)
        if header_buf.nbytes > self.limits.max_header_bytes:
            raise LimitError(f"header of {header_buf.nbytes} bytes exceeds the limit of {self.limits.max_header_bytes}")
        head = self._unpack_header(header_buf)
        _mac.verify_reference_mac(self.key, header_buf, locator_buf, tag_buf)
        payload_bufs = resolve(locator_buf)
        descs = self._check_payload(head["p"], payload_bufs)
        return self._open(head, descs, payload_bufs, channel, sender, replay, [])

    def _open(
        self,
        head: dict[str, Any],
        descs: list[tuple[str, list[int]]],
        payload_bufs: list[memoryview],
        channel: Channel,
        sender: Sender | None,
        replay: bool,
        frames: Sequence[Any],
    ) -> Envelope:
        """The checks after the MAC, in order: incarnation, channel, kind, fields, attribution, sequence.

        Attribution precedes the sequence so a frame signed by the wrong peer
        never moves the ledger of the signer it names.
        """
        if head["run"] != self.incarnation:
            raise IncarnationError(
                f"frame belongs to incarnation {head['run'].hex()}, this is incarnation {self.incarnation.hex()}: "
                "a record of another run, or of this run before a controller restart or re-form (a replay, or a "
                "process that outlived its incarnation); stop that process, or use a fresh key for another run"
            )
        if head["ch"] != channel.value:
            raise SchemaError(f"a {head['ch']!r} message arrived on the {channel.value} channel")
        spec = REGISTRY.get(head["k"])
        if spec is None:
            raise SchemaError(f"unknown record kind {head['k']!r} (peer built from a newer protocol?)")
        if channel not in spec.channels:
            raise SchemaError(f"{spec.kind} may not travel on the {channel.value} channel")
        if descs and not spec.carries_payload:
            raise FramingError(f"{spec.kind} carries no tensor payload but {len(descs)} frames came with it")
        rec = from_fields(spec.cls, head["f"], spec.kind)
        ledger_name = head["from"]
        if sender is not None:
            expected = sender if isinstance(sender, Attribution) else sender(rec)
            expected.check(spec.kind, head["from"], rec)
            ledger_name = expected.ledger_name(head["from"])
        if replay:
            self.check_sequence(channel, ledger_name, head["seq"])
        payload = [
            np.frombuffer(buf, dtype=DTYPES[name]).reshape(shape) for (name, shape), buf in zip(descs, payload_bufs, strict=True)
        ]
        return Envelope(
            record=rec,
            kind=spec.kind,
            channel=channel,
            sender=head["from"],
            seq=head["seq"],
            incarnation=head["run"],
            payload=payload,
            dtypes=[name for name, _ in descs],
            frames=list(frames),
        )

    def check_sequence(self, channel: Channel, sender: str, seq: int) -> None:
        """Raise ReplayError unless `seq` is fresh in (channel, sender)'s window; then record it."""
        key = (channel.value, sender)
        window = self._windows.get(key)
        why = None if window is None else window.refusal(seq)
        if why is not None:
            raise ReplayError(f"sequence {seq} from {sender!r} on {channel.value} {why}")
        if window is None:
            if self._max_ledger is not None and len(self._windows) >= self._max_ledger:
                del self._windows[next(iter(self._windows))]  # the entry first seen longest ago
            window = self._windows[key] = ReplayWindow()
        window.accept(seq)

    @property
    def ledger_size(self) -> int:
        """How many (channel, signer) entries the replay ledger holds."""
        return len(self._windows)

    def _unpack_header(self, buf: memoryview) -> dict[str, Any]:
        lim = self.limits
        try:
            head = msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True, object_pairs_hook=_map,
                                   **self._unpack_kwargs)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise SchemaError(f"header is not valid msgpack within limits: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # msgpack raises assorted types on truncated input
            raise SchemaError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
        if not isinstance(head, dict):
            raise SchemaError(f"header must be a msgpack map, got {type(head).__name__}")
        _depth(head, lim.max_depth)
        version = head.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:  # true and 1.0 equal 1 in Python
            raise VersionError(
                f"peer speaks protocol version {version!r}, this build speaks {PROTOCOL_VERSION}: "
                "run the same flodl-zmq version on every host"
            )
        if head.keys() != _HEADER_KEYSET:
            raise SchemaError(
                f"header keys {sorted(map(str, head))} differ from the required {sorted(HEADER_KEYS)}"
            )
        for key, tp in _HEADER_TYPES.items():
            if not isinstance(head[key], tp) or isinstance(head[key], bool):
                raise SchemaError(f"header field {key!r} must be {tp.__name__}, got {type(head[key]).__name__}")
        if not 1 <= head["seq"] <= MAX_SEQ:
            raise SchemaError(f"sequence number {head['seq']} is outside 1..2^63-1")
        if not 0 < len(head["from"]) <= MAX_SENDER_CHARS:
            raise SchemaError(f"sender name must be 1..{MAX_SENDER_CHARS} characters")
        if len(head["salt"]) != SALT_BYTES:
            raise SchemaError(f"header salt must be {SALT_BYTES} bytes, got {len(head['salt'])}")
        return head

    def _check_payload(self, descs: list[Any], bufs: list[memoryview]) -> list[tuple[str, list[int]]]:
        lim = self.limits
        if len(descs) != len(bufs):
            raise FramingError(f"header describes {len(descs)} payload frames but {len(bufs)} arrived")
        out, total = [], 0
        for i, d in enumerate(descs):
            if not (isinstance(d, list) and len(d) == 3):
                raise SchemaError(f"payload descriptor {i} must be [dtype, shape, nbytes]")
            name, shape, nbytes = d
            if not isinstance(name, str) or name not in DTYPES:  # a list or map here is unhashable
                raise SchemaError(f"payload {i}: unknown dtype {name!r}; the wire carries {sorted(DTYPES)}")
            if not isinstance(shape, list) or len(shape) > lim.max_dims:
                raise SchemaError(f"payload {i}: shape must be a list of at most {lim.max_dims} dims")
            if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
                raise SchemaError(f"payload {i}: shape dims must be non-negative integers")
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise SchemaError(f"payload {i}: byte length must be a non-negative integer")
            total += nbytes
            if total > lim.max_payload_bytes:
                raise LimitError(f"payload totals over {lim.max_payload_bytes} bytes, the configured limit")
            if nbytes != bufs[i].nbytes:
                raise FramingError(f"payload {i}: header says {nbytes} bytes, frame has {bufs[i].nbytes}")
            if math.prod(shape) * DTYPES[name].itemsize != nbytes:
                raise FramingError(f"payload {i}: shape {shape} of {name} is not {nbytes} bytes")
            out.append((name, shape))
        return out
