"""A round over shaped host links against the bandwidth bound and gloo's ring: one reducer, and sharded.

Topology: network namespaces on one bridge (tests/cluster/netns.py): `controller`
and hosts `h1`..`hH`, every link shaped both ways with tbf at `--rate` (1 Gbit/s
by default; bench/wan.py's `shape`), the controller's included, so no process
has a free link. One rank per host: a round's cost is in the links, not in the
ranks of a host (bench/scale.py measures those).

- ours (`round_s_<H>h_<M>_s1`): today's layout, one reducer shard. The real
  reducer service in `controller`, the real relay on each host, and a light rank
  that deposits an M-parameter f32 vector into its shared-memory segment (as the
  rank runtime does) and waits for the verified consensus, as bench/round.py's.
  The relay and the reducer take the run's settings from the environment
  (FLODL_LINK_SILENCE, ...), as a real run's do. Every host frame crosses the reducer's one link in, every consensus out: that
  link carries H x M bytes each way per round.
- sharded across the H hosts (`round_s_<H>h_<M>_s<H>`; the key counts the host
  shards): H + 1 reducer shards (flodl_zmq/shards.py), the controller's
  reducer as shard 0 and one in each host's relay process, bound at the
  host's address (FLODL_SHARDS lists h1..hH at SHARD_PORT; each relay's
  shard proves hellos with the run's route secret, as the reducer does). A
  relay cuts its host frame into the shards' even slices and puts the slices
  of the consensus back together; the rank still waits for the whole
  consensus. `floor_s_<H>h_<M>_s<H>` is the least such a round can take
  from the bytes its links carry in order (`sharded_floor_s`): about
  2H / (H + 1) x M / rate with even slices (the controller's shard takes its
  slice from H hosts, then sends it to H), under the bound, by a third at 2
  hosts. The model needs a block (4096 values) per shard: a case with fewer
  is null, the reason in `why_null`.
- gloo (`gloo_s_<H>h_<M>`): torch.distributed's all_reduce (gloo, one process
  per host, its store on h1) of the same vector, and a divide, across the same
  shaped links.
- bound (`bound_s_<H>h_<M>`): 2M / rate, the time a bandwidth-optimal all-reduce
  needs on each host's link (it sends and receives about 2M bytes per host
  whatever H is; M in bytes, f32).

A round: from the first process told to start it to the last one holding the
result (CLOCK_MONOTONIC is one clock across namespaces); each figure is the
median of `--rounds` rounds after `--warmup` (the first rounds connect, and a
relay's consensus wait learns the round's latency from the round before).
`reasks_<H>h_<M>_s1` and `_s<H>`: the reducer shards' count, over the measured
rounds, of the relays' requests for a late consensus (slice) and their own requests
for a host frame (slice): each is one more model-sized message (or a shard's
slice of one) through a shard's link.

Memory: the reducer shards hold about (H + 3) x M between them (each of S its
slice, M / S, of: the host frames as received, the sum, the consensus, a resend)
and 5 x M per host (the deposit and consensus segments, the consensus as received,
resends): measured with one shard at 4 hosts x 100M, 2.8 GB in the reducer and
2.0 GB in each relay. A case needing more than three quarters
of the memory available is not run (its keys null, the reason printed): the hosts
are halved until the case fits, and that case is run instead.

    sudo .venv/bin/python bench/topology.py                       # H = 2, 4, 8; M = 25M, 100M
    sudo .venv/bin/python bench/topology.py --hosts 8 --sizes 25M --json
    sudo .venv/bin/python bench/topology.py --rate 100mbit --sizes 1M

JSON: the keys above, `why_null` (key -> reason), rate, rounds, warmup,
load_avg_1m. Needs root (namespaces, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flodl_zmq.shards import ShardMap

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PORT = 7300  # the controller's base port in its own namespace (nothing else listens there)
GLOO_PORT = 29511
START_S = 180.0  # imports and connections on a loaded 2-core machine; not timed
SECRETS = ("TOPO_KEY", "TOPO_RUN", "TOPO_ROUTE_SECRET")  # in the environment, never argv (ps shows argv)
SHARD_PORT = 7400  # each host shard's data ROUTER at its host's address (its PUB at the next port)
MEMORY_SHARE = 0.75  # of MemAvailable a case may plan to use: the machine is shared
BASE_BYTES = 100e6  # an interpreter with numpy, zmq and flodl_zmq (no torch)
TORCH_BYTES = 300e6  # one with torch too (a gloo process)


# ---------------------------------------------------------------------------- pure rules


def parse_size(text: str) -> int:
    """`25M` -> 25_000_000 parameters (K, M or G; a plain number as is)."""
    m = re.fullmatch(r"([1-9]\d*)([KMG]?)", text.strip())
    if m is None:
        raise ValueError(f"size {text!r}: write parameters as a number above 0 with K, M or G, e.g. 25M")
    return int(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[m.group(2)]


def parse_rate(text: str) -> float:
    """A tc rate (`1gbit`, `100mbit`, `500kbit`: SI units, as tc reads them) in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", text.strip())
    if m is None:
        raise ValueError(f"rate {text!r}: write it as tc does, e.g. 1gbit or 100mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def bound_s(params: int, rate_bps: float) -> float:
    """2M / rate: each host of a bandwidth-optimal all-reduce sends (and receives) about 2M bytes."""
    return 2 * params * 4 * 8 / rate_bps


def shard_bytes(hosts: int, params: int, shards: int) -> float:
    """One of `shards` reducer shards at its peak: of its slice (M / S), each host's as received, the sum,
    the consensus and a resend."""
    return (hosts + 3) * params * 4 / shards


def memory_needed(hosts: int, params: int) -> float:
    """Bytes a case holds at its peak, the largest of its runs (one after another): ours with one shard,
    ours with H + 1 (each host's relay process then holds its shard besides the 5 x M of a relay), or gloo's."""
    model = params * 4
    relays = hosts * 5 * model + (2 * hosts + 1) * BASE_BYTES
    ours = max(s * shard_bytes(hosts, params, s) for s in (1, hosts + 1)) + relays
    gloo = hosts * (3 * model + TORCH_BYTES)
    return max(ours, gloo)


@dataclass(frozen=True)
class Case:
    hosts: int
    size: str  # as given (`25M`): the keys carry it
    params: int
    skipped: str | None = None  # why it is not run


def plan(hosts: list[int], sizes: list[str], available: float) -> list[Case]:
    """The cases to run: each (H, M) asked, one that would not fit in memory skipped with the reason
    and replaced by the largest H (halving) that fits, unless that one is asked anyway."""
    cases: list[Case] = []
    for size in sizes:
        params = parse_size(size)
        for h in hosts:
            if memory_needed(h, params) <= MEMORY_SHARE * available:
                cases.append(Case(h, size, params))
                continue
            fits = h // 2
            while fits >= 2 and memory_needed(fits, params) > MEMORY_SHARE * available:
                fits //= 2
            why = (f"needs about {memory_needed(h, params) / 1e9:.1f} GB, over {MEMORY_SHARE:.0%} of the "
                   f"{available / 1e9:.1f} GB available" + (f": ran {fits} hosts instead" if fits >= 2 else ""))
            cases.append(Case(h, size, params, why))
            if fits >= 2 and fits not in hosts and Case(fits, size, params) not in cases:
                cases.append(Case(fits, size, params))
    return cases


def round_span(done: list[tuple[int, int]]) -> float:
    """One round's seconds: the first process's start to the last one's end (monotonic ns)."""
    return (max(t1 for _, t1 in done) - min(t0 for t0, _ in done)) / 1e9


def host_names(hosts: int) -> list[str]:
    return [f"h{i}" for i in range(1, hosts + 1)]


def world(hosts: int) -> dict[str, tuple[int, ...]]:
    """One rank per host: h1 holds rank 0, h2 rank 1, ..."""
    return {name: (i,) for i, name in enumerate(host_names(hosts))}


def shard_map(addresses: dict[str, str]) -> ShardMap:
    """A shard on every host (host -> its address), at SHARD_PORT: FLODL_SHARDS of the sharded run."""
    from flodl_zmq.shards import ShardMap

    return ShardMap(tuple((h, f"tcp://{a}:{SHARD_PORT}") for h, a in addresses.items()))


def sharded_floor_s(shards: ShardMap, params: int, rate_bps: float) -> float:
    """The least a round sharded by `shards` can take, from the bytes its links must carry in order.

    A shard publishes its slice of the consensus once every host's slice is in (whole messages): shard k
    on a host takes (H - 1) s_k in through its link, then sends as much out, 2 (H - 1) s_k in all; the
    controller's shard 2 H s_0. And a host's link carries M + (H - 2) s_k each way (its frame's other
    slices out, its shard's slice of the consensus to the H - 1 other relays). With even slices the
    controller's 2 H / (H + 1) x M is the most: under the bound's 2M, by a third at 2 hosts. Slices are even
    to a block of 4096 values (PROTOCOL.md 10.9 item 2; before version 9 whole chunks: 25M over 9 shards gave
    three hosts 2 of its 12 chunks, 2 x 7 x 16.8 MB, 1.17x the bound).
    """
    sizes = [4 * len(r) for r in shards.ranges(params)]
    hosts = len(shards.hosts)
    busiest = max([2 * hosts * sizes[0]]
                  + [max(2 * (hosts - 1) * s, 4 * params + (hosts - 2) * s) for s in sizes[1:]])
    return busiest * 8 / rate_bps


def why_not_sharded(shards: ShardMap, params: int) -> str | None:
    """Why a model of `params` f32 values cannot be cut between `shards` (a block each at least), or None."""
    from flodl_zmq.errors import ConfigError

    try:
        shards.ranges(params)
    except ConfigError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------------- inside the namespaces


def secrets() -> tuple[bytes, bytes, bytes]:
    key, run_id, route_secret = (bytes.fromhex(os.environ[name]) for name in SECRETS)
    return key, run_id, route_secret


def stdin_lines() -> queue.Queue[str | None]:
    """The harness's lines to this process, then None once it closes stdin: how it tells a service to stop."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def reducer_role(hosts: int, address: str) -> None:
    """`controller`: the reducer service; prints its counters at each `counters` line, until told to stop."""
    import zmq

    from flodl_zmq.controller_shards import shard_starts
    from flodl_zmq.endpoints import ControllerAddress
    from flodl_zmq.io_threads import controller_context, keep_off_the_data_plane
    from flodl_zmq.links import (
        CONTROL_MAX_FRAME_BYTES,
        CONTROL_MAX_FRAMES,
        limit_receive,
        recv_bounded,
    )
    from flodl_zmq.reducer_config import ReducerConfig
    from flodl_zmq.reducer_service import ReducerService
    from flodl_zmq.settings import Settings
    from flodl_zmq.wire import Channel

    key, run_id, route_secret = secrets()
    controller = ControllerAddress(address, PORT)
    s = Settings.from_environ()  # the run's link settings, as a controller's reducer takes them
    _, starts = shard_starts(s.shard_map, None, None)  # no outer step: each host shard's start is the record alone
    svc = ReducerService(ReducerConfig.for_controller(
        world(hosts), key, run_id, controller, route_secret=route_secret,
        link_heartbeat_period_s=s.link_heartbeat_period_s, link_silence_s=s.link_silence_s,
        shard_hosts=tuple(h for h, _ in s.shard_map.hosts)), starts=starts)
    svc.start()
    # No coordinator here, but each relay dials the control link too: a listener keeps it connected.
    control = controller_context().socket(zmq.ROUTER)
    keep_off_the_data_plane(control)
    limit_receive(control, CONTROL_MAX_FRAME_BYTES)
    control.bind(controller.endpoint(Channel.CONTROL))
    lines = stdin_lines()
    print("READY", flush=True)
    while True:
        if control.poll(100):
            recv_bounded(control, CONTROL_MAX_FRAMES)
        try:
            line = lines.get_nowait()
        except queue.Empty:
            continue
        if line is None:
            break
        print("COUNTERS " + json.dumps(svc.counters()), flush=True)
    control.close(0)
    svc.stop()


def relay_role(hosts: int, host: str, address: str, ipc_dir: str) -> None:
    """A host's relay, the real one, with its reducer shard where FLODL_SHARDS lists the host; prints the
    shard's counters (none: `{}`) at each `counters` line, until told to stop."""
    from flodl_zmq.endpoints import ControllerAddress
    from flodl_zmq.environment import ProcessEnv
    from flodl_zmq.links import host_token, local_endpoints
    from flodl_zmq.relay import Relay, shard_config
    from flodl_zmq.relay_config import RelayConfig
    from flodl_zmq.settings import Settings
    from flodl_zmq.shards import ShardMap

    key, run_id, route_secret = secrets()
    s = Settings.from_environ()  # the run's settings, as run_relay takes them
    controller = ControllerAddress(address, PORT)
    # The rank beats from its own thread while it waits for the harness: a long silence limit keeps a
    # rank that a loaded machine leaves unscheduled for a while from being declared dead mid-bench.
    cfg = RelayConfig.for_controller(
        host, world(hosts)[host], key, run_id, controller,
        local_endpoints(key, run_id, host, ipc_dir), rank_silence_at_relay_s=10.0,
        consensus_wait_at_relay_s=s.consensus_wait_at_relay_s, link_heartbeat_period_s=s.link_heartbeat_period_s,
        link_silence_s=s.link_silence_s, peer_send_timeout_s=s.peer_send_timeout_s,
        host_token=host_token(route_secret, host), shards=ShardMap.parse(s.shards))
    # The shard's config as run_relay makes it: a shard host's relay is given the route secret.
    penv = ProcessEnv("relay", controller, key, run_id, run_id, world(hosts), host=host, settings=s,
                      route_secret=route_secret)
    relay = Relay(cfg, shard=shard_config(penv, cfg))
    relay.start()
    lines = stdin_lines()
    print("READY", flush=True)
    while lines.get() is not None:
        print("COUNTERS " + json.dumps({} if relay.shard is None else relay.shard.counters()), flush=True)
    relay.stop()


def rank_role(hosts: int, host: str, params: int, ipc_dir: str, deadline_s: float) -> None:
    """A light rank: per `go` line, deposit by reference and wait for the verified consensus; print its span."""
    import numpy as np
    import zmq
    from round import rank_heartbeats  # bench/round.py's stand-in rank beats the same way

    from flodl_zmq.links import (
        DATA_MAX_FRAMES,
        local_endpoints,
        rank_identity,
        rank_sender,
        recv_bounded,
    )
    from flodl_zmq.wire import Channel, Codec, shm
    from flodl_zmq.wire.records import RoundFrame
    from flodl_zmq.wire_format import F32

    key, run_id, _ = secrets()
    rank = world(hosts)[host][0]
    control_ep, data_ep = local_endpoints(key, run_id, host, ipc_dir)
    ctx = zmq.Context()
    stop = threading.Event()
    beat = threading.Thread(target=rank_heartbeats, args=(ctx, key, run_id, rank, control_ep, stop), daemon=True)
    beat.start()
    data = ctx.socket(zmq.DEALER)
    data.setsockopt(zmq.IDENTITY, rank_identity(rank))
    data.setsockopt(zmq.LINGER, 0)
    data.connect(data_ep)
    codec, decoder = Codec(key, run_id, rank_sender(rank)), Codec(key, run_id, "bench")
    segment = shm.Segment(key, run_id, shm.rank_owner(rank))
    # In the protocol's chunks (PROTOCOL.md 3.4), as a rank deposits.
    deposit = [np.frombuffer(v, np.float32) for v in segment.layout([n * 4 for _, n in F32.layout(params)])]
    for d in deposit:
        d.fill(rank + 1.0)  # mass 1 each: the consensus is the mean of 1..H
    expect = (hosts + 1) / 2
    mapped = shm.SegmentMap(run_id, shm.run_dir(key, run_id))
    print("READY", flush=True)
    for line in sys.stdin:
        round_id = int(line.split()[1])
        t0 = time.monotonic_ns()
        data.send_multipart(shm.by_reference(codec, RoundFrame(round_id, rank, 1.0), deposit, segment,
                                             dtypes=["f32"] * len(deposit)))
        if not data.poll(int(deadline_s * 1000)):
            raise TimeoutError(f"rank {rank}: no consensus of round {round_id} within {deadline_s:g} s; "
                               f"see the relay's and the reducer's logs")
        frames = recv_bounded(data, DATA_MAX_FRAMES, copy=False)
        if frames is None:
            raise RuntimeError(f"rank {rank}: the relay sent a message of over {DATA_MAX_FRAMES} frames")
        env = mapped.decode(decoder, frames, shm.host_owner(host), Channel.BROADCAST, replay=False)
        t1 = time.monotonic_ns()
        got = float(env.payload[0][0])
        if env.record.round != round_id or abs(got - expect) > 1e-3 * expect:
            raise RuntimeError(f"rank {rank}: round {env.record.round} consensus {got}, expected round {round_id} "
                               f"and {expect}")
        print(f"DONE {round_id} {t0} {t1}", flush=True)
    stop.set()
    beat.join(5)
    ctx.destroy(0)
    segment.close()


def gloo_role(hosts: int, host: str, params: int, master: str, deadline_s: float) -> None:
    """One gloo process: per `go` line, all_reduce the vector and divide; print its span."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = world(hosts)[host][0]
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{GLOO_PORT}", rank=rank, world_size=hosts,
                            timeout=timedelta(seconds=deadline_s))
    t = torch.full((params,), rank + 1.0)
    print("READY", flush=True)
    for line in sys.stdin:
        round_id = int(line.split()[1])
        t0 = time.monotonic_ns()
        dist.all_reduce(t)
        t.div_(hosts)
        t1 = time.monotonic_ns()
        print(f"DONE {round_id} {t0} {t1}", flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the harness


class Side:
    """One side's processes in the namespaces: their tagged stdout lines on one queue, stderr in a log each."""

    def __init__(self, net: Any, logs: Path) -> None:
        self.net, self.logs = net, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()

    def start(self, name: str, host: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self.logs / f"{name}.log", "w") as err:  # the child keeps its own descriptor
            proc = self.net.popen(host, [sys.executable, str(Path(__file__).resolve()), *argv], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self.procs[name] = proc
        threading.Thread(target=self._read, args=(name, proc), daemon=True).start()

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put((name, line.rstrip("\n")))
        self.lines.put((name, None))  # its end: a process that exits early is named, not waited for

    def expect(self, names: list[str], tag: str, deadline_s: float) -> dict[str, list[str]]:
        """The words after `tag` on each of `names`' next such line, within `deadline_s`."""
        got: dict[str, list[str]] = {}
        end = time.monotonic() + deadline_s
        while len(got) < len(names):
            try:
                name, line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(names) - set(got))
                raise TimeoutError(f"{missing}: no {tag} within {deadline_s:g} s\n{self.tails()}") from None
            if name not in names:
                continue
            if line is None:
                said = (self.logs / f"{name}.log").read_text(errors="replace").strip().splitlines() or ["nothing"]
                raise RuntimeError(f"{name} exited before its {tag} line, saying: {said[-1]}\n{self.tails()}")
            if line == tag or line.startswith(tag + " "):
                got[name] = line.split()[1:]
        return got

    def tell(self, names: list[str], text: str) -> None:
        for name in names:
            self.procs[name].stdin.write(text + "\n")
            self.procs[name].stdin.flush()

    def rounds(self, names: list[str], ids: range, deadline_s: float) -> list[float]:
        """Rounds `ids`, each started by a `go` to every one of `names` once the last has ended: their spans."""
        spans = []
        for round_id in ids:
            self.tell(names, f"go {round_id}")
            done = self.expect(names, "DONE", deadline_s)
            spans.append(round_span([(int(w[1]), int(w[2])) for w in done.values()]))
        return spans

    def stop(self, first: list[str]) -> None:
        """Close `first`'s stdin (the ranks: they end), then every other's; whatever lingers is killed."""
        rest = [n for n in self.procs if n not in first]
        for name in [*first, *rest]:
            self.procs[name].stdin.close()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.net.stop(list(self.procs.values()))

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{(self.logs / f'{n}.log').read_text(errors='replace')[-1500:]}"
                         for n in self.procs)


