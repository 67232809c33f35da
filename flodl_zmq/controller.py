"""`flodl-zmq controller` and `flodl-zmq status`: the controller host of a multi-host run.

    flodl-zmq controller --bind HOST:PORT [options] -- SCRIPT [ARGS]     (or -- -m MODULE [ARGS])

1. Trust. The session key is FLODL_KEY, pre-shared with every agent; or,
   with --open-admission (loopback and private networks only, and CURVE
   required: the agents pin this controller's public key, which it logs at
   start), a fresh key handed to each admitted agent over the encrypted link.
   CURVE server keys come from --curve-secret or FLODL_CURVE_SECRET; with
   them only admitted agents' keys may reach the data sockets (CurveGate).
2. The join window. The membership service on PORT+3 admits agents until
   the world forms (target ranks reached, or quorum when the window closes)
   or fails (no quorum by the hard cap; the agents are told why).
3. The controller role. SCRIPT runs in this process (runpy) as the
   controller of the formed world, its role and the membership link handed
   to its `Trainer.run()` or `Session` by `session.hosted` (the process environment is left
   as it is); every agent runs the same SCRIPT and ARGS for its relay and
   ranks. The membership keeps the join links open meanwhile, and its events
   feed the coordinator: a rank exit an agent reports and a host whose agent
   falls silent are deaths declared at once. This process runs no ranks.
4. The end. The script's exit status is the command's. After a completed
   run the agents get `END_GRACE_S` to see their ranks out, then an abort;
   after a failure they are aborted at once, with the reason.

`flodl-zmq status --controller HOST:PORT` asks the membership service for
the cohort's state (`join.status_request`, keyed like a hello) and prints it;
with `--watch` it redraws a compact per-rank table every `--interval`
seconds until the run ends. A controller started by `flodl-zmq launch`
answers the same request itself (flodl_zmq/status_server.py).

Rules this module keeps: every flag is a setting of flodl_zmq/settings.py,
with its environment fallback, and the help says which; every wait is bounded or interruptible (SIGINT/SIGTERM
abort the agents with the reason); the agents are always told how the run
ended, so none waits out a heartbeat timeout to learn it. One exception: a
controller started with `--resume auto` is one an orchestrator restarts, and
its SIGTERM is the orchestrator moving it (a pod evicted or rescheduled, a
container restarted): it exits without aborting, and the agents re-dial the
next controller within `--controller-grace` (docs/operations.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import queue
import runpy
import signal
import sys
import textwrap
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from flodl_zmq.controller_shards import check_sharded
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import (
    INTERRUPTED_EXIT,
    TERMINATED_EXIT,
    ProcessEnv,
    SigtermInterrupt,
    SpawnSpec,
    moves_the_run,
    raise_interrupt_on_sigterm,
    raise_lost_signal,
    with_tunables,
)
from flodl_zmq.errors import ConfigError, FlodlError, MembershipError, NoStatusReply, WireError
from flodl_zmq.io_threads import controller_context
from flodl_zmq.join import CHALLENGE_NONCE_BYTES, JoinConfig, JoinWindow, WindowPhase
from flodl_zmq.links import CONTROL_MAX_FRAME_BYTES, JOIN_MAX_FRAMES, limit_receive, recv_bounded
from flodl_zmq.membership import MembershipService
from flodl_zmq.metrics import RunMetrics, served
from flodl_zmq.security import SERVER_ENV, CurveGate, CurveKeys, apply_client, start_gate
from flodl_zmq.settings import DEFAULTS, Settings, add_arguments
from flodl_zmq.trust import (
    JOIN_RUN_ID,
    OPEN_JOIN_KEY,
    TrustMode,
    check_open_admission_curve,
    endpoint_ip,
    resolve_trust,
)
from flodl_zmq.warm import check_target
from flodl_zmq.wire import RUN_ID_BYTES, Channel, Codec, new_incarnation, new_key, session_key
from flodl_zmq.wire.records import Challenge, ChallengeRequest, StatusReply, StatusRequest

log = logging.getLogger("flodl_zmq.controller")

END_GRACE_S = 15.0  # after a completed run: how long agents may take to see their ranks out
# A flush grace, not an ordering: `abort` (and a failed verdict) return once the aborts are
# handed to ZeroMQ, but ZeroMQ cannot tell when a queued frame has left the machine, and the
# join socket closes without lingering as this process exits.
ABORT_FLUSH_S = 0.5
STATUS_SENDER = "status"
WATCH_FIRST_CONTACT_S = 60.0  # how long `status --watch` asks a controller that is not answering yet


@dataclass(frozen=True)
class ControllerOptions:
    """One `flodl-zmq controller` run, validated.

    `settings`: the timings (join-link heartbeat, host silence, startup) and
    the run-wide settings shipped to every host in the spawn spec.
    """

    address: ControllerAddress
    argv: tuple[str, ...]
    join: JoinConfig
    open_admission: bool = False
    key: bytes | None = None
    dataset_sig: bytes | None = None
    curve: CurveKeys | None = None
    settings: Settings = field(default_factory=Settings)

    def __post_init__(self) -> None:
        argv = self.argv
        if not argv or not (len(argv) >= 2 if argv[0] == "-m" else not argv[0].startswith("-")):
            raise ConfigError(
                "the controller needs the program every host runs, after `--`: SCRIPT [ARGS] or -m MODULE [ARGS] "
                "(e.g. flodl-zmq controller --bind 10.0.0.5:7300 -- -m flodl_zmq.demo)"
            )
        if self.open_admission and self.key is not None:
            raise ConfigError(
                "--open-admission hands every agent a fresh session key, but FLODL_KEY is set too: unset "
                "FLODL_KEY, or drop --open-admission and give every agent the same FLODL_KEY"
            )
        if self.open_admission:
            check_open_admission_curve(self.curve)
        if self.settings.shard_map.count > 1:
            check_sharded(self.curve is not None, self.open_admission)
        if not self.open_admission and self.key is None:
            raise ConfigError(
                "no session key: set FLODL_KEY (`flodl-zmq keygen`) on the controller and on every agent, or "
                "pass --open-admission on a private network to hand a fresh key to each agent that joins"
            )
        self.address.check_apart(self.settings.metrics_port)


def serve(opts: ControllerOptions) -> int:
    """Run the join window, then the controller role; the exit status (see the module docstring).

    The metrics port is bound first: a taken one fails the command before any host joins.
    """
    with served(opts.settings.metrics_port, opts.address.host) as metrics:
        return _serve(opts, metrics)


def _serve(opts: ControllerOptions, metrics: RunMetrics | None) -> int:
    check_target(opts.argv, "controller")  # before any host joins: the world would form, then the script fail
    opts.address.check_free()
    trust = resolve_trust(opts.open_admission, endpoint_ip(opts.address.endpoint(Channel.JOIN)))
    key = opts.key if opts.key is not None else new_key()
    run_id, resumed, settings, cfg = _run_to_start(opts)
    # This start's incarnation (PROTOCOL.md 4.1): it keys the join links and the first world; nothing
    # signed for the controller before it (killed and restarted with --resume) is accepted by this one.
    incarnation = new_incarnation()
    ctx = controller_context()
    curve, auth, gate = opts.curve, None, None
    if curve is not None:
        # Only admitted agents' keys (and ours) may reach the data sockets: the PUB
        # would otherwise hand the model to any client that completes a handshake.
        gate, auth = start_gate(ctx, curve)
        log.info("CURVE on; this controller's public key (give it to every agent): %s=%s",
                 SERVER_ENV, curve.public.decode())
    membership = _open_join_window(opts, ctx, trust, key, (run_id, incarnation), resumed, settings, cfg, gate)
    formed = False
    try:
        world = _wait_formed(membership)
        formed = True
        penv = ProcessEnv(
            role="controller", controller=opts.address, key=key, run_id=run_id, incarnation=incarnation, world=world,
            settings=settings, route_secret=membership.route_secret,
        )
        return _run_role(opts, membership, penv, metrics)
    except SigtermInterrupt as stop:
        if moves_the_run(stop, opts.settings.resume):
            log.warning("SIGTERM under --resume auto: exiting without ending the run; the agents wait for the "
                        "restarted controller (--controller-grace), which resumes from the newest checkpoint")
        else:
            _abort(membership, "the controller was interrupted (SIGTERM)")
        return TERMINATED_EXIT
    except KeyboardInterrupt:
        _abort(membership, "the controller was interrupted (SIGINT)")
        return INTERRUPTED_EXIT
    except FlodlError as exc:
        if not formed:
            raise
        reason = f"{type(exc).__name__}: {exc}"
        print(f"flodl-zmq controller: {reason}", file=sys.stderr, flush=True)
        _abort(membership, reason)
        return 1
    except Exception as exc:
        traceback.print_exc()
        _abort(membership, f"the controller failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        membership.close()
        if auth is not None:
            auth.stop()


def _run_to_start(opts: ControllerOptions) -> tuple[bytes, dict[str, tuple[int, ...]] | None, Settings, JoinConfig]:
    """The run id, the world to re-admit (a restart), the settings and the join window's config.

    A restart (PROTOCOL.md 13): the checkpoint's run id and world, the same hosts with
    their old ranks, all of them; every host is told the one checkpoint chosen here.
    """
    # Imported here: every `flodl-zmq` command builds this module's parser, and the agent's and
    # status's must start without torch (bundle and checkpoints import it).
    from flodl_zmq import bundle, checkpoints, runlog

    checkpoints.check_dir(opts.settings.checkpoint_dir)  # before any host joins, as the script and the ports
    if opts.settings.run_dir is not None:
        runlog.check_dir(opts.settings.run_dir)
    run_id, resumed, settings, cfg = os.urandom(RUN_ID_BYTES), None, checkpoints.pin_resume(opts.settings), opts.join
    stem = settings.resume
    if stem is not None:
        if opts.open_admission:
            raise ConfigError("--resume needs the run's pre-shared FLODL_KEY: under --open-admission the session "
                              "key the agents hold died with the old controller")
        meta = bundle.load_meta(stem)
        run_id = bytes.fromhex(meta["run_id"])
        resumed = {host: tuple(ranks) for host, ranks in meta["world"].items()}
        size = sum(map(len, resumed.values()))
        cfg = replace(cfg, min_ranks=size, target_ranks=size)
        log.info("resuming run %s from %s: waiting for hosts %s to rejoin", run_id.hex()[:8], stem, sorted(resumed))
    return run_id, resumed, settings, cfg


def _open_join_window(
    opts: ControllerOptions, ctx: zmq.Context, trust: TrustMode, key: bytes, ids: tuple[bytes, bytes],
    resumed: dict[str, tuple[int, ...]] | None, settings: Settings, cfg: JoinConfig, gate: CurveGate | None,
) -> MembershipService:
    """Start the membership service: the join window on the join endpoint (`ids`: run id, incarnation)."""
    window = JoinWindow(cfg, opened_at=time.monotonic(), dataset_sig=opts.dataset_sig, resumed=resumed)
    membership = MembershipService(
        window, endpoint=opts.address.endpoint(Channel.JOIN), trust=trust, session_key=key,
        run_id=ids[0], incarnation=ids[1],
        # Every host's relay and ranks read the run's timings from the controller's settings.
        spawn=SpawnSpec(opts.argv, env=settings.to_environ(("run",))),
        join_heartbeat_period_s=settings.join_heartbeat_period_s,
        host_silence_at_controller_s=settings.host_silence_at_controller_s,
        context=ctx, curve=opts.curve, gate=gate,
    )
    forming = (f"forming at {cfg.target_ranks} ranks, or at least {cfg.min_ranks} when the window ends"
               if cfg.target_ranks else f"forming with at least {cfg.min_ranks} ranks when the window ends")
    log.info("join window open on %s (%s%s): %s, window %g s, hard cap %g s", membership.endpoint, trust.value,
             ", CURVE" if opts.curve is not None else "", forming, cfg.join_window_s, cfg.join_cap_s)
    membership.start()
    return membership


def _wait_formed(membership: MembershipService) -> dict[str, tuple[int, ...]]:
    """The formed world (host -> ranks); MembershipError when it did not form."""
    verdict = None
    while verdict is None:
        raise_lost_signal()  # a SIGTERM whose raise a finaliser swallowed stops the wait here
        verdict = membership.wait_closed(0.5)
    if verdict.phase is not WindowPhase.FORMED:
        time.sleep(ABORT_FLUSH_S)  # the aborts are queued (the verdict is set after): let them leave
        raise MembershipError(f"the world did not form: {verdict.reason}")
    return {m.host: m.ranks for m in verdict.members}


def _run_role(opts: ControllerOptions, membership: MembershipService, penv: ProcessEnv,
              metrics: RunMetrics | None) -> int:
    """Run the program as the controller of the formed world, then see the agents out; its exit status."""
    log.info("world formed: %s; running %s", penv.world, " ".join(opts.argv))
    from flodl_zmq.membership_link import MembershipLink
    from flodl_zmq.session import hosted, unplayed

    with hosted(penv, MembershipLink(membership, opts.curve, metrics)) as host:  # what Trainer.run() or Session plays
        code = run_script(opts.argv)
    code = code or unplayed(host)
    if code != 0:
        _abort(membership, f"the controller's program exited with status {code}")
        return code
    if membership.end_joins("the run is over (a host joins at a re-form; there is none left)"):
        time.sleep(ABORT_FLUSH_S)
    _see_agents_out(membership)
    return 0


def _abort(membership: MembershipService, reason: str) -> None:
    if membership.abort(reason):  # returns once the aborts are queued on the socket
        time.sleep(ABORT_FLUSH_S)


def _see_agents_out(membership: MembershipService) -> None:
    """Give the agents time to report their ranks' exits, then abort the stragglers."""
    deadline = time.monotonic() + END_GRACE_S
    # A host leaves `hosts_running` before its HostDone (or HostLost) is put: wake on each event.
    while membership.hosts_running():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            membership.events.get(timeout=left)
        except queue.Empty:
            break
    late = membership.hosts_running()
    if late:
        _abort(membership, f"the run is over but host(s) {late} still run ranks after {END_GRACE_S:g} s")
    else:
        log.info("every host finished; controller done")


