"""Elastic join: hosts that dial in after the world formed enter it at the next round.

Real processes: `flodl-zmq controller` and agents in network namespaces (the
compose harness of test_multihost.py), one CPU rank per host, training
tests/cluster/digits_job.py (`cpu-cadence`). The controller re-forms the
world from the checkpoint of the first round finished after the joiner's
admission (PROTOCOL.md 13.1): every host's ranks start again from it with
the larger world, the joiner's cold in ElChe.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flodl_zmq import bundle
from tests.cluster.digits_job import batches_per_epoch, held, samples_per_epoch
from tests.cluster.netns import network_or_skip
from tests.cluster.test_controller_restart import covered
from tests.cluster.test_multihost import BIN, Compose, controller_argv, result_of, without

JOB = str(Path(__file__).with_name("digits_job.py"))
EPOCHS = 6
SAMPLES_16 = samples_per_epoch(16)
SAMPLES_8 = samples_per_epoch(8)
PROGRAM = [JOB, "--epochs", str(EPOCHS), "--batch-size", "16", "--step-ms", "30"]


pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(sys.platform != "linux", reason="network namespaces")]


@pytest.fixture(scope="module")
def net():
    with network_or_skip("controller", "worker1", "worker2", "worker3", "intruder") as n:
        yield n


@pytest.fixture
def hosts(net, tmp_path, monkeypatch):
    with Compose.running(net, tmp_path, monkeypatch) as c:
        yield c


def agent(c: Compose, name: str, *, host: str | None = None, extra: tuple[str, ...] = (),
          env: dict[str, str] | None = None, hidden: Path | None = None) -> None:
    """An agent named `name` (its --host) on netns host `host` (default `name`), one CPU slot;
    `hidden`: a directory of the controller's this host does not see (no shared filesystem)."""
    argv = [str(BIN / "flodl-zmq"), "agent", "--controller", "controller:7300", "--host", name, "--cpu-slots", "1",
            "--join-timeout", "60", "--script", JOB, *extra]
    c.up(name, host=host or name, service="worker1", env=env, argv=argv if hidden is None else without(hidden, argv))


def events_of(run_dir: Path) -> list[dict]:
    """The run log's events written whole so far (the controller may be writing the next line)."""
    text = (run_dir / "events.jsonl").read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def reform_seconds(run_dir: Path) -> float:
    """From the run log: the round the world re-formed at, finished -> the re-formed world starting."""
    events = events_of(run_dir)
    join = next(i for i, e in enumerate(events) if e["kind"] == "join")
    reformed = next(e["t"] for e in events[:join] if e["kind"] == "round" and e["round"] == events[join]["round"])
    return next(e["t"] for e in events[join:] if e["kind"] == "start") - reformed


