"""A rank that ends with status 0 before training, under `flodl-zmq controller` and its agents (real processes)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from flodl_zmq.launch import free_port_base
from tests.cluster.agents import run_agents

pytestmark = [pytest.mark.timeout(240), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]

# Rank 1 ends at once with status 0: os._exit, past the interpreter's check of a role never played
# (which turns a script's own exit 0 into status 3), as a process killed from within or a wrapper would.
SCRIPT = """
import os
import sys

from flodl_zmq import demo

if os.environ.get("FLODL_RANK") == "1":
    os._exit(0)
sys.exit(demo.main(["--epochs", "1", "--quiet"]))
"""


def test_a_rank_that_exits_0_before_the_world_formed_is_left_out_at_once_by_its_agents_report(tmp_path: Path) -> None:
    # Its agent's report of exit code 0 was not acted on: nobody said rank 1 was gone (its agent then
    # stopped the host's relay, which would have), and the run failed after the ranks' 120 s first-contact limit.
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    outputs, codes = run_agents(tmp_path, free_port_base(), [str(script)], ("a", "b", "c"), min_ranks=2)
    everything = "\n".join(f"--- {n}\n{o}" for n, o in outputs.items())
    assert codes == {"controller": 0, "a": 0, "b": 0, "c": 0}, everything
    log = outputs["controller"]
    # Hosts are admitted in the order their hellos come: rank 1 is any one's.
    assert re.search(r"rank 1 left before the world formed \(its agent on [abc] reported exit code 0\); "
                     r"forming without it", log), everything
    [line] = [x for x in log.splitlines() if x.startswith("FLODL_DEMO_RESULT ")]
    share = json.loads(line.removeprefix("FLODL_DEMO_RESULT "))["batch_share"]
    assert share[1] == 0.0 and share[0] > 0.0 and share[2] > 0.0, share
