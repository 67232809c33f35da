"""TensorBoard event files of a run, without TensorBoard: `RUN_DIR/events.out.tfevents.<time>.<host>`.

The run log (flodl_zmq/runlog.py) hands every event it writes to `series`,
which picks the scalars TensorBoard shows; `record` frames each as
TensorBoard reads it, so `tensorboard --logdir RUN_DIR` draws the run
without this package depending on tensorboard.

The format (TFRecord framing of `Event` protobufs):

    record  uint64 length | uint32 masked CRC32C(length) | bytes | uint32 masked CRC32C(bytes)
    Event   wall_time double (1), step int64 (2), file_version string (3, "brain.Event:2" in the
            first record), summary (5) -> Summary.value repeated (1) -> {tag string (1), simple_value float (2)}

Rules it keeps: the writer is pure (bytes out, the time an argument); only
the series named in `series` are written, one scalar per rank at most, so a
file grows with the run's rounds and epochs and nothing else.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

FILE_PREFIX = "events.out.tfevents"
FILE_VERSION = "brain.Event:2"
FLOAT32_MAX = 3.4028234663852886e38  # simple_value is a float32


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of `data`; per byte in Python, which the records' few dozen bytes afford."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C: a CRC of data that holds CRCs must not look like one."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 on the wire: a negative step is ten bytes, as protobuf writes it
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, scalars: Mapping[str, float] | None = None,
          file_version: str | None = None) -> bytes:
    """One `Event` protobuf: a file's first (`file_version`) or one step's `scalars` (tag -> value)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)  # fields 1 (double) and 2 (varint)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", _float32(value)))
                          for tag, value in scalars.items())
        out += _field(5, values)
    return out


def _float32(value: float) -> float:
    """`value` as TensorBoard's float32 holds it: a finite value past its range (a rank may report 1e308) is
    its infinity, not an OverflowError in the run log's writer."""
    return value if not math.isfinite(value) or abs(value) <= FLOAT32_MAX else math.copysign(math.inf, value)


def first_record(wall_time: float) -> bytes:
    """What every event file starts with: the file version TensorBoard checks."""
    return record(event(wall_time, 0, file_version=FILE_VERSION))


def series(kind: str, fields: Mapping[str, Any]) -> tuple[int, dict[str, float]] | None:
    """The scalars a run log event gives TensorBoard, with their step; None for other kinds.

    Epoch series step by epoch (1-based, as the epoch lines print them);
    round time by round. Values that are not numbers (a NaN logged as null)
    are left out.
    """
    scalars: dict[str, Any]
    if kind == "epoch":
        step = fields["epoch"] + 1
        scalars = {"loss": fields.get("avg_loss")}
        scalars |= {f"share/rank{r}": v for r, v in enumerate(fields.get("batch_share") or [])}
        scalars |= {f"throughput/rank{r}": v for r, v in enumerate(fields.get("throughput") or [])}
    elif kind == "eval":
        step, scalars = fields["epoch"] + 1, {"eval": fields.get("metric")}
    elif kind == "round" and fields.get("round_ms") is not None:
        step, scalars = fields["round"], {"round_ms": fields["round_ms"]}
    else:
        return None
    kept = {tag: float(v) for tag, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return (step, kept) if kept else None
