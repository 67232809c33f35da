"""The controller service over real sockets in one process, facing a scripted relay and its ranks."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import zmq
from torch.utils.data import TensorDataset

from flodl_zmq.control_router import RELAY_SAW
from flodl_zmq.controller_service import ControllerService
from flodl_zmq.coordinator.liveness import RankState
from flodl_zmq.datasets import dataset_signature
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import TERMINATED_EXIT, ChildExit, ExitReports, ProcessEnv
from flodl_zmq.errors import TrainingError
from flodl_zmq.job import Job
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import RELAY_ROUTE, rank_identity, rank_sender, relay_sender
from flodl_zmq.payload import model_signature
from flodl_zmq.runlog import EVENTS_FILE
from flodl_zmq.settings import Settings
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire import records as rec

from .dataplane_helpers import ROUTE_SECRET, WAIT_S, token

pytestmark = pytest.mark.timeout(150)

WORLD = {"h": (0, 1)}


def model() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)


def job(mode: str = "cpu-cadence") -> Job:
    data = TensorDataset(torch.arange(128.0).reshape(64, 2), torch.zeros(64, 1))
    return Job(
        model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train_step=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), dataset=data,
        batch_size=8, epochs=1, quiet=True, mode=mode,
    )


class ScriptedRelay:
    """A relay for host `h` that speaks for its ranks: each rank signs its own records."""

    def __init__(self, ctx: zmq.Context, endpoint: str, key: bytes, run_id: bytes, j: Job):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.codec = Codec(key, run_id, relay_sender("h"))
        self.ranks = {r: Codec(key, run_id, rank_sender(r)) for r in WORLD["h"]}
        torch.manual_seed(j.seed)
        self.sigs = (model_signature(j.model()), dataset_signature(j.dataset))

    def relay_send(self, record) -> None:
        self.sock.send_multipart([RELAY_ROUTE, *self.codec.encode(record, channel=Channel.CONTROL)])

    def send(self, rank: int, record) -> None:
        self.sock.send_multipart([rank_identity(rank), *self.ranks[rank].encode(record, channel=Channel.CONTROL)])

    def hello(self, rank: int) -> None:
        model_sig, data_sig = self.sigs
        self.send(rank, rec.RankHello(rank=rank, world_size=2, host="h", model_sig=model_sig, dataset_sig=data_sig))

    def recv(self) -> tuple[bytes, str]:
        """The next record for this host: (route, kind)."""
        assert self.sock.poll(int(WAIT_S * 1000)), "the controller sent nothing"
        route, *frames = self.sock.recv_multipart()
        return route, type(self.codec.decode(frames, Channel.CONTROL, replay=False).record).__name__

    def wait_for(self, route: bytes, kind: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.recv() == (route, kind):
                return
        raise AssertionError(f"no {kind} for route {route!r}")


@pytest.fixture
def rig(request):
    """A controller of `job(mode)` (mode: the test's indirect parameter, else Cadence) and its scripted relay."""
    ctx = zmq.Context()
    key, run_id = new_key(), bytes(range(16))
    address = ControllerAddress("127.0.0.1", free_port_base())
    exits, exits_w = os.pipe()  # the launcher's exit reports (FLODL_EXIT_FD): a test writes them to outcome["exits"]
    penv = ProcessEnv(role="controller", controller=address, key=key, run_id=run_id, incarnation=run_id, world=WORLD,
                      settings=Settings(startup_timeout_s=WAIT_S), route_secret=ROUTE_SECRET, exit_fd=exits)
    j = job(getattr(request, "param", "cpu-cadence"))
    service = ControllerService(j, penv)
    outcome: dict = {"exits": exits_w}

    def run() -> None:
        try:
            outcome["result"] = service.run()
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever ended the run
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    relay = ScriptedRelay(ctx, address.endpoint(Channel.CONTROL), key, run_id, j)
    relay.relay_send(rec.RelayHello(host="h", ranks=[0, 1], model_sigs=[], token=token("h")))
    relay.wait_for(RELAY_ROUTE, "RelayHelloAck")
    yield service, relay, thread, outcome
    for rank in (0, 1):  # the relay reports its ranks gone: the run ends, the service returns
        relay.relay_send(rec.RankExit(rank))
    thread.join(WAIT_S)
    relay.sock.close(0)
    os.close(exits_w)
    os.close(exits)
    assert not thread.is_alive(), "the controller service outlived its test"
    ctx.term()


def test_a_rank_sending_an_illegal_record_is_declared_dead_and_the_run_goes_on(rig):
    service, relay, thread, outcome = rig
    relay.hello(0)
    relay.hello(1)
    relay.wait_for(rank_identity(1), "StartEpoch")
    # Rank 0 sends a record claiming to be rank 1: a correct rank never does.
    relay.send(0, rec.Exiting(rank=1))
    relay.wait_for(rank_identity(0), "Shutdown")
    # The service thread records the death (`deaths`), then hands it to the core: wait for the
    # core's verdict, the last of the two (waiting for the first raced the second, ~1 run in 50).
    deadline = time.monotonic() + WAIT_S
    while service.core.liveness.state(0) is RankState.LIVE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.core.liveness.state(0) is RankState.DEAD
    assert "protocol violation: " in service.deaths[0][1] and "claims rank 1" in service.deaths[0][1]
    assert service.counts["violation.control"] == 1
    assert thread.is_alive() and "error" not in outcome  # the service did not crash
    assert service.core.liveness.state(1) is RankState.LIVE
    # The survivor is still served, then leaves cleanly: the run ends the way the core decides.
    relay.send(1, rec.Heartbeat(rank=1, step_count=0))
    relay.send(1, rec.Exiting(rank=1))
    thread.join(WAIT_S)
    assert not thread.is_alive()
    # Every rank is gone, so the core ends the run as it ends any run that lost every rank.
    assert isinstance(outcome.get("error"), TrainingError) and "stopped early (all_ranks_lost)" in str(outcome["error"])
    # ...and the error says where the cause is written: a user's first question.
    assert "the controller's log names each death" in str(outcome["error"])
    assert "'rank N: training failed: ERROR'" in str(outcome["error"])


def test_a_rank_that_leaves_before_the_world_forms_is_left_out_at_once(rig):
    service, relay, thread, outcome = rig
    relay.hello(0)
    relay.relay_send(rec.RankExit(rank=1))
    relay.wait_for(rank_identity(0), "StartEpoch")  # not the start-up timeout: the world formed without it
    assert service.started and service.core.liveness.state(1) is RankState.DEAD
    assert "before the world formed: the relay on h saw it leave" in service.deaths[1][1]
    relay.send(0, rec.Exiting(rank=0))  # the last rank leaves: the run ends, the service stops
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_rank_that_exits_cleanly_before_it_said_hello_is_left_out_at_once(rig):
    # Its launcher's report of exit code 0 was taken for a goodbye: the world waited for the rank's
    # hello until the relay's first-record limit (60 s) before it formed without it.
    service, relay, thread, outcome = rig
    relay.hello(0)
    os.write(outcome["exits"], ExitReports.line(ChildExit("h", 1, 0)))
    relay.wait_for(rank_identity(0), "StartEpoch")  # not the start-up timeout: the world formed without it
    assert service.core.liveness.state(1) is RankState.DEAD and "it exited with code 0" in service.deaths[1][1]
    relay.send(0, rec.Exiting(rank=0))
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_rank_its_agent_stopped_with_sigterm_left_the_run_and_is_no_failure(rig):
    # Ctrl-C on an agent: its ranks say goodbye as they stop, and the agent reports exit code 143. A report that
    # came first declared the rank dead, counted by max_failures, where the docs say it left.
    service, relay, thread, outcome = rig
    relay.hello(0)
    relay.hello(1)
    relay.wait_for(rank_identity(1), "StartEpoch")
    os.write(outcome["exits"], ExitReports.line(ChildExit("h", 1, TERMINATED_EXIT)))
    deadline = time.monotonic() + WAIT_S
    while service.core.liveness.state(1) is RankState.LIVE and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.core.liveness.state(1) is RankState.EXITED and 1 not in service.deaths
    relay.send(0, rec.Exiting(rank=0))
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_dead_rank_that_speaks_again_is_told_it_is_dead_again(rig):
    # Its death went once and was never resent: a link cut then lost it, and the rank, back on its
    # link, trained on unheard until its own silence limit (30 s in the links trial).
    service, relay, thread, outcome = rig
    relay.hello(0)
    relay.hello(1)
    relay.wait_for(rank_identity(1), "StartEpoch")
    relay.relay_send(rec.RankExit(rank=1))  # its relay lost it: dead, and told so once (that copy is "lost")
    relay.wait_for(rank_identity(1), "DeclareDead")
    relay.send(1, rec.Heartbeat(rank=1, step_count=0))  # the rank speaks again
    relay.wait_for(rank_identity(1), "DeclareDead")
    relay.send(0, rec.Exiting(rank=0))
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_rank_lost_before_a_re_form_keeps_its_cause_when_the_new_world_forms_without_it(rig):
    # status and the log said "before the world formed: no host holds it" of a rank whose host was lost mid-run.
    service, relay, thread, outcome = rig
    service.deaths[1] = (1.0, "host h1 lost: its agent fell silent")  # the world before's, as run_controller carries it
    relay.hello(0)
    relay.relay_send(rec.RankExit(rank=1))
    relay.wait_for(rank_identity(0), "StartEpoch")
    assert service.deaths[1] == (1.0, "host h1 lost: its agent fell silent")
    relay.send(0, rec.Exiting(rank=0))
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_the_start_up_fails_at_once_naming_every_rank_gone_when_none_remain(rig):
    service, relay, thread, outcome = rig
    t0 = time.monotonic()
    relay.relay_send(rec.RankExit(rank=1))
    relay.relay_send(rec.RankExit(rank=0))
    thread.join(WAIT_S)
    assert not thread.is_alive() and time.monotonic() - t0 < WAIT_S / 2  # not the start-up timeout
    assert f"rank 0 (the relay on h saw it leave: {RELAY_SAW}); rank 1 (the relay on h saw it leave" in str(
        outcome["error"])
    assert "0 of 2 ranks remain" in str(outcome["error"])


def test_the_controller_holds_the_model_once_its_tensors_view_the_kept_consensus(rig):
    # At 124M parameters a second copy is 0.5 GB in the controller (docs/benchmarks.md, bench/large.py).
    service, _, _, _ = rig
    flat = torch.from_numpy(service.kept.consensus)
    start, end = flat.data_ptr(), flat.data_ptr() + flat.nbytes
    assert all(start <= p.data_ptr() < end for p in service.model.parameters())
    service.kept.consensus[:] = 7.0  # what a kept round writes is the model, with no copy back
    assert all(bool((p == 7.0).all()) for p in service.model.parameters())


def test_a_rank_that_leaves_mid_run_is_said_by_the_controller_and_in_the_run_log(rig, caplog):
    # A rank whose loop broke or raised said goodbye and was gone from the run without a word on the
    # controller's console or in events.jsonl: the run directory could not tell why its share fell to 0.
    service, relay, thread, outcome = rig
    relay.hello(0)
    relay.hello(1)
    relay.wait_for(rank_identity(1), "StartEpoch")
    relay.send(1, rec.Exiting(rank=1))
    deadline = time.monotonic() + WAIT_S
    while service.core.liveness.state(1) is RankState.LIVE and time.monotonic() < deadline:
        time.sleep(0.01)  # the core's verdict comes after the service's word: wait for the last
    assert service.core.liveness.state(1) is RankState.EXITED
    assert "rank 1 left the run before its end (it said goodbye); training goes on without it" in caplog.text
    events = [json.loads(line) for line in (service.report.events.run_dir / EVENTS_FILE).read_text().splitlines()]
    assert [e["rank"] for e in events if e["kind"] == "exit"] == [1]
    assert thread.is_alive() and "error" not in outcome
