"""A large model: GPT-2 small's shape (124M parameters) trained as 2 hosts x 1 rank, peak memory per process.

    python bench/large.py [--wire f32] [--layers 12] [--d-model 768] [--context 64] [--batch 2]
                          [--sequences 16] [--json]

The question a user asks before fine-tuning a 100M-1B model with floDl: does
a round of that size go through, and what does each process hold? The model
is GPT-2 small's shape (12 pre-LayerNorm blocks, d_model 768, 12 heads, vocab
50,257, 1,024 positions, the output head tied to the token embedding as
GPT-2 ties it: 124.4M parameters) on random tokens, trained with AdamW, one
torch thread per process, for one epoch of --sequences sequences in windows
of one batch (anchor 1: a round after every step, the point is rounds, not
accuracy), in the --wire format, as `flodl-zmq launch --hosts 2
--ranks-per-host 1` runs it: each rank's host leg in shared memory, the relay
folding and sending on to the reducer over TCP.

The bench samples each process's peak resident memory (VmHWM of
/proc/<pid>/status, every 0.1 s while it lives: the kernel's high-water mark,
so no peak between two samples is missed, only growth after the last one)
and reports it with the baseline of an interpreter that has imported torch
and flodl_zmq (`base_rss_mb`: what every forked process starts from), so the
model's share is peak minus baseline. Figures (JSON keys):

  params, model_mb (the f32 parameters, MB of 10^6 bytes), wire,
  peak_rss_mb_reducer (the controller: coordinator and reducer),
  peak_rss_mb_relay (the larger of the two relays), peak_rss_mb_rank (the
  larger of the two ranks); peak_shm_mb_<role>: the largest shared-memory
  part of its resident memory sampled (RssShmem: the segments of the host
  leg, one copy in memory that the rank and its relay both count); base_rss_mb
  (torch imported) and base_rss_mb_relay (a relay: no torch);
  consensus_requests (the relays' requests for a consensus that was late:
  each answered one is one more model-sized message); rounds, round_s
  (median, trigger -> consensus published), run_s (the command's wall time).
This script is also the job the launcher runs (FLODL_ROLE set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flodl_zmq.api import Trainer
from flodl_zmq.launch import Cluster

ROOT = Path(__file__).resolve().parent.parent
TAG = "LARGE_RESULT"
VOCAB = 50257
POSITIONS = 1024
HEAD_DIM = 64  # GPT-2: 768 / 12 heads
SEED = 5
ROLES = ("rank", "relay", "reducer")


class GPT(torch.nn.Module):
    """GPT-2's shape: token + position embeddings, pre-LN blocks, a final LayerNorm, the head tied to wte."""

    def __init__(self, layers: int, d_model: int) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, d_model)
        self.wpe = torch.nn.Embedding(POSITIONS, d_model)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(d_model, max(1, d_model // HEAD_DIM), 4 * d_model, dropout=0.0, activation="gelu",
                                             batch_first=True, norm_first=True)
            for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.wte(tokens) + self.wpe(torch.arange(n))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return F.linear(self.ln_f(h), self.wte.weight)  # tied: no second 154 MB matrix


def step(model: torch.nn.Module, batch: tuple[torch.Tensor]) -> torch.Tensor:
    tokens = batch[0]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def job(args: argparse.Namespace) -> None:
    tokens = torch.randint(0, VOCAB, (args.sequences, args.context + 1), generator=torch.Generator().manual_seed(SEED))
    result = Trainer(
        model=lambda: GPT(args.layers, args.d_model),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, weight_decay=0.01),
        train_step=step, dataset=torch.utils.data.TensorDataset(tokens), batch_size=args.batch, epochs=1,
        anchor=1, max_anchor=1, torch_threads=1, wire_dtype=args.wire, seed=SEED, quiet=True,
    ).run()
    print(TAG + " " + json.dumps({"round_ms": result.round_ms}), flush=True)


FIELDS = ("VmHWM", "RssShmem")  # the kernel's peak resident memory; the shared-memory part of it now