def run_script(argv: Sequence[str]) -> int:
    """Run `SCRIPT [ARGS]` or `-m MODULE [ARGS]` in this process as `__main__`; its exit status."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            # What `python SCRIPT` does: the script's directory comes first on the path.
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


# --------------------------------------------------------------------------- status


def query_status(
    address: ControllerAddress,
    key: bytes | None,
    curve: CurveKeys | None = None,
    status_reply_timeout_s: float = DEFAULTS.status_reply_timeout_s,
    context: zmq.Context | None = None,
) -> dict[str, Any]:
    """Ask the controller at `address` for the cohort's state (the `join.status_reply` object).

    `key`: the pre-shared session key, or None for an open-admission controller.
    """
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    limit_receive(sock, CONTROL_MAX_FRAME_BYTES)
    try:
        if curve is not None:
            apply_client(sock, curve)
        sock.connect(address.endpoint(Channel.JOIN))
        codec = Codec(key or OPEN_JOIN_KEY, JOIN_RUN_ID, STATUS_SENDER)
        deadline = time.monotonic() + status_reply_timeout_s
        # A challenge first (PROTOCOL.md 10.4): a status request is good once, on this connection.
        ours = os.urandom(CHALLENGE_NONCE_BYTES)
        sock.send_multipart(codec.encode(ChallengeRequest(ours), channel=Channel.JOIN))
        challenge = _status_answer(sock, codec, address, deadline, status_reply_timeout_s, Challenge, ours)
        sock.send_multipart(codec.encode(StatusRequest(challenge.nonce), channel=Channel.JOIN))
        reply = _status_answer(sock, codec, address, deadline, status_reply_timeout_s, StatusReply,
                                challenge.nonce)
        return json.loads(reply.json)
    finally:
        sock.close(0)


def _status_answer(
    sock: zmq.Socket, codec: Codec, address: ControllerAddress, deadline: float, status_reply_timeout_s: float,
    kind: type, nonce: bytes,
) -> Any:
    """The controller's next `kind` record answering `nonce` (a replayed answer is skipped)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(max(1, int(left * 1000))):
            raise NoStatusReply(
                f"no status reply from the controller at {address} within {status_reply_timeout_s:g} s: it is not "
                "running or not reachable, or it dropped the request because the key differs (FLODL_KEY must "
                "be the controller's; unset under open admission)"
            )
        frames = recv_bounded(sock, JOIN_MAX_FRAMES)
        if frames is None:
            raise MembershipError(f"the controller at {address} sent a status reply of too many frames")
        try:
            env = codec.decode(frames, Channel.JOIN)
        except WireError as exc:
            raise MembershipError(f"the controller's status reply was refused: {exc}") from None
        rec = env.record
        if not isinstance(rec, kind):
            raise MembershipError(f"expected {kind.KIND}, got {env.kind}: the controller runs another version")
        echoed = rec.client_nonce if isinstance(rec, Challenge) else rec.nonce
        if echoed == nonce:
            return rec
        log.warning("%s from the controller dropped: it answers another request (a replay?)", env.kind)


