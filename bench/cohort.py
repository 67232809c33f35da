"""A heterogeneous cohort against its fastest member alone: 2 ranks, rank 1 slowed, same core for the fast rank.

    python bench/cohort.py [--batches 32,256] [--layouts 1x2,2x1] [--slow 3] [--repeats 1] [--json]

The honest version of "the cohort finishes sooner than its fastest machine
alone" on a machine with few cores. The same 1-D CNN (BatchNorm, Adam) on the
packaged digits, the same data order and target accuracy, trained:

  cluster: flodl-zmq cpu-cadence, 2 ranks as 1 host x 2 (and 2 hosts x 1);
           rank 1 slowed by --slow (it sleeps, leaving its core's time free);
  alone:   one process, the fast rank's work alone.

Pinning (`os.sched_setaffinity`): the fast rank and the lone run get the first
core, the slow rank the second; relays and the controller share the second
core with the slow rank (what its sleep leaves).

Figures per batch size and layout (steady state = every epoch after the
first; the clock is CLOCK_MONOTONIC, shared by all processes):

- epoch_s: median wall time between consecutive epoch ends (eval included);
- time_to_target_s: from training start to the first eval at --target;
- speedup_vs_alone: alone's steady epoch time over the cluster's;
- step_ms: the fast rank's median time from one train_step call to the
  next, in the cluster and alone; step_overhead_pct the excess in percent;
- service_cpu_us_per_step: CPU (user + system, /proc, 10 ms ticks) of the
  relays and the controller in the steady window, over the steps all ranks
  took in it.

JSON keys: speedup_vs_alone_b{B}, step_overhead_pct_b{B},
service_cpu_us_per_step_b{B} (1 host x 2), the same with suffix _h2_r1 for
2 hosts x 1, and time_to_target_s_{cluster,alone}_b{B}[_h2_r1].
This script is also the job the launcher runs (FLODL_ROLE set).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

from flodl_zmq.api import Trainer
from flodl_zmq.datasets import digits
from flodl_zmq.launch import Cluster

TAG = "COHORT_RESULT"
SEED = 7
TARGET = 0.95
EPOCHS = {32: 12, 256: 40}  # enough steady epochs past the target at each batch size
CLK_TCK = os.sysconf("SC_CLK_TCK")

_steps: list[float] = []  # monotonic time of every train_step call in this process
_epoch_ends: list[float] = []  # monotonic time of every epoch end (controller, or alone)


def model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 64)),
        torch.nn.Conv1d(1, 32, 5, padding=2), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
        torch.nn.Conv1d(32, 64, 5, padding=2), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
        torch.nn.MaxPool1d(4), torch.nn.Flatten(), torch.nn.Linear(64 * 16, 10),
    )


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


def step(m: torch.nn.Module, batch) -> torch.Tensor:
    _steps.append(time.monotonic())
    return F.cross_entropy(m(batch[0]), batch[1])


def accuracy(m: torch.nn.Module, dataset) -> float:
    x, y = dataset.tensors
    return float((m(x).argmax(1) == y).float().mean())


def on_epoch(row: dict) -> None:
    _epoch_ends.append(time.monotonic())


def pin(role: str | None, rank: int) -> None:
    """The fast rank (and the lone run) on the first core; everything else on the second."""
    cores = sorted(os.sched_getaffinity(0))
    first, second = cores[0], cores[1 % len(cores)]
    os.sched_setaffinity(0, {first} if role in (None, "rank") and rank == 0 else {second})


def run_job(batch: int, epochs: int) -> dict | None:
    """Train; returns the controller's (or the lone run's) figures. Ranks print theirs at exit."""
    role = os.environ.get("FLODL_ROLE") or None
    pin(role, int(os.environ.get("FLODL_RANK", "0")))
    torch.set_num_threads(1)
    if role == "rank":
        atexit.register(lambda: print(TAG + " " + json.dumps({"rank": int(os.environ["FLODL_RANK"]),
                                                             "steps": _steps}), flush=True))
    train, test = digits()
    result = Trainer(
        model=model, optimizer=optimizer, train_step=step, dataset=train, batch_size=batch, epochs=epochs,
        mode="cpu-cadence", eval_dataset=test, eval_fn=accuracy, metrics_fn=on_epoch, seed=SEED, quiet=True,
    ).run()
    return {"epoch_ends": _epoch_ends, "evals": [r.get("eval") for r in result.epochs],
            "eval_at_s": [r.get("eval_at_s") for r in result.epochs], "batch_share": result.batch_share,
            "steps": _steps}


# --------------------------------------------------------------------------- the parent


class CpuSampler:
    """Samples the CPU ticks of some processes every 20 ms: (monotonic time, total ticks)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            total = 0
            try:
                for pid in self.pids:
                    with open(f"/proc/{pid}/stat") as fh:
                        fields = fh.read().rpartition(")")[2].split()
                    total += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, IndexError):
                return  # a process is gone: the run is over
            self.samples.append((time.monotonic(), total))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def cpu_s_between(self, t0: float, t1: float) -> float:
        """CPU seconds spent between t0 and t1 (nearest samples)."""
        def at(t: float) -> int:
            return min(self.samples, key=lambda s: abs(s[0] - t))[1]
        return (at(t1) - at(t0)) / CLK_TCK


