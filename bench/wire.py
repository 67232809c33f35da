"""Wire benchmark: what framing and authentication cost per payload byte.

For 1M, 10M and 25M-element f32 and bf16 payloads this measures, in the same
run and interleaved repeat by repeat (so a noisy neighbour hits every column
alike):

- memcpy     np.copyto of the payload bytes into a preallocated buffer: the floor
- hmac       plain HMAC-SHA256 of the payload bytes: the naive authentication
- mac        the protocol's MAC alone (HMAC-SHA256 header + GMAC payload blocks)
- encode     Codec.encode of a RoundFrame with the tensor: header + MAC
- verify     mac.verify_mac alone over the received frames
- decode     Codec.decode: checks, verify, numpy views

and reports medians, throughput in GB/s (1e9 bytes/s), the framing overhead
(encode over mac, decode over verify; target <= 10%) and the payload
authentication throughput (target >= 2.5 GB/s). Then the microseconds to
encode and to decode (every check, the MAC) three control records a round
sends per rank: `timing.sync_ack`, `control.update` with its next plan, and
`timing.batch` of 8 steps.

    python bench/wire.py            # readable table
    python bench/wire.py --json     # one JSON object on stdout
    python bench/wire.py --quick    # 1M elements only, few repeats (CI smoke)
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from flodl_zmq.wire import Channel, Codec, mac
from flodl_zmq.wire.codec import Attribution
from flodl_zmq.wire.records import Batch, EpochPlan, RoundFrame, SyncAck, Update

SIZES = {"1M": 1_000_000, "10M": 10_000_000, "25M": 25_000_000}
REPEATS = {"1M": 9, "10M": 7, "25M": 5}
QUICK_REPEATS = 5
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
MEASURES = ("memcpy", "hmac", "mac", "encode", "verify", "decode")
TARGET_OVERHEAD_PCT = 10.0
TARGET_AUTH_GBPS = 2.5
RECORDS = {  # a round's control records, each as a rank or the coordinator sends it
    "sync_ack": SyncAck(rank=1, round=42, step_count=4200, divergence=0.01, post_norm=12.5, pre_norm=12.4),
    "update": Update(round=42, next_plan=EpochPlan(epoch=3, offset=1024, size=320, deposit=43)),
    "batch": Batch(rank=1, step_count=4200, batch_ms=[2.5] * 8, data_ms=[0.1] * 8, batch_loss=[0.3] * 8),
}


SAMPLE_S = (
    0.02  # each sample loops a call for about this long, so timer and scheduler noise stay small
)


def _time(fn: Callable[[], object], loops: int) -> float:
    """Seconds per call of `fn`, averaged over `loops` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(loops):
        fn()
    return (time.perf_counter() - start) / loops


