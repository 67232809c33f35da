"""The coordinator at 64 and 256 ranks, in the simulator: wall time per simulated epoch and cost per record.

    python bench/simscale.py [--ranks 64,256] [--epochs 4] [--json]

The real `Coordinator` driven by `coordinator/sim.py` in virtual time (cpu-cadence): ranks of
throughputs spread geometrically from 1 to 16, batch 8, an epoch sized so the slowest rank does
about 12 batches of it, one `Batch` record per step (the most a rank may send: coalescing only
lowers the count). Figures:

- wall_s_per_epoch, cpu_s_per_epoch: the simulation's wall and CPU time per epoch (simulator and
  coordinator; on a loaded machine the CPU time is the figure to trust);
- coordinator_us_per_record: CPU time (this thread's) inside `Coordinator.on_record` per record,
  every record kind;
- records_per_epoch: records from ranks per epoch;
- worst_share_error: the largest relative gap between a rank's mean batch share (epochs after the
  third) and its speed share.

JSON keys: wall_s_per_epoch_n{N}, cpu_s_per_epoch_n{N}, coordinator_us_per_record_n{N}, records_per_epoch_n{N},
worst_share_error_n{N}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.sim import RankSpec, SimConfig, Simulation

BS = 8


def run(n: int, epochs: int) -> dict:
    speeds = [16 ** (i / (n - 1)) for i in range(n)]
    total = int(sum(speeds) * 12) * BS
    sim = Simulation(CoordinatorConfig(total_samples=total, batch_size=BS, num_epochs=epochs, mode="cadence"),
                     [RankSpec(16.0 / s) for s in speeds], SimConfig(seed=0))
    spent = [0.0, 0]
    on_record = sim.coord.on_record

    def timed(rank, record, now):
        t = time.thread_time()
        try:
            return on_record(rank, record, now)
        finally:
            spent[0] += time.thread_time() - t
            spent[1] += 1

    sim.coord.on_record = timed  # the simulator calls the coordinator through this attribute
    t0, c0 = time.perf_counter(), time.process_time()
    res = sim.run()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert res.ended is not None and res.ended.reason is None
    settled = res.aggregated[3:] or res.aggregated
    worst = max(abs(statistics.mean(a.per_rank_batch_share[r] for a in settled) * sum(speeds) / speeds[r] - 1.0)
                for r in range(n))
    return {"wall_s_per_epoch": wall / epochs, "cpu_s_per_epoch": cpu / epochs, "coordinator_us_per_record": spent[0] / spent[1] * 1e6,
            "records_per_epoch": spent[1] / epochs, "worst_share_error": worst}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="64,256")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    figures: dict = {"load_average": os.getloadavg()}
    rows = []
    for n in (int(x) for x in args.ranks.split(",")):
        f = run(n, args.epochs)
        rows.append((n, f))
        figures |= {f"{k}_n{n}": round(v, 4) for k, v in f.items()}
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"simulated cpu-cadence, speeds 1-16x, {args.epochs} epochs; load average {figures['load_average'][0]:.2f}")
    print("ranks | wall s / epoch | CPU s / epoch | coordinator us / record | records / epoch | worst share error")
    for n, f in rows:
        print(f"{n} | {f['wall_s_per_epoch']:.2f} | {f['cpu_s_per_epoch']:.2f} | {f['coordinator_us_per_record']:.1f} | "
              f"{f['records_per_epoch']:.0f} | {f['worst_share_error']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
