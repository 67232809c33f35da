"""Time to target against the peers: ours against torch PostLocalSGD, torchft DiLoCo and hivemind.

The topology, links and model of bench/wan.py (its helpers, imported): three
network namespaces on one bridge, `controller`, `worker1` and `worker2`, two
ranks per worker, and here EVERY link shaped both ways at the link's rate, the
controller's included, so no run has a free link. Tasks:

- mlp:         the digits MLP of 2.5 M parameters (bench/wan.py), SGD lr 0.05 momentum 0.9,
               batch 8 per rank, test accuracy >= 0.95
- transformer: examples/char_transformer.py (128 wide, 2 layers) on a 200 000 character corpus,
               AdamW lr 3e-3, batch 32 per rank, validation loss <= 2.5 nats/char
               (many rounds to the target)

Runs (interleaved, `--repeats` times each; every figure the median):

- flodl_nesterov, flodl_int8: ours as in bench/wan.py (outer Nesterov; int8
  on the wire), one round per task window (one epoch) on the mlp; on the
  transformer our best settings for it (Task.flodl, FLODL_TRANSFORMER: the
  batch split over the ranks, the overlapped round every 4 steps, no outer
  step). Scored as often as the peers in samples (`eval_every_samples`,
  EVAL_STEPS steps of the four ranks), at the first round to finish past
  each due point: our consensus changes only at a round.
- postlocalsgd: torch's post-local SGD: DDP with `post_localSGD_hook` (gradients
  all-reduced within each host, every step) and `PostLocalSGDOptimizer` with a
  `PeriodicModelAverager` over all four ranks every window steps; gloo, its
  TCPStore rendezvous on worker1 (rank 0); rank 0 evaluates its model every
  EVAL_STEPS steps, between averages too (more often than ours: the peer's edge).
- torchft_diloco: torchft's DiLoCo, one replica per rank, the outer step ours
  (Nesterov, lr 0.7, momentum 0.5) every window steps; its lighthouse in
  `controller`; every replica evaluates after each outer step.
- hivemind: `hivemind.Optimizer` with local updates, one peer per rank: each
  steps the task's optimizer on its own batches, and the swarm averages
  parameters each time the four have trained a window's samples between
  them; a DHT per rank, rank 0's the others' initial peer. Rank 0 evaluates
  its model every EVAL_STEPS steps, as PostLocalSGD's (a round starts at a
  sample count the swarm reaches, not at a step count).
A peer whose package is absent is null, printed as "not installed"
(`pip install -e '.[peers]'`).

Time to target: from the first step (start-up, joins and rendezvous excluded)
to the first eval at or past the target.

    sudo python bench/peers.py                       # both tasks, every run, 3 repeats
    sudo python bench/peers.py --tasks mlp --runs flodl_int8,postlocalsgd --repeats 1 --json

JSON keys: time_to_target_s_<run>_100mbit (mlp) and time_to_target_s_<run>_transformer_100mbit,
final_metric_<run>[_transformer]_100mbit; null where a run failed, missed the target or is not installed.
Needs root (namespaces, tc).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import wan  # noqa: E402

OURS = ("flodl_nesterov", "flodl_int8")
PEERS = {"postlocalsgd": None, "torchft_diloco": "torchft", "hivemind": "hivemind"}  # run -> package it needs
RUNS = (*OURS, *PEERS)
TASKS = ("mlp", "transformer")
EVAL_STEPS = 11  # a peer's eval cadence in steps: a quarter of the mlp's round, under half the transformer's
LINK = "100mbit"
HIVEMIND_PEER = "HIVEMIND_PEER"  # hivemind's rank 0 prints its DHT address after this tag: the others' initial peer


@dataclass(frozen=True)
class Task:
    """What every run trains, and the target that ends the race."""

    build: Callable[[], dict[str, Any]]  # model factory, train_step, dataset, eval_dataset, eval_fn
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batch: int
    # Batches per rank between two averages, every peer's run: one epoch (the data over 4 ranks x batch).
    window: int
    epochs: int
    target: float
    higher_is_better: bool
    flodl: dict[str, Any]  # our runs' Trainer keywords for the task beyond wan.FLODL's: our best found for it

    def reached(self, metric: float | None) -> bool:
        if metric is None:
            return False
        return metric >= self.target if self.higher_is_better else metric <= self.target


def _mlp() -> dict[str, Any]:
    from flodl_zmq.datasets import digits
    from flodl_zmq.demo import accuracy, cross_entropy_step

    train, test = digits()
    return {"model": wan.wide_mlp, "train_step": cross_entropy_step, "dataset": train, "eval_dataset": test,
            "eval_fn": accuracy}


def _transformer() -> dict[str, Any]:
    import char_transformer as ct

    train, val = ct.corpus(200_000, 20_000)
    return {"model": lambda: ct.CharTransformer(64, 128, 2, 4), "train_step": ct.step,
            "dataset": ct.Windows(train, 64), "eval_dataset": ct.Windows(val, 64), "eval_fn": ct.validation_loss}


# Our best for the transformer (docs/benchmarks.md, "bench/peers.py"), bench/tta.py's BEST over these links: the
# peers' batch of 32 split over the four ranks, the overlapped round every 4 steps, no outer step (the two runs
# then differ in their wire only). An epoch-long window took about twice the samples to the target.
FLODL_TRANSFORMER = {"mode": "cpu-async", "easgd_alpha": 1.0, "batch_size": 8, "anchor": 4, "max_anchor": 4, "outer": "none"}
TASK = {
    "mlp": Task(_mlp, wan.sgd, batch=wan.BATCH, window=44, epochs=8, target=0.95, higher_is_better=True,
                flodl={"anchor": 44, "max_anchor": 44}),
    "transformer": Task(_transformer, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01), batch=32,
                        window=24, epochs=12, target=2.5, higher_is_better=False, flodl=FLODL_TRANSFORMER),
}


# ---------------------------------------------------------------------------- inside the namespaces


def flodl_job(run: str, task: str, epochs: int) -> None:
    """The program every process of our run executes (controller, relays, ranks)."""
    from flodl_zmq.api import Trainer

    spec = TASK[task]
    keywords = {"batch_size": spec.batch, "mode": "cpu-cadence", **wan.FLODL[run], **spec.flodl}
    if keywords.get("outer", "none") != "none":
        keywords["outer_momentum"] = wan.OUTER_MOMENTUM
    result = Trainer(**spec.build(), optimizer=spec.optimizer, epochs=epochs, quiet=True,
                     eval_every_samples=EVAL_STEPS * 4 * spec.batch, **keywords).run()
    rows = [{"eval": e["metric"], "at_s": e["eval_at_s"]} for e in result.evals]
    print(f"{wan.TAG} " + json.dumps({"rows": rows, "final": result.final_eval}), flush=True)


def postlocalsgd_worker(rank: int, master: str, task: str, epochs: int, cap_s: float) -> None:
    """One PostLocalSGD rank: DDP within its host every step, all four averaged every window steps."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:29512", rank=rank, world_size=4)
    host, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    spec, job = TASK[task], TASK[task].build()
    torch.manual_seed(42)
    model = DistributedDataParallel(job["model"]())
    model.register_comm_hook(hook.PostLocalSGDState(None, host, start_localSGD_iter=1), hook.post_localSGD_hook)
    opt = PostLocalSGDOptimizer(spec.optimizer(model.parameters()), PeriodicModelAverager(spec.window, warmup_steps=1))
    rows: list[dict[str, Any]] = []
    dist.barrier()
    t0 = time.perf_counter()
    for step, batch in enumerate(_batches(job["dataset"], spec.batch, rank, epochs), start=1):
        opt.zero_grad()
        job["train_step"](model, batch).backward()
        opt.step()
        if step % EVAL_STEPS == 0 and _stop_together(rank, model.module, job, spec, rows, t0, cap_s):
            break
    if rank == 0:
        print(f"{wan.TAG} " + json.dumps({"rows": rows, "final": rows[-1]["eval"] if rows else None}), flush=True)
    dist.destroy_process_group()


