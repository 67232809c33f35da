"""The job the cluster tests launch: the demo's digits MLP with test knobs.

Every process of a test cluster runs this file; the controller prints one
`RESULT {json}` line. Knobs (command line): --mode, --epochs, --batch-size,
--step-ms (a sleep per step, so a run lasts long enough to kill ranks in),
--save / --resume (bundle stem), --eval-raises (eval_fn raises on its second
call), --eval-ms (a sleep per eval; with --slow-evals N, in the first N evals of each rank only), --callback-errors report|stop, --wire-dtype f32|bf16, --cosine (an LR schedule over the whole
run, each step's LR recorded as the scalar "lr"), --max-grad-norm X, --workers N (loader processes
per rank), --outer none|nesterov|momentum, --anchor N (ElChe's window floor), --easgd-alpha A (cpu-async's pull to each consensus), --heartbeat-timeout S (the coordinator's rank silence limit: the chaos suite's short one),
--pad-chunks N (a frozen all-zero parameter of N payload chunks ahead of the MLP's: a sharded run's
payload of several chunks, the MLP's own values in its last shard's slice: PROTOCOL.md 10.9), --gate PATH --gate-after N (each rank holds before its step N+1 until PATH exists: the run cannot
end before the test has seen what it waits for, whatever this machine's speed; the test opens it).
Environment: DIGITS_SHIFT=1 makes this process load a perturbed dataset (a dataset mismatch);
DIGITS_SIGKILL_RANK=N makes rank N SIGKILL itself before it does anything (a rank that dies before
its hello); DIGITS_NAN_RANK=N makes rank N's every loss NaN (a diverged model: its deposits are poison).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from torch.utils.data import TensorDataset

import flodl_zmq as fz
from flodl_zmq.api import Trainer
from flodl_zmq.datasets import digits
from flodl_zmq.demo import accuracy, cross_entropy_step, mlp, sgd
from flodl_zmq.wire_format import CHUNK_VALUES

calls = {"eval": 0, "step": 0}
GATE_HANG_GUARD_S = 120.0  # a test that never opens its gate fails on its own deadline first

# What this job reliably reaches in 12 to 15 epochs of batch 16 (one test image is 0.28 points of
# 359): 0.972 to 0.989 seen on 3 or 4 ranks; on 2 ranks 0.9638 to 0.9889 (16 undisturbed runs, 12
# of them beside a stress run) and 0.9526 to 0.9861 restarted from a checkpoint (7 runs; the lowest
# under a load of 8 on 2 cores); a run that loses ranks trains on what is left (4 ranks losing 2:
# 0.9638 to 0.9694). Tests of a disturbance assert it, three images under the lowest seen, rather
# than a point under one undisturbed run of their own: two single runs can lie more than a point
# apart by chance with nothing wrong. A broken recovery (a stale or corrupt consensus, a rank's
# state lost) costs far more, and what a disturbance could cost in samples is checked exactly,
# epoch by epoch.
RELIABLE_ACCURACY = 0.944
TRAIN_SAMPLES = 1437  # the packaged digits' training split


def batches_per_epoch(batch_size: int) -> int:
    """An epoch's batches: a progressive pool is batch-aligned (the last partial batch is left out)."""
    return TRAIN_SAMPLES // batch_size


def samples_per_epoch(batch_size: int) -> int:
    """What every epoch trains exactly once (`batches_per_epoch` full batches)."""
    return batches_per_epoch(batch_size) * batch_size


def held(gate: str | os.PathLike[str], *, after_epochs: int, epochs: int, ranks: int, batch_size: int = 16) -> list[str]:
    """The job's arguments that hold every rank, once it has taken `after_epochs` epochs' worth of
    batches, until the file `gate` exists; the test creates it once it has seen what it waits for.

    By construction, whatever this machine's speed: no rank holds before `after_epochs` epochs have
    ended (it would need more batches than they have), and a run of `epochs` on at most `ranks`
    training ranks cannot end before one holds (each would have taken at most that many batches,
    fewer in all than the run has). A layout where the second may fail is refused here.
    """
    limit = after_epochs * batches_per_epoch(batch_size)
    if epochs * batches_per_epoch(batch_size) <= ranks * limit:
        raise ValueError(f"{epochs} epochs on {ranks} ranks can end before any rank has taken {after_epochs} "
                         f"epochs' worth of batches: the gate could hold nothing")
    return ["--gate", str(gate), "--gate-after", str(limit)]