def test_a_host_joins_mid_run_with_a_share_by_speed_and_one_with_other_data_is_refused(hosts, tmp_path):
    ckpt, gate = tmp_path / "ckpt", tmp_path / "gate"
    # Two ranks hold within three epochs of six until worker3 is admitted: the run cannot end before.
    hosts.up("controller", argv=controller_argv(hosts, program=[*PROGRAM, *held(gate, after_epochs=1, epochs=EPOCHS, ranks=2)], extra=[
        "--min-ranks", "2", "--target-ranks", "2", "--max-ranks", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-keep", "100",
        "--run-dir", str(tmp_path / "run")]))
    # No worker sees the checkpoint directory: the re-formed world's ranks get their model over the wire.
    agent(hosts, "worker1", hidden=ckpt)
    hosts.wait_for("controller", "admitted 'worker1'")
    agent(hosts, "worker2", hidden=ckpt)
    # Both dial in once the world of two formed (the second admission forms it): admitted mid-run.
    hosts.wait_for("controller", "admitted 'worker2'")
    # Slower hardware: ElChe must measure it and give it a smaller share than the others.
    agent(hosts, "worker3", env={"FLODL_SLOWDOWN": "3"}, hidden=ckpt)
    # Another dataset: refused by name, the run goes on untouched.
    agent(hosts, "other-data", host="intruder", extra=("--dataset-sig", "ab" * 32))
    hosts.wait_for("controller", "admitted 'worker3' as ranks [2], pending")
    gate.touch()

    assert hosts.wait("other-data") == 2, hosts.tails()
    assert "REJECTED by the controller: dataset signature mismatch: worker 'other-data'" in hosts.log("other-data")
    assert hosts.wait("controller", 150) == 0, hosts.tails()
    for name in ("worker1", "worker2", "worker3"):
        assert hosts.wait(name) == 0, hosts.tails()
    # The re-form stopped the healthy hosts' ranks: said at its level, not as a fault (a warning of code 143).
    assert not [line for line in hosts.log("worker1").splitlines() if "WARNING" in line and "exited with code" in line]
    log = hosts.log("controller")
    result = result_of(log, "RESULT ")
    assert "admitted 'worker3' as ranks [2], pending" in log, log
    [change] = result["world_changes"]
    assert change["before"] == {"worker1": [0], "worker2": [1]} and change["after"]["worker3"] == [2]
    first = change["epoch"]  # the first epoch the world of three trains in: the one it was admitted in
    assert 0 <= first < EPOCHS, change
    assert "world 2 -> 3 ranks (+worker3)" in log, log
    # Every epoch once, every sample of every epoch once: the re-formed world trains what the checkpoint lacks.
    epochs = result["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(EPOCHS)), [e["epoch"] for e in epochs]
    meta = bundle.load_meta(change["checkpoint"])
    assert meta["epoch"] == first and meta["reason"] == "reform"
    for e in epochs:
        want = SAMPLES_16 - (covered(meta, first) if e["epoch"] == first else 0)
        assert e["samples"] == want, (e["epoch"], e["samples"], want)
        assert e.get("eval") is not None, e  # no eval lost with the world before (ReformGate waits for it)
    # From the epoch after the join on, the slow joiner has the smallest share, measured by ElChe.
    last = epochs[-1]["batch_share"]
    assert len(last) == 3 and last[2] < min(last[0], last[1]), [e["batch_share"] for e in epochs]
    assert result["accuracy"] >= 0.9, result["accuracy"]
    print(f"elastic join at epoch {first + 1}: accuracy {result['accuracy']:.4f}; shares of the last epoch "
          f"{[round(s, 3) for s in last]}; re-form round -> re-formed world training "
          f"{reform_seconds(tmp_path / 'run'):.1f} s")


def test_a_host_joins_a_run_of_one_epoch_and_trains_within_two_rounds_of_its_hello(hosts, tmp_path):
    gate, run = tmp_path / "gate", tmp_path / "run"
    # Each of the two first ranks holds after a sixth of the epoch's batches until worker3 waits to join:
    # together they cannot have trained more than a third of it, whatever this machine's speed, and what
    # the windows up to the re-form round add leaves the world of three more than its first windows take.
    # Steps of 30 ms, as a real epoch's are long: without them the re-formed world's first rank up
    # trained the whole rest of the epoch (about 120 batches, a fraction of a second) before worker3's
    # rank had started, taking its share as any idle rank takes a slower one's.
    program = [JOB, "--epochs", "1", "--batch-size", "8", "--step-ms", "30", "--gate", str(gate),
               "--gate-after", str(batches_per_epoch(8) // 6)]
    hosts.up("controller", argv=controller_argv(hosts, program=program, extra=[
        "--min-ranks", "2", "--target-ranks", "2", "--max-ranks", "3", "--run-dir", str(run)]))
    agent(hosts, "worker1")
    hosts.wait_for("controller", "admitted 'worker1'")
    agent(hosts, "worker2")
    hosts.wait_for("controller", "admitted 'worker2'")
    # Mid-run: once the world of two has averaged.
    hosts.wait_for("controller", lambda _: (run / "events.jsonl").exists() and any(
        e["kind"] == "round" for e in events_of(run)))
    agent(hosts, "worker3")
    hosts.wait_for("controller", "worker3 waiting to join at round")
    gate.touch()

    assert hosts.wait("controller", 150) == 0, hosts.tails()
    for name in ("worker1", "worker2", "worker3"):
        assert hosts.wait(name) == 0, hosts.tails()
    result = result_of(hosts.log("controller"), "RESULT ")
    [change] = result["world_changes"]
    assert change["epoch"] == 0 and change["after"]["worker3"] == [2], change  # within the run's only epoch
    events = events_of(run)
    [noticed] = [e["round"] for e in events if e["kind"] == "pending" and "worker3" in e["hosts"]]
    assert noticed >= 1, noticed
    [join] = [e for e in events if e["kind"] == "join"]
    after = [e["round"] for e in events if e["kind"] == "round" and e["round"] > noticed]
    trained = [e["round"] for e in events if e["kind"] == "round" and e["masses"].get("worker3", 0.0) > 0.0]
    # The world re-forms from the first round finished after worker3 was seen (the one then in flight, if
    # any), and worker3's rank trains in the round after it: within two rounds.
    assert join["round"] == after[0] and trained[:1] == after[1:2], (noticed, join["round"], after, trained)
    # Every sample once: what the re-form checkpoint holds, then what the world of three trained.
    meta = bundle.load_meta(change["checkpoint"])
    assert meta["consensus_round"] == join["round"]
    [epoch] = result["epochs"]
    assert epoch["samples"] == SAMPLES_8 - covered(meta, 0), (epoch["samples"], covered(meta, 0))
    assert 0 < covered(meta, 0) < SAMPLES_8 and epoch["per_rank_samples"][2] > 0, epoch
    print(f"join within one epoch: seen after round {noticed}, re-formed at {join['round']}, worker3 trained "
          f"from round {trained[0]}; {covered(meta, 0)} of {SAMPLES_8} samples trained before; re-form round -> "
          f"re-formed world training {reform_seconds(run):.1f} s")


SILENCE_S = 3.0


def test_a_host_declared_dead_after_its_link_was_cut_rejoins_with_new_ranks(hosts, net, tmp_path):
    # Rank 0 holds after two epochs' worth of batches (the world has covered at most four of eight)
    # until worker2 is admitted again: the run cannot end before its rejoin.
    gate = tmp_path / "gate"
    # No step delay is needed to outlast the cut and the rejoin: the hold does (the join test's delay
    # is there for ElChe to tell a 3x slower host by its steps).
    program = [JOB, "--epochs", "8", "--batch-size", "16", *held(gate, after_epochs=2, epochs=8, ranks=2)]
    # Every checkpoint kept: the compose command's checkpoint directory holds the re-form one, read below.
    hosts.up("controller", argv=controller_argv(hosts, program=program, extra=[
        "--min-ranks", "2", "--target-ranks", "2", "--host-silence", str(SILENCE_S), "--run-dir", str(tmp_path / "run"),
        "--checkpoint-keep", "100"]))
    agent(hosts, "worker1")
    hosts.wait_for("controller", "admitted 'worker1'")
    agent(hosts, "worker2", extra=("--controller-silence", str(SILENCE_S), "--controller-grace", "120"))
    hosts.wait_for("controller", "epoch 1/")
    net.cut("worker2")
    hosts.wait_for("controller", "rank 1 declared dead")
    hosts.wait_for("worker2", "re-dialling the controller")
    net.restore("worker2")
    hosts.wait_for("controller", "admitted 'worker2' as ranks [2], pending", timeout=90)
    gate.touch()
    hosts.wait_for("controller", "world re-formed", timeout=90)
    status = hosts.status("worker1")  # `flodl-zmq status`: the host that left, and its return
    assert status["departed"] == [{"host": "worker2", "ranks": [1]}], status
    assert [(j["host"], j["ranks"]) for j in status["joins"]] == [("worker2", [2])], status
    assert status["hosts"]["worker2"] == {"ranks": [2], "state": "live"}, status

    assert hosts.wait("controller", 150) == 0, hosts.tails()
    for name in ("worker1", "worker2"):
        assert hosts.wait(name) == 0, hosts.tails()
    assert "back in the running world with new ranks [2] (its old ranks [1] stay dead)" in hosts.log("worker2")
    result = result_of(hosts.log("controller"), "RESULT ")
    [change] = result["world_changes"]
    assert change["after"] == {"worker1": [0], "worker2": [2]}, change
    epochs = result["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(8))
    meta = bundle.load_meta(change["checkpoint"])
    for e in epochs:
        want = SAMPLES_16 - (covered(meta, change["epoch"]) if e["epoch"] == change["epoch"] else 0)
        assert e["samples"] == want, (e["epoch"], e["samples"], want)
        assert e.get("eval") is not None, e
    last = epochs[-1]["per_rank_samples"]
    assert len(last) == 3 and last[1] == 0 and last[2] > 0, last  # rank 1 stays dead, rank 2 trains
    print(f"rejoin at epoch {change['epoch'] + 1}: accuracy {result['accuracy']:.4f}; re-form round -> re-formed "
          f"world training {reform_seconds(tmp_path / 'run'):.1f} s")
