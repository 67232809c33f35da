"""Nothing lost in a reset on the control link (PROTOCOL.md 10.7): a dropped record is resent, handed on once, in order.

A whole run in one process: the real controller service, a real relay and
two real ranks (threads), with a shim between the relay and the controller's
control port that drops the control records named, as a connection reset
does to a record in flight. The run must finish with every epoch's samples
trained exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import torch
import zmq
from torch.utils.data import TensorDataset

from flodl_zmq.controller_service import ControllerService
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.job import Job
from flodl_zmq.launch import free_port_base
from flodl_zmq.rank import RankRuntime
from flodl_zmq.rank_link import RankConfig
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.settings import Settings
from flodl_zmq.wire import Channel, new_key

from .dataplane_helpers import ROUTE_SECRET, token
from .test_resend import DropShim

pytestmark = pytest.mark.timeout(90)

WORLD = {"h": (0, 1)}
SAMPLES = 256
EPOCHS = 3


def job() -> Job:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    return Job(
        model=lambda: torch.nn.Linear(4, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
        train_step=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), dataset=data,
        batch_size=8, epochs=EPOCHS, quiet=True,
    )


def run_with_drops(tmp_path, drops: dict[tuple[str, bool], int]) -> tuple[dict, ControllerService, list[RankRuntime]]:
    """One run of WORLD with `drops` applied on the relay's control link (the shim's count in outcome)."""
    key, run_id = new_key(), uuid.uuid4().bytes
    address = ControllerAddress("127.0.0.1", free_port_base())
    penv = ProcessEnv(role="controller", controller=address, key=key, run_id=run_id, incarnation=run_id, world=WORLD,
                      settings=Settings(startup_timeout_s=30.0), route_secret=ROUTE_SECRET)
    service = ControllerService(job(), penv)
    outcome: dict = {}

    def run_controller() -> None:
        outcome["thread"] = threading.get_ident()  # whose log records are this run's
        try:
            outcome["result"] = service.run()
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever ended the run
            outcome["error"] = exc

    ctx = zmq.Context.instance()
    tag = uuid.uuid4().hex[:8]
    local = (f"ipc://{tmp_path}/c-{tag}", f"ipc://{tmp_path}/d-{tag}")
    shim_ep = f"ipc://{tmp_path}/shim-{tag}"
    cfg = RelayConfig("h", WORLD["h"], key, run_id, shim_ep, address.endpoint(Channel.DATA),
                      address.endpoint(Channel.BROADCAST), *local, host_token=token("h"))
    relay = Relay(cfg, ctx)
    shim = DropShim(ctx, shim_ep, address.endpoint(Channel.CONTROL), relay.identity, drops)
    threads = [threading.Thread(target=run_controller, daemon=True)]
    ranks = []
    for r in WORLD["h"]:
        rcfg = RankConfig(rank=r, local_rank=r, world_size=2, host="h", key=key, incarnation=run_id,
                          control_endpoint=local[0], data_endpoint=local[1])
        rt = RankRuntime(job(), rcfg, torch.device("cpu"))
        ranks.append(rt)
        threads.append(threading.Thread(target=rt.run, daemon=True))
    try:
        relay.start()
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), f"the run stalled: {outcome}"
    finally:
        relay.stop()
        shim.close()
    outcome["dropped"] = shim.dropped
    return outcome, service, ranks


@pytest.mark.parametrize("drops", [
    pytest.param({("control.update", False): 1, ("metrics.epoch", True): 1}, id="an update down, epoch metrics up"),
    # Step reports go up merged by the relay (PROTOCOL.md 10.7 item 9): a lost merged record is
    # recovered by its ranks' resends, merged again.
    pytest.param({("control.start_epoch", False): 1, ("relay.reports", True): 2}, id="a plan down, merged reports up"),
])
def test_a_control_record_lost_either_way_is_resent_and_every_sample_is_trained_once(tmp_path, drops):
    outcome, service, ranks = run_with_drops(tmp_path, drops)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["dropped"] == sum(drops.values()), "the chosen records never crossed the link"
    assert [e["samples"] for e in outcome["result"].epochs] == [SAMPLES] * EPOCHS
    assert service.deaths == {}, "a lost record cost a rank its place"
    # Recovered by the resend, not by luck: each side sent again at least what it lost.
    assert service.router.resends["h"] >= sum(n for (_, up), n in drops.items() if not up)
    assert sum(rt.link.resent_control for rt in ranks) >= sum(n for (_, up), n in drops.items() if up)


def test_resends_through_an_outage_are_logged_once_and_summed_up_when_it_ends(tmp_path, caplog):
    # The update and its next two resends lost: three resend passes to rank(s) of host h, one warning.
    caplog.set_level(logging.INFO, logger="flodl_zmq.control_router")
    outcome, service, _ = run_with_drops(tmp_path, {("control.update", False): 3})
    assert "error" not in outcome, outcome.get("error")
    assert outcome["dropped"] == 3 and service.router.resends["h"] >= 3
    # This run's controller loop only: a service another test left behind may still be logging.
    said = [r.getMessage() for r in caplog.records if r.thread == outcome["thread"]]
    assert len([m for m in said if "has not acknowledged" in m]) == 1, said
    assert len([m for m in said if "host h acknowledges again" in m]) == 1, said


def test_a_ranks_resend_warning_is_ended_by_a_line_at_its_level(tmp_path, caplog):
    # A rank logs warnings only: its outage's end, said at info, never showed where its warning did.
    caplog.set_level(logging.WARNING, logger="flodl_zmq.rank_link")
    outcome, _, _ = run_with_drops(tmp_path, {("metrics.epoch", True): 3})
    assert "error" not in outcome, outcome.get("error")
    said = [r.getMessage() for r in caplog.records if r.name == "flodl_zmq.rank_link"]
    warned = [m for m in said if "the coordinator has not acknowledged" in m]
    assert warned and len([m for m in said if "the coordinator acknowledges again" in m]) == len(warned), said
