"""Message authentication for every record on every channel.

Rules this module keeps (normative text: protocol/PROTOCOL.md, "Authentication"):

- The session key is exactly 32 bytes. A shorter key is refused, never padded:
  a truncated key would silently interoperate with nobody.
- The header is authenticated with HMAC-SHA256. Payload frames (tensor bytes,
  up to gigabytes) are authenticated block by block with GMAC (AES-256-GCM
  with no plaintext) under a one-time key that is itself an HMAC of the
  header. The header holds the run id, channel, sender, a sequence number
  that never repeats for that sender, and the sender incarnation's random
  salt (a restarted process reusing its name and counters still signs new
  headers), so the one-time key never repeats, each (key, nonce) pair is used
  once (GCM's requirement), and the payload tags are bound to exactly this
  header. HMAC-SHA256 over 100 MB costs ~58 ms on one
  core here; GMAC runs at ~20 GB/s, Poly1305 (protocol version 1) at ~12.
- Block tags are independent and AES-GCM releases the GIL, so a large payload
  is authenticated on every core at once: the reducer verifies a host's
  40 MB frame in about a millisecond while its other work waits on it.
- Every length is part of the MAC input, so frames cannot be cut, merged,
  swapped or reordered without the tag failing.
- A message whose payload lies in shared memory (wire/shm.py) is signed over
  its header and locator only, under a label of its own, so neither MAC can
  ever stand in for the other.
- Comparison is constant-time (hmac.compare_digest).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from flodl_zmq import threads
from flodl_zmq.errors import AuthError, ConfigError

KEY_BYTES = 32
MAC_BYTES = 32
LABEL_VERSION = 10  # the protocol version this build signs under: codec.PROTOCOL_VERSION (a test keeps them equal)
GMAC_BLOCK = 1 << 20  # bytes per block tag: parallel grain, ~5% call overhead over one whole-frame tag

Buffer = bytes | bytearray | memoryview

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_NONCE = struct.Struct("<IQ")  # frame number, block number: 12 bytes


def check_key(key: bytes) -> bytes:
    """Return `key` if it is a usable session key, else raise ConfigError naming the fix."""
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        got = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
        raise ConfigError(
            f"session key must be exactly {KEY_BYTES} bytes (got {got}); "
            "generate one with `flodl-zmq keygen` or flodl_zmq.wire.new_key()"
        )
    return bytes(key)


def new_key() -> bytes:
    """A fresh random 32-byte session key from the OS CSPRNG."""
    return os.urandom(KEY_BYTES)


def key_from_hex(text: str) -> bytes:
    """Parse a session key given as 64 hex characters (FLODL_KEY).

    The error names the variable and the fix, never the value: a near-miss of the key is still secret.
    """
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = None
    if key is None or len(key) != KEY_BYTES:
        what = "not all hex digits" if key is None else f"{len(text)} hex characters"
        raise ConfigError(f"{KEY_ENV} is not a session key ({what}): it must be {2 * KEY_BYTES} hex characters, "
                          "the same on every host; make one with `flodl-zmq keygen`")
    return key


KEY_ENV = "FLODL_KEY"


def session_key(environ: Mapping[str, str]) -> bytes | None:
    """The pre-shared session key in ``environ`` (FLODL_KEY), or None where it is unset or blank.

    How the controller, the launcher and the agent read the variable, so a key one
    accepts none of them refuses (a spawned process, which must have one, reads it
    as a required variable of its role: environment.ProcessEnv).
    """
    text = environ.get(KEY_ENV, "").strip()
    return key_from_hex(text) if text else None


def label(use: str, version: int | None = None) -> bytes:
    """The HMAC label `flodl-zmq/<version>/<use>` || 0x00 (PROTOCOL.md 4.2).

    It names the version the header claims, so a receiver can authenticate a
    peer of another version (under that version's label) before refusing it
    by name, instead of dropping its messages as forgeries (PROTOCOL.md 12).
    None: this build's version.
    """
    return f"flodl-zmq/{LABEL_VERSION if version is None else version}/{use}".encode() + b"\x00"


def payload_tag(key: bytes, header: Buffer, payloads: Sequence[Buffer], version: int | None = None) -> bytes:
    """Per payload frame: its u64 length, then the GMAC tag of each GMAC_BLOCK-byte block."""
    gcm = AESGCM(hmac.new(key, label("payload-key", version) + bytes(header), hashlib.sha256).digest())
    frames = [byte_view(frame) for frame in payloads]
    blocks = [
        (_NONCE.pack(i, j), view[start:start + GMAC_BLOCK])
        for i, view in enumerate(frames, 1)
        for j, start in enumerate(range(0, view.nbytes, GMAC_BLOCK))
    ]

    def tag(block: tuple[bytes, memoryview]) -> bytes:
        return gcm.encrypt(block[0], b"", block[1])

    tags = iter(threads.each(tag, blocks))
    out = bytearray()
    for view in frames:
        out += _U64.pack(view.nbytes)
        for _ in range(0, view.nbytes, GMAC_BLOCK):
            out += next(tags)
    return bytes(out)


def byte_view(frame: Any) -> memoryview:
    """A flat byte view of a frame: bytes, a buffer (a numpy array, a memoryview) or a zmq.Frame."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame, without importing zmq here
    view = memoryview(buf if buf is not None else frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def compute_mac(key: bytes, header: Buffer, payloads: Sequence[Buffer], version: int | None = None) -> bytes:
    """The 32-byte MAC frame for a message: HMAC-SHA256 over the header and the payload tag.

    `version` is the protocol version whose labels sign it: this build's, or
    the one a received header claims (`Codec.authentic`).
    """
    header = bytes(header)
    mac = hmac.new(key, label("mac", version), hashlib.sha256)
    mac.update(_U32.pack(len(payloads)))
    mac.update(_U64.pack(len(header)))
    mac.update(header)
    if payloads:
        mac.update(payload_tag(key, header, payloads, version))
    return mac.digest()


def reference_mac(key: bytes, header: Buffer, locator: Buffer) -> bytes:
    """The 32-byte MAC of a by-reference message: HMAC-SHA256 over its header and locator.

    Its own label keeps it from ever validating a framed message, or the reverse.
    """
    header, locator = bytes(header), bytes(locator)
    mac = hmac.new(key, label("by-reference"), hashlib.sha256)
    mac.update(_U64.pack(len(header)))
    mac.update(header)
    mac.update(_U64.pack(len(locator)))
    mac.update(locator)
    return mac.digest()


def verify_mac(
    key: bytes, header: Buffer, payloads: Sequence[Buffer], tag: Buffer, version: int | None = None
) -> None:
    """Raise AuthError unless `tag` is the MAC of this header and these payload frames."""
    _compare(compute_mac(key, header, payloads, version), tag)


def verify_reference_mac(key: bytes, header: Buffer, locator: Buffer, tag: Buffer) -> None:
    """Raise AuthError unless `tag` is the by-reference MAC of this header and locator."""
    _compare(reference_mac(key, header, locator), tag)


def _compare(expected: bytes, tag: Buffer) -> None:
    if memoryview(tag).nbytes != MAC_BYTES:
        raise AuthError(f"MAC frame is {memoryview(tag).nbytes} bytes, expected {MAC_BYTES}")
    if not hmac.compare_digest(expected, bytes(tag)):
        raise AuthError(
            "MAC verification failed: the frame was altered, belongs to another run, or the "
            "sender uses a different session key (check FLODL_KEY on both ends)"
        )
