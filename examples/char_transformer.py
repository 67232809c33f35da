"""A character-level transformer language model trained on the Python standard library's own sources.

The corpus is the `.py` files at the top of this interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`), sorted by name: every tenth file is held
out for validation, so the model is judged on code it never saw. Characters
are their ASCII code points (anything else becomes code 0, which Python
sources never hold), and the text is cut into fixed windows of `--context`
characters; the model predicts each next character.

Alone (one process):

    python examples/char_transformer.py --epochs 3

On a local cluster (the same script in every process; `Trainer.run()` picks the role):

    flodl-zmq launch --hosts 1 --ranks-per-host 2 -- examples/char_transformer.py --epochs 3

Two ranks with the lone run's batch split between them, ElChe's window fixed at
one step (docs/guide.md, "As many samples as alone"):

    flodl-zmq launch --hosts 1 --ranks-per-host 2 -- examples/char_transformer.py --epochs 3 --batch-size 16 --every-step

The metric is the validation loss: the mean cross-entropy per predicted
character in nats (lower is better; uniform guessing over 128 codes is 4.85).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

VOCAB = 128  # ASCII code points
VALIDATION_EVERY = 10  # every tenth file (by sorted name) is held out


def corpus(max_train_chars: int, max_val_chars: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) code-point tensors from the stdlib's top-level .py files, split by file and capped."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < VALIDATION_EVERY:
        raise SystemExit(f"found only {len(files)} .py files in the standard library at "
                         f"{sysconfig.get_paths()['stdlib']}; this example needs an interpreter that ships its sources")
    parts: tuple[list[str], list[str]] = ([], [])
    room = [max_train_chars, max_val_chars]
    for i, path in enumerate(files):
        which = 1 if i % VALIDATION_EVERY == VALIDATION_EVERY - 1 else 0
        if room[which] > 0:
            text = path.read_text(encoding="utf-8", errors="replace")[: room[which]]
            parts[which].append(text)
            room[which] -= len(text)
    return encode("".join(parts[0])), encode("".join(parts[1]))


def encode(text: str) -> torch.Tensor:
    codes = torch.tensor(list(text.encode("utf-32-le")), dtype=torch.uint8).view(-1, 4).to(torch.int64)
    points = codes[:, 0] | codes[:, 1] << 8 | codes[:, 2] << 16 | codes[:, 3] << 24
    return torch.where(points < VOCAB, points, 0)


class Windows(Dataset):
    """Non-overlapping windows of `context` characters: item i is (input, the same shifted by one)."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context
        self.n = (len(tokens) - 1) // context

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.context : (i + 1) * self.context + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(torch.nn.Module):
    """Token and position embeddings, pre-norm causal self-attention blocks, a head tied to the embedding."""

    def __init__(self, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        # Small embeddings: the head reuses them, and unit-variance rows would start it
        # with logits of size sqrt(width), a loss far above uniform guessing.
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        # True above the diagonal: a position never sees the characters after it. A boolean
        # buffer, not the usual float one of -inf: float buffers travel with the weights in
        # every round, and a relay rightly refuses a deposit that holds an infinity.
        self.register_buffer("mask", torch.ones(context, context, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.norm(h) @ self.embed.weight.T


def step(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def validation_loss(model: torch.nn.Module, dataset: Windows) -> float:
    """Mean cross-entropy per character (nats) over every validation window (called in eval mode, no grad)."""
    total, count = 0.0, 0
    for x, y in DataLoader(dataset, batch_size=64):
        total += float(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum"))
        count += y.numel()
    return total / count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW")
    p.add_argument("--train-chars", type=int, default=200_000, help="cap on the training text (an epoch's length)")
    p.add_argument("--val-chars", type=int, default=20_000)
    p.add_argument("--mode", default="cpu-async")
    p.add_argument("--every-step", action="store_true",
                   help="ElChe's window fixed at one step (anchor=1, max_anchor=1): for the batch split over the ranks")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    from flodl_zmq.api import Trainer  # after argparse, so --help is instant

    train, val = corpus(args.train_chars, args.val_chars)
    total_steps = args.epochs * math.ceil(len(Windows(train, args.context)) / args.batch_size)
    result = Trainer(
        model=lambda: CharTransformer(args.context, args.width, args.layers, args.heads),
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        train_step=step, dataset=Windows(train, args.context), batch_size=args.batch_size,
        epochs=args.epochs, mode=args.mode, max_grad_norm=1.0,
        **({"anchor": 1, "max_anchor": 1} if args.every_step else {}),
        # Cosine over the whole run, on the cluster's global step (the same in every process).
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, total_steps),
        eval_dataset=Windows(val, args.context), eval_fn=validation_loss, quiet=args.quiet,
    ).run()
    params = sum(p.numel() for p in result.model.parameters())
    print(f"parameters: {params}; final validation loss: {result.final_eval:.4f} nats/char "
          f"({result.final_eval / math.log(2):.3f} bits/char)", flush=True)
    print("RESULT " + json.dumps({"val_loss": result.final_eval, "parameters": params, "wall_s": result.wall_s}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