def bench_one(n: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Median seconds of each measure for one payload of `n` elements."""
    key = bytes(range(32))
    sender = Codec(key, bytes(16), "bench-rank")
    receiver = Codec(key, bytes(16), "bench-reducer")
    tensor = torch.rand(n, dtype=torch.float32).to(dtype)
    src = tensor.view(torch.uint8).numpy()
    dst = np.empty_like(src)
    dst.fill(0)  # first touch outside the timing: fresh pages would measure the page-fault path
    rec = RoundFrame(round=1, rank=0, mass=1.0)
    frames = sender.encode(rec, [tensor])
    header, payload, tag = frames[0], frames[1:-1], frames[-1]

    runs: dict[str, Callable[[], object]] = {
        "memcpy": lambda: np.copyto(dst, src),
        "hmac": lambda: hmac.new(key, src, hashlib.sha256).digest(),
        "mac": lambda: mac.compute_mac(key, header, payload),
        "encode": lambda: sender.encode(rec, [tensor]),
        "verify": lambda: mac.verify_mac(key, header, payload, tag),
        # replay=False: the same frames are decoded repeatedly; the ledger check is O(1).
        "decode": lambda: receiver.decode(frames, Channel.DATA, replay=False),
    }
    # Warm-up (imports, allocator, caches) doubles as calibration of the loop count per sample.
    loops = {m: max(1, int(SAMPLE_S / max(_time(runs[m], 1), 1e-9))) for m in MEASURES}
    samples: dict[str, list[float]] = {m: [] for m in MEASURES}
    for _ in range(repeats):
        for m in MEASURES:
            samples[m].append(_time(runs[m], loops[m]))
    return {m: statistics.median(samples[m]) for m in MEASURES}


def bench_records(repeats: int) -> dict[str, float]:
    """Median microseconds to encode and to decode each of `RECORDS` (sequence check off: the same frames
    are decoded again and again)."""
    key = bytes(range(32))
    sender, receiver = Codec(key, bytes(16), "coordinator:1"), Codec(key, bytes(16), "relay:h0")
    signer = Attribution.signed_by("coordinator:1", "the bench's link")
    out: dict[str, float] = {}
    for name, rec in RECORDS.items():
        frames = sender.encode(rec, channel=Channel.CONTROL)
        runs = {"encode": lambda rec=rec: sender.encode(rec, channel=Channel.CONTROL),
                "decode": lambda frames=frames: receiver.decode_from(frames, Channel.CONTROL, signer, replay=False)}
        for m, fn in runs.items():
            loops = max(1, int(SAMPLE_S / max(_time(fn, 1), 1e-9)))
            out[f"record_{m}_us_{name}"] = round(statistics.median(_time(fn, loops) for _ in range(repeats)) * 1e6, 1)
    return out


def run(sizes: list[str], repeats_for: Callable[[str], int]) -> dict[str, float]:
    """Flat figures keyed `<figure>_<dtype>_<size>`."""
    out: dict[str, float] = {}
    for size in sizes:
        n = SIZES[size]
        for dname, dtype in DTYPES.items():
            nbytes = n * torch.empty((), dtype=dtype).element_size()
            med = bench_one(n, dtype, repeats_for(size))
            tag = f"{dname}_{size}"
            out[f"bytes_{tag}"] = nbytes
            for m in MEASURES:
                out[f"{m}_ms_{tag}"] = round(med[m] * 1e3, 4)
                out[f"{m}_gbps_{tag}"] = round(nbytes / med[m] / 1e9, 3)
            out[f"encode_overhead_pct_{tag}"] = round((med["encode"] / med["mac"] - 1) * 100, 2)
            out[f"decode_overhead_pct_{tag}"] = round((med["decode"] / med["verify"] - 1) * 100, 2)
            out[f"mac_speedup_over_hmac_{tag}"] = round(med["hmac"] / med["mac"], 2)
    return out


def table(fig: dict[str, float], sizes: list[str]) -> str:
    head = (
        f"{'payload':<11}{'MB':>7} | {'memcpy':>7}{'hmac':>7}{'mac':>7}{'encode':>7}{'verify':>7}{'decode':>7}"
        f" | {'enc ovh':>8}{'dec ovh':>8}"
    )
    lines = [
        "throughput in GB/s (median); overhead = encode/mac - 1 and decode/verify - 1",
        head,
        "-" * len(head),
    ]
    for size in sizes:
        for dname in DTYPES:
            tag = f"{dname}_{size}"
            gbps = "".join(f"{fig[f'{m}_gbps_{tag}']:>7.2f}" for m in MEASURES)
            lines.append(
                f"{dname + ' ' + size:<11}{fig[f'bytes_{tag}'] / 1e6:>7.1f} | {gbps}"
                f" | {fig[f'encode_overhead_pct_{tag}']:>7.1f}%{fig[f'decode_overhead_pct_{tag}']:>7.1f}%"
            )
    worst_ovh = max(
        max(fig[f"encode_overhead_pct_{d}_{s}"], fig[f"decode_overhead_pct_{d}_{s}"])
        for s in sizes
        for d in DTYPES
    )
    worst_auth = min(
        min(fig[f"mac_gbps_{d}_{s}"], fig[f"verify_gbps_{d}_{s}"]) for s in sizes for d in DTYPES
    )
    lines.append(
        f"worst framing overhead {worst_ovh:.1f}% (target <= {TARGET_OVERHEAD_PCT:.0f}%); "
        f"slowest payload authentication {worst_auth:.2f} GB/s (target >= {TARGET_AUTH_GBPS} GB/s)"
    )
    lines += ["", "control record   encode us  decode us (median)"]
    lines += [f"{name:<16}{fig[f'record_encode_us_{name}']:>10.1f}{fig[f'record_decode_us_{name}']:>11.1f}"
              for name in RECORDS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout instead of the table"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"1M elements only, {QUICK_REPEATS} repeats (CI smoke)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(
        1
    )  # the wire path is single-threaded; keep torch.rand from stealing the second core
    sizes = ["1M"] if args.quick else list(SIZES)
    fig = run(sizes, (lambda _s: QUICK_REPEATS) if args.quick else REPEATS.__getitem__)
    fig |= bench_records(QUICK_REPEATS if args.quick else 9)
    print(json.dumps(fig, sort_keys=True) if args.json else table(fig, sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
