"""The launcher's start-up (flodl_zmq.launch.Cluster.start): the warm interpreter's torch import is the only one."""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_zmq import cli, launch

# Run in a fresh interpreter: the test session has imported torch already. The warm
# interpreter and the cohort are stood in for, so nothing is spawned.
PROBE = """
import json, sys
from flodl_zmq import launch

seen = {}

class Spawned(Exception):
    pass

def warm():
    seen["torch_when_the_warm_interpreter_starts"] = "torch" in sys.modules

def spawn(self, settings):
    seen["torch_when_the_cohort_spawns"] = "torch" in sys.modules
    raise Spawned

launch.warm_interpreter = warm
launch.Cluster._spawn_cohort = spawn
try:
    launch.Cluster(argv=["train.py"], hosts=1, ranks_per_host=2).start()
except Spawned:
    pass
print(json.dumps(seen))
"""


def test_a_fresh_launch_starts_its_warm_interpreter_without_importing_torch_itself():
    # The launcher imported torch (1.7 s on one core) to resolve a resume that was not asked for,
    # before it started the warm interpreter, whose own torch import then came after: a launch
    # formed its world 1.3 s later than it does now (docs/benchmarks.md, bench/tta.py).
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).parents[2])}, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "torch_when_the_warm_interpreter_starts": False, "torch_when_the_cohort_spawns": False}


def started(*_: object) -> None:
    raise AssertionError("a process was started")


@pytest.mark.parametrize(("args", "named"), [
    (["--slow", "1:nan", "train.py"], r"--slow 1:nan: .* factor a finite number >= 1"),
    (["--slow", "1:inf", "train.py"], r"--slow 1:inf: .* factor a finite number >= 1"),
    (["--port", "70000", "train.py"], r"127\.0\.0\.1:70000: port must be in 1\.\.65532"),
    (["--port", "-3", "train.py"], r"127\.0\.0\.1:-3: port must be in 1\.\.65532"),
    (["nothere.py"], r"no script 'nothere\.py' \(from .*\): give the path of a Python file, or -- -m module"),
    (["--", "-m", "nosuchmod.train"], r"no module 'nosuchmod\.train' to run with -m \(from .*\): check its name"),
    (["--port", "17300", "--metrics-port", "17302", "train.py"],
     r"metrics port 17302 \(--metrics-port / FLODL_METRICS_PORT\) is one of the controller's own ports: the "
     r"controller at 127\.0\.0\.1:17300 binds 17300\.\.17303"),
    (["--shards", "1", "--port", "17300", "--metrics-port", "17305", "train.py"], r"binds 17300\.\.17305"),
], ids=["slow-nan", "slow-inf", "port-too-high", "port-negative", "no-script", "no-module", "metrics-port-overlaps",
        "metrics-port-overlaps-a-shard"])
def test_launch_refuses_a_bad_value_by_name_before_it_starts_any_process(args, named, tmp_path, monkeypatch, capsys):
    # Each once started the whole cluster: a NaN slowdown failed in every rank, a port past 65532 ran a
    # script that never binds to success, and a missing script printed one traceback per process.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")

    monkeypatch.setattr(launch, "warm_interpreter", started)
    monkeypatch.setattr(launch.Cluster, "_spawn_cohort", started)
    assert cli.main(["launch", "--hosts", "1", *args]) == 2
    assert re.search(named, capsys.readouterr().err)


def test_launch_refuses_a_taken_port_by_name_before_it_starts_any_process(tmp_path, monkeypatch, capsys):
    # The controller's first bind failed with a ZMQError traceback, after every process had started.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(launch, "warm_interpreter", started)
    monkeypatch.setattr(launch.Cluster, "_spawn_cohort", started)
    base = launch.free_port_base()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 3))
        taken.listen()
        assert cli.main(["launch", "--hosts", "1", "--port", str(base), "train.py"]) == 2
    assert (f"controller port {base + 3} on 127.0.0.1: Address already in use (another controller?); the controller "
            "uses PORT..PORT+3 of --port PORT: choose another PORT, or stop what holds it") in capsys.readouterr().err


def test_a_free_port_base_leaves_the_metrics_port_to_the_metrics(monkeypatch):
    # Drawn at random, the controller's four ports could take the metrics port, bound after them.
    metrics = launch.free_port_base() + 10
    monkeypatch.setattr(launch, "_listening_port_range", lambda span: range(metrics - 3, metrics + 3))
    assert all(launch.free_port_base(avoid=metrics) > metrics for _ in range(20))


def test_a_free_port_base_is_not_drawn_from_the_generator_a_job_seeds():
    # Job.build_model seeds `random`: two test workers (or a launcher and a job in one process) seeded
    # alike probed the same ports in the same order, and one controller bound the other's (a CI failure).
    draws = []
    for _ in range(2):
        random.seed(0)
        draws.append([launch.free_port_base() for _ in range(3)])
    assert draws[0] != draws[1]


@pytest.mark.parametrize(("args", "named"), [
    (["--epochs", "0"], r"epochs must be an integer \(a Python int\) >= 1, got 0"),
    (["--slow", "0.5"], r"--slow 3:0\.5: .* factor a finite number >= 1"),
    (["--slow", "nan"], r"--slow 3:nan: .* factor a finite number >= 1"),
], ids=["no-epochs", "slow-below-1", "slow-nan"])
def test_demo_refuses_a_bad_value_by_name_before_it_starts_any_process(args, named, tmp_path, monkeypatch, capsys):
    # --epochs 0 started the cluster and every process failed with a traceback; --slow 0.5 or nan ran
    # unslowed and said nothing (only factors > 1 were passed on, and so checked).
    monkeypatch.chdir(tmp_path)

    monkeypatch.setattr(launch, "warm_interpreter", started)
    monkeypatch.setattr(launch.Cluster, "_spawn_cohort", started)
    assert cli.main(["demo", *args]) == 2
    assert re.search(named, capsys.readouterr().err)
