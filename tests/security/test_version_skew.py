"""Version skew at the join: a genuine peer of another protocol version is refused by name, at once, on both sides.

The MAC labels name the protocol version (`flodl-zmq/<v>/mac`), so a peer of
another version used to fail every MAC check: the controller dropped its
hello as a stranger's, and the agent waited out its reply timeout with a
message blaming the key. A receiver now checks the MAC of such a message
under the labels of the version its header claims (PROTOCOL.md 12): a peer
holding the key is told "version skew", naming both versions and the fix,
and a stranger still gets nothing (tests/security/test_join_replay.py).
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from flodl_zmq.agent import Agent
from flodl_zmq.agent_rules import AgentConfig
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import SpawnSpec
from flodl_zmq.errors import MembershipError
from flodl_zmq.join import JoinConfig, JoinWindow
from flodl_zmq.membership import MembershipService
from flodl_zmq.trust import TrustMode
from flodl_zmq.wire import PROTOCOL_VERSION, Channel, Codec, new_key
from flodl_zmq.wire import mac as mac_module
from flodl_zmq.wire.mac import compute_mac
from flodl_zmq.wire.records import JoinReject

pytestmark = pytest.mark.timeout(60)

OTHER = PROTOCOL_VERSION + 1
REPLY_TIMEOUT_S = 30.0  # an agent that hears nothing says "no reply" only after this: far past the test's bounds

# An agent built from another protocol version: the same code, its version constants patched.
OTHER_AGENT = """
import io, sys
import zmq
from flodl_zmq.wire import codec, mac
codec.PROTOCOL_VERSION = mac.LABEL_VERSION = int(sys.argv[1])
import flodl_zmq.agent as agent_module
agent_module.PROTOCOL_VERSION = codec.PROTOCOL_VERSION
from flodl_zmq.agent import Agent
from flodl_zmq.agent_rules import AgentConfig
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.errors import MembershipError
config = AgentConfig(ControllerAddress("127.0.0.1", int(sys.argv[2])), "future", ("cpu:0",),
                     key=bytes.fromhex(sys.argv[3]), join_reply_timeout_s=float(sys.argv[4]),
                     join_heartbeat_period_s=0.1, controller_silence_at_agent_s=5.0, kill_grace_s=1.0)
try:
    Agent(config, context=zmq.Context(), out=io.StringIO()).join()
except MembershipError as exc:
    print(exc, flush=True)
    sys.exit(3)
sys.exit(0)
"""


def test_labels_name_this_builds_protocol_version():
    assert mac_module.LABEL_VERSION == PROTOCOL_VERSION
    assert mac_module.label("mac") == f"flodl-zmq/{PROTOCOL_VERSION}/mac".encode() + b"\0"


def test_an_agent_of_another_version_and_the_controller_both_name_the_skew(ctx, caplog):
    key = new_key()
    window = JoinWindow(JoinConfig(min_ranks=2, join_window_s=30.0, join_cap_s=30.0), opened_at=time.monotonic())
    svc = MembershipService(
        window, endpoint="tcp://127.0.0.1:*", trust=TrustMode.PRE_SHARED, session_key=key,
        run_id=os.urandom(16), incarnation=os.urandom(16), spawn=SpawnSpec(("-c", "pass"), {}), context=ctx, join_heartbeat_period_s=0.1, host_silence_at_controller_s=60.0,
    )
    svc.start()
    try:
        port = int(svc.endpoint.rsplit(":", 1)[1]) - 3
        caplog.set_level(logging.WARNING, logger="flodl_zmq.membership")
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", OTHER_AGENT, str(OTHER), str(port), key.hex(), str(REPLY_TIMEOUT_S)],
            capture_output=True, text=True, timeout=REPLY_TIMEOUT_S + 20, env=os.environ,
        )
        took = time.monotonic() - started
        # The agent's side: refused by name (both versions and the fix), not a silent timeout.
        assert done.returncode == 3, done.stderr
        assert f"peer speaks protocol version {PROTOCOL_VERSION}, this build speaks {OTHER}" in done.stdout
        assert "run the same flodl-zmq version on every host" in done.stdout
        assert took < REPLY_TIMEOUT_S, "the agent learned of the skew only by timing out"
        # The controller's side: the log names the skew; nobody was admitted, nothing counted as junk.
        skew = [r.getMessage() for r in caplog.records if "protocol version skew" in r.getMessage()]
        assert skew and f"peer speaks protocol version {OTHER}, this build speaks {PROTOCOL_VERSION}" in skew[0]
        assert not svc.window.members and svc.dropped == 0
    finally:
        svc.close()


def test_an_agent_told_by_a_controller_of_another_version_names_both(ctx):
    key = new_key()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1") - 3
    config = AgentConfig(ControllerAddress("127.0.0.1", port), "worker", ("cpu:0",), key=key,
                         join_reply_timeout_s=REPLY_TIMEOUT_S, join_heartbeat_period_s=0.1, controller_silence_at_agent_s=5.0, kill_grace_s=1.0)
    agent = Agent(config, context=ctx, out=io.StringIO())
    result: list[BaseException] = []
    t = threading.Thread(target=lambda: _join(agent, result), daemon=True)
    t.start()
    try:
        assert router.poll(10_000), "the agent never asked for a challenge"
        ident, *_ = router.recv_multipart()
        # The controller of another version refuses it, signed as that version signs.
        header, *_ = Codec(key, bytes(16), "membership").encode(JoinReject("skew", b""), channel=Channel.JOIN)
        head = msgpack.unpackb(header)
        head["v"] = OTHER
        header = msgpack.packb(head, use_bin_type=True)
        router.send_multipart([ident, header, compute_mac(key, header, [], version=OTHER)])
        t.join(10)
        assert not t.is_alive(), "the agent did not act on the controller's refusal"
        assert isinstance(result[0], MembershipError)
        assert f"peer speaks protocol version {OTHER}, this build speaks {PROTOCOL_VERSION}" in str(result[0])
    finally:
        agent.close()
        router.close()


def _join(agent: Agent, out: list[BaseException]) -> None:
    try:
        agent.join()
    except BaseException as exc:  # handed to the test thread
        out.append(exc)