def steady_figures(epoch_ends: list[float], evals: list, eval_at_s: list, fast_steps: list[float]) -> dict:
    window = (epoch_ends[0], epoch_ends[-1])
    fast = [b - a for a, b in zip(fast_steps, fast_steps[1:], strict=False) if window[0] <= a and b <= window[1]]
    hit = next((t for e, t in zip(evals, eval_at_s, strict=True) if e is not None and e >= TARGET), None)
    return {
        "epoch_s": statistics.median(b - a for a, b in zip(epoch_ends, epoch_ends[1:], strict=False)),
        "time_to_target_s": hit,
        "step_ms": statistics.median(fast) * 1000.0,
        "window": window,
    }


def run_cluster(batch: int, hosts: int, slow: float) -> dict:
    per_host = 2 // hosts
    cluster = Cluster(argv=[__file__, "--job", "--batches", str(batch)], hosts=hosts, ranks_per_host=per_host,
                      slow={1: slow})
    cluster.start()
    services = [c.proc.pid for label, c in cluster.children.items() if label == "controller" or label.endswith(":relay")]
    sampler = CpuSampler(services)
    try:
        code = cluster.wait(600)
    finally:
        sampler.stop()
    found: dict = {"ranks": {}}
    for line in cluster.lines:
        label, _, text = line.partition("] ")
        if text.startswith(TAG):
            data = json.loads(text[len(TAG) + 1:])
            if "rank" in data:
                found["ranks"][data["rank"]] = data["steps"]
            else:
                found["controller"] = data
    if code != 0 or "controller" not in found or len(found["ranks"]) != 2:
        raise RuntimeError(f"cluster run failed (exit {code}):\n{cluster.output()}")
    ctl = found["controller"]
    fig = steady_figures(ctl["epoch_ends"], ctl["evals"], ctl["eval_at_s"], found["ranks"][0])
    t0, t1 = fig.pop("window")
    steps = sum(1 for s in found["ranks"].values() for t in s if t0 < t <= t1)
    fig["service_cpu_us_per_step"] = sampler.cpu_s_between(t0, t1) / steps * 1e6
    fig["batch_share"] = ctl["batch_share"]
    return fig


