"""A relay written from PROTOCOL.md alone (spec_relay.py) serves a whole job between our real ranks and controller.

The controller runs in this process (the reducer with it); the relay and both ranks are processes,
each given only the FLODL_* environment a spawner gives. Our ranks train (lr > 0), so every round's
consensus moves; the relay logs what it folded, and the reducer's consensus must be exactly that sum
over the mass. What a user checks: the run completes, each epoch covers every sample once, every
consensus is the mass-weighted mean of the host's deposits, the controller ends on the last one, and
no service saw a protocol violation.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from flodl_zmq.controller_service import ControllerService
from flodl_zmq.datasets import dataset_signature
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.job import Job
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import remove_local_dir
from flodl_zmq.settings import Settings
from flodl_zmq.wire import new_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))
from dataplane_helpers import ROUTE_SECRET, WAIT_S, token  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_job import BATCH, EPOCHS, SAMPLES, dataset, job  # noqa: E402
from test_spec_rank import BAD_COUNTS, NUDGE, OWN_RANK, SPEC_RANK, flat  # noqa: E402

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve().parent
WORLD = {"h": (0, 1)}
LR = 1e-5  # small enough for inputs up to 95 (interop_job.dataset): the model moves and stays finite


def rank_command(kind: str, rank: int, tmp: Path) -> list[str]:
    """Ours (own_rank_job.py, training at LR) or the spec rank (spec_rank.py, its deposits framed)."""
    if kind == "own":
        return [sys.executable, str(OWN_RANK)]
    return [sys.executable, str(SPEC_RANK), "--dataset-sig", dataset_signature(dataset()).hex(),
            "--out", str(tmp / f"r{rank}.json"), "--values", "3", "--batch-size", str(BATCH),
            "--samples", str(SAMPLES), "--seed", "42", "--nudge", str(NUDGE)]


# Our ranks deposit by reference (3.5); the spec rank frames its deposits: both forms in one fold.
@pytest.mark.parametrize("kinds", [("own", "own"), ("own", "spec")], ids="-".join)
def test_ranks_train_a_whole_job_through_the_spec_relay(tmp_path, caplog, kinds):
    caplog.set_level(logging.WARNING)
    key, run_id = new_key(), os.urandom(16)
    address = ControllerAddress("127.0.0.1", free_port_base())

    def environ(role: str, **extra) -> dict[str, str]:
        penv = ProcessEnv(role=role, controller=address, key=key, run_id=run_id, incarnation=run_id, world=WORLD,
                          settings=Settings(startup_timeout_s=WAIT_S), **extra)
        return {**os.environ, **penv.to_environ()}

    service = ControllerService(Job(**job(lr=LR)), ProcessEnv(
        role="controller", controller=address, key=key, run_id=run_id, incarnation=run_id, world=WORLD,
        settings=Settings(startup_timeout_s=WAIT_S), route_secret=ROUTE_SECRET))
    init = flat(service.model)
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=service.run()), daemon=True)
    thread.start()
    root = str(HERE.parents[1])
    relay = subprocess.Popen([sys.executable, str(HERE / "spec_relay.py"), "--out", str(tmp_path / "relay.json")],
                             env=environ("relay", host="h", host_token=token("h")))
    ranks = [subprocess.Popen(rank_command(kind, r, tmp_path), cwd=root, env={
        **environ("rank", host="h", rank=r, local_rank=r), "OWN_RANK_LOG": str(tmp_path / f"r{r}.ids"),
        "OWN_RANK_LR": str(LR), "PYTHONPATH": root}) for r, kind in zip(WORLD["h"], kinds, strict=True)]
    try:
        for p in ranks:
            assert p.wait(timeout=60) == 0, "a rank failed"
        thread.join(WAIT_S)
        assert not thread.is_alive() and "result" in outcome, "the controller did not finish the run"
        relay.terminate()
        assert relay.wait(timeout=WAIT_S) == 0, "the spec relay failed"
    finally:
        for p in (*ranks, relay):
            p.kill()
        remove_local_dir(key, run_id)
    result, log = outcome["result"], json.loads((tmp_path / "relay.json").read_text())

    ids = {r: [int(i) for i in (tmp_path / f"r{r}.ids").read_text().split()] for r, k in enumerate(kinds) if k == "own"}
    spec_logs = [json.loads((tmp_path / f"r{r}.json").read_text()) for r, k in enumerate(kinds) if k == "spec"]
    assert all(s["rejected"] == 0 and s["unacked"] == [] for s in spec_logs), "the spec rank refused or lost a record"
    spans = [s for log in spec_logs for s in log["spans"]]
    for e, row in enumerate(result.epochs):  # our ranks' steps in order; the rows say how many each held
        trained = [i for s in spans if s["epoch"] == e for i in s["ids"]]
        for r in ids:
            n = row["per_rank_samples"][r]
            trained, ids[r] = trained + ids[r][:n], ids[r][n:]
        assert sorted(trained) == list(range(SAMPLES)), f"epoch {e} did not cover every sample once"
    assert all(left == [] for left in ids.values()), "our rank trained samples outside every epoch"

    assert log["shipped"] and [s["round"] for s in log["shipped"]] == [d["round"] for d in log["delivered"]]
    for shipped, got in zip(log["shipped"], log["delivered"], strict=True):
        mass = np.float32(sum(shipped["masses"].values()))
        assert got["mass"] == mass and sorted(shipped["masses"]) == ["0", "1"], "both ranks in every round"
        if mass > 0:  # the reducer divides the host frame once by its mass (9.5)
            np.testing.assert_allclose(got["theta"], np.float32(shipped["sum"]) / mass, rtol=1e-6)
    last = log["delivered"][-1]["theta"]
    assert not np.allclose(last, init), "training moved the model"
    np.testing.assert_allclose(flat(result.model), last, rtol=1e-6,  # the controller ends on it
                               err_msg=f"the relay delivered {[(d['round'], d['mass']) for d in log['delivered']]}")
    assert log["violations"] == [] and log["counts"].get("by_reference", 0) > 0, log["counts"]
    assert not {k: v for k, v in service.counts.items() if v and any(b in k for b in BAD_COUNTS)}, service.counts
    assert not [r.getMessage() for r in caplog.records if "violation" in r.getMessage()]
    assert len(result.epochs) == EPOCHS
