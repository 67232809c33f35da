"""Loader workers: epoch time with a dataset whose items are costly, 0 workers vs 4.

    python bench/dataloader.py [--workers 0,4] [--cost-ms 0.2] [--busy] [--epochs 3] [--repeats 3] [--json]

The packaged digits, wrapped in a map-style Dataset whose `__getitem__`
costs --cost-ms per item (a sleep, as reading or decoding a file waits; with
--busy a spin on the CPU instead), trained alone (the same loader and step
code a rank runs) by the demo MLP for --epochs epochs, once per worker count
per repeat, interleaved so a noisy neighbour hits every column alike. The
figure is the median epoch time over every epoch of every repeat, and its
ratio to the first worker count's. On a machine with few cores, --busy
cannot scale past the cores; the sleep cost shows what the pipeline itself
allows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.utils.data import Dataset

from flodl_zmq.api import Trainer
from flodl_zmq.datasets import digits
from flodl_zmq.demo import cross_entropy_step, mlp, sgd


class Costly(Dataset):
    """The items of a TensorDataset, each costing `cost_s` (sleep, or a spin with `busy`)."""

    def __init__(self, base, cost_s: float, busy: bool) -> None:
        self.x, self.y = base.tensors
        self.cost_s, self.busy = cost_s, busy

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if self.busy:
            end = time.perf_counter() + self.cost_s
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(self.cost_s)
        return self.x[i], self.y[i]


def item_cost_ms(dataset: Costly, n: int = 300) -> float:
    """What one `__getitem__` really costs here (a short sleep oversleeps)."""
    t0 = time.perf_counter()
    for i in range(n):
        dataset[i]
    return (time.perf_counter() - t0) * 1000.0 / n


def epoch_ms(dataset: Costly, workers: int, epochs: int) -> list[float]:
    result = Trainer(
        model=mlp, optimizer=sgd, train_step=cross_entropy_step, dataset=dataset, batch_size=32, epochs=epochs,
        num_workers=workers, quiet=True,
    ).run()
    return [row["epoch_ms"] for row in result.epochs]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="0,4", help="worker counts, comma-separated (the first is the reference)")
    p.add_argument("--cost-ms", type=float, default=0.2)
    p.add_argument("--busy", action="store_true", help="spin on the CPU instead of sleeping")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    os.environ.pop("FLODL_ROLE", None)  # always alone: this measures the data path, not the cluster
    torch.set_num_threads(1)
    counts = [int(w) for w in args.workers.split(",")]
    dataset = Costly(digits()[0], args.cost_ms / 1000.0, args.busy)
    times: dict[int, list[float]] = {w: [] for w in counts}
    for _ in range(args.repeats):
        for w in counts:
            times[w].extend(epoch_ms(dataset, w, args.epochs))
    medians = {w: statistics.median(times[w]) for w in counts}
    ref = counts[0]
    figures: dict = {
        "items": len(dataset), "cost": "busy" if args.busy else "sleep", "item_cost_ms": item_cost_ms(dataset),
        "epochs": args.epochs, "repeats": args.repeats, "load_avg_1m": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    for w in counts:
        figures[f"epoch_ms_median_workers_{w}"] = medians[w]
        figures[f"speedup_workers_{w}"] = medians[ref] / medians[w]
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"digits MLP, {figures['items']} items costing {figures['item_cost_ms']:.3f} ms each ({figures['cost']}), "
          f"batch 32, {args.epochs} epochs x {args.repeats} repeats; load average {figures['load_avg_1m']:.1f} "
          f"on {figures['cpu_count']} CPUs")
    print(f"{'num_workers':>12}{'median epoch':>16}{'speed-up':>12}")
    for w in counts:
        print(f"{w:>12}{medians[w]:>13.1f} ms{figures[f'speedup_workers_{w}']:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