def run_alone(batch: int) -> dict:
    """The lone run, in its own process (its pinning must not reach the clusters started after it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    proc = subprocess.run([sys.executable, __file__, "--job", "--batches", str(batch)], env=env,
                          capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(TAG)), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"lone run failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    out = json.loads(line[len(TAG) + 1:])
    fig = steady_figures(out["epoch_ends"], out["evals"], out["eval_at_s"], out["steps"])
    fig.pop("window")
    return fig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="32,256")
    p.add_argument("--layouts", default="1x2,2x1", help="HOSTSxRANKS_PER_HOST, comma separated")
    p.add_argument("--slow", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=1, help="alternated runs of each side; medians over them")
    p.add_argument("--json", action="store_true")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.job or os.environ.get("FLODL_ROLE"):
        out = run_job(batches[0], EPOCHS[batches[0]])
        if out is not None:
            print(TAG + " " + json.dumps(out), flush=True)
        return 0
    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    table, figures = [], {"slowdown": args.slow, "target": TARGET, "load_average": os.getloadavg()}
    for batch in batches:
        alone_runs, cluster_runs = [], {lay: [] for lay in layouts}
        for _ in range(args.repeats):
            for lay in layouts:
                cluster_runs[lay].append(run_cluster(batch, lay[0], args.slow))
            alone_runs.append(run_alone(batch))
        alone = _median_of(alone_runs)
        for lay in layouts:
            c = _median_of(cluster_runs[lay])
            suffix = f"_b{batch}" + ("" if lay == (1, 2) else f"_h{lay[0]}_r{lay[1]}")
            row = {
                "batch": batch, "layout": f"{lay[0]}x{lay[1]}",
                "epoch_s_cluster": c["epoch_s"], "epoch_s_alone": alone["epoch_s"],
                "ttt_cluster": c["time_to_target_s"], "ttt_alone": alone["time_to_target_s"],
                "speedup": alone["epoch_s"] / c["epoch_s"],
                "step_ms_cluster": c["step_ms"], "step_ms_alone": alone["step_ms"],
                "overhead_pct": (c["step_ms"] / alone["step_ms"] - 1.0) * 100.0,
                "service_us": c["service_cpu_us_per_step"], "share": cluster_runs[lay][-1]["batch_share"],
            }
            table.append(row)
            figures[f"speedup_vs_alone{suffix}"] = round(row["speedup"], 3)
            figures[f"step_overhead_pct{suffix}"] = round(row["overhead_pct"], 1)
            figures[f"service_cpu_us_per_step{suffix}"] = round(row["service_us"], 0)
            figures[f"time_to_target_s_cluster{suffix}"] = row["ttt_cluster"]
            figures[f"time_to_target_s_alone{suffix}"] = row["ttt_alone"]
            figures[f"epoch_s_cluster{suffix}"] = round(row["epoch_s_cluster"], 4)
            figures[f"epoch_s_alone{suffix}"] = round(row["epoch_s_alone"], 4)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"1-D CNN on digits, cpu-cadence, rank 1 slowed {args.slow:g}x, target {TARGET}, "
          f"medians of {args.repeats} run(s); load average {figures['load_average'][0]:.2f}")
    head = ("batch", "layout", "epoch s cl", "epoch s alone", "speedup", "ttt cl", "ttt alone",
            "step ms cl", "step ms alone", "overhead", "svc us/step", "shares")
    print(" | ".join(head))
    for r in table:
        ttt = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("ttt_cluster", "ttt_alone")]
        print(f"{r['batch']} | {r['layout']} | {r['epoch_s_cluster']:.3f} | {r['epoch_s_alone']:.3f} | "
              f"{r['speedup']:.2f}x | {ttt[0]} | {ttt[1]} | {r['step_ms_cluster']:.2f} | {r['step_ms_alone']:.2f} | "
              f"{r['overhead_pct']:+.1f}% | {r['service_us']:.0f} | "
              + "/".join(f"{s:.2f}" for s in r["share"]))
    return 0


def _median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs) else None
            for k in ("epoch_s", "time_to_target_s", "step_ms")} | (
        {"service_cpu_us_per_step": statistics.median(r["service_cpu_us_per_step"] for r in runs)}
        if "service_cpu_us_per_step" in runs[0] else {})


if __name__ == "__main__":
    sys.exit(main())
