"""A controller that comes back: periodic checkpoints, and a killed controller restarted from the newest.

Real processes: the launcher's `Cluster` (2 hosts x 1 rank, tcp loopback,
`digits_job.py` as in test_training.py), and `flodl-zmq controller` with two
agents of one CPU slot each in network namespaces (the compose harness of
test_multihost.py). Every rank is a process importing torch, and what these
tests check (restarts, coverage, accuracy at RELIABLE_ACCURACY, which
digits_job.py states for 2 ranks too) needs no more than two. The
checkpoint directory and its timings are the controller's settings
(FLODL_CHECKPOINT_*).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flodl_zmq import bundle, checkpoints
from flodl_zmq.launch import Cluster
from flodl_zmq.wire import new_key
from tests.cluster.digits_job import RELIABLE_ACCURACY, held, samples_per_epoch
from tests.cluster.netns import network_or_skip
from tests.cluster.test_multihost import Compose, agent_argv, controller_argv, result_of, without
from tests.cluster.test_training import Run

JOB = str(Path(__file__).with_name("digits_job.py"))
SAMPLES_16 = samples_per_epoch(16)

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="process groups, ipc")]


def cluster(args: list[str], controller_env: dict[str, str], **kw) -> Cluster:
    """Two hosts of one rank each: what the checkpoint tests read needs no more processes."""
    return Cluster(argv=[JOB, *args], hosts=2, ranks_per_host=1, env_for={"controller": controller_env},
                   grace_s=3.0, **kw)


def finish(c: Cluster, timeout: float = 120.0) -> tuple[int, dict | None, str]:
    try:
        code = c.wait(timeout)
    finally:
        c.shutdown()
    out = c.output()
    lines = [ln for ln in out.splitlines() if ln.startswith("[controller] RESULT ")]
    return code, json.loads(lines[-1][len("[controller] RESULT "):]) if lines else None, out


def test_periodic_checkpoints_keep_the_last_k_and_name_the_run_and_world(tmp_path, warm):
    c = cluster(["--epochs", "4", "--batch-size", "16"], {
        "FLODL_CHECKPOINT_DIR": str(tmp_path), "FLODL_CHECKPOINT_EVERY_ROUNDS": "5", "FLODL_CHECKPOINT_KEEP": "2",
    }, warm=warm)
    c.start()
    code, result, out = finish(c)
    assert code == 0, out
    kept = checkpoints.complete(tmp_path)
    assert len(kept) == 2, (kept, out)
    state, meta = bundle.load(kept[-1])
    assert meta["run_id"] == c.run_id.hex() and meta["world"] == {"h0": [0], "h1": [1]}
    assert meta["reason"] == "checkpoint" and meta["coordinator"]["round"] >= 1 and state
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_full_checkpoint_disk_is_reported_with_the_path_and_the_run_completes(tmp_path, warm):
    small = tmp_path / "small"
    small.mkdir()
    # mode=0700: a tmpfs root is 1777 by default, a checkpoint directory others may write in (refused).
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=0700", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        c = cluster(["--epochs", "3", "--batch-size", "16"], {
            "FLODL_CHECKPOINT_DIR": str(small), "FLODL_CHECKPOINT_EVERY_ROUNDS": "5",
        }, warm=warm)
        c.start()
        code, result, out = finish(c)
        assert code == 0, out  # the model (69 KB) never fits: every write fails, the run does not
        assert f"could not write {small}/ckpt-r" in out and "No space left on device" in out, out
        assert result["accuracy"] is not None and len(result["epochs"]) == 3
        assert os.listdir(small) == [checkpoints.COMPLETED]  # no partial checkpoint; the run's completion marked
    finally:
        subprocess.run(["umount", str(small)], check=True)


# ---------------------------------------------------------------------------- restart

ARGS = ["--mode", "cpu-cadence", "--epochs", "15", "--batch-size", "16", "--step-ms", "4"]
EPOCHS = 15
TWICE = pytest.mark.timeout(300)  # a cohort started twice on two shared cores


def reliably_accurate(result: dict) -> None:
    # What the job reliably reaches undisturbed (tests/cluster/digits_job.py), rather than a point
    # under one undisturbed run: single runs of this world spread 2 points at 8 epochs (0.961 to
    # 0.981 seen), so that comparison failed with nothing wrong. Where the resumed run starts is
    # checked exactly (the checkpoint's epoch and coverage), and a lost or corrupt state costs more.
    assert result["accuracy"] >= RELIABLE_ACCURACY, result["accuracy"]


def covered(meta: dict, epoch: int) -> int:
    return sum(n for _, n in meta["coordinator"]["coverage"].get(str(epoch), []))


@TWICE
@pytest.mark.parametrize("when", ["mid-epoch", "during-eval"])
def test_a_sigkilled_controller_is_restarted_from_the_newest_checkpoint_and_the_run_completes(
    tmp_path, monkeypatch, when, warm
):
    monkeypatch.setenv("FLODL_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("FLODL_CHECKPOINT_EVERY_ROUNDS", "4")
    monkeypatch.setenv("FLODL_CHECKPOINT_KEEP", "100")  # the resumed one stays readable for the checks
    monkeypatch.setenv("FLODL_RUN_DIR", str(tmp_path / "run"))
    # Slow evals up to the kill (epoch 3's), at full speed after it. Held from epoch 5 on until the
    # kill: it lands in epoch 3 whatever this machine's speed, while the ranks train.
    gate = tmp_path / "gate"
    args = [*ARGS, *held(gate, after_epochs=5, epochs=EPOCHS, ranks=2)]
    if when == "during-eval":
        args += ["--eval-ms", "1500", "--slow-evals", "4"]
    w = Run(*args, ranks_per_host=1, warm=warm).start()
    try:
        w.wait_for("[controller] epoch 3/", timeout=90.0)
        if when == "mid-epoch":
            time.sleep(1.0)  # rounds go on all epoch long: the kill lands in or between rounds
        else:
            time.sleep(0.3)  # the eval of epoch 3 (1.5 s) has just been dispatched
        stem = checkpoints.newest(tmp_path)
        assert stem is not None, "an epoch end wrote a checkpoint"
        w.cluster.kill("controller")
        gate.touch()
        code, result, out = finish(w.cluster)
    finally:
        w.cluster.shutdown()
    assert code == 0, out
    assert "the controller was killed by SIGKILL" in out and len(w.cluster.restarts) == 1, out
    resumed, took = w.cluster.restarts[0]
    assert Path(resumed) >= stem, (resumed, stem)  # the newest at the kill (or one written just before)
    _, meta = bundle.load(resumed)
    first = meta["epoch"]
    assert f"resumed from {resumed}: epoch {first + 1}" in out and "controller incarnation 2" in out, out
    # Every epoch exactly once: the resumed epoch trains what its checkpoint lacked, later ones whole.
    epochs = result["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(first, EPOCHS)), epochs
    assert epochs[0]["samples"] + covered(meta, first) == SAMPLES_16, (epochs[0], meta["coordinator"]["coverage"])
    assert all(e["samples"] == SAMPLES_16 for e in epochs[1:]), epochs
    # The run log says where the second incarnation starts: its rounds follow the checkpoint's round,
    # which the first incarnation's lines may have passed (those rounds are trained again).
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    kinds = [e["kind"] for e in events]
    assert kinds.count("restart") == 1 and kinds.count("start") == 2, kinds
    at = kinds.index("restart")
    restart = events[at]
    assert (Path(restart["checkpoint"]), restart["epoch"], restart["incarnation"]) == (Path(resumed), first, 2), restart
    assert kinds[at + 1] == "start" and kinds.index("start") < at, kinds
    rounds = [e["round"] for e in events[at:] if e["kind"] == "round"]
    assert rounds[0] == restart["round"] + 1, (restart, rounds[:3])
    print(f"restart ({when}): accuracy {result['accuracy']:.4f}; relaunch {took:.2f} s")
    reliably_accurate(result)


# ---------------------------------------------------------------------------- hosts: agents re-dial

HOSTS_JOB = ARGS


@pytest.fixture(scope="module")
def net():
    with network_or_skip("controller", "worker1", "worker2") as n:
        yield n


@pytest.fixture
def hosts(net, tmp_path, monkeypatch):
    with Compose.running(net, tmp_path, monkeypatch) as c:
        yield c


def start_run(c: Compose, ckpt: Path, key: str, grace_s: float) -> None:
    """The controller (pre-shared key, checkpoints, --resume auto) on host `controller`, and two agents of one
    CPU slot re-dialling it for `grace_s`; its ranks held from epoch 3 on until `kill_controller` (the run
    cannot end before the kill)."""
    c.up("controller", env={"FLODL_KEY": key}, argv=controller_argv(
        c, program=[JOB, *HOSTS_JOB, *held(gate_of(ckpt), after_epochs=3, epochs=EPOCHS, ranks=2)],
        extra=["--checkpoint-dir", str(ckpt), "--checkpoint-every-rounds", "4", "--checkpoint-keep", "100",
               "--resume", "auto", "--min-ranks", "2", "--target-ranks", "2"]))
    env = {"FLODL_KEY": key, "FLODL_CONTROLLER_SILENCE": "3"}
    # One CPU slot each: one rank per host shows what these tests check.
    c.up("worker1", env=env, argv=without(ckpt, agent_argv(c, "worker1", JOB, cpu_slots=1, grace_s=grace_s)))
    c.wait_for("controller", "admitted 'worker1'")
    c.up("worker2", env=env, argv=without(ckpt, agent_argv(c, "worker2", JOB, cpu_slots=1, grace_s=grace_s)))


def gate_of(ckpt: Path) -> Path:
    return ckpt.with_name("gate")


def kill_controller(c: Compose, ckpt: Path, how: signal.Signals = signal.SIGKILL) -> int:
    """Stop the controller with `how` once it trains; its exit status."""
    c.wait_for("controller", "epoch 2/")
    os.killpg(c.procs["controller"].pid, how)
    code = c.procs["controller"].wait(10)
    gate_of(ckpt).touch()
    return code


# What Compose (restart: on-failure) and Kubernetes (a Job, restartPolicy OnFailure) do: the compose
# file's controller command, its checkpoints in its volume, killed and started again as it is. Four
# epochs on two ranks held from the second (digits_job.held) until the kill: checkpoints at every
# epoch end (the command's default) give one to resume from, and the run cannot end before the kill.
ORCHESTRATED_EPOCHS = 4


@TWICE
def test_the_compose_controller_command_killed_and_started_again_resumes_completes_and_then_stays_complete(
    hosts, tmp_path
):
    gate = tmp_path / "gate"
    program = [JOB, "--epochs", str(ORCHESTRATED_EPOCHS), "--batch-size", "16",
               *held(gate, after_epochs=1, epochs=ORCHESTRATED_EPOCHS, ranks=2)]
    # The compose file's command and environment (its key, its volume), its program swapped for the held
    # job, its world for one rank per worker, and every checkpoint kept (the resumed one is read below).
    command = controller_argv(hosts, program=program, extra=["--min-ranks", "2", "--target-ranks", "2",
                                                             "--checkpoint-keep", "100"])
    assert {"--checkpoint-dir", "--resume"} <= set(command)
    volume = hosts.volume("controller", "/runs")
    hosts.up("controller", argv=command)
    env = {"FLODL_CONTROLLER_SILENCE": "3"}  # the agents notice the kill within seconds
    for worker in ("worker1", "worker2"):
        # The workers do not share the controller's volume: their ranks get the model over the wire.
        hosts.up(worker, env=env, argv=without(volume, agent_argv(hosts, worker, JOB, cpu_slots=1)))
        hosts.wait_for("controller", f"admitted {worker!r}")
    hosts.wait_for("controller", "checkpoint: wrote")
    os.killpg(hosts.procs["controller"].pid, signal.SIGKILL)
    hosts.procs["controller"].wait(10)
    gate.touch()

    hosts.up("controller2", host="controller", service="controller", argv=command)  # the same command again
    assert hosts.wait("controller2", 200) == 0, hosts.tails()
    log = hosts.log("controller2")
    stem = log.split("resuming run ", 1)[1].split(" from ", 1)[1].split(":", 1)[0]
    meta = bundle.load_meta(stem)
    assert Path(stem).parent == volume / "ckpt", stem
    for worker, ranks in (("worker1", [0]), ("worker2", [1])):
        assert f"taken back by the restarted controller with ranks {ranks}" in hosts.log(worker), hosts.tails()
        assert hosts.wait(worker) == 0, hosts.tails()
    # Every epoch exactly once: the resumed epoch trains what its checkpoint lacked, later ones whole.
    first, epochs = meta["epoch"], result_of(log, "RESULT ")["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(first, ORCHESTRATED_EPOCHS)), epochs
    assert epochs[0]["samples"] + covered(meta, first) == SAMPLES_16, (epochs[0], meta["coordinator"]["coverage"])
    assert all(e["samples"] == SAMPLES_16 for e in epochs[1:]), epochs

    # Started once more after the end (`docker compose up` again, a pod restarted late): nothing trains.
    hosts.up("controller3", host="controller", service="controller", argv=command)
    assert hosts.wait("controller3", 60) == 0, hosts.tails()
    assert "is complete" in hosts.log("controller3") and "nothing was started" in hosts.log("controller3")
    assert "join window open" not in hosts.log("controller3")


@TWICE
def test_a_controller_terminated_under_resume_auto_leaves_the_agents_waiting_until_the_grace_period_ends(
    hosts, tmp_path
):
    # SIGTERM is how Kubernetes and Compose move a container: under --resume auto it is not the run's end,
    # so the agents are not aborted (they would exit naming the abort) but wait for a restarted controller.
    ckpt = tmp_path / "ckpt"
    start_run(hosts, ckpt, new_key().hex(), grace_s=4)
    assert kill_controller(hosts, ckpt, signal.SIGTERM) == 143, hosts.tails()
    assert "exiting without ending the run" in hosts.log("controller"), hosts.tails()
    for worker in ("worker1", "worker2"):
        assert hosts.wait(worker, 60) != 0
        assert "did not come back within the grace period of 4 s" in hosts.log(worker), hosts.tails()