def round_deadline_s(case: Case, rate_bps: float) -> float:
    """Ten times a one-shard round's link time (H x the bound), and a minute for a loaded machine."""
    return 60.0 + 10 * case.hosts * bound_s(case.params, rate_bps)


def reasks(side: Side, shards: list[str]) -> int:
    """The count so far, over the processes running a reducer shard, of the relays' requests for a late
    consensus and the shards' own for a host frame."""
    side.tell(shards, "counters")
    counts = [json.loads(" ".join(words)) for words in side.expect(shards, "COUNTERS", 30).values()]
    return sum(c.get("consensus_requests", 0) + c.get("frame_requests", 0) for c in counts)


def run_ours(net: Any, case: Case, rate_bps: float, rounds: int, warmup: int, logs: Path,
             shards: ShardMap | None = None) -> tuple[float, int]:
    """The reducer in `controller`, a relay and a rank per host; with `shards`, a reducer shard in each
    listed host's relay as well (FLODL_SHARDS). The median round and the re-asks of the measured rounds."""
    import wan  # here, not at the top: it imports torch, which the processes of our side never need

    from flodl_zmq.environment import with_tunables
    from flodl_zmq.wire import new_key
    from flodl_zmq.wire.shm import unlink_run

    key, run_id = new_key(), os.urandom(16)
    run_settings = {k: v for k, v in os.environ.items() if k.startswith("FLODL_")}  # e.g. FLODL_LINK_SILENCE
    run_settings.pop("FLODL_SHARDS", None)  # the case says the layout
    if shards is not None:
        run_settings["FLODL_SHARDS"] = str(shards)
    env = wan.environ({**run_settings, **dict(zip(SECRETS, (key.hex(), run_id.hex(), os.urandom(32).hex()),
                                                  strict=True))})
    ipc_dir = tempfile.mkdtemp(prefix="flodl-topo-")
    side, address = Side(net, logs), net.hosts["controller"].address
    deadline = round_deadline_s(case, rate_bps)
    hosts, ranks = host_names(case.hosts), [f"rank-{h}" for h in host_names(case.hosts)]
    try:
        side.start("reducer", "controller", ["--role", "reducer", "--world", str(case.hosts), "--address", address],
                   with_tunables(env, "controller"))
        for h in hosts:
            side.start(f"relay-{h}", h, ["--role", "relay", "--world", str(case.hosts), "--host", h, "--address",
                                         address, "--ipc", ipc_dir], with_tunables(env, "relay"))
        for h, name in zip(hosts, ranks, strict=True):
            side.start(name, h, ["--role", "rank", "--world", str(case.hosts), "--host", h, "--params",
                                 str(case.params), "--ipc", ipc_dir, "--deadline", str(deadline)],
                       with_tunables(env, "rank"))
        side.expect(list(side.procs), "READY", START_S)
        side.rounds(ranks, range(1, warmup + 1), deadline + 30)
        counted = ["reducer"] + ([] if shards is None else [f"relay-{h}" for h, _ in shards.hosts])
        before = reasks(side, counted)
        spans = side.rounds(ranks, range(warmup + 1, warmup + rounds + 1), deadline + 30)
        return statistics.median(spans), reasks(side, counted) - before
    finally:
        side.stop(first=ranks)  # the ranks end first: a relay stopped under a waiting rank is not a failure here
        unlink_run(key, run_id)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def run_gloo(net: Any, case: Case, rate_bps: float, rounds: int, warmup: int, logs: Path) -> float:
    """gloo's all_reduce, one process per host, its store on h1: the median round."""
    import wan

    from flodl_zmq.environment import with_tunables

    env = with_tunables(wan.environ({"GLOO_SOCKET_IFNAME": "eth0"}), "rank")
    side, deadline = Side(net, logs), round_deadline_s(case, rate_bps)
    names = [f"gloo-{h}" for h in host_names(case.hosts)]
    try:
        for h, name in zip(host_names(case.hosts), names, strict=True):
            side.start(name, h, ["--role", "gloo", "--world", str(case.hosts), "--host", h, "--params",
                                 str(case.params), "--address", net.hosts["h1"].address, "--deadline",
                                 str(deadline)], env)
        side.expect(names, "READY", START_S)
        side.rounds(names, range(1, warmup + 1), deadline + 30)
        return statistics.median(side.rounds(names, range(warmup + 1, warmup + rounds + 1), deadline + 30))
    finally:
        side.stop(first=names)


