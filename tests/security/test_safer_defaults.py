"""Issue 27 item 6: the defaults a user copies are the safe ones, and the model is read only with the run's keys.

Findings: without CURVE anyone who connects to the PUB reads the consensus,
and the multi-host examples (the README's, docker-compose.yml) ran with
CURVE off or without `--max-ranks` (a stranger's hellos with 256 devices
each were all accepted pending); `launch` printed the session key it
generated. Here: the shipped command lines, parsed by flodl-zmq's own parser,
run with CURVE and a rank cap; `launch`'s output holds no key; a PUB under
CURVE serves an admitted key and refuses a stranger's in the handshake.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
import zmq
from transport.dataplane_helpers import ROUTE_SECRET
from zmq.utils.monitor import recv_monitor_message

from flodl_zmq.cli import build_parser
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.launch import Cluster, free_port_base
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.security import SECRET_ENV, SERVER_ENV, CurveKeys, apply_client, start_gate
from flodl_zmq.wire import Channel, new_key

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 10.0


def parsed(words: list[str]):
    assert words[0] == "flodl-zmq", words
    return build_parser().parse_args(words[1:])


def assert_safe_controller(args, env: dict[str, str], where: str) -> None:
    given = vars(args)  # the parser leaves out what the command line does not set
    assert given["command"] == "controller", where
    assert given.get("max_ranks"), f"{where}: the controller runs without --max-ranks (no cap on strangers' ranks)"
    assert given["max_ranks"] >= given.get("target_ranks", 0), where
    assert given.get("curve_secret_file") or SECRET_ENV in env, f"{where}: the controller runs without CURVE"


# ---------------------------------------------------------------------------- the shipped command lines


def test_the_compose_file_runs_with_curve_and_a_rank_cap():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    controller = services.pop("controller")
    assert_safe_controller(parsed(shlex.split(controller["command"])), controller["environment"], "docker-compose.yml")
    assert services
    for name, worker in services.items():
        assert parsed(shlex.split(worker["command"])).command == "agent"
        assert SERVER_ENV in worker["environment"], f"docker-compose.yml: {name} does not pin the controller's key"


def readme_commands() -> dict[str, tuple[list[str], str]]:
    """The README's multi-host example: each `flodl-zmq` command (continuations joined) and its code block."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Multi-host"):]
    section = section[:section.index("\n## ", 1)]
    commands = {}
    for block in re.findall(r"(?:\n {4}[^\n]*)+", section):
        for command in re.findall(r"^ {4}(flodl-zmq (?:controller|agent)[^\n]*)", block.replace("\\\n", " "), re.M):
            words = shlex.split(command, comments=True)
            commands[words[1]] = (words, block)
    return commands


def test_the_readme_multi_host_example_runs_with_curve_and_a_rank_cap():
    commands = readme_commands()
    assert set(commands) == {"controller", "agent"}, commands
    words, block = commands["controller"]
    assert_safe_controller(parsed(words), {}, "README.md's multi-host controller")
    words, block = commands["agent"]
    assert vars(parsed(words)).get("curve_server_file") or f"export {SERVER_ENV}=" in block, "README.md's agent does not pin the controller's key"


def test_the_kubernetes_controller_runs_with_curve_and_a_rank_cap():
    docs = [d for p in sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    (job,) = [d for d in docs if d and d["kind"] == "Job" and d["metadata"]["name"] == "flodl-controller"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: "from a Secret" for e in container["env"]}
    assert_safe_controller(parsed(container["args"]), env, "deploy/kubernetes/controller.yaml")


# ---------------------------------------------------------------------------- launch's output


def test_launch_never_prints_the_key_it_generates(monkeypatch):
    monkeypatch.delenv("FLODL_KEY", raising=False)
    cluster = Cluster(argv=["-c", "pass"], hosts=1, ranks_per_host=1, grace_s=0.0)
    try:
        cluster.start()
        assert cluster.wait(WAIT_S * 3) == 0, cluster.output()
    finally:
        cluster.shutdown()
    out = cluster.output()
    assert cluster.key is not None and cluster.key.hex() not in out, "launch printed the run's session key"
    assert "[launch] controller at" in out and "export FLODL_KEY" in out, out  # and says how to watch instead


# ---------------------------------------------------------------------------- who reads the consensus


def handshake_outcome(sock: zmq.Socket, endpoint: str) -> int:
    """Connect `sock` to `endpoint`; the monitor event that ends its first CURVE handshake."""
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        sock.connect(endpoint)
        assert mon.poll(int(WAIT_S * 1000)), f"no handshake outcome on the connection to {endpoint}"
        return recv_monitor_message(mon)["event"]
    finally:
        sock.disable_monitor()
        mon.close(0)


def test_a_pub_under_curve_serves_an_admitted_key_and_refuses_a_strangers_in_the_handshake(ctx):
    server = CurveKeys(*zmq.curve_keypair())
    gate, auth = start_gate(ctx, server)  # what `flodl-zmq controller` runs whenever CURVE is on
    address = ControllerAddress("127.0.0.1", free_port_base())
    # The reducer's own PUB, as the controller binds it.
    reducer = ReducerService(ReducerConfig.for_controller({"a": (0,)}, new_key(), bytes(range(16)), address,
                                                          curve=server, route_secret=ROUTE_SECRET), ctx)
    pinned = {SERVER_ENV: server.public.decode()}
    member, stranger = CurveKeys.for_client(pinned), CurveKeys.for_client(pinned)  # both know the public key
    gate.admit(member.public, "a")  # what the membership does with an admitted agent's handshake key
    subs: list[zmq.Socket] = []
    try:
        reducer.start()
        for keys in (stranger, member):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            apply_client(sub, keys)
            subs.append(sub)
        stranger_sub, member_sub = subs
        bcast = address.endpoint(Channel.BROADCAST)
        assert handshake_outcome(stranger_sub, bcast) == zmq.EVENT_HANDSHAKE_FAILED_AUTH, (
            "a key that was never admitted subscribed to the consensus")
        assert handshake_outcome(member_sub, bcast) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        for sub in subs:
            sub.close(0)
        reducer.stop()
        auth.stop()
