"""A controller that comes back: periodic checkpoints, and a killed controller restarted from the newest.

Real processes through the launcher's `Cluster` (2 hosts x 2 ranks, tcp
loopback), `digits_job.py` as in test_training.py. The checkpoint directory
and its timings are the controller's settings (FLODL_CHECKPOINT_*).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_zmq import bundle, checkpoints
from flodl_zmq.launch import Cluster

JOB = str(Path(__file__).with_name("digits_job.py"))
SAMPLES_16 = (1437 // 16) * 16  # a progressive pool is batch-aligned

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def cluster(args: list[str], controller_env: dict[str, str], **kw) -> Cluster:
    return Cluster(argv=[JOB, *args], hosts=2, ranks_per_host=2, env_for={"controller": controller_env},
                   grace_s=3.0, **kw)


def finish(c: Cluster, timeout: float = 120.0) -> tuple[int, dict | None, str]:
    try:
        code = c.wait(timeout)
    finally:
        c.shutdown()
    out = c.output()
    lines = [ln for ln in out.splitlines() if ln.startswith("[controller] RESULT ")]
    return code, json.loads(lines[-1][len("[controller] RESULT "):]) if lines else None, out


def test_periodic_checkpoints_keep_the_last_k_and_name_the_run_and_world(tmp_path):
    c = cluster(["--epochs", "4", "--batch-size", "16"], {
        "FLODL_CHECKPOINT_DIR": str(tmp_path), "FLODL_CHECKPOINT_EVERY_ROUNDS": "5", "FLODL_CHECKPOINT_KEEP": "2",
    })
    c.start()
    code, result, out = finish(c)
    assert code == 0, out
    kept = checkpoints.complete(tmp_path)
    assert len(kept) == 2, (kept, out)
    state, meta = bundle.load(kept[-1])
    assert meta["run_id"] == c.run_id.hex() and meta["world"] == {"h0": [0, 1], "h1": [2, 3]}
    assert meta["reason"] == "checkpoint" and meta["coordinator"]["round"] >= 5 and state
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_full_checkpoint_disk_is_reported_with_the_path_and_the_run_completes(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        c = cluster(["--epochs", "3", "--batch-size", "16"], {
            "FLODL_CHECKPOINT_DIR": str(small), "FLODL_CHECKPOINT_EVERY_ROUNDS": "5",
        })
        c.start()
        code, result, out = finish(c)
        assert code == 0, out  # the model (69 KB) never fits: every write fails, the run does not
        assert f"could not write {small}/ckpt-r" in out and "No space left on device" in out, out
        assert result["accuracy"] is not None and len(result["epochs"]) == 3
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
