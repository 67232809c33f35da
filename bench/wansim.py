"""bench/wan.py's rounds in one process: what the int8 wire and the outer step do to accuracy, without a network.

Four ranks on two hosts train bench/wan.py's model (the digits MLP, --hidden
wide) on the same batches, every variant in lock-step, for --epochs epochs. A
round goes through the real code of each hop: the rank's deposit (params x
mass) and the relay's host frame in int8 with their error feedback
(flodl_zmq/int8.py), the reducer's sum, the outer step (flodl_zmq/outer.py) and
the consensus in int8 with the reducer's error feedback, handed back to the
outer step (`published`) as the reducer service does. No sockets, no clocks:
a seed gives the same numbers every time, so a difference between variants is
the wire's or the outer step's, not the machine's.

Variants (a round at each window's end and at each epoch's end, as cpu-cadence):

    avg_f32         plain averaging every --window batches, f32 wire
    avg_int8        the same, int8 wire
    nesterov_f32    outer Nesterov every 4 x --window batches (4x fewer rounds), f32 wire
    nesterov_int8   the same, int8 wire
    nesterov_int8_unpublished   as nesterov_int8, the outer step measuring from its unrounded
                    global model (the reducer before it handed the published consensus back)

Accuracy is the mean of the last three per-epoch evals (one eval swings by a
point or more), its median over the seeds.

    python bench/wansim.py                       # 3 seeds, outer lr 0.7, momentum 0.5
    python bench/wansim.py --outer-momentum 0.9  # DiLoCo's momentum
    python bench/wansim.py --json                # accuracy_<variant>, accuracy_delta_..., rounds_...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.nn.utils import parameters_to_vector, vector_to_parameters  # noqa: E402

from flodl_zmq import int8  # noqa: E402
from flodl_zmq.datasets import digits  # noqa: E402
from flodl_zmq.outer import OuterConfig, OuterOptimizer  # noqa: E402
from flodl_zmq.sampling import epoch_permutation  # noqa: E402

VARIANTS = ("avg_f32", "avg_int8", "nesterov_f32", "nesterov_int8", "nesterov_int8_unpublished")
RANKS, HOSTS, BATCH, LR = 4, ((0, 1), (2, 3)), 8, 0.05


class Replica:
    """One variant: four ranks' models and inner optimizers, the wire's encoders, the outer step."""

    def __init__(self, name: str, args: argparse.Namespace, seed: int) -> None:
        self.name = name
        self.packed = "int8" in name
        self.window = args.window * (4 if name.startswith("nesterov") else 1)
        self.models = []
        for _ in range(RANKS):
            torch.manual_seed(seed)
            h = args.hidden
            self.models.append(torch.nn.Sequential(
                torch.nn.Linear(64, h), torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 10)))
        self.opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in self.models]
        start = parameters_to_vector(self.models[0].parameters()).detach().numpy().copy()
        self.outer = OuterOptimizer(OuterConfig("nesterov", args.outer_lr, args.outer_momentum), start) if (
            name.startswith("nesterov")) else None
        self.senders = [int8.PayloadEncoder() for _ in range(RANKS + len(HOSTS) + 1)]
        self.since = self.rounds = 0
        self.evals: list[float] = []

    def wire(self, sender: int, x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """(payload, what the receiver widens) of ``x`` sent by ``sender``."""
        if not self.packed:
            return [x], x
        payload = self.senders[sender].encode([x])
        return payload, int8.widen(payload, [np.empty(x.size, np.float32)])[0]

    def step(self, x: torch.Tensor, y: torch.Tensor, batches: list[torch.Tensor], epoch_end: bool) -> None:
        for m, o, b in zip(self.models, self.opts, batches, strict=True):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x[b]), y[b]).backward()
            o.step()
        self.since += 1
        if self.since >= self.window or epoch_end:
            self.round()

    def round(self) -> None:
        mass = np.float32(1.0 / RANKS)
        deposits = [self.wire(r, parameters_to_vector(m.parameters()).detach().numpy() * mass)[1]
                    for r, m in enumerate(self.models)]
        average = sum(self.wire(RANKS + i, deposits[a] + deposits[b])[1] for i, (a, b) in enumerate(HOSTS))
        if self.outer is not None:
            self.outer.step([average])
        payload, loaded = self.wire(RANKS + len(HOSTS), average)
        if self.outer is not None and self.packed and not self.name.endswith("unpublished"):
            self.outer.published(payload)
        for m in self.models:
            vector_to_parameters(torch.from_numpy(loaded.copy()), m.parameters())
        self.since, self.rounds = 0, self.rounds + 1

    def evaluate(self, tx: torch.Tensor, ty: torch.Tensor) -> None:
        with torch.no_grad():
            self.evals.append(float((self.models[0](tx).argmax(1) == ty).float().mean()))


def simulate(args: argparse.Namespace, seed: int, names: list[str]) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    train, test = digits()
    x, y = train.tensors
    tx, ty = test.tensors
    replicas = [Replica(n, args, seed) for n in names]
    per = len(x) // (RANKS * BATCH) * BATCH  # each rank's share of an epoch (the tail dropped)
    for epoch in range(args.epochs):
        perm = torch.as_tensor(epoch_permutation(42, epoch, len(x)))
        shards = [perm[r * per : (r + 1) * per] for r in range(RANKS)]
        for i in range(0, per, BATCH):
            end = i + BATCH >= per
            for rep in replicas:
                rep.step(x, y, [s[i : i + BATCH] for s in shards], end)
        for rep in replicas:
            rep.evaluate(tx, ty)
    return {r.name: {"accuracy": float(np.mean(r.evals[-3:])), "final": r.evals[-1],
                     "rounds_per_epoch": r.rounds / args.epochs} for r in replicas}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS[:4]), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--window", type=int, default=11, help="plain averaging's window (batches); nesterov's is 4x")
    p.add_argument("--hidden", type=int, default=1536, help="bench/wan.py's width; 512 runs about 6x faster")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    for n in names:
        if n not in VARIANTS:
            p.error(f"unknown variant {n!r}: one of {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [simulate(args, seed, names) for seed in seeds]
    out: dict[str, float | int | None] = {}
    print(f"hidden {args.hidden}, {args.epochs} epochs, outer lr {args.outer_lr} momentum {args.outer_momentum}, "
          f"seeds {args.seeds}: last-3-epoch accuracy, median over seeds")
    print(f"{'variant':27} {'accuracy':>9} {'per seed':>26} {'rounds/epoch':>13}")
    for n in names:
        accs = [r[n]["accuracy"] for r in runs]
        out[f"accuracy_{n}"] = statistics.median(accs)
        out[f"rounds_per_epoch_{n}"] = runs[0][n]["rounds_per_epoch"]
        print(f"{n:27} {100 * statistics.median(accs):9.2f} {' '.join(f'{100 * a:.2f}' for a in accs):>26} "
              f"{runs[0][n]['rounds_per_epoch']:13.3f}")
    pairs = {"accuracy_delta_nesterov_vs_avg": ("nesterov_f32", "avg_f32"),
             "accuracy_delta_int8_vs_f32_nesterov": ("nesterov_int8", "nesterov_f32"),
             "accuracy_delta_int8_vs_f32_avg": ("avg_int8", "avg_f32")}
    for key, (a, b) in pairs.items():
        if a in names and b in names:
            out[key] = 100 * statistics.median(r[a]["accuracy"] - r[b]["accuracy"] for r in runs)
            print(f"{key}: {out[key]:+.2f} points (median of the per-seed differences)")
    if "avg_f32" in names and "nesterov_f32" in names:
        out["rounds_ratio_nesterov_vs_f32"] = out["rounds_per_epoch_avg_f32"] / out["rounds_per_epoch_nesterov_f32"]
    load = os.getloadavg()
    out["load_avg_1m"] = load[0]
    print(f"load average {load[0]:.1f} (the figures do not depend on it: one process, fixed seeds)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
