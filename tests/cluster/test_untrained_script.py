"""A script that never trains, under `flodl-zmq launch`: the launch fails and says why, as a user reads it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_zmq.environment import UNPLAYED_EXIT

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]

BUILDS_A_TRAINER = """
import torch
import torch.nn.functional as F
from flodl_zmq import Trainer
from flodl_zmq.datasets import digits

train, _ = digits()
trainer = Trainer(model=lambda: torch.nn.Linear(64, 10), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                  train_step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), dataset=train, batch_size=32, epochs=1)
print("built a trainer")  # and never called trainer.run()
"""


def launch(tmp_path: Path, script: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """`script` launched as 1 host x 2 ranks: the finished process and its whole output."""
    path = tmp_path / "job.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "flodl_zmq.cli", "launch", "--hosts", "1", "--ranks-per-host", "2",
           "--run-dir", str(tmp_path / "run"), "--", str(path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=100, check=False)
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", [BUILDS_A_TRAINER, "print('no flodl-zmq here')\n"],
                         ids=["trainer-never-run", "no-trainer-at-all"])
def test_a_script_that_never_trains_fails_the_launch_naming_the_missing_call(tmp_path: Path, script: str) -> None:
    # Before, every process exited 0 and so did launch, with no word that nothing trained.
    proc, out = launch(tmp_path, script)
    assert proc.returncode == UNPLAYED_EXIT, out
    assert proc.stdout.splitlines()[-1].startswith("[launch] no rank ever trained: the script ended without "
                                                   "calling Trainer(...).run() or entering a Session"), out
    for who, label in (("controller", "controller"), ("rank 0 on h0", "h0:0"), ("rank 1 on h0", "h0:1")):
        assert (f"[{label}] flodl-zmq: the script ended without playing this process's role ({who}): it never "
                "called Trainer(...).run() nor entered a Session") in out, out


IN_A_THREAD = BUILDS_A_TRAINER.replace("print(\"built a trainer\")  # and never called trainer.run()", """
import threading
worker = threading.Thread(target=trainer.run)  # a web app's or a notebook helper's worker thread
worker.start()
worker.join()
""")


def test_a_trainer_run_in_a_worker_thread_fails_the_launch_naming_the_main_thread(tmp_path: Path) -> None:
    # Before, each process failed on "signal only works in main thread", from inside the role's set-up.
    proc, out = launch(tmp_path, IN_A_THREAD)
    assert proc.returncode == UNPLAYED_EXIT, out
    assert "signal only works" not in out, out
    for label, role in (("controller", "controller"), ("h0:0", "rank"), ("h0:1", "rank")):
        assert (f"[{label}] flodl_zmq.errors.SessionError: Trainer(...).run() or a Session ran outside the main "
                f"thread of a cluster process ({role})") in out, out
