"""docker-compose.yml as a three-host cluster, each service in its own network namespace.

The harness (tests/cluster/netns.py) reads the compose file and runs every
service's command and environment in its own namespace on a bridge, so
controller, agents, relays and ranks talk over real veth interfaces. Each
test is one cluster run with a few scenarios; the failure runs swap the
controller's program for tests/cluster/digits_job.py with a per-step sleep,
so training lasts long enough to break things in, and shorten the agent
silence timeout so a lost host is declared within seconds.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import yaml
import zmq

from flodl_zmq.wire import new_key
from tests.cluster.digits_job import held
from tests.cluster.netns import Logged, Network, Service, network_or_skip, read_compose

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent
JOB = str(Path(__file__).with_name("digits_job.py"))
WAIT_S = 60.0
# Failure runs: ~90 batches of 16 per epoch, each step sleeping 12 ms.
# Held (digits_job.held) from epoch 2 on until the test has seen what it waits for: no step delay
# is needed to outlast anything, and the fewest epochs the hold allows on 4 ranks keep the tail
# that one surviving rank trains alone short.
EPOCHS = 9
HELD_JOB = ["--epochs", str(EPOCHS), "--batch-size", "16"]
HOST_SILENCE_S = 3.0
AGENT_HEARTBEAT_S = 1.0  # AgentConfig.join_heartbeat_period_s
FAST_PATH_S = 2.0

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="network namespaces")]


@pytest.fixture(scope="module")
def net():
    with network_or_skip("controller", "worker1", "worker2", "intruder") as n:
        yield n


class Compose(Logged):
    """The compose file's services in the namespaces: start, watch logs, act, tear down."""

    def __init__(self, net: Network, logs: Path):
        super().__init__(net, logs)
        self.services = {s.name: s for s in read_compose(COMPOSE)}
        # A named volume is a directory of the test's: its mount point's paths in a command lead there.
        spec = yaml.safe_load(COMPOSE.read_text())["services"]
        self.mounts = {name: {target: logs / "volumes" / volume for volume, target in
                              (v.split(":")[:2] for v in spec[name].get("volumes", ()))} for name in spec}

    def volume(self, service: str, target: str) -> Path:
        """Where `service`'s volume mounted at `target` lies in this test."""
        return self.mounts[service][target]

    @classmethod
    def with_curve_keys(cls, net: Network, logs: Path, monkeypatch: pytest.MonkeyPatch) -> Compose:
        """The services with the compose file's keys (its `.env`) in the environment: the session key,
        the controller's CURVE secret, the agents' pinned public key."""
        public, secret = (k.decode() for k in zmq.curve_keypair())
        monkeypatch.setenv("FLODL_KEY", new_key().hex())
        monkeypatch.setenv("FLODL_CURVE_SECRET", secret)
        monkeypatch.setenv("FLODL_CURVE_SERVER", public)
        return cls(net, logs)

    @classmethod
    @contextlib.contextmanager
    def running(cls, net: Network, logs: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Compose]:
        """`with_curve_keys`; at the end every service stopped and every host's link up again."""
        c = cls.with_curve_keys(net, logs, monkeypatch)
        try:
            yield c
        finally:
            c.down()
            for host in net.hosts:
                net.restore(host)

    def up(self, name: str, *, host: str | None = None, service: str | None = None,
           argv: Sequence[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start `service` (default `name`) as `name` on `host` (default `name`), argv/env overridden."""
        svc: Service = self.services[service or name]
        command = [self._on_volumes(svc.name, a) for a in (argv if argv is not None else svc.command)]
        if command[0] == "flodl-zmq":  # the image's console script is this venv's
            command[0] = str(BIN / "flodl-zmq")
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **svc.environment, **(env or {})}
        for var in ("FLODL_KEY", "FLODL_CURVE_SECRET", "FLODL_CURVE_PUBLIC", "FLODL_CURVE_SERVER"):
            if var not in svc.environment and var not in (env or {}):
                environ.pop(var, None)
        return self.start(name, host or name, command, environ)

    def _on_volumes(self, service: str, arg: str) -> str:
        for target, directory in self.mounts[service].items():
            if arg == target or arg.startswith(target + "/"):
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                return str(directory) + arg[len(target):]
        return arg

    def status(self, host: str, env: dict[str, str] | None = None) -> dict:
        # A generous reply deadline: a controller busy re-forming on a loaded machine answers late, not never.
        done = self.net.run(host, [str(BIN / "flodl-zmq"), "status", "--controller", "controller:7300", "--json",
                                   "--timeout", "60"], env={**os.environ, **(env or {})})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def rank_pid(self, host: str, rank: int) -> int:
        """The pid of global rank `rank`'s process on agent `host`, from the agent's log (a rank forked
        from its warm interpreter shows that interpreter's environment in /proc)."""
        started = [ln for ln in self.log(host).splitlines() if "running relay (pid" in ln]
        assert started, self.log(host)
        return ast.literal_eval(started[-1].split(" + ranks ", 1)[1].split(" of a ", 1)[0])[rank]


@pytest.fixture
def compose(net, tmp_path, monkeypatch):
    with Compose.running(net, tmp_path, monkeypatch) as c:
        yield c


def controller_argv(compose: Compose, *, program: Sequence[str] | None = None, extra: Sequence[str] = ()) -> list[str]:
    """The compose file's controller command with its program (after `--`) swapped, `extra` flags after its own
    (a flag given twice: the later wins)."""
    command = list(compose.services["controller"].command)
    split = command.index("--")
    head, tail = command[:split], command[split + 1:]
    return [*head, *extra, "--", *(program if program is not None else tail)]


def agent_argv(compose: Compose, name: str, script: str, cpu_slots: int | None = None,
               grace_s: float | None = None) -> list[str]:
    """The compose file's command of worker `name`, agreeing to run `script` (its --script swapped),
    with `cpu_slots` for its --cpu-slots and `grace_s` for its --controller-grace if given."""
    command = list(compose.services[name].command)
    command[command.index("--script") + 1] = script
    for flag, value in (("--cpu-slots", cpu_slots), ("--controller-grace", grace_s)):
        if value is not None:
            command[command.index(flag) + 1] = str(value)
    return command


def without(directory: Path, agent: Sequence[str]) -> list[str]:
    """`agent` in a mount namespace of its own where `directory` is an empty tmpfs: a worker host that
    does not share the controller's filesystem, so its ranks must get their model over the wire."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [str(BIN / "flodl-zmq"), *agent[1:]] if agent[0] == "flodl-zmq" else list(agent)
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs hidden "$0" && exec "$@"', str(directory), *command]


def start_workers(compose: Compose, env: dict[str, str] | None = None, script: str = JOB) -> None:
    """worker1, admitted as ranks 0 and 1, then worker2 (ranks 2 and 3), each agreeing to run `script`."""
    compose.up("worker1", env=env, argv=agent_argv(compose, "worker1", script))
    compose.wait_for("controller", "admitted 'worker1'")
    compose.up("worker2", env=env, argv=agent_argv(compose, "worker2", script))


def result_of(log: str, tag: str) -> dict:
    line = next(ln for ln in log.splitlines() if ln.startswith(tag))
    return json.loads(line[len(tag):])


# ---------------------------------------------------------------------------- the compose file as it is


# The compose file's demo (15 epochs, 2 hosts x 2 ranks) under the default cpu-async: its epochs' evals
# reach 0.95-0.98. Its final eval dips below them in about 1 run of 15 (0.80 to 0.94 in 13 of ~195 launch
# runs, the landed tree's as this one's): the demo keeps a constant learning rate, and the run's last consensus
# can rest on a small trailing round of one or two ranks (docs/guide.md, "The last consensus"). So the
# median of the last three evals is held to 0.90, and the final one only to a trained model (chance: 0.1).
DEMO_ACCURACY = 0.900
DEMO_FINAL_FLOOR = 0.5


def test_compose_trains_digits_to_90_percent_and_refuses_bad_workers_by_name(compose):
    intruder_agent = [str(BIN / "flodl-zmq"), "agent", "--controller", "controller:7300", "--cpu-slots", "1",
                      "--join-timeout", "3", "--script", "-m flodl_zmq.demo"]
    compose.up("controller")
    compose.wait_for("controller", "join window open")
    # A worker with a key of its own: its hello fails the MAC and is dropped unanswered.
    wrong_key = compose.up("wrong-key", host="intruder", service="worker1",
                           argv=[*intruder_agent, "--host", "wrong-key"], env={"FLODL_KEY": new_key().hex()})
    # A worker of another protocol version.
    skew = compose.up("skew", host="intruder", service="worker1", argv=[
        sys.executable, "-c",
        "import sys, flodl_zmq.agent as a; a.PROTOCOL_VERSION = 99; from flodl_zmq.cli import main; "
        "sys.exit(main(sys.argv[1:]))", *intruder_agent[1:], "--host", "skew",
    ])
    compose.up("worker1")
    compose.wait_for("controller", "admitted 'worker1'")
    # A worker with other data (the first member set the run's dataset signature).
    other_data = compose.up("other-data", host="intruder", service="worker1",
                            argv=[*intruder_agent, "--host", "other-data", "--dataset-sig", "ab" * 32])
    for proc in (wrong_key, skew, other_data):
        assert proc.wait(WAIT_S) == 2
    compose.up("worker2")

    assert compose.wait("controller") == 0, compose.tails()
    for name in ("worker1", "worker2"):
        assert compose.wait(name) == 0, compose.tails()
    log = compose.log("controller")
    assert "world formed: {'worker1': (0, 1), 'worker2': (2, 3)}" in log
    result = result_of(log, "FLODL_DEMO_RESULT ")
    # An epoch whose eval was merged into a later one (its consensus was scored with that one's) has none.
    last_evals = [row["eval"] for row in result["epochs"] if "eval" in row][-3:]
    assert result["accuracy"] >= DEMO_FINAL_FLOOR, result
    assert len(last_evals) == 3 and sorted(last_evals)[1] >= DEMO_ACCURACY, result["epochs"]
    assert "join frame dropped without reply" in log
    assert "key differs" in compose.log("wrong-key")
    assert "REJECTED by the controller: protocol version skew: worker 'skew' speaks 99" in compose.log("skew")
    assert "REJECTED by the controller: dataset signature mismatch: worker 'other-data'" in compose.log("other-data")
    assert "[worker1:relay]" in compose.log("worker1")  # children's output forwarded with their prefix


# ---------------------------------------------------------------------------- failures


def test_with_curve_a_killed_rank_is_dead_within_2s_and_a_cut_host_after_the_silence_timeout(compose, net, tmp_path):
    key = new_key().hex()
    public, secret = (k.decode() for k in zmq.curve_keypair())
    client_env = {"FLODL_KEY": key, "FLODL_CURVE_SERVER": public}
    # The run must outlast the cut host's silence timeout: held from epoch 2 on (digits_job.held)
    # until the deaths are seen.
    gate = tmp_path / "gate"
    hold = held(gate, after_epochs=2, epochs=EPOCHS, ranks=4)
    compose.up("controller", env={"FLODL_KEY": key, "FLODL_CURVE_SECRET": secret}, argv=controller_argv(
        compose, program=[JOB, *HELD_JOB, *hold],
        extra=["--heartbeat-timeout", str(HOST_SILENCE_S)]))
    start_workers(compose, client_env)
    compose.wait_for("controller", "epoch 2/")

    before = compose.status("worker1", client_env)
    assert before["phase"] == "formed" and set(before["hosts"]) == {"worker1", "worker2"}
    assert before["training"]["started"] and before["training"]["alive"] == [0, 1, 2, 3]
    assert before["training"]["epoch"] >= 1 and before["training"]["last_round_at"] is not None

    # The reported-exit fast path: the agent sees its child die and tells the controller.
    pid = compose.rank_pid("worker1", 1)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    compose.wait_for("controller", "rank 1 declared dead")
    death = compose.status("worker1", client_env)["training"]["deaths"]["1"]
    assert "its agent on worker1 reported exit code -9" in death["reason"]
    assert death["at"] - killed_at < FAST_PATH_S

    # A cut link: the agent falls silent, its host's ranks are dead after the timeout.
    cut_at = time.time()
    net.cut("worker2")
    compose.wait_for("controller", lambda log: "rank 2 declared dead" in log and "rank 3 declared dead" in log)
    deaths = compose.status("worker1", client_env)["training"]["deaths"]
    for rank in ("2", "3"):
        assert "host worker2 lost" in deaths[rank]["reason"]
        # The silence clock runs from the agent's last heartbeat, up to one interval before the cut.
        assert deaths[rank]["at"] - cut_at >= HOST_SILENCE_S - AGENT_HEARTBEAT_S

    gate.touch()
    assert compose.wait("controller") == 0, compose.tails()
    result = result_of(compose.log("controller"), "RESULT ")
    assert len(result["epochs"]) == EPOCHS
    assert result["epochs"][-1]["per_rank_samples"][1:] == [0, 0, 0]  # rank 0 alone finished
    assert compose.wait("worker1") == 0  # a lost rank is not a host fault


def test_killing_every_process_of_one_host_leaves_the_other_to_finish(compose, net, tmp_path):
    # Held as above: a run that ended before the kill would leave nobody to declare dead.
    gate = tmp_path / "gate"
    hold = held(gate, after_epochs=2, epochs=EPOCHS, ranks=4)
    compose.up("controller", argv=controller_argv(compose, program=[JOB, *HELD_JOB, *hold],
                                                  extra=["--heartbeat-timeout", str(HOST_SILENCE_S)]))
    start_workers(compose)
    compose.wait_for("controller", "epoch 2/")
    net.kill_host_processes("worker2")
    compose.wait_for("controller", lambda log: "rank 2 declared dead" in log and "rank 3 declared dead" in log)

    gate.touch()
    assert compose.wait("controller") == 0, compose.tails()
    log = compose.log("controller")
    result = result_of(log, "RESULT ")
    assert len(result["epochs"]) == EPOCHS
    assert result["epochs"][-1]["per_rank_samples"][2:] == [0, 0]
    assert compose.wait("worker1") == 0
