"""Bring your own loop: an existing training loop on the packaged digits, kept, run by `fz.Session`.

The loop is the user's: two losses (cross-entropy with label smoothing, and
an activation penalty on the hidden layer), its own gradient clipping, its
own logging every `--log-every` steps. flodl-zmq hands it the batches
(`s.batches()`) and is told of each step (`s.step(loss)`); the averaging,
ElChe's dispatch, evals and saves are flodl-zmq's.

Alone (one process):

    python examples/own_loop.py --epochs 10

On a local cluster (the same script in every process; `Session` picks the role):

    flodl-zmq launch --hosts 2 --ranks-per-host 2 -- examples/own_loop.py --epochs 10

The controller (or the lone process) prints one `RESULT {json}` line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import flodl_zmq as fz
from flodl_zmq.datasets import digits

GATE_HANG_GUARD_S = 120.0  # --gate: a test that never opens its gate fails on its own deadline first


class Net(torch.nn.Module):
    """An MLP that also returns its hidden activations (the second loss reads them)."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.hidden(x))
        return self.head(h), h


def accuracy(model: torch.nn.Module, dataset) -> float:
    x, y = dataset.tensors
    return float((model(x)[0].argmax(dim=1) == y).float().mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--log-every", type=int, default=0, help="print the loop's own line every N steps (0: never)")
    p.add_argument("--stop-after", type=int, default=0, help="break out of the loop after N steps (0: never)")
    p.add_argument("--step-ms", type=float, default=0.0, help="sleep per step (tests: a run long enough to act in)")
    p.add_argument("--gate", help="tests: after --gate-after steps, each rank holds until this file exists")
    p.add_argument("--gate-after", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args()

    train, test = digits()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = 0
    with fz.Session(model, optimizer, train, batch_size=args.batch_size, epochs=args.epochs,
                    eval_dataset=test, eval_fn=accuracy, quiet=args.quiet) as s:
        for x, y in s.batches():
            logits, h = model(x)
            ce = F.cross_entropy(logits, y, label_smoothing=0.05)
            penalty = 1e-4 * h.pow(2).mean()
            loss = ce + penalty
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            optimizer.zero_grad()
            s.step(loss)
            steps += 1
            fz.record_scalar("penalty", penalty)
            if args.log_every and steps % args.log_every == 0:
                print(f"epoch {s.epoch} step {steps}: ce {ce.item():.4f} penalty {penalty.item():.2e}", flush=True)
            if args.step_ms:
                time.sleep(args.step_ms / 1000.0)
            if args.gate and steps >= args.gate_after:
                held_until = time.monotonic() + GATE_HANG_GUARD_S
                while not os.path.exists(args.gate) and time.monotonic() < held_until:
                    time.sleep(0.01)
            if args.stop_after and steps >= args.stop_after:
                break
    result = s.result
    print("RESULT " + json.dumps({
        "accuracy": result.final_eval, "batch_share": result.batch_share, "epochs": result.epochs,
    }), flush=True)


if __name__ == "__main__":
    main()
