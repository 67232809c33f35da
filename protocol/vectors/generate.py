"""Regenerate the wire test vectors: `records.json` (one accepted message per
record kind and channel), `rejections.json` (one refused message per
rejection cause), `windows.json` (arrival orders through the anti-replay
window), `int8.json` (the int8 payload, PROTOCOL.md 3.6) and `shards.json` (the values each reducer
shard owns and its slice's frames, PROTOCOL.md 10.9).

    .venv/bin/python protocol/vectors/generate.py

Rules this script keeps:

- Deterministic: a fixed key, incarnation id, sender and salt, and per-channel sequence
  numbers that count up through `records.json` in file order, so two runs
  write identical files and the positive vectors, replayed in order, are also
  one valid stream.
- Field values come from the record annotations (with realistic values for
  known field names), so a kind added to the registry gets its vector on the
  next run; the test suite fails until then.
- A rejection vector isolates one cause: every check the decoder runs before
  the one under test passes (a valid MAC where the MAC is checked first).

JSON conventions (PROTOCOL.md, "Test vectors"): bytes are lowercase hex
strings, frames are lists of hex strings, payload arrays are nested lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import types
import typing
from typing import Any, Union

import msgpack
import numpy as np
import torch

from flodl_zmq import int8
from flodl_zmq.links import (
    RELAY_ROUTE,
    TAG_BCAST,
    TAG_DATA,
    coordinator_sender,
    rank_identity,
    rank_sender,
    relay_identity,
    relay_sender,
)
from flodl_zmq.wire import PROTOCOL_VERSION, REGISTRY, Channel, Codec, EpochPlan, compute_mac
from flodl_zmq.wire.codec import REPLAY_WINDOW
from flodl_zmq.wire.fields import to_fields
from flodl_zmq.wire.shm import ALIGN, SHM_TAG, host_owner, rank_owner

HERE = pathlib.Path(__file__).resolve().parent
KEY = bytes(range(32))
OTHER_KEY = bytes(range(32, 64))
INCARNATION = bytes.fromhex("f10d17c0ffee4a11b0a7d00dfeedf00d")  # the header's `run` in every vector
OTHER_INCARNATION = bytes.fromhex("0123456789abcdef0123456789abcdef")  # another run's
EARLIER_INCARNATION = bytes.fromhex("e5c0ffee0badf00de5c0ffee0badf00d")  # this run's before a restart or re-form
RUN_ID = bytes.fromhex("a11ce5a11ce5a11ce5a11ce5a11ce5a1")  # the run's stable id: a join.accept field only
SENDER = "host-a/rank-2"
SALT = bytes.fromhex("5a17c0de0123456789abcdef5a17c0de")  # the sender incarnation's salt (random in use)
OTHER_SALT = bytes.fromhex("0badc0de0badc0de0badc0de0badc0de")


def _sig(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


PLAN = EpochPlan(epoch=3, offset=1200, size=400, deposit=8)  # a plan whose end is round 8's deposit

# Realistic values by field name; anything else falls back to its type.
FIELD_VALUES: dict[str, Any] = {
    "round": 7,
    "rank": 2,
    "outer": "nesterov",  # data.shard_start: an outer step's name (10.9 item 11)
    "world_size": 4,
    "host": "host-a",
    "model_sig": _sig("model"),
    "dataset_sig": _sig("dataset"),
    "epoch": 3,
    "offset": 1200,
    "size": 400,
    "global_step": 2**33 + 5,  # above u32: exercises msgpack uint64
    "version": 5,
    "target_rank": 1,
    "schedule_id": 11,
    "adopt_consensus": True,
    "reason": "stopping: convergence guard stalled (ünïcödé kept as UTF-8)",
    "avg_loss": 0.4375,
    "epoch_ms": 81234.5,
    "per_rank_throughput": [112.5, 98.25],
    "per_rank_batch_share": [0.53125, 0.46875],
    "per_rank_loss": [0.40625, None],
    "per_rank_samples": [6000, 5210],
    "scalars": {"accuracy": 0.953125, "top5": 0.99609375},  # a map of several keys
    "metric": 0.953125,
    "batch_ms": [12.5, 11.75],
    "data_ms": [0.75, 0.5],
    "step_count": 1234,
    "ack": 1233,
    "batch_loss": [0.40625, 0.375],
    "divergence": 0.0078125,
    "post_norm": 15.0,
    "pre_norm": 15.125,
    "lr": 0.001,
    "elapsed_ms": 420.25,
    "error": None,
    "batches_processed": 188,
    "samples_processed": 6000,
    "compute_only_ms": 70000.0,
    "data_starve_ms": 1500.5,
    "scalar_sums": {"accuracy": 179.25, "top5": 187.25},
    "scalar_counts": {"accuracy": 188, "top5": 188},
    "ranks": [2, 3],
    "model_sigs": [_sig("model"), _sig("model")],
    "mass": 3.0,
    "latest": 9,
    "nonce": 0x5EED_1234_ABCD,
    "devices": ["cpu:0", "cpu:1"],
    "protocol": 1,
    "session_key": None,
    "formation_wait_s": 287.5,
    "run_id": RUN_ID,
    "incarnation": INCARNATION,
    "spawn_json": '{"hosts": {"host-a": [2, 3]}}',
    "code": -9,
    "next_plan": PLAN,
    "plan": PLAN,
    "token": _sig("host-token"),  # relay.hello: the host's token (32 bytes, PROTOCOL.md 10.5)
    "host_token": _sig("host-token"),  # join.accept: the same token, as the membership gives it
    "seqs": [7, 12, 8, 9],  # relay.reports: one per merged record (a heartbeat, a batch, a snapshot notice, an ack)
}


RECORD_CLASSES = {spec.cls for spec in REGISTRY.values()}


def sample(tp: Any, name: str) -> Any:
    """A deterministic value of annotation `tp` for field `name`."""
    if tp is bytes and name.endswith("nonce"):  # the join challenge nonces (16 bytes); probe nonces are ints
        return bytes(range(0xA0, 0xB0))
    if name in FIELD_VALUES:
        return FIELD_VALUES[name]
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return sample(next(a for a in typing.get_args(tp) if a is not type(None)), name)
    if origin is list:
        item = typing.get_args(tp)[0]
        return [sample_record(item) if item in RECORD_CLASSES else sample(item, name)]
    if origin is dict:
        return {"key": sample(typing.get_args(tp)[1], name)}
    return {
        int: 1,
        float: 0.5,
        str: "text",
        bytes: b"\x01\x02\x03\x04",
        bool: False,
        EpochPlan: PLAN,
    }[tp]


def sample_record(cls: type) -> Any:
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: sample(hints[f.name], f.name) for f in dataclasses.fields(cls)})


# ---------------------------------------------------------------- payloads

# f32 values whose bf16 rounding shows round-to-nearest-even: exact, below a tie,
# ties to even (down and up), above a tie, and the sign.
BF16_SOURCE = np.array(
    [0x3F800000, 0x3F808000, 0x3F818000, 0x3F80C000, 0xBFC00000], dtype="<u4"
).view("<f4")


def _payloads(kind: str, channel: Channel) -> list[tuple[str, np.ndarray]]:
    """(wire dtype, array) per payload frame; bf16 arrays are uint16 bit patterns."""
    if kind == "data.round_frame":
        return [
            ("f32", np.array([[1.5, -2.25, 0.0], [3.0, 1e-3, -0.5]], dtype="<f4")),
            ("f32", np.array(6.0, dtype="<f4")),  # a 0-d tensor: shape []
            ("f32", np.zeros((0, 4), dtype="<f4")),  # no elements: an empty frame
        ]
    if kind == "data.host_frame":
        bits = (
            torch.from_numpy(BF16_SOURCE.copy())
            .to(torch.bfloat16)
            .view(torch.int16)
            .numpy()
            .view("<u2")
        )
        return [("bf16", bits.copy())]
    if kind in ("data.shard_start", "data.outer_state"):  # a slice of one part: its global model, then its momentum's
        return [("f32", np.array([0.5, -1.25, 3.0], dtype="<f4")), ("f32", np.array([0.0, 0.125, -0.5], dtype="<f4"))]
    if kind == "data.consensus" and channel is Channel.BROADCAST:
        return [("f32", np.array([[0.5, 0.25], [-1.0, 2.0]], dtype="<f4"))]
    if kind == "data.consensus":
        return [("f16", np.array([0.5, -1.5, 65504.0], dtype="<f2"))]
    return []


def _payload_json(dtype: str, arr: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": dtype, "shape": list(arr.shape)}
    if arr.nbytes > 4096:  # too large to repeat as numbers: the frame holds them, this checks them
        out["sha256"] = hashlib.sha256(arr.tobytes()).hexdigest()
    elif dtype == "bf16":
        out["bits"] = arr.tolist()
        out["values"] = (arr.astype("<u4") << 16).view("<f4").tolist()
        out["from_f32"] = BF16_SOURCE.tolist()
    else:
        out["values"] = arr.tolist()
    return out


# ---------------------------------------------------------------- JSON forms


def to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if dataclasses.is_dataclass(value):  # EpochPlan, or a record merged into another
        return to_json(to_fields(value))
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    return value


def _hex_frames(frames: list[Any]) -> list[str]:
    return [bytes(f).hex() for f in frames]


# ---------------------------------------------------------------- positive vectors


def positive_vectors() -> list[dict[str, Any]]:
    codec = Codec(KEY, INCARNATION, SENDER, salt=SALT)
    out = []
    for kind, spec in REGISTRY.items():
        for i, channel in enumerate(spec.channels):
            rec = sample_record(spec.cls)
            payload = _payloads(kind, channel) if spec.carries_payload else []
            frames = codec.encode(
                rec, [a for _, a in payload], channel=channel, dtypes=[d for d, _ in payload]
            )
            seq = msgpack.unpackb(frames[0])["seq"]
            out.append(
                {
                    "name": kind if i == 0 else f"{kind}@{channel.value}",
                    "kind": kind,
                    "channel": channel.value,
                    "key": KEY.hex(),
                    "incarnation": INCARNATION.hex(),
                    "sender": SENDER,
                    "salt": SALT.hex(),
                    "seq": seq,
                    "record": to_json(to_fields(rec)),
                    "payload": [_payload_json(d, a) for d, a in payload],
                    "frames": _hex_frames(frames),
                }
            )
    for name, kind, channel, overrides, payload in EXTRA:
        rec = dataclasses.replace(sample_record(REGISTRY[kind].cls), **overrides)
        frames = codec.encode(rec, [a for _, a in payload], channel=channel, dtypes=[d for d, _ in payload])
        out.append(
            {
                "name": name,
                "kind": kind,
                "channel": channel.value,
                "key": KEY.hex(),
                "incarnation": INCARNATION.hex(),
                "sender": SENDER,
                "salt": SALT.hex(),
                "seq": msgpack.unpackb(frames[0])["seq"],
                "record": to_json(to_fields(rec)),
                "payload": [_payload_json(d, a) for d, a in payload],
                "frames": _hex_frames(frames),
            }
        )
    out.append(noncanonical_vector())
    return out


# A payload just over one GMAC block (1 MiB + 4 bytes): its second block has block index 1.
LARGE = (np.arange((1 << 18) + 1, dtype="<u4") % 4093).astype("<f4") * np.float32(0.25)

# Accepted messages beyond one per kind and channel: what the per-kind samples do not reach.
EXTRA: list[tuple[str, str, Channel, dict[str, Any], list[tuple[str, np.ndarray]]]] = [
    ("control.execute_eval@false", "control.execute_eval", Channel.CONTROL, {"adopt_consensus": False}, []),
    ("data.round_frame@no-payload", "data.round_frame", Channel.DATA, {}, []),
    ("data.round_frame@over-1MiB", "data.round_frame", Channel.DATA, {}, [("f32", LARGE)]),
]


# ---------------------------------------------------------------- hand-made msgpack

def _str(text: str, width: int) -> bytes:
    """A msgpack str in the given length width (8, 16 or 32 bits), whatever is shortest."""
    raw = text.encode()
    return {8: b"\xd9", 16: b"\xda", 32: b"\xdb"}[width] + len(raw).to_bytes(width // 8, "big") + raw


def _bin(data: bytes, width: int) -> bytes:
    return {8: b"\xc4", 16: b"\xc5", 32: b"\xc6"}[width] + len(data).to_bytes(width // 8, "big") + data


def _uint(n: int, width: int) -> bytes:
    return {8: b"\xcc", 16: b"\xcd", 32: b"\xce", 64: b"\xcf"}[width] + n.to_bytes(width // 8, "big")


def _int(n: int, width: int) -> bytes:
    return {8: b"\xd0", 16: b"\xd1", 32: b"\xd2", 64: b"\xd3"}[width] + n.to_bytes(width // 8, "big", signed=True)


def _map(pairs: list[tuple[bytes, bytes]], width: int | None = None) -> bytes:
    """A msgpack map of already-encoded (key, value) pairs, as fixmap or map16/map32."""
    head = bytes([0x80 | len(pairs)]) if width is None else {16: b"\xde", 32: b"\xdf"}[width] + len(pairs).to_bytes(width // 8, "big")
    return head + b"".join(k + v for k, v in pairs)


def _array(items: list[bytes], width: int | None = None) -> bytes:
    head = bytes([0x90 | len(items)]) if width is None else {16: b"\xdc", 32: b"\xdd"}[width] + len(items).to_bytes(width // 8, "big")
    return head + b"".join(items)


def _pk(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def _header_pairs(fields: bytes, sender: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """The encoded (key, value) pairs of a timing.heartbeat header whose `f` (and sender) are raw msgpack."""
    return [
        (_pk("v"), _pk(PROTOCOL_VERSION)), (_pk("k"), _pk("timing.heartbeat")), (_pk("run"), _pk(INCARNATION)),
        (_pk("ch"), _pk("control")), (_pk("from"), _pk(SENDER) if sender is None else sender),
        (_pk("salt"), _pk(SALT)), (_pk("seq"), _pk(1)), (_pk("f"), fields), (_pk("p"), _pk([])),
    ]


def _raw_header(fields: bytes, sender: bytes | None = None) -> bytes:
    """A header holding what a dict cannot (a repeated key, a non-str key, bytes that are not UTF-8)."""
    return _map(_header_pairs(fields, sender))


NONCANONICAL_SENDER = "host-a/noncanonical"


def noncanonical_vector() -> dict[str, Any]:
    """A data.round_frame whose header uses a non-shortest form for every value: a decoder MUST accept it
    (PROTOCOL.md 3.2); an encoder never produces it, so it has no byte-for-byte encoding check."""
    head = _map([
        (_str("v", 8), _uint(PROTOCOL_VERSION, 64)),
        (_str("k", 16), _str("data.round_frame", 32)),
        (_str("run", 8), _bin(INCARNATION, 32)),
        (_str("ch", 32), _str("data", 16)),
        (_str("from", 8), _str(NONCANONICAL_SENDER, 16)),
        (_str("salt", 8), _bin(SALT, 16)),
        (_str("seq", 8), _uint(1, 32)),
        (_str("f", 8), _map([
            (_str("round", 8), _int(7, 64)),
            (_str("rank", 8), _int(2, 8)),
            (_str("mass", 8), b"\xca" + np.array([3.0], dtype=">f4").tobytes()),  # float32, read as float
        ], 32)),
        (_str("p", 8), _array([_array([_str("f32", 8), _array([_uint(4, 16)], 32), _uint(16, 32)], 16)], 16)),
    ], 16)
    frames = signed(head, [F32x4])
    return {
        "name": "data.round_frame@non-canonical",
        "kind": "data.round_frame",
        "channel": "data",
        "canonical": False,
        "key": KEY.hex(),
        "incarnation": INCARNATION.hex(),
        "sender": NONCANONICAL_SENDER,
        "salt": SALT.hex(),
        "seq": 1,
        "record": {"round": 7, "rank": 2, "mass": 3.0},
        "payload": [_payload_json("f32", np.frombuffer(F32x4, "<f4"))],
        "frames": _hex_frames(frames),
    }


# ---------------------------------------------------------------- negative vectors


def header(
    kind: str = "timing.heartbeat",
    ch: str = "control",
    fields: Any = None,
    p: Any = None,
    seq: Any = 1,
    run: Any = INCARNATION,
    v: Any = PROTOCOL_VERSION,
    sender: Any = SENDER,
    salt: Any = SALT,
) -> dict[str, Any]:
    """A header map in the canonical key order; defaults make a valid timing.heartbeat."""
    return {
        "v": v,
        "k": kind,
        "run": run,
        "ch": ch,
        "from": sender,
        "salt": salt,
        "seq": seq,
        "f": {"rank": 2, "step_count": 1234, "ack": 0} if fields is None else fields,
        "p": [] if p is None else p,
    }


def signed(
    head: dict[str, Any] | bytes, payloads: list[bytes] = (), key: bytes = KEY, version: int | None = None
) -> list[bytes]:
    """Frames `[header, payload..., mac]` with a valid MAC over whatever the header is (`version`: whose labels)."""
    raw = head if isinstance(head, bytes) else msgpack.packb(head, use_bin_type=True)
    return [raw, *payloads, compute_mac(key, raw, list(payloads), version)]


F32x4 = np.array([1.0, 2.0, 3.0, 4.0], dtype="<f4").tobytes()


def round_frame(
    p: list[Any] | None = None, payloads: list[bytes] | None = None, **kw: Any
) -> list[bytes]:
    """A data.round_frame with one f32[4] payload unless told otherwise."""
    p = [["f32", [4], 16]] if p is None else p
    payloads = [F32x4] if payloads is None else payloads
    head = header("data.round_frame", "data", {"round": 7, "rank": 2, "mass": 3.0}, p, **kw)
    return signed(head, payloads)


def _flip(frame: bytes, byte: int = 0, bit: int = 0) -> bytes:
    b = bytearray(frame)
    b[byte] ^= 1 << bit
    return bytes(b)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def negative_cases() -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """(name, cause, error class, message fragment, vector extras)."""
    ok = signed(header())
    ok_pair = round_frame(p=[["f32", [4], 16], ["f32", [4], 16]], payloads=[F32x4, F32x4[::-1]])
    tampered_head = msgpack.packb(header(fields={"rank": 2, "step_count": 1235, "ack": 0}), use_bin_type=True)
    return [
        (
            "mac_bit_flipped",
            "one bit of the MAC frame flipped",
            "AuthError",
            "MAC verification failed",
            {"frames": [ok[0], _flip(ok[1], 5, 3)]},
        ),
        (
            "mac_wrong_length",
            "the MAC frame is 31 bytes",
            "AuthError",
            "MAC frame is 31 bytes",
            {"frames": [ok[0], ok[1][:31]]},
        ),
        (
            "wrong_session_key",
            "signed with another session key",
            "AuthError",
            "MAC verification failed",
            {"frames": signed(header(), key=OTHER_KEY)},
        ),
        (
            "header_tampered",
            "a field changed after signing (step_count 1234 -> 1235)",
            "AuthError",
            "MAC verification failed",
            {"frames": [tampered_head, ok[1]]},
        ),
        (
            "payload_tampered",
            "one bit of a payload frame flipped",
            "AuthError",
            "MAC verification failed",
            {
                "frames": [ok_pair[0], _flip(ok_pair[1], 3, 7), ok_pair[2], ok_pair[3]],
                "channel": "data",
            },
        ),
        (
            "payload_frames_swapped",
            "two same-shaped payload frames exchanged",
            "AuthError",
            "MAC verification failed",
            {"frames": [ok_pair[0], ok_pair[2], ok_pair[1], ok_pair[3]], "channel": "data"},
        ),
        (
            "wrong_run_id",
            "a validly signed message of another run",
            "IncarnationError",
            "belongs to incarnation",
            {"frames": signed(header(run=OTHER_INCARNATION))},
        ),
        (
            "earlier_incarnation",
            "a validly signed message of this run's earlier incarnation (before a controller restart or a "
            "re-form), replayed under the same session key after the sender's first message of this one: its "
            "sequence number is fresh to the receiver's ledger, so only the header's `run` refuses it (4.1)",
            "IncarnationError",
            "belongs to incarnation",
            {"frames": signed(header(run=EARLIER_INCARNATION, seq=2)), "accept_first": [signed(header())]},
        ),
        (
            "wrong_version",
            f"protocol version {PROTOCOL_VERSION + 1}",
            "VersionError",
            f"protocol version {PROTOCOL_VERSION + 1}",
            {"frames": signed(header(v=PROTOCOL_VERSION + 1))},
        ),
        (
            "version_missing",
            "no `v` key",
            "VersionError",
            "protocol version None",
            {"frames": signed({k: v for k, v in header().items() if k != "v"})},
        ),
        (
            "version_is_boolean",
            f"`v` is true, not the integer {PROTOCOL_VERSION}",
            "VersionError",
            "protocol version True",
            {"frames": signed(header(v=True))},
        ),
        (
            "unknown_kind",
            "kind control.self_destruct is not in the registry",
            "SchemaError",
            "unknown record kind",
            {"frames": signed(header("control.self_destruct", fields={}))},
        ),
        (
            "malformed_msgpack",
            "header is the never-used msgpack byte 0xc1",
            "SchemaError",
            "not valid msgpack",
            {"frames": signed(b"\xc1")},
        ),
        (
            "truncated_msgpack",
            "header cut short inside the map",
            "SchemaError",
            "not valid msgpack",
            {"frames": signed(ok[0][:20])},
        ),
        (
            "trailing_bytes",
            "header followed by extra bytes in the same frame",
            "SchemaError",
            "not valid msgpack",
            {"frames": signed(ok[0] + b"\x00")},
        ),
        (
            "header_not_a_map",
            "header is a msgpack array",
            "SchemaError",
            "must be a msgpack map",
            {"frames": signed(msgpack.packb([1, "timing.heartbeat"]))},
        ),
        (
            "msgpack_over_deep",
            "a field nests 12 arrays deep (limit 8 levels)",
            "SchemaError",
            "nests deeper than 8",
            {"frames": signed(header(fields={"rank": 2, "step_count": _nested(12), "ack": 0}))},
        ),
        (
            "msgpack_string_over_limit",
            "a 40-byte string with max_str_bytes 16",
            "SchemaError",
            "within limits",
            {"frames": signed(header(sender="s" * 40)), "limits": {"max_str_bytes": 16}},
        ),
        (
            "header_too_big",
            "a header above max_header_bytes 64",
            "LimitError",
            "exceeds the limit of 64",
            {"frames": ok, "limits": {"max_header_bytes": 64}},
        ),
        (
            "too_many_payload_frames",
            "3 payload frames with max_payload_frames 2",
            "LimitError",
            "exceed the limit of 2",
            {
                "frames": round_frame(p=[["f32", [4], 16]] * 3, payloads=[F32x4] * 3),
                "channel": "data",
                "limits": {"max_payload_frames": 2},
            },
        ),
        (
            "payload_bytes_over_limit",
            "32 payload bytes with max_payload_bytes 16",
            "LimitError",
            "configured limit",
            {"frames": ok_pair, "channel": "data", "limits": {"max_payload_bytes": 16}},
        ),
        (
            "too_few_frames",
            "a lone header frame",
            "FramingError",
            "at least 2 frames",
            {"frames": [ok[0]]},
        ),
        (
            "payload_frame_missing",
            "header describes 2 payload frames, 1 arrived",
            "FramingError",
            "describes 2 payload frames but 1 arrived",
            {"frames": [ok_pair[0], ok_pair[1], ok_pair[3]], "channel": "data"},
        ),
        (
            "payload_frame_duplicated",
            "a payload frame sent twice",
            "FramingError",
            "describes 2 payload frames but 3 arrived",
            {
                "frames": [ok_pair[0], ok_pair[1], ok_pair[1], ok_pair[2], ok_pair[3]],
                "channel": "data",
            },
        ),
        (
            "payload_length_mismatch",
            "descriptor says 16 bytes, frame has 12",
            "FramingError",
            "header says 16 bytes, frame has 12",
            {"frames": round_frame(payloads=[F32x4[:12]]), "channel": "data"},
        ),
        (
            "shape_mismatch",
            "shape [5] of f32 is 20 bytes, descriptor and frame say 16",
            "FramingError",
            "is not 16 bytes",
            {"frames": round_frame(p=[["f32", [5], 16]]), "channel": "data"},
        ),
        (
            "unknown_dtype",
            "dtype f64",
            "SchemaError",
            "unknown dtype",
            {"frames": round_frame(p=[["f64", [2], 16]]), "channel": "data"},
        ),
        (
            "dtype_not_a_string",
            "a descriptor whose dtype is an array",
            "SchemaError",
            "unknown dtype",
            {"frames": round_frame(p=[[["f32"], [4], 16]]), "channel": "data"},
        ),
        (
            "bad_descriptor",
            "a descriptor with two items",
            "SchemaError",
            "must be [dtype, shape, nbytes]",
            {"frames": round_frame(p=[["f32", [4]]]), "channel": "data"},
        ),
        (
            "too_many_dims",
            "a 9-dimensional shape (limit 8)",
            "SchemaError",
            "at most 8 dims",
            {"frames": round_frame(p=[["f32", [1] * 8 + [4], 16]]), "channel": "data"},
        ),
        (
            "negative_dim",
            "a shape with a negative dimension",
            "SchemaError",
            "non-negative integers",
            {"frames": round_frame(p=[["f32", [-4], 16]]), "channel": "data"},
        ),
        (
            "payload_on_plain_kind",
            "a timing.heartbeat with a payload frame",
            "FramingError",
            "carries no tensor payload",
            {"frames": signed(header(p=[["f32", [4], 16]]), [F32x4])},
        ),
        (
            "channel_mismatch",
            "a control message received on the data socket",
            "SchemaError",
            "arrived on the data channel",
            {"frames": ok, "channel": "data"},
        ),
        (
            "kind_on_wrong_channel",
            "control.shutdown claiming and arriving on the data channel",
            "SchemaError",
            "may not travel on the data channel",
            {"frames": signed(header("control.shutdown", "data", {})), "channel": "data"},
        ),
        (
            "field_missing",
            "timing.heartbeat without step_count",
            "SchemaError",
            "missing field",
            {"frames": signed(header(fields={"rank": 2, "ack": 0}))},
        ),
        (
            "field_unknown",
            "timing.heartbeat with an extra field",
            "SchemaError",
            "unknown field",
            {"frames": signed(header(fields={"rank": 2, "step_count": 1, "ack": 0, "extra": 0}))},
        ),
        (
            "field_mistyped",
            "step_count as a string",
            "SchemaError",
            "expected int, got str",
            {"frames": signed(header(fields={"rank": 2, "step_count": "1234", "ack": 0}))},
        ),
        (
            "field_bool_for_int",
            "rank given as true",
            "SchemaError",
            "expected int, got bool",
            {"frames": signed(header(fields={"rank": True, "step_count": 1, "ack": 0}))},
        ),
        (
            "count_over_range",
            "step_count 2^64-1: a count above 2^53-1 (the encode of a sum of it would overflow)",
            "SchemaError",
            "outside Count 0..9007199254740991",
            {"frames": signed(header(fields={"rank": 2, "step_count": 2**64 - 1, "ack": 0}))},
        ),
        (
            "count_negative",
            "step_count -1",
            "SchemaError",
            "outside Count",
            {"frames": signed(header(fields={"rank": 2, "step_count": -1, "ack": 0}))},
        ),
        (
            "rank_over_range",
            "rank 2^31",
            "SchemaError",
            "outside Rank 0..2147483647",
            {"frames": signed(header(fields={"rank": 2**31, "step_count": 1, "ack": 0}))},
        ),
        (
            "seq_negative",
            "a heartbeat's ack -1",
            "SchemaError",
            "outside Seq",
            {"frames": signed(header(fields={"rank": 2, "step_count": 1, "ack": -1}))},
        ),
        (
            "duration_not_finite",
            "timing.batch with an infinite batch_ms",
            "SchemaError",
            "outside Duration",
            {"frames": signed(header("timing.batch", fields={
                "rank": 2, "step_count": 1, "batch_ms": [float("inf")], "data_ms": [0.0], "batch_loss": [0.5]}))},
        ),
        (
            "duration_nan",
            "timing.epoch_fn_elapsed with elapsed_ms NaN",
            "SchemaError",
            "outside Duration",
            {"frames": signed(header("timing.epoch_fn_elapsed", fields={"rank": 2, "epoch": 1, "elapsed_ms": float("nan")}))},
        ),
        (
            "duration_negative",
            "timing.checkpoint_result with elapsed_ms -1",
            "SchemaError",
            "outside Duration",
            {"frames": signed(header("timing.checkpoint_result", fields={
                "rank": 2, "version": 1, "elapsed_ms": -1.0, "error": None}))},
        ),
        (
            "batch_lists_unequal",
            "timing.batch listing two steps' batch_ms but one data_ms",
            "SchemaError",
            "a report lists each step once in all three",
            {
                "frames": signed(
                    header(
                        "timing.batch",
                        fields={"rank": 2, "step_count": 1234, "batch_ms": [12.5, 11.75], "data_ms": [0.75],
                                "batch_loss": [0.40625, 0.375]},
                    )
                )
            },
        ),
        (
            "nested_field_mistyped",
            "control.update whose next_plan.epoch is a string",
            "SchemaError",
            "expected int, got str",
            {
                "frames": signed(
                    header(
                        "control.update",
                        fields={"round": 7, "next_plan": {"epoch": "3", "offset": 0, "size": 1, "deposit": None}},
                    )
                )
            },
        ),
        (
            "fields_not_a_map",
            "`f` is an array",
            "SchemaError",
            "header field 'f' must be dict",
            {"frames": signed(header(fields=[2, 1234]))},
        ),
        (
            "header_key_missing",
            "no `p` key",
            "SchemaError",
            "header keys",
            {"frames": signed({k: v for k, v in header().items() if k != "p"})},
        ),
        (
            "header_key_unknown",
            "an extra `x` key",
            "SchemaError",
            "header keys",
            {"frames": signed({**header(), "x": 0})},
        ),
        (
            "header_field_mistyped",
            "seq as a string",
            "SchemaError",
            "header field 'seq' must be int",
            {"frames": signed(header(seq="1"))},
        ),
        (
            "salt_missing",
            f"no `salt` key (a version 2 header under a version {PROTOCOL_VERSION} number)",
            "SchemaError",
            "header keys",
            {"frames": signed({k: v for k, v in header().items() if k != "salt"})},
        ),
        (
            "salt_short",
            "a 15-byte salt",
            "SchemaError",
            "header salt must be 16 bytes, got 15",
            {"frames": signed(header(salt=SALT[:15]))},
        ),
        (
            "salt_not_bin",
            "the salt as a str of 32 hex characters",
            "SchemaError",
            "header field 'salt' must be bytes",
            {"frames": signed(header(salt=SALT.hex()))},
        ),
        (
            "version_2_header",
            "a version 2 header (no `salt`)",
            "VersionError",
            f"peer speaks protocol version 2, this build speaks {PROTOCOL_VERSION}",
            {"frames": signed({k: v for k, v in header(v=2).items() if k != "salt"})},
        ),
        (
            "version_3_header",
            "a version 3 timing.batch (one step, single floats; its receivers refuse a resent record, 5.1)",
            "VersionError",
            f"peer speaks protocol version 3, this build speaks {PROTOCOL_VERSION}",
            {
                "frames": signed(header("timing.batch", v=3, fields={
                    "rank": 2, "batch_ms": 12.5, "data_ms": 0.75, "step_count": 1234, "batch_loss": 0.40625,
                    "param_norm": None, "sync_divergence": None,
                }))
            },
        ),
        (
            "seq_zero",
            "sequence number 0",
            "SchemaError",
            "outside 1..2^63-1",
            {"frames": signed(header(seq=0))},
        ),
        (
            "sender_empty",
            "an empty sender name",
            "SchemaError",
            "sender name",
            {"frames": signed(header(sender=""))},
        ),
        (
            "misattributed_sender",
            "a valid MAC from a signer other than the one the route names",
            "AttributionError",
            f"only {SENDER!r} may use",
            {"frames": signed(header(sender="host-a/rank-3"))},
        ),
        (
            "duplicate_field_key",
            "`f` holds `rank` twice (2, then 3): which one a decoder keeps is not for it to choose",
            "SchemaError",
            "repeats a key",
            {"frames": signed(_raw_header(_map([(_pk("rank"), _pk(2)), (_pk("rank"), _pk(3)),
                                                 (_pk("step_count"), _pk(1234))])))},
        ),
        (
            "duplicate_header_key",
            "the header holds `seq` twice",
            "SchemaError",
            "repeats a key",
            {"frames": signed(_map([*_header_pairs(_pk({"rank": 2, "step_count": 1234, "ack": 0})), (_pk("seq"), _pk(2))]))},
        ),
        (
            "bin_map_key",
            "a key of `f` is the bin b\"rank\", not the str \"rank\"",
            "SchemaError",
            "map keys must be str",
            {"frames": signed(_raw_header(_map([(_bin(b"rank", 8), _pk(2)), (_pk("step_count"), _pk(1234))])))},
        ),
        (
            "int_map_key",
            "a key of `f` is the int 1",
            "SchemaError",
            "map key",
            {"frames": signed(_raw_header(_map([(_pk(1), _pk(2)), (_pk("step_count"), _pk(1234))])))},
        ),
        (
            "invalid_utf8",
            "the sender name holds the byte 0xff, which is never UTF-8",
            "SchemaError",
            "not valid msgpack",
            {"frames": signed(_raw_header(_pk({"rank": 2, "step_count": 1234, "ack": 0}), sender=b"\xa3a\xffb"))},
        ),
        (
            "utf8_surrogate",
            "the sender name holds an encoded UTF-16 surrogate (ED A0 80), which UTF-8 forbids",
            "SchemaError",
            "not valid msgpack",
            {"frames": signed(_raw_header(_pk({"rank": 2, "step_count": 1234, "ack": 0}), sender=b"\xa3\xed\xa0\x80"))},
        ),
        (
            "utf8_overlong",
            "the sender name is \"/\" in an overlong 2-byte form (C0 AF)",
            "SchemaError",
            "not valid msgpack",
            {"frames": signed(_raw_header(_pk({"rank": 2, "step_count": 1234, "ack": 0}), sender=b"\xa2\xc0\xaf"))},
        ),
        (
            "depth_9_container",
            "an array at level 9 (the header map is level 1, `f` level 2, the field's arrays levels 3..9)",
            "SchemaError",
            "nests deeper than 8",
            {"frames": signed(header(fields={"rank": 2, "step_count": _nested(7), "ack": 0}))},
        ),
        (
            "depth_8_container_passes",
            "arrays at levels 3..8 holding a scalar at level 9: within the depth limit, refused only by the "
            "field type",
            "SchemaError",
            "expected int, got list",
            {"frames": signed(header(fields={"rank": 2, "step_count": _nested(6), "ack": 0}))},
        ),
        (
            "map_pairs_over_max_items",
            "a header map of 9 pairs with max_items 8",
            "SchemaError",
            "within limits",
            {"frames": ok, "limits": {"max_items": 8}},
        ),
        (
            "max_items_counts_map_pairs",
            "a header map of 9 pairs (18 objects) with max_items 9 passes the parser; refused later, by its `run`",
            "IncarnationError",
            "belongs to incarnation",
            {"frames": signed(header(run=OTHER_INCARNATION)), "limits": {"max_items": 9}},
        ),
        (
            "shape_product_wraps_u64",
            "shape [2^32, 2^32, 4] of f32 with nbytes 0 and an empty frame: 2^68 bytes, 0 modulo 2^64",
            "FramingError",
            "is not 0 bytes",
            {"frames": round_frame(p=[["f32", [1 << 32, 1 << 32, 4], 0]], payloads=[b""]), "channel": "data"},
        ),
        (
            "incarnation_short",
            "a 15-byte `run` (a prefix of the receiver's incarnation id)",
            "IncarnationError",
            "belongs to incarnation",
            {"frames": signed(header(run=INCARNATION[:15]))},
        ),
        (
            "version_is_float",
            f"`v` is the float {PROTOCOL_VERSION}.0",
            "VersionError",
            f"protocol version {float(PROTOCOL_VERSION)}",
            {"frames": signed(header(v=float(PROTOCOL_VERSION)))},
        ),
        (
            "version_is_str",
            f"`v` is the str \"{PROTOCOL_VERSION}\"",
            "VersionError",
            f"protocol version '{PROTOCOL_VERSION}'",
            {"frames": signed(header(v=str(PROTOCOL_VERSION)))},
        ),
        (
            "other_version_genuine",
            f"a genuine version {PROTOCOL_VERSION + 1} message, signed under that version's labels "
            "(Codec.authentic: true, so a join socket may name the skew)",
            "VersionError",
            f"peer speaks protocol version {PROTOCOL_VERSION + 1}, this build speaks {PROTOCOL_VERSION}",
            {"frames": signed(header(v=PROTOCOL_VERSION + 1), version=PROTOCOL_VERSION + 1)},
        ),
        (
            "replayed_sequence",
            "the same message twice",
            "ReplayError",
            "was already accepted",
            {"frames": ok, "accept_first": [ok]},
        ),
        (
            "sequence_outside_window",
            f"seq {REPLAY_WINDOW + 1} accepted, then seq 1 ({REPLAY_WINDOW} behind: outside the window)",
            "ReplayError",
            f"outside the window of {REPLAY_WINDOW}",
            {"frames": ok, "accept_first": [signed(header(seq=REPLAY_WINDOW + 1))]},
        ),
    ]


# Arrival orders for one sender on one channel, and whether each arrival is accepted (PROTOCOL.md 5.1).
WINDOW_STREAMS = [
    ("resend_after_later_ones", [1, 3, 4, 2]),
    ("replay_of_a_resend", [1, 3, 2, 2, 3]),
    ("window_edge", [REPLAY_WINDOW + 4, 4, 5, 5, REPLAY_WINDOW + 3]),
    ("jump_past_the_window", [1, 2 * REPLAY_WINDOW + 1, 2, REPLAY_WINDOW + 2]),
]


def window_vectors() -> list[dict[str, Any]]:
    out = []
    for name, seqs in WINDOW_STREAMS:
        seen: set[int] = set()
        accepted = []
        for seq in seqs:
            fresh = seq not in seen and seq > max(seen, default=0) - REPLAY_WINDOW
            seen |= {seq} if fresh else set()
            accepted.append(fresh)
        out.append(
            {
                "name": name,
                "key": KEY.hex(),
                "incarnation": INCARNATION.hex(),
                "channel": "control",
                "sender": SENDER,
                "window": REPLAY_WINDOW,
                "seqs": seqs,
                "accepted": accepted,
                "messages": [_hex_frames(signed(header(seq=seq))) for seq in seqs],
            }
        )
    return out


# ---------------------------------------------------------------- by reference (PROTOCOL.md 3.5)

HOST = "host-a"


def by_reference(codec: Codec, rec: Any, payload: list[tuple[str, np.ndarray]], owner: str, channel: Channel,
                 *, incarnation: bytes = INCARNATION, frames_at: list[list[int]] | None = None) -> tuple[list[bytes], dict[str, str]]:
    """`[b"shm", locator, header, mac]` and the segment file (name, hex) holding the payload frames.

    Frames lie ALIGN-aligned in order, as a Segment lays them out; `frames_at` overrides the
    locator's [offset, nbytes] pairs (to point outside the file)."""
    at, pairs = 0, []
    for _, arr in payload:
        pairs.append([at, arr.nbytes])
        at += -(-arr.nbytes // ALIGN) * ALIGN
    segment = bytearray(max(at, 1))
    for (off, n), (_, arr) in zip(pairs, payload, strict=True):
        segment[off:off + n] = arr.tobytes()
    name = f"flodl-{incarnation.hex()}-{owner}-1"
    locator = _pk([name, frames_at if frames_at is not None else pairs])
    header, mac = codec.encode_reference(rec, [a for _, a in payload], locator, channel=channel,
                                         dtypes=[d for d, _ in payload])
    return [SHM_TAG, locator, header, mac], {"name": name, "hex": bytes(segment).hex()}


def by_reference_vectors() -> list[dict[str, Any]]:
    """A deposit of rank 2 and its relay's consensus, each signed by the peer whose segment it names (3.5)."""
    out = []
    for kind, channel, owner, sender in (("data.round_frame", Channel.DATA, rank_owner(2), rank_sender(2)),
                                         ("data.consensus", Channel.BROADCAST, host_owner(HOST), relay_sender(HOST))):
        codec = Codec(KEY, INCARNATION, sender, salt=SALT)
        rec = sample_record(REGISTRY[kind].cls)
        payload = _payloads(kind, channel)
        frames, segment = by_reference(codec, rec, payload, owner, channel)
        out.append({
            "name": f"{kind}@by-reference", "kind": kind, "channel": channel.value, "key": KEY.hex(),
            "incarnation": INCARNATION.hex(), "sender": sender, "salt": SALT.hex(), "seq": 1, "owner": owner,
            "segment": segment, "record": to_json(to_fields(rec)),
            "payload": [_payload_json(d, a) for d, a in payload], "frames": _hex_frames(frames),
        })
    return out


def by_reference_cases() -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """Rejections of the by-reference form: a deposit of rank 2 (owner r2) received on the data channel."""
    rec = REGISTRY["data.round_frame"].cls(round=7, rank=2, mass=3.0)
    payload = [("f32", np.frombuffer(F32x4, "<f4"))]

    def ref(**kw: Any) -> tuple[list[bytes], dict[str, str]]:
        return by_reference(Codec(KEY, INCARNATION, SENDER, salt=SALT), rec, payload, kw.pop("owner", rank_owner(2)),
                            Channel.DATA, **kw)

    good, segment = ref()
    moved = _pk([segment["name"], [[4, 16]]])
    extra = {"channel": "data", "owner": rank_owner(2), "segment": segment}
    return [
        ("ref_framed_mac", "the by-reference form carrying the framed MAC of its header (no payload frames)",
         "AuthError", "MAC verification failed", {**extra, "frames": [*good[:3], compute_mac(KEY, good[2], [])]}),
        ("ref_locator_tampered", "the locator's offset changed after signing (0 -> 4)", "AuthError",
         "MAC verification failed", {**extra, "frames": [good[0], moved, good[2], good[3]]}),
        ("ref_other_owner", "a validly signed locator naming rank 3's segment, on rank 2's socket", "FramingError",
         "not one of r2's", {**extra, "frames": ref(owner=rank_owner(3))[0]}),
        ("ref_other_run", "a validly signed locator naming a segment of another run", "FramingError",
         "not one of r2's", {**extra, "frames": ref(incarnation=OTHER_INCARNATION)[0]}),
        ("ref_frame_outside", "a validly signed locator whose frame ends past the segment's end", "FramingError",
         "does not lie inside", {**extra, "frames": ref(frames_at=[[60, 16]])[0]}),
        ("ref_locator_not_pair", "a validly signed locator of three items", "SchemaError", "must be [name",
         {**extra, "frames": _resigned(good, _pk([segment["name"], [[0, 16]], 0]))}),
        ("ref_locator_map", "a validly signed locator that is a map (no map is allowed in a locator)",
         "SchemaError", "not valid msgpack", {**extra, "frames": _resigned(good, _pk({"name": segment["name"]}))}),
        ("ref_frame_length_mismatch", "the locator's frame is 12 bytes, its descriptor says 16", "FramingError",
         "header says 16 bytes, frame has 12", {**extra, "frames": ref(frames_at=[[0, 12]])[0]}),
    ]


def _resigned(frames: list[bytes], locator: bytes) -> list[bytes]:
    """A by-reference message with another locator, its MAC recomputed (an insider's message)."""
    from flodl_zmq.wire.mac import reference_mac

    return [frames[0], locator, frames[2], reference_mac(KEY, frames[2], locator)]


# ---------------------------------------------------------------- envelopes (PROTOCOL.md 3.1)

RELAY_PROCESS = bytes.fromhex("0123456789abcdef")  # the relay process's random part of its routing identity
RELAY_ID = relay_identity(HOST, RELAY_PROCESS)


AGENT_ID = b"A" + bytes(range(1, 16))  # an agent join DEALER's identity: b"A" and 15 random bytes (10.5)


def envelope_vectors() -> list[dict[str, Any]]:
    """Each leg's frames in front of a message, as the receiving application reads them."""
    consensus = REGISTRY["data.consensus"].cls
    hello_ack = REGISTRY["relay.hello_ack"].cls
    legs = [
        ("rank_to_relay_control", "a rank's control DEALER to its relay's control ROUTER: the routing identity "
         "is the rank in ASCII decimal", [rank_identity(2)], "rank:2", sample_record(REGISTRY["timing.heartbeat"].cls),
         Channel.CONTROL, []),
        ("relay_to_controller_rank_record", "a rank's record forwarded verbatim by its relay (DEALER) to the "
         "controller's control ROUTER: the relay's routing identity, then the route frame naming the rank",
         [RELAY_ID, rank_identity(2)], "rank:2", sample_record(REGISTRY["timing.heartbeat"].cls), Channel.CONTROL, []),
        ("relay_own_control_record", "the relay's own control record to the controller: an empty route frame",
         [RELAY_ID, RELAY_ROUTE], f"relay:{HOST}", sample_record(REGISTRY["relay.hello"].cls), Channel.CONTROL, []),
        ("controller_to_relay_for_rank", "the coordinator's record for rank 2, as the relay's control DEALER reads "
         "it (the controller sends [relay id, route, message]); the relay passes [b\"2\", message] to its ROUTER, "
         "and the rank's DEALER reads the bare message; signed by rank 2's stream", [rank_identity(2)],
         coordinator_sender(2), REGISTRY["control.shutdown"].cls(), Channel.CONTROL, []),
        ("reducer_to_relay_data", "the reducer's own data record to a relay, as the relay's data DEALER reads it: "
         "the tag frame b\"data\"", [TAG_DATA], "reducer", hello_ack(), Channel.DATA, []),
        ("reducer_resend_consensus", "a consensus resent point to point, byte-identical to the broadcast: the tag "
         "frame b\"bcast\"", [TAG_BCAST], "reducer", sample_record(consensus),
         Channel.BROADCAST, _payloads("data.consensus", Channel.BROADCAST)),
        ("pub_to_sub", "the broadcast: no envelope and no topic frame (subscribers subscribe to b\"\")", [],
         "reducer", sample_record(consensus), Channel.BROADCAST, _payloads("data.consensus", Channel.BROADCAST)),
        ("relay_to_reducer_data", "a relay's data record to the reducer's data ROUTER: its routing identity only",
         [RELAY_ID], f"relay:{HOST}", sample_record(REGISTRY["data.host_frame"].cls), Channel.DATA,
         _payloads("data.host_frame", Channel.DATA)),
        ("rank_to_relay_data", "a rank's deposit on its data DEALER to its relay's data ROUTER: the routing "
         "identity is the rank in ASCII decimal", [rank_identity(2)], "rank:2",
         sample_record(REGISTRY["data.round_frame"].cls), Channel.DATA, _payloads("data.round_frame", Channel.DATA)),
        ("relay_to_rank_data", "the relay's own data record to a rank, as the rank's data DEALER reads it: no "
         "envelope (the relay sends [b\"2\", message])", [], f"relay:{HOST}",
         sample_record(REGISTRY["data.frame_request"].cls), Channel.DATA, []),
        ("agent_to_controller_join", "an admitted agent's join record, as the controller's join ROUTER reads it: "
         "the agent's routing identity, b\"A\" and 15 random bytes (the agent's DEALER reads the controller's "
         "records bare)", [AGENT_ID], HOST, REGISTRY["join.heartbeat"].cls(), Channel.JOIN, []),
    ]
    out = []
    for name, leg, envelope, signer, rec, channel, payload in legs:
        frames = Codec(KEY, INCARNATION, signer, salt=SALT).encode(
            rec, [a for _, a in payload], channel=channel, dtypes=[d for d, _ in payload])
        out.append({
            "name": name, "leg": leg, "kind": rec.KIND, "channel": channel.value, "key": KEY.hex(),
            "incarnation": INCARNATION.hex(), "signer": signer, "salt": SALT.hex(), "seq": 1,
            "record": to_json(to_fields(rec)), "payload": [_payload_json(d, a) for d, a in payload],
            "envelope": _hex_frames(envelope), "frames": _hex_frames(frames),
        })
    return out


def negative_vectors() -> list[dict[str, Any]]:
    out = []
    for name, cause, error, fragment, extra in [*negative_cases(), *by_reference_cases()]:
        by_ref = {k: extra[k] for k in ("owner", "segment") if k in extra}
        out.append(
            {
                "name": name,
                "cause": cause,
                "error": error,
                "message_contains": fragment,
                "key": KEY.hex(),
                "incarnation": INCARNATION.hex(),
                "channel": extra.get("channel", "control"),
                "expected_sender": SENDER,
                "limits": extra.get("limits", {}),
                "accept_first": [_hex_frames(f) for f in extra.get("accept_first", [])],
                "frames": _hex_frames(extra["frames"]),
                **by_ref,
            }
        )
    return out


def int8_vectors() -> list[dict[str, Any]]:
    """f32 tensors and their int8 encoding (values, scales), and one RoundFrame carrying such a payload."""
    cases = {
        "ties_to_even": np.array([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.49], dtype="<f4"),
        "negative_max": np.array([-4.0, 1.0, 0.015625, 2.0], dtype="<f4"),
        "zero_block": np.zeros(3, dtype="<f4"),
        # Two blocks, the second short: x[i] = ((37 * i) % 255 - 127) / 64 for i < BLOCK + 5.
        "two_blocks": ((np.arange(int8.BLOCK + 5) * 37 % 255 - 127) / 64).astype("<f4"),
    }
    out = []
    for name, x in cases.items():
        q, s = np.empty(x.size, int8.I8), np.empty(int8.blocks(x.size), int8.F32)
        int8.quantize(x, q, s)
        vec: dict[str, Any] = {"name": name, "n": x.size, "scales": s.tolist(),
                               "scale_bits": s.view("<u4").tolist()}
        if x.size <= 16:
            vec.update(values=x.tolist(), q=q.tolist())
        else:
            vec.update(values_rule="x[i] = ((37 * i) % 255 - 127) / 64, as f32",
                       q_sha256=hashlib.sha256(q.tobytes()).hexdigest(), q_head=q[:8].tolist(),
                       q_tail=q[-8:].tolist())
        out.append(vec)
    codec = Codec(KEY, INCARNATION, SENDER, salt=SALT)
    x = cases["ties_to_even"]
    q, s = np.empty(x.size, int8.I8), np.empty(int8.blocks(x.size), int8.F32)
    int8.quantize(x, q, s)
    rec = REGISTRY["data.round_frame"].cls(round=7, rank=2, mass=1.0)
    frames = codec.encode(rec, [q, s], channel=Channel.DATA, dtypes=["i8", "f32"])
    out.append({"name": "round_frame", "kind": "data.round_frame", "channel": "data", "key": KEY.hex(),
                "incarnation": INCARNATION.hex(), "sender": SENDER, "salt": SALT.hex(), "record": to_json(to_fields(rec)),
                "payload_of": "ties_to_even", "frames": _hex_frames(frames)})
    return out


def shard_vectors() -> list[dict[str, Any]]:
    """The values each of S reducer shards owns for a flat vector of n values, and its slice's frames (10.9)."""
    from flodl_zmq.shards import ShardMap, parts

    chunk = 1 << 21
    out = []
    for n, shards in ((100, 1), (12 * chunk, 1), (12 * chunk, 2), (12 * chunk, 9), (25_000_000, 9),
                      (5 * chunk - 7, 3), (3 * 4096 - 100, 3), (chunk + 4096, 2), (48 * chunk, 5)):
        listed = ShardMap(tuple((f"h{k}", f"tcp://10.0.0.{k}:7400") for k in range(1, shards)))
        ranges = listed.ranges(n)
        out.append({"values": n, "shards": shards, "ranges": [[r.start, r.stop] for r in ranges],
                    "frames": [[[p.start, p.stop] for p in parts(r)] for r in ranges]})
    return out


def main() -> None:
    docs = {
        "records.json": {
            "about": "One accepted message per record kind and channel; decode(frames) gives `record` and "
            "`payload`, and encoding `record` as the `seq`-th message of `sender` on `channel` gives `frames` "
            "byte for byte. See protocol/PROTOCOL.md, Test vectors.",
            "vectors": positive_vectors(),
            "by_reference": by_reference_vectors(),
            "envelopes": envelope_vectors(),
        },
        "rejections.json": {
            "about": "One refused message per rejection cause: a receiver with `key`, `incarnation` and `limits` "
            "(overrides of the defaults) whose route names `expected_sender`, and that has accepted "
            "`accept_first` on `channel`, rejects `frames` with `error`. See protocol/PROTOCOL.md, Test vectors.",
            "vectors": negative_vectors(),
        },
        "windows.json": {
            "about": "Arrival orders of one sender's messages on one channel: a receiver decodes `messages` in "
            "order and accepts exactly those marked in `accepted` (the others: ReplayError), by the anti-replay "
            "window of `window` sequence numbers. See protocol/PROTOCOL.md, Sequence numbers and Test vectors.",
            "vectors": window_vectors(),
        },
        "int8.json": {
            "about": "The int8 payload (PROTOCOL.md 3.6): each f32 tensor of `n` values and its encoding, "
            "`q` (int8 values, or their SHA-256 when long) and `scales` (f32, one per block of 4096; "
            "`scale_bits` their binary32 patterns); and one data.round_frame carrying the first as "
            "(i8 values, f32 scales), decoded like a records.json vector.",
            "vectors": int8_vectors(),
        },
        "shards.json": {
            "about": "The values each reducer shard owns and the frames of its slice (PROTOCOL.md 10.9): of S "
            "shards and a flat vector of n values in B = ceil(n / 4096) blocks, shard k (0: the controller's "
            "reducer) owns values min(n, 4096*floor(k*B/S)) up to, not including, min(n, 4096*floor((k+1)*B/S)): "
            "`ranges[k]` is [start, stop). Its slice of a payload is one frame per chunk of 2^21 values (3.4) "
            "that meets its values, holding their intersection: `frames[k]` lists each frame's [start, stop) "
            "of the flat vector (under int8 each is a values frame and its blocks' scales frame, 3.6).",
            "vectors": shard_vectors(),
        },
    }
    for name, doc in docs.items():
        (HERE / name).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {HERE / name}: {len(doc['vectors'])} vectors")


if __name__ == "__main__":
    main()
