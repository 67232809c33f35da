"""`flodl-zmq run --hosts` across network namespaces: one launched run, three hosts listed, one unreachable.

The `--ssh` command is tests/cluster/netns_ssh.sh: `HOST COMMAND` runs COMMAND in HOST's namespace, as
ssh runs it in HOST's login shell, and fails like ssh (exit 255) for a host with no namespace.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from flodl_zmq.demo import RESULT_TAG
from flodl_zmq.wire import new_key
from tests.cluster.netns import Logged, network_or_skip

ROOT = Path(__file__).resolve().parents[2]
SSH = Path(__file__).with_name("netns_ssh.sh")

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(sys.platform != "linux", reason="network namespaces")]


@pytest.fixture(scope="module")
def net():
    with network_or_skip("controller", "worker1", "worker2") as n:
        yield n


def cmdlines(net, host: str) -> list[str]:
    out = []
    for pid in net.pids(host):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
    return out


def test_run_trains_digits_on_the_reachable_hosts_names_the_unreachable_one_and_leaves_nothing(net, tmp_path):
    key = new_key().hex()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_CURVE")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", FLODL_KEY=key, FLODL_STARTUP_TIMEOUT="120")
    argv = [sys.executable, "-m", "flodl_zmq.cli", "run", "--hosts", "worker1:2,ghost:2,worker2:2",
            "--ssh", f"sh {SSH} {net.tag}", "--curve", "--min-ranks", "4", "--target-ranks", "4",
            "--", "-m", "flodl_zmq.demo", "--epochs", "4"]
    logged = Logged(net, tmp_path)
    try:
        logged.start("run", "controller", argv, env, cwd=ROOT)
        logged.wait_for("run", "world formed", timeout=120)
        # The key went to each agent on stdin: no command line on any host shows it.
        seen = [line for host in net.hosts for line in cmdlines(net, host)]
        assert any("flodl_zmq.cli agent" in line for line in seen), seen
        assert not [line for line in seen if key in line]
        assert logged.wait("run", timeout=150) == 0, logged.tails()
        log = logged.log("run")
        # Every SSH command (here: the agent it became) ended with the run; nothing is left on any host.
        assert {host: net.pids(host) for host in net.hosts} == {host: [] for host in net.hosts}
    finally:
        logged.down()
    assert "[run] host 'ghost' unreachable" in log and "[ghost] ssh: Could not resolve hostname ghost" in log
    formed = next(line for line in log.splitlines() if "world formed: {" in line)
    assert "'worker1'" in formed and "'worker2'" in formed and "ghost" not in formed
    assert "CURVE on" in log
    result = json.loads(next(line for line in log.splitlines() if line.startswith(RESULT_TAG))[len(RESULT_TAG):])
    assert result["accuracy"] >= 0.5  # learnt: chance is 0.1 (4 epochs reach about 0.8)
    assert "[worker1:relay]" in log and "[worker2:agent]" in log  # each host's lines come back under its name
    assert "[run] host 'worker1': its agent finished" in log
