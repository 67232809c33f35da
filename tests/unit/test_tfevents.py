"""The TensorBoard event files of a run directory: the pure writer against known vectors, and TensorBoard's own reader."""

from __future__ import annotations

import math
import struct

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from flodl_zmq import tfevents
from flodl_zmq.runlog import RunLog


def test_crc32c_matches_the_standard_check_value_and_known_vectors():
    assert tfevents.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720, iSCSI)
    assert tfevents.crc32c(b"") == 0
    assert tfevents.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert tfevents.crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of ones


def test_a_record_is_framed_with_masked_crcs_of_its_length_and_its_bytes():
    data = b"123456789"
    framed = tfevents.record(data)
    length = struct.pack("<Q", 9)
    crc = 0xE3069283
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF  # TFRecord's mask, computed by hand
    assert tfevents.masked_crc(data) == masked
    assert framed[:8] == length and framed[12:21] == data
    assert struct.unpack("<I", framed[8:12])[0] == tfevents.masked_crc(length)
    assert struct.unpack("<I", framed[21:])[0] == masked


def test_only_the_named_series_become_scalars():
    epoch = {"epoch": 0, "avg_loss": 0.5, "epoch_ms": 10.0, "batch_share": [0.6, 0.4], "throughput": [100.0, 80.0]}
    assert tfevents.series("epoch", epoch) == (1, {"loss": 0.5, "share/rank0": 0.6, "share/rank1": 0.4,
                                                   "throughput/rank0": 100.0, "throughput/rank1": 80.0})
    assert tfevents.series("eval", {"epoch": 2, "metric": 0.9}) == (3, {"eval": 0.9})
    assert tfevents.series("round", {"round": 7, "round_ms": 12.5, "counts": [3, 4]}) == (7, {"round_ms": 12.5})
    assert tfevents.series("round", {"round": 8, "round_ms": None}) is None
    assert tfevents.series("death", {"rank": 1, "reason": "gone"}) is None
    assert tfevents.series("eval", {"epoch": 0, "metric": None}) is None  # a NaN metric is logged as null


def test_a_finite_value_past_float32_is_written_as_its_infinity_not_an_error():
    # A rank may report any finite metric (1e308): TensorBoard's scalars are float32.
    for value, want in ((1e308, math.inf), (-1e308, -math.inf), (3.0e38, 3.0e38)):
        written = tfevents.event(0.0, 1, {"eval": value})
        assert struct.unpack("<f", written[-4:])[0] == pytest.approx(want)


def test_the_run_logs_scalars_are_read_back_by_tensorboards_own_reader(tmp_path):
    log = RunLog(tmp_path)
    log.write("start", mode="cpu-cadence", epochs=2, world={"h0": [0, 1]}, world_size=2)
    for r in (1, 2, 3):
        log.write("round", round=r, round_ms=10.0 * r, global_step=r, epoch=0, counts=[1, 1])
    log.write("epoch", epoch=0, avg_loss=0.75, epoch_ms=30.0, batch_share=[0.5, 0.5], throughput=[200.0, 150.0])
    log.write("eval", epoch=0, metric=0.8)
    log.close()
    files = list(tmp_path.glob(f"{tfevents.FILE_PREFIX}.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"round_ms", "loss", "eval", "share/rank0", "share/rank1", "throughput/rank0", "throughput/rank1"}
    assert [(e.step, e.value) for e in acc.Scalars("round_ms")] == [(1, 10.0), (2, 20.0), (3, 30.0)]
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 0.75)]
    assert [(e.step, e.value) for e in acc.Scalars("throughput/rank1")] == [(1, 150.0)]
    assert acc.Scalars("eval")[0].value == pytest.approx(0.8)  # a float32 on disk
