"""`flodl-zmq controller` and `agent` at their start: what they cannot run is refused before any host joins (exit 2).

Found by trying them as an operator: a missing script opened the join window, formed the world from the
agents that joined, then failed in the controller's own process and tore every agent down; a port of
PORT..PORT+2 held by another process was found only when the world formed (those ports are bound then);
an agent without a program (or with a missing one) was admitted, took ranks, and refused the run after
the world formed, which the controller saw only as its silence.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_zmq.launch import free_port_base
from flodl_zmq.wire import new_key

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(sys.platform != "linux", reason="tcp ports")]


def cli(*words: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    return subprocess.run([sys.executable, "-m", "flodl_zmq.cli", *words],
                          env={**env, "PYTHONPATH": str(ROOT), "FLODL_KEY": new_key().hex()}, capture_output=True,
                          text=True, timeout=100, check=False, cwd=ROOT)


def controller(port: int, *program: str) -> subprocess.CompletedProcess[str]:
    return cli("controller", "--bind", f"127.0.0.1:{port}", "--join-window", "60", "--", *program)


def test_a_missing_script_is_refused_before_the_join_window_opens():
    done = controller(free_port_base(), "no_such_job.py")
    assert done.returncode == 2, done.stderr
    assert f"controller: no script 'no_such_job.py' (from {ROOT})" in done.stderr
    assert "join window open" not in done.stderr + done.stdout


@pytest.mark.parametrize("offset", [0, 2, 3])
def test_a_port_another_process_holds_is_refused_by_number_before_the_join_window_opens(offset):
    port = free_port_base()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + offset))
        held.listen()
        done = controller(port, "-m", "flodl_zmq.demo")
    assert done.returncode == 2, done.stderr
    assert f"controller port {port + offset} on 127.0.0.1: Address already in use" in done.stderr
    assert "choose another PORT" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("script", "named"), [
    (None, "the program it agrees to run, --script SCRIPT or '-m MODULE' (FLODL_SCRIPT)"),
    ("no_such_job.py", f"agent: no script 'no_such_job.py' (from {ROOT})"),
])
def test_an_agent_without_a_program_it_can_run_is_refused_before_it_dials(script, named):
    port = free_port_base()  # nothing listens there: a refused agent never dials
    done = cli("agent", "--controller", f"127.0.0.1:{port}", "--host", "a", "--cpu-slots", "1",
               *(["--script", script] if script else []))
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr


def test_a_checkpoint_directory_that_cannot_be_made_is_refused_before_the_join_window_opens(tmp_path):
    # Before, the run trained to its end with every checkpoint's write failing (and --resume auto had nothing).
    blocker = tmp_path / "a-file"
    blocker.write_text("where the checkpoint directory's parent should be")
    done = cli("controller", "--bind", f"127.0.0.1:{free_port_base()}", "--join-window", "60", "--checkpoint-dir",
               str(blocker / "ckpts"), "--", "-m", "flodl_zmq.demo")
    assert done.returncode == 2, done.stderr
    assert f"checkpoint directory (--checkpoint-dir) {blocker / 'ckpts'}: cannot create it (Not a directory)" \
        in done.stderr
    assert "join window open" not in done.stderr + done.stdout
