"""Time to target on real jobs: flodl-zmq (defaults, and tuned) against torch DDP and the fastest member alone.

    python bench/tta.py [--jobs cnn,transformer,mlp] [--worlds 1x2,1x2slow,2x2slow] [--runs ours,best,ddp,alone]
                        [--repeats 3] [--evals-per-epoch 4] [--lr-scale 1.0] [--json]

The question a user asks before adding a machine: does the run reach the
target sooner? Every run trains the same job from the same seed with one
torch thread per process, each rank on its share of its host's cores as the
framework keeps it (`rank.core_share`: a core each on this machine), the lone
run and DDP's ranks pinned the same way here, and records when each evaluation
finished (CLOCK_MONOTONIC, shared by every process) and how many samples the
scored model had trained on. Every run is scored at the same cadence in
samples, `--evals-per-epoch` K times an epoch (the Trainer's
`eval_every_samples`, an epoch's samples / K; DDP's rank 0 at the same
points), so time to target is not rounded up to an epoch and no run is
favoured; K = 1 scores at epoch ends only. `--lr-scale S` multiplies the
job's learning rate by S in every run (alone and DDP's scaled rate too): the
same job with another rate, to compare a pair and its member alone where
each is better tuned.

Jobs (the examples' and bench/train.py's models, per-rank batch 32):

  cnn:         examples/cnn_digits.py (SGD Nesterov, warm-up + cosine), test accuracy >= 0.98
  mlp:         bench/train.py's 2.2M-parameter MLP (SGD momentum), test accuracy >= 0.95
  transformer: examples/char_transformer.py (AdamW, cosine), validation loss <= 2.5 nats/char

Worlds: 1x2 (one host, two equal ranks), 1x2slow (rank 1 slowed 3x, `launch
--slow`), 2x2slow (two hosts of two ranks, rank 3 slowed 3x). Runs:

  ours:  flodl-zmq with the Trainer's defaults (what a user gets untuned);
  best:  flodl-zmq with --best's Trainer keywords (default BEST, per job: the
         overlapped round, cpu-async with half of each correction, as the
         defaults are, and for the transformer the whole correction with the
         lone run's batch split over the ranks and an average after every
         step; docs/benchmarks.md);
  ddp:   DistributedDataParallel on gloo in the same world, the same per-rank
         batch, the slow rank sleeping the same way, the learning rate scaled
         as DDP users do (linearly with the world for SGD, by its square root
         for AdamW), warm-up as the job's;
  alone: the fastest member alone: one process, one pinned core.

Figures per job, world and run (medians over --repeats runs, alternated):
time to target from the first step (`ttt_s`) and from the command's start
(`ttt_cmd_s`, start-up included), samples to target, the metric at a fixed
budget (the lone run's time to target), the metric after the job's epochs,
the time to train all of them (`run_s`: floDl's own measure, the whole
schedule's wall time with the final metric beside it) and the services'
share of the run's CPU time (relays and controller), over the whole run and
from the first step to the target. `--timeline` accounts each rank's time to
phases, over the whole run and to the target, and times every training step
(the job's forward, backward and optimizer step), alone as on a rank: how
many each process took, and the median wall and CPU time of one.

JSON keys: evals_per_epoch, lr_scale, tta_speedup_vs_alone_<job>_<world> and tta_speedup_vs_ddp_<job>_<world>
(time from the first step; ours with defaults, `_best` appended for BEST),
run_speedup_vs_alone_<job>_<world> (all epochs),
final_delta_vs_alone_<job>_<world> (ours minus alone after equal epochs, in
points of accuracy or nats; `_best` too), and per run
ttt_s_/ttt_cmd_s_/samples_/budget_metric_/final_/run_s_/evals_/service_cpu_share_/service_cpu_share_to_target_
<run>_<job>_<world> (`evals_`: how many times the run was scored); with --timeline,
timeline_/timeline_to_target_<run>_<job>_<world>_<rank label> (seconds per phase) and
steps_<run>_<job>_<world>_<rank label> / steps_alone_<job> ({"n", "ms", "cpu_ms"}: steps, median wall and CPU ms).
This script is also the job the launcher runs (FLODL_ROLE set).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

TAG = "TTA_RESULT"
SEED = 11
BATCH = 32
SLOW = 3.0
WORLDS: dict[str, tuple[int, int, dict[int, float]]] = {  # hosts, ranks per host, slowed ranks
    "1x2": (1, 2, {}),
    "1x2slow": (1, 2, {1: SLOW}),
    "2x2slow": (2, 2, {3: SLOW}),
}
# The best Trainer keywords found per job (docs/benchmarks.md, "What was tried"); --best replaces them for
# every job. "batch_size": "split" is the lone run's batch split over the world's ranks, which keeps the
# lone run's samples to target: it wins where a step's cost follows its batch (the transformer), not on
# the digits models, whose steps cost about the same at half the batch. Half of each correction (the
# default) against the whole reached the digits jobs' targets sooner in 12 of 15 pairings; the split
# transformer did as well with either, and its figures were measured with the whole.
OVERLAPPED: dict[str, Any] = {"mode": "cpu-async", "easgd_alpha": 0.5}
BEST: dict[str, dict[str, Any]] = {
    "cnn": OVERLAPPED,
    "mlp": OVERLAPPED,
    "transformer": {**OVERLAPPED, "easgd_alpha": 1.0, "batch_size": "split", "anchor": 1, "max_anchor": 1},
}


@dataclass(frozen=True)
class Spec:
    """One job: what the Trainer (or DDP) trains, and the target that ends the race."""

    build: Callable[[], dict[str, Any]]  # Trainer keywords without optimizer/scheduler
    optimizer: Callable[[Any, float], torch.optim.Optimizer]  # (params, lr scale)
    scheduler: Callable[[int], Callable[[Any], Any]] | None  # total steps -> scheduler factory
    epochs: int
    target: float
    higher_is_better: bool
    adam: bool  # DDP scales an Adam learning rate by sqrt(world), SGD's linearly

    def reached(self, metric: float) -> bool:
        return metric >= self.target if self.higher_is_better else metric <= self.target


def _cnn() -> dict[str, Any]:
    import cnn_digits

    from flodl_zmq.datasets import digits

    train, test = digits()
    return {"model": cnn_digits.cnn, "train_step": cnn_digits.step, "dataset": train, "eval_dataset": test,
            "eval_fn": cnn_digits.accuracy, "max_grad_norm": 2.0}


def _mlp() -> dict[str, Any]:
    import train as mlp_bench

    from flodl_zmq.datasets import digits

    train, test = digits()
    return {"model": mlp_bench.model, "train_step": mlp_bench.step, "dataset": train, "eval_dataset": test,
            "eval_fn": mlp_bench.accuracy}


def _transformer() -> dict[str, Any]:
    import char_transformer as ct

    train, val = ct.corpus(200_000, 20_000)
    return {"model": lambda: ct.CharTransformer(64, 128, 2, 4), "train_step": ct.step,
            "dataset": ct.Windows(train, 64), "eval_dataset": ct.Windows(val, 64), "eval_fn": ct.validation_loss,
            "max_grad_norm": 1.0}


def _warmup_cosine(total: int) -> Callable[[Any], Any]:
    import cnn_digits

    return cnn_digits.warmup_cosine(total, min(50, total))


JOBS: dict[str, Spec] = {
    "cnn": Spec(_cnn, lambda p, s: torch.optim.SGD(p, lr=0.1 * s, momentum=0.9, nesterov=True, weight_decay=5e-4),
                _warmup_cosine, epochs=12, target=0.98, higher_is_better=True, adam=False),
    "mlp": Spec(_mlp, lambda p, s: torch.optim.SGD(p, lr=0.05 * s, momentum=0.9), None,
                epochs=12, target=0.95, higher_is_better=True, adam=False),
    "transformer": Spec(_transformer, lambda p, s: torch.optim.AdamW(p, lr=3e-3 * s, weight_decay=0.01),
                        lambda total: lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, total),
                        epochs=3, target=2.5, higher_is_better=False, adam=True),
}


# --------------------------------------------------------------------------- inside a run's processes

_first_step: list[float] = []
_evals: list[tuple[float, float]] = []  # (monotonic time the eval ended, metric), in the process that scores
_scored: list[int] = []  # the samples each eval's model had trained on, in order, where the result is known


def pin(slot: int) -> None:
    """This process on one core: slot `slot`, round robin over the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[slot % len(cores)]})


