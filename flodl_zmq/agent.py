"""The worker agent: the one process a worker host starts.

It dials the controller's join endpoint, joins, waits for the world to form,
then spawns this host's relay (`python -m flodl_zmq.relay`) and one rank
process per device running the controller's program, each with its role in
the environment (flodl_zmq/environment.py), and supervises them until the
run ends. What it makes of devices, of the controller's answers and of
what it is asked to run is decided by the pure rules of
flodl_zmq/agent_rules.py; this module does the dialling, waiting and spawning.

Rules this module keeps:

- **No CUDA here.** Devices come from `CUDA_VISIBLE_DEVICES` and
  `nvidia-smi -L`, never from torch: the agent never trains, and a CUDA
  context in the parent would hold memory on every GPU for the whole run.
  Without GPUs it offers a configured number of CPU slots.
- **Every wait is bounded.** The reply to the hello by `join_reply_timeout_s`;
  world formation by the budget the controller announced plus a margin; the
  controller's liveness by its heartbeats (`controller_silence_at_agent_s`),
  because ZeroMQ does not report a vanished peer.
- **A silent controller may come back.** When it falls silent
  (`controller_silence_at_agent_s`) the agent stops its relay and ranks, then
  re-dials it with backoff for `controller_grace_s`: a controller restarted
  with `--resume` takes this host back with its old ranks in the same run
  (the accept's run id and ranks must be the old ones, PROTOCOL.md 13), and the
  host runs again from the checkpoint. Past the grace period it exits, saying so.
- **A world may re-form mid-run** (hosts joining, PROTOCOL.md 13.1): a
  `join.world_formed` on the admitted link is the new world. The agent stops
  its relay and ranks, reports their exits, and spawns them again for the
  new world, marked resumed (FLODL_RESUME): the ranks load the checkpoint's
  consensus from the controller's reducer (no file here is read); this
  host's ranks must be the ones it has. A host admitted after formation waits for that
  record like any joiner, for the announced budget (the controller's join
  cap, which must cover an epoch).
- **Every rank exit and relay failure is reported at once** (`RankExited`,
  `RelayExited`; a negative code names the signal): the controller's fast
  path to declaring ranks dead (and a shard lost), before silence would tell.
- **Exit code contract.** 0 when the agent did its job: children spawned,
  every exit reported, all reaped, even if some ranks failed (a rank loss is
  a membership event the controller already knows, not a host failure).
  1 for host-level faults: the controller aborted the run or went silent
  while ranks ran, the relay died (under ranks, or with its reducer shard),
  or the agent was told to stop. A refused or failed join raises MembershipError.
- **Nothing from the wire runs unchecked.** A spawn spec is checked
  (`agent_rules.check_spawn`) before anything of it is used, at the first
  formation and at every re-form.
- **The controller is authenticated before anything it says is taken.**
  Under a pre-shared key by the MAC; under open admission by CURVE (the
  agent pins the controller's public key, FLODL_CURVE_SERVER): open
  admission without CURVE is refused, since the all-zero pre-admission key
  proves nothing and the session key would cross the network in the clear.
- **CURVE follows the agent.** With CURVE keys the join link is a CURVE
  client of the controller, and the relay gets the same keys through its
  environment (FLODL_CURVE_*), so every inter-host link of the host is
  encrypted or none is. Without them, a controller outside loopback and
  private networks is warned about once.
- Children run in their own process groups so a teardown reaches their
  helpers (data loader workers) too: SIGTERM first, SIGKILL after a grace.
  They hold a lifeline (FLODL_LIFELINE_FD) only this process keeps open: a
  SIGKILLed agent leaves no relay or rank behind.
- Ranks are forked from a warm interpreter (flodl_zmq/warm.py): torch is
  imported once per host, not once per rank and again at every re-form. The
  agent itself never imports torch. It says hello once that interpreter is
  warm (at most `join_reply_timeout_s`): a host taken in mid-run re-forms
  every host's world at the next round, and they would all wait on its imports.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

import zmq

from flodl_zmq.agent_rules import (
    REJOIN_BACKOFF_S,
    TUNABLES,
    AgentConfig,
    Joined,
    NoReply,
    Refused,
    check_accept,
    check_comeback,
    check_world,
    device_env,
    may_be_declared_lost,
    worth_redialling,
)
from flodl_zmq.environment import REFUSED_EXIT, RELAY_ARGV, ProcessEnv, SpawnSpec, with_tunables
from flodl_zmq.errors import ConfigError, MembershipError, VersionError, WireError
from flodl_zmq.join import CHALLENGE_NONCE_BYTES
from flodl_zmq.launch import signal_group, warm_interpreter
from flodl_zmq.links import (
    CONTROL_MAX_FRAME_BYTES,
    JOIN_MAX_FRAMES,
    DialWatch,
    dial_afresh,
    limit_receive,
    recv_bounded,
    remove_host_sockets,
)
from flodl_zmq.security import (
    PUBLIC_ENV,
    SECRET_ENV,
    SERVER_ENV,
    CleartextWarner,
    apply_client,
)
from flodl_zmq.trust import JOIN_RUN_ID, OPEN_JOIN_KEY
from flodl_zmq.warm import WarmProcess, WarmServer, runnable, start
from flodl_zmq.wire import PROTOCOL_VERSION, Channel, Codec, Envelope
from flodl_zmq.wire.mac import check_key
from flodl_zmq.wire.records import (
    Abort,
    Challenge,
    ChallengeRequest,
    JoinAccept,
    JoinHeartbeat,
    JoinHello,
    JoinReject,
    RankExited,
    RelayExited,
    WorldFormed,
)
from flodl_zmq.wire.shm import unlink_host

log = logging.getLogger(__name__)

POLL_S = 0.05
EVERY_RANK_EXITED = "every rank exited"  # the teardown after the host's last rank exited, on its own


def run_nvidia_smi() -> str | None:
    """`nvidia-smi -L`'s output, None when it is missing or fails (no driver: no GPUs)."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


