"""How a `flodl-zmq launch` ends when the run does not complete, as its user reads it.

A user trial found two ends that misled: Ctrl-C on a run with `save_path`
saved nothing and said nothing of it (the user believed the model saved),
and a dataset whose `__getitem__` raises on one sample ended every rank,
each with its own traceback, under a final error that did not tie them
together. A job refused by name (a float16 model) ended the same way: three
tracebacks, and no last word from the launcher.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flodl_zmq.checkpoints import newest
from flodl_zmq.environment import INTERRUPTED_EXIT

ROOT = Path(__file__).resolve().parents[2]
DIGITS_JOB = ROOT / "tests" / "cluster" / "digits_job.py"

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]

# 64 samples of which one raises: each epoch hands sample 13 to some rank, and the rank that takes over
# a raised rank's samples is handed it too.
BAD_SAMPLE = """
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
import flodl_zmq as fz


class Flaky(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 13:
            raise ValueError(f"sample {i} is corrupt")
        return self.x[i], self.y[i]


fz.Trainer(model=lambda: torch.nn.Linear(8, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
           train_step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), dataset=Flaky(), batch_size=4, epochs=2,
           quiet=True).run()
"""


def launcher(tmp_path: Path, argv: list[str], hosts: int, ranks_per_host: int,
             env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`flodl-zmq launch` of `argv` as a user starts it from a terminal: its own process group, which Ctrl-C
    signals whole; stdout and stderr on one pipe."""
    cmd = [sys.executable, "-m", "flodl_zmq.cli", "launch", "--hosts", str(hosts), "--ranks-per-host",
           str(ranks_per_host), "--run-dir", str(tmp_path / "run"), "--", *argv]
    return subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def read_lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """`proc`'s output lines as they come, then None at its end."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for(lines: queue.Queue[str | None], seen: list[str], prefix: str, timeout_s: float) -> None:
    """Read `lines` into `seen` until one starts with `prefix`; fail naming the output when none does in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(prefix):
            return
    pytest.fail(f"no line starting {prefix!r} within {timeout_s} s:\n" + "\n".join(seen))


def rest(lines: queue.Queue[str | None], seen: list[str], timeout_s: float) -> None:
    """Read the rest of `lines` into `seen` (the process has ended)."""
    deadline = time.monotonic() + timeout_s
    while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
        seen.append(line)


@pytest.mark.parametrize("checkpoints", [False, True], ids=["no-checkpoints", "checkpoints"])
def test_ctrl_c_on_a_launch_with_save_path_says_nothing_was_saved_and_where_the_progress_is(
        tmp_path: Path, checkpoints: bool) -> None:
    save = tmp_path / "out" / "digits"
    ckpt = tmp_path / "ckpt"
    # Epochs of 2 ms a step: far more than the test waits for, however fast the machine.
    proc = launcher(tmp_path, [str(DIGITS_JOB), "--epochs", "50", "--step-ms", "2", "--save", str(save)], 1, 2,
                    env={"FLODL_CHECKPOINT_DIR": str(ckpt)} if checkpoints else None)
    seen: list[str] = []
    try:
        lines = read_lines(proc)
        wait_for(lines, seen, "[controller] epoch 1/", 90)
        deadline = time.monotonic() + 30
        while checkpoints and newest(ckpt) is None and time.monotonic() < deadline:  # the epoch end's checkpoint
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the launcher's whole group
        code = proc.wait(60)
        rest(lines, seen, 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    out = "\n".join(seen)
    assert code == INTERRUPTED_EXIT, out
    assert not any(save.parent.glob("digits*")), "an interrupted run writes no bundle"
    # Before, the launch ended on "flodl-zmq launch: interrupted; stopping every process" and nothing more.
    notice = [line for line in seen if line.startswith(f"[controller] interrupted: nothing was saved to {save} ")]
    assert len(notice) == 1, out
    if checkpoints:
        stem = newest(ckpt)
        assert stem is not None, out
        assert f"its progress is in the checkpoint {stem}: continue with --resume {stem}" in notice[0], out
    else:
        assert "no checkpoint holds its progress" in notice[0], out
        assert "--checkpoint-dir DIR (FLODL_CHECKPOINT_DIR=DIR under launch)" in notice[0], out


def launched_to_its_end(tmp_path: Path, script_text: str, hosts: int, ranks_per_host: int) -> tuple[int, str]:
    """`script_text` launched as a user launches it, to its end: the exit status and the output."""
    script = tmp_path / "job.py"
    script.write_text(script_text)
    proc = launcher(tmp_path, [str(script)], hosts, ranks_per_host)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, out


def test_a_sample_that_raises_on_every_rank_ends_the_launch_naming_the_error_and_the_ranks(tmp_path: Path) -> None:
    code, out = launched_to_its_end(tmp_path, BAD_SAMPLE, 2, 1)
    assert code == 1, out
    for label, rank in (("h0:0", 0), ("h1:1", 1)):
        assert f"[{label}] ERROR flodl_zmq.session: rank {rank}: training failed: ValueError: sample 13 is corrupt" \
            in out, out
    # The controller knows only that every rank said goodbye and none died: it names what makes ranks do that.
    assert ("TrainingError: the run stopped early (all_ranks_lost): no rank died, every one said goodbye before "
            "the end, as a rank does when its own code raised") in out, out
    # The launcher read each rank's error: the last line says what ended the run, and on which ranks.
    assert out.splitlines()[-1] == (
        "[launch] every rank left the run because its own code raised (its train_step or its dataset: a sample "
        "that raises ends every rank that is handed it): h0:0, h1:1 raised ValueError: sample 13 is corrupt; "
        "each traceback is above, under its [host:rank] prefix"), out


def test_a_job_refused_by_name_ends_the_launch_with_one_line_naming_the_cause_and_the_fix(tmp_path: Path) -> None:
    code, out = launched_to_its_end(tmp_path, BAD_SAMPLE.replace("torch.nn.Linear(8, 2)", "torch.nn.Linear(8, 2).half()"),
                                    1, 2)
    assert code == 1, out
    # The controller refuses it before a socket binds; a rank may say the same before the launcher stops it.
    last = out.splitlines()[-1]
    assert last.startswith("[launch] the run failed: controller"), out
    assert last.endswith(" raised ConfigError: the data plane averages float32 tensors; the model's 'weight' is "
                         "torch.float16 of shape (2, 8): keep the master weights in float32 (autocast for lower "
                         "precision); each traceback is above, under its [label] prefix"), out
