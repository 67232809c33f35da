"""A small CNN on the packaged digits: BatchNorm, cosine LR with warm-up, gradient clipping.

Alone (one process):

    python examples/cnn_digits.py --epochs 20

On a local cluster (the same script in every process; `Trainer.run()` picks the role):

    flodl-zmq launch --hosts 1 --ranks-per-host 2 -- examples/cnn_digits.py --epochs 20

The controller (or the lone process) prints the test accuracy after each
evaluation and one `RESULT {json}` line at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from flodl_zmq.api import Trainer
from flodl_zmq.datasets import digits


def cnn() -> torch.nn.Module:
    """Three 3x3 conv blocks over the 1x8x8 image, global average pooling, a linear head."""

    def block(c_in: int, c_out: int) -> list[torch.nn.Module]:
        return [torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c_out), torch.nn.ReLU()]

    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 8, 8)),  # the dataset holds each image as a 64-vector
        *block(1, 16), *block(16, 32), torch.nn.MaxPool2d(2),
        *block(32, 64), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Linear(64, 10),
    )


def warmup_cosine(total_steps: int, warmup_steps: int):
    """A scheduler factory: the LR climbs linearly over `warmup_steps`, then falls on a cosine to zero."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def step(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def accuracy(model: torch.nn.Module, dataset: Dataset) -> float:
    """The share of test images classified right (the framework calls this in eval mode, without grad)."""
    x, y = dataset.tensors
    return float((model(x).argmax(dim=1) == y).float().mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="peak LR (SGD with Nesterov momentum)")
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--max-grad-norm", type=float, default=2.0)
    p.add_argument("--limit", type=int, help="train on the first N training images only (a quick run)")
    p.add_argument("--mode", default="cpu-async")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    train, test = digits()
    if args.limit is not None:
        train = Subset(train, range(min(args.limit, len(train))))
    # The schedule runs on the cluster's global step, which counts batches over the
    # whole dataset whatever the number of ranks: one epoch is this many steps.
    total_steps = args.epochs * math.ceil(len(train) / args.batch_size)
    result = Trainer(
        model=cnn,
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4),
        train_step=step, dataset=train, batch_size=args.batch_size, epochs=args.epochs, mode=args.mode,
        scheduler=warmup_cosine(total_steps, min(args.warmup_steps, total_steps)),
        max_grad_norm=args.max_grad_norm, eval_dataset=test, eval_fn=accuracy, quiet=args.quiet,
    ).run()
    print(f"final test accuracy: {result.final_eval:.4f}", flush=True)
    print("RESULT " + json.dumps({"accuracy": result.final_eval, "wall_s": result.wall_s}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
