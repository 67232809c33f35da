"""The codec against protocol/vectors/, in both directions, and the registry
against the vectors and PROTOCOL.md: a record the spec does not describe, or
a vector the code no longer reproduces, fails here."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import pathlib
import re
import struct
import types
import typing
from typing import Any, Union

import msgpack
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from flodl_zmq import errors
from flodl_zmq.links import (
    RELAY_ROUTE,
    TAG_BCAST,
    TAG_DATA,
    rank_identity,
    rank_sender,
    relay_identity,
    relay_sender,
)
from flodl_zmq.tensors import bf16_from_f32
from flodl_zmq.wire import (
    PROTOCOL_VERSION,
    REGISTRY,
    SALT_BYTES,
    Attribution,
    Channel,
    Codec,
    EpochPlan,
    Limits,
    compute_mac,
    verify_mac,
)
from flodl_zmq.wire import mac as mac_module
from flodl_zmq.wire.codec import REPLAY_WINDOW
from flodl_zmq.wire.shm import ALIGN, SHM_TAG, SegmentMap, host_owner, rank_owner

ROOT = pathlib.Path(__file__).resolve().parents[2]
VECTORS = ROOT / "protocol" / "vectors"
SPEC = (ROOT / "protocol" / "PROTOCOL.md").read_text()
POSITIVE = json.loads((VECTORS / "records.json").read_text())["vectors"]
NEGATIVE = json.loads((VECTORS / "rejections.json").read_text())["vectors"]
WINDOWS = json.loads((VECTORS / "windows.json").read_text())["vectors"]

# One small record per channel, used to advance a fresh Codec's sequence counter.
FILLER = {
    Channel.CONTROL: REGISTRY["control.shutdown"].cls(),
    Channel.DATA: REGISTRY["data.consensus_request"].cls(round=0),
    Channel.BROADCAST: REGISTRY["bcast.probe"].cls(nonce=0),
    Channel.JOIN: REGISTRY["join.reject"].cls(reason="", nonce=b""),
}


def from_json(value: Any, tp: Any) -> Any:
    """A vector's JSON value as the Python value of annotation `tp` (bytes are hex)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            return None
        return from_json(value, next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is list:
        return [from_json(v, typing.get_args(tp)[0]) for v in value]
    if origin is dict:
        return {k: from_json(v, typing.get_args(tp)[1]) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return record_from_json(tp, value)
    if tp is bytes:
        return bytes.fromhex(value)
    return float(value) if tp is float else value


def record_from_json(cls: type, fields: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    assert set(fields) == {f.name for f in dataclasses.fields(cls)}
    return cls(**{name: from_json(v, hints[name]) for name, v in fields.items()})


def frames_of(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


def payload_arrays(vector: dict[str, Any], frames: list[bytes] | None = None) -> tuple[list[np.ndarray], list[str]]:
    """The vector's payload arrays; one given by its `sha256` only is read from `frames` (the payload frames)."""
    arrays, dtypes = [], []
    for i, p in enumerate(vector["payload"]):
        if "sha256" in p:
            raw = (frames or frames_of(vector["frames"])[1:-1])[i]
            assert hashlib.sha256(raw).hexdigest() == p["sha256"]
            arr = np.frombuffer(raw, dtype={"f32": "<f4", "f16": "<f2", "bf16": "<u2"}[p["dtype"]])
        elif p["dtype"] == "bf16":
            arr = np.array(p["bits"], dtype="<u2")
        else:
            arr = np.array(p["values"], dtype={"f32": "<f4", "f16": "<f2"}[p["dtype"]])
        arrays.append(arr.reshape(p["shape"]))
        dtypes.append(p["dtype"])
    return arrays, dtypes


def codec_for(
    vector: dict[str, Any], sender: str = "receiver", limits: Limits | None = None
) -> Codec:
    salt = bytes.fromhex(vector["salt"]) if "salt" in vector else None
    return Codec(bytes.fromhex(vector["key"]), bytes.fromhex(vector["incarnation"]), sender, limits, salt=salt)


@pytest.mark.parametrize("vector", POSITIVE, ids=[v["name"] for v in POSITIVE])
def test_vector_decodes_to_its_record_and_payload(vector: dict[str, Any]) -> None:
    spec = REGISTRY[vector["kind"]]
    env = codec_for(vector).decode(frames_of(vector["frames"]), Channel(vector["channel"]))
    assert env.kind == vector["kind"]
    assert env.record == record_from_json(spec.cls, vector["record"])
    assert (env.sender, env.seq, env.incarnation.hex()) == (
        vector["sender"],
        vector["seq"],
        vector["incarnation"],
    )
    arrays, dtypes = payload_arrays(vector)
    assert env.dtypes == dtypes
    for got, want in zip(env.payload, arrays, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(got, want)


@pytest.mark.parametrize("vector", POSITIVE, ids=[v["name"] for v in POSITIVE])
def test_record_encodes_to_the_vector_frames_byte_for_byte(vector: dict[str, Any]) -> None:
    if not vector.get("canonical", True):
        pytest.skip("a non-canonical encoding: decoders accept it, encoders never produce it")
    channel = Channel(vector["channel"])
    codec = codec_for(vector, sender=vector["sender"])
    for _ in range(vector["seq"] - 1):  # the Codec numbers each channel from 1
        codec.encode(FILLER[channel], channel=channel)
    rec = record_from_json(REGISTRY[vector["kind"]].cls, vector["record"])
    arrays, dtypes = payload_arrays(vector)
    frames = codec.encode(rec, arrays, channel=channel, dtypes=dtypes)
    assert [bytes(f).hex() for f in frames] == vector["frames"]


def spec_mac(key: bytes, header: bytes, payloads: list[bytes], version: int = PROTOCOL_VERSION) -> bytes:
    """The MAC of PROTOCOL.md 4.2, written from the text rather than from mac.py."""
    tag = b""
    if payloads:
        one_time = hmac.new(key, f"flodl-zmq/{version}/payload-key".encode() + b"\x00" + header,
                            hashlib.sha256).digest()
        for i, p in enumerate(payloads, 1):
            tag += struct.pack("<Q", len(p))
            for j in range(0, len(p), 1 << 20):
                nonce = struct.pack("<I", i) + struct.pack("<Q", j >> 20)
                tag += AESGCM(one_time).encrypt(nonce, b"", p[j:j + (1 << 20)])
    body = struct.pack("<I", len(payloads)) + struct.pack("<Q", len(header)) + header + tag
    return hmac.new(key, f"flodl-zmq/{version}/mac".encode() + b"\x00" + body, hashlib.sha256).digest()


@pytest.mark.parametrize("vector", POSITIVE, ids=[v["name"] for v in POSITIVE])
def test_vector_mac_is_the_construction_the_spec_describes(vector: dict[str, Any]) -> None:
    frames = frames_of(vector["frames"])
    assert spec_mac(bytes.fromhex(vector["key"]), frames[0], frames[1:-1]) == frames[-1]


def test_two_incarnations_never_share_a_one_time_key_or_payload_tags() -> None:
    # Issue 15 finding 8: a restarted process under the same sender name, run id and key,
    # encoding the same record as its seq-th message, must not reuse a (GCM key, nonce):
    # the salt in the signed header changes the one-time key, hence every block tag.
    vector = next(v for v in POSITIVE if v["payload"])
    channel = Channel(vector["channel"])
    rec = record_from_json(REGISTRY[vector["kind"]].cls, vector["record"])
    arrays, dtypes = payload_arrays(vector)
    key, run = bytes.fromhex(vector["key"]), bytes.fromhex(vector["incarnation"])
    sent = []
    for salt in (bytes(16), b"\xff" * 16):
        codec = Codec(key, run, vector["sender"], salt=salt)
        for _ in range(vector["seq"] - 1):
            codec.encode(FILLER[channel], channel=channel)
        sent.append(codec.encode(rec, arrays, channel=channel, dtypes=dtypes))
    (h1, *p1, m1), (h2, *p2, m2) = ([bytes(f) for f in frames] for frames in sent)
    assert p1 == p2 and h1 != h2 and m1 != m2
    one_time = [hmac.new(key, mac_module.label("payload-key") + h, hashlib.sha256).digest() for h in (h1, h2)]
    assert one_time[0] != one_time[1]
    nonce = struct.pack("<IQ", 1, 0)
    tags = [AESGCM(k).encrypt(nonce, b"", p1[0][: 1 << 20]) for k in one_time]
    assert tags[0] != tags[1]
    assert mac_module.payload_tag(key, h1, p1) != mac_module.payload_tag(key, h2, p2)
    for frames in sent:  # both decode: the salt is a header field, not a receiver setting
        codec_for(vector).decode(frames, channel)


def test_codec_draws_a_fresh_salt_per_instance() -> None:
    unsalted = {k: v for k, v in POSITIVE[0].items() if k != "salt"}
    a, b = codec_for(unsalted), codec_for(unsalted)
    assert len(a.salt) == SALT_BYTES and len(b.salt) == SALT_BYTES and a.salt != b.salt
    with pytest.raises(errors.SchemaError, match="salt must be 16 bytes"):
        Codec(bytes.fromhex(unsalted["key"]), bytes.fromhex(unsalted["incarnation"]), "x", salt=bytes(15))


def test_multi_block_payload_mac_is_the_construction_the_spec_describes() -> None:
    # The vectors' payloads fit one block; models span many, and a frame may end anywhere in one.
    rng = np.random.default_rng(7)
    key, header = bytes(range(32)), b"a header of some kind"
    sizes = [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 17]
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    assert compute_mac(key, header, payloads) == spec_mac(key, header, payloads)


def test_a_payload_change_in_any_block_or_a_block_moved_fails_the_mac() -> None:
    rng = np.random.default_rng(8)
    key, header = bytes(range(32)), b"h"
    body = bytearray(rng.integers(0, 256, 3 * (1 << 20) + 5, dtype=np.uint8).tobytes())
    tag = compute_mac(key, header, [body])
    for at in (0, (1 << 20) + 3, len(body) - 1):  # first, middle and the short last block
        bad = bytearray(body)
        bad[at] ^= 0x10
        with pytest.raises(errors.AuthError):
            verify_mac(key, header, [bad], tag)
    swapped = body[1 << 20:2 << 20] + body[:1 << 20] + body[2 << 20:]
    with pytest.raises(errors.AuthError):
        verify_mac(key, header, [swapped], tag)
    with pytest.raises(errors.AuthError):  # the same bytes cut into two frames at a block boundary
        verify_mac(key, header, [body[:1 << 20], body[1 << 20:]], tag)


def test_positive_vectors_replayed_in_file_order_form_one_valid_stream() -> None:
    receiver = codec_for(POSITIVE[0])
    for vector in POSITIVE:
        receiver.decode(frames_of(vector["frames"]), Channel(vector["channel"]))


def test_bf16_payload_bits_are_f32_rounded_to_nearest_even() -> None:
    bf16 = [p for v in POSITIVE for p in v["payload"] if p["dtype"] == "bf16"]
    assert bf16, "a vector must carry a bf16 payload"
    for p in bf16:
        source = np.array(p["from_f32"], dtype="<f4")
        bits = np.array(p["bits"], dtype="<u2")
        rounded = torch.from_numpy(source).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
        assert np.array_equal(rounded, bits)
        assert np.array_equal(bf16_from_f32(source, np.empty_like(bits)), bits)
        # Decoding is exact: a bf16 is the top half of an f32 bit pattern.
        assert np.array_equal(
            (bits.astype("<u4") << 16).view("<f4"), np.array(p["values"], dtype="<f4")
        )


def segment_map(vector: dict[str, Any], directory: pathlib.Path) -> SegmentMap:
    """A reader whose run directory holds the vector's segment file, private to this user (0600)."""
    path = directory / vector["segment"]["name"]
    path.write_bytes(bytes.fromhex(vector["segment"]["hex"]))
    path.chmod(0o600)
    directory.chmod(0o700)
    return SegmentMap(bytes.fromhex(vector["incarnation"]), str(directory))


@pytest.mark.parametrize("vector", NEGATIVE, ids=[v["name"] for v in NEGATIVE])
def test_rejection_vector_raises_its_error(vector: dict[str, Any], tmp_path: pathlib.Path) -> None:
    receiver = codec_for(vector, limits=Limits(**vector["limits"]))
    channel = Channel(vector["channel"])
    sender = Attribution.signed_by(vector["expected_sender"], "the vector's route")
    for earlier in vector["accept_first"]:
        receiver.decode_from(frames_of(earlier), channel, sender)
    error = getattr(errors, vector["error"])
    assert issubclass(error, errors.WireError)
    with pytest.raises(error) as info:
        if "segment" in vector:  # the by-reference form, read from the owner's segment
            segment_map(vector, tmp_path).decode(receiver, frames_of(vector["frames"]), vector["owner"], channel,
                                                 sender=sender)
        else:
            receiver.decode_from(frames_of(vector["frames"]), channel, sender)
    assert type(info.value) is error
    assert vector["message_contains"] in str(info.value)


@pytest.mark.parametrize("vector", WINDOWS, ids=[v["name"] for v in WINDOWS])
def test_window_vector_accepts_exactly_the_marked_arrivals(vector: dict[str, Any]) -> None:
    assert vector["window"] == REPLAY_WINDOW
    receiver = codec_for(vector)
    sender = Attribution.signed_by(vector["sender"], "the vector's route")
    got = []
    for message in vector["messages"]:
        try:
            receiver.decode_from(frames_of(message), Channel(vector["channel"]), sender)
            got.append(True)
        except errors.ReplayError:
            got.append(False)
    assert got == vector["accepted"]


def test_a_genuine_message_of_another_version_is_authentic_and_a_forgery_is_not() -> None:
    # PROTOCOL.md 12: a receiver may tell a peer of another version from a stranger by checking the MAC
    # under the labels of the version the header claims; only then does a join socket name the skew.
    vector = next(v for v in NEGATIVE if v["name"] == "other_version_genuine")
    frames = frames_of(vector["frames"])
    receiver = codec_for(vector)
    assert receiver.authentic(frames)
    assert not receiver.authentic([frames[0], bytes(32)])
    assert not Codec(bytes(32), bytes.fromhex(vector["incarnation"]), "x").authentic(frames)
    version = msgpack.unpackb(frames[0])["v"]
    assert spec_mac(receiver.key, frames[0], [], version) == frames[-1]


BY_REFERENCE = json.loads((VECTORS / "records.json").read_text())["by_reference"]
ENVELOPES = json.loads((VECTORS / "records.json").read_text())["envelopes"]


def reference_mac_from_the_spec(key: bytes, header: bytes, locator: bytes) -> bytes:
    """The by-reference MAC of PROTOCOL.md 3.5, written from the text."""
    body = struct.pack("<Q", len(header)) + header + struct.pack("<Q", len(locator)) + locator
    return hmac.new(key, f"flodl-zmq/{PROTOCOL_VERSION}/by-reference".encode() + b"\0" + body, hashlib.sha256).digest()


@pytest.mark.parametrize("vector", BY_REFERENCE, ids=[v["name"] for v in BY_REFERENCE])
def test_by_reference_vector_decodes_from_its_segment(vector: dict[str, Any], tmp_path: pathlib.Path) -> None:
    frames = frames_of(vector["frames"])
    assert frames[0] == b"shm" and len(frames) == 4
    assert reference_mac_from_the_spec(bytes.fromhex(vector["key"]), frames[2], frames[1]) == frames[3]
    env = segment_map(vector, tmp_path).decode(codec_for(vector), frames, vector["owner"], Channel(vector["channel"]))
    assert env.record == record_from_json(REGISTRY[vector["kind"]].cls, vector["record"])
    name, pairs = msgpack.unpackb(frames[1])
    segment = bytes.fromhex(vector["segment"]["hex"])
    arrays, dtypes = payload_arrays(vector, [segment[off:off + n] for off, n in pairs])
    assert env.dtypes == dtypes and all(np.array_equal(a, b) for a, b in zip(env.payload, arrays, strict=True))


# Who the receiving socket attributes each by-reference vector to (3.5 step 3, 7 step 21): rank 2's
# data socket at its relay, and on rank 2's data DEALER its own host's relay.
REFERENCE_SIGNERS = {
    rank_owner(2): Attribution.signed_by(rank_sender(2), "rank 2's data socket", rank=2),
    host_owner("host-a"): Attribution.signed_by(relay_sender("host-a"), "the data link from host-a's relay"),
}


@pytest.mark.parametrize("vector", BY_REFERENCE, ids=[v["name"] for v in BY_REFERENCE])
def test_by_reference_vector_is_signed_by_the_peer_whose_segment_it_names(
    vector: dict[str, Any], tmp_path: pathlib.Path
) -> None:
    frames = frames_of(vector["frames"])
    env = segment_map(vector, tmp_path).decode(codec_for(vector), frames, vector["owner"], Channel(vector["channel"]),
                                               sender=REFERENCE_SIGNERS[vector["owner"]], replay=vector["channel"] != "bcast")
    assert env.sender == vector["sender"]


@pytest.mark.parametrize("vector", BY_REFERENCE, ids=[v["name"] for v in BY_REFERENCE])
def test_by_reference_record_encodes_to_the_vector_frames(vector: dict[str, Any]) -> None:
    frames = frames_of(vector["frames"])
    name, pairs = msgpack.unpackb(frames[1])
    segment = bytes.fromhex(vector["segment"]["hex"])
    arrays, dtypes = payload_arrays(vector, [segment[off:off + n] for off, n in pairs])
    rec = record_from_json(REGISTRY[vector["kind"]].cls, vector["record"])
    header, mac = codec_for(vector, sender=vector["sender"]).encode_reference(
        rec, arrays, frames[1], channel=Channel(vector["channel"]), dtypes=dtypes)
    assert [SHM_TAG, frames[1], header, mac] == frames
    owner = vector["owner"]
    assert name == f"flodl-{vector['incarnation']}-{owner}-1"
    assert owner in (rank_owner(2), host_owner("host-a"))
    assert all(off % ALIGN == 0 for off, _ in pairs)


@pytest.mark.parametrize("vector", ENVELOPES, ids=[v["name"] for v in ENVELOPES])
def test_envelope_vector_is_what_the_legs_send_and_its_message_decodes(vector: dict[str, Any]) -> None:
    envelope = {
        "rank_to_relay_control": [rank_identity(2)],
        "relay_to_controller_rank_record": [relay_identity("host-a", bytes.fromhex("0123456789abcdef")),
                                            rank_identity(2)],
        "relay_own_control_record": [relay_identity("host-a", bytes.fromhex("0123456789abcdef")), RELAY_ROUTE],
        "controller_to_relay_for_rank": [rank_identity(2)],
        "reducer_to_relay_data": [TAG_DATA],
        "reducer_resend_consensus": [TAG_BCAST],
        "pub_to_sub": [],
        "relay_to_reducer_data": [relay_identity("host-a", bytes.fromhex("0123456789abcdef"))],
        "rank_to_relay_data": [rank_identity(2)],
        "relay_to_rank_data": [],
        "agent_to_controller_join": [b"A" + bytes(range(1, 16))],
    }[vector["name"]]
    assert frames_of(vector["envelope"]) == envelope
    channel = Channel(vector["channel"])
    rec = record_from_json(REGISTRY[vector["kind"]].cls, vector["record"])
    frames = frames_of(vector["frames"])
    arrays, dtypes = payload_arrays(vector)
    encoder = Codec(bytes.fromhex(vector["key"]), bytes.fromhex(vector["incarnation"]), vector["signer"],
                    salt=bytes.fromhex(vector["salt"]))
    assert [bytes(f) for f in encoder.encode(rec, arrays, channel=channel, dtypes=dtypes)] == frames
    env = codec_for(vector).decode_from(frames, channel, Attribution.signed_by(vector["signer"], vector["name"]))
    assert env.record == rec


# Each leg of PROTOCOL.md 3.1's envelope table (its first cell, up to the arrow) and the vectors that show it.
LEG_VECTORS = {
    "rank control or data DEALER": ["rank_to_relay_control", "rank_to_relay_data"],
    "relay control DEALER": ["relay_to_controller_rank_record", "relay_own_control_record"],
    "controller control ROUTER": ["controller_to_relay_for_rank"],
    "relay local control ROUTER": ["controller_to_relay_for_rank"],
    "relay data DEALER": ["relay_to_reducer_data"],
    "reducer data ROUTER": ["reducer_to_relay_data", "reducer_resend_consensus"],
    "reducer PUB": ["pub_to_sub"],
    "relay local data ROUTER": ["relay_to_rank_data"],
    "agent join DEALER": ["agent_to_controller_join"],
}


def test_every_leg_of_the_envelope_table_has_a_vector() -> None:
    section = SPEC.split("**Envelope frames (normative).**", 1)[1].split("\n\n", 2)[1]
    rows = "\n".join(section.splitlines()[2:])  # past the heading row and the rule under it
    legs = re.findall(r"^\| ([^|]+?) (?:→|⇄) ", rows, re.M)
    assert len(legs) >= 9, f"PROTOCOL.md 3.1's envelope table should list every leg, found {legs}"
    assert sorted(legs) == sorted(LEG_VECTORS), "a leg of PROTOCOL.md 3.1 without a vector, or a vector of no leg"
    names = {v["name"] for v in ENVELOPES}
    missing = {leg: want for leg, want in LEG_VECTORS.items() if not set(want) <= names}
    assert not missing, f"regenerate protocol/vectors: no envelope vector for {missing}"


def test_every_registered_kind_and_channel_has_a_positive_vector() -> None:
    covered = {(v["kind"], v["channel"]) for v in POSITIVE}
    wanted = {(kind, ch.value) for kind, spec in REGISTRY.items() for ch in spec.channels}
    assert wanted <= covered, f"regenerate protocol/vectors: missing {sorted(wanted - covered)}"
    assert {kind for kind, _ in covered} <= set(REGISTRY), "vectors name kinds the registry lacks"


def test_every_rejection_error_class_has_a_vector() -> None:
    named = {v["error"] for v in NEGATIVE}
    causes = {cls.__name__ for cls in errors.WireError.__subclasses__()}
    assert causes <= named, f"no rejection vector for {sorted(causes - named)}"


def _record_section(kind: str) -> str:
    """The PROTOCOL.md text under the heading that names `kind`, up to the next heading."""
    match = re.search(rf"^#+ [^\n]*`{re.escape(kind)}`[^\n]*\n(.*?)(?=^#)", SPEC, re.M | re.S)
    assert match, f"PROTOCOL.md has no section for record kind {kind!r}"
    return match.group(1)


@pytest.mark.parametrize("kind", list(REGISTRY))
def test_spec_describes_every_record_and_each_of_its_fields(kind: str) -> None:
    spec = REGISTRY[kind]
    section = _record_section(kind)
    for f in dataclasses.fields(spec.cls):
        assert f"`{f.name}`" in section, (
            f"PROTOCOL.md section {kind} does not describe field {f.name!r}"
        )
    for ch in spec.channels:
        assert ch.value in section, f"PROTOCOL.md section {kind} does not name channel {ch.value!r}"


def test_spec_describes_the_epoch_plan_fields() -> None:
    section = _record_section("EpochPlan")
    for f in dataclasses.fields(EpochPlan):
        assert f"`{f.name}`" in section


def test_the_model_signature_protocol_md_gives_is_the_ranks() -> None:
    # PROTOCOL.md 9.3 (`rank.hello`): a third-party rank that computes it as written agrees with ours.
    from flodl_zmq.payload import model_signature

    stated = re.search(r"`BatchNorm1d\(3\)` in a `Sequential` it is\s+`([0-9a-f]{64})`", SPEC)
    assert stated, "PROTOCOL.md 9.3 should give the model signature of Sequential(Linear(2, 3), BatchNorm1d(3))"
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    assert model_signature(model).hex() == stated.group(1)
