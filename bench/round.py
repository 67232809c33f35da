"""Round time of the ZeroMQ data plane against torch.distributed gloo, on one machine.

A round: every rank deposits its (mass-premultiplied) parameters, cut in the
protocol's chunks of 2^21 values as the rank runtime cuts them, relays fold,
the reducer divides once and publishes, relays fan out; the round ends when
the last rank holds the verified consensus. Measured from the first deposit
sent to the last consensus verified, across processes (CLOCK_MONOTONIC is
system-wide), median over rounds after warm-up. Topology: 4 rank processes as
2 hosts x 2 ranks, one relay process per host (ranks on ipc://), relays to the
controller process over tcp loopback, every record authenticated. By default
ranks deposit and receive the consensus by reference in shared memory, as the
rank runtime does with a same-host relay (`--transports socket`: as frames).

gloo: 4 processes, all_reduce + divide on one tensor of the same size, same
clock rule (first rank to start -> last rank done).

Also the CPU time all processes of each side spend per round after warm-up
(user + system, from /proc; 10 ms ticks, so read it over several rounds): on
a machine with few cores the round time cannot beat total CPU / cores. And the
fold throughput: the relay's f32 (and bf16) accumulate against numpy `a += b`
on the same bytes.

    python bench/round.py                 # table
    python bench/round.py --json          # {"ratio_f32_25M": ..., "zmq_cpu_ms_f32_25M": ..., ...}
    python bench/round.py --sizes 1M --rounds 5
    python bench/round.py --transports shm,socket   # also the framed path, for comparison
    python bench/round.py --device cuda --sizes 1M,10M --repeats 1   # CUDA ranks (scripts/gpu-check.sh)

`--device cuda`: each rank's parameters live on its GPU (`cuda:LOCAL_RANK`,
modulo the GPUs there are) and every round goes through the rank runtime's
own CUDA path (`param_buffers.ParamBuffers`: the snapshot copied device to host into
pinned or shared memory, the consensus loaded back host to device); gloo
all-reduces a tensor on the same device. Default `cpu`: numpy ranks, the
data plane alone.

Each case runs gloo and ours `--repeats` times, alternated, and takes the
median over every measured round of every run: this machine drifts by tens
of percent from one minute to the next, and alternation spreads that over
both sides.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

HOSTS = {"a": (0, 1), "b": (2, 3)}
ROUTE_SECRET = bytes(range(32))  # the controller's: each relay's hello proves its host with a token of it
WORLD = 4
MASS = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
SIZES = {"1M": 1_000_000, "10M": 10_000_000, "25M": 25_000_000}


def start(proc: Any, role: str) -> None:
    """Start a spawned child with what the launcher gives `role` at start-up (glibc tunables, a service's
    thread count); this process's environment, which the next child inherits, is left as it was."""
    from flodl_zmq.environment import with_tunables

    saved = dict(os.environ)
    os.environ.update(with_tunables(os.environ, role))
    try:
        proc.start()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def die_with_parent() -> None:
    """End this spawned child as soon as the bench's process is gone, however it went: a child left behind
    waits on a stop event or a barrier no one will set, on the machine's cores for ever. The parent's
    sentinel is a pipe only the parent's death closes: the launcher's lifeline rule."""
    from flodl_zmq.environment import watch_lifeline

    watch_lifeline(mp.parent_process().sentinel)


# ---------------------------------------------------------------------- zmq data plane processes


def _controller(port: int, key: bytes, run_id: bytes, dtype: str, stop: Any) -> None:
    die_with_parent()
    import logging
    logging.basicConfig(level=logging.WARNING)
    import zmq

    from flodl_zmq.endpoints import ControllerAddress
    from flodl_zmq.io_threads import controller_context, keep_off_the_data_plane
    from flodl_zmq.reducer_config import ReducerConfig
    from flodl_zmq.reducer_service import ReducerService
    from flodl_zmq.wire import Channel
    from flodl_zmq.wire_format import named

    address = ControllerAddress("127.0.0.1", port)
    svc = ReducerService(ReducerConfig.for_controller(HOSTS, key, run_id, address, wire=named(dtype),
                                                      route_secret=ROUTE_SECRET))
    svc.start()
    # No coordinator here, but the relays' control links need a listener: a client that
    # keeps reconnecting to a local port nobody listens on can end up connected to
    # itself (TCP simultaneous open) and read its own records back as replays.
    control = controller_context().socket(zmq.ROUTER)
    keep_off_the_data_plane(control)
    control.bind(address.endpoint(Channel.CONTROL))
    while not stop.is_set():
        if control.poll(100):
            control.recv_multipart()
    control.close(0)
    svc.stop()