def format_status(address: ControllerAddress, status: Mapping[str, Any]) -> str:
    """The status as a few lines for a person."""
    lines = [f"controller {address}: {status['phase']} ({status['reason']}), {status['joined_ranks']} ranks joined"]
    for host, h in status.get("hosts", {}).items():
        lines.append(f"  host {host}: ranks {h['ranks']} {h['state']}")
    for host, h in status.get("pending", {}).items():
        lines.append(f"  host {host}: ranks {h['ranks']} pending (joins at the next re-form)")
    for d in status.get("departed", []):
        lines.append(f"  host {d['host']}: left the world; its ranks {d['ranks']} stay dead")
    for j in status.get("joins", []):
        at = time.strftime("%H:%M:%S", time.localtime(j["at"]))
        lines.append(f"  host {j['host']}: joined mid-run at {at} as ranks {j['ranks']}")
    t = status.get("training")
    if t is not None:
        lines.append(f"  ranks alive {t['alive']}, dead {t['dead']}, exited {t['exited']}")
        for rank, d in t["deaths"].items():
            at = time.strftime("%H:%M:%S", time.localtime(d["at"])) + f".{int(d['at'] % 1 * 1000):03d}"
            lines.append(f"    rank {rank} dead at {at}: {d['reason']}")
        for host, link in t.get("links", {}).items():
            rejected = ", ".join(f"{cause} {n}" for cause, n in sorted(link["rejected"].items())) or "none"
            seen = "never" if link["last_seen"] is None else f"{time.time() - link['last_seen']:.1f} s ago"
            lines.append(f"  link {host}: reconnects {link['reconnects']}, resends {link['resends']}, "
                         f"rejected {rejected}, last seen {seen}")
        last = "no round finished yet"
        if t["last_round_at"] is not None:
            last = f"last round {t['last_round_ms']:.1f} ms, {time.time() - t['last_round_at']:.1f} s ago"
        lines.append(
            f"  epoch {min(t['epoch'] + 1, t['epochs'])}/{t['epochs']}, round {t['round']} "
            f"({t['rounds_done']} done), global step {t['global_step']}, {last}"
            + (f"; run ended: {t['ended']}" if t["ended"] else "")
        )
        ck = t.get("checkpoint")
        lines.append(f"  controller incarnation {t.get('incarnation', 1)}" + (
            "" if ck is None else f", last checkpoint {ck['last_path'] or 'none yet'}"
            + (f" (last write failed: {ck['last_error']})" if ck["last_error"] else "")))
    return "\n".join(lines)


