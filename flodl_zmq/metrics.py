"""The controller's Prometheus metrics (`--metrics-port PORT` / FLODL_METRICS_PORT; off by default).

Served over HTTP at `http://HOST:PORT/metrics` on a thread of its own, HOST
the controller's bind host (127.0.0.1 under `flodl-zmq launch`), from a
private registry (never prometheus_client's global one: two runs in one
process must not share counters). The names, labels and units are listed in
docs/operations.md ("Metrics").

Where the figures come from, each from one place only:

- what happens (rounds and their time, epochs' loss, shares and throughput,
  evals, deaths, joins) from the run log's events (`event`, the RunLog's
  listener: flodl_zmq/runlog.py), the stream events.jsonl and the
  TensorBoard files are written from;
- what is (live ranks, resends and rejections per host and cause, the
  checkpoint's age) from the last `status` snapshot the controller reports
  (`report_training`, as to the status service), read when scraped.

Rules it keeps: the metrics never stall the run (an event updates a few
numbers; a scrape reads the snapshot by reference on the server's thread);
a port that cannot be bound stops the start-up with a ConfigError naming
it and the cause (endpoints.bind_error); the labels are bounded (ranks and
hosts of the world, the router's causes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from flodl_zmq.endpoints import bind_error

log = logging.getLogger(__name__)

PATH = "/metrics"


@contextmanager
def served(port: int | None, host: str) -> Iterator[RunMetrics | None]:
    """The controller's metrics served on host:port for the block; None when `port` is unset (no metrics)."""
    if port is None:
        yield None
        return
    metrics = RunMetrics()
    metrics.serve(host, port)
    try:
        yield metrics
    finally:
        metrics.close()


class RunMetrics:
    """One controller's metrics (module docstring): fed by `event` and `report_training`; `serve`, then `close`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Counter("flodl_rounds", "averaging rounds completed", registry=r)
        self.round_seconds = Histogram("flodl_round_seconds", "a round's time, from its trigger to its consensus "
                                       "published (seconds)", registry=r)
        self.epoch = Gauge("flodl_epoch", "epochs finished", registry=r)
        self.loss = Gauge("flodl_loss", "the last epoch's mean training loss", registry=r)
        self.eval = Gauge("flodl_eval", "the last evaluation of the consensus (eval_fn's metric)", registry=r)
        self.share = Gauge("flodl_batch_share", "a rank's share of the last epoch's batches (0..1)", ["rank"], registry=r)
        self.throughput = Gauge("flodl_throughput_samples_per_second", "a rank's training throughput in the last "
                                "epoch (samples/s)", ["rank"], registry=r)
        self.deaths = Counter("flodl_rank_deaths", "ranks declared dead", registry=r)
        self.joins = Counter("flodl_world_joins", "times the world re-formed with hosts that joined mid-run",
                             registry=r)
        self._status: Mapping[str, Any] | None = None  # replaced whole by the controller, read whole by a scrape
        r.register(self)  # `collect`: the snapshot's figures
        self._server: Any = None
        self._thread: Any = None

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
        """A run log event (runlog.py's kinds): the figures it carries."""
        if kind == "round":
            self.rounds.inc()
            if fields.get("round_ms") is not None:
                self.round_seconds.observe(fields["round_ms"] / 1000.0)
        elif kind == "epoch":
            self.epoch.set(fields["epoch"] + 1)
            if fields.get("avg_loss") is not None:
                self.loss.set(fields["avg_loss"])
            for rank, share in enumerate(fields.get("batch_share") or []):
                self.share.labels(str(rank)).set(share)
            for rank, rate in enumerate(fields.get("throughput") or []):
                self.throughput.labels(str(rank)).set(rate)
        elif kind == "eval" and fields.get("metric") is not None:
            self.eval.set(fields["metric"])
        elif kind == "death":
            self.deaths.inc()
        elif kind == "join":
            self.joins.inc()

    def report_training(self, snapshot: dict[str, Any]) -> None:
        """The coordinator's current view, as `status` serves it (controller_service._report_status)."""
        self._status = snapshot

    def collect(self) -> Iterator[Metric]:
        """The snapshot's figures (`families`), read at each scrape on the server's thread."""
        status = self._status
        return iter(families(status, time.time()) if status is not None else ())

    def serve(self, host: str, port: int) -> None:
        """Serve `PATH` on host:port from a thread; ConfigError when the port cannot be had."""
        bind = "0.0.0.0" if host in ("*", "") else host  # ZeroMQ's "every interface" is "*"
        try:
            self._server, self._thread = start_http_server(port, bind, registry=self.registry)
        except (OSError, OverflowError) as exc:
            raise bind_error(
                exc, what=f"metrics port {port} on {bind}", host=bind, port_setting="--metrics-port / FLODL_METRICS_PORT",
                in_use="; choose a free port with --metrics-port / FLODL_METRICS_PORT, or leave it unset to serve no "
                "metrics") from exc
        log.info("controller: Prometheus metrics at http://%s:%d%s", bind, port, PATH)

    def close(self, timeout: float = 2.0) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout)
            self._server = None


def families(status: Mapping[str, Any], now: float) -> list[Metric]:
    """The metrics of a `status` snapshot (controller_service._report_status) at unix time `now`."""
    live = GaugeMetricFamily("flodl_ranks_live", "ranks training now", value=len(status.get("alive", [])))
    resends = CounterMetricFamily("flodl_link_resends", "control records sent again to a host's relay", labels=["host"])
    rejected = CounterMetricFamily("flodl_link_rejected", "control records from a host's relay rejected, by cause",
                                   labels=["host", "cause"])
    for host, link in sorted((status.get("links") or {}).items()):
        resends.add_metric([host], link.get("resends", 0))
        for cause, n in sorted((link.get("rejected") or {}).items()):
            rejected.add_metric([host, cause], n)
    out: list[Metric] = [live, resends, rejected]
    last_at = (status.get("checkpoint") or {}).get("last_at")
    if last_at is not None:
        out.append(GaugeMetricFamily("flodl_checkpoint_age_seconds", "seconds since the last periodic checkpoint "
                                     "was written", value=max(0.0, now - last_at)))
    return out
