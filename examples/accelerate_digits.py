"""A stock Hugging Face Accelerate loop on the packaged digits, run by flodl-zmq through one changed import.

The loop is Accelerate's own (prepare, backward, an eval loader gathered for
metrics, print and save on the main process); the only flodl-zmq line is the
import of `Accelerator`. Swap it for `from accelerate import Accelerator`
and the script runs under plain Accelerate.

Alone (one process, Accelerate's single-process world):

    python examples/accelerate_digits.py --epochs 10

On a local cluster (the epochs of the loop said once, outside the script):

    FLODL_ACCELERATE_EPOCHS=10 flodl-zmq launch --hosts 1 --ranks-per-host 2 -- \\
        examples/accelerate_digits.py --epochs 10

The main process (the controller under flodl-zmq) prints the test accuracy
after each epoch and one `RESULT {json}` line at the end.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from flodl_zmq.accelerate import Accelerator  # was: from accelerate import Accelerator
from flodl_zmq.datasets import digits


def evaluate(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader) -> float:
    """Test accuracy, gathered over the processes as Accelerate's examples do."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            pred, y = accelerator.gather_for_metrics((model(x).argmax(dim=1), y))
            correct += int((pred == y).sum())
            total += len(y)
    model.train()
    return correct / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--save", help="save the trained model's state_dict here")
    args = p.parse_args()

    torch.manual_seed(0)
    train, test = digits()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test, batch_size=256)

    accelerator = Accelerator()
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)
    accuracy = 0.0
    for epoch in range(args.epochs):
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accuracy = evaluate(accelerator, model, test_loader)
        accelerator.print(f"epoch {epoch}: test accuracy {accuracy:.4f}")
    accelerator.wait_for_everyone()
    if args.save:
        accelerator.save(accelerator.unwrap_model(model).state_dict(), args.save)
    accelerator.print("RESULT " + json.dumps({"accuracy": accuracy}), flush=True)


if __name__ == "__main__":
    main()
