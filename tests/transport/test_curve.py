"""CURVE over tcp loopback: records round-trip, wrong keys get nothing through, keys are checked.

Every wait is a bounded poll; a refused handshake is observed on the server's
monitor socket instead of by waiting for silence.
"""

from __future__ import annotations

import logging
import stat

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from flodl_zmq import security
from flodl_zmq.errors import ConfigError
from flodl_zmq.security import CleartextWarner, CurveKeys, apply_client, apply_server
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import RoundFrame

pytestmark = pytest.mark.timeout(30)

WAIT_MS = 5000
RUN_ID = bytes(range(16))
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def z85_pair() -> dict[str, str]:
    public, secret = zmq.curve_keypair()
    return {"public": public.decode(), "secret": secret.decode()}


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def server_pair():
    return z85_pair()


class Server:
    """A CURVE ROUTER on a random loopback port, with a monitor for handshake events."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        apply_server(self.sock, keys)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def next_handshake_event(self) -> int:
        assert self.monitor.poll(WAIT_MS), "no handshake event on the server within the bound"
        return recv_monitor_message(self.monitor)["event"]


def client(ctx: zmq.Context, endpoint: str, keys: CurveKeys) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    apply_client(sock, keys)
    sock.connect(endpoint)
    return sock


def client_keys(server_public: str, **env: str) -> CurveKeys:
    keys = CurveKeys.for_client({"FLODL_CURVE_SERVER": server_public, **env})
    assert keys is not None
    return keys


def test_round_frames_round_trip_over_curve(ctx, server_pair):
    server = Server(ctx, CurveKeys.for_server({"FLODL_CURVE_SECRET": server_pair["secret"]}))
    dealer = client(ctx, server.endpoint, client_keys(server_pair["public"]))
    key = new_key()
    sender, receiver = Codec(key, RUN_ID, "rank:0"), Codec(key, RUN_ID, "relay:a")
    params = [np.arange(1000, dtype=np.float32), np.full((3, 4), 0.25, dtype=np.float32)]

    dealer.send_multipart(sender.encode(RoundFrame(7, 0, 2.0), params))
    assert server.sock.poll(WAIT_MS)
    identity, *frames = server.sock.recv_multipart()
    env = receiver.decode(frames, Channel.DATA)

    assert env.record == RoundFrame(7, 0, 2.0)
    for got, want in zip(env.payload, params, strict=True):
        np.testing.assert_array_equal(got, want)
    server.sock.send_multipart([identity, b"ack"])
    assert dealer.poll(WAIT_MS)
    assert dealer.recv_multipart() == [b"ack"]


def test_client_with_wrong_server_key_gets_nothing_through(ctx, server_pair):
    server = Server(ctx, CurveKeys.for_server({"FLODL_CURVE_SECRET": server_pair["secret"]}))
    impostor = client(ctx, server.endpoint, client_keys(z85_pair()["public"]))
    impostor.send(b"should never arrive")

    assert server.next_handshake_event() & HANDSHAKE_FAILED
    impostor.close()
    # The server is still serving: a client with the right key is heard, and the
    # impostor's queued message never was.
    honest = client(ctx, server.endpoint, client_keys(server_pair["public"]))
    honest.send(b"hello")
    assert server.sock.poll(WAIT_MS)
    assert server.sock.recv_multipart()[1:] == [b"hello"]


def test_cleartext_client_cannot_talk_to_a_curve_server(ctx, server_pair):
    server = Server(ctx, CurveKeys.for_server({"FLODL_CURVE_SECRET": server_pair["secret"]}))
    plain = ctx.socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(server.endpoint)
    plain.send(b"in the clear")

    assert server.next_handshake_event() & HANDSHAKE_FAILED
    assert not server.sock.poll(0)


def test_allow_list_admits_listed_clients_and_refuses_others(ctx, server_pair, tmp_path):
    clients = tmp_path / "clients"
    clients.mkdir()
    security.keygen(clients, "worker1")
    listed_secret = tmp_path / "worker1.key_secret"
    (clients / "worker1.key_secret").rename(listed_secret)  # the directory holds public keys only
    keys = CurveKeys.for_server({"FLODL_CURVE_SECRET": server_pair["secret"]}, clients_dir=clients)
    auth = security.start_allow_list(ctx, keys)
    try:
        server = Server(ctx, keys)
        stranger = client(ctx, server.endpoint, client_keys(server_pair["public"]))
        stranger.send(b"let me in")
        assert server.next_handshake_event() == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        stranger.close()

        listed = CurveKeys.for_client({"FLODL_CURVE_SERVER": server_pair["public"]}, secret_file=listed_secret)
        member = client(ctx, server.endpoint, listed)
        member.send(b"hello")
        assert server.sock.poll(WAIT_MS)
        assert server.sock.recv_multipart()[1:] == [b"hello"]
    finally:
        auth.stop()


def test_no_allow_list_starts_no_authenticator(ctx, server_pair):
    keys = CurveKeys.for_server({"FLODL_CURVE_SECRET": server_pair["secret"]})
    assert security.start_allow_list(ctx, keys) is None


# ---------------------------------------------------------------- key loading


def test_nothing_configured_means_cleartext():
    assert CurveKeys.for_server({}) is None
    assert CurveKeys.for_client({}) is None


def test_keys_from_keygen_files_match_the_environment_form(tmp_path):
    public_file, secret_file = security.keygen(tmp_path, "controller")
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    from_file = CurveKeys.for_server({}, secret_file=secret_file)
    from_env = CurveKeys.for_server({"FLODL_CURVE_SECRET": from_file.secret.decode()})
    assert from_file == from_env
    worker = CurveKeys.for_client({}, server_file=public_file)
    assert worker.server == from_file.public


def test_keygen_never_overwrites_a_key(tmp_path):
    security.keygen(tmp_path, "controller")
    with pytest.raises(ConfigError, match="already exists"):
        security.keygen(tmp_path, "controller")


def test_curve_keygen_command_prints_the_public_key(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser()
    security.add_commands(parser.add_subparsers())
    args = parser.parse_args(["curve-keygen", str(tmp_path), "--name", "ctl"])
    assert args.func(args) == 0
    public = CurveKeys.for_server({}, secret_file=tmp_path / "ctl.key_secret").public.decode()
    assert f"FLODL_CURVE_SERVER={public}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"FLODL_CURVE_SECRET": "too-short"}, "FLODL_CURVE_SECRET"),
        ({"FLODL_CURVE_SECRET": "~" * 40}, "FLODL_CURVE_SECRET"),
        ({"FLODL_CURVE_PUBLIC": z85_pair()["public"]}, "FLODL_CURVE_SECRET"),
        ({"FLODL_CURVE_SECRET": z85_pair()["secret"], "FLODL_CURVE_PUBLIC": z85_pair()["public"]}, "does not belong"),
        ({"FLODL_CURVE_SERVER": z85_pair()["public"]}, "FLODL_CURVE_SECRET"),
    ],
)
def test_bad_server_keys_are_refused_naming_the_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        CurveKeys.for_server(env)


def test_worker_with_a_secret_but_no_controller_key_is_refused():
    with pytest.raises(ConfigError, match="FLODL_CURVE_SERVER"):
        CurveKeys.for_client({"FLODL_CURVE_SECRET": z85_pair()["secret"]})


def test_public_certificate_given_as_secret_is_refused_naming_the_file(tmp_path):
    public_file, _ = security.keygen(tmp_path, "controller")
    with pytest.raises(ConfigError, match="only a public key"):
        CurveKeys.for_server({}, secret_file=public_file)


def test_same_key_from_file_and_environment_is_refused(tmp_path):
    public_file, _ = security.keygen(tmp_path, "controller")
    with pytest.raises(ConfigError, match="given twice"):
        CurveKeys.for_client({"FLODL_CURVE_SERVER": z85_pair()["public"]}, server_file=public_file)


def test_repr_never_shows_the_secret(server_pair):
    keys = CurveKeys.for_server({"FLODL_CURVE_SECRET": server_pair["secret"]})
    assert server_pair["secret"] not in repr(keys)


# ---------------------------------------------------------------- cleartext warning


def warnings_for(caplog, calls: list[tuple[str, bool]]) -> list[logging.LogRecord]:
    warner = CleartextWarner(logging.getLogger("test.curve"))
    with caplog.at_level(logging.WARNING, logger="test.curve"):
        for host, encrypted in calls:
            warner.warn_if_cleartext(host, encrypted)
    return [r for r in caplog.records if r.name == "test.curve"]


def test_cleartext_to_a_public_address_warns_once(caplog):
    records = warnings_for(caplog, [("8.8.8.8", False), ("8.8.8.8", False), ("8.8.8.8", False)])
    assert len(records) == 1
    assert "8.8.8.8" in records[0].getMessage() and "CURVE" in records[0].getMessage()


def test_each_public_peer_gets_its_own_warning(caplog):
    assert len(warnings_for(caplog, [("8.8.8.8", False), ("2001:4860:4860::8888", False)])) == 2


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "10.1.2.3", "192.168.0.7", "172.16.5.5"])
def test_cleartext_to_loopback_or_private_never_warns(caplog, host):
    assert warnings_for(caplog, [(host, False)]) == []


def test_encrypted_link_to_a_public_address_never_warns(caplog):
    assert warnings_for(caplog, [("8.8.8.8", True)]) == []
