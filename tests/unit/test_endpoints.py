"""Which sockets count as loopback-only, the send buffer they get (flodl_zmq.endpoints, links.tune_loopback),
and what a controller address that cannot be bound here is told (ControllerAddress.check_free)."""

from __future__ import annotations

import socket

import pytest
import zmq

from flodl_zmq.endpoints import ControllerAddress, is_loopback_endpoint
from flodl_zmq.errors import ConfigError
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import LOOPBACK_SNDBUF, tune_loopback

LOOPBACK = ["tcp://127.0.0.1:7302", "tcp://127.8.9.10:7302", "tcp://[::1]:7302", "tcp://localhost:7302"]
ELSEWHERE = [
    "tcp://10.0.0.5:7302",  # a LAN peer
    "tcp://*:7302",  # a wildcard also listens on the network
    "tcp://0.0.0.0:7302",
    "tcp://[::]:7302",
    "tcp://gpu-box.lan:7302",  # a name may resolve anywhere
    "ipc:///tmp/flodl-x-data",
    "inproc://reducer-bcast",
]


@pytest.mark.parametrize("endpoint", LOOPBACK)
def test_tcp_on_a_loopback_address_is_loopback(endpoint):
    assert is_loopback_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ELSEWHERE)
def test_anything_that_may_reach_another_machine_or_is_not_tcp_is_not(endpoint):
    assert not is_loopback_endpoint(endpoint)


def test_only_a_loopback_socket_gets_the_small_send_buffer():
    ctx = zmq.Context()
    try:
        local, remote = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
        tune_loopback(local, "tcp://127.0.0.1:7302")
        tune_loopback(remote, "tcp://10.0.0.5:7302")
        assert local.getsockopt(zmq.SNDBUF) == LOOPBACK_SNDBUF
        assert remote.getsockopt(zmq.SNDBUF) == -1  # the kernel's autotuned buffer
    finally:
        ctx.destroy(0)


# Each of these was told "(another controller?) ... choose another PORT, or stop what holds it": a user
# looked for a process that did not exist.
@pytest.mark.parametrize(("host", "cause"), [
    ("nosuchhost.invalid", r"the host name 'nosuchhost\.invalid' does not resolve here .*; fix the name in --bind "
                           r"HOST:PORT, or give an IP address of this machine"),
    ("192.0.2.1", r"192\.0\.2\.1 is not an address of this machine \(Cannot assign requested address\); bind one of "
                  r"its own addresses .*, or 0\.0\.0\.0 or \* for every interface"),
], ids=["unknown-name", "another-machines-address"])
def test_a_bind_address_that_is_not_this_machines_is_named_not_taken_for_a_busy_port(host, cause):
    with pytest.raises(ConfigError, match=rf"controller port 7300 on {host}: {cause}") as raised:
        ControllerAddress(host, 7300).check_free()
    assert "another controller" not in str(raised.value) and "stop what holds it" not in str(raised.value)


def test_a_busy_controller_port_is_still_named_with_what_may_hold_it():
    base = free_port_base()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        with pytest.raises(ConfigError, match=rf"controller port {base + 2} on 127\.0\.0\.1: Address already in use "
                           r"\(another controller\?\); the controller uses PORT\.\.PORT\+3 of --bind HOST:PORT: "
                           "choose another PORT, or stop what holds it"):
            ControllerAddress("127.0.0.1", base).check_free()


def test_a_metrics_port_among_the_controllers_own_is_refused_naming_both_before_anything_binds():
    address = ControllerAddress("127.0.0.1", 7300)
    address.check_apart(None)
    address.check_apart(7304)
    for port in (7300, 7303):
        with pytest.raises(ConfigError, match=rf"metrics port {port} \(--metrics-port / FLODL_METRICS_PORT\) is one "
                           r"of the controller's own ports: the controller at 127\.0\.0\.1:7300 binds 7300\.\.7303"):
            address.check_apart(port)
    with pytest.raises(ConfigError, match=r"binds 7300\.\.7307"):  # launch's host shards take two ports each
        address.check_apart(7306, extra=4)


def test_a_controller_name_that_does_not_exist_is_named_at_once_and_one_the_resolver_cannot_reach_is_retried(
    monkeypatch,
):
    # An agent dialling an unknown name waited out its 30 s reply timeout, then listed every cause but this.
    def lookup(code: int):
        def fail(*_: object, **__: object) -> None:
            raise socket.gaierror(code, "Name or service not known" if code == socket.EAI_NONAME else "try again")
        return fail

    monkeypatch.setattr(socket, "getaddrinfo", lookup(socket.EAI_NONAME))
    with pytest.raises(ConfigError, match=r"the host name 'ctl\.example' does not resolve here .*--controller"):
        ControllerAddress("ctl.example", 7300).check_resolves("--controller HOST:PORT")
    monkeypatch.setattr(socket, "getaddrinfo", lookup(socket.EAI_AGAIN))
    ControllerAddress("ctl.example", 7300).check_resolves("--controller HOST:PORT")  # ZeroMQ retries it
