"""Interop: ranks written from protocol/PROTOCOL.md alone (spec_rank.py) run a job on our real services.

The controller (coordinator, reducer) runs in this process and the host's real relay beside it;
both ranks are spec_rank.py processes. What a user checks: the run completes, each epoch covers
every sample once, every consensus is the mass-weighted mean of the deposits, the controller ends
on the last consensus, and no service saw a protocol violation.
"""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from torch.utils.data import TensorDataset

from flodl_zmq.controller_service import ControllerService
from flodl_zmq.datasets import dataset_signature
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.job import Job
from flodl_zmq.launch import free_port_base
from flodl_zmq.payload import model_signature
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.settings import Settings
from flodl_zmq.wire import Channel, new_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))
from dataplane_helpers import ROUTE_SECRET, WAIT_S, token  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_rank  # noqa: E402

pytestmark = pytest.mark.timeout(90)

SPEC_RANK = Path(__file__).resolve().parent / "spec_rank.py"
WORLD = {"h": (0, 1)}
SAMPLES, BATCH, EPOCHS = 48, 4, 2
ALLOWED = {"zmq", "msgpack", "numpy", "hashlib", "hmac", "cryptography", "__future__", "argparse", "json", "os",
           "struct", "sys", "time"}


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(2.0 * SAMPLES).reshape(SAMPLES, 2), torch.zeros(SAMPLES, 1))


def job() -> Job:
    return Job(model=lambda: torch.nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
               train_step=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), dataset=dataset(),
               batch_size=BATCH, epochs=EPOCHS, quiet=True, mode="cpu-cadence")


def test_the_spec_rank_imports_nothing_of_flodl_zmq():
    tree = ast.parse(SPEC_RANK.read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= ALLOWED, f"spec_rank.py imports {roots - ALLOWED}"


def test_the_spec_signatures_are_the_ones_our_ranks_compute():
    torch.manual_seed(0)
    assert spec_rank.model_signature([("weight", (1, 2)), ("bias", (1,))]) == model_signature(torch.nn.Linear(2, 1))
    items = [tuple(t.numpy() for t in dataset()[i]) for i in range(SAMPLES)]
    assert spec_rank.dataset_signature(items, SAMPLES) == dataset_signature(dataset())


def test_spec_ranks_train_a_whole_job_against_the_real_relay_and_controller(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    ctx = zmq.Context()
    key, run_id = new_key(), bytes(range(16))
    address = ControllerAddress("127.0.0.1", free_port_base())
    penv = ProcessEnv(role="controller", controller=address, key=key, run_id=run_id, incarnation=run_id, world=WORLD,
                      settings=Settings(startup_timeout_s=WAIT_S), route_secret=ROUTE_SECRET)
    service = ControllerService(job(), penv)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=service.run()), daemon=True)
    thread.start()
    local = {n: f"ipc://{tmp_path}/h-{n}" for n in ("control", "data")}
    relay = Relay(RelayConfig("h", WORLD["h"], key, run_id, address.endpoint(Channel.CONTROL),
                              address.endpoint(Channel.DATA), address.endpoint(Channel.BROADCAST), local["control"],
                              local["data"], host_token=token("h")), ctx)
    relay.start()
    sig = dataset_signature(dataset()).hex()
    procs = [subprocess.Popen([sys.executable, str(SPEC_RANK), "--control", local["control"], "--data", local["data"],
                               "--key", key.hex(), "--incarnation", run_id.hex(), "--host", "h", "--dataset-sig", sig,
                               "--out", str(tmp_path / f"r{r}.json"), "--rank", str(r), "--world-size", "2",
                               "--values", "3", "--batch-size", str(BATCH)]) for r in WORLD["h"]]
    try:
        for p in procs:
            assert p.wait(timeout=60) == 0
        thread.join(WAIT_S)
        assert not thread.is_alive() and "result" in outcome, "the controller did not finish the run"
    finally:
        for p in procs:
            p.kill()
        relay_counts = relay.counters()
        relay.stop()
        ctx.term()
    logs = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in WORLD["h"]]
    for epoch in range(EPOCHS):  # every sample of the epoch's permutation trained once
        covered = sorted(i for log in logs for s in log["spans"] if s["epoch"] == epoch
                         for i in range(s["offset"], s["offset"] + s["size"]))
        assert covered == list(range(SAMPLES)), f"epoch {epoch} covered {covered}"
    rounds = sorted({d["round"] for log in logs for d in log["deposits"]})
    assert rounds, "no round was averaged"
    for round_id in rounds:  # each consensus is sum(mass * theta) / sum(mass) of that round's deposits
        deps = [d for log in logs for d in log["deposits"] if d["round"] == round_id]
        mass = sum(d["mass"] for d in deps)
        want = sum(np.float32(d["mass"]) * np.array(d["theta"], np.float32) for d in deps) / np.float32(mass)
        for log in logs:
            got = [c for c in log["consensus"] if c["round"] == round_id]
            assert len(got) == 1 and got[0]["mass"] == mass
            np.testing.assert_allclose(got[0]["theta"], want, rtol=1e-6)
    last = logs[0]["consensus"][-1]["theta"]
    steps = SAMPLES * EPOCHS // BATCH // 2  # each rank took about half the steps, each +0.01
    assert 0.5 * steps * 0.01 < last[0] < 1.5 * steps * 0.01
    model = outcome["result"].model
    np.testing.assert_allclose(torch.cat([p.detach().flatten() for p in model.parameters()]).numpy(), last, rtol=1e-6)
    assert all(log["rejected"] == 0 and log["unacked"] == [] for log in logs)
    bad = ("violation", "rejected", "forged", "unexpected", "unknown", "bad_")
    for counts in (service.counts, relay_counts):
        assert not {k: v for k, v in counts.items() if v and any(b in k for b in bad)}, counts
    assert relay_counts["rounds_shipped"] == len(rounds)
    assert not [r.getMessage() for r in caplog.records if "violation" in r.getMessage()]
    print(json.dumps({"rounds": rounds, "relay": relay_counts, "controller": dict(service.counts),
                      "spans": [log["spans"] for log in logs]}))
