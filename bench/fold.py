"""Fold throughput: the host fold's add path against numpy ``a += b`` on the same data, in one run.

For each size (10M and 25M elements) it times, median of ``--repeats``:

- ``numpy_add``: ``np.add(a, b, out=a)`` on f32 arrays, the floor a fold can hope for;
- ``fold_f32``: one FoldStation deposit that adds an f32 frame into the running sums;
- ``fold_bf16``: the same with a bf16 frame (widened block by block, then added);
- ``bf16_encode``: encoding the f32 sums back to bf16 (round to nearest even);
- ``pair_bf16``: a two-rank host's round: its second bf16 deposit, summed with the
  first and encoded in one pass (what ``fold_bf16`` then ``bf16_encode`` would do).

GB/s counts the bytes of the deposited frame (bf16 frames are half the bytes);
ratios compare times over the same element count (fold / numpy, higher is
better; the target is >= 0.6 for f32). ``--json`` prints one JSON object.

    python bench/fold.py [--repeats N] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from flodl_zmq.fold import FoldStation
from flodl_zmq.tensors import bf16_from_f32

SIZES = {"10M": 10_000_000, "25M": 25_000_000}


def median_seconds(
    run: Callable[[], None], repeats: int, setup: Callable[[], None] | None = None
) -> float:
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fold_add_seconds(frame: np.ndarray, repeats: int) -> float:
    """Time the third deposit of a four-rank round: a pure add into sums that already exist."""
    station = FoldStation(range(4))
    rnd = iter(range(1 << 30))
    current = {}

    def setup() -> None:
        current["round"] = next(rnd)
        station.deposit(0, current["round"], 1.0, [frame])  # held verbatim
        station.deposit(1, current["round"], 1.0, [frame])  # promotes to f32 sums

    def add() -> None:
        station.deposit(2, current["round"], 1.0, [frame])

    times = []
    for _ in range(repeats):
        setup()
        t0 = time.perf_counter()
        add()
        times.append(time.perf_counter() - t0)
        station.deposit(3, current["round"], 1.0, [frame])  # completes and encodes, untimed
    return statistics.median(times)


def pair_seconds(frame: np.ndarray, repeats: int) -> float:
    """Time the deposit that completes a two-rank round: sum and encode, no f32 sums."""
    station = FoldStation(range(2))
    times = []
    for round_id in range(repeats):
        station.deposit(0, round_id, 1.0, [frame])  # held verbatim
        t0 = time.perf_counter()
        station.deposit(1, round_id, 1.0, [frame])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    results: dict[str, float] = {}
    for label, n in SIZES.items():
        a = rng.standard_normal(n, dtype=np.float32)
        b = rng.standard_normal(n, dtype=np.float32)
        b.flags.writeable = False
        b16 = bf16_from_f32(b, np.empty(n, np.uint16))
        b16.flags.writeable = False

        t_np = median_seconds(lambda a=a, b=b: np.add(a, b, out=a), repeats)
        t_f32 = fold_add_seconds(b, repeats)
        t_b16 = fold_add_seconds(b16, repeats)
        out16 = np.empty(n, np.uint16)
        t_enc = median_seconds(lambda a=a, o=out16: bf16_from_f32(a, o), repeats)
        t_pair = pair_seconds(b16, repeats)

        results[f"numpy_add_{label}_gbps"] = b.nbytes / t_np / 1e9
        results[f"fold_f32_{label}_gbps"] = b.nbytes / t_f32 / 1e9
        results[f"fold_bf16_{label}_gbps"] = b16.nbytes / t_b16 / 1e9
        results[f"bf16_encode_{label}_gbps"] = a.nbytes / t_enc / 1e9
        results[f"pair_bf16_{label}_gbps"] = b16.nbytes / t_pair / 1e9
        results[f"ratio_fold_vs_numpy_f32_{label}"] = t_np / t_f32
        results[f"ratio_fold_vs_numpy_bf16_{label}"] = t_np / t_b16
        results[f"numpy_add_{label}_ms"] = t_np * 1e3
        results[f"fold_f32_{label}_ms"] = t_f32 * 1e3
        results[f"fold_bf16_{label}_ms"] = t_b16 * 1e3
        results[f"bf16_encode_{label}_ms"] = t_enc * 1e3
        results[f"pair_bf16_{label}_ms"] = t_pair * 1e3
    return results


def table(results: dict[str, float]) -> str:
    rows = [f"{'path':<14}{'size':>6}{'ms':>10}{'GB/s':>9}{'vs numpy':>10}"]
    for label in SIZES:
        for path, ratio in (
            ("numpy_add", None),
            ("fold_f32", f"ratio_fold_vs_numpy_f32_{label}"),
            ("fold_bf16", f"ratio_fold_vs_numpy_bf16_{label}"),
            ("bf16_encode", None),
            ("pair_bf16", None),
        ):
            ms = results[f"{path}_{label}_ms"]
            gbps = results[f"{path}_{label}_gbps"]
            rel = f"{results[ratio]:.2f}x" if ratio else ""
            rows.append(f"{path:<14}{label:>6}{ms:>10.2f}{gbps:>9.2f}{rel:>10}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed repeats per measurement (median)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    args = parser.parse_args()
    results = bench(args.repeats)
    print(json.dumps({k: round(v, 4) for k, v in results.items()}) if args.json else table(results))


if __name__ == "__main__":
    main()