def format_watch(address: ControllerAddress, status: Mapping[str, Any]) -> str:
    """The status as one header line and a row per rank: state, window, batch share, throughput."""
    t = status.get("training")
    if t is None:
        return f"controller {address}: {status['phase']} ({status['reason']}), {status['joined_ranks']} ranks joined"
    last = "-" if t["last_round_ms"] is None else f"{t['last_round_ms']:.1f} ms"
    lines = [
        f"controller {address}  epoch {min(t['epoch'] + 1, t['epochs'])}/{t['epochs']}  round {t['round']}  "
        f"step {t['global_step']}  last round {last}" + (f"  ended: {t['ended']}" if t["ended"] else ""),
        f"{'rank':>4}  {'host':<8} {'state':<7} {'window':>6} {'share':>6} {'samples/s':>10}",
    ]
    state = {r: "alive" for r in t["alive"]} | {r: "exited" for r in t["exited"]} | {r: "dead" for r in t["dead"]}
    host_of = {r: h for h, info in status.get("hosts", {}).items() for r in info["ranks"]}
    window, share, speed = t.get("window") or [], t.get("share") or [], t.get("throughput") or []
    for r in sorted(set(state) | set(host_of)):
        lines.append(
            f"{r:>4}  {host_of.get(r, '?'):<8} {state.get(r, '?'):<7} {_at(window, r, '{:d}'):>6} "
            f"{_at(share, r, '{:.1%}'):>6} {_at(speed, r, '{:.0f}'):>10}"
        )
    return "\n".join(lines)


