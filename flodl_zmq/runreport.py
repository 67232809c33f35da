"""`flodl-zmq report RUN_DIR`: draws a run's `events.jsonl` (flodl_zmq/runlog.py) as `RUN_DIR/report.html`.

The page is one self-contained file: charts are inline SVG drawn here, the
style and the one small script are inline, and a Content-Security-Policy
forbids every fetch, so it opens from a mail attachment or an air-gapped
machine as it does anywhere. It shows loss and eval against wall time and
epochs, each rank's batch share and throughput over time, round time,
ElChe's window sizes, divergence with the guard's verdicts, and marks
deaths, exits (a rank that left before the run's end), joins, restarts and
checkpoints on every time axis.

Rules it keeps: reading is forgiving (a run that crashed leaves a torn last
line; it is skipped and counted, never fatal), writing is plain (no
template engine, no plotting library: the project's dependencies stay as
they are); files are this user's (flodl_zmq/private_files.py): the log is read
and the page written never through a symlink, the page atomically, 0600.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flodl_zmq.errors import ConfigError
from flodl_zmq.private_files import read_own, write_atomic
from flodl_zmq.runlog import EVENTS_FILE

REPORT_FILE = "report.html"
# One colour per rank (cycled past ten), and one per marked event kind.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
MARKERS = {"death": "#d62728", "exit": "#b8860b", "join": "#2ca02c", "restart": "#2ca02c",
           "checkpoint": "#9467bd"}
VERDICTS = {"stable": "#7f7f7f", "suppress_growth": "#ff7f0e", "nudge_down": "#d62728"}
WIDTH, HEIGHT = 560, 250
LEFT, RIGHT, TOP, BOTTOM = 60, 16, 34, 40


@dataclass
class Series:
    """One line (or set of dots) of a chart; None in `ys` breaks the line."""

    label: str
    xs: list[float]
    ys: list[float | None]
    color: str
    dots: bool = False
    dot_colors: list[str] | None = None
    tips: list[str] | None = None


@dataclass
class Events:
    """A run's events, read from events.jsonl, grouped by kind; `skipped`: unreadable lines; `earlier`: runs
    logged before it in the same file (a run directory given to more than one run), which are not drawn."""

    by_kind: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    t0: float = 0.0
    skipped: int = 0
    earlier: int = 0

    def __getitem__(self, kind: str) -> list[dict[str, Any]]:
        return self.by_kind.get(kind, [])

    def at(self, event: dict[str, Any]) -> float:
        """Seconds since the run started."""
        return float(event["t"]) - self.t0


def read_events(run_dir: Path) -> Events:
    """The events of `run_dir/events.jsonl`; ConfigError naming the path when there is none."""
    path = run_dir / EVENTS_FILE
    try:
        with read_own(path) as f:
            text = f.read().decode("utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot read {path}: {exc.strerror or exc}; give the run directory of a run (it holds {EVENTS_FILE})"
        ) from None
    events, ended = Events(), False
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            event = json.loads(line)
            float(event["t"]), str(event["kind"])
        except (ValueError, TypeError, KeyError):
            events.skipped += 1  # a torn last line of a crashed run, or a foreign line
            continue
        if ended:  # a line after a run's end is another run's: the last one is drawn
            events.by_kind.clear()
            events.earlier += 1
        events.by_kind.setdefault(event["kind"], []).append(event)
        ended = event["kind"] == "end"
    starts = events["start"]
    times = [float(e["t"]) for kind in events.by_kind.values() for e in kind]
    events.t0 = float(starts[0]["t"]) if starts else min(times, default=0.0)
    return events


def write_report(run_dir: str | Path) -> Path:
    """Render `run_dir/events.jsonl` into `run_dir/report.html`; returns the page's path."""
    run_dir = Path(run_dir)
    page = render(read_events(run_dir), title=str(run_dir))
    out = run_dir / REPORT_FILE
    try:
        write_atomic(out, lambda f: f.write(page.encode("utf-8")))
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror or exc}; check the directory's permissions and space") from None
    return out


# --------------------------------------------------------------------------- the page


