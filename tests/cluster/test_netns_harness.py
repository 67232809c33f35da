"""The namespace harness itself: names resolve, ZeroMQ crosses the veth, a cut link cuts it.

(No `ping` binary here: reachability is proved with TCP and ZeroMQ instead.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cluster.netns import network_or_skip, read_compose

ROOT = Path(__file__).resolve().parents[2]

REP = textwrap.dedent(
    """
    import zmq
    s = zmq.Context().socket(zmq.REP)
    s.bind("tcp://*:7410")
    print("ready", flush=True)
    while True:
        s.send(b"pong:" + s.recv())
    """
)

REQ = textwrap.dedent(
    """
    import socket, sys, zmq
    print(socket.gethostbyname("beta"))
    s = zmq.Context().socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect("tcp://beta:7410")
    s.send(b"ping")
    if not s.poll(int(float(sys.argv[1]) * 1000)):
        sys.exit(3)
    print(s.recv().decode())
    """
)


@pytest.fixture(scope="module")
def net():
    with network_or_skip("alpha", "beta") as n:
        yield n


def test_hosts_resolve_each_other_by_service_name(net):
    done = net.run("alpha", [sys.executable, "-c", "import socket; print(socket.gethostbyname('beta'))"])
    assert done.stdout.strip() == net.hosts["beta"].address == "10.231.0.3"


def test_zmq_crosses_the_veth_and_a_cut_link_stops_it(net):
    server = net.popen("beta", [sys.executable, "-c", REP], stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    done = net.run("alpha", [sys.executable, "-c", REQ, "10"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["10.231.0.3", "pong:ping"]
    net.cut("beta")
    try:
        cut = net.run("alpha", [sys.executable, "-c", REQ, "1.5"])
        assert cut.returncode == 3, cut.stdout + cut.stderr
    finally:
        net.restore("beta")
    again = net.run("alpha", [sys.executable, "-c", REQ, "10"])
    assert again.stdout.split()[-1] == "pong:ping"


def test_the_compose_file_reads_as_a_controller_and_two_workers_with_authenticated_admission(monkeypatch):
    monkeypatch.setenv("FLODL_KEY", "k" * 64)
    monkeypatch.delenv("FLODL_CURVE_SECRET", raising=False)
    with pytest.raises(ValueError, match="FLODL_CURVE_SECRET is required"):
        read_compose(ROOT / "docker-compose.yml")
    monkeypatch.setenv("FLODL_CURVE_SECRET", "s" * 40)
    monkeypatch.setenv("FLODL_CURVE_SERVER", "p" * 40)
    services = read_compose(ROOT / "docker-compose.yml")
    assert services[0].name == "controller"
    assert services[0].command[:2] == ("flodl-zmq", "controller")
    # A pre-shared key (a restarted controller takes its agents back under it) and CURVE.
    assert services[0].environment["FLODL_KEY"] == "k" * 64
    assert services[0].environment["FLODL_CURVE_SECRET"] == "s" * 40
    workers = services[1:]
    assert len(workers) == 2
    for w in workers:
        assert w.command[:2] == ("flodl-zmq", "agent")
        assert "controller:7300" in w.command
        assert w.command[w.command.index("--script") + 1] == "-m flodl_zmq.demo"
        # The session key and the pinned controller key, never the controller's secret.
        assert w.environment == {"FLODL_KEY": "k" * 64, "FLODL_CURVE_SERVER": "p" * 40}
        assert w.depends_on == ("controller",)
