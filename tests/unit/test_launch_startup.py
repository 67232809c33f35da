"""The launcher's start-up (flodl_zmq.launch.Cluster.start): the warm interpreter's torch import is the only one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