def _stop_together(rank: int, model: torch.nn.Module, job: dict[str, Any], spec: Task, rows: list, t0: float,
                   cap_s: float) -> bool:
    """Rank 0 scores its model as the peer's user would, and decides for every rank whether to stop."""
    import torch.distributed as dist

    stop = torch.tensor([int(rank == 0 and _scored(model, job, spec, rows, t0, cap_s))])
    dist.broadcast(stop, 0)  # every rank stops at the same step
    return bool(stop.item())


def torchft_worker(rank: int, lighthouse: str, address: str, task: str, epochs: int, cap_s: float) -> None:
    """One torchft DiLoCo replica per rank: an outer Nesterov step (ours' lr and momentum) every window steps."""
    import socket
    from datetime import timedelta

    # torchft's checkpoint transport advertises socket.gethostname(), one name for every namespace here
    # (one UTS namespace): a replica healing from another would fetch from itself. Its address instead.
    socket.gethostname = lambda: address
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    spec, job = TASK[task], TASK[task].build()
    torch.manual_seed(42)
    model = job["model"]()
    inner = spec.optimizer(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=wan.OUTER_MOMENTUM, nesterov=True)
    store = TCPStore(address, 29600 + rank, is_master=True, wait_for_workers=False)  # the replica's own store
    wait = timedelta(seconds=wan.START_S)
    manager = Manager(pg=ProcessGroupGloo(timeout=wait), min_replica_size=4, use_async_quorum=False,
                      load_state_dict=lambda state: model.load_state_dict(state["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, replica_id=f"replica{rank}",
                      store_addr=address, store_port=29600 + rank, rank=0, world_size=1, lighthouse_addr=lighthouse,
                      hostname=address, port=29700 + rank, timeout=wait, quorum_timeout=wait, connect_timeout=wait)
    rows: list[dict[str, Any]] = []
    with DiLoCo(manager, [model], inner, outer, sync_every=spec.window, pin_memory=False):
        t0 = time.perf_counter()
        for step, batch in enumerate(_batches(job["dataset"], spec.batch, rank, epochs), start=1):
            inner.zero_grad()
            job["train_step"](model, batch).backward()
            inner.step()
            # After an outer step every replica holds the same model: each evaluates it, and all stop together.
            if step % spec.window == 0 and _scored(model, job, spec, rows, t0, cap_s):
                break
    if rank == 0:
        print(f"{wan.TAG} " + json.dumps({"rows": rows, "final": rows[-1]["eval"] if rows else None}), flush=True)
    manager.shutdown(wait=False)
    del store


def hivemind_worker(rank: int, address: str, initial_peer: str | None, task: str, epochs: int,
                    cap_s: float) -> None:
    """One hivemind peer per rank: local steps, parameters averaged once the world has trained a window."""
    import hivemind

    torch.set_num_threads(1)
    spec, job = TASK[task], TASK[task].build()
    torch.manual_seed(42)
    model = job["model"]()
    # p2pd listens on 127.0.0.1 unless told: each namespace's own address, or no other host reaches it.
    dht = hivemind.DHT(initial_peers=[initial_peer] if initial_peer else None, host_maddrs=[f"/ip4/{address}/tcp/0"],
                       start=True)
    if initial_peer is None:
        print(f"{HIVEMIND_PEER} {dht.get_visible_maddrs()[0]}", flush=True)
    # Local updates: a step per batch, the parameters averaged every target_batch_size samples (our window across
    # the world), as ours, PostLocalSGD and DiLoCo do. hivemind's default instead accumulates gradients to
    # target_batch_size for one step: `window` times fewer steps, each at a learning rate tuned for one batch.
    # Averaging in step (delay_state_averaging=False): in the background (the default) every local step waits for
    # the round anyway, outside the tracker's pause, so the swarm's estimated samples run on while all wait and the
    # next round starts after one step. A group closes once all four are in (target_group_size), else after
    # matchmaking_time: 5 s, hivemind's upper value for small local runs, above its 3 s request_timeout as it asks.
    opt = hivemind.Optimizer(dht=dht, run_id=f"flodl_peers_{task}", target_batch_size=4 * spec.window * spec.batch,
                             batch_size_per_step=spec.batch, params=model.parameters(), optimizer=spec.optimizer,
                             use_local_updates=True, delay_state_averaging=False, matchmaking_time=5.0,
                             averaging_timeout=30.0, averager_opts={"target_group_size": 4})
    _all_joined(dht, f"flodl_peers_{task}_joined", rank)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for step, batch in enumerate(_batches(job["dataset"], spec.batch, rank, epochs), start=1):
        opt.zero_grad()
        job["train_step"](model, batch).backward()
        opt.step()
        if rank == 0 and step % EVAL_STEPS == 0 and _scored(model, job, spec, rows, t0, cap_s):
            break
    if rank == 0:
        print(f"{wan.TAG} " + json.dumps({"rows": rows, "final": rows[-1]["eval"] if rows else None}), flush=True)
    opt.shutdown()
    dht.shutdown()


def _all_joined(dht: Any, key: str, rank: int) -> None:
    """Wait (up to wan.START_S) until all four peers have their record under `key` in the DHT: the rendezvous,
    so that no peer trains alone while the others start (start-up is not timed, as for every run)."""
    from hivemind.utils import get_dht_time

    dht.store(key, True, expiration_time=get_dht_time() + wan.START_S, subkey=rank)
    deadline = time.monotonic() + wan.START_S
    while (got := dht.get(key, latest=True)) is None or len(got.value) < 4:
        if time.monotonic() > deadline:
            raise TimeoutError(f"hivemind rank {rank}: {0 if got is None else len(got.value)} of 4 peers in the DHT "
                               f"after {wan.START_S:g} s; see the other ranks' logs for why they did not join")
        time.sleep(0.5)


def _batches(data: Any, batch: int, rank: int, epochs: int) -> Any:
    """Rank `rank`'s batches of each epoch's shared permutation (the tail dropped: equal steps everywhere)."""
    from torch.utils.data import default_collate

    from flodl_zmq.sampling import epoch_permutation

    for epoch in range(epochs):
        perm = epoch_permutation(42, epoch, len(data))
        mine = perm[: len(perm) // (4 * batch) * 4 * batch][rank::4]
        for i in range(0, len(mine) - batch + 1, batch):
            yield default_collate([data[int(j)] for j in mine[i : i + batch]])


def _scored(model: torch.nn.Module, job: dict[str, Any], spec: Task, rows: list, t0: float, cap_s: float) -> bool:
    """Evaluate `model`, record the row; True at the target or past cap_s."""
    model.eval()
    with torch.no_grad():
        metric = float(job["eval_fn"](model, job["eval_dataset"]))
    model.train()
    rows.append({"eval": metric, "at_s": time.perf_counter() - t0})
    return spec.reached(metric) or rows[-1]["at_s"] > cap_s


# ---------------------------------------------------------------------------- the harness


def run_peer(net: Any, run: str, task: str, epochs: int, cap_s: float, logs: Path) -> dict[str, Any] | None:
    """A peer's four ranks (and torchft's lighthouse in `controller`): rank 0's result line, or None."""
    env = wan.environ({"GLOO_SOCKET_IFNAME": "eth0"})
    procs, files = [], []
    if run == "torchft_diloco":
        files.append(open(logs / f"{run}-{task}-lighthouse.log", "w"))  # noqa: SIM115
        procs.append(net.popen("controller", [str(wan.BIN / "torchft_lighthouse"), "--min_replicas", "4",
                                              "--bind", "[::]:29510"], env=env, stdout=files[-1], stderr=subprocess.STDOUT))
    rank0, initial_peer = len(procs), None
    try:
        for rank in range(4):
            host = "worker1" if rank < 2 else "worker2"
            files.append(open(logs / f"{run}-{task}-rank{rank}.log", "w"))  # noqa: SIM115
            procs.append(net.popen(host, [sys.executable, str(Path(__file__).resolve()), "--peer", run, "--rank",
                                          str(rank), *_where(net, run, host, initial_peer), "--task", task,
                                          "--epochs", str(epochs), "--cap", str(cap_s)],
                                   env=env, stdout=files[-1], stderr=subprocess.STDOUT))
            # hivemind's others join through rank 0's DHT, whose address (its peer id in it) exists once it is up.
            if run == "hivemind" and rank == 0:
                initial_peer = _printed(logs / f"{run}-{task}-rank0.log", HIVEMIND_PEER, procs[rank0])
                if initial_peer is None:
                    print(f"  {run} {task}: rank 0 printed no DHT address within {wan.START_S:g} s", file=sys.stderr)
                    break
        else:  # every rank started
            procs[rank0].wait(cap_s + wan.START_S)
    except subprocess.TimeoutExpired:
        print(f"  {run} {task}: rank 0 still running after {cap_s + wan.START_S:g} s", file=sys.stderr)
    finally:
        wan.stop(net, procs)
        for f in files:
            f.close()
    text = (logs / f"{run}-{task}-rank0.log").read_text(errors="replace")
    got = wan.result_line(text)
    if got is None:
        print(f"  {run} {task}: rank 0 printed no result:\n{text[-1500:]}", file=sys.stderr)
    return got


def _where(net: Any, run: str, host: str, initial_peer: str | None) -> list[str]:
    """A peer rank's addresses: PostLocalSGD's TCPStore is rank 0's, on worker1; a torchft replica serves its own
    store on its host, the lighthouse in `controller`; a hivemind peer's DHT listens on its host's address."""
    if run == "postlocalsgd":
        return ["--master", net.hosts["worker1"].address]
    if run == "torchft_diloco":
        return ["--master", net.hosts[host].address, "--lighthouse", f"http://{net.hosts['controller'].address}:29510"]
    return ["--master", net.hosts[host].address, *(["--initial-peer", initial_peer] if initial_peer else [])]


def _printed(log: Path, tag: str, proc: subprocess.Popen) -> str | None:
    """What `proc` printed after `tag` in its log, once it does (up to wan.START_S); None if it exits first."""
    deadline = time.monotonic() + wan.START_S
    while proc.poll() is None and time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(f"{tag} "):
                return line.split(maxsplit=1)[1]
        time.sleep(0.2)
    return None


def run_once(net: Any, run: str, task: str, epochs: int, cap_s: float, logs: Path) -> dict[str, Any] | None:
    """One run of `run` on `task`: its result line (rows of eval and time), or None."""
    if run in OURS:
        program = [str(Path(__file__).resolve()), "--job", run, "--task", task, "--epochs", str(epochs)]
        return wan.run_flodl(net, f"{run}-{task}", program, logs, timeout_s=cap_s * 2 + wan.START_S)
    return run_peer(net, run, task, epochs * 4, cap_s, logs)


def missing(run: str) -> str | None:
    """Why `run` cannot run here ("not installed"), or None when it can."""
    package = PEERS.get(run)
    return "not installed" if package is not None and importlib.util.find_spec(package) is None else None


def time_to_target(got: dict[str, Any] | None, spec: Task) -> float | None:
    if got is None:
        return None
    return next((r["at_s"] for r in got["rows"] if spec.reached(r["eval"])), None)


def measure(tasks: list[str], runs: list[str], repeats: int, epochs: int | None, cap_s: float) -> dict[str, Any]:
    """Every runnable run on every task, interleaved `repeats` times over shaped links: the JSON figures."""
    from tests.cluster.netns import network_or_skip

    out: dict[str, Any] = {}
    logs = Path(tempfile.mkdtemp(prefix="flodl-peers-"))
    with network_or_skip("controller", "worker1", "worker2") as net:
        for host in net.hosts:
            wan.shape(net, host, wan.RATES[LINK])
        for task in tasks:
            spec, suffix = TASK[task], "" if task == "mlp" else f"_{task}"
            each: dict[str, list[dict[str, Any]]] = {run: [] for run in runs if missing(run) is None}
            for i in range(repeats):
                here = logs / f"{task}-{i}"
                here.mkdir()
                for run in each:
                    got = run_once(net, run, task, epochs or spec.epochs, cap_s, here)
                    each[run].append({"time": time_to_target(got, spec), "final": got and got["final"]})
                    print(f"  {task} {run} #{i + 1}: {each[run][-1]}", file=sys.stderr, flush=True)
            for run in runs:
                figures = each.get(run, [{"time": None, "final": None}])
                out[f"time_to_target_s_{run}{suffix}_{LINK}"] = wan.median([f["time"] for f in figures])
                out[f"final_metric_{run}{suffix}_{LINK}"] = wan.median([f["final"] for f in figures])
    print(f"logs in {logs}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS), help="comma list of " + ", ".join(TASKS))
    p.add_argument("--runs", default=",".join(RUNS), help="comma list of " + ", ".join(RUNS))
    p.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved; figures are their medians")
    p.add_argument("--epochs", type=int, help="ours trains this many epochs, a peer up to 4x (default: the task's)")
    p.add_argument("--cap", type=float, default=300.0, help="a peer stops after its first epoch past this many s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--task", default="mlp", help=argparse.SUPPRESS)  # inside the namespaces
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)  # inside the namespaces: a peer's rank
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--initial-peer", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        flodl_job(args.job, args.task, args.epochs)
        return 0
    if args.peer == "postlocalsgd":
        postlocalsgd_worker(args.rank, args.master, args.task, args.epochs, args.cap)
        return 0
    if args.peer == "torchft_diloco":
        torchft_worker(args.rank, args.lighthouse, args.master, args.task, args.epochs, args.cap)
        return 0
    if args.peer == "hivemind":
        hivemind_worker(args.rank, args.master, args.initial_peer, args.task, args.epochs, args.cap)
        return 0
    tasks, runs = [t for t in args.tasks.split(",") if t], [r for r in args.runs.split(",") if r]
    unknown = sorted(set(tasks) - set(TASKS)) + sorted(set(runs) - set(RUNS))
    if unknown:
        p.error(f"unknown task or run {unknown}: tasks are {TASKS}, runs {RUNS}")
    out = measure(tasks, runs, args.repeats, args.epochs, args.cap)
    load = os.getloadavg()
    print(f"medians of {args.repeats} run(s) each over {LINK} links (every link shaped, the controller's too)")
    for task in tasks:
        suffix = "" if task == "mlp" else f"_{task}"
        for run in runs:
            t, m = out[f"time_to_target_s_{run}{suffix}_{LINK}"], out[f"final_metric_{run}{suffix}_{LINK}"]
            shown = missing(run) or ("-" if t is None else f"{t:.1f} s")
            print(f"{task:12} {run:15} to target {shown:>12}   final {'-' if m is None else format(m, '.4f')}")
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} cores)")
    if args.json:
        print(json.dumps({**out, "repeats": args.repeats, "load_avg_1m": load[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
