"""The join protocol over real TCP sockets on loopback: membership service <-> agents.

Every wait is bounded: agents have short reply/silence timeouts, the service
heartbeats fast, and the window's cap is seconds.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from flodl_zmq.agent import Agent
from flodl_zmq.agent_rules import AgentConfig
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import REFUSED_EXIT, SpawnSpec, reported_exit
from flodl_zmq.errors import MembershipError
from flodl_zmq.host_links import HostDone, HostLost, RankExitReported, RelayExitReported
from flodl_zmq.join import JoinConfig, JoinWindow, WindowPhase
from flodl_zmq.membership import MembershipService
from flodl_zmq.security import CurveKeys
from flodl_zmq.trust import JOIN_RUN_ID, TrustMode
from flodl_zmq.wire import Channel, Codec, compute_mac, new_key
from flodl_zmq.wire.records import JoinHello, JoinReject

SIG = bytes([7]) * 32
RUN_ID = bytes(range(16))


def join_timings(beat: float, silence: float) -> tuple[dict[str, float], dict[str, float]]:
    """The join link's timings, the same two numbers on both sides: (the controller's, an agent's)."""
    return (
        {"join_heartbeat_period_s": beat, "host_silence_at_controller_s": silence},
        {"join_heartbeat_period_s": beat, "controller_silence_at_agent_s": silence},
    )


FAST = join_timings(0.1, 2.0)

# The ranks' stand-in program, the one the agents agree to run (`script`): the
# relay (no FLODL_RANK) waits to be stopped; a rank runs the snippet the
# controller gives as the program's argument. Either ends with its agent, as
# the real ones do (the lifeline): a test that SIGKILLs an agent leaves none behind.
# That is environment.watch_lifeline's rule, written out: importing it would cost
# every stand-in the package's 0.3 s of imports.
CHILD = (
    "import os, sys, threading, time\n"
    "def orphaned():\n"
    "    os.read(int(os.environ['FLODL_LIFELINE_FD']), 1)\n"
    "    os._exit(0)\n"
    "threading.Thread(target=orphaned, daemon=True).start()\n"
    "if os.environ['FLODL_ROLE'] == 'relay':\n"
    "    time.sleep(60)\n"
    "exec(sys.argv[1])\n"
)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


class Cluster:
    """A membership service on loopback plus helpers to run agents against it."""

    def __init__(self, ctx, trust=TrustMode.PRE_SHARED, rank_code="pass", timings=FAST, program=None, **cfg):
        self.ctx = ctx
        controller_timings, self.agent_timings = timings
        self.key = new_key()
        config = {"min_ranks": 2, "join_window_s": 30.0, "join_cap_s": 30.0, **cfg}
        self.window = JoinWindow(JoinConfig(**config), opened_at=time.monotonic())
        spawn = SpawnSpec(program or ("-c", CHILD, rank_code))
        # Open admission needs CURVE: the agents pin this service's public key.
        public, secret = zmq.curve_keypair()
        self.curve = CurveKeys(public=public, secret=secret) if trust is TrustMode.OPEN else None
        self.service = MembershipService(
            self.window, endpoint="tcp://127.0.0.1:*", trust=trust, session_key=self.key,
            run_id=RUN_ID, incarnation=RUN_ID, spawn=spawn, context=ctx, curve=self.curve, **controller_timings,
        )
        port = int(self.service.endpoint.rsplit(":", 1)[1])
        self.address = ControllerAddress("127.0.0.1", port - 3)  # the join endpoint is port+3
        self.service.start()
        self.agents: list[Agent] = []

    def agent(self, host, n=1, *, key="same", out=None, **cfg) -> Agent:
        key = self.key if key == "same" else key
        if self.curve is not None:
            cfg.setdefault("curve", CurveKeys.for_client({"FLODL_CURVE_SERVER": self.curve.public.decode()}))
        cfg.setdefault("script", ("-c", CHILD))
        config = AgentConfig(
            cfg.pop("controller", self.address), host, tuple(f"cpu:{i}" for i in range(n)), key=key, dataset_sig=cfg.pop("sig", SIG),
            join_reply_timeout_s=cfg.pop("join_reply_timeout_s", 10.0), kill_grace_s=2.0, **self.agent_timings,
            **cfg,
        )
        a = Agent(config, context=self.ctx, out=out or io.StringIO())
        self.agents.append(a)
        return a

    def close(self):
        for a in self.agents:
            a.close()
        self.service.close()


