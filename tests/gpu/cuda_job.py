"""The job tests/gpu launches: the demo's digits MLP, refusing to train anywhere but on CUDA.

Every process of the cluster runs this file; the controller prints one
`RESULT {json}` line. A rank whose batches are not on a GPU raises, so a run
that completes proves the ranks trained on CUDA.
"""

from __future__ import annotations

import json

from flodl_zmq.api import Trainer
from flodl_zmq.datasets import digits
from flodl_zmq.demo import accuracy, cross_entropy_step, mlp, sgd


def on_cuda_step(model, batch):
    if not (batch[0].is_cuda and next(model.parameters()).is_cuda):
        raise RuntimeError(f"this rank trains on {batch[0].device}, not CUDA")
    return cross_entropy_step(model, batch)


def main() -> None:
    train, test = digits()
    result = Trainer(
        model=mlp, optimizer=sgd, train_step=on_cuda_step, dataset=train, batch_size=32, epochs=8,
        eval_dataset=test, eval_fn=accuracy, on_callback_error="stop",
    ).run()
    print("RESULT " + json.dumps({"accuracy": result.final_eval, "batch_share": result.batch_share}), flush=True)


if __name__ == "__main__":
    main()
