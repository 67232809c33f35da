"""Elastic join: hosts that dial in after the world formed enter it at the next epoch boundary.

Real processes: `flodl-zmq controller` and agents in network namespaces (the
compose harness of test_multihost.py), one CPU rank per host, training
tests/cluster/digits_job.py. The controller re-forms the world from an
epoch-end checkpoint (PROTOCOL.md 13.1): every host's ranks start again from
it with the larger world, the joiner's cold in ElChe.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cluster.netns import network_or_skip
from tests.cluster.test_multihost import BIN, Compose, controller_argv, result_of

JOB = str(Path(__file__).with_name("digits_job.py"))
EPOCHS = 6
SAMPLES_16 = (1437 // 16) * 16  # a progressive pool is batch-aligned
PROGRAM = [JOB, "--epochs", str(EPOCHS), "--batch-size", "16", "--step-ms", "30"]

pytestmark = [pytest.mark.timeout(200), pytest.mark.skipif(sys.platform != "linux", reason="network namespaces")]


@pytest.fixture(scope="module")
def net():
    with network_or_skip("controller", "worker1", "worker2", "worker3", "intruder") as n:
        yield n


@pytest.fixture
def hosts(net, tmp_path, monkeypatch):
    c = Compose.with_curve_keys(net, tmp_path, monkeypatch)
    yield c
    c.down()
    for host in net.hosts:
        net.restore(host)


def agent(c: Compose, name: str, *, host: str | None = None, extra: tuple[str, ...] = (),
          env: dict[str, str] | None = None) -> None:
    """An agent named `name` (its --host) on netns host `host` (default `name`), one CPU slot."""
    c.up(name, host=host or name, service="worker1", env=env, argv=[
        str(BIN / "flodl-zmq"), "agent", "--controller", "controller:7300", "--host", name, "--cpu-slots", "1",
        "--join-timeout", "60", "--script", JOB, *extra])


def covered(meta: dict, epoch: int) -> int:
    return sum(n for _, n in meta["coordinator"]["coverage"].get(str(epoch), []))


def test_a_host_joins_mid_run_with_a_share_by_speed_and_one_with_other_data_is_refused(hosts, tmp_path):
    from flodl_zmq import bundle

    ckpt = tmp_path / "ckpt"
    hosts.up("controller", argv=controller_argv(hosts, program=PROGRAM, extra=[
        "--min-ranks", "2", "--target-ranks", "2", "--max-ranks", "3", "--checkpoint-dir", str(ckpt)]))
    agent(hosts, "worker1")
    hosts.wait_for("controller", "admitted 'worker1'")
    agent(hosts, "worker2")
    hosts.wait_for("controller", "epoch 1/")
    # Slower hardware: ElChe must measure it and give it a smaller share than the others.
    agent(hosts, "worker3", env={"FLODL_SLOWDOWN": "3"})
    # Another dataset: refused by name, the run goes on untouched.
    agent(hosts, "other-data", host="intruder", extra=("--dataset-sig", "ab" * 32))

    assert hosts.wait("other-data") == 2, hosts.tails()
    assert "REJECTED by the controller: dataset signature mismatch: worker 'other-data'" in hosts.log("other-data")
    assert hosts.wait("controller", 150) == 0, hosts.tails()
    for name in ("worker1", "worker2", "worker3"):
        assert hosts.wait(name) == 0, hosts.tails()
    log = hosts.log("controller")
    result = result_of(log, "RESULT ")
    assert "admitted 'worker3' as ranks [2], pending" in log, log
    [change] = result["world_changes"]
    assert change["before"] == {"worker1": [0], "worker2": [1]} and change["after"]["worker3"] == [2]
    first = change["epoch"]  # the first epoch the world of three trains in
    assert 2 <= first < EPOCHS, change  # after the epoch it was admitted in
    assert "world 2 -> 3 ranks (+worker3)" in log, log
    # Every epoch once, every sample of every epoch once: the re-formed world trains what the checkpoint lacks.
    epochs = result["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS)), [e["epoch"] for e in epochs]
    meta = bundle.load_meta(change["checkpoint"])
    assert meta["epoch"] == first and meta["reason"] == "reform"
    for e in epochs:
        want = SAMPLES_16 - (covered(meta, first) if e["epoch"] == first else 0)
        assert e["samples"] == want, (e["epoch"], e["samples"], want)
    # From the epoch after the join on, the slow joiner has the smallest share, measured by ElChe.
    last = epochs[-1]["batch_share"]
    assert len(last) == 3 and last[2] < min(last[0], last[1]), [e["batch_share"] for e in epochs]
    assert result["accuracy"] >= 0.9, result["accuracy"]
    print(f"elastic join at epoch {first + 1}: accuracy {result['accuracy']:.4f}; shares of the last epoch "
          f"{[round(s, 3) for s in last]}")