class Padded(torch.nn.Module):
    """The MLP behind a frozen parameter of `chunks` payload chunks of zeros (registered first: it leads the payload)."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.pad = torch.nn.Parameter(torch.zeros(chunks * CHUNK_VALUES), requires_grad=False)
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    if os.environ.get("FLODL_ROLE") == "rank" and os.environ.get("FLODL_RANK") == os.environ.get("DIGITS_SIGKILL_RANK"):
        os.kill(os.getpid(), signal.SIGKILL)
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="cpu-cadence")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-ms", type=float, default=0.0)
    p.add_argument("--save")
    p.add_argument("--resume")
    p.add_argument("--eval-raises", action="store_true")
    p.add_argument("--eval-ms", type=float, default=0.0)
    p.add_argument("--slow-evals", type=int)
    p.add_argument("--callback-errors", default="report")
    p.add_argument("--wire-dtype", default="f32")
    p.add_argument("--heartbeat-timeout", type=float, default=30.0)
    p.add_argument("--cosine", action="store_true")
    p.add_argument("--max-grad-norm", type=float)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--outer", default="none")
    p.add_argument("--anchor", type=int)
    p.add_argument("--easgd-alpha", type=float)
    p.add_argument("--pad-chunks", type=int, default=0)
    p.add_argument("--gate")
    p.add_argument("--gate-after", type=int, default=0)
    args = p.parse_args()
    train, test = digits()
    nan_rank = os.environ.get("FLODL_ROLE") == "rank" and os.environ.get("FLODL_RANK") == os.environ.get("DIGITS_NAN_RANK")
    if os.environ.get("DIGITS_SHIFT"):
        x, y = train.tensors
        train = TensorDataset(x + 0.01, y)

    optimizers = []

    def cosine(optimizer):
        optimizers.append(optimizer)
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs * (len(train) // args.batch_size))

    def step(model, batch):
        calls["step"] += 1
        if args.gate and calls["step"] > args.gate_after:
            held_until = time.monotonic() + GATE_HANG_GUARD_S
            while not os.path.exists(args.gate) and time.monotonic() < held_until:
                time.sleep(0.01)
        if args.step_ms:
            time.sleep(args.step_ms / 1000.0)
        if optimizers:
            fz.record_scalar("lr", optimizers[0].param_groups[0]["lr"])
        loss = cross_entropy_step(model, batch)
        return loss * float("nan") if nan_rank else loss

    def evaluate(model, dataset):
        calls["eval"] += 1
        if args.eval_ms and (args.slow_evals is None or calls["eval"] <= args.slow_evals):
            time.sleep(args.eval_ms / 1000.0)
        if args.eval_raises and calls["eval"] == 2:
            raise RuntimeError("eval exploded on purpose")
        return accuracy(model, dataset)

    result = Trainer(
        model=(lambda: Padded(args.pad_chunks)) if args.pad_chunks else mlp, optimizer=sgd, train_step=step, dataset=train, batch_size=args.batch_size,
        epochs=args.epochs, mode=args.mode, eval_dataset=test, eval_fn=evaluate,
        on_callback_error=args.callback_errors, save_path=args.save, resume_from=args.resume,
        wire_dtype=args.wire_dtype, rank_silence_at_coordinator_s=args.heartbeat_timeout,
        scheduler=cosine if args.cosine else None, max_grad_norm=args.max_grad_norm, num_workers=args.workers,
        outer=args.outer, anchor=args.anchor, easgd_alpha=args.easgd_alpha,
    ).run()
    print("RESULT " + json.dumps({
        "accuracy": result.final_eval, "batch_share": result.batch_share, "epochs": result.epochs, "evals": result.evals,
        "saved": result.saved, "rounds": result.epochs[-1]["round"] + 1 if result.epochs else 0,
        "world_changes": result.world_changes,
    }), flush=True)


if __name__ == "__main__":
    main()