def render(ev: Events, title: str) -> str:
    """The whole page for `ev`."""
    marks = [(ev.at(e), kind, _mark_label(kind, e)) for kind in MARKERS for e in ev[kind]]
    epochs, evals, rounds = ev["epoch"], ev["eval"], ev["round"]
    ranks = max((len(e.get("batch_share") or []) for e in epochs), default=0)
    ranks = max(ranks, max((len(e.get("counts") or []) for e in rounds), default=0))
    t_epoch = [ev.at(e) for e in epochs]
    n_epoch = [e["epoch"] + 1 for e in epochs]
    t_eval = [ev.at(e) for e in evals]
    n_eval = [e["epoch"] + 1 for e in evals]
    loss = [e.get("avg_loss") for e in epochs]
    metric = [e.get("metric") for e in evals]
    t_round = [ev.at(e) for e in rounds]

    def per_rank(events: list[dict[str, Any]], key: str, xs: list[float], scale: float = 1.0) -> list[Series]:
        return [
            Series(f"rank {r}", xs, [_nth(e.get(key), r, scale) for e in events], PALETTE[r % len(PALETTE)])
            for r in range(ranks)
        ]

    verdicts = [e.get("verdict") or "none" for e in rounds]
    charts = [
        chart("loss-time", "Training loss", "wall time (s)", "mean loss",
              [Series("loss", t_epoch, loss, PALETTE[0], dots=True)], marks),
        chart("eval-time", "Eval", "wall time (s)", "metric",
              [Series("eval", t_eval, metric, PALETTE[2], dots=True)], marks),
        chart("loss-epoch", "Training loss by epoch", "epoch", "mean loss",
              [Series("loss", n_epoch, loss, PALETTE[0], dots=True)]),
        chart("eval-epoch", "Eval by epoch", "epoch", "metric",
              [Series("eval", n_eval, metric, PALETTE[2], dots=True)]),
        chart("share", "Batch share per rank (per epoch)", "wall time (s)", "share of batches (%)",
              per_rank(epochs, "batch_share", t_epoch, 100.0), marks),
        chart("throughput", "Throughput per rank (per epoch)", "wall time (s)", "samples / s",
              per_rank(epochs, "throughput", t_epoch), marks),
        chart("round-time", "Round time", "wall time (s)", "trigger to consensus (ms)",
              [Series("round", t_round, [e.get("round_ms") for e in rounds], PALETTE[0], dots=True)], marks),
        chart("windows", "Window sizes (ElChe batch counts)", "wall time (s)", "batches per round",
              per_rank(rounds, "counts", t_round), marks),
        chart("divergence", "Divergence and guard verdicts", "wall time (s)", "max relative divergence",
              [Series("divergence", t_round, [e.get("divergence") for e in rounds], "#555555", dots=True,
                      dot_colors=[VERDICTS.get(v, "#000000") for v in verdicts],
                      tips=[f"round {e.get('round')}: {v}" for e, v in zip(rounds, verdicts, strict=True)])],
              marks, legend_extra=[(name, color) for name, color in VERDICTS.items()]),
    ]
    return PAGE.format(
        title=html.escape(title),
        summary=_summary(ev, ranks),
        charts="\n".join(charts),
        events=_event_table(ev),
    )


def _nth(values: Sequence[Any] | None, r: int, scale: float) -> float | None:
    if not values or r >= len(values) or values[r] is None:
        return None
    return float(values[r]) * scale


def _mark_label(kind: str, e: dict[str, Any]) -> str:
    who = f" rank {e['rank']}" if "rank" in e else (f" {e['host']}" if "host" in e else "")
    why = e.get("reason") or e.get("path") or ""
    return f"{kind}{who}" + (f": {why}" if why else "")


def _summary(ev: Events, ranks: int) -> str:
    start = (ev["start"] or [{}])[0]
    end = (ev["end"] or [{}])[-1]
    evals = [e.get("metric") for e in ev["eval"] if e.get("metric") is not None]
    final = end.get("final_eval", evals[-1] if evals else None)
    world = start.get("world") or {}
    rows = [
        ("mode", start.get("mode", "?")),
        ("world", f"{start.get('world_size', ranks)} ranks on {len(world)} host(s): "
                  + ", ".join(f"{h} {rs}" for h, rs in world.items())),
        ("epochs", f"{len(ev['epoch'])} of {start.get('epochs', '?')}"),
        ("rounds", str(len(ev["round"]))),
        ("final eval", "-" if final is None else f"{final:.4f}"),
        ("wall time", "-" if end.get("wall_s") is None else f"{end['wall_s']:.1f} s"),
        ("ended", end.get("reason", "no end recorded (still running, or crashed)")),
        ("deaths", str(len(ev["death"]))),
        ("exits", str(len(ev["exit"]))),
        ("controller restarts", str(len(ev["restart"]))),
    ]
    if ev.skipped:
        rows.append(("unreadable lines", f"{ev.skipped} (skipped)"))
    if ev.earlier:
        rows.append(("earlier runs", f"{ev.earlier} in this log before this one, not drawn (a run directory of its "
                                     "own keeps each run apart)"))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f'<table class="summary" id="summary">{body}</table>'


