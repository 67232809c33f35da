"""A scripted rank process for the data-plane process tests.

Heartbeats on its control socket every 0.5 s (its own thread); for each round
deposits `params(rank, round)` pre-scaled by `MASS[rank]`, waits for the
consensus and saves it (float64) to OUT/r{rank}_round{k}.npy, printing
`round k done`. With --hang-at K it prints `hanging at K` instead of
depositing round K and waits to be killed (still heartbeating: the test's
SIGKILL is what stops it). With --shm it deposits by reference from its
shared-memory segment and takes the consensus by reference, as the rank
runtime does with a same-host relay. Key from FLODL_KEY.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))
from dataplane_helpers import from_wire, model, to_wire  # noqa: E402

from flodl_zmq.links import rank_identity, rank_sender  # noqa: E402
from flodl_zmq.wire import Channel, Codec, key_from_hex  # noqa: E402
from flodl_zmq.wire.records import Heartbeat, RoundFrame  # noqa: E402
from flodl_zmq.wire.shm import (  # noqa: E402
    Segment,
    SegmentMap,
    by_reference,
    host_owner,
    is_by_reference,
    rank_owner,
    run_dir,
)

MASS = {0: 1.0, 1: 3.0, 2: 0.5, 3: 2.0}
SIZES = (1000, 37)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--dtype", default="f32")
    p.add_argument("--out", required=True)
    p.add_argument("--hang-at", type=int, default=0)
    p.add_argument("--host", default="")
    p.add_argument("--shm", action="store_true")
    a = p.parse_args()
    key, run_id = key_from_hex(os.environ["FLODL_KEY"]), bytes.fromhex(a.run_id)
    if a.dtype == "bf16":
        # As a real rank has, before its first heartbeat: torch imported at the first bf16 encode
        # would hold the GIL for seconds and starve the heartbeats past the relay's deadline.
        import torch  # noqa: F401
    ctx = zmq.Context()

    def heartbeats() -> None:
        codec = Codec(key, run_id, rank_sender(a.rank))
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, rank_identity(a.rank))
        s.setsockopt(zmq.LINGER, 0)
        s.connect(a.control)
        while True:
            s.send_multipart(codec.encode(Heartbeat(a.rank, 0)))
            time.sleep(0.5)

    threading.Thread(target=heartbeats, daemon=True).start()
    codec, decoder = Codec(key, run_id, rank_sender(a.rank)), Codec(key, run_id, "rank-decoder")
    data = ctx.socket(zmq.DEALER)
    data.setsockopt(zmq.IDENTITY, rank_identity(a.rank))
    data.setsockopt(zmq.LINGER, 0)
    data.connect(a.data)
    segment = Segment(key, run_id, rank_owner(a.rank)) if a.shm else None
    mapped = SegmentMap(run_id, run_dir(key, run_id))
    for k in range(1, a.rounds + 1):
        if k == a.hang_at:
            print(f"hanging at {k}", flush=True)
            time.sleep(3600)
        mass = MASS[a.rank]
        wire = to_wire(model(a.rank, k, SIZES), mass, a.dtype)
        if segment is not None:
            views = segment.layout([x.nbytes for x in wire])
            placed = [np.frombuffer(v, x.dtype).reshape(x.shape) for v, x in zip(views, wire, strict=True)]
            for dst, src in zip(placed, wire, strict=True):
                np.copyto(dst, src)
            wire = placed
        deposit, dtypes = RoundFrame(k, a.rank, mass), [a.dtype] * len(wire)
        if segment is None:
            data.send_multipart(codec.encode(deposit, wire, dtypes=dtypes))
        else:
            data.send_multipart(by_reference(codec, deposit, wire, segment, dtypes=dtypes))
        if not data.poll(60_000):
            print(f"no consensus for round {k}", flush=True)
            return 1
        msg = data.recv_multipart()
        shared = is_by_reference(msg)
        env = mapped.decode(decoder, msg, host_owner(a.host), Channel.BROADCAST, replay=False)
        assert env.record.round == k, env.record
        flat = np.concatenate([x.ravel() for x in from_wire(env.payload, env.dtypes)])
        np.save(Path(a.out) / f"r{a.rank}_round{k}.npy", flat)
        print(f"round {k} done mass={env.record.mass} by_reference={shared}", flush=True)
    if segment is not None:
        segment.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