def _at(values: Sequence[Any], i: int, fmt: str) -> str:
    return fmt.format(values[i]) if i < len(values) and values[i] is not None else "-"


def watch_status(
    address: ControllerAddress, key: bytes | None, curve: CurveKeys | None, status_reply_timeout_s: float,
    interval_s: float, out: Any = None,
) -> int:
    """Redraw `format_watch` every `interval_s` until the run ends (`run_ended`: 0), or the controller goes quiet.

    Quiet at first: a controller just launched may still be starting, so it is
    asked again for WATCH_FIRST_CONTACT_S, then MembershipError as plain
    `status`. Quiet after a reply: the controller ended, was stopped or cut
    off; said, and exit status 1. Not a key that differs: it was just proven.
    """
    out = out or sys.stdout
    clear = "\x1b[H\x1b[2J" if out.isatty() else ""
    replies = 0
    give_up = time.monotonic() + WATCH_FIRST_CONTACT_S
    while True:
        try:
            status = query_status(address, key, curve, status_reply_timeout_s=status_reply_timeout_s)
        except MembershipError as exc:
            if not replies and time.monotonic() < give_up:
                print(f"{clear}controller {address}: no reply yet, still asking", file=out, flush=True)
                time.sleep(interval_s)
                continue
            if not replies:
                raise
            why = (f"none within {status_reply_timeout_s:g} s: it ended or was stopped, or the link was cut; its own "
                   "output says how" if isinstance(exc, NoStatusReply) else str(exc))
            print(f"controller {address} stopped answering after {replies} {'reply' if replies == 1 else 'replies'} "
                  f"({why})", file=out, flush=True)
            return 1
        replies += 1
        print(clear + format_watch(address, status), file=out, flush=True)
        ended = run_ended(status)
        if ended is not None:
            print(f"controller {address}: the run ended ({ended})", file=out, flush=True)
            return 0
        time.sleep(interval_s)