# --------------------------------------------------------------------------- the agent


@dataclass
class _Child:
    label: str
    rank: int | None  # None: the relay
    proc: subprocess.Popen | WarmProcess
    forwarders: list[threading.Thread]


class Agent:
    """Join the controller's world, then run and supervise this host's processes.

    `join()` performs the join protocol (see membership.MembershipService);
    `run()` is join + spawn + supervise and returns the exit code. `stop(reason)`
    may be called from any thread or a signal handler: it tears the host down.
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        context: zmq.Context | None = None,
        out: IO[str] | None = None,
        python: str = sys.executable,
    ):
        self.config = config
        self.python = python
        self._out = out or sys.stdout
        self._out_lock = threading.Lock()
        self._stop_reason: str | None = None
        self._ctx = context or zmq.Context.instance()
        self._sock = self._new_link()
        self._codec = Codec(config.key or OPEN_JOIN_KEY, JOIN_RUN_ID, config.host)
        self._last_heard = 0.0
        self._next_beat = 0.0
        self._lost_controller = False  # the last teardown was the controller's silence (under running ranks, or after them: `_declared_lost`)
        self._reformed: WorldFormed | None = None  # a re-formed world the controller sent while ranks ran
        self._world = b""  # the incarnation of the world this host runs (or ran last)
        self._lifeline: int | None = None  # write end of the running children's FLODL_LIFELINE_FD pipe
        self._warm: WarmServer | None = None  # forks the ranks (`_warm_for`)
        self._dialled_at = 0.0  # the join link's last re-dial (`_redial_if_silent`)
        self._replaced: zmq.Socket | None = None  # the connection the last re-dial replaced, still read

    def _new_link(self, routing_id: bytes | None = None) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        # A fixed routing id survives reconnects, so the controller still knows
        # this link after a network blip (its ROUTER hands the id over).
        sock.setsockopt(zmq.ROUTING_ID, routing_id or b"A" + os.urandom(15))
        sock.setsockopt(zmq.LINGER, 1000)
        dial_afresh(sock, self.config.join_heartbeat_period_s)
        limit_receive(sock, CONTROL_MAX_FRAME_BYTES)
        return sock

    def stop(self, reason: str) -> None:
        if self._stop_reason is None:
            self._stop_reason = reason

    def close(self) -> None:
        self._drop_replaced()
        self._sock.close()

    # ------------------------------------------------------------------ join

    def join(self, join_reply_timeout_s: float | None = None) -> Joined:
        """Dial, send the hello, and wait for admission and then the formed world (NoReply: no answer)."""
        cfg = self.config
        if join_reply_timeout_s is None:
            join_reply_timeout_s = cfg.join_reply_timeout_s
        CleartextWarner(log).warn_if_cleartext(cfg.controller.host, encrypted=cfg.curve is not None)
        watch = DialWatch(self._sock)
        self._dial()
        log.info("host %r dialing %s with %d device(s) %s (admission: %s)", cfg.host, cfg.controller.endpoint(Channel.JOIN),
                 len(cfg.devices), list(cfg.devices), "pre-shared key" if cfg.key else "open")
        try:
            reply = self._hello(join_reply_timeout_s)
            if reply is None:
                raise NoReply(f"no reply from the controller at {cfg.controller} within {join_reply_timeout_s:g} s: "
                              + watch.why_silent(cfg.controller.endpoint(Channel.JOIN).removeprefix("tcp://")))
        finally:
            watch.close()
        key = check_accept(reply, cfg)
        log.info("joined as rank(s) %s; waiting for the world to form (up to %.0f s)", reply.ranks, reply.formation_wait_s)
        self._codec = Codec(check_key(key), reply.incarnation, cfg.host)  # this controller's (PROTOCOL.md 4.4)
        formed = self._await_world(reply)
        spawn = self._checked_world(formed, reply.ranks, "formed")
        return Joined(tuple(reply.ranks), key, reply.run_id, formed.incarnation, formed.world_size, spawn,
                      reply.host_token, formed.route_secret)

    def _checked_world(self, formed: WorldFormed, ranks: Sequence[int], what: str) -> SpawnSpec:
        """`check_world`, before anything of the world is used. A world refused is reported as its ranks' exits
        (REFUSED_EXIT), so that the run goes on without them at once, not after this host's silence."""
        try:
            return check_world(formed, self.config, ranks, what)
        except MembershipError:
            for rank in ranks:
                self._send(RankExited(rank, REFUSED_EXIT))
            raise

    def _hello(self, join_reply_timeout_s: float) -> Any:
        """Ask for a challenge, then send the hello it makes fresh: the controller's answer (None: none in time).

        The challenge (PROTOCOL.md 10.4): our fresh nonce comes back in it, its nonce goes
        into the hello under the MAC and comes back in the answer, so nothing recorded
        earlier (a hello, a challenge, an accept or a reject) is good in this exchange.
        """
        cfg = self.config
        ours = os.urandom(CHALLENGE_NONCE_BYTES)
        self._send(ChallengeRequest(ours))
        challenge = self._receive(
            time.monotonic() + join_reply_timeout_s,
            before_admission=True,
            fresh=lambda r: isinstance(r, Challenge) and r.client_nonce == ours,
        )
        if challenge is None:
            return None
        if not isinstance(challenge, Challenge):
            raise MembershipError(f"expected join.challenge, got {challenge.KIND}: controller bug")
        self._send(JoinHello(cfg.host, list(cfg.devices), cfg.dataset_sig, PROTOCOL_VERSION, cfg.model_sig,
                             challenge.nonce))
        return self._receive(
            time.monotonic() + join_reply_timeout_s,
            before_admission=True,
            fresh=lambda r: not isinstance(r, (JoinAccept, JoinReject)) or r.nonce == challenge.nonce,
        )

    def _await_world(self, accept: JoinAccept) -> WorldFormed:
        """Wait, admitted, for the formed world: the budget the controller announced plus our margin."""
        cfg = self.config
        self._last_heard = time.monotonic()
        deadline = self._last_heard + accept.formation_wait_s + cfg.formation_margin_s
        formed = self._receive(deadline, before_admission=False)
        if formed is None:
            raise MembershipError(
                f"the world did not form within the announced {accept.formation_wait_s:.0f} s "
                f"(+{cfg.formation_margin_s:g} s margin), or the controller went silent: is it still running?"
            )
        if isinstance(formed, Abort):
            raise MembershipError(f"run aborted before world formation: {formed.reason}")
        if not isinstance(formed, WorldFormed):
            raise MembershipError(f"expected join.world_formed or join.abort, got {formed.KIND}: controller bug")
        return formed

    def _receive(self, deadline: float, *, before_admission: bool, fresh: Any = None) -> Any:
        """The next meaningful record before `deadline` (None: timed out or controller silent).

        After admission, heartbeats are answered in kind and only reset the
        silence clock; a frame that fails verification is logged and skipped,
        and so is a record `fresh` refuses (one that answers another exchange:
        a replay).
        """
        while True:
            now = time.monotonic()
            if now >= deadline or self._stop_reason is not None:
                return None
            if not before_admission:
                if now - self._last_heard > self.config.controller_silence_at_agent_s:
                    log.error("controller silent for %.0f s while the world forms", now - self._last_heard)
                    return None
                self._redial_if_silent(now)
                self._beat(now)
            frames = self._recv(int(min(POLL_S, deadline - now) * 1000) + 1)
            env = None if frames is None else self._open(frames, joining=True)
            if env is None:
                continue
            if fresh is not None and not fresh(env.record):
                log.warning("%s from the controller dropped: it answers another exchange (a replay?)", env.kind)
                continue
            self._last_heard = time.monotonic()
            if not isinstance(env.record, JoinHeartbeat):
                return env.record

    def _beat(self, now: float) -> None:
        if now >= self._next_beat:
            self._next_beat = now + self.config.join_heartbeat_period_s
            self._send(JoinHeartbeat())

    def _send(self, rec: Any) -> None:
        try:
            self._sock.send_multipart(self._codec.encode(rec, channel=Channel.JOIN), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not send %s to the controller (link congested or down)", rec.KIND)

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Join, spawn, supervise; the exit code (see the module docstring). Join failures raise."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda s, _f: self.stop(f"agent received {signal.Signals(s).name}"))
        if self.config.script is not None and (warm := self._warm_for(self.config.script)) is not None:
            warm.wait_ready(self.config.join_reply_timeout_s)  # hello once warm (module docstring)
        try:
            joined = self.join()
            while True:
                try:
                    children = self._spawn(joined)
                    code = self._supervise(children, serves=bool(joined.route_secret))
                finally:
                    # A SIGKILLed relay or rank cannot unlink its shared-memory segments, nor its
                    # ipc socket files. Only this host's: another agent's may share the machine.
                    unlink_host(joined.session_key, joined.incarnation, self.config.host, joined.ranks)
                    remove_host_sockets(joined.session_key, joined.incarnation, self.config.host)
                if self._reformed is not None and self._stop_reason is None:
                    joined = self._reform(joined, self._reformed)
                    continue
                if (not self._lost_controller or not self.config.controller_grace_s
                        or self._stop_reason is not None):
                    return code
                rejoined = self._rejoin(joined)
                if rejoined is None:
                    return 1  # torn down by the controller's silence, as without a grace period
                joined = rejoined
        finally:
            if self._warm is not None:
                self._warm.close()
                self._warm = None
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def _teardown_level(self) -> int:
        """A re-form is the run going on, not a fault: said at info level; any other teardown at error."""
        return logging.INFO if self._reformed is not None else logging.ERROR

    def _reform(self, before: Joined, formed: WorldFormed) -> Joined:
        """The world this host runs next, after a re-form: the same run, our ranks as they were."""
        self._reformed = None
        spawn = self._checked_world(formed, before.ranks, "re-formed")
        log.info("host %r: the world re-formed (%d ranks); starting ranks %s again from the checkpoint",
                 self.config.host, formed.world_size, list(before.ranks))
        return Joined(before.ranks, before.session_key, before.run_id, formed.incarnation, formed.world_size, spawn,
                      before.host_token, formed.route_secret)

    def _rejoin(self, before: Joined) -> Joined | None:
        """Re-dial a silent controller with backoff until a restart of our run takes us back (at most
        `controller_grace_s`); None, said in the log, when the grace period ends or the agent is stopped."""
        cfg = self.config
        deadline = time.monotonic() + cfg.controller_grace_s
        wait = REJOIN_BACKOFF_S[0]
        log.warning("host %r: re-dialling the controller at %s for up to %g s (--controller-grace) for a restart "
                    "of run %s", cfg.host, cfg.controller, cfg.controller_grace_s, before.run_id.hex()[:8])
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._stop_reason is not None:
                log.error(
                    f"the controller at {cfg.controller} did not come back within the grace period of "
                    f"{cfg.controller_grace_s:g} s (--controller-grace): host {cfg.host!r} leaves run "
                    f"{before.run_id.hex()[:8]}; "
                    "restart the controller with --resume auto and start this agent again"
                    if self._stop_reason is None else f"stopped while waiting for the controller: {self._stop_reason}"
                )
                return None
            # A fresh link and the join key: nothing of the dead controller's link carries over.
            self._drop_replaced()
            self._sock.close(0)
            self._sock = self._new_link()
            self._codec = Codec(cfg.key or OPEN_JOIN_KEY, JOIN_RUN_ID, cfg.host)
            try:
                joined = self.join(join_reply_timeout_s=min(cfg.join_reply_timeout_s, max(left, 0.1)))
            except (NoReply, Refused) as exc:
                if not worth_redialling(exc):
                    raise
                time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
                wait = min(2 * wait, REJOIN_BACKOFF_S[1])
                continue
            if not check_comeback(before, joined, cfg.controller):
                # The run went on without us (our ranks were declared dead): we re-entered its
                # world at a re-form with fresh ranks (PROTOCOL.md 13.1).
                log.warning("host %r: back in the running world with new ranks %s (its old ranks %s stay dead)",
                            cfg.host, list(joined.ranks), list(before.ranks))
            else:
                log.warning("host %r: taken back by the restarted controller with ranks %s", cfg.host,
                            list(joined.ranks))
            self._lost_controller = False
            return joined

    def child_environ(self, joined: Joined, role: str, rank: int | None, local_rank: int | None) -> dict[str, str]:
        """The environment of one child: ours, the run's tunables, then its identity."""
        identity = ProcessEnv(
            role=role,
            controller=self.config.controller,  # the address our own join provably reached
            key=joined.session_key,
            run_id=joined.run_id, incarnation=joined.incarnation,
            world=joined.spawn.world,
            host=self.config.host,
            rank=rank, local_rank=local_rank,
            host_token=joined.host_token if role == "relay" else None,  # the relay's alone, never a rank's
            route_secret=(joined.route_secret or None) if role == "relay" else None,  # a shard host's relay's
        ).to_environ()
        for name in TUNABLES:
            identity.pop(name, None)
        # Unbuffered, so forwarded lines arrive as they are printed, not when a buffer fills.
        env = {**with_tunables(os.environ, role), "PYTHONUNBUFFERED": "1", **joined.spawn.env, **identity}
        curve = self.config.curve
        if curve is not None:  # the relay dials the controller with the agent's keys
            assert curve.server is not None  # for_client always names the controller's key
            env.update({SERVER_ENV: curve.server.decode(), SECRET_ENV: curve.secret.decode(),
                        PUBLIC_ENV: curve.public.decode()})
        if local_rank is not None:
            env.update(device_env(self.config.devices[local_rank]))
        return env

    def _spawn(self, joined: Joined) -> list[_Child]:
        """Relay first (ranks dial its local sockets), then one rank per device; all or nothing."""
        host = self.config.host
        self._world = joined.incarnation
        plan: list[tuple[str, int | None, Sequence[str], dict[str, str]]] = [
            (f"{host}:relay", None, RELAY_ARGV, self.child_environ(joined, "relay", None, None))
        ]
        for local, (rank, device) in enumerate(zip(joined.ranks, self.config.devices, strict=True)):
            label = f"{host}:{device.replace(':', '')}:r{rank}"
            plan.append((label, rank, joined.spawn.argv, self.child_environ(joined, "rank", rank, local)))
        warm = self._warm_for(joined.spawn.argv)
        # Heartbeats go on while it imports (seconds): a host silent that long is declared lost.
        beat = self.config.join_heartbeat_period_s
        while warm is not None and not warm.wait_ready(beat / 2) and self._stop_reason is None:
            self._beat(time.monotonic())
        children: list[_Child] = []
        # The children's lifeline (environment.watch_lifeline): only this process's death closes
        # the write end we keep, so a SIGKILLed agent leaves no relay or rank behind.
        lifeline, keep = os.pipe()
        if self._lifeline is not None:
            os.close(self._lifeline)  # the incarnation before is gone (every child reaped)
        self._lifeline = keep
        try:
            for label, rank, argv, env in plan:
                proc = start(label, argv, {**env, "FLODL_LIFELINE_FD": str(lifeline)}, (lifeline,),
                             warm if rank is not None else None, self.python)
                children.append(_Child(label, rank, proc, [self._forward(proc.stdout, f"[{label}] ")]))
        except (OSError, ConfigError) as exc:
            for c in children:
                signal_group(c.proc, signal.SIGKILL)
                c.proc.wait()
            raise MembershipError(f"could not start {joined.spawn.argv[0]!r} with {self.python}: {exc}") from None
        finally:
            os.close(lifeline)  # the children hold their own copies
        # With the pids: /proc/PID/environ of a forked rank shows the warm interpreter's environment.
        log.info("host %r running relay (pid %d) + ranks %s of a %d-rank world", host, children[0].proc.pid,
                 {c.rank: c.proc.pid for c in children[1:]}, joined.world_size)
        return children

    def _warm_for(self, argv: Sequence[str]) -> WarmServer | None:
        """The warm interpreter that forks ranks running `argv`, started once; None for a form it cannot run."""
        if not runnable(argv):
            return None
        if self._warm is None:
            self._warm = warm_interpreter(self.python)
        return self._warm

    def _forward(self, pipe: IO[bytes] | None, prefix: str) -> threading.Thread:
        def pump() -> None:
            assert pipe is not None
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                with self._out_lock:
                    self._out.write(f"{prefix}{line}\n")
                    self._out.flush()
            pipe.close()

        t = threading.Thread(target=pump, name=f"forward {prefix}", daemon=True)
        t.start()
        return t

    def _supervise(self, children: list[_Child], serves: bool) -> int:
        """`serves`: the relay runs a reducer shard, which outlives this host's ranks (it stops when no rank of
        the run is left, PROTOCOL.md 10.9 item 9): their exits do not stop it."""
        cfg, host = self.config, self.config.host
        live = list(children)
        teardown: str | None = None  # why the host is being torn down
        fault = False  # a host-level fault: exit 1
        kill_at = 0.0
        failures = finished = 0  # ranks that exited non-zero, and with 0
        self._last_heard = time.monotonic()
        while live:
            now = time.monotonic()
            ranks_live = any(c.rank is not None for c in live)
            why = self._stop_reason or self._poll_controller(now)
            if why is not None and teardown is None:
                self._lost_controller = (ranks_live and self._stop_reason is None
                                         and now - self._last_heard > cfg.controller_silence_at_agent_s)
                teardown, kill_at = why, now + cfg.kill_grace_s
                # The controller vanishing after every rank exited is just the end of the run.
                fault = fault or ranks_live or self._stop_reason is not None
                log.log(self._teardown_level, "tearing down host %r (%s); stopping %d process(es)", host, why,
                        len(live))
                for c in live:
                    signal_group(c.proc, signal.SIGTERM)
            elif teardown is not None and now >= kill_at:
                for c in live:
                    signal_group(c.proc, signal.SIGKILL)
            for c in list(live):
                code = c.proc.poll()
                if code is None:
                    continue
                live.remove(c)
                if c.rank is not None:
                    if code != 0:  # a re-form stops every rank: said at its level, not as a fault
                        failures += 1
                        log.log(min(self._teardown_level, logging.WARNING), "%s exited with code %d", c.label, code)
                    else:
                        finished += 1
                    self._send(RankExited(c.rank, code))  # the controller's fast path to its death
                    if not any(x.rank is not None for x in live) and teardown is None and not serves:
                        teardown, kill_at = EVERY_RANK_EXITED, now + cfg.kill_grace_s
                        for x in live:  # the relay has nothing left to serve
                            signal_group(x.proc, signal.SIGTERM)
                elif code != 0 and teardown is None:  # not one we stopped: its ranks lost their path, or its shard
                    self._send(RelayExited(code))
                    teardown, kill_at, fault = f"relay died with code {code}", now + cfg.kill_grace_s, True
                    log.error("tearing down host %r: %s", host, teardown)
                    for x in live:
                        signal_group(x.proc, signal.SIGTERM)
            if live:
                time.sleep(POLL_S)
        for c in children:
            for t in c.forwarders:
                t.join(timeout=2.0)
        if may_be_declared_lost(failures, finished) and teardown == EVERY_RANK_EXITED and self._stop_reason is None:
            self._lost_controller = self._declared_lost()
        return self._exit_code(teardown if fault else None, failures)

    def _declared_lost(self) -> bool:
        """Every rank exited, none finishing (`may_be_declared_lost`): True when the controller no longer counts
        this host.

        A controller that declared the host lost (this machine stalled past its --host-silence: a SIGSTOP,
        a suspend) has its ranks declared dead too, and drops our frames unanswered; its silence, past
        ours, says so, and the host dials in again to come back with new ranks (`run`). A controller that
        still counts the host answers within a heartbeat: its ranks failed on their own, and it finishes.
        """
        since = time.monotonic()
        while self._stop_reason is None:
            why = self._poll_controller(time.monotonic())
            if self._last_heard >= since:
                return False
            if why is not None:
                log.warning("host %r: every rank exited and the controller stopped answering (it declared this host "
                            "lost, or it is gone): dialling in again", self.config.host)
                return True
            time.sleep(POLL_S)
        return False

    def _exit_code(self, fault: str | None, failures: int) -> int:
        """The host's exit code (the module docstring's contract), said in the log: 1 for a host-level
        `fault`, else 0, degraded by rank `failures` the controller already knows of."""
        host = self.config.host
        if fault is not None:
            log.log(self._teardown_level, "host %r torn down: %s", host, fault)
            return 1
        if failures and self._lost_controller:  # not the end: `run` dials in again
            log.warning("host %r: its %d rank(s) exited non-zero, and the run goes on without them", host, failures)
        elif failures:
            log.warning("host %r finished DEGRADED: %d rank(s) exited non-zero (reported)", host, failures)
        else:
            log.info("host %r finished cleanly", host)
        return 0

    def _poll_controller(self, now: float) -> str | None:
        """Drain the join link; the reason to tear down, if the controller gave one or went silent."""
        self._beat(now)
        while (frames := self._recv(0)) is not None:
            env = self._open(frames, joining=False)
            if env is None:
                continue
            self._last_heard = now
            if isinstance(env.record, Abort):
                return f"the controller aborted the run: {env.record.reason}"
            if isinstance(env.record, WorldFormed):
                if env.record.incarnation == self._world:
                    continue  # the word of the world we run, repeated after a silence (PROTOCOL.md 10.4)
                self._reformed = env.record
                return "the world re-forms with hosts that joined"
        if now - self._last_heard > self.config.controller_silence_at_agent_s:
            return f"controller silent for {now - self._last_heard:.0f} s (gone, or the link is cut)"
        self._redial_if_silent(now)
        return None

    def _redial_if_silent(self, now: float) -> None:
        """After admission: a fresh connection under the same identity once the controller has been
        silent for half the limit (and again after as long), which its ROUTER hands our id over to.
        After a few flaps in a row TCP's retransmission backoff can keep a link that is back silent
        for longer than the limit, though every cut was shorter; a new connection gets through.
        The old one is still read until either speaks: its next retransmission may be due any
        moment (after a 2 s cut, about 3 s after the first loss), before the new one is through."""
        if now - max(self._last_heard, self._dialled_at) <= self.config.controller_silence_at_agent_s / 2:
            return
        log.info("host %r: the controller silent for %.1f s; dialling it again", self.config.host,
                 now - self._last_heard)
        identity = self._sock.getsockopt(zmq.ROUTING_ID)
        self._drop_replaced()
        self._replaced = self._sock
        self._sock = self._new_link(identity)
        self._dial()
        self._dialled_at = now

    def _recv(self, timeout_ms: int) -> list[Any] | None:
        """The next message from the controller on the join link or the connection a re-dial
        replaced (None: nothing within `timeout_ms`, or a message refused for its frame count).
        Once either speaks the replaced one is closed: the link works again, and a replaced
        connection left open would dial back and take the route over."""
        links = [self._sock] if self._replaced is None else [self._sock, self._replaced]
        ready = zmq.select(links, [], [], timeout_ms / 1000)[0]
        if not ready:
            return None
        frames = recv_bounded(ready[0], JOIN_MAX_FRAMES, copy=False)
        self._drop_replaced()
        return frames

    def _open(self, frames: list[Any], *, joining: bool) -> Envelope | None:
        """The controller's message in `frames`, or None for a frame that fails verification (logged, dropped).

        While `joining`, an authentic message of another protocol version refuses
        the join by name; a host whose ranks run drops it like any frame it cannot
        read, and the silence rule decides.
        """
        try:
            return self._codec.decode(frames, Channel.JOIN)
        except WireError as exc:
            if not (joining and isinstance(exc, VersionError)):
                log.warning("join frame from the controller dropped: %s", exc)
            elif self._codec.authentic(frames):  # a stranger's frame of any version is not the controller's word
                raise MembershipError(f"join refused: {exc}") from None
            else:
                log.warning("join frame of another protocol version dropped: its MAC does not verify")
            return None

    def _drop_replaced(self) -> None:
        if self._replaced is not None:
            self._replaced.close(0)
            self._replaced = None

    def _dial(self) -> None:
        """Connect the join link to the controller (as its CURVE client when we have keys)."""
        if self.config.curve is not None:
            apply_client(self._sock, self.config.curve)
        self._sock.connect(self.config.controller.endpoint(Channel.JOIN))
