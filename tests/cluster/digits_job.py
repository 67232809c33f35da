"""The job the cluster tests launch: the demo's digits MLP with test knobs.

Every process of a test cluster runs this file; the controller prints one
`RESULT {json}` line. Knobs (command line): --mode, --epochs, --batch-size,
--step-ms (a sleep per step, so a run lasts long enough to kill ranks in),
--save / --resume (bundle stem), --eval-raises (eval_fn raises on its second
call), --callback-errors report|stop, --wire-dtype f32|bf16, --outer none|nesterov|momentum,
--anchor N (ElChe's window floor). Environment: DIGITS_SHIFT=1 makes this
process load a perturbed dataset (a dataset mismatch).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from torch.utils.data import TensorDataset

from flodl_zmq.api import Trainer
from flodl_zmq.datasets import digits
from flodl_zmq.demo import accuracy, cross_entropy_step, mlp, sgd

calls = {"eval": 0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="cpu-cadence")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--save")
    p.add_argument("--resume")
    p.add_argument("--eval-raises", action="store_true")
    p.add_argument("--callback-errors", default="report")
    p.add_argument("--wire-dtype", default="f32")
    p.add_argument("--outer", default="none")
    p.add_argument("--anchor", type=int)
    args = p.parse_args()
    train, test = digits()
    if os.environ.get("DIGITS_SHIFT"):
        x, y = train.tensors
        train = TensorDataset(x + 0.01, y)

    def step(model, batch):
        if args.step_ms:
            time.sleep(args.step_ms / 1000.0)
        return cross_entropy_step(model, batch)

    def evaluate(model, dataset):
        calls["eval"] += 1
        if args.eval_raises and calls["eval"] == 2:
            raise RuntimeError("eval exploded on purpose")
        return accuracy(model, dataset)

    result = Trainer(
        model=mlp, optimizer=sgd, train_step=step, dataset=train, batch_size=args.batch_size,
        epochs=args.epochs, mode=args.mode, eval_dataset=test, eval_fn=evaluate,
        on_callback_error=args.callback_errors, save_path=args.save, resume_from=args.resume,
        wire_dtype=args.wire_dtype, outer=args.outer, anchor=args.anchor,
    ).run()
    print("RESULT " + json.dumps({
        "accuracy": result.final_eval, "batch_share": result.batch_share, "epochs": result.epochs,
        "saved": result.saved, "rounds": result.epochs[-1]["round"] + 1 if result.epochs else 0,
    }), flush=True)


if __name__ == "__main__":
    main()