def run_ended(status: Mapping[str, Any]) -> str | None:
    """How the run ended, by a status reply; None while it runs. A join window that failed is an end too:
    no world forms after it (a SIGTERM before formation fails it), and its endpoint closes."""
    t = status.get("training")
    if t is not None and t.get("ended"):
        return str(t["ended"])
    if status.get("phase") == WindowPhase.FAILED.value:
        return f"before its world formed: {status.get('reason')}"
    return None


# --------------------------------------------------------------------------- command line


def add_commands(sub: Any) -> None:
    """Register `controller` and `status` on the `flodl-zmq` sub-command parser (flags: settings.py)."""
    c = sub.add_parser(
        "controller",
        help="run the controller host of a multi-host run: the join window, then the coordinator and reducer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="\n\n".join(textwrap.fill(p, 79) for p in (
            "Open a join window on PORT+3 of --bind, admit agents (`flodl-zmq agent --controller HOST:PORT`) "
            "until the world forms, then run PROGRAM in this process as the controller while every agent runs it "
            "as its relay and ranks. PROGRAM is SCRIPT [ARGS] or -m MODULE [ARGS], after `--`. This host runs no "
            "ranks: start an agent here too to train on it.",
            "Trust: FLODL_KEY (`flodl-zmq keygen`), the same on every host; or --open-admission on a private "
            "network with CURVE, which hands a fresh key to each agent that joins over the encrypted link. "
            "Encryption: give the controller a CURVE secret (`flodl-zmq curve-keygen DIR`, then --curve-secret "
            "DIR/controller.key_secret or FLODL_CURVE_SECRET) and every agent its public key "
            "(FLODL_CURVE_SERVER, logged at start); only admitted agents' keys then reach the data sockets.",
            "Exit status: the program's (0 when the run completed), 1 when it failed or the agents were aborted, "
            "2 when the world did not form or a setting is wrong, 130 on SIGINT, 143 on SIGTERM.",
        )),
    )
    add_arguments(c, "controller")
    c.add_argument("argv", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS], or -- -m MODULE [ARGS]")
    c.set_defaults(func=_controller_command)

    s = sub.add_parser(
        "status",
        help="print the state of a running controller's cohort: hosts, ranks alive and dead, epoch, round",
        description=(
            "Ask the controller at HOST:PORT (its join endpoint, PORT+3) for the cohort's state. Uses FLODL_KEY "
            "when the controller has a pre-shared key, none under open admission; FLODL_CURVE_SERVER when it "
            "runs CURVE."
        ),
    )
    add_arguments(s, "status")
    s.add_argument("--json", action="store_true", help="print the status object as JSON")
    s.add_argument("--watch", action="store_true",
                   help="redraw a compact per-rank table until the run ends (Ctrl-C to stop watching)")
    s.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between redraws (default 1)")
    s.set_defaults(func=_status_command)


