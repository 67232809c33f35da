"""The stock Accelerate example (examples/accelerate_digits.py) under `flodl-zmq launch`, 1 host x 2 ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flodl_zmq.launch import Cluster
from tests.cluster.digits_job import samples_per_epoch

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "accelerate_digits.py")
EPOCHS = 4
# What the example's MLP reaches in 4 epochs of batch 32 on 2 ranks: 0.9443 to 0.9471 in 3 runs under
# cpu-cadence, 0.9499 to 0.9526 in 3 under the default cpu-async (`launch`, 2 cores), and 0.9359 once
# with the whole cluster suite beside it (the overlapped round's timing follows the load); stated
# three test images (of 359) under the lowest seen, as digits_job.py states its own. Broken averaging
# or a rank training the wrong samples costs far more.
STATED_ACCURACY = 0.927

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def test_a_stock_accelerate_loop_trains_every_sample_once_per_epoch_and_reaches_its_accuracy(
        warm, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FLODL_ACCELERATE_EPOCHS", str(EPOCHS))
    saved = tmp_path / "model.pt"
    cluster = Cluster(argv=[EXAMPLE, "--epochs", str(EPOCHS), "--save", str(saved)], hosts=1, ranks_per_host=2,
                      run_dir=str(tmp_path / "run"), warm=warm)
    cluster.start()
    code = cluster.wait(150)
    out = cluster.output()
    assert code == 0, out
    results = [line for line in out.splitlines() if line.startswith("[controller] RESULT ")]
    assert len(results) == 1 and out.count("RESULT ") == 1, out  # printed by the main process alone
    assert json.loads(results[0][len("[controller] RESULT "):])["accuracy"] >= STATED_ACCURACY, out
    # Both ranks trained (ElChe's dispatch) and every epoch covered each sample once, no more. Over the
    # run, not in each epoch: an epoch here lasts tens of milliseconds, and under load one rank may take
    # a whole one while the other is descheduled (a CI run saw it), as the dispatch intends.
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    epochs = [e for e in events if e["kind"] == "epoch"]
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS)), out
    assert all(e["samples"] == samples_per_epoch(32) for e in epochs), epochs
    assert all(share > 0 for share in map(sum, zip(*(e["batch_share"] for e in epochs), strict=True))), epochs
    assert out.count("said goodbye") == 2, out  # each rank's loop ended with the run's last epoch
    assert saved.exists()  # the main process saved the run's model
