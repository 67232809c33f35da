"""Our own rank for tests/interop: the job of test_spec_rank.py, its steps logged, its model unmoved.

Run with FLODL_ROLE=rank (flodl_zmq/environment.py). The learning rate is 0, so its deposits are
exactly the model it was given (the torch init, then each consensus): the test can then tell what
the spec rank's deposits did to every consensus. OWN_RANK_LR, when set, trains at that rate instead
(tests/interop/test_spec_relay.py, whose relay logs what the deposits were). Appends each batch's
sample ids to OWN_RANK_LOG.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_job import job  # noqa: E402

from flodl_zmq import Trainer  # noqa: E402


def main() -> None:
    log = open(os.environ["OWN_RANK_LOG"], "a")  # noqa: SIM115 - open for the process's life

    def step(model, batch):
        log.write(" ".join(str(int(i)) for i in batch[2]) + "\n")
        log.flush()
        return ((model(batch[0]) - batch[1]) ** 2).mean()

    Trainer(**job(step, lr=float(os.environ.get("OWN_RANK_LR", "0")))).run()


if __name__ == "__main__":
    main()