def _timed(spec_kw: dict[str, Any]) -> dict[str, Any]:
    """The job's step and eval, noting the first step's and every eval's time."""
    step, evaluate = spec_kw["train_step"], spec_kw["eval_fn"]

    def train_step(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if not _first_step:
            _first_step.append(time.monotonic())
        return step(model, batch)

    def eval_fn(model: torch.nn.Module, dataset: Any) -> float:
        metric = float(evaluate(model, dataset))
        _evals.append((time.monotonic(), metric))
        return metric

    return {**spec_kw, "train_step": train_step, "eval_fn": eval_fn}


def _report() -> None:
    steps = {"n": len(_steps), "ms": 1e3 * statistics.median(w for w, _ in _steps),
             "cpu_ms": 1e3 * statistics.median(c for _, c in _steps)} if _steps else None
    print(TAG + " " + json.dumps({"first_step": _first_step[:1], "evals": _evals, "samples": _scored,
                                  "timeline": _timeline, "bins": _bins, "steps": steps}), flush=True)


_timeline: dict[str, float] = {}  # phase -> seconds, on a rank (--timeline)
# The same seconds by when they were spent, in bins of BIN_S of CLOCK_MONOTONIC (the bin's index: its start
# over BIN_S), so that the parent can cut a rank's time at the run's time to target.
BIN_S = 0.02
_bins: dict[int, dict[str, float]] = {}


_steps: list[tuple[float, float]] = []  # each training step's wall and this thread's CPU seconds (--timeline)


def time_steps() -> None:
    """Time each training step (`Stepper.step`: the job's forward, backward and optimizer step), wall and the
    training thread's CPU, alone as on a rank: what one step costs beside the rest of its run. Wall time past
    CPU time is time the thread waited for its core."""
    from flodl_zmq.training import Stepper

    step = Stepper.step

    def timed(self: Any, batch: Any) -> float:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return step(self, batch)
        finally:
            _steps.append((time.perf_counter() - t0, time.thread_time() - c0))

    Stepper.step = timed


def time_phases() -> None:
    """Account a rank's wall time to phases by wrapping its runtime's steps (a measurement, not an API).

    Each phase's time is counted in the bin of BIN_S in which it ended. Nested phases
    are taken out of the enclosing one; a wait is "round" while
    this rank's deposit awaits its consensus, else "idle" (no work given yet), and
    "start-up" before the run's first step.
    """
    from flodl_zmq.rank import RankRuntime
    from flodl_zmq.training import Stepper

    stack: list[list[float]] = []

    def wrap(name: str | Callable[[Any], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(self: Any, *a: Any, **k: Any) -> Any:
            phase = name(self, *a, **k) if callable(name) else name
            if phase is None:
                return fn(self, *a, **k)
            stack.append([time.perf_counter(), 0.0])
            try:
                return fn(self, *a, **k)
            finally:
                t0, nested = stack.pop()
                spent = time.perf_counter() - t0
                _timeline[phase] = _timeline.get(phase, 0.0) + spent - nested
                row = _bins.setdefault(int(time.monotonic() / BIN_S), {})
                row[phase] = row.get(phase, 0.0) + spent - nested
                if stack:
                    stack[-1][1] += spent
        return timed

    def wait_phase(self: Any, block: bool) -> str | None:
        if not block:
            return None
        if not _first_step:
            return "start-up"  # formation, the model hand-out, the first plan
        return "round" if self._pending_round is not None else "idle"

    RankRuntime._take_batch = wrap("train", RankRuntime._take_batch)
    RankRuntime.step = wrap("train", RankRuntime.step)
    Stepper.step = wrap("train", Stepper.step)
    RankRuntime._drain = wrap(wait_phase, RankRuntime._drain)
    RankRuntime._on_consensus = wrap("load", RankRuntime._on_consensus)
    RankRuntime._deposit = wrap("deposit", RankRuntime._deposit)
    RankRuntime._run_eval = wrap("eval", RankRuntime._run_eval)


def keywords(best: dict[str, Any], world: str) -> dict[str, Any]:
    """A run's Trainer keywords beyond the job's: BATCH per rank unless `best` sets a batch; "split" is BATCH
    over the world's ranks, the lone run's batch as the world's."""
    extra = {"batch_size": BATCH, **best}
    if extra["batch_size"] == "split":
        hosts, per_host, _ = WORLDS[world]
        extra["batch_size"] = BATCH // (hosts * per_host)
    return extra


def eval_every(dataset_len: int, evals_per_epoch: int) -> int:
    """The samples between two evals for `evals_per_epoch` a run (0: at epoch ends only)."""
    return 0 if evals_per_epoch <= 1 else dataset_len // evals_per_epoch


def run_trainer(job: str, world: str, variant: str, best: dict[str, Any], timeline: bool, evals_per_epoch: int,
                lr_scale: float) -> None:
    """ours / best / alone: the Trainer, in whatever role this process has."""
    from flodl_zmq.api import Trainer

    spec = JOBS[job]
    role = os.environ.get("FLODL_ROLE")
    if role is None:  # alone; a rank keeps to its share of the cores as any user's does (rank.keep_to_share)
        pin(0)
    if role == "rank" and timeline:
        time_phases()
    if role in ("rank", None) and timeline:
        time_steps()
    kw = _timed(spec.build())
    extra = keywords(best if variant == "best" else {}, world)
    total = spec.epochs * math.ceil(len(kw["dataset"]) / extra["batch_size"])
    atexit.register(_report)
    result = Trainer(**kw, optimizer=lambda p: spec.optimizer(p, lr_scale), epochs=spec.epochs, seed=SEED,
                     eval_every_samples=eval_every(len(kw["dataset"]), evals_per_epoch),
                     scheduler=spec.scheduler(total) if spec.scheduler else None, quiet=True, **extra).run()
    _scored.extend(row["samples"] for row in result.evals)  # the controller, or alone (a rank does not return)


def _ddp_worker(rank: int, world: int, job: str, slow: dict[int, float], init: str, evals_per_epoch: int,
                lr_scale: float) -> None:
    import torch.distributed as dist

    from flodl_zmq.sampling import epoch_permutation

    pin(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    spec = JOBS[job]
    torch.manual_seed(SEED)
    kw = _timed(spec.build())
    ddp = torch.nn.parallel.DistributedDataParallel(kw["model"]())
    opt = spec.optimizer(ddp.parameters(), lr_scale * (math.sqrt(world) if spec.adam else float(world)))
    data, n = kw["dataset"], len(kw["dataset"])
    per_step = world * BATCH
    sched = spec.scheduler(spec.epochs * (n // per_step))(opt) if spec.scheduler else None
    every, trained = eval_every(n, evals_per_epoch), 0

    def score() -> None:  # rank 0, as the others wait at the next all-reduce
        ddp.module.eval()
        with torch.no_grad():
            kw["eval_fn"](ddp.module, kw["eval_dataset"])
        ddp.module.train()
        _scored.append(trained)

    dist.barrier()
    for epoch in range(spec.epochs):
        perm = epoch_permutation(SEED, epoch, n)
        steps = n // per_step
        for s in range(steps):  # equal step counts: DDP moves in lockstep
            t = time.perf_counter()
            idx = perm[s * per_step + rank : (s + 1) * per_step : world]
            batch = torch.utils.data.default_collate([data[int(i)] for i in idx])
            opt.zero_grad(set_to_none=True)
            loss = kw["train_step"](ddp, batch)
            loss.backward()  # the all-reduce: every rank waits for the slowest
            if kw.get("max_grad_norm"):
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), kw["max_grad_norm"])
            opt.step()
            if sched is not None:
                sched.step()
            if rank in slow:
                time.sleep((slow[rank] - 1.0) * (time.perf_counter() - t))
            trained += per_step
            if rank == 0 and (s + 1 == steps or (every and trained // every > (trained - per_step) // every)):
                score()  # the Trainer's rule: one eval per due point, and at the epoch's end
    if rank == 0:
        _report()
    dist.barrier()  # gloo aborts a rank (SIGABRT) that tears down while a peer is still scoring
    dist.destroy_process_group()


def run_ddp(job: str, world_name: str, evals_per_epoch: int, lr_scale: float) -> None:
    import torch.multiprocessing as mp

    hosts, per_host, slow = WORLDS[world_name]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ddp_worker, nprocs=hosts * per_host, join=True,
                 args=(hosts * per_host, job, slow, f"file://{d}/rendezvous", evals_per_epoch, lr_scale))


# --------------------------------------------------------------------------- the parent


class CpuTicks:
    """Each process's CPU ticks, sampled every 10 ms (the kernel's tick) until the run ends: the services' share
    of its CPU. Sampled every 50 ms, a window of half a second from the first step to the target could
    count up to 50 ms of the controller's busy start-up before that step."""

    def __init__(self, pids: dict[int, bool]) -> None:
        self.pids = pids  # pid -> is a service
        self.samples: list[tuple[float, dict[int, int]]] = []  # (CLOCK_MONOTONIC, each process's ticks so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ticks: dict[int, int] = {}  # a process that is gone keeps its last count
        while not self._stop.wait(0.01):
            for pid in self.pids:
                try:
                    with open(f"/proc/{pid}/stat") as fh:
                        fields = fh.read().rpartition(")")[2].split()
                    ticks[pid] = int(fields[11]) + int(fields[12])
                except (OSError, IndexError):
                    continue
            self.samples.append((time.monotonic(), dict(ticks)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def service_share(self, start: float = -math.inf, end: float = math.inf) -> float | None:
        """The services' share of the CPU ticks taken from `start` to `end` (CLOCK_MONOTONIC; the whole run
        by default), between the last sample before `start` and the first after `end`."""
        before = next((s for t, s in reversed(self.samples) if t <= start), {})
        after = next((s for t, s in self.samples if t >= end), self.samples[-1][1] if self.samples else {})
        spent = {p: after.get(p, 0) - before.get(p, 0) for p in self.pids}
        total = sum(spent.values())
        return sum(n for p, n in spent.items() if self.pids[p]) / total if total else None


def _parse(lines: list[str]) -> dict[str, Any]:
    first: list[float] = []
    evals: list[tuple[float, float]] = []
    samples: list[int] = []
    timelines: dict[str, dict[str, float]] = {}
    bins: dict[str, dict[int, dict[str, float]]] = {}
    steps: dict[str, dict[str, float]] = {}
    for line in lines:
        label, _, text = line.partition("] ") if line.startswith("[") else ("", "", line)
        if text.startswith(TAG):
            who = label.lstrip("[")
            data = json.loads(text[len(TAG) + 1:])
            first += data["first_step"]
            evals += [tuple(e) for e in data["evals"]]
            samples += data["samples"]
            if data["timeline"]:
                timelines[who] = data["timeline"]
                bins[who] = {int(k): v for k, v in data["bins"].items()}
            if data["steps"]:
                steps[who] = data["steps"]
    if not first or not evals:
        raise RuntimeError("the run reported no step or no evaluation:\n" + "\n".join(lines[-40:]))
    if len(samples) != len(evals):
        raise RuntimeError(f"{len(evals)} evaluations but {len(samples)} sample counts:\n" + "\n".join(lines[-40:]))
    # One process scores at a time, in the order its result lists them: time order is that order.
    return {"first_step": min(first), "evals": [(t, m, n) for (t, m), n in zip(sorted(evals), samples, strict=True)],
            "timelines": timelines, "bins": bins, "steps": steps}


def run_one(job: str, world: str, run: str, best: str, timeline: bool = False, evals_per_epoch: int = 4,
            lr_scale: float = 1.0) -> dict[str, Any]:
    """One run in fresh processes; its raw figures (times are CLOCK_MONOTONIC)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    child = [sys.executable, __file__, "--child", run, "--jobs", job, "--worlds", world, "--best", best,
             "--evals-per-epoch", str(evals_per_epoch), "--lr-scale", repr(lr_scale),
             *(["--timeline"] if timeline else [])]
    t_cmd = time.monotonic()
    ticks = None
    if run in ("ours", "best"):
        from flodl_zmq.launch import Cluster

        hosts, per_host, slow = WORLDS[world]
        cluster = Cluster(argv=child[1:], hosts=hosts, ranks_per_host=per_host, slow=slow)
        cluster.start()
        ticks = CpuTicks({c.proc.pid: not label.split(":")[-1].isdigit() for label, c in cluster.children.items()})
        code = cluster.wait(1800)
        ticks.stop()
        if code != 0:
            raise RuntimeError(f"{run} {job} {world}: the cluster failed (exit {code}):\n{cluster.output()}")
        lines = cluster.lines
    else:
        proc = subprocess.run(child, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{run} {job} {world}: exit {proc.returncode}:\n{proc.stdout}{proc.stderr}")
        lines = proc.stdout.splitlines()
    out = _parse(lines)
    return {**out, "t_cmd": t_cmd, "cpu": ticks}


def figures(spec: Spec, raw: dict[str, Any], budget_s: float | None) -> dict[str, Any]:
    """What one run says: time and samples to target, the metric at the budget and after the epochs.

    Each eval is (time, metric, samples); the last scores the model after every epoch (the cluster's
    final eval, the lone run's and DDP's last epoch end), as a run that ended early raised in run_one.
    """
    evals = raw["evals"]
    hit = next((i for i, (_, m, _) in enumerate(evals) if spec.reached(m)), None)
    t_hit = None if hit is None else evals[hit][0]
    at_budget = None
    if budget_s is not None:
        within = [m for t, m, _ in evals if t - raw["first_step"] <= budget_s]
        at_budget = within[-1] if within else None
    return {
        "ttt_s": None if t_hit is None else t_hit - raw["first_step"],
        "ttt_cmd_s": None if t_hit is None else t_hit - raw["t_cmd"],
        "samples": None if hit is None else evals[hit][2],
        "budget_metric": at_budget,
        "final": evals[-1][1],
        "run_s": evals[-1][0] - raw["first_step"],
        "evals": len(evals),
        "service_cpu_share": None if raw["cpu"] is None else raw["cpu"].service_share(),
        "service_cpu_share_to_target": None if raw["cpu"] is None or t_hit is None
        else raw["cpu"].service_share(raw["first_step"], t_hit),
    }


def phases_until(bins: dict[int, dict[str, float]], t: float) -> dict[str, float]:
    """Seconds per phase spent by `t` (CLOCK_MONOTONIC): the bins that end by then, and the one that
    straddles it in proportion."""
    out: dict[str, float] = {}
    for k, row in bins.items():
        share = min(1.0, max(0.0, t / BIN_S - k))
        for phase, spent in row.items():
            out[phase] = out.get(phase, 0.0) + spent * share
    return out


def _median(values: list[Any]) -> Any:
    """The median, or None when a run missed (a run that never reached the target has no time)."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default="cnn,transformer,mlp")
    p.add_argument("--worlds", default="1x2,1x2slow,2x2slow")
    p.add_argument("--runs", default="ours,best,ddp,alone")
    p.add_argument("--repeats", type=int, default=3, help="alternated runs of each; medians over them")
    p.add_argument("--best", help="the best run's Trainer keywords for every job, as JSON (default: BEST, per job)")
    p.add_argument("--timeline", action="store_true", help="account each rank's time to phases; print it per run")
    p.add_argument("--evals-per-epoch", type=int, default=4,
                   help="score every run this many times an epoch, at the same samples (1: at epoch ends only)")
    p.add_argument("--lr-scale", type=float, default=1.0,
                   help="every run's learning rate times this (the job's own: 1)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    jobs, worlds, runs = (a.split(",") for a in (args.jobs, args.worlds, args.runs))
    if not (math.isfinite(args.lr_scale) and args.lr_scale > 0):
        p.error(f"--lr-scale {args.lr_scale} must be a positive number (1: the job's own learning rate)")
    for name, chosen, known in (("job", jobs, JOBS), ("world", worlds, WORLDS)):
        bad = [x for x in chosen if x not in known]
        if bad:
            p.error(f"unknown {name} {bad}: choose from {sorted(known)}")
    if args.child:  # one run's process (the launcher's roles too: FLODL_ROLE)
        if args.child == "ddp":
            run_ddp(jobs[0], worlds[0], args.evals_per_epoch, args.lr_scale)
        else:
            run_trainer(jobs[0], worlds[0], args.child, json.loads(args.best), args.timeline, args.evals_per_epoch,
                        args.lr_scale)
        return 0

    out: dict[str, Any] = {"load_average": os.getloadavg(), "repeats": args.repeats, "best": {},
                           "evals_per_epoch": args.evals_per_epoch, "lr_scale": args.lr_scale}
    table = []
    for job in jobs:
        spec = JOBS[job]
        best = args.best or json.dumps(BEST[job])
        out["best"][job] = json.loads(best)
        raw: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.repeats):
            if "alone" in runs:
                raw.setdefault(("alone", ""), []).append(
                    run_one(job, worlds[0], "alone", best, args.timeline, args.evals_per_epoch, args.lr_scale))
            for world in worlds:
                for run in (r for r in runs if r != "alone"):
                    raw.setdefault((run, world), []).append(
                        run_one(job, world, run, best, args.timeline, args.evals_per_epoch, args.lr_scale))
        alone_figs = [figures(spec, r, None) for r in raw.get(("alone", ""), [])]
        budget = _median([f["ttt_s"] for f in alone_figs])
        med: dict[tuple[str, str], dict] = {}
        figs_of: dict[tuple[str, str], list[dict]] = {}
        for (run, world), rs in raw.items():
            figs = figs_of[run, world] = [figures(spec, r, budget) for r in rs]
            med[run, world] = {k: _median([f[k] for f in figs]) for k in figs[0]}
        for (run, world), m in med.items():
            tag = f"{run}_{job}" + (f"_{world}" if world else "")
            for k, v in m.items():
                out[f"{k}_{tag}"] = v
            table.append((job, world or "alone", run, m))
            for label in raw[run, world][0]["timelines"]:  # medians over the repeats, per rank and phase
                runs_of = [r["timelines"].get(label, {}) for r in raw[run, world]]
                phases = sorted({k for t in runs_of for k in t})
                out[f"timeline_{tag}_{label}"] = {k: round(statistics.median(t.get(k, 0.0) for t in runs_of), 3)
                                                  for k in phases}
                cut = [phases_until(r["bins"].get(label, {}), r["first_step"] + f["ttt_s"])
                       for r, f in zip(raw[run, world], figs_of[run, world], strict=True) if f["ttt_s"] is not None]
                if cut:  # the same, from the start to the target, over the runs that reached it
                    out[f"timeline_to_target_{tag}_{label}"] = {
                        k: round(statistics.median(c.get(k, 0.0) for c in cut), 3)
                        for k in sorted({k for c in cut for k in c})}
            for label in raw[run, world][0]["steps"]:  # each process's steps: medians over the repeats
                of = [r["steps"][label] for r in raw[run, world] if label in r["steps"]]
                out["_".join(filter(None, ("steps", tag, label)))] = {
                    k: round(statistics.median(s[k] for s in of), 3) for k in ("n", "ms", "cpu_ms")}
        alone = med.get(("alone", ""))
        for world in worlds:
            for run, suffix in (("ours", ""), ("best", "_best")):
                m = med.get((run, world))
                if m is None:
                    continue
                key = f"{job}_{world}{suffix}"
                if alone and m["ttt_s"] and alone["ttt_s"]:
                    out[f"tta_speedup_vs_alone_{key}"] = round(alone["ttt_s"] / m["ttt_s"], 3)
                ddp = med.get(("ddp", world))
                if ddp and m["ttt_s"] and ddp["ttt_s"]:
                    out[f"tta_speedup_vs_ddp_{key}"] = round(ddp["ttt_s"] / m["ttt_s"], 3)
                if alone and m["run_s"] and alone["run_s"]:
                    out[f"run_speedup_vs_alone_{key}"] = round(alone["run_s"] / m["run_s"], 3)
                if alone and m["final"] is not None and alone["final"] is not None:
                    delta = (m["final"] - alone["final"]) * (100.0 if spec.higher_is_better else 1.0)
                    out[f"final_delta_vs_alone_{key}"] = round(delta, 3)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"time to target, medians of {args.repeats}; load average {out['load_average'][0]:.2f}; "
          f"best = {json.dumps(out['best'])}")
    print("job | world | run | ttt s (first step) | ttt s (command) | samples | metric at budget | final | "
          "all epochs s | svc cpu | svc cpu to target")
    for job, world, run, m in table:
        cells = [("-" if m[k] is None else f"{m[k]:.{d}f}") for k, d in
                 (("ttt_s", 2), ("ttt_cmd_s", 2), ("samples", 0), ("budget_metric", 4), ("final", 4),
                  ("run_s", 2), ("service_cpu_share", 3), ("service_cpu_share_to_target", 3))]
        print(f"{job} | {world} | {run} | " + " | ".join(cells))
    for k in sorted(out):
        if k.startswith(("tta_", "run_speedup", "final_delta", "timeline_", "steps_")):
            print(f"{k} = {out[k]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
