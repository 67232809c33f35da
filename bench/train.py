"""Time to accuracy: flodl-zmq cpu-cadence vs torch DDP (gloo) vs one process, one rank 3x slower.

    python bench/train.py [--epochs 15] [--target 0.95] [--slow 3] [--json]

Same model (a ~2.2M-parameter MLP on the packaged digits), data order, batch
size per rank and target accuracy for:

  (a) flodl-zmq cpu-cadence: 2 hosts x 2 ranks as processes (flodl-zmq launch),
      rank 3 slowed by --slow (a per-step delay proportional to its step time);
  (b) torch DistributedDataParallel on gloo, 4 processes, rank 3 slowed the same
      way: every step all-reduces gradients, so every step waits for rank 3;
  (c) one process alone, no slowdown.

Each trains --epochs epochs and evaluates on the test split after each one;
the figures are the wall time (from the start of training, after start-up)
until the test accuracy first reaches --target, and the final accuracy. For
(a) the median round time (trigger -> consensus published) is reported too.
This script is also the job the launcher runs for (a) (FLODL_ROLE set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from flodl_zmq.api import Trainer
from flodl_zmq.datasets import digits
from flodl_zmq.launch import Cluster
from flodl_zmq.sampling import epoch_permutation

TAG = "BENCH_RESULT"
BATCH = 32
LR = 0.05
SEED = 42


def model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def step(m: torch.nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(m(batch[0]), batch[1])


def accuracy(m: torch.nn.Module, dataset) -> float:
    x, y = dataset.tensors
    return float((m(x).argmax(1) == y).float().mean())


def time_to(rows: list[dict], target: float) -> float | None:
    return next((r["eval_at_s"] for r in rows if r.get("eval") is not None and r["eval"] >= target), None)


# --------------------------------------------------------------------------- (a) flodl-zmq


def flodl_job(epochs: int) -> None:
    train, test = digits()
    result = Trainer(
        model=model, optimizer=optimizer, train_step=step, dataset=train, batch_size=BATCH, epochs=epochs,
        mode="cpu-cadence", eval_dataset=test, eval_fn=accuracy, seed=SEED, quiet=True,
    ).run()
    rounds = sorted(result.round_ms)
    print(TAG + " " + json.dumps({
        "rows": [{"eval": r.get("eval"), "eval_at_s": r.get("eval_at_s")} for r in result.epochs],
        "final": result.final_eval, "batch_share": result.batch_share,
        "round_ms_median": rounds[len(rounds) // 2] if rounds else None, "rounds": len(rounds),
    }), flush=True)


def run_flodl(epochs: int, slow: float) -> dict:
    cluster = Cluster(argv=[__file__, "--job", "--epochs", str(epochs)], hosts=2, ranks_per_host=2, slow={3: slow})
    cluster.start()
    code = cluster.wait(1800)
    for line in cluster.lines:
        _, _, text = line.partition("] ")
        if text.startswith(TAG):
            return json.loads(text[len(TAG) + 1:])
    raise RuntimeError(f"flodl-zmq run failed (exit {code}):\n{cluster.output()}")


# --------------------------------------------------------------------------- (b) DDP on gloo


def _ddp_worker(rank: int, world: int, epochs: int, slow: float, init: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.manual_seed(SEED)
    train, test = digits()
    ddp = torch.nn.parallel.DistributedDataParallel(model())
    opt = optimizer(ddp.parameters())
    x, y = train.tensors
    rows = []
    dist.barrier()
    t0 = time.perf_counter()
    for epoch in range(epochs):
        perm = torch.from_numpy(epoch_permutation(SEED, epoch, len(train)))
        shard = perm[rank::world]
        steps = len(perm) // (world * BATCH)  # equal step count on every rank (DDP needs lockstep)
        for s in range(steps):
            t = time.perf_counter()
            idx = shard[s * BATCH : (s + 1) * BATCH]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x[idx]), y[idx])
            loss.backward()  # all-reduce: waits for the slowest rank
            opt.step()
            if rank == world - 1 and slow > 1:
                time.sleep((slow - 1) * (time.perf_counter() - t))
        if rank == 0:
            with torch.no_grad():
                rows.append({"eval": accuracy(ddp.module, test), "eval_at_s": time.perf_counter() - t0})
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump({"rows": rows, "final": rows[-1]["eval"]}, fh)
    dist.destroy_process_group()


def run_ddp(epochs: int, slow: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "ddp.json")
        init = f"file://{os.path.join(d, 'rendezvous')}"
        mp.spawn(_ddp_worker, args=(4, epochs, slow, init, out), nprocs=4, join=True)
        with open(out) as fh:
            return json.load(fh)


# --------------------------------------------------------------------------- (c) alone


def run_alone(epochs: int) -> dict:
    train, test = digits()
    result = Trainer(
        model=model, optimizer=optimizer, train_step=step, dataset=train, batch_size=BATCH, epochs=epochs,
        eval_dataset=test, eval_fn=accuracy, seed=SEED, quiet=True,
    ).run()
    return {"rows": [{"eval": r.get("eval"), "eval_at_s": r.get("eval_at_s")} for r in result.epochs],
            "final": result.final_eval}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--slow", type=float, default=3.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job or os.environ.get("FLODL_ROLE"):
        flodl_job(args.epochs)
        return 0
    os.environ.pop("FLODL_ROLE", None)
    torch.set_num_threads(1)
    runs = {"flodl_cadence": run_flodl(args.epochs, args.slow), "ddp_gloo": run_ddp(args.epochs, args.slow),
            "alone": run_alone(args.epochs)}
    figures: dict = {"epochs": args.epochs, "target": args.target, "slowdown": args.slow,
                     "params": sum(t.numel() for t in model().parameters())}
    for name, r in runs.items():
        figures[f"time_to_target_s_{name}"] = time_to(r["rows"], args.target)
        figures[f"final_accuracy_{name}"] = r["final"]
    figures["round_ms_median_flodl"] = runs["flodl_cadence"]["round_ms_median"]
    figures["batch_share_flodl"] = runs["flodl_cadence"]["batch_share"]
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"MLP {figures['params'] / 1e6:.1f}M params, digits, {args.epochs} epochs, target {args.target:.2f}, "
          f"4 ranks with rank 3 slowed {args.slow:g}x")
    print(f"{'run':<16}{'time to target':>16}{'final accuracy':>16}")
    for name in runs:
        t = figures[f"time_to_target_s_{name}"]
        print(f"{name:<16}{(f'{t:.2f} s' if t is not None else 'not reached'):>16}{figures[f'final_accuracy_{name}'] * 100:>15.2f}%")
    print(f"flodl-zmq median round time: {figures['round_ms_median_flodl']:.1f} ms; batch share "
          + " ".join(f"r{i} {s * 100:.0f}%" for i, s in enumerate(figures["batch_share_flodl"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