@pytest.fixture
def cluster(ctx):
    made = []

    def make(**kw):
        c = Cluster(ctx, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def in_thread(fn):
    """Run `fn` in a thread; the returned getter yields its result or raises its exception."""
    box: queue.Queue = queue.Queue()

    def body():
        try:
            box.put((True, fn()))
        except BaseException as exc:  # handed to the test thread
            box.put((False, exc))

    threading.Thread(target=body, daemon=True).start()

    def get(timeout=20.0):
        ok, value = box.get(timeout=timeout)
        if not ok:
            raise value
        return value

    return get


def wait_joined(c, n):
    deadline = time.monotonic() + 10
    while c.window.joined_ranks < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.window.joined_ranks >= n


def events(service, timeout=20.0, until=lambda e: False):
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            e = service.events.get(timeout=0.1)
        except queue.Empty:
            continue
        out.append(e)
        if until(e):
            break
    return out


# --------------------------------------------------------------------------- admission


def test_open_admission_hands_out_the_session_key_and_forms_on_target(cluster):
    c = cluster(trust=TrustMode.OPEN, target_ranks=3)
    a = in_thread(c.agent("a", 1, key=None).join)
    wait_joined(c, 1)  # a before b: ranks go in admission order
    b = in_thread(c.agent("b", 2, key=None).join)
    ja, jb = a(), b()
    assert ja.session_key == jb.session_key == c.key
    assert ja.run_id == RUN_ID
    assert (ja.ranks, jb.ranks) == ((0,), (1, 2))
    assert ja.world_size == 3 and ja.spawn.world == {"a": (0,), "b": (1, 2)}
    verdict = c.service.wait_closed(5)
    assert verdict.phase is WindowPhase.FORMED and verdict.reason == "target ranks reached"


def test_pre_shared_key_drops_a_wrong_key_unanswered_and_forms_without_it(cluster):
    c = cluster(trust=TrustMode.PRE_SHARED, target_ranks=2)
    stranger = in_thread(c.agent("stranger", 1, key=new_key(), join_reply_timeout_s=1.5).join)
    with pytest.raises(MembershipError, match="no reply"):
        stranger()
    assert c.service.dropped == 1
    a, b = in_thread(c.agent("a").join), in_thread(c.agent("b").join)
    ja, jb = a(), b()
    assert ja.session_key == jb.session_key == c.key and sorted(ja.spawn.world) == ["a", "b"]
    assert c.service.wait_closed(5).world_size == 2


def test_wrong_dataset_and_wrong_version_are_refused_by_name_and_the_world_forms(cluster, monkeypatch):
    c = cluster(target_ranks=2)
    seed = in_thread(c.agent("seed").join)
    wait_joined(c, 1)  # the first member seeds the dataset signature
    with pytest.raises(MembershipError, match="REJECTED.*dataset signature mismatch"):
        c.agent("other-data", sig=bytes(32)).join()
    monkeypatch.setattr("flodl_zmq.agent.PROTOCOL_VERSION", 99)
    with pytest.raises(MembershipError, match="REJECTED.*protocol version skew"):
        c.agent("old-build").join()
    monkeypatch.undo()
    good = c.agent("good").join()
    assert seed().spawn.world == {"seed": (0,), "good": (1,)} == good.spawn.world


def test_a_hello_from_another_wire_version_gets_a_reject_naming_the_skew(cluster, ctx):
    c = cluster()
    codec = Codec(c.key, JOIN_RUN_ID, "future")
    header, *_ = codec.encode(JoinHello("future", ["cpu:0"], SIG, 1, None, bytes(16)), channel=Channel.JOIN)
    head = msgpack.unpackb(header)
    head["v"] = 2
    header = msgpack.packb(head, use_bin_type=True)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(c.address.endpoint(Channel.JOIN))
    dealer.send_multipart([header, compute_mac(c.key, header, [], version=2)])  # signed as a version 2 peer signs
    assert dealer.poll(10_000), "no reply to a version-skewed hello"
    reply = codec.decode(dealer.recv_multipart(), Channel.JOIN).record
    dealer.close()
    assert isinstance(reply, JoinReject) and "protocol version skew" in reply.reason
    assert "same flodl-zmq version" in reply.reason


def test_quorum_not_met_by_the_cap_aborts_the_joined_agents(cluster):
    c = cluster(min_ranks=2, join_window_s=0.2, join_cap_s=0.6)
    with pytest.raises(MembershipError, match="aborted.*quorum not met: 1/2"):
        c.agent("lonely").join()
    assert c.service.wait_closed(5).phase is WindowPhase.FAILED


# --------------------------------------------------------------------------- supervision


def test_rank_exits_are_reported_at_once_and_a_failed_rank_is_not_a_host_fault(cluster):
    code = "print('hello from', os.environ['FLODL_RANK'], flush=True); sys.exit(3 if os.environ['FLODL_RANK'] == '1' else 0)"
    c = cluster(target_ranks=3, rank_code=code)
    out = io.StringIO()
    other = c.agent("a", 1, out=io.StringIO())
    b = in_thread(c.agent("b", 2, out=out).run)
    a = in_thread(other.run)
    assert b() == 0 and a() == 0
    seen = events(c.service, timeout=1.0)
    exits = {(e.host, e.rank): e.code for e in seen if isinstance(e, RankExitReported)}
    ranks_b = c.window.members[[m.host for m in c.window.members].index("b")].ranks
    assert {exits[("b", r)] for r in ranks_b} == {0, 3}
    assert {e.host for e in seen if isinstance(e, HostDone)} == {"a", "b"}
    text = out.getvalue()
    for local, r in enumerate(ranks_b):
        assert f"[b:cpu{local}:r{r}] hello from {r}" in text


def test_an_agent_refusing_the_formed_worlds_program_reports_its_ranks_gone_at_once(cluster):
    # Admitted, then handed a program it does not run: it spawns nothing and says so for each of its
    # ranks (REFUSED_EXIT), so the controller goes on without them instead of waiting out its silence.
    c = cluster(target_ranks=3, rank_code="pass")
    refusing = in_thread(c.agent("b", 2, script=("other.py",)).run)
    wait_joined(c, 2)
    other = in_thread(c.agent("a").run)
    with pytest.raises(MembershipError, match="run refused: .* runs only 'other.py'"):
        refusing()
    assert other() == 0
    seen = events(c.service, timeout=1.0)
    ranks_b = c.window.members[[m.host for m in c.window.members].index("b")].ranks
    refused = {e.rank: e.code for e in seen if isinstance(e, RankExitReported) and e.host == "b"}
    assert refused == {r: REFUSED_EXIT for r in ranks_b}
    assert reported_exit("b", REFUSED_EXIT).startswith("its agent on b refused the run")


def test_a_killed_rank_is_reported_with_the_negative_signal(cluster):
    c = cluster(target_ranks=2, rank_code="import signal; os.kill(os.getpid(), signal.SIGKILL)")
    a, b = in_thread(c.agent("a").run), in_thread(c.agent("b").run)
    assert a() == 0 and b() == 0
    seen = events(c.service, timeout=1.0)
    assert sorted(e.code for e in seen if isinstance(e, RankExitReported)) == [-signal.SIGKILL] * 2


def test_a_failed_relay_is_reported_at_once_and_tears_its_host_down(cluster, monkeypatch):
    # The relay exits 5 under running ranks: the agent says so (join.relay_exited) before it stops
    # them, the controller's fast path to those ranks' deaths and to a reducer shard the relay ran.
    monkeypatch.setattr("flodl_zmq.agent.RELAY_ARGV", ("-c", "import time; time.sleep(0.5); raise SystemExit(5)"))
    c = cluster(target_ranks=2, rank_code="time.sleep(60)")
    a, b = in_thread(c.agent("a").run), in_thread(c.agent("b").run)
    assert a() == 1 and b() == 1
    seen = events(c.service, timeout=1.0)
    assert sorted((e.host, e.code) for e in seen if isinstance(e, RelayExitReported)) == [("a", 5), ("b", 5)]
    assert all(e.code < 0 for e in seen if isinstance(e, RankExitReported))  # the ranks it stopped


def test_an_abort_after_formation_tears_the_hosts_down(cluster):
    c = cluster(target_ranks=2, rank_code="time.sleep(60)")
    a, b = in_thread(c.agent("a").run), in_thread(c.agent("b").run)
    assert c.service.wait_closed(10).phase is WindowPhase.FORMED
    time.sleep(0.3)  # let the agents spawn
    c.service.abort("operator stopped the run")
    assert a() == 1 and b() == 1
    seen = events(c.service, timeout=1.0)
    assert all(e.code < 0 for e in seen if isinstance(e, RankExitReported))
    assert not [e for e in seen if isinstance(e, RelayExitReported)]  # relays their agents stopped did not fail


def test_a_silent_controller_tears_the_host_down(cluster):
    c = cluster(target_ranks=2, rank_code="time.sleep(60)")
    a, b = in_thread(c.agent("a", controller_grace_s=0).run), in_thread(c.agent("b", controller_grace_s=0).run)
    assert c.service.wait_closed(10).phase is WindowPhase.FORMED
    c.service.close()  # no more heartbeats, no goodbye: as if the link were cut
    assert a() == 1 and b() == 1


def test_an_agent_forks_its_ranks_from_one_warm_interpreter_and_logs_their_pids(cluster, tmp_path, caplog):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\n"
                      "print('rank', os.environ['FLODL_RANK'], 'warm', 'torch' in sys.modules, 'pid', os.getpid(),"
                      " 'parent', os.getppid())\n")
    c = cluster(target_ranks=2, program=(str(script),))
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="flodl_zmq.agent"):
        assert c.agent("a", 2, out=out, script=(str(script),)).run() == 0
    ranks = [line.split() for line in out.getvalue().splitlines() if " rank " in line and " warm " in line]
    assert len(ranks) == 2, out.getvalue()
    assert all(words[words.index("warm") + 1] == "True" for words in ranks)  # torch imported before the fork
    parents = {words[words.index("parent") + 1] for words in ranks}
    assert len(parents) == 1 and parents != {str(os.getpid())}  # one warm interpreter, not the agent
    started = next(r.getMessage() for r in caplog.records if "running relay (pid" in r.getMessage())
    pids = {int(words[words.index("rank") + 1]): int(words[words.index("pid") + 1]) for words in ranks}
    # The log names each rank's pid (in whatever order the ranks printed): /proc shows a forked rank as the interpreter.
    assert all(f"{rank}: {pid}" in started for rank, pid in pids.items()), (pids, started)


