"""`flodl-zmq status` against a controller with no membership service (launch, compose): StatusServer."""

from __future__ import annotations

import io
import re
import threading

import pytest
import zmq

from flodl_zmq.controller import format_watch, query_status, watch_status
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.errors import MembershipError
from flodl_zmq.launch import free_port_base
from flodl_zmq.membership import EndWatch
from flodl_zmq.status_server import StatusServer
from flodl_zmq.wire import Channel, new_key
from tests.cluster.agents import until
from tests.transport.test_status import serve

WORLD = {"h0": (0, 1), "h1": (2, 3)}
TRAINING = {
    "started": True, "alive": [0, 1, 3], "exited": [], "dead": [2], "deaths": {"2": {"at": 0.0, "reason": "gone"}},
    "epoch": 2, "epochs": 5, "round": 9, "rounds_done": 8, "global_step": 400, "last_round_ms": 41.5,
    "last_round_at": None, "ended": None, "window": [12, 20, 0, 4], "share": [0.3, 0.45, 0.0, 0.25],
    "throughput": [1200.0, 1800.0, 0.0, 950.0],
}


@pytest.fixture
def served():
    ctx = zmq.Context()
    server, address, key = served_by("status_server", ctx)
    try:
        yield address, key, server, ctx
    finally:
        server.close()
        ctx.term()


def test_a_launched_controller_answers_status_with_its_fixed_world_and_training_view(served):
    address, key, server, ctx = served
    status = query_status(address, key, context=ctx, status_reply_timeout_s=5.0)
    assert status["phase"] == "formed" and status["joined_ranks"] == 4
    assert status["hosts"] == {"h0": {"ranks": [0, 1], "state": "live"}, "h1": {"ranks": [2, 3], "state": "live"}}
    assert "training" not in status
    server.report_training(TRAINING)
    assert query_status(address, key, context=ctx, status_reply_timeout_s=5.0)["training"] == TRAINING


def test_a_status_request_with_the_wrong_key_gets_no_answer(served):
    address, _key, server, ctx = served
    with pytest.raises(MembershipError, match="no status reply"):
        query_status(address, new_key(), context=ctx, status_reply_timeout_s=0.5)
    assert server.dropped >= 1


def test_watch_draws_a_row_per_rank_and_ends_with_the_run(served):
    address, key, server, ctx = served
    server.report_training({**TRAINING, "ended": "completed"})
    out = io.StringIO()
    assert watch_status(address, key, None, status_reply_timeout_s=5.0, interval_s=0.1, out=out) == 0
    lines = out.getvalue().splitlines()
    assert "epoch 3/5" in lines[0] and "round 9" in lines[0] and "ended: completed" in lines[0]
    assert lines[-1] == f"controller {address}: the run ended (completed)"
    rows = {int(line.split()[0]): line.split() for line in lines[2:-1]}
    assert rows[1] == ["1", "h0", "alive", "20", "45.0%", "1800"]
    assert rows[2][:3] == ["2", "h1", "dead"]


def test_watch_says_when_the_controller_goes_away():
    ctx = zmq.Context()
    address = ControllerAddress("127.0.0.1", free_port_base())
    key = new_key()
    server = StatusServer(address.endpoint(Channel.JOIN), key, WORLD, ctx)
    server.start()
    server.report_training(TRAINING)
    calls = {"n": 0}

    class Closing(io.StringIO):
        def write(self, text: str) -> int:
            calls["n"] += 1
            server.close()  # the run ended (or the controller died) after the first table
            return super().write(text)

    out = Closing()
    try:
        assert watch_status(address, key, None, status_reply_timeout_s=0.5, interval_s=0.05, out=out) == 1
        assert f"controller {address} stopped answering after 1 reply (none within 0.5 s" in out.getvalue()
    finally:
        server.close()
        ctx.term()


def served_by(kind: str, ctx: zmq.Context):
    """A status endpoint of either kind, its address and key: the launcher's StatusServer or the membership."""
    if kind == "membership":
        service, key, address = serve(ctx)
        return service, address, key
    address, key = ControllerAddress("127.0.0.1", free_port_base()), new_key()
    server = StatusServer(address.endpoint(Channel.JOIN), key, WORLD, ctx)
    server.start()
    return server, address, key