def _event_table(ev: Events) -> str:
    marked = sorted((ev.at(e), kind, _mark_label(kind, e)) for kind in MARKERS for e in ev[kind])
    if not marked:
        return "<p>No deaths, exits, joins, restarts or checkpoints.</p>"
    rows = "".join(
        f'<tr class="ev-{kind}"><td>{t:.1f} s</td><td>{html.escape(label)}</td></tr>' for t, kind, label in marked
    )
    return f'<table class="events" id="events"><tr><th>at</th><th>what</th></tr>{rows}</table>'


# --------------------------------------------------------------------------- charts


def chart(
    chart_id: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: list[Series],
    marks: Sequence[tuple[float, str, str]] = (),
    legend_extra: Sequence[tuple[str, str]] = (),
) -> str:
    """One chart as an inline SVG figure: axes with ticks, a line (and dots) per series, vertical marks."""
    points = [(x, y) for s in series for x, y in zip(s.xs, s.ys, strict=True) if y is not None and _finite(x, y)]
    head = f'<figure class="chart" id="{chart_id}"><figcaption>{html.escape(title)}</figcaption>'
    svg = f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{html.escape(title)}">'
    if not points:
        return (f'{head}{svg}<text class="nodata" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                f"no data in this run</text></svg></figure>")
    xs = [p[0] for p in points] + [m[0] for m in marks]
    ys = [p[1] for p in points]
    plot = _Plot(*_span(min(xs), max(xs)), *_span(min(ys), max(ys)))
    parts = [svg, *_axes(plot, xlabel, ylabel)]
    for x, kind, label in marks:
        parts.append(f'<line class="mark mark-{kind}" x1="{plot.px(x):.1f}" x2="{plot.px(x):.1f}" y1="{TOP}" '
                     f'y2="{TOP + plot.ph}" stroke="{MARKERS[kind]}"><title>{html.escape(label)} at {x:.1f} s</title></line>')
    for s in series:
        parts += _series(plot, s)
    parts += _legend(series, marks, legend_extra)
    parts.append("</svg>")
    return head + "".join(parts) + "</figure>"


@dataclass(frozen=True)
class _Plot:
    """A chart's data ranges and the plot area they map onto (SVG y grows downwards)."""

    xlo: float
    xhi: float
    ylo: float
    yhi: float
    pw: float = WIDTH - LEFT - RIGHT
    ph: float = HEIGHT - TOP - BOTTOM

    def px(self, x: float) -> float:
        return LEFT + _part(x, self.xlo, self.xhi) * self.pw

    def py(self, y: float) -> float:
        return TOP + self.ph - _part(y, self.ylo, self.yhi) * self.ph


# Axis arithmetic works on halves: any two finite floats are at most 2 * FLOAT_MAX apart, so their
# difference may overflow, but half of it never does. A rank reports any finite loss or metric it likes
# (1e308 and -1e308 in one chart are legal); the page must still render, never raise OverflowError.
FLOAT_MAX = sys.float_info.max


def _half_width(lo: float, hi: float) -> float:
    return hi / 2 - lo / 2  # halving is exact: the same as (hi - lo) / 2 wherever that does not overflow


def _part(v: float, lo: float, hi: float) -> float:
    """Where `v` lies between `lo` (0) and `hi` (1)."""
    return _half_width(lo, v) / _half_width(lo, hi)


def _axes(plot: _Plot, xlabel: str, ylabel: str) -> list[str]:
    """The plot frame, a grid line and label per tick, and the axis labels."""
    pw, ph, px, py = plot.pw, plot.ph, plot.px, plot.py
    parts = [f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}"/>']
    for t in _ticks(plot.xlo, plot.xhi):
        parts.append(f'<line class="grid" x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{TOP}" y2="{TOP + ph}"/>'
                     f'<text class="tick" x="{px(t):.1f}" y="{TOP + ph + 14}" text-anchor="middle">{_fmt(t)}</text>')
    for t in _ticks(plot.ylo, plot.yhi):
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{LEFT + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}"/>'
                     f'<text class="tick" x="{LEFT - 4}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    parts.append(f'<text class="label" x="{LEFT + pw / 2}" y="{HEIGHT - 6}" text-anchor="middle">{html.escape(xlabel)}</text>'
                 f'<text class="label" transform="translate(14 {TOP + ph / 2}) rotate(-90)" text-anchor="middle">'
                 f"{html.escape(ylabel)}</text>")
    return parts