def _relay(host: str, port: int, key: bytes, run_id: bytes, dtype: str, ipc_dir: str, stop: Any) -> None:
    die_with_parent()
    import logging
    logging.basicConfig(level=logging.WARNING)
    from flodl_zmq.endpoints import ControllerAddress
    from flodl_zmq.links import host_token, local_endpoints
    from flodl_zmq.relay import Relay
    from flodl_zmq.relay_config import RelayConfig
    from flodl_zmq.wire_format import named

    # The ranks here beat only between rounds: a long silence limit keeps the relay from
    # declaring a busy rank dead mid-benchmark.
    cfg = RelayConfig.for_controller(host, HOSTS[host], key, run_id, ControllerAddress("127.0.0.1", port),
                                     local_endpoints(key, run_id, host, ipc_dir), rank_silence_at_relay_s=10.0,
                                     wire=named(dtype), host_token=host_token(ROUTE_SECRET, host))
    relay = Relay(cfg)
    relay.start()
    stop.wait()
    relay.stop()


def rank_heartbeats(ctx: Any, key: bytes, run_id: bytes, rank: int, endpoint: str, stop: threading.Event) -> None:
    """A stand-in rank's beats to its relay every 0.5 s until `stop`, with a codec of their own (a codec's
    sequence belongs to one thread): the relay declares a silent rank dead. bench/topology.py's too."""
    import zmq

    from flodl_zmq.links import rank_identity, rank_sender
    from flodl_zmq.wire import Codec
    from flodl_zmq.wire.records import Heartbeat

    codec = Codec(key, run_id, rank_sender(rank))
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, rank_identity(rank))
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    while not stop.wait(0.5):
        s.send_multipart(codec.encode(Heartbeat(rank, 0)))
    s.close(0)


def _rank(rank: int, host: str, n: int, dtype: str, transport: str, rounds: int, key: bytes, run_id: bytes,
          ipc_dir: str, barrier: Any, out: Any, stop: Any, device: str = "cpu") -> None:
    die_with_parent()
    import zmq

    from flodl_zmq.links import local_endpoints, rank_identity, rank_sender
    from flodl_zmq.tensors import DTYPES, as_numpy, bf16_from_f32
    from flodl_zmq.wire import Channel, Codec
    from flodl_zmq.wire.records import RoundFrame
    from flodl_zmq.wire.shm import (
        Segment,
        SegmentMap,
        by_reference,
        host_owner,
        rank_owner,
        run_dir,
    )
    from flodl_zmq.wire_format import chunks

    control_ep, data_ep = local_endpoints(key, run_id, host, ipc_dir)
    codec = Codec(key, run_id, rank_sender(rank))
    ctx = zmq.Context()
    beating = threading.Event()
    beat = threading.Thread(target=rank_heartbeats, args=(ctx, key, run_id, rank, control_ep, beating), daemon=True)
    beat.start()
    data = ctx.socket(zmq.DEALER)
    data.setsockopt(zmq.IDENTITY, rank_identity(rank))
    data.setsockopt(zmq.LINGER, 0)
    data.connect(data_ep)
    decoder = Codec(key, run_id, "bench")
    params = np.full(n, MASS[rank] * (rank + 1), np.float32)  # pre-scaled by the mass
    # The snapshot buffer, cut in the protocol's chunks as a rank's is: in the rank's shared-memory
    # segment (by reference) or its own memory.
    segment = Segment(key, run_id, rank_owner(rank)) if transport == "shm" else None
    cuts = chunks(n)
    item = DTYPES[dtype].itemsize
    wires = [np.empty(b - a, DTYPES[dtype]) for a, b in cuts] if segment is None else [
        np.frombuffer(view, DTYPES[dtype]) for view in segment.layout([(b - a) * item for a, b in cuts])]
    for wire, (a, b) in zip(wires, cuts, strict=True):
        if dtype == "bf16":
            bf16_from_f32(params[a:b], wire)
        else:
            np.copyto(wire, params[a:b])
    dtypes = [dtype] * len(wires)
    buffers = None
    if device == "cuda":
        import torch

        buffers = _cuda_buffers(rank, host, n, dtype, segment)
    mapped = SegmentMap(run_id, run_dir(key, run_id))
    expect = sum(MASS[r] * (r + 1) for r in range(WORLD)) / sum(MASS.values())
    for round_id in range(1, rounds + 1):
        barrier.wait(timeout=120)
        t0 = time.monotonic_ns()
        if buffers is not None:
            wires = [as_numpy(t) for t in buffers.snapshot(MASS[rank])]  # device -> host, the deposit's chunks
        deposit = RoundFrame(round_id, rank, MASS[rank])
        if segment is None:
            data.send_multipart(codec.encode(deposit, wires, dtypes=dtypes), copy=False)
        else:
            data.send_multipart(by_reference(codec, deposit, wires, segment, dtypes=dtypes))
        if not data.poll(120_000):
            raise TimeoutError(f"rank {rank}: no consensus for round {round_id}")
        env = mapped.decode(decoder, data.recv_multipart(copy=False), host_owner(host), Channel.BROADCAST, replay=False)
        if buffers is not None:
            buffers.load(env.payload)  # host -> device, as a rank adopts the consensus
            torch.cuda.synchronize(buffers.device)
        t1 = time.monotonic_ns()
        if env.record.round != round_id:
            raise RuntimeError(f"rank {rank}: got round {env.record.round}, expected {round_id}")
        head = env.payload[0][:1]
        first = float(head[0]) if dtype == "f32" else float((head.astype(np.uint32) << 16).view(np.float32)[0])
        if abs(first - expect) > 1e-2 * abs(expect):
            raise RuntimeError(f"rank {rank}: consensus {first} != {expect}")
        out.put((round_id, rank, t0, t1))
    beating.set()
    beat.join()
    ctx.destroy(0)
    if segment is not None:
        segment.close()


