"""The bring-your-own-loop example (examples/own_loop.py, `fz.Session`) on a local cluster of 2 hosts x 2 ranks,
as `flodl-zmq launch --hosts 2 --ranks-per-host 2` runs it: a rank killed mid-run costs no sample."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from flodl_zmq.launch import Cluster
from tests.cluster.digits_job import held, samples_per_epoch

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "own_loop.py")

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def test_the_own_loop_example_covers_every_sample_of_each_epoch_with_a_rank_sigkilled_mid_run(tmp_path, warm):
    # Held from epoch 2 on until rank 1's death is seen: the run cannot end before the kill.
    gate, seen = tmp_path / "gate", threading.Condition()

    def sink(line: str) -> None:
        with seen:
            seen.notify_all()

    def wait_for(text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        with seen:
            while text not in cluster.output():
                left = deadline - time.monotonic()
                assert left > 0, f"{text!r} never appeared:\n{cluster.output()}"
                seen.wait(left)

    cluster = Cluster(argv=[EXAMPLE, "--epochs", "5", "--batch-size", "16",
                            *held(gate, after_epochs=1, epochs=5, ranks=4)],
                      hosts=2, ranks_per_host=2, sink=sink, warm=warm)
    cluster.start()
    try:
        wait_for("[controller] epoch 1/")
        cluster.kill("h0:1", signal.SIGKILL)
        wait_for("rank 1 declared dead")
        gate.touch()
        code = cluster.wait(100)
    finally:
        cluster.shutdown()
    out = cluster.output()
    assert code == 0, out
    (line,) = [x for x in out.splitlines() if x.startswith("[controller] RESULT ")]
    result = json.loads(line[len("[controller] RESULT "):])
    assert "RESULT" not in out.replace("[controller] RESULT", ""), "only the controller gets past the block"
    assert len(result["epochs"]) == 5
    assert all(e["samples"] == samples_per_epoch(16) for e in result["epochs"]), result["epochs"]
    assert result["epochs"][-1]["per_rank_samples"][1] == 0
    # Far above chance (0.1): about 0.95 undisturbed; the bound leaves room for the lost rank and a slow machine.
    assert result["accuracy"] > 0.85, result["accuracy"]