def _series(plot: _Plot, s: Series) -> list[str]:
    """One series: a path per run of finite points, and its dots (always for a single point)."""
    parts = []
    for run in _runs(s.xs, s.ys):
        if len(run) > 1:
            d = "M" + " L".join(f"{plot.px(x):.1f},{plot.py(y):.1f}" for x, y in run)
            parts.append(f'<path class="series" d="{d}" stroke="{s.color}"/>')
    if s.dots or len(s.xs) == 1:
        for i, (x, y) in enumerate(zip(s.xs, s.ys, strict=True)):
            if y is None or not _finite(x, y):
                continue
            color = s.dot_colors[i] if s.dot_colors else s.color
            tip = s.tips[i] if s.tips else f"{s.label}: {_fmt(y)} at {_fmt(x)}"
            parts.append(f'<circle class="dot" cx="{plot.px(x):.1f}" cy="{plot.py(y):.1f}" r="2.5" fill="{color}">'
                         f"<title>{html.escape(tip)}</title></circle>")
    return parts


def _legend(
    series: list[Series], marks: Sequence[tuple[float, str, str]], extra: Sequence[tuple[str, str]]
) -> list[str]:
    """A swatch per series (when there are several), per extra entry and per kind of mark shown."""
    legend = [(s.label, s.color) for s in series if len(series) > 1] + list(extra)
    legend += sorted({(kind, MARKERS[kind]) for _, kind, _ in marks})
    parts = []
    x = LEFT
    for label, color in legend:
        parts.append(f'<rect x="{x}" y="10" width="10" height="10" fill="{color}"/>'
                     f'<text class="legend" x="{x + 13}" y="19">{html.escape(label)}</text>')
        x += 20 + 7 * len(label)
    return parts


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def _runs(xs: Sequence[float], ys: Sequence[float | None]) -> list[list[tuple[float, float]]]:
    """The unbroken stretches of a line (a None or non-finite value breaks it)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys, strict=True):
        if y is None or not _finite(x, y):
            runs.append([])
        else:
            runs[-1].append((x, y))
    return [r for r in runs if r]


def _span(lo: float, hi: float) -> tuple[float, float]:
    """An axis range around [lo, hi] with a little air (a flat line gets a visible band), within the floats."""
    half = _half_width(lo, hi)
    pad = (abs(lo) * 0.1 or 1.0) if half < 5e-13 else half * 0.1
    return max(lo - pad, -FLOAT_MAX), min(hi + pad, FLOAT_MAX)


def _ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) inside [lo, hi]."""
    raw = _half_width(lo, hi) / target * 2
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    return [2 * (first / 2 + i * (step / 2)) for i in range(int(hi / step - first / step) + 1)]  # in halves too


def _fmt(v: float) -> str:
    return f"{v:.0f}" if 1e4 <= abs(v) < 1e15 else f"{v:.3g}"


# The page. The script only counts what rendered and records errors in the DOM, so a
# headless browser's DOM dump shows both (tests/browser/test_report_page.py).
PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>flodl-zmq run {title}</title>
<script>
document.documentElement.dataset.errors = "0";
window.addEventListener("error", function () {{
  var root = document.documentElement;
  root.dataset.errors = String(Number(root.dataset.errors) + 1);
}});
</script>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
h1 {{ font-size: 1.3em; }}
.charts {{ display: flex; flex-wrap: wrap; gap: 1em; }}
figure.chart {{ margin: 0; border: 1px solid #ddd; padding: 0.4em; }}
figcaption {{ font-weight: bold; font-size: 0.95em; }}
svg text {{ font-size: 11px; fill: #333; }}
svg .plot {{ fill: #fcfcfc; stroke: #999; }}
svg .grid {{ stroke: #e6e6e6; }}
svg .series {{ fill: none; stroke-width: 1.6; }}
svg .mark {{ stroke-dasharray: 4 3; stroke-width: 1.2; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; }}
th, td {{ text-align: left; padding: 0.15em 0.8em 0.15em 0; }}
</style>
</head>
<body>
<h1>flodl-zmq run {title}</h1>
{summary}
<div class="charts">
{charts}
</div>
<h2>Deaths, exits, joins, restarts, checkpoints</h2>
{events}
<script>
(function () {{
  var root = document.documentElement;
  var drawn = 0;
  document.querySelectorAll("figure.chart svg").forEach(function (svg) {{
    var box = svg.getBBox();
    if (svg.querySelector("path.series, circle.dot") && box.width > 0 && box.height > 0) drawn += 1;
  }});
  root.dataset.chartsDrawn = String(drawn);
}})();
</script>
</body>
</html>
"""


# --------------------------------------------------------------------------- command line


def add_command(sub: Any) -> None:
    """Register `report` on the `flodl-zmq` sub-command parser."""
    p = sub.add_parser(
        "report", help="draw a run directory's events.jsonl as a self-contained RUN_DIR/report.html",
        description="Read RUN_DIR/events.jsonl (written by every run: Trainer(run_dir=...), --run-dir, or "
                    "runs/TIME-ID) and write RUN_DIR/report.html, viewable offline.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.set_defaults(func=_report_command)


def _report_command(args: argparse.Namespace) -> int:
    print(write_report(args.run_dir))
    return 0
