"""Interop: ranks written from protocol/PROTOCOL.md alone (spec_rank.py) run a job on our real services.

The controller (coordinator, reducer) runs in this process and the host's real relay beside it;
the ranks are spec_rank.py processes, or one of them ours (own_rank_job.py). What a user checks: the run completes, each epoch covers
every sample once, every consensus is the mass-weighted mean of the deposits, the controller ends
on the last consensus, and no service saw a protocol violation.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from flodl_zmq.controller_service import ControllerService
from flodl_zmq.datasets import dataset_signature
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.job import Job
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import local_endpoints, remove_local_dir
from flodl_zmq.payload import model_signature
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.sampling import epoch_permutation
from flodl_zmq.settings import Settings
from flodl_zmq.wire import Channel, new_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))
from dataplane_helpers import ROUTE_SECRET, WAIT_S, token  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_rank  # noqa: E402
from interop_job import BATCH, EPOCHS, SAMPLES, dataset, job  # noqa: E402

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve().parent
SPEC_RANK, OWN_RANK = HERE / "spec_rank.py", HERE / "own_rank_job.py"
WORLD = {"h": (0, 1)}
NUDGE = 0.01
ALLOWED = {"zmq", "msgpack", "numpy", "hashlib", "hmac", "cryptography", "__future__", "argparse", "json", "os",
           "pathlib", "signal", "stat", "struct", "sys", "tempfile", "time",
           "spec_rank"}  # the relay shares the rank's framing and MAC, written from the spec too
BAD_COUNTS = ("violation", "rejected", "forged", "unexpected", "unknown", "bad_")


class Run:
    """One job on the real controller (this process) and relay: `kinds[r]` is "spec" or "own" for rank r."""

    def __init__(self, tmp_path: Path, kinds: tuple[str, ...], lose_seq: int = 0, mode: str = "cpu-cadence",
                 consensus_wait_s: float = 2.0):
        """`consensus_wait_s`: how long the relay waits for a round's broadcast before it asks for it."""
        self.tmp, self.kinds, self.lose_seq, self.mode = tmp_path, kinds, lose_seq, mode
        self.consensus_wait_s = consensus_wait_s
        self.key, self.run_id = new_key(), os.urandom(16)
        self.address = ControllerAddress("127.0.0.1", free_port_base())
        penv = ProcessEnv(role="controller", controller=self.address, key=self.key, run_id=self.run_id,
                          incarnation=self.run_id, world=WORLD, settings=Settings(startup_timeout_s=WAIT_S),
                          route_secret=ROUTE_SECRET)
        self.service = ControllerService(Job(**job(mode=mode)), penv)
        self.init = flat(self.service.model)  # what our rank starts from too (the job's seed)

    def rank_process(self, rank: int) -> subprocess.Popen:
        """Rank `rank`, spawned as an agent spawns one: the FLODL_* environment, nothing else of the run."""
        env = {**os.environ, **ProcessEnv(role="rank", controller=self.address, key=self.key, run_id=self.run_id,
                                          incarnation=self.run_id, world=WORLD, host="h", rank=rank,
                                          local_rank=rank).to_environ()}
        if self.kinds[rank] == "own":
            root = str(HERE.parents[1])
            return subprocess.Popen([sys.executable, str(OWN_RANK)], cwd=root, env={
                **env, "OWN_RANK_LOG": str(self.tmp / f"r{rank}.ids"), "PYTHONPATH": root})
        return subprocess.Popen([
            sys.executable, str(SPEC_RANK), "--dataset-sig", dataset_signature(dataset()).hex(),
            "--out", str(self.tmp / f"r{rank}.json"), "--values", "3", "--batch-size", str(BATCH),
            "--samples", str(SAMPLES), "--seed", "42", "--nudge", str(NUDGE),
            "--lose-seq", str(self.lose_seq if rank == 1 else 0), *(["--sync"] if self.mode == "cpu-sync" else [])],
            env=env)

    def run(self) -> None:
        ctx, outcome = zmq.Context(), {}
        thread = threading.Thread(target=lambda: outcome.update(result=self.service.run()), daemon=True)
        thread.start()
        local = local_endpoints(self.key, self.run_id, "h")
        relay = Relay(RelayConfig("h", WORLD["h"], self.key, self.run_id, self.address.endpoint(Channel.CONTROL),
                                  self.address.endpoint(Channel.DATA), self.address.endpoint(Channel.BROADCAST),
                                  *local, consensus_wait_at_relay_s=self.consensus_wait_s, host_token=token("h")),
                      ctx)
        relay.start()
        procs = [self.rank_process(r) for r in WORLD["h"]]
        try:
            for p in procs:
                assert p.wait(timeout=60) == 0, "a rank failed"
            thread.join(WAIT_S)
            assert not thread.is_alive() and "result" in outcome, "the controller did not finish the run"
        finally:
            for p in procs:
                p.kill()
            self.relay_counts = relay.counters()
            relay.stop()
            ctx.term()
        self.result = outcome["result"]
        self.spec = {r: json.loads((self.tmp / f"r{r}.json").read_text())
                     for r, k in enumerate(self.kinds) if k == "spec"}

    def ids_by_epoch(self) -> list[list[int]]:
        """Every sample id trained in each epoch, over both ranks."""
        out: list[list[int]] = [[] for _ in range(EPOCHS)]
        for log in self.spec.values():
            for span in log["spans"]:
                out[span["epoch"]] += span["ids"]
        for r, kind in enumerate(self.kinds):
            if kind == "own":  # its steps in order; the epochs' rows say how many samples each held
                ids = [int(i) for i in (self.tmp / f"r{r}.ids").read_text().split()]
                for e, row in enumerate(self.result.epochs):
                    n = row["per_rank_samples"][r]
                    out[e], ids = out[e] + ids[:n], ids[n:]
                assert ids == [], "our rank trained samples outside every epoch"
        return out

    def assert_clean(self) -> None:
        for counts in (self.service.counts, self.relay_counts):
            assert not {k: v for k, v in counts.items() if v and any(b in k for b in BAD_COUNTS)}, counts
        assert all(log["rejected"] == 0 and log["unacked"] == [] for log in self.spec.values())


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()


