"""The authenticated msgpack wire: records, framing, MAC (normative spec: protocol/PROTOCOL.md)."""

from flodl_zmq.wire.codec import (
    DTYPES,
    PROTOCOL_VERSION,
    RUN_ID_BYTES,
    SALT_BYTES,
    Attribution,
    Codec,
    Envelope,
    Limits,
    new_incarnation,
    tensor_view,
)
from flodl_zmq.wire.mac import (
    KEY_BYTES,
    KEY_ENV,
    compute_mac,
    key_from_hex,
    new_key,
    session_key,
    verify_mac,
)
from flodl_zmq.wire.records import REGISTRY, Channel, EpochPlan

__all__ = [
    "DTYPES",
    "KEY_BYTES",
    "PROTOCOL_VERSION",
    "REGISTRY",
    "RUN_ID_BYTES",
    "SALT_BYTES",
    "Attribution",
    "Channel",
    "Codec",
    "Envelope",
    "EpochPlan",
    "Limits",
    "compute_mac",
    "key_from_hex",
    "KEY_ENV",
    "session_key",
    "new_key",
    "new_incarnation",
    "tensor_view",
    "verify_mac",
]
