"""The controller's Prometheus endpoint (flodl_zmq/metrics.py) scraped over HTTP: the run log's events, the status snapshot, a taken port."""

from __future__ import annotations

import errno
import os
import socket
import urllib.request
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flodl_zmq.controller import ControllerOptions, serve
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.errors import ConfigError
from flodl_zmq.join import JoinConfig
from flodl_zmq.launch import free_port_base
from flodl_zmq.metrics import PATH, RunMetrics, served
from flodl_zmq.settings import DEFAULTS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:port/metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{PATH}", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_scrape_shows_the_run_logs_events_and_the_status_snapshot():
    port = free_port()
    with served(port, "127.0.0.1") as metrics:
        assert metrics is not None
        for r, ms in ((1, 100.0), (2, 300.0)):
            metrics.event("round", {"round": r, "round_ms": ms})
        metrics.event("epoch", {"epoch": 0, "avg_loss": 0.5, "batch_share": [0.7, 0.3], "throughput": [90.0, 40.0]})
        metrics.event("eval", {"epoch": 0, "metric": 0.875})
        metrics.event("death", {"rank": 1, "reason": "it exited with code -9"})
        metrics.event("join", {"epoch": 1, "joined": ["h2"]})
        metrics.report_training({
            "alive": [0, 2], "checkpoint": {"last_at": 0.0},
            "links": {"h0": {"resends": 3, "rejected": {"bad_mac": 2}}, "h1": {"resends": 0, "rejected": {}}},
        })
        got = scrape(port)
    assert got[("flodl_rounds_total", ())] == 2
    assert got[("flodl_round_seconds_count", ())] == 2 and got[("flodl_round_seconds_sum", ())] == pytest.approx(0.4)
    assert got[("flodl_epoch", ())] == 1 and got[("flodl_loss", ())] == 0.5 and got[("flodl_eval", ())] == 0.875
    assert got[("flodl_batch_share", (("rank", "1"),))] == pytest.approx(0.3)
    assert got[("flodl_throughput_samples_per_second", (("rank", "0"),))] == 90.0
    assert got[("flodl_rank_deaths_total", ())] == 1 and got[("flodl_world_joins_total", ())] == 1
    assert got[("flodl_ranks_live", ())] == 2
    assert got[("flodl_link_resends_total", (("host", "h0"),))] == 3
    assert got[("flodl_link_rejected_total", (("cause", "bad_mac"), ("host", "h0")))] == 2
    assert got[("flodl_checkpoint_age_seconds", ())] > 0  # written at unix time 0: long ago


def test_no_port_serves_nothing_and_two_controllers_in_one_process_keep_their_own_counters():
    with served(None, "127.0.0.1") as metrics:
        assert metrics is None
    one, two = RunMetrics(), RunMetrics()
    one.event("round", {"round": 1, "round_ms": 5.0})
    assert one.registry.get_sample_value("flodl_rounds_total") == 1
    assert two.registry.get_sample_value("flodl_rounds_total") == 0


def test_a_taken_port_is_a_config_error_naming_the_port_and_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics port {port} .*--metrics-port"):
            with served(port, "127.0.0.1"):
                pass


def test_a_privileged_or_unresolvable_metrics_bind_is_named_by_its_cause_not_as_a_taken_port(monkeypatch):
    # Both were told to choose a free port. A user runs as root here, so the kernel's refusal is stood in for.
    with pytest.raises(ConfigError, match=r"metrics port 9100 on nosuchhost\.invalid: the host name "
                       r"'nosuchhost\.invalid' does not resolve here .*; fix the name in --bind HOST:PORT"):
        with served(9100, "nosuchhost.invalid"):
            pass

    def refused(port: int, addr: str, registry: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr("flodl_zmq.metrics.start_http_server", refused)
    with pytest.raises(ConfigError, match=r"metrics port 80 on 127\.0\.0\.1: Permission denied: a port below 1024 "
                       r"needs root \(or CAP_NET_BIND_SERVICE\); give --metrics-port / FLODL_METRICS_PORT a port of "
                       r"1024 or above$"):
        with served(80, "127.0.0.1"):
            pass


def test_a_taken_port_stops_flodl_zmq_controller_before_its_join_window_opens():
    # Bound only once the world had formed, a taken port sent every joined agent home;
    # now the command fails at once, and no agent can join a controller that cannot serve.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        opts = ControllerOptions(
            address=ControllerAddress("127.0.0.1", free_port_base()), argv=("train.py",), key=bytes(32),
            # A window that cannot form and closes at once: a join window that opened ends in a MembershipError.
            join=JoinConfig(min_ranks=2, join_window_s=0.5, join_cap_s=0.5),
            settings=replace(DEFAULTS, metrics_port=port),
        )
        with pytest.raises(ConfigError, match=rf"metrics port {port} .*--metrics-port"):
            serve(opts)
