"""The data plane as real processes over tcp loopback: relay processes, rank processes, and the
reducer service in this process (the coordinator is not part of these tests: a drained control
ROUTER stands in for it, and deaths are declared through the reducer's API as it will)."""

from __future__ import annotations

import glob
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import with_tunables
from flodl_zmq.launch import free_port_base
from flodl_zmq.links import host_token
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.settings import Settings
from flodl_zmq.warm import WarmServer
from flodl_zmq.wire import Channel, new_key
from flodl_zmq.wire.shm import rank_owner, run_dir, segment_prefix, unlink_run
from flodl_zmq.wire_format import named

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))
from dataplane_helpers import model, reference, tiered_bf16_reference  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dataplane_rank import MASS, SIZES  # noqa: E402

HOSTS = {"a": (0, 1), "b": (2, 3)}
WAIT_S = 90.0  # a hang guard: six processes starting beside another test take a while

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(sys.platform != "linux", reason="ipc, signals")]


class Proc:
    """A child process forked from the warm interpreter (torch imported once), its output lines collected by a thread."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], warm: WarmServer):
        self.p = warm.spawn(name, argv, env)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            with self._cv:
                self.lines.append(line.decode(errors="replace").rstrip())
                self._cv.notify_all()

    def wait_for(self, text: str, timeout: float = WAIT_S) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: any(text in ln for ln in self.lines), timeout):
                raise TimeoutError(f"{text!r} not seen; output: {self.lines[-20:]}")

    def signal(self, sig: int) -> None:
        os.kill(self.p.pid, sig)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.signal(signal.SIGKILL)
        self.p.wait(10)


class World:
    def __init__(self, tmp_path: Path, warm: WarmServer, rounds: int, dtype: str = "f32",
                 hang: dict[int, int] | None = None, shm: bool = False):
        self.key, self.run_id = new_key(), os.urandom(16)
        self.out = tmp_path
        port = free_port_base()
        addr = ControllerAddress("127.0.0.1", port)
        self.ctx = zmq.Context()
        self._stop = threading.Event()
        self._coord = threading.Thread(target=self._drain_control, args=(addr.endpoint(Channel.CONTROL),),
                                       daemon=True)
        self._coord.start()
        secret = os.urandom(32)  # the controller's route secret: each relay gets its host's token of it
        self.reducer = ReducerService(ReducerConfig.for_controller(HOSTS, self.key, self.run_id, addr,
                                                                   wire=named(dtype), route_secret=secret), self.ctx)
        self.reducer.start()
        env = {role: with_tunables(dict(os.environ, FLODL_KEY=self.key.hex()), role) for role in ("relay", "rank")}
        self.procs: dict[str, Proc] = {}
        for host, ranks in HOSTS.items():
            local = {ch: f"ipc://{tmp_path}/{host}-{ch}" for ch in ("control", "data")}
            self.procs[host] = Proc(
                f"{host}:relay", [str(HERE / "dataplane_relay.py"), "--host", host, "--ranks", ",".join(map(str, ranks)),
                 "--controller", str(addr), "--run-id", self.run_id.hex(),
                 "--local-control", local["control"], "--local-data", local["data"], "--wire-dtype", dtype],
                dict(env["relay"], FLODL_HOST_TOKEN=host_token(secret, host).hex()), warm)
            for r in ranks:
                self.procs[f"r{r}"] = Proc(
                    f"r{r}", [str(HERE / "dataplane_rank.py"), "--rank", str(r), "--run-id",
                     self.run_id.hex(), "--control", local["control"], "--data", local["data"],
                     "--rounds", str(rounds), "--dtype", dtype, "--out", str(tmp_path),
                     "--hang-at", str((hang or {}).get(r, 0)), "--host", host] + (["--shm"] if shm else []), env["rank"], warm)

    def _drain_control(self, endpoint: str) -> None:
        s = self.ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(endpoint)
        while not self._stop.is_set():
            if s.poll(50):
                s.recv_multipart()
        s.close(0)

    def consensus(self, rank: int, round_id: int) -> np.ndarray:
        self.procs[f"r{rank}"].wait_for(f"round {round_id} done")
        return np.load(self.out / f"r{rank}_round{round_id}.npy")

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
        unlink_run(self.key, self.run_id)  # as the launcher does: SIGKILLed relays leave their segments
        self._stop.set()
        self._coord.join(5)
        self.reducer.stop()
        self.ctx.destroy(0)


def expected(round_id: int, ranks: list[int], dtype: str) -> np.ndarray:
    contribs = {r: (model(r, round_id, SIZES), MASS[r]) for r in ranks}
    if dtype == "f32":
        want = reference(list(contribs.values()), dtype)
    else:
        want = tiered_bf16_reference([[contribs[r] for r in rs if r in contribs] for rs in HOSTS.values()])
    return np.concatenate(want)


def assert_mean(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    if dtype == "f32":
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6
    else:  # bf16 consensus: at most one ulp off the exact tiered result, rarely
        assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want))
        assert np.count_nonzero(got != want) <= max(1, got.size // 100)


@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shm"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_two_hosts_of_two_rank_processes_produce_the_weighted_mean(tmp_path, warm, dtype, shm):
    w = World(tmp_path, warm, rounds=2, dtype=dtype, shm=shm)
    try:
        for k in (1, 2):
            want = expected(k, [0, 1, 2, 3], dtype)
            for r in range(4):
                assert_mean(w.consensus(r, k), want, dtype)
                assert f"by_reference={shm}" in w.procs[f"r{r}"].lines[-1]
    finally:
        w.close()


def segments_of(key: bytes, run_id: bytes, rank: int) -> list[str]:
    return glob.glob(os.path.join(run_dir(key, run_id), segment_prefix(run_id, rank_owner(rank)) + "*"))


@pytest.mark.parametrize("shm", [False, True], ids=["frames", "shm"])
def test_sigkilled_rank_mid_round_leaves_the_barrier_and_survivors_get_their_mean(tmp_path, warm, shm):
    w = World(tmp_path, warm, rounds=3, hang={3: 2}, shm=shm)
    try:
        w.procs["r3"].wait_for("hanging at 2")
        for r in (0, 1, 2):  # the survivors deposit round 2 and wait in the barrier
            w.consensus(r, 1)
        time.sleep(0.3)
        killed = time.monotonic()
        if shm:
            assert segments_of(w.key, w.run_id, 3), "the hanging rank deposited round 1 from its segment"
        w.procs["r3"].kill()
        for k in (2, 3):
            want = expected(k, [0, 1, 2], "f32")
            for r in (0, 1, 2):
                assert_mean(w.consensus(r, k), want, "f32")
            if k == 2:
                # Out of the barrier within the 1.5 s heartbeat deadline, plus the round itself.
                assert time.monotonic() - killed < 5.0
        # The killed rank could not unlink its segment; its relay did when the rank left.
        assert segments_of(w.key, w.run_id, 3) == []
    finally:
        w.close()


def test_a_stopped_relay_kills_none_of_its_ranks_and_a_sigkilled_one_lets_the_other_host_finish(tmp_path, warm):
    w = World(tmp_path, warm, rounds=3, hang={2: 2, 3: 2})
    try:
        for r in range(4):
            w.consensus(r, 1) if r < 2 else w.procs[f"r{r}"].wait_for("hanging at 2")
        # Relay a's own stall (SIGSTOP here; in the field torch's import holding its GIL) is not its
        # ranks' silence: their heartbeats wait in the socket and are read before a deadline is judged.
        w.procs["a"].signal(signal.SIGSTOP)
        time.sleep(2 * Settings().rank_silence_at_relay_s)
        w.procs["a"].signal(signal.SIGCONT)
        w.procs["b"].kill()
        for r in HOSTS["b"]:  # what the coordinator does once the host's heartbeats stop
            w.reducer.declare_dead(r)
        for k in (2, 3):
            want = expected(k, [0, 1], "f32")
            for r in (0, 1):
                assert_mean(w.consensus(r, k), want, "f32")
        outcomes = [w.reducer.completed.get(timeout=WAIT_S) for _ in range(3)]
        assert [o.hosts for o in outcomes] == [("a", "b"), ("a",), ("a",)]
        assert not [ln for ln in w.procs["a"].lines if "left" in ln], w.procs["a"].lines
    finally:
        w.close()