class HoldingProxy:
    """A TCP proxy whose `hold()` makes the connections it carries keep every byte, both ways, still
    open: a link whose TCP is stuck in retransmission backoff. `release(n)` delivers what
    connection n (in order of acceptance) held and lets it flow again, as a retransmission does."""

    def __init__(self, target: int):
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._held: dict[int, list[tuple[socket.socket, bytes]]] = {}  # connection -> (destination, bytes)
        self._hold_new = False
        self._cut: set[int] = set()
        self._count = 0
        self.connections = threading.Semaphore(0)  # released per accepted connection
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self, new_too: bool = False) -> None:
        """Hold every connection's bytes from now on; `new_too`: also those of connections yet to come."""
        with self._lock:
            for conn in range(self._count):
                self._held.setdefault(conn, [])
            self._hold_new = new_too

    def cut(self) -> None:
        """The connections made so far never deliver again, either way: what they held and what comes is dropped."""
        with self._lock:
            for conn in range(self._count):
                self._cut.add(conn)
                self._held.pop(conn, None)

    def release(self, conn: int | None = None) -> None:
        """Deliver what connection `conn` (every one: None) held, in order, and let it flow again."""
        with self._lock:
            for n in [conn] if conn is not None else list(self._held):
                for dst, data in self._held.pop(n, []):
                    with contextlib.suppress(OSError):
                        dst.sendall(data)
            if conn is None:
                self._hold_new = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:  # the controller is gone (a test's end): the agent's dial finds nobody, as it would
                client.close()
                continue
            with self._lock:
                conn, self._count = self._count, self._count + 1
                if self._hold_new:
                    self._held[conn] = []
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(conn, src, dst), daemon=True).start()
            self.connections.release()

    def _pump(self, conn: int, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                with self._lock:
                    if conn in self._cut:
                        continue
                    if conn in self._held:
                        self._held[conn].append((dst, data))
                    else:
                        dst.sendall(data)

    def close(self) -> None:
        self._listener.close()


def gated_cluster(cluster, tmp_path, silence: float = 3.0) -> tuple[Cluster, Path, HoldingProxy]:
    """A cluster whose ranks say `up` and wait for the gate file, on the join timings of the tests of a
    held link (longer than FAST's, the same on both sides: an agent's re-dial at half its limit beats
    the controller's own limit with a margin a loaded machine keeps), and a proxy to its join port."""
    gate = tmp_path / "gate"
    c = cluster(target_ranks=2, timings=join_timings(0.2, silence),
                rank_code=f"print('up', flush=True)\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.01)")
    return c, gate, HoldingProxy(c.address.port + 3)


def through(c: Cluster, proxy: HoldingProxy, host: str, out: io.StringIO, **cfg):
    """Run agent `host` dialling the join port through `proxy` (in a thread: the getter of its exit code)."""
    controller = ControllerAddress("127.0.0.1", proxy.port - 3)
    return in_thread(c.agent(host, out=out, controller=controller, **{"controller_grace_s": 0, **cfg}).run)


def form_with_b_through(c: Cluster, proxy: HoldingProxy, caplog, out: io.StringIO) -> None:
    """Form a world of b (its join link through `proxy`, a grace period to dial in again) and a, and wait until
    b runs its ranks (said in `caplog`, which the caller has at INFO for flodl_zmq.agent)."""
    through(c, proxy, "b", out, controller_grace_s=30.0)
    wait_joined(c, 1)
    in_thread(c.agent("a").run)
    assert c.service.wait_closed(10).phase is WindowPhase.FORMED
    deadline = time.monotonic() + 20
    while "host 'b' running relay" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_up(out: io.StringIO) -> None:
    """Until a rank said `up` in `out` (a hang guard: it does once its host has the formed world)."""
    deadline = time.monotonic() + 20
    while "] up" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("heard_on", ["the new connection", "the replaced one"])
def test_a_join_link_stuck_silent_is_redialled_and_the_host_stays(cluster, tmp_path, heard_on):
    # After a few flaps in a row, TCP's backoff can keep a link that is back silent for longer than
    # the agent's silence limit. The agent re-dials at half the limit under the same identity,
    # which the controller's ROUTER hands to the new connection, and still reads the old one:
    # - "the new connection": the old one never delivers again;
    # - "the replaced one": the new one stays held past the limit, and the old one delivers what it
    #   held just after the re-dial, as TCP's retransmission did in a chaos-suite flap that lost
    #   its host when a re-dial dropped the old connection.
    c, gate, proxy = gated_cluster(cluster, tmp_path)
    old_speaks = heard_on == "the replaced one"
    try:
        a = in_thread(c.agent("a", controller_grace_s=0).run)
        b_out = io.StringIO()
        b = through(c, proxy, "b", b_out)
        assert c.service.wait_closed(10).phase is WindowPhase.FORMED
        assert proxy.connections.acquire(timeout=10)
        wait_up(b_out)
        proxy.hold(new_too=old_speaks)
        held_at = time.monotonic()
        assert proxy.connections.acquire(timeout=10), "the agent never re-dialled its stuck join link"
        if old_speaks:
            proxy.release(0)
        # Past the agent's silence limit since the hold: had it heard nothing, it would have torn
        # its host down by now.
        time.sleep(max(0.0, held_at + c.agent_timings["controller_silence_at_agent_s"] + 0.5 - time.monotonic()))
        if old_speaks:
            proxy.release()
        gate.touch()
        assert a() == 0 and b() == 0, b_out.getvalue()
        # The controller heard b again after the silence and repeated the word of its world: b's
        # agent knew it for the world it runs and kept its rank (a re-form would have started it again).
        assert b_out.getvalue().count(":r1] up") == 1, b_out.getvalue()
    finally:
        proxy.close()


def test_the_word_of_the_formed_world_lost_with_a_replaced_connection_is_sent_again(cluster, tmp_path, caplog):
    # A link cut as the world formed: the controller's join.world_formed went into a connection the
    # agent then gave up on (it dials again after half its silence limit), and the host waited, alive
    # and heartbeating, while the others' ranks timed out at start-up. The controller, hearing the
    # host again after the silence, repeats the word of its world. A wider silence limit than its sibling's:
    # an agent that misses its re-dial at half the limit (a CI run at load 19) gives up the world at the limit.
    c, gate, proxy = gated_cluster(cluster, tmp_path, silence=6.0)
    try:
        b_out = io.StringIO()
        b = through(c, proxy, "b", b_out)
        wait_joined(c, 1)
        proxy.hold()  # b's first connection never delivers again, either way
        with caplog.at_level(logging.INFO, logger="flodl_zmq.membership"):
            a = in_thread(c.agent("a", controller_grace_s=0).run)
            assert c.service.wait_closed(10).phase is WindowPhase.FORMED
            assert proxy.connections.acquire(timeout=10) and proxy.connections.acquire(timeout=10), "b never re-dialled"
            wait_up(b_out)
        assert "] up" in b_out.getvalue(), "b never started its rank: the formed world never reached it"
        assert "host 'b' heard again after a silence: its join.world_formed sent again" in caplog.text
        gate.touch()
        assert a() == 0 and b() == 0, b_out.getvalue()
    finally:
        proxy.close()


def test_a_controller_silent_past_the_grace_period_leaves_the_agents_with_the_reason(cluster, caplog):
    # A host torn down by its controller's silence exits 1 (docs/operations.md), with a grace period or
    # without: past it the agent exited 2, the code of a refused join.
    c = cluster(target_ranks=2, rank_code="time.sleep(60)")
    with caplog.at_level(logging.ERROR, logger="flodl_zmq.agent"):
        a, b = in_thread(c.agent("a", controller_grace_s=1.5).run), in_thread(c.agent("b", controller_grace_s=1.5).run)
        assert c.service.wait_closed(10).phase is WindowPhase.FORMED
        c.service.close()
        assert a() == 1 and b() == 1
    left = [r.getMessage() for r in caplog.records if "did not come back within the grace period of 1.5 s" in r.getMessage()]
    assert {"host 'a'", "host 'b'"} == {h for h in ("host 'a'", "host 'b'") if any(h in m for m in left)}


def test_abort_returns_once_the_service_thread_acted_on_it_and_not_after_close(cluster):
    c = cluster()
    t0 = time.perf_counter()
    assert c.service.abort("operator gave up") is True  # the thread woke for it: no poll tick to wait out
    assert time.perf_counter() - t0 < 0.5
    verdict = c.service.wait_closed(0)
    assert verdict is not None and verdict.phase is WindowPhase.FAILED and verdict.reason == "operator gave up"
    c.service.close()
    assert c.service.abort("again") is False  # nobody left to send it


def test_a_host_lost_before_the_world_forms_leaves_the_window_and_its_agent_may_join_again(cluster):
    # Its agent died while the window was open: the host stayed a member, counted toward the target, and
    # every hello of a restarted agent was refused "duplicate join" until the window closed.
    c = cluster(target_ranks=3)
    a = in_thread(c.agent("a").run)
    wait_joined(c, 1)  # a holds rank 0
    first = c.agent("b")
    in_thread(first.join)
    wait_joined(c, 2)
    first.close()  # the agent dies before the world forms
    deadline = time.monotonic() + 10
    while [m.host for m in c.window.members] != ["a"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [m.host for m in c.window.members] == ["a"] and c.window.joined_ranks == 1  # left; not counted
    b = in_thread(c.agent("b").run)  # restarted
    wait_joined(c, 2)
    assert c.window.phase is WindowPhase.OPEN  # the target counts live members only
    cc = in_thread(c.agent("c").run)
    assert c.service.wait_closed(10).phase is WindowPhase.FORMED
    # Ranks are never given twice: the lost host's rank 1 is a vacancy of the formed world.
    assert c.window.world == {"a": (0,), "b": (2,), "c": (3,)}
    assert a() == 0 and b() == 0 and cc() == 0


def test_a_host_whose_ranks_all_exited_dials_in_again_and_is_taken_back_with_fresh_ranks(cluster):
    # An agent that lost the controller for a while stops its ranks (each exit reported) and
    # re-dials: it is no duplicate member any more (PROTOCOL.md 13.1), it joins as a host that came back.
    c = cluster(target_ranks=2, rank_code="pass")
    a, b = in_thread(c.agent("a").run), in_thread(c.agent("b").run)
    assert a() == 0 and b() == 0
    old = c.window.world["b"]
    seen = events(c.service, timeout=5.0, until=lambda e: isinstance(e, HostDone) and e.host == "b")
    assert any(isinstance(e, HostDone) and e.host == "b" for e in seen)
    out = io.StringIO()
    c.agent("b", out=out)  # the same host, dialling in again
    in_thread(c.agents[-1].join)
    deadline = time.monotonic() + 10
    while not c.window.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(m.host, m.ranks) for m in c.window.pending] == [("b", (2,))], out.getvalue()
    assert "duplicate join" not in out.getvalue()
    assert c.service.status()["departed"] == [{"host": "b", "ranks": list(old)}]  # its old ranks stay dead


def test_an_agent_that_tore_down_on_silence_is_taken_back_at_once_not_refused_as_a_duplicate(cluster, tmp_path, caplog):
    # A flapping link: the agent heard nothing for its limit and tore its host down while the controller,
    # which had heard it later, still counted it; every hello it sent was refused "duplicate join" until
    # the controller's --host-silence ran out. A member silent for a few heartbeats whose name dials in
    # again is its agent coming back: the old link is lost now and the hello admitted.
    die = tmp_path / "die"  # never made: the ranks run until stopped
    timings = ({"join_heartbeat_period_s": 0.2, "host_silence_at_controller_s": 30.0},
               {"join_heartbeat_period_s": 0.2, "controller_silence_at_agent_s": 2.0})
    c = cluster(target_ranks=2, timings=timings, rank_code=f"while not os.path.exists({str(die)!r}): time.sleep(0.01)")
    proxy = HoldingProxy(c.address.port + 3)  # the join port
    try:
        b_out = io.StringIO()
        with caplog.at_level(logging.INFO):
            form_with_b_through(c, proxy, caplog, b_out)
            deadline = time.monotonic() + 20
            proxy.hold(new_too=True)  # b hears nothing, on its link or any re-dial, past its limit
            while "tearing down host 'b'" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            proxy.cut()  # the torn-down links (and what they held: the rank's exit) never deliver; new dials do
            proxy.release()
            lost = events(c.service, timeout=10.0, until=lambda e: isinstance(e, HostLost))
            while not c.window.pending and time.monotonic() < deadline:
                time.sleep(0.05)
        assert [(e.host, e.why.split(" after ")[0]) for e in lost if isinstance(e, HostLost)] == [
            ("b", "its agent dialled in again")]
        assert [m.host for m in c.window.pending] == ["b"], caplog.text
        assert "duplicate join" not in caplog.text
    finally:
        proxy.close()


def test_a_host_declared_lost_says_so_and_dials_in_again_rather_than_finishing(cluster, tmp_path, caplog):
    # The agent's silence limit longer than the controller's: a cut between the two has the controller
    # declare the host lost while the agent keeps it up. Its ranks then fail, and the agent dials in
    # again; it logged "finished DEGRADED" first, mid-run.
    die = tmp_path / "die"
    timings = ({"join_heartbeat_period_s": 0.2, "host_silence_at_controller_s": 1.0},
               {"join_heartbeat_period_s": 0.2, "controller_silence_at_agent_s": 4.0})
    c = cluster(target_ranks=2, timings=timings, rank_code=f"while not os.path.exists({str(die)!r} + "
                                                            f"os.environ['FLODL_RANK']): time.sleep(0.01)\nsys.exit(5)")
    proxy = HoldingProxy(c.address.port + 3)  # the join port
    try:
        with caplog.at_level(logging.INFO, logger="flodl_zmq.agent"):
            form_with_b_through(c, proxy, caplog, io.StringIO())
            deadline = time.monotonic() + 20
            proxy.hold()
            lost = events(c.service, timeout=10.0, until=lambda e: isinstance(e, HostLost))
            assert [e.host for e in lost if isinstance(e, HostLost)] == ["b"]
            proxy.release()
            Path(f"{die}0").touch()  # b's rank 0, told it is dead, ends so
            while not c.window.pending and time.monotonic() < deadline:
                time.sleep(0.05)
        assert [m.host for m in c.window.pending] == ["b"], caplog.text
        assert "host 'b': its 1 rank(s) exited non-zero, and the run goes on without them" in caplog.text
        assert "host 'b' finished" not in caplog.text
    finally:
        proxy.close()


@pytest.mark.parametrize("peer", ["wrong key", "nothing listens", "not zeromq"])
def test_an_agent_that_gets_no_reply_says_what_came_of_its_connection(cluster, peer):
    # Every silence was one message listing every cause: an operator could not tell a firewall from a key.
    c = cluster()
    with contextlib.ExitStack() as stack:
        controller = c.address
        if peer != "wrong key":
            listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            controller = ControllerAddress("127.0.0.1", listener.getsockname()[1] - 3)  # its join port
            if peer == "nothing listens":
                listener.close()
            else:  # it accepts and hangs up, as a web server answers a request it cannot parse
                threading.Thread(target=lambda: [listener.accept()[0].close() for _ in range(3)], daemon=True).start()
        agent = c.agent("a", key=new_key() if peer == "wrong key" else "same", controller=controller,
                        join_reply_timeout_s=1.5)
        with pytest.raises(MembershipError, match="no reply from the controller") as raised:
            agent.join()
    said = {"wrong key": "a ZeroMQ handshake was made) and dropped our hello: its key differs",
            "nothing listens": "no TCP connection to 127.0.0.1:",
            "not zeromq": "not a flodl-zmq controller"}[peer]
    assert said in str(raised.value)