def restart_with_service_tunables() -> None:
    """Start this process over, once, with the controller's glibc tunables (environment.py).

    glibc reads them only at start-up, and a controller started from a shell
    has none: every host frame it receives would fault in freshly zeroed pages.
    """
    env = with_tunables(os.environ, "controller")
    if env["GLIBC_TUNABLES"] != os.environ.get("GLIBC_TUNABLES"):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _controller_command(args: argparse.Namespace) -> int:
    restart_with_service_tunables()
    logging.basicConfig(level=logging.INFO, format="[controller] %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_args(args)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    curve = CurveKeys.for_server(os.environ, settings.curve_secret_file, settings.curve_clients_dir)
    opts = controller_options(settings, argv, session_key(os.environ), curve)
    stop = raise_interrupt_on_sigterm()
    try:
        return serve(opts)
    finally:
        signal.signal(signal.SIGTERM, stop)


def controller_options(settings: Settings, argv: Sequence[str], key: bytes | None,
                       curve: CurveKeys | None) -> ControllerOptions:
    """The options of a controller run from its settings (`controller` and `run` both start one this way)."""
    if not settings.bind:
        raise ConfigError("the controller needs an address to listen on: --bind HOST:PORT (or FLODL_BIND)")
    try:
        sig = bytes.fromhex(settings.dataset_sig) if settings.dataset_sig else None
    except ValueError:
        raise ConfigError("--dataset-sig must be 64 hex characters") from None
    if sig is not None and len(sig) != 32:
        raise ConfigError("--dataset-sig must be 64 hex characters (32 bytes)")
    return ControllerOptions(
        address=ControllerAddress.parse(settings.bind),
        argv=tuple(argv),
        join=JoinConfig(
            min_ranks=settings.min_ranks, target_ranks=settings.target_ranks, join_window_s=settings.join_window_s,
            join_cap_s=settings.effective_join_cap_s, max_ranks=settings.max_ranks,
            max_pending_hosts=settings.max_pending_hosts,
        ),
        open_admission=settings.open_admission,
        key=key,
        dataset_sig=sig,
        curve=curve,
        settings=settings,
    )


def _status_command(args: argparse.Namespace) -> int:
    settings = Settings.from_args(args)
    if not settings.controller:
        raise ConfigError("status needs the controller's address: --controller HOST:PORT (or FLODL_CONTROLLER)")
    address = ControllerAddress.parse(settings.controller)
    address.check_resolves("--controller HOST:PORT (FLODL_CONTROLLER)")
    key, curve = session_key(os.environ), CurveKeys.for_client(os.environ, server_file=settings.curve_server_file)
    if args.watch:
        if args.json:
            raise ConfigError("--watch draws a table, --json prints one reply: give one of them")
        if not 0 < args.interval < math.inf:  # nan and inf too: a redraw every nan or inf seconds never comes
            raise ConfigError(f"--interval {args.interval}: the seconds between two redraws, a finite number > 0, "
                              "e.g. --interval 1")
        try:
            return watch_status(address, key, curve, settings.status_reply_timeout_s, args.interval)
        except KeyboardInterrupt:
            return 0
    status = query_status(address, key, curve, status_reply_timeout_s=settings.status_reply_timeout_s)
    print(json.dumps(status, indent=2, sort_keys=True) if args.json else format_status(address, status))
    return 0
