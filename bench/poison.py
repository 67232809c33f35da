"""Accuracy under a poisoning rank: plain averaging against the robust aggregations.

    python bench/poison.py                       # table
    python bench/poison.py --json                # {"accuracy_median_scaled": ..., "time_s_mean_none": ..., ...}
    python bench/poison.py --aggregations mean,median --attacks none,scaled --epochs 8

The digits MLP (flodl_zmq.demo, the cluster tests' job) on 2 hosts x 2 ranks,
cpu-cadence, batch 16, one torch thread per process. Rank 3 poisons every
deposit it makes after it has taken its snapshot, so what leaves it is what a
tampered rank would send, and what it trains on is the consensus like any rank:

  none:    no poisoning rank (the baseline);
  scaled:  -10 times its own model (finite, ten times its honest magnitude:
           well inside the magnitude bound, so only the aggregation can help);
  garbage: random values of standard deviation 100 (large, finite, and
           under the bound of 1e6 times the consensus's largest value);
  huge:    every value 1e30 (the magnitude bound refuses it: the rank leaves,
           whatever the aggregation).

Figures per aggregation and attack (a run that fails is a row too: a
poisoned mean can diverge until every rank's deposit is refused): the final
test accuracy ("-": none), the run's wall
time (floDl's own measure) and the ranks that had stopped training at the end
(a refused rank leaves the run). Evaluation runs on rank
0, on the consensus. This script is also the job the launcher runs (FLODL_ROLE set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TAG = "POISON_RESULT"
POISONER = 3
ATTACKS = ("none", "scaled", "garbage", "huge")


def poison(attack: str) -> None:
    """Make this rank's every deposit the attack's (bench only: the runtime has no such switch)."""
    import torch

    from flodl_zmq.param_buffers import ParamBuffers

    honest = ParamBuffers.snapshot

    def snapshot(self: ParamBuffers, mass: float) -> list[torch.Tensor]:
        out = honest(self, mass)  # f32 wire: the payload is the premultiplied snapshot itself
        with torch.no_grad():
            if attack == "scaled":
                self.snap.mul_(-10.0)
            elif attack == "garbage":
                self.snap.copy_(torch.randn_like(self.snap) * (100.0 * max(mass, 1.0)))
            elif attack == "huge":
                self.snap.fill_(1e30)
        return out

    ParamBuffers.snapshot = snapshot  # type: ignore[method-assign]


def run_job(epochs: int, attack: str) -> None:
    """One process of one run (the launcher's roles: FLODL_ROLE)."""
    import torch

    from flodl_zmq.api import Trainer
    from flodl_zmq.datasets import digits
    from flodl_zmq.demo import accuracy, cross_entropy_step, mlp, sgd

    torch.set_num_threads(1)
    if os.environ.get("FLODL_ROLE") == "rank" and int(os.environ.get("FLODL_RANK", "-1")) == POISONER \
            and attack != "none":
        poison(attack)
    train, test = digits()
    result = Trainer(model=mlp, optimizer=sgd, train_step=cross_entropy_step, dataset=train, batch_size=16,
                     epochs=epochs, mode="cpu-cadence", eval_dataset=test, eval_fn=accuracy, callback_rank=0,
                     quiet=True).run()
    if result is not None and os.environ.get("FLODL_ROLE") == "controller":
        last = result.epochs[-1].get("per_rank_samples", []) if result.epochs else []
        lost = [r for r, n in enumerate(last) if n == 0]  # trained nothing in the last epoch: refused, gone
        print(TAG + " " + json.dumps({"accuracy": result.final_eval, "wall_s": result.wall_s, "lost": lost}),
              flush=True)


def run_one(aggregation: str, attack: str, epochs: int) -> dict[str, Any]:
    """One cluster run in fresh processes."""
    from flodl_zmq.launch import Cluster

    os.environ["FLODL_AGGREGATION"] = aggregation  # the relays and the reducer read the run's setting
    cluster = Cluster(argv=[__file__, "--child", "--attack", attack, "--epochs", str(epochs)], hosts=2,
                      ranks_per_host=2)
    cluster.start()
    code = cluster.wait(900)
    lines = [ln for ln in cluster.lines if TAG in ln]
    if code != 0 or not lines:  # a poisoned mean can diverge until every rank is refused: that is a result
        why = [ln for ln in cluster.lines if "ERROR" in ln or "Error" in ln][-1:] or [f"exit {code}"]
        return {"accuracy": None, "wall_s": None, "lost": [], "failed": why[0][-200:]}
    return json.loads(lines[-1].split(TAG, 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--aggregations", default="mean,median,trimmed_mean")
    p.add_argument("--attacks", default=",".join(ATTACKS))
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--attack", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        run_job(args.epochs, args.attack)
        return
    rows = {(agg, attack): run_one(agg, attack, args.epochs)
            for agg in args.aggregations.split(",") for attack in args.attacks.split(",")}
    if args.json:
        out = {}
        for (agg, attack), r in rows.items():
            out[f"accuracy_{agg}_{attack}"] = r["accuracy"]
            out[f"time_s_{agg}_{attack}"] = None if r["wall_s"] is None else round(r["wall_s"], 1)
            out[f"lost_{agg}_{attack}"] = r["lost"]
        print(json.dumps(out, indent=1))
        return
    print(f"digits MLP, 2 hosts x 2 ranks, cpu-cadence, {args.epochs} epochs; rank {POISONER} poisons")
    print(f"{'aggregation':<13} {'attack':<8} {'accuracy':>8} {'time s':>7}  ranks lost")
    for (agg, attack), r in rows.items():
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        wall = "failed" if r["wall_s"] is None else f"{r['wall_s']:.1f}"
        print(f"{agg:<13} {attack:<8} {acc:>8} {wall:>7}  {r['lost'] or '-'}")


if __name__ == "__main__":
    main()