def key(name: str, case: Case, shards: int | None = None) -> str:
    """`round_s_8h_25M_s1`: the figure, hosts, parameters and (for ours) shards: 1, or H for sharded
    across the H hosts (H + 1 shards with the controller's)."""
    return f"{name}_{case.hosts}h_{case.size}" + ("" if shards is None else f"_s{shards}")


def failed(exc: Exception, logs: Path) -> str:
    return f"failed: {str(exc).splitlines()[0]}; logs in {logs}"


def run_case(net: Any, case: Case, rate_bps: float, rounds: int, warmup: int,
             logs: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """One case: ours with one shard, ours sharded across its hosts, gloo. Its figures (None where not
    measured) and each null's reason."""
    layouts = {1: None, case.hosts: shard_map({h: net.hosts[h].address for h in host_names(case.hosts)})}
    out: dict[str, Any] = {key("bound_s", case): bound_s(case.params, rate_bps), key("gloo_s", case): None}
    for n in layouts:
        out[key("round_s", case, n)] = out[key("reasks", case, n)] = None
    if case.skipped is not None:
        return out, {k: case.skipped for k, v in out.items() if v is None}
    why: dict[str, str] = {}
    for n, shards in layouts.items():
        ours, asked, here = key("round_s", case, n), key("reasks", case, n), logs / f"s{n}"
        if shards is not None and (cannot := why_not_sharded(shards, case.params)) is not None:
            why[ours] = why[asked] = cannot
            continue
        if shards is not None:
            out[key("floor_s", case, n)] = sharded_floor_s(shards, case.params, rate_bps)
        here.mkdir(parents=True)
        try:
            out[ours], out[asked] = run_ours(net, case, rate_bps, rounds, warmup, here, shards)
        except (RuntimeError, TimeoutError) as exc:
            why[ours] = why[asked] = failed(exc, here)
            print(f"{ours}: {exc}", file=sys.stderr)
    gloo, here = key("gloo_s", case), logs / "gloo"
    here.mkdir(parents=True)
    try:
        out[gloo] = run_gloo(net, case, rate_bps, rounds, warmup, here)
    except (RuntimeError, TimeoutError) as exc:
        why[gloo] = failed(exc, here)
        print(f"{gloo}: {exc}", file=sys.stderr)
    return out, why


def measure(cases: list[Case], rate: str, rounds: int, warmup: int) -> dict[str, Any]:
    """Every case over links shaped at `rate`: the JSON figures, `why_null` naming each null's reason."""
    import wan

    from tests.cluster.netns import network_or_skip

    rate_bps = parse_rate(rate)
    out: dict[str, Any] = {}
    why: dict[str, str] = {}
    logs = Path(tempfile.mkdtemp(prefix="flodl-topo-logs-"))
    most = max((c.hosts for c in cases if c.skipped is None), default=0)
    with network_or_skip("controller", *host_names(most)) as net:
        for name in net.hosts:
            wan.shape(net, name, rate)
        for case in cases:
            figures, whys = run_case(net, case, rate_bps, rounds, warmup, logs / f"{case.hosts}h_{case.size}")
            out.update(figures)
            why.update(whys)
            print(f"  {case.hosts}h {case.size}: ours {figures[key('round_s', case, 1)]} s one shard, "
                  f"{figures[key('round_s', case, case.hosts)]} s sharded, gloo {figures[key('gloo_s', case)]} s",
                  file=sys.stderr, flush=True)
    out["why_null"] = why
    return out


def available_bytes() -> float:
    """MemAvailable (/proc/meminfo): what this machine can give a case now without swapping."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024.0
    raise RuntimeError("/proc/meminfo has no MemAvailable: this bench needs Linux 3.14 or later")


def table(cases: list[Case], out: dict[str, Any], rate: str, rounds: int, warmup: int) -> str:
    def cell(v: float | None, of: float | None = None) -> str:
        if v is None:
            return "-"
        return f"{v:.2f}" + ("" if of is None else f" ({v / of:.1f}x)")

    rows = [f"{rate} per host link (every link shaped, the controller's too); medians of {rounds} rounds after "
            f"{warmup} warm-up; sharded: H + 1 shards, the controller's and one per host (key _s<H>); floor: the "
            f"least its links allow",
            f"{'hosts':>5} {'params':>6} {'bound s':>8} {'1 shard s (x bound)':>20} {'re-asks':>7} "
            f"{'H+1 shards s (x bound)':>23} {'re-asks':>7} {'floor s':>7} {'gloo s (x bound)':>17}"]
    for c in cases:
        b = out[key("bound_s", c)]
        cols = []
        for n in (1, c.hosts):
            asked = out[key("reasks", c, n)]
            cols.append(f"{cell(out[key('round_s', c, n)], b):>{20 if n == 1 else 23}} "
                        f"{'-' if asked is None else asked:>7}")
        rows.append(f"{c.hosts:>5} {c.size:>6} {b:>8.2f} {' '.join(cols)} "
                    f"{cell(out.get(key('floor_s', c, c.hosts))):>7} {cell(out[key('gloo_s', c)], b):>17}")
    rows += [f"{k}: null, {v}" for k, v in out["why_null"].items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="2,4,8", help="comma list of host counts (at least 2)")
    p.add_argument("--sizes", default="25M,100M", help="comma list of parameter counts: 25M, 100M, 1M, 500K, ...")
    p.add_argument("--rate", default="1gbit", help="every link's rate both ways, as tc writes it (1gbit, 100mbit)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per case; the figure is their median")
    p.add_argument("--warmup", type=int, default=1, help="rounds before them, not counted")
    p.add_argument("--json", action="store_true")
    p.add_argument("--role", choices=("reducer", "relay", "rank", "gloo"), help=argparse.SUPPRESS)  # in a namespace
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--params", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ipc", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "reducer":
        reducer_role(args.world, args.address)
    elif args.role == "relay":
        relay_role(args.world, args.host, args.address, args.ipc)
    elif args.role == "rank":
        rank_role(args.world, args.host, args.params, args.ipc, args.deadline)
    elif args.role == "gloo":
        gloo_role(args.world, args.host, args.params, args.address, args.deadline)
    if args.role:
        return 0
    try:
        hosts = [int(h) for h in args.hosts.split(",") if h]
        sizes = [s for s in args.sizes.split(",") if s]
        for s in sizes:
            parse_size(s)
        parse_rate(args.rate)
    except ValueError as exc:
        p.error(str(exc))
    if not hosts or min(hosts) < 2 or args.rounds < 1 or args.warmup < 0:
        p.error("--hosts needs counts of at least 2 (one reducer and one host is no all-reduce), --rounds at least 1")
    cases = plan(hosts, sizes, available_bytes())
    out = measure(cases, args.rate, args.rounds, args.warmup)
    load = os.getloadavg()
    out.update(rate=args.rate, rounds=args.rounds, warmup=args.warmup, load_avg_1m=load[0])
    print(table(cases, out, args.rate, args.rounds, args.warmup))
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} ({os.cpu_count()} cores)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