def memory_mb(pid: int) -> dict[str, float]:
    """FIELDS of /proc/<pid>/status, MB; empty once the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name in FIELDS:
                    out[name] = int(value.split()[0]) * 1024 / 1e6
    except OSError:
        return {}
    return out


class PeakSampler(threading.Thread):
    """Reads every child's FIELDS every `period_s` until stopped; keeps each label's largest reading of each."""

    def __init__(self, cluster: Cluster, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.cluster, self.period_s = cluster, period_s
        self.peaks: dict[str, dict[str, float]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period_s):
            for label, child in list(self.cluster.children.items()):
                for name, mb in memory_mb(child.proc.pid).items():
                    peaks = self.peaks.setdefault(label, {})
                    peaks[name] = max(mb, peaks.get(name, 0.0))

    def largest(self, role: str, name: str = "VmHWM") -> float:
        """The largest `name` of the processes of `role` (reducer: the controller; relay; rank)."""
        def role_of(label: str) -> str:
            return "reducer" if label == "controller" else "relay" if label.endswith(":relay") else "rank"
        return max(p.get(name, 0.0) for label, p in self.peaks.items() if role_of(label) == role)


def base_rss_mb(modules: str) -> float:
    """VmHWM of an interpreter that imported `modules`: what a process of the run starts from."""
    code = (f"import {modules}\n"
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return int(out.stdout.strip()) * 1024 / 1e6


def measure(args: argparse.Namespace) -> dict:
    os.environ["FLODL_WIRE_DTYPE"] = args.wire  # announced to the relays (a run setting)
    argv = [__file__, "--job", "--wire", args.wire, "--layers", str(args.layers), "--d-model", str(args.d_model),
            "--context", str(args.context), "--batch", str(args.batch), "--sequences", str(args.sequences)]
    cluster = Cluster(argv=argv, hosts=2, ranks_per_host=1)
    sampler = PeakSampler(cluster)
    t0 = time.monotonic()
    cluster.start()
    sampler.start()
    try:
        code = cluster.wait(args.timeout)
    finally:
        sampler.done.set()
        sampler.join()
    run_s = time.monotonic() - t0
    found = [json.loads(t[len(TAG) + 1:]) for t in (line.partition("] ")[2] for line in cluster.lines)
             if t.startswith(TAG)]
    if code != 0 or not found:
        raise RuntimeError(f"the run failed (exit {code}):\n{cluster.output()}")
    params = sum(p.numel() for p in GPT(args.layers, args.d_model).parameters())
    rounds = found[0]["round_ms"]
    figures = {"params": params, "model_mb": params * 4 / 1e6, "wire": args.wire}
    for role in ROLES:
        figures[f"peak_rss_mb_{role}"] = sampler.largest(role)
        figures[f"peak_shm_mb_{role}"] = sampler.largest(role, "RssShmem")
    figures["base_rss_mb"] = base_rss_mb("torch, flodl_zmq.api, flodl_zmq.controller_service")
    figures["base_rss_mb_relay"] = base_rss_mb("flodl_zmq.relay")  # a relay runs none of the script: no torch
    # A relay asks the reducer for a consensus it waited on longer than consensus_wait_at_relay_s: at this
    # size each answer is another model-sized message (logged at INFO by the relay).
    figures["consensus_requests"] = sum("asking the reducer" in line for line in cluster.lines)
    figures.update(rounds=len(rounds), round_s=statistics.median(rounds) / 1000.0 if rounds else None, run_s=run_s)
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wire", default="f32", choices=("f32", "bf16", "int8"))
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job or os.environ.get("FLODL_ROLE"):
        job(args)
        return 0
    f = measure(args)
    if args.json:
        print(json.dumps(f))
        return 0
    print(f"GPT-2-small shape: {f['params'] / 1e6:.1f}M parameters ({f['model_mb']:.0f} MB f32), "
          f"wire {f['wire']}, 2 hosts x 1 rank, {f['rounds']} rounds, median round {f['round_s']:.2f} s, "
          f"run {f['run_s']:.0f} s")
    print(f"{'process':<10}{'peak RSS MB':>12}{'less base':>11}{'x model':>9}{'of it shm':>11}")
    for who in ROLES:
        peak, base = f[f"peak_rss_mb_{who}"], f["base_rss_mb_relay" if who == "relay" else "base_rss_mb"]
        print(f"{who:<10}{peak:>12.0f}{peak - base:>11.0f}{(peak - base) / f['model_mb']:>9.2f}"
              f"{f[f'peak_shm_mb_{who}']:>11.0f}")
    print(f"base: {f['base_rss_mb']:.0f} MB with torch imported, {f['base_rss_mb_relay']:.0f} MB for a relay")
    return 0


if __name__ == "__main__":
    sys.exit(main())
