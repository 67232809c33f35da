"""`flodl-zmq status` against a membership service on loopback, and the controller command's checks."""

from __future__ import annotations

import time

import pytest
import zmq

from flodl_zmq.controller import ControllerOptions, format_status, query_status, run_script
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import SpawnSpec
from flodl_zmq.errors import ConfigError, MembershipError
from flodl_zmq.join import JoinConfig, JoinWindow
from flodl_zmq.membership import MembershipService
from flodl_zmq.result import format_epoch
from flodl_zmq.security import CurveKeys
from flodl_zmq.trust import TrustMode
from flodl_zmq.wire import new_key

RUN_ID = bytes(range(16))


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def serve(ctx, trust=TrustMode.PRE_SHARED, curve=None):
    key = new_key()
    window = JoinWindow(JoinConfig(min_ranks=2, join_window_s=30.0, join_cap_s=30.0), opened_at=time.monotonic())
    service = MembershipService(
        window, endpoint="tcp://127.0.0.1:*", trust=trust, session_key=key, run_id=RUN_ID, incarnation=RUN_ID,
        spawn=SpawnSpec(("-m", "x")), context=ctx, curve=curve,
    )
    service.start()
    port = int(service.endpoint.rsplit(":", 1)[1])
    return service, key, ControllerAddress("127.0.0.1", port - 3)


def test_status_during_the_window_then_with_the_coordinators_view(ctx):
    service, key, address = serve(ctx)
    try:
        status = query_status(address, key, context=ctx)
        assert status["phase"] == "open" and status["joined_ranks"] == 0 and status["hosts"] == {}
        assert "training" not in status
        service.report_training({"alive": [0], "dead": [1], "epoch": 2})
        assert query_status(address, key, context=ctx)["training"] == {"alive": [0], "dead": [1], "epoch": 2}
    finally:
        service.close()


def test_a_status_request_with_the_wrong_key_gets_no_answer(ctx):
    service, _, address = serve(ctx)
    try:
        with pytest.raises(MembershipError, match="no status reply.*FLODL_KEY"):
            query_status(address, new_key(), status_reply_timeout_s=0.5, context=ctx)
        assert service.dropped == 1
    finally:
        service.close()


def test_status_under_open_admission_needs_no_key_and_works_over_curve(ctx):
    public, secret = zmq.curve_keypair()
    server = CurveKeys(public=public, secret=secret)
    client = CurveKeys.for_client({"FLODL_CURVE_SERVER": public.decode()})
    service, _, address = serve(ctx, TrustMode.OPEN, curve=server)
    try:
        assert query_status(address, None, curve=client, context=ctx)["phase"] == "open"
    finally:
        service.close()


def test_format_status_names_each_death_the_round_and_each_hosts_link_counters():
    status = {
        "phase": "formed", "reason": "target ranks reached", "joined_ranks": 2,
        "hosts": {"a": {"ranks": [0], "state": "live"}, "b": {"ranks": [1], "state": "lost"}},
        "training": {
            "started": True, "alive": [0], "exited": [], "dead": [1],
            "deaths": {"1": {"at": time.time(), "reason": "host b lost: its agent fell silent"}},
            "epoch": 3, "epochs": 8, "round": 12, "rounds_done": 11, "global_step": 400,
            "last_round_ms": 4.5, "last_round_at": time.time(), "ended": None, "incarnation": 2,
            "checkpoint": {"last_path": "runs/ckpt/ckpt-r000000008", "last_error": "disk full"},
            "links": {
                "a": {"reconnects": 3, "resends": 0, "rejected": {"AuthError": 2, "forged_route": 1},
                      "last_seen": time.time() - 0.5},
                "b": {"reconnects": 0, "resends": 0, "rejected": {}, "last_seen": None},
            },
        },
    }
    text = format_status(ControllerAddress("10.0.0.5", 7300), status)
    assert "controller incarnation 2, last checkpoint runs/ckpt/ckpt-r000000008 (last write failed: disk full)" in text
    assert "link a: reconnects 3, resends 0, rejected AuthError 2, forged_route 1, last seen 0.5 s ago" in text
    assert "link b: reconnects 0, resends 0, rejected none, last seen never" in text
    assert "host b: ranks [1] lost" in text
    assert "rank 1 dead at" in text and "host b lost" in text
    assert "epoch 4/8, round 12 (11 done)" in text


def test_format_status_lists_pending_joiners_departed_hosts_and_joins_mid_run():
    status = {
        "phase": "formed", "reason": "target ranks reached", "joined_ranks": 2,
        "hosts": {"a": {"ranks": [0], "state": "live"}, "b": {"ranks": [2], "state": "live"}},
        "pending": {"c": {"ranks": [3]}},
        "departed": [{"host": "b", "ranks": [1]}],
        "joins": [{"host": "b", "ranks": [2], "at": time.time()}],
    }
    text = format_status(ControllerAddress("10.0.0.5", 7300), status)
    assert "host c: ranks [3] pending (joins at the next re-form)" in text
    assert "host b: left the world; its ranks [1] stay dead" in text
    assert "host b: joined mid-run at" in text and "as ranks [2]" in text


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"open_admission": True, "key": bytes(32)}, "unset FLODL_KEY"),
        ({}, "no session key"),
        ({"key": bytes(32), "argv": ()}, "program every host runs"),
        ({"key": bytes(32), "argv": ("-c", "print()")}, "program every host runs"),
    ],
)
def test_controller_options_refuse_what_cannot_work(kw, match):
    args = {"address": ControllerAddress("127.0.0.1", 7300), "argv": ("train.py",), "join": JoinConfig(), **kw}
    with pytest.raises(ConfigError, match=match):
        ControllerOptions(**args)


def test_run_script_returns_the_programs_exit_status(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    assert run_script([str(script), "3"]) == 3
    assert run_script([str(script), "0"]) == 0


def test_the_epoch_line_counts_reconnects_only_when_a_link_reconnected():
    row = {"epoch": 1, "avg_loss": 0.5, "epoch_ms": 1200.0, "batch_share": [0.5, 0.5]}
    assert "reconnect" not in format_epoch({**row, "reconnects": 0}, 3)
    assert format_epoch({**row, "reconnects": 2}, 3).endswith("| 1.20s | 2 reconnect(s)")


def test_an_epoch_covered_before_a_resume_says_so_instead_of_a_nan_loss():
    row = {"epoch": 2, "avg_loss": float("nan"), "epoch_ms": 0.0, "batch_share": [0.0, 0.0], "samples": 0}
    assert format_epoch(row, 8) == "epoch 3/8: covered before the resume"
    assert format_epoch({**row, "eval": 0.9}, 8) == "epoch 3/8: covered before the resume | eval 0.9000"
    assert format_epoch({**row, "samples": 64, "avg_loss": 0.5}, 8).startswith("epoch 3/8 | loss 0.5000")