@pytest.mark.parametrize("peer", [SPEC_RANK, HERE / "spec_relay.py"], ids=lambda p: p.stem)
def test_the_spec_peers_import_nothing_of_flodl_zmq(peer):
    tree = ast.parse(peer.read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= ALLOWED, f"{peer.name} imports {roots - ALLOWED}"


def test_the_spec_signatures_and_permutation_are_the_ones_our_ranks_compute():
    assert spec_rank.model_signature([("weight", (1, 2)), ("bias", (1,))]) == model_signature(torch.nn.Linear(2, 1))
    items = [tuple(t.numpy() for t in dataset()[i]) for i in range(SAMPLES)]
    assert spec_rank.dataset_signature(items, SAMPLES) == dataset_signature(dataset())
    key, incarnation = new_key(), os.urandom(16)
    try:
        assert spec_rank.local_endpoints(key, incarnation, "h") == local_endpoints(key, incarnation, "h")
    finally:
        remove_local_dir(key, incarnation)
    for epoch in (0, 1, 7):
        assert spec_rank.permutation(42, epoch, SAMPLES).tolist() == epoch_permutation(42, epoch, SAMPLES).tolist()


# Cadence: deposits told ahead in the plans (10.1.1); Sync: a request and a throttle every step.
# lose_seq 4: rank 1's fourth control record (a step report or a heartbeat) is lost, so the
# coordinator holds what follows it until the resend fills the gap (PROTOCOL.md 10.7 items 2 and 4).
@pytest.mark.parametrize(("mode", "lose_seq"), [("cpu-cadence", 0), ("cpu-cadence", 4), ("cpu-sync", 0)])
def test_two_spec_ranks_train_a_whole_job_on_the_real_relay_and_controller(tmp_path, caplog, mode, lose_seq):
    caplog.set_level(logging.WARNING)
    run = Run(tmp_path, ("spec", "spec"), lose_seq, mode)
    run.run()
    assert [sorted(ids) for ids in run.ids_by_epoch()] == [list(range(SAMPLES))] * EPOCHS
    logs = list(run.spec.values())
    rounds = sorted({d["round"] for log in logs for d in log["deposits"]})
    assert rounds and run.relay_counts["rounds_shipped"] == len(rounds)
    if mode == "cpu-sync":  # a rank holds after each step (10.1): every deposit is one step's
        assert {d["mass"] for log in logs for d in log["deposits"]} <= {0.0, 1.0}, logs
    for round_id in rounds:  # each consensus is sum(mass * theta) / sum(mass) of that round's deposits
        deps = [d for log in logs for d in log["deposits"] if d["round"] == round_id]
        mass = sum(d["mass"] for d in deps)
        if mass == 0:
            continue  # nothing realized: each rank keeps its model (9.5)
        want = sum(np.float32(d["mass"]) * np.array(d["theta"], np.float32) for d in deps) / np.float32(mass)
        for log in logs:
            [got] = [c for c in log["consensus"] if c["round"] == round_id]
            assert got["mass"] == mass
            np.testing.assert_allclose(got["theta"], want, rtol=1e-6)
    last = logs[0]["consensus"][-1]["theta"]
    # A round moves the consensus by NUDGE * sum(s_i^2) / sum(s_i) for the ranks' steps s_i: between half
    # its steps' nudges (an even split) and all of them (one rank took every step): how ElChe splits varies.
    steps = SAMPLES * EPOCHS // BATCH
    assert 0.5 * steps * NUDGE - 1e-4 < last[0] < steps * NUDGE + 1e-4
    np.testing.assert_allclose(flat(run.result.model), last, rtol=1e-6)  # the controller ends on it
    # The evaluations and the checkpoint went to a spec rank (the fastest), which answered them: the
    # run's results are its answers, the final one scoring the final consensus.
    answered = sorted(metric for log in logs for _, metric in log["evals"])
    assert sorted(e["metric"] for e in run.result.evals) == answered and len(answered) == EPOCHS
    assert run.result.final_eval == pytest.approx(float(np.mean(np.float32(last))), rel=1e-6)
    assert sorted(v for log in logs for v in log["checkpoints"]) == list(range(1, EPOCHS))
    run.assert_clean()
    assert not [r.getMessage() for r in caplog.records if "violation" in r.getMessage()]


def test_the_controller_ends_on_the_last_consensus_though_its_own_copy_of_the_broadcast_missed_it(tmp_path,
                                                                                                 monkeypatch):
    # A PUB drops for a subscriber that fell behind (the controller's loop on a loaded machine, under a round
    # every step): no later round makes good the last one. Here no broadcast goes out at all; the relay asks
    # for each round point to point, and the controller's copy never sees one. Its result (and the model it
    # would save) must still be the last consensus, which it takes from its reducer once that stopped.
    reducer_of = ControllerService._reducer

    def dropping(service: ControllerService, ctx: zmq.Context) -> ReducerService:
        reducer = reducer_of(service, ctx)
        for round_id in range(1, 1000):
            reducer.drop_broadcast(round_id)
        return reducer

    monkeypatch.setattr(ControllerService, "_reducer", dropping)
    run = Run(tmp_path, ("spec", "spec"), consensus_wait_s=0.1)
    run.run()
    last = run.spec[0]["consensus"][-1]["theta"]
    assert run.relay_counts["consensus_requests"] >= len(run.spec[0]["consensus"])  # none came by broadcast
    np.testing.assert_allclose(flat(run.result.model), last, rtol=1e-6)
    assert not np.allclose(last, run.init)


def test_a_spec_rank_and_our_rank_train_a_whole_job_together(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    run = Run(tmp_path, ("own", "spec"))
    run.run()
    epochs = run.ids_by_epoch()
    assert [sorted(ids) for ids in epochs] == [list(range(SAMPLES))] * EPOCHS
    log = run.spec[1]
    spec_trained = sum(len(s["ids"]) for s in log["spans"])
    assert 0 < spec_trained < SAMPLES * EPOCHS, "each rank trained part of the run"
    ours = run.init  # our rank's lr is 0: it deposits the model it holds, the init then each consensus
    assert log["consensus"], "no round was averaged"
    for dep, got in zip(log["deposits"], log["consensus"], strict=True):
        assert dep["round"] == got["round"] and got["mass"] >= dep["mass"] >= 0
        if got["mass"] == 0:
            continue  # nothing realized: every rank keeps its model
        m = np.float32(dep["mass"])
        want = ((np.float32(got["mass"]) - m) * ours + m * np.array(dep["theta"], np.float32)) / np.float32(got["mass"])
        np.testing.assert_allclose(got["theta"], want, rtol=1e-5, atol=1e-6)
        ours = np.array(got["theta"], np.float32)
    np.testing.assert_allclose(flat(run.result.model), log["consensus"][-1]["theta"], rtol=1e-6)
    assert run.result.final_eval == pytest.approx(float(np.mean(ours)), rel=1e-5)
    run.assert_clean()
    assert not [r.getMessage() for r in caplog.records if "violation" in r.getMessage()]
