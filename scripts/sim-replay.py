"""Replay fixed simulated runs of the real coordinator and print one digest of every output.

The check for a refactor that must not change behaviour: the digest before and
after is the same. Scenarios cover the three modes, deaths reported and not,
a hang, lost records, failed sends, a resume and 16 ranks of mixed speeds.
Usage: .venv/bin/python scripts/sim-replay.py  (prints `<digest>  <outputs>`).
"""

from __future__ import annotations

import hashlib

from flodl_zmq.coordinator.config import CoordinatorConfig
from flodl_zmq.coordinator.sim import RankSpec, SimConfig, Simulation
from flodl_zmq.wire import records as rec

TOTAL, BS = 5440, 8


def scenarios() -> list[tuple[CoordinatorConfig, list[RankSpec], SimConfig]]:
    out = []
    for mode in ("cadence", "async", "sync"):
        cfg = CoordinatorConfig(total_samples=TOTAL, batch_size=BS, num_epochs=4, mode=mode)
        out.append((cfg, [RankSpec(12.0), RankSpec(3.0), RankSpec(1.0)], SimConfig(seed=1)))
        out.append((cfg, [RankSpec(12.0), RankSpec(3.0, die_at=0.8), RankSpec(1.0, hang_at=1.5)],
                    SimConfig(seed=2)))
        out.append((cfg, [RankSpec(4.0), RankSpec(2.0, die_at=1.0, reported=False), RankSpec(1.0)],
                    SimConfig(seed=3, loss={rec.Heartbeat: 0.2}, send_fail={rec.EpochMetrics: 0.1})))
    wide = CoordinatorConfig(total_samples=TOTAL * 4, batch_size=BS, num_epochs=3, mode="cadence")
    out.append((wide, [RankSpec(1.0 + r % 16) for r in range(16)], SimConfig(seed=4)))
    return out


def main() -> None:
    digest = hashlib.sha256()
    n = 0
    for cfg, ranks, sim in scenarios():
        res = Simulation(cfg, ranks, sim).run()
        for t, out in res.outputs:
            digest.update(repr((round(t, 9), out)).encode())
            n += 1
        digest.update(repr((res.end_time, res.ended, sorted(res.completed.items()))).encode())
    print(f"{digest.hexdigest()}  {n}")


if __name__ == "__main__":
    main()