def _cuda_buffers(rank: int, host: str, n: int, dtype: str, segment: Any) -> Any:
    """The rank runtime's snapshot/load buffers over one n-element parameter on this rank's GPU."""
    import torch

    from flodl_zmq.param_buffers import ParamBuffers
    from flodl_zmq.wire_format import named

    device = torch.device("cuda", HOSTS[host].index(rank) % torch.cuda.device_count())
    holder = torch.nn.Module()
    holder.p = torch.nn.Parameter(torch.full((n,), float(rank + 1), device=device))
    return ParamBuffers(holder, segment, named(dtype))


def zmq_rounds(n: int, dtype: str, transport: str, rounds: int, warmup: int, device: str = "cpu") -> Rounds:
    """Round times of the zmq data plane (controller, relays and ranks)."""
    import tempfile

    from flodl_zmq.launch import free_port_base
    from flodl_zmq.wire import new_key
    from flodl_zmq.wire.shm import unlink_run

    ctx = mp.get_context("spawn")
    key, run_id = new_key(), os.urandom(16)
    port = free_port_base()
    stop, barrier, out = ctx.Event(), ctx.Barrier(WORLD), ctx.Queue()
    ipc_dir = tempfile.mkdtemp(prefix="flodl-bench-")
    procs = {ctx.Process(target=_controller, args=(port, key, run_id, dtype, stop)): "controller"}
    procs.update({ctx.Process(target=_relay, args=(h, port, key, run_id, dtype, ipc_dir, stop)): "relay"
                  for h in HOSTS})
    procs.update({ctx.Process(target=_rank, args=(r, h, n, dtype, transport, rounds, key, run_id, ipc_dir, barrier,
                                                  out, stop, device)): "rank" for h, rs in HOSTS.items() for r in rs})
    for p, role in procs.items():
        start(p, role)
    try:
        return round_times(out, rounds, warmup, [p.pid for p in procs])
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        unlink_run(key, run_id)


