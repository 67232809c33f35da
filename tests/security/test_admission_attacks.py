"""Issue 15, findings 1 and 6: who may tell an agent what to run, and who may read the model.

Each test performs the attack against real sockets (and, where a process
would run, a real agent process or spawn) and asserts it fails:

- a fake controller answering an agent's hello chooses the program (`-c
  CODE`) or the environment (`PYTHONPATH` with a `sitecustomize`): the code
  would create a marker file; the marker must not exist;
- open admission without CURVE is refused by name, on both sides;
- a CURVE client that was not admitted cannot subscribe to the controller's
  PUB, while an admitted agent's key can.

Every wait is bounded (short reply and silence timeouts, polls with limits).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from flodl_zmq.agent import Agent
from flodl_zmq.agent_rules import AgentConfig
from flodl_zmq.controller import ControllerOptions, query_status
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import SpawnSpec
from flodl_zmq.errors import ConfigError, MembershipError, WireError
from flodl_zmq.join import JoinConfig, JoinWindow
from flodl_zmq.membership import MembershipService
from flodl_zmq.security import CurveKeys, apply_client, apply_server, start_gate
from flodl_zmq.trust import JOIN_RUN_ID, OPEN_JOIN_KEY, TrustMode
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import Challenge, JoinAccept, JoinHeartbeat, WorldFormed

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = bytes(range(16))
BEAT_S, SILENCE_S = 0.1, 2.0  # the join link's timings, the same two numbers on both sides
CONTROLLER_FAST = {"join_heartbeat_period_s": BEAT_S, "host_silence_at_controller_s": SILENCE_S}
AGENT_FAST = {"join_heartbeat_period_s": BEAT_S, "controller_silence_at_agent_s": SILENCE_S}

pytestmark = pytest.mark.timeout(60)



class FakeController:
    """Answers the first hello it gets with an accept and a formed world of its choosing, then heartbeats.

    `key`: the pre-shared key it holds (None: it plays open admission with
    the all-zero key); `curve`: CURVE server keys of its own (an impostor's).
    """

    def __init__(self, ctx: zmq.Context, argv: tuple[str, ...], env: dict[str, str], *,
                 key: bytes | None = None, curve: CurveKeys | None = None):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            apply_server(self.sock, curve)
        self.sock.bind("tcp://127.0.0.1:*")
        port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.address = ControllerAddress("127.0.0.1", port - 3)  # the join endpoint is PORT+3
        self.session_key = key or new_key()
        self.join = Codec(key or OPEN_JOIN_KEY, JOIN_RUN_ID, "membership")
        self.session = Codec(self.session_key, RUN_ID, "membership")
        self.argv, self.env = argv, env
        self.answered = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _echo(self, frames: list[bytes], field: str) -> bytes:
        """The nonce the agent's message carries, if this controller's key can read it."""
        try:
            return getattr(self.join.decode(frames[1:], Channel.JOIN, replay=False).record, field)
        except (WireError, AttributeError):
            return bytes(16)

    def _run(self) -> None:
        ident = None
        challenged = False
        deadline = time.monotonic() + 30
        while not self._stop.is_set() and time.monotonic() < deadline:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                if not challenged:
                    challenged = True  # it plays the challenge exchange as well as it can
                    challenge = Challenge(self._echo(frames, "nonce"), bytes(16), 30.0)
                    self.sock.send_multipart([frames[0], *self.join.encode(challenge, channel=Channel.JOIN)])
                elif ident is None:
                    ident = frames[0]  # the hello's content does not matter: answering is all the attack takes
                    accept = JoinAccept([0], self.session_key if self.join.key == OPEN_JOIN_KEY else None,
                                        5.0, RUN_ID, RUN_ID, self._echo(frames, "nonce"), bytes(32))
                    self.sock.send_multipart([ident, *self.join.encode(accept, channel=Channel.JOIN)])
                    spawn = SpawnSpec(self.argv, self.env, world={"victim": (0,)})
                    formed = WorldFormed(1, spawn.to_json(), RUN_ID, b"")
                    self.sock.send_multipart([ident, *self.session.encode(formed, channel=Channel.JOIN)])
                    self.answered.set()
            if ident is not None:
                self.sock.send_multipart([ident, *self.session.encode(JoinHeartbeat(), channel=Channel.JOIN)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def hostile_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('pwned')"


def victim(ctx: zmq.Context, address: ControllerAddress, **cfg) -> Agent:
    config = AgentConfig(address, "victim", ("cpu:0",), join_reply_timeout_s=cfg.pop("join_reply_timeout_s", 10.0),
                         kill_grace_s=1.0, **AGENT_FAST, **cfg)
    return Agent(config, context=ctx, out=io.StringIO())


def run_agent(agent: Agent) -> None:
    try:
        agent.run()
    finally:
        agent.close()


# ---------------------------------------------------------------------------- finding 1: what an agent runs


def test_a_fake_controller_cannot_make_an_open_admission_agent_without_curve_run_code(ctx, tmp_path):
    marker = tmp_path / "pwned"
    fake = FakeController(ctx, ("-c", hostile_code(marker)), {})
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
        done = subprocess.run(
            [sys.executable, "-m", "flodl_zmq.cli", "agent", "--controller", str(fake.address), "--host", "victim",
             "--cpu-slots", "1", "--join-timeout", "5", "--controller-silence", "2", "--script", "-m flodl_zmq.demo"],
            env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=40, check=False, cwd=ROOT,
        )
    finally:
        fake.close()
    assert not marker.exists(), "the fake controller's code ran on the agent's host"
    assert done.returncode == 2, done.stderr
    assert "open admission without CURVE refused" in done.stderr and "FLODL_CURVE_SERVER" in done.stderr


def test_a_fake_controller_without_the_pinned_curve_key_gets_no_answer_through(ctx, tmp_path):
    marker = tmp_path / "pwned"
    impostor = CurveKeys(*zmq.curve_keypair())
    real_public, _ = zmq.curve_keypair()
    fake = FakeController(ctx, ("-c", hostile_code(marker)), {}, curve=impostor)
    agent = victim(ctx, fake.address, curve=CurveKeys.for_client({"FLODL_CURVE_SERVER": real_public.decode()}),
                   script=("train.py",), join_reply_timeout_s=1.5)
    try:
        with pytest.raises(MembershipError, match="no reply"):
            run_agent(agent)
    finally:
        fake.close()
    assert not fake.answered.is_set()  # the handshake never completed: our hello never reached it
    assert not marker.exists()


def test_a_key_holder_posing_as_the_controller_cannot_make_an_agent_run_another_program(ctx, tmp_path):
    marker = tmp_path / "pwned"
    key = new_key()  # every worker holds it: a compromised worker can answer another's hello
    fake = FakeController(ctx, ("-c", hostile_code(marker)), {}, key=key)
    agent = victim(ctx, fake.address, key=key, script=("-m", "flodl_zmq.demo"))
    try:
        with pytest.raises(MembershipError, match="run refused.*-c.*runs only '-m flodl_zmq.demo'"):
            run_agent(agent)
    finally:
        fake.close()
    assert fake.answered.is_set()
    assert not marker.exists()


@pytest.mark.parametrize("variable", ["PYTHONPATH", "LD_PRELOAD"])
def test_a_key_holder_cannot_smuggle_environment_into_the_agents_children(ctx, tmp_path, variable):
    marker = tmp_path / "pwned"
    # PYTHONPATH: a sitecustomize that every child would import before the script.
    (tmp_path / "sitecustomize.py").write_text(hostile_code(marker) + "\n")
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    key = new_key()
    value = str(tmp_path) if variable == "PYTHONPATH" else str(tmp_path / "evil.so")
    fake = FakeController(ctx, (str(script), "--epochs", "1"), {variable: value, "FLODL_SLOWDOWN": "1"}, key=key)
    agent = victim(ctx, fake.address, key=key, script=(str(script),))
    try:
        with pytest.raises(MembershipError, match=f"spawn environment sets \\['{variable}'\\]"):
            run_agent(agent)
    finally:
        fake.close()
    assert not marker.exists()


def test_an_agent_without_a_script_refuses_every_program(ctx, tmp_path):
    marker = tmp_path / "pwned"
    key = new_key()
    fake = FakeController(ctx, ("-c", hostile_code(marker)), {}, key=key)
    agent = victim(ctx, fake.address, key=key)
    try:
        with pytest.raises(MembershipError, match="not told what it may run.*--script"):
            run_agent(agent)
    finally:
        fake.close()
    assert not marker.exists()


def test_open_admission_without_curve_is_refused_by_name_on_the_controller(ctx):
    with pytest.raises(ConfigError, match="open admission without CURVE refused.*FLODL_CURVE_SERVER"):
        ControllerOptions(ControllerAddress("127.0.0.1", 7300), ("train.py",), JoinConfig(), open_admission=True)
    window = JoinWindow(JoinConfig(), opened_at=time.monotonic())
    with pytest.raises(ConfigError, match="open admission without CURVE refused"):
        MembershipService(window, endpoint="tcp://127.0.0.1:*", trust=TrustMode.OPEN, session_key=new_key(),
                          run_id=RUN_ID, incarnation=RUN_ID, spawn=SpawnSpec(("train.py",)), context=ctx)


def test_open_admission_without_curve_is_refused_by_the_controller_command():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    done = subprocess.run(
        [sys.executable, "-m", "flodl_zmq.cli", "controller", "--bind", "127.0.0.1:7390", "--open-admission",
         "--", "-m", "flodl_zmq.demo"],
        env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=30, check=False,
    )
    assert done.returncode == 2
    assert "open admission without CURVE refused" in done.stderr


# ---------------------------------------------------------------------------- finding 6: who reads the model


def received(sock: zmq.Socket, within_s: float) -> bytes | None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            return sock.recv()
    return None


def test_only_admitted_agents_keys_can_subscribe_to_the_controllers_pub(ctx):
    server = CurveKeys(*zmq.curve_keypair())
    gate, auth = start_gate(ctx, server)  # what `flodl-zmq controller` runs whenever CURVE is on
    window = JoinWindow(JoinConfig(min_ranks=2, target_ranks=2, join_window_s=30, join_cap_s=30), opened_at=time.monotonic())
    service = MembershipService(
        window, endpoint="tcp://127.0.0.1:*", trust=TrustMode.OPEN, session_key=new_key(), run_id=RUN_ID, incarnation=RUN_ID,
        spawn=SpawnSpec(("train.py",)), context=ctx, curve=server, gate=gate, **CONTROLLER_FAST,
    )
    service.start()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    apply_server(pub, server)  # as the reducer's consensus PUB
    pub_endpoint = "tcp://127.0.0.1:*"
    pub.bind(pub_endpoint)
    pub_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    port = int(service.endpoint.rsplit(":", 1)[1])
    address = ControllerAddress("127.0.0.1", port - 3)
    pinned = {"FLODL_CURVE_SERVER": server.public.decode()}
    agent = Agent(AgentConfig(address, "a", ("cpu:0",), curve=CurveKeys.for_client(pinned), script=("train.py",),
                              join_reply_timeout_s=10.0, **AGENT_FAST), context=ctx, out=io.StringIO())
    stranger_keys = CurveKeys.for_client(pinned)  # knows the public key, as everyone may
    subs: list[zmq.Socket] = []
    joining: threading.Thread | None = None
    try:
        # The agent joins (the window waits for a second one, so nothing is spawned).
        def join() -> None:
            try:
                agent.join()
            except MembershipError:
                pass  # stopped at the end of the test

        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        deadline = time.monotonic() + 10
        while not gate.admitted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gate.admitted == {agent.config.curve.public}
        # A stranger may still knock on the join socket (a host must be able to ask) ...
        assert query_status(address, None, curve=stranger_keys, context=ctx, status_reply_timeout_s=5)["joined_ranks"] == 1
        # ... but not subscribe to the model.
        for keys in (agent.config.curve, stranger_keys):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            apply_client(sub, keys)
            sub.connect(pub_endpoint)
            subs.append(sub)
        admitted_sub, stranger_sub = subs
        deadline = time.monotonic() + 5
        got = None
        while got is None and time.monotonic() < deadline:
            pub.send(b"consensus")
            got = received(admitted_sub, 0.1)
        assert got == b"consensus", "the admitted agent's key could not subscribe"
        for _ in range(10):
            pub.send(b"consensus")
        assert received(stranger_sub, 1.5) is None, "a key that was never admitted read the model"
    finally:
        for sub in subs:
            sub.close(0)
        pub.close(0)
        agent.stop("test over")
        if joining is not None:
            joining.join(5)
        service.close()
        agent.close()
        auth.stop()
