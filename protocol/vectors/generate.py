"""Regenerate the wire test vectors: `records.json` (one accepted message per
record kind and channel) and `rejections.json` (one refused message per
rejection cause).

    .venv/bin/python protocol/vectors/generate.py

Rules this script keeps:

- Deterministic: a fixed key, run id, sender and salt, and per-channel sequence
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

from flodl_zmq.wire import PROTOCOL_VERSION, REGISTRY, Channel, Codec, EpochPlan, compute_mac
from flodl_zmq.wire.records import to_fields

HERE = pathlib.Path(__file__).resolve().parent
KEY = bytes(range(32))
OTHER_KEY = bytes(range(32, 64))
RUN_ID = bytes.fromhex("f10d17c0ffee4a11b0a7d00dfeedf00d")
OTHER_RUN_ID = bytes.fromhex("0123456789abcdef0123456789abcdef")
SENDER = "host-a/rank-2"
SALT = bytes.fromhex("5a17c0de0123456789abcdef5a17c0de")  # the sender incarnation's salt (random in use)
OTHER_SALT = bytes.fromhex("0badc0de0badc0de0badc0de0badc0de")


def _sig(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


PLAN = EpochPlan(epoch=3, offset=1200, size=400)

# Realistic values by field name; anything else falls back to its type.
FIELD_VALUES: dict[str, Any] = {
    "round": 7,
    "rank": 2,
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
    "scalars": {"accuracy": 0.953125},
    "metric": 0.953125,
    "batch_ms": [12.5, 11.75],
    "data_ms": [0.75, 0.5],
    "step_count": 1234,
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
    "scalar_sums": {"accuracy": 179.25},
    "scalar_counts": {"accuracy": 188},
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
    "spawn_json": '{"hosts": {"host-a": [2, 3]}}',
    "code": -9,
    "next_plan": PLAN,
    "plan": PLAN,
}


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
        return [sample(typing.get_args(tp)[0], name)]
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
    if kind == "data.consensus" and channel is Channel.BROADCAST:
        return [("f32", np.array([[0.5, 0.25], [-1.0, 2.0]], dtype="<f4"))]
    if kind == "data.consensus":
        return [("f16", np.array([0.5, -1.5, 65504.0], dtype="<f2"))]
    return []


def _payload_json(dtype: str, arr: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": dtype, "shape": list(arr.shape)}
    if dtype == "bf16":
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
    if isinstance(value, EpochPlan):
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
    codec = Codec(KEY, RUN_ID, SENDER, salt=SALT)
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
                    "run_id": RUN_ID.hex(),
                    "sender": SENDER,
                    "salt": SALT.hex(),
                    "seq": seq,
                    "record": to_json(to_fields(rec)),
                    "payload": [_payload_json(d, a) for d, a in payload],
                    "frames": _hex_frames(frames),
                }
            )
    return out


# ---------------------------------------------------------------- negative vectors


def header(
    kind: str = "timing.heartbeat",
    ch: str = "control",
    fields: Any = None,
    p: Any = None,
    seq: Any = 1,
    run: Any = RUN_ID,
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
        "f": {"rank": 2, "step_count": 1234} if fields is None else fields,
        "p": [] if p is None else p,
    }


def signed(
    head: dict[str, Any] | bytes, payloads: list[bytes] = (), key: bytes = KEY
) -> list[bytes]:
    """Frames `[header, payload..., mac]` with a valid MAC over whatever the header is."""
    raw = head if isinstance(head, bytes) else msgpack.packb(head, use_bin_type=True)
    return [raw, *payloads, compute_mac(key, raw, list(payloads))]


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
    tampered_head = msgpack.packb(header(fields={"rank": 2, "step_count": 1235}), use_bin_type=True)
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
            "AuthError",
            "belongs to run",
            {"frames": signed(header(run=OTHER_RUN_ID))},
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
            {"frames": signed(header(fields={"rank": 2, "step_count": _nested(12)}))},
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
            {"frames": signed(header(fields={"rank": 2}))},
        ),
        (
            "field_unknown",
            "timing.heartbeat with an extra field",
            "SchemaError",
            "unknown field",
            {"frames": signed(header(fields={"rank": 2, "step_count": 1, "extra": 0}))},
        ),
        (
            "field_mistyped",
            "step_count as a string",
            "SchemaError",
            "expected int, got str",
            {"frames": signed(header(fields={"rank": 2, "step_count": "1234"}))},
        ),
        (
            "field_bool_for_int",
            "rank given as true",
            "SchemaError",
            "expected int, got bool",
            {"frames": signed(header(fields={"rank": True, "step_count": 1}))},
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
                        fields={"round": 7, "next_plan": {"epoch": "3", "offset": 0, "size": 1}},
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
            "no `salt` key (a version 2 header under a version 3 number)",
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
            "a version 3 timing.batch (one step, single floats)",
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
            "replayed_sequence",
            "the same message twice",
            "ReplayError",
            "is not above 1",
            {"frames": ok, "accept_first": [ok]},
        ),
        (
            "reordered_sequence",
            "seq 2 accepted, then seq 1",
            "ReplayError",
            "is not above 2",
            {"frames": ok, "accept_first": [signed(header(seq=2))]},
        ),
    ]


def negative_vectors() -> list[dict[str, Any]]:
    out = []
    for name, cause, error, fragment, extra in negative_cases():
        out.append(
            {
                "name": name,
                "cause": cause,
                "error": error,
                "message_contains": fragment,
                "key": KEY.hex(),
                "run_id": RUN_ID.hex(),
                "channel": extra.get("channel", "control"),
                "expected_sender": SENDER,
                "limits": extra.get("limits", {}),
                "accept_first": [_hex_frames(f) for f in extra.get("accept_first", [])],
                "frames": _hex_frames(extra["frames"]),
            }
        )
    return out


def main() -> None:
    docs = {
        "records.json": {
            "about": "One accepted message per record kind and channel; decode(frames) gives `record` and "
            "`payload`, and encoding `record` as the `seq`-th message of `sender` on `channel` gives `frames` "
            "byte for byte. See protocol/PROTOCOL.md, Test vectors.",
            "vectors": positive_vectors(),
        },
        "rejections.json": {
            "about": "One refused message per rejection cause: a receiver with `key`, `run_id` and `limits` "
            "(overrides of the defaults) whose route names `expected_sender`, and that has accepted "
            "`accept_first` on `channel`, rejects `frames` with `error`. See protocol/PROTOCOL.md, Test vectors.",
            "vectors": negative_vectors(),
        },
    }
    for name, doc in docs.items():
        (HERE / name).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {HERE / name}: {len(doc['vectors'])} vectors")


if __name__ == "__main__":
    main()