@dataclass
class Rounds:
    """Per-round wall times (s) and the CPU seconds every process spent per round after warm-up."""

    times: list[float]
    cpu_per_round: float


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of `pids` so far (Linux /proc), in seconds."""
    ticks = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def round_times(out: Any, rounds: int, warmup: int, pids: list[int]) -> Rounds:
    """Per round, seconds from the first rank's start to the last rank's end (each rank puts one
    tuple); and the CPU every process in `pids` spent per round once `warmup` rounds were done."""
    times: dict[int, list[tuple[int, int]]] = {}
    cpu0 = cpu_seconds(pids) if warmup == 0 else None
    for _ in range(rounds * WORLD):
        round_id, _rank_id, t0, t1 = out.get(timeout=120)
        times.setdefault(round_id, []).append((t0, t1))
        if round_id == warmup and len(times[round_id]) == WORLD:
            cpu0 = cpu_seconds(pids)
    cpu = (cpu_seconds(pids) - cpu0) / (rounds - warmup) if cpu0 is not None and rounds > warmup else float("nan")
    return Rounds([(max(t1 for _, t1 in v) - min(t0 for t0, _ in v)) / 1e9 for _, v in sorted(times.items())], cpu)


def summary(runs: list[Rounds], warmup: int) -> tuple[float, float]:
    """Median round time over the measured rounds of every run, and the mean CPU per round."""
    return (statistics.median(t for r in runs for t in r.times[warmup:]),
            statistics.mean(r.cpu_per_round for r in runs))


# ---------------------------------------------------------------------- gloo


def _gloo(rank: int, port: int, n: int, dtype: str, rounds: int, out: Any, device: str = "cpu") -> None:
    die_with_parent()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    where = torch.device("cuda", rank % 2 % torch.cuda.device_count()) if device == "cuda" else torch.device("cpu")
    t = torch.full((n,), float(rank + 1), dtype=torch.float32 if dtype == "f32" else torch.bfloat16, device=where)
    for round_id in range(1, rounds + 1):
        dist.barrier()
        t0 = time.monotonic_ns()
        dist.all_reduce(t)
        t.div_(WORLD)
        if where.type == "cuda":
            torch.cuda.synchronize(where)
        t1 = time.monotonic_ns()
        out.put((round_id, rank, t0, t1))
    dist.destroy_process_group()


def gloo_rounds(n: int, dtype: str, rounds: int, warmup: int, device: str = "cpu") -> Rounds:
    from flodl_zmq.launch import free_port_base

    ctx = mp.get_context("spawn")
    port = free_port_base()
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo, args=(r, port, n, dtype, rounds, out, device)) for r in range(WORLD)]
    for p in procs:
        start(p, "rank")  # what a gloo job's processes would get from our launcher
    try:
        return round_times(out, rounds, warmup, [p.pid for p in procs])
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# ---------------------------------------------------------------------- fold throughput


def fold_throughput(n: int, dtype: str, repeats: int = 5) -> float:
    """The relay fold's accumulate time over numpy `a += b` time on the same bytes (higher is better)."""
    from flodl_zmq.sums import SumImage
    from flodl_zmq.tensors import bf16_from_f32

    src = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x = bf16_from_f32(src, np.empty(n, np.uint16)) if dtype == "bf16" else src
    image = SumImage(((dtype, (n,)),))
    image.fill([x])
    a, b = src.copy(), src.copy()

    def best(fn) -> float:
        fn()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    fold_t = best(lambda: image.add([x]))
    numpy_t = best(lambda: np.add(a, b, out=a))
    return numpy_t / fold_t


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1M,10M,25M", help="comma list of 1M, 10M, 25M")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--rounds", type=int, default=8, help="measured rounds per case (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each side per case, alternated; the median is over every measured round")
    p.add_argument("--transports", default="shm",
                   help="comma list: shm (same-host ranks deposit and load by reference), socket (frames)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each rank's parameters live (cuda: the rank runtime's CUDA path; see above)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda needs a GPU and a CUDA build of torch (torch.cuda.is_available() is False)")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every spawned child
    total = args.rounds + args.warmup
    transports = args.transports.split(",")
    figures: dict[str, float] = {}
    for size in args.sizes.split(","):
        n = SIZES[size]
        for dtype in args.dtypes.split(","):
            gloo: list[Rounds] = []
            ours: dict[str, list[Rounds]] = {t: [] for t in transports}
            for _ in range(args.repeats):  # alternated, so the machine's drift hits both sides alike
                gloo.append(gloo_rounds(n, dtype, total, args.warmup, args.device))
                for transport in transports:
                    ours[transport].append(zmq_rounds(n, dtype, transport, total, args.warmup, args.device))
            g, g_cpu = summary(gloo, args.warmup)
            figures[f"gloo_ms_{dtype}_{size}"] = round(g * 1e3, 2)
            figures[f"gloo_cpu_ms_{dtype}_{size}"] = round(g_cpu * 1e3, 1)
            fold = figures[f"fold_vs_numpy_{dtype}_{size}"] = round(fold_throughput(n, dtype), 3)
            for transport in transports:
                z, z_cpu = summary(ours[transport], args.warmup)
                tag = "" if transport == "shm" else f"{transport}_"
                figures[f"zmq_ms_{tag}{dtype}_{size}"] = round(z * 1e3, 2)
                figures[f"zmq_cpu_ms_{tag}{dtype}_{size}"] = round(z_cpu * 1e3, 1)
                figures[f"ratio_{tag}{dtype}_{size}"] = round(z / g, 3)
                if not args.json:
                    print(f"{size:>4} {dtype:>4} {transport:>6}: zmq {z * 1e3:8.1f} ms  gloo {g * 1e3:8.1f} ms  "
                          f"ratio {z / g:5.2f}  cpu/round zmq {z_cpu * 1e3:6.1f} ms "
                          f"gloo {g_cpu * 1e3:6.1f} ms  fold/numpy {fold:.2f}", flush=True)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
