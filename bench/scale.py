"""What a world of many ranks costs the control plane: worlds 1x8, 2x4, 4x2, 8x1 and 8x4 on one machine.

    python bench/scale.py [--worlds 1x8,2x4,4x2,8x1,8x4] [--epochs 4] [--json]

A tiny model (a 16 -> 4 linear layer, 68 parameters) so compute is nothing
and every cost measured is the control plane's. The controller runs the real
`Trainer` (cpu-cadence); relays are the real relay; ranks are light: they
speak the rank's protocol (hello, coalesced step reports, deposits, consensus,
acks, chunk completions, heartbeats, goodbye) with the real codec but do not
import torch, so 32 of them start in seconds and fit in memory. A light
rank's step is a 2 ms sleep.

Figures per world H x R (H hosts, R ranks per host):

- formation_s: from spawning the processes to the last rank holding its
  first plan (torch's import in the controller included);
- round_ms: median round time, trigger to consensus published (the
  controller's own clock, `TrainResult.round_ms`), rounds of the first
  epoch left out;
- barrier_ms: median of the round as the ranks see it, from the last rank's
  window end (its last step before the round's deposit, asked or not) to the
  last rank's first step of its next window (the consensus loaded and the
  next plan in hand), same rounds;
- controller_cpu_ms: the controller process's CPU (user + system, /proc,
  10 ms ticks) over the steady window (first to last epoch end) per round
  in it;
- uplink_bytes: bytes the controller's control and data sockets received
  per round in the same window (TCP's count, `bytes_received` of `ss -ti`).

JSON keys: round_ms_h{H}_r{R}, barrier_ms_h{H}_r{R}, controller_cpu_ms_h{H}_r{R},
uplink_bytes_h{H}_r{R}, formation_s_h{H}_r{R}, rounds_h{H}_r{R}.
This script is also the job the launcher runs (FLODL_ROLE set).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

TAG = "SCALE_RESULT"
SAMPLES = 4096
BATCH = 8
STEP_S = 0.002
CLK_TCK = os.sysconf("SC_CLK_TCK")


def tiny_model():
    import torch

    return torch.nn.Linear(16, 4)


def tiny_dataset():
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 16, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g))


# --------------------------------------------------------------------------- the light rank


def light_rank() -> int:
    """A rank without torch: the protocol with the real codec, a sleep for a step."""
    import zmq

    from flodl_zmq.environment import ProcessEnv
    from flodl_zmq.errors import ReplayError
    from flodl_zmq.links import (
        CONTROL_MAX_FRAMES,
        DATA_MAX_FRAMES,
        FROM_REDUCER,
        coordinator_sender,
        local_endpoints,
        rank_identity,
        rank_sender,
        recv_bounded,
        relay_sender,
    )
    from flodl_zmq.wire import Attribution, Channel, Codec
    from flodl_zmq.wire import records as rec
    from flodl_zmq.wire.shm import SegmentMap, host_owner, is_by_reference, run_dir
    from flodl_zmq.wire.stream import InOrder, Outstream

    penv = ProcessEnv.from_environ()
    assert penv is not None and penv.rank is not None and penv.host is not None
    rank, host = penv.rank, penv.host
    codec = Codec(penv.key, penv.incarnation, rank_sender(rank))
    mapped = SegmentMap(penv.incarnation, run_dir(penv.key, penv.incarnation))
    from_relay = Attribution.signed_by(relay_sender(host), "this host's relay")
    from_coordinator = Attribution.signed_by(coordinator_sender(rank), "the coordinator's link")
    up, down = Outstream(codec), InOrder()  # the control streams of PROTOCOL.md 10.7, as a real rank keeps them
    ctx = zmq.Context()
    control_ep, data_ep = local_endpoints(penv.key, penv.incarnation, host)
    socks = []
    for ep in (control_ep, data_ep):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, rank_identity(rank))
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(ep)
        socks.append(s)
    control, data = socks
    params = np.zeros(68, dtype=np.float32)

    def send(record, payload=(), channel=Channel.CONTROL):
        if channel is Channel.DATA:
            data.send_multipart(codec.encode(record, list(payload), channel=channel))
        else:
            control.send_multipart(up.send(record, time.monotonic()))

    send(rec.RankHello(rank=rank, world_size=penv.world_size, host=host,
                       model_sig=bytes.fromhex(os.environ["BENCH_MODEL_SIG"]),
                       dataset_sig=bytes.fromhex(os.environ["BENCH_DATASET_SIG"])))
    spans: list[list] = []  # [epoch, steps left, steps total, samples, round deposited at its end or None]
    steps = since_avg = at_snapshot = last_deposit = 0
    pending: int | None = None
    held: list = []
    throttled = False
    first_plan = None
    deposits: list[tuple[float, int]] = []  # (window end: the last step before the deposit, round)
    last_step = 0.0
    resumes: list[tuple[float, int]] = []  # (first step after the round's consensus, round)
    resume_for: int | None = None
    report: list[float] = []
    report_opened = 0.0
    next_beat = 0.0
    poller = zmq.Poller()
    poller.register(control, zmq.POLLIN)
    poller.register(data, zmq.POLLIN)

    def add(plan) -> None:
        nonlocal first_plan
        first_plan = first_plan or time.monotonic()
        n = -(-plan.size // BATCH)
        if n:
            spans.append([plan.epoch, n, n, plan.size, getattr(plan, "deposit", None)])

    def flush() -> None:
        nonlocal report
        if report:
            send(rec.Batch(rank=rank, step_count=steps, batch_ms=report, data_ms=[0.0] * len(report),
                           batch_loss=[1.0] * len(report)))
            report = []

    def deposit(round_id: int) -> None:
        nonlocal at_snapshot, pending, last_deposit
        # The window ended at the last step; asked, the rank waited for the request since.
        flush()
        deposits.append((last_step, round_id))
        at_snapshot, pending, last_deposit = since_avg, round_id, round_id
        send(rec.SnapshotReady(rank=rank, round=round_id))
        send(rec.RoundFrame(round=round_id, rank=rank, mass=float(at_snapshot)), [params * at_snapshot], Channel.DATA)

    def handle(r) -> bool:
        """One coordinator record, in stream order; True to stop."""
        nonlocal throttled
        if isinstance(r, rec.StartEpoch):
            add(r.plan)
        elif isinstance(r, rec.Update):
            throttled = False
            if r.next_plan is not None and pending is not None:
                held.append(r.next_plan)  # trained only on this round's consensus
            elif r.next_plan is not None:
                add(r.next_plan)
        elif isinstance(r, rec.RequestParams) and r.round > last_deposit:  # else deposited at its span's end
            deposit(r.round)
        elif isinstance(r, rec.Throttle):
            throttled = True
        return isinstance(r, (rec.Shutdown, rec.ShutdownWithSave))

    stop = False
    while not stop:
        now = time.monotonic()
        if now >= next_beat:
            send(rec.Heartbeat(rank=rank, step_count=steps - len(report), ack=down.acked))
            next_beat = now + 0.5
        for frames in up.due(now):
            control.send_multipart(frames)
        can_train = bool(spans) and not throttled
        if not can_train:
            flush()
        events = dict(poller.poll(0 if can_train else 100))
        if control in events:
            while control.poll(0):
                frames = recv_bounded(control, CONTROL_MAX_FRAMES, copy=False)
                try:
                    env = codec.decode_from(frames, Channel.CONTROL, from_coordinator)
                except ReplayError:  # a resend whose first copy arrived
                    continue
                if isinstance(env.record, rec.CoordHeartbeat):
                    up.ack(env.record.ack)
                for r in down.accept(env.seq, env.record):
                    stop = stop or handle(r)
        if data in events:
            while data.poll(0):
                frames = recv_bounded(data, DATA_MAX_FRAMES, copy=False)
                sender = from_relay if is_by_reference(frames) else FROM_REDUCER
                env = mapped.decode(codec, frames, host_owner(host), Channel.BROADCAST, sender=sender, replay=False)
                c = env.record
                if isinstance(c, rec.Consensus) and c.round == pending:
                    since_avg -= at_snapshot
                    pending, resume_for = None, c.round
                    flush()
                    send(rec.SyncAck(rank=rank, round=c.round, step_count=steps, divergence=0.0,
                                     post_norm=1.0, pre_norm=1.0))
                    for plan in held:
                        add(plan)
                    held = []
        if spans and not throttled and not stop:
            if resume_for is not None:
                resumes.append((time.monotonic(), resume_for))
                resume_for = None
            time.sleep(STEP_S)
            last_step = time.monotonic()
            steps += 1
            since_avg += 1
            span = spans[0]
            span[1] -= 1
            if not report:
                report_opened = time.monotonic()
            report.append(STEP_S * 1000.0)
            if time.monotonic() - report_opened >= 0.05:
                flush()
            if span[1] == 0:
                spans.pop(0)
                flush()
                if span[4] is not None and span[4] > last_deposit:
                    deposit(span[4])  # told ahead: the window ends here
                send(rec.EpochMetrics(rank=rank, epoch=span[0], avg_loss=1.0, batches_processed=span[2],
                                      samples_processed=span[3], epoch_ms=span[2] * STEP_S * 1000.0,
                                      compute_only_ms=span[2] * STEP_S * 1000.0, data_starve_ms=0.0,
                                      scalar_sums={}, scalar_counts={}))
    flush()
    send(rec.Exiting(rank=rank))
    print(TAG + " " + json.dumps({"rank": rank, "first_plan": first_plan, "deposits": deposits, "resumes": resumes}),
          flush=True)
    for s in socks:
        s.close(2000)
    ctx.term()
    return 0


# --------------------------------------------------------------------------- the controller


def controller(epochs: int) -> int:
    import torch

    from flodl_zmq.api import Trainer

    ends: list[float] = []
    result = Trainer(
        model=tiny_model, optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        train_step=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        dataset=tiny_dataset(), batch_size=BATCH, epochs=epochs, mode="cpu-cadence", seed=1, quiet=True,
        metrics_fn=lambda row: ends.append(time.monotonic()),
    ).run()
    print(TAG + " " + json.dumps({"epoch_ends": ends, "round_ms": result.round_ms}), flush=True)
    return 0


# --------------------------------------------------------------------------- the parent


class ProcSampler:
    """Samples every 100 ms the controller's CPU ticks and the bytes its control and data sockets
    received (TCP's own count, `ss`): (monotonic time, ticks, bytes)."""

    def __init__(self, pid: int, port: int) -> None:
        self.pid = pid
        self.filter = f"( sport = :{port} or sport = :{port + 1} )"
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _received(self) -> int:
        out = subprocess.run(["ss", "-tinH", "state", "established", self.filter], capture_output=True, text=True,
                             timeout=10).stdout
        return sum(int(m) for m in re.findall(r"bytes_received:(\d+)", out))

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                with open(f"/proc/{self.pid}/stat") as fh:
                    fields = fh.read().rpartition(")")[2].split()
            except (OSError, IndexError):
                return
            self.samples.append((time.monotonic(), int(fields[11]) + int(fields[12]), self._received()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)

    def between(self, t0: float, t1: float) -> tuple[float, int]:
        """(CPU seconds, bytes received) between t0 and t1 (nearest samples)."""
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        return (b[1] - a[1]) / CLK_TCK, b[2] - a[2]


def run_world(hosts: int, per_host: int, epochs: int, sigs: dict[str, str]) -> dict:
    from flodl_zmq.launch import Cluster, free_port_base

    env = {"BENCH_MODEL_SIG": sigs["model"], "BENCH_DATASET_SIG": sigs["dataset"]}
    world = hosts * per_host
    port = free_port_base()
    cluster = Cluster(argv=[__file__, "--job", "--epochs", str(epochs)], hosts=hosts, ranks_per_host=per_host, port=port,
                      env_for={label: env for label in
                               [f"h{h}:{h * per_host + i}" for h in range(hosts) for i in range(per_host)]})
    t_spawn = time.monotonic()
    cluster.start()
    sampler = ProcSampler(cluster.pid("controller"), port)
    try:
        code = cluster.wait(900)
    finally:
        sampler.stop()
    ranks, ctl = {}, None
    for line in cluster.lines:
        _, _, text = line.partition("] ")
        if text.startswith(TAG):
            data = json.loads(text[len(TAG) + 1:])
            if "rank" in data:
                ranks[data["rank"]] = data
            else:
                ctl = data
    if code != 0 or ctl is None or len(ranks) != world:
        raise RuntimeError(f"world {hosts}x{per_host} failed (exit {code}):\n{cluster.output()[-6000:]}")
    t0, t1 = ctl["epoch_ends"][0], ctl["epoch_ends"][-1]
    rounds = sum(1 for t, _ in ranks[0]["deposits"] if t0 < t <= t1)
    cpu_s, read = sampler.between(t0, t1)
    steady = ctl["round_ms"][len(ctl["round_ms"]) // epochs:]  # the first epoch's rounds left out
    return {
        "formation_s": max(r["first_plan"] for r in ranks.values()) - t_spawn,
        "round_ms": statistics.median(steady),
        "barrier_ms": barrier_ms(ranks.values(), t0),
        "controller_cpu_ms": cpu_s * 1000.0 / max(rounds, 1),
        "uplink_bytes": read / max(rounds, 1),
        "rounds": len(ctl["round_ms"]),
    }


def barrier_ms(ranks, t0: float) -> float:
    """Median over the rounds after `t0` of the last rank's first step after the round's consensus minus the
    last rank's window end before its deposit in it (the round as the ranks wait for it)."""
    ends: dict[int, float] = {}
    starts: dict[int, float] = {}
    for r in ranks:
        for t, rnd in r["deposits"]:
            ends[rnd] = max(ends.get(rnd, t), t)
        for t, rnd in r["resumes"]:
            starts[rnd] = max(starts.get(rnd, t), t)
    return statistics.median((starts[r] - ends[r]) * 1000.0 for r in ends if r in starts and ends[r] > t0)


def signatures() -> dict[str, str]:
    from flodl_zmq.datasets import dataset_signature
    from flodl_zmq.payload import model_signature

    return {"model": model_signature(tiny_model()).hex(), "dataset": dataset_signature(tiny_dataset()).hex()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1x8,2x4,4x2,8x1,8x4", help="HOSTSxRANKS_PER_HOST, comma separated")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--json", action="store_true")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    role = os.environ.get("FLODL_ROLE")
    if role == "rank":
        return light_rank()
    if role in ("controller", "relay") or args.job:
        if role == "relay":
            from flodl_zmq.api import run_relay
            from flodl_zmq.environment import ProcessEnv

            penv = ProcessEnv.from_environ()
            assert penv is not None
            return run_relay(penv)
        return controller(args.epochs)
    sigs = signatures()
    figures: dict = {"load_average": os.getloadavg()}
    rows = []
    for item in args.worlds.split(","):
        h, r = (int(x) for x in item.split("x"))
        fig = run_world(h, r, args.epochs, sigs)
        rows.append((h, r, fig))
        for k, v in fig.items():
            figures[f"{k}_h{h}_r{r}"] = round(v, 3) if isinstance(v, float) else v
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"tiny model, cpu-cadence, {args.epochs} epochs of {SAMPLES} samples, batch {BATCH}, light ranks "
          f"({STEP_S * 1000:g} ms steps); load average {figures['load_average'][0]:.2f}")
    print("world | ranks | formation s | median round ms | median barrier ms | controller CPU ms / round | "
          "bytes in / round | rounds")
    for h, r, f in rows:
        print(f"{h}x{r} | {h * r} | {f['formation_s']:.1f} | {f['round_ms']:.1f} | {f['barrier_ms']:.1f} | "
              f"{f['controller_cpu_ms']:.1f} | "
              f"{f['uplink_bytes']:.0f} | {f['rounds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