def watching(address: ControllerAddress, key: bytes, **timing: float) -> tuple[threading.Thread, io.StringIO, list[int]]:
    """`status --watch` of `address` on a thread of its own: the thread, what it prints, and its exit status once it ends."""
    out, codes = io.StringIO(), []
    watcher = threading.Thread(target=lambda: codes.append(watch_status(address, key, None, out=out, **timing)))
    watcher.start()
    return watcher, out, codes


@pytest.mark.parametrize("kind", ["status_server", "membership"])
def test_a_watched_run_that_ends_between_two_queries_is_seen_ending_before_its_endpoint_closes(kind):
    ctx = zmq.Context()
    endpoint, address, key = served_by(kind, ctx)
    endpoint.report_training(TRAINING)
    watcher, out, codes = watching(address, key, status_reply_timeout_s=5.0, interval_s=1.0)
    try:
        until(lambda: "epoch 3/5" in out.getvalue(), "the watcher's first table", 30)
        # The controller's end, while the watcher sleeps: the last report, then close (ControllerService._close).
        endpoint.report_training({**TRAINING, "ended": "completed"})
        endpoint.close()
        watcher.join(30)
        assert codes == [0], out.getvalue()
        assert "ended: completed" in out.getvalue() and "stopped answering" not in out.getvalue()
    finally:
        endpoint.close()
        ctx.term()


@pytest.mark.parametrize("kind", ["status_server", "membership"])
def test_a_watch_that_loses_a_controller_it_heard_says_so_and_never_blames_the_key(kind):
    # A controller stopped with SIGTERM closes its endpoint without an end to report: the watch said it
    # "dropped the request because the key differs", of a key its replies had just proven.
    ctx = zmq.Context()
    endpoint, address, key = served_by(kind, ctx)
    endpoint.report_training(TRAINING)
    watcher, out, codes = watching(address, key, status_reply_timeout_s=0.5, interval_s=0.05)
    try:
        until(lambda: out.getvalue().count("epoch 3/5") >= 3, "the watcher's third table", 30)
        endpoint.close()
        watcher.join(30)
        assert codes == [1], out.getvalue()
        last = out.getvalue().splitlines()[-1]
        assert re.fullmatch(rf"controller {address} stopped answering after \d+ replies \(none within 0\.5 s: it ended "
                            r"or was stopped, or the link was cut; its own output says how\)", last), last
        assert "key" not in out.getvalue().lower()
    finally:
        endpoint.close()
        ctx.term()


def test_a_watched_join_window_that_failed_is_the_runs_end():
    # A controller stopped before its world formed fails the window and says so to `status`; the watch asked
    # on until the endpoint closed, then blamed the key.
    ctx = zmq.Context()
    service, address, key = served_by("membership", ctx)
    try:
        assert service.abort("the controller was interrupted (SIGTERM)")
        watcher, out, codes = watching(address, key, status_reply_timeout_s=5.0, interval_s=0.1)
        watcher.join(10)
        assert codes == [0], out.getvalue()
        assert out.getvalue().splitlines()[-1] == (
            f"controller {address}: the run ended (before its world formed: the controller was interrupted (SIGTERM))")
    finally:
        service.close()
        ctx.term()


def test_closing_waits_for_no_watcher_when_nobody_watched_or_the_run_did_not_end(monkeypatch):
    monkeypatch.setattr("flodl_zmq.membership.WATCH_LINGER_S", 1e9)  # a wait here would hang the test
    ended = {**TRAINING, "ended": "completed"}
    EndWatch().hold(ended, now=100.0)  # never asked
    asked_long_ago = EndWatch()
    asked_long_ago.answered(TRAINING, now=1.0)
    asked_long_ago.hold(ended, now=1e10)
    watched = EndWatch()
    watched.answered(TRAINING, now=99.0)
    watched.hold(TRAINING, now=100.0)  # stopped, not ended: a failure is not held up
    watched.answered(ended, now=100.5)
    watched.hold(ended, now=101.0)  # told already


def test_format_watch_before_training_is_one_line():
    text = format_watch(ControllerAddress("127.0.0.1", 7300), {"phase": "open", "reason": "waiting", "joined_ranks": 1})
    assert text.count("\n") == 0 and "open" in text


