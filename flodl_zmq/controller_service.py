"""The controller process: the coordinator core on ZeroMQ, next to the reducer service.

Sockets (ControllerAddress rule, flodl_zmq/endpoints.py):

    control  ROUTER  (bind)  <- every relay's control DEALER     owned by this loop, through ControlRouter
    data     ROUTER  (bind)  <- every relay's data DEALER        owned by ReducerService
    bcast    PUB     (bind)  -> every relay's SUB                owned by ReducerService
    bcast    SUB  (connect)  <- the reducer's own PUB, inproc    owned by this loop (consensus copy)
    shard    SUB  (connect)  <- each host shard's PUB, tcp        owned by this loop (sharded runs: the other slices)

The control ROUTER's framing, attribution and streams with each rank are `ControlRouter`'s
(flodl_zmq/control_router.py), which hands this service each rank's records in order; the kept
consensus, its checkpoints, a resume and a re-formed world are flodl_zmq/checkpoints.py's (`Keeper`,
`Resumed`, `WorldChange`), the copies of each consensus it keeps (whole again in a sharded run) and what a
sharded run refuses flodl_zmq/controller_shards.py's; under `flodl-zmq controller` the role runs next to the membership
service, linked by a `MembershipLink` (flodl_zmq/membership_link.py).

Theory of operation:

1. Formation. Relays say hello (answered RelayHelloAck), then every rank's RankHello arrives
   through them. Once all W ranks have spoken, their model and dataset signatures are compared with
   the controller's own; any difference stops the run with an error naming the ranks, before a step
   is trained. A rank known to have left before then (its launcher, agent or relay saw it exit) is
   acted on at once: the world forms without it while at least the minimum remain (--min-ranks
   under `flodl-zmq controller`, any rank under `launch`), else the start-up fails naming it and
   its exit code. A formation that does not complete in FLODL_STARTUP_TIMEOUT fails loudly (with
   AuthError if records failed authentication: a wrong FLODL_KEY somewhere). The checks are the
   pure `Formation` (flodl_zmq/formation.py); this loop only feeds it.
2. Training. Every authenticated rank record goes to `Coordinator.on_record`, relay RankExit to
   `on_rank_death`, the reducer's round outcomes to `on_round_complete` / `on_round_abandoned`, and
   a tick whenever the loop wakes, which is at the latest when the core's next timer is due
   (`Coordinator.next_due`): the loop has no polling interval. Outputs: rank records are routed
   through the relays; DeclareDead goes to the reducer (out of every barrier); controller effects
   (epoch metrics, eval results, save-state, run end) drive the `RunReport` (flodl_zmq/report.py:
   progress, epoch lines, result, bundle), the same one `AloneLoop` uses.
3. The end. After RunEnded the loop keeps serving until every rank has said goodbye or is dead and
   the last finished round's consensus is in (at most a short drain), then stops the reducer. The
   final model is the last consensus with positive mass seen on its own PUB, or the reducer's last
   if newer (a PUB drops for a subscriber that fell behind). Interrupted (Ctrl-C, or a SIGTERM the
   role turns into one), the run log still ends with its `end` line, reason "interrupted".

Rules this module keeps: one socket, one thread (the reducer's sockets are the reducer thread's); the
core sees only the records `ControlRouter` authenticated and attributed to the rank their route names.

Peer violations: one policy with the reducer's. A rank whose authenticated record the coordinator
refuses (a record it can never legally send: another rank's id, a kind a rank does not send, a
completion of the wrong size; the core raises CoordinatorError/ProtocolError before any change), or
whose record makes anything here raise (the core, a reply's encode, the report), is declared dead
with the reason, exactly like a rank that exited, and the run trains on without it (`violation`,
called from the router's one handler boundary, `links.act_for_peer`); before the world formed, that
fails the formation naming it or forms without it. A peer must never be able to end the service; an
exception that is our bug is logged with its traceback and counted (`handler_error.control`) on the
way.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import zmq

from flodl_zmq import bundle, environment
from flodl_zmq.checkpoints import Keeper, Resumed, WorldChange
from flodl_zmq.control_router import ControlRouter
from flodl_zmq.controller_shards import ConsensusCopies, reducer_frame_bytes, shard_lost, sharding
from flodl_zmq.coordinator.core import Coordinator
from flodl_zmq.coordinator.liveness import RankState, stop_hint
from flodl_zmq.coordinator.outputs import (
    CONTROLLER,
    REDUCER,
    EpochProgress,
    EvalsMerged,
    Evaluated,
    MassBound,
    RoundOpened,
    RunEnded,
    SaveState,
)
from flodl_zmq.datasets import dataset_signature
from flodl_zmq.environment import ChildExit, ExitReports, ProcessEnv
from flodl_zmq.errors import FlodlError, TrainingError
from flodl_zmq.formation import Failed, Formation, Formed, Ignored
from flodl_zmq.host_links import HostLost
from flodl_zmq.io_threads import controller_context, keep_off_the_data_plane
from flodl_zmq.job import Job, coordinator_config
from flodl_zmq.join import ReformGate
from flodl_zmq.links import (
    CONTROL_MAX_FRAME_BYTES,
    CONTROL_MAX_FRAMES,
    drain,
    keep_alive,
    limit_receive,
    take_over_routes,
)
from flodl_zmq.mailbox import poll_ms
from flodl_zmq.membership import MembershipService
from flodl_zmq.membership_link import MembershipLink
from flodl_zmq.metrics import RunMetrics, served
from flodl_zmq.payload import adopt_flat, check_model, model_signature, parameter_count
from flodl_zmq.reducer_config import ReducerConfig
from flodl_zmq.reducer_messages import HostRefused, OuterSlice
from flodl_zmq.reducer_service import ReducerService
from flodl_zmq.report import RunReport
from flodl_zmq.result import TrainResult, epoch_row
from flodl_zmq.runlog import run_dir_for
from flodl_zmq.security import apply_server
from flodl_zmq.status_server import StatusServer
from flodl_zmq.wire import Channel
from flodl_zmq.wire import records as rec

log = logging.getLogger(__name__)

END_DRAIN_S = 1.0  # the longest the end waits for goodbyes (until every rank left, `_loop`)
STATUS_EVERY_S = 0.25


class ControllerService:
    """Runs one training job's controller until the run ends; `run()` returns the TrainResult."""

    def __init__(self, job: Job, penv: ProcessEnv, link: MembershipLink | None = None, carried: WorldChange | None = None,
                 metrics: RunMetrics | None = None, deaths: dict[int, tuple[float, str]] | None = None) -> None:
        self.job = job
        self.metrics = metrics  # fed the run log's events and the status snapshot (flodl_zmq/metrics.py)
        self.penv = penv
        self.link = link
        # Who serves `flodl-zmq status`: the membership under `flodl-zmq controller`, else
        # our own StatusServer on the join endpoint (set in run()).
        self.status_sink: MembershipService | StatusServer | None = link.membership if link is not None else None
        self.curve = link.curve if link is not None else None
        self.deaths = dict(deaths or {})  # rank -> (unix time, why), failures only; the world's before a re-form
        self._last_round_at: float | None = None
        self._next_status = 0.0
        self.world = penv.world
        self.world_size = penv.world_size
        self.counts: collections.Counter[str] = collections.Counter()
        self.router = ControlRouter(penv.world, self.world_size, penv.key, penv.incarnation, penv.need_route_secret(),
                                    self.counts)
        self.model = job.build_model()  # the same initial replica as every rank
        check_model(self.model, job.wire)  # before a socket binds
        resumed = Resumed.load(job.resume_from)
        if resumed.model_state is not None:
            bundle.load_into(self.model, resumed.model_state, job.resume_from)
        # A re-formed world is not a restart: it keeps the restart count (its incarnation id is new: PROTOCOL.md 4.1).
        self.incarnation = resumed.incarnation if carried is None else carried.result.incarnation
        # The model's tensors view the kept consensus: it is current with every kept round, and the
        # controller holds the model once (bench/large.py: one model copy less).
        self.kept = Keeper(job, penv, self.incarnation, adopt_flat(self.model).numpy())
        self.outer = resumed.outer_optimizer(job, self.kept.consensus, parameter_count(self.model))
        self.shards = penv.settings.shard_map
        # Checked before a socket binds; with host shards the outer step here is shard 0's, over its slice.
        self.shard_cut, self.outer, self.shard_starts = sharding(self.shards, self.world, self.kept.consensus.size,
                                                                 job.wire, self.outer)
        self.config = coordinator_config(job)
        self.core = Coordinator(self.config, self.world_size, time.monotonic(), resume=resumed.coordinator)
        self.model_sig = model_signature(self.model)
        self.dataset_sig = dataset_signature(job.dataset)
        self._carried = carried
        self.result = self._result(resumed.epoch)
        self.report = RunReport(
            job, self.result, self.config.batches_per_epoch, run_dir_for(job.run_dir, penv.settings.run_dir),
            resumed.epoch, on_callback_error=self._callback_failed,
            listener=None if metrics is None else metrics.event, evals_follow=True,
        )
        self.formation = self._formation()
        self.started = False
        self.ended: RunEnded | None = None
        self.stop_error: FlodlError | None = None
        self._round_started: dict[int, float] = {}
        # Elastic join (PROTOCOL.md 13.1): when hosts waiting to join enter, and the
        # checkpoint this service ended on to re-form the world with them.
        self._reform = ReformGate(self.config.mode.progressive, job.epochs)
        self.reform_stem: Path | None = None

    def _result(self, start_epoch: int) -> TrainResult:
        """The run's result: a fresh one, or the one a re-formed world continues (not a restart)."""
        if self._carried is not None:
            return self._carried.carry_on(self.model, start_epoch, self.job.quiet)
        if self.job.resume_from and not self.job.quiet:
            print(f"resumed from {self.job.resume_from}: epoch {start_epoch + 1}, round {self.core.avg_count}, "
                  f"controller incarnation {self.incarnation}", flush=True)
        return TrainResult(model=self.model, resumed_from=self.job.resume_from, incarnation=self.incarnation)

    def _formation(self) -> Formation:
        """The start-up's checks, due within FLODL_STARTUP_TIMEOUT from now."""
        timeout_s = self.penv.startup_timeout_s
        return Formation(
            self.world, self.model_sig, self.dataset_sig, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s,
            # Under `flodl-zmq controller` the join window's quorum (--min-ranks); a local
            # launch trains on with any rank that survives start-up.
            minimum=self.penv.settings.min_ranks if self.link is not None else 1,
        )

    # ------------------------------------------------------------------ run

    def run(self) -> TrainResult:
        """Serve the run until it ends or re-forms; its result, or its error raised."""
        ctx = controller_context()
        reducer = self._reducer(ctx)
        if self.shard_cut is not None and self.outer is not None:  # its shards hold the outer state, in slices
            self.kept.gather_outer(self.shard_cut, reducer.want_state)
        control = self._control_socket(ctx)
        copies = ConsensusCopies(ctx, self.router.codec, self.kept.keep, self.counts, self.shard_cut,
                                 self.penv.settings.host_silence_at_controller_s)
        t0 = time.perf_counter()
        status_server = None
        try:
            try:
                if self.link is None:
                    status_server = StatusServer(self.penv.controller.endpoint(Channel.JOIN), self.penv.key, self.world, ctx)
                    status_server.start()
                    self.status_sink = status_server
                control.bind(self.penv.controller.endpoint(Channel.CONTROL))
                reducer.start()
                copies.connect(reducer.local_bcast, self.shards, reducer.config)
                self.reducer = reducer
                outer_state = reducer.outer_state if self.outer is not None and self.shard_cut is None else None
                self.kept.start(time.monotonic(), self.core.avg_count, outer_state)
                self._loop(control, copies, reducer)
            finally:
                self._close(reducer, control, copies, status_server)
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: closed as at every end, saying what was not saved
            self.report.interrupted(time.perf_counter() - t0, self.kept.newest_checkpoint,
                                    moved=environment.moves_the_run(stop, self.penv.settings.resume))
            raise
        return self._finish(time.perf_counter() - t0 + (self._carried.result.wall_s if self._carried else 0.0), copies)

    def _reducer(self, ctx: zmq.Context) -> ReducerService:
        settings = self.penv.settings
        return ReducerService(
            ReducerConfig.for_controller(
                self.world, self.penv.key, self.penv.incarnation, self.penv.controller, curve=self.curve,
                link_heartbeat_period_s=settings.link_heartbeat_period_s, link_silence_s=settings.link_silence_s,
                wire=self.job.wire, aggregation=settings.aggregation,
                # The relays send this model's frames (or the shards' outer state) and nothing longer (PROTOCOL.md 6.1).
                max_frame_bytes=reducer_frame_bytes(self.job.wire, self.kept.consensus.size,
                                                    self.shard_cut is not None and self.outer is not None),
                route_secret=self.penv.need_route_secret(),
                shard_hosts=tuple(host for host, _ in self.shards.hosts),
            ),
            ctx,
            self.outer,
            # A resumed world's ranks load the checkpoint's consensus from the reducer, a shipped
            # start's the controller's model (PROTOCOL.md 13).
            None if not (self.job.resume_from or self.job.ship_start)
            else (rec.RESUME_ROUND, self.job.wire.resume_payload(self.kept.consensus)),
            self.shard_starts,
        )

    def _control_socket(self, ctx: zmq.Context) -> zmq.Socket:
        """The control ROUTER, not yet bound, handed to the router with this service upstream."""
        control = ctx.socket(zmq.ROUTER)
        keep_off_the_data_plane(control)
        control.setsockopt(zmq.ROUTER_MANDATORY, 1)
        control.setsockopt(zmq.LINGER, 1000)
        limit_receive(control, CONTROL_MAX_FRAME_BYTES)
        # Relays' control DEALERs keep their identity across reconnects (links.relay_identity):
        # the returning connection takes the route over from a half-open one at once.
        take_over_routes(control)
        self.router.attach(control, self)
        keep_alive(control, self.penv.controller.endpoint(Channel.CONTROL),
                   self.penv.settings.link_heartbeat_period_s, self.penv.settings.link_silence_s)
        if self.curve is not None:
            apply_server(control, self.curve)
        return control

    def _close(self, reducer: ReducerService, control: zmq.Socket, copies: ConsensusCopies,
               status_server: StatusServer | None) -> None:
        self.report.close()
        self.kept.close()
        reducer.stop()
        if self.shard_cut is None and reducer.published is not None:  # the broadcast may have missed the last
            self.kept.keep(*reducer.published)
        # What the reducer refused or dropped (a late host's frames among them), for the log.
        log.info("controller: reducer counters: %s", {k: v for k, v in reducer.counters().items() if v})
        self.router.connections.close()
        control.close()
        copies.close()
        self._report_status()
        if status_server is not None:
            status_server.close()

    def _finish(self, wall_s: float, copies: ConsensusCopies) -> TrainResult:
        """The run's result once the loop ended: handed on to a re-formed world, raised, or saved and returned."""
        if self.reform_stem is not None and self.stop_error is None:
            self.result.wall_s = wall_s  # the run goes on in the re-formed world's service
            self.report.close()
            self.report.events.close()
            return self.result
        if self.stop_error is not None:
            self.result.reason = f"failed: {self.stop_error}"
            self.report.finish(wall_s)
            raise self.stop_error
        reason = self.ended.reason if self.ended is not None else None
        self.result.reason = "completed" if reason is None else reason.value
        if reason is None:
            if self.job.save_path:
                self._save("completed", self.core.state_dict(held_whole=True))  # a resume: the next epoch on
            self.kept.mark_completed(self.result.saved)
        self.report.finish(wall_s)  # after the save: the log ends with the run's end
        if reason is not None:
            raise TrainingError(
                f"the run stopped early ({reason.value}){stop_hint(reason, self.core.liveness)}{copies.stalled(reason)}; "
                + (f"its state is saved in {self.result.saved}: continue with resume_from={self.job.save_path!r}"
                   if self.result.saved else "set save_path to keep the consensus of a run that stops early")
            )
        return self.result

    def _loop(self, control: zmq.Socket, copies: ConsensusCopies, reducer: ReducerService) -> None:
        # Mailboxes (the reducer's outcomes, the membership's events) wake this poll as its sockets do: no interval.
        poller, exits = self._poller(control, copies, reducer)
        outcomes, monitor = reducer.completed.fileno(), self.router.connections.monitor
        membership = self.link.membership.events if self.link is not None else None
        drain_until: float | None = None
        while True:
            environment.raise_lost_signal()  # a SIGTERM whose raise a finaliser swallowed stops the loop here
            now = time.monotonic()
            # After the end: every rank said goodbye (acknowledged at once) or is dead, and the last round's
            # consensus came in on the broadcast (apart from its outcome), with a sharded run's outer state for
            # the final save (asked for first, while the shards' relays are still up): nothing left to drain.
            if drain_until is not None and (now >= drain_until or (
                    self.started and self.kept.settled() and not self.core.liveness.live)):
                return
            if not self.started and self.stop_error is None:
                verdict = self.formation.poll(now)
                if isinstance(verdict, Failed):
                    self._formation_failed(verdict)
                    return
            events = dict(poller.poll(poll_ms(min(self._wake_at(drain_until), copies.silence.due_at()) - now)))
            copies.read(events, time.monotonic())
            silent = copies.lost(time.monotonic()) if self.started else None  # named once: no wake-up due again
            self._stop_with(silent if self.ended is None else None)  # a run that ended keeps its end
            # Before the ranks' records: a finished round's Updates (the next plans) are what
            # idle ranks wait for, and a burst of reports must not hold them back.
            if outcomes in events:
                self._on_outcomes(reducer)
            if control in events or monitor in events:
                self.router.connections.read_events()  # first: a reconnected peer's records follow its accept
            if control in events:
                oversized = drain(control, self.router.on_control, copy=False, max_frames=CONTROL_MAX_FRAMES)
                self.counts["rejected.control"] += oversized  # apart: the handler counts rejections too
            if exits is not None and exits.fd in events:
                exits = self._on_exits(poller, exits)
            self.router.resend(time.monotonic())
            if reducer.error is not None:
                raise FlodlError(f"the reducer failed: {reducer.error}") from reducer.error
            if membership is not None and membership.fileno() in events:
                self._on_membership()
            now = time.monotonic()
            if self.status_sink is not None and now >= self._next_status:
                self._next_status = now + STATUS_EVERY_S
                self._report_status()
            if self.started and self._tick():
                return
            if drain_until is None and (self.ended is not None or self.stop_error is not None):
                drain_until = time.monotonic() + self.kept.end_wait_s(END_DRAIN_S)

    def _poller(self, control: zmq.Socket, copies: ConsensusCopies,
                reducer: ReducerService) -> tuple[zmq.Poller, ExitReports | None]:
        """What wakes the loop: the sockets, the reducer's outcomes, the membership's events, the launcher's exit reports."""
        poller = zmq.Poller()
        for source in (control, self.router.connections.monitor, *copies.watched, reducer.completed):
            poller.register(source, zmq.POLLIN)
        if self.link is not None:
            poller.register(self.link.membership.events, zmq.POLLIN)
        exits = ExitReports(self.penv.exit_fd) if self.penv.exit_fd is not None else None
        if exits is not None:
            poller.register(exits.fd, zmq.POLLIN)
        return poller, exits

    def _on_outcomes(self, reducer: ReducerService) -> None:
        """The reducer's finished and abandoned rounds, to the coordinator."""
        for outcome in reducer.completed.drain():
            if isinstance(outcome, OuterSlice):
                self.kept.outer_slice(outcome.shard, outcome.round_id, outcome.payload)
                continue
            if isinstance(outcome, HostRefused) and self.started:
                self.violation(outcome.ranks, f"the reducer refused host {outcome.host}'s frame: {outcome.reason}")
            # No round opens before the world forms: an outcome then names none.
            if isinstance(outcome, HostRefused) or outcome.round_id is None or not self.started:
                continue
            started = self._round_started.pop(outcome.round_id, None)
            if outcome.abandoned is None:
                if started is not None and outcome.published_at is not None:
                    self.result.round_ms.append((outcome.published_at - started) * 1000.0)
                    self._last_round_at = time.time()
                self.kept.completed_round = outcome.round_id
                self._perform(self.core.on_round_complete(outcome.round_id, time.monotonic(), outcome.ranks))
                self.report.round(outcome.round_id, self.result.round_ms[-1] if started is not None else None,
                                  dict(zip(outcome.hosts, outcome.masses, strict=True)), self.core)
            else:
                self._perform(self.core.on_round_abandoned(outcome.round_id, time.monotonic()))

    def _on_exits(self, poller: zmq.Poller, exits: ExitReports) -> ExitReports | None:
        """The launcher's exit reports; None once the launcher is gone (nothing more will come)."""
        reports = exits.read()
        for report in reports or ():
            self._on_exit(report)
        if reports is None:
            poller.unregister(exits.fd)
            return None
        return exits

    def _tick(self) -> bool:
        """The coordinator's timers, then a due checkpoint or re-form; True when this service ends on a re-form."""
        self._perform(self.core.on_tick(time.monotonic()))
        self.kept.maybe_checkpoint(time.monotonic(), self.core.avg_count, self.core.state_dict)
        return self._maybe_reform()

    def _wake_at(self, drain_until: float | None) -> float:
        """The next moment this loop has something to do unprompted (monotonic seconds)."""
        due = [drain_until if drain_until is not None else math.inf, self.router.due_at()]
        if not self.started:
            due.append(self.formation.deadline)
        else:
            tick = self.core.next_due()
            due.append(math.inf if tick is None else tick)
        if self.status_sink is not None:
            due.append(self._next_status)
        return min(due)

    # ------------------------------------------------------------------ checkpoints

    def _maybe_reform(self) -> bool:
        """End this service on a checkpoint once hosts wait to join and `ReformGate` lets them in; the checkpoint
        describes one finished consensus (resume.py), so the new world trains nothing twice and loses nothing."""
        pending = self.link.membership.pending() if self.link is not None else ()
        if not pending or self.ended is not None:
            return False
        state, round = self.core.state_dict(held_whole=True), self.kept.round
        if self._reform.notice(round, state["epoch"]):  # said at once, though the kept copy may lag a round
            hosts = [m.host for m in pending]
            log.info("controller: %s waiting to join at round %d", " ".join(hosts), round)
            self.report.events.write("pending", hosts=hosts, round=round)
        if not self.kept.consistent or not self._reform.due(round, state["epoch"], self.core.last_aggregated + 1,
                                                            self.core.evals.owed) or not self.kept.outer_ready():
            return False
        stem = self.kept.write_reform(state, self.report.events.run_dir)
        if stem is None:  # the joiners cannot come in yet
            self._reform.failed(state["epoch"])
            return False
        self.reform_stem = stem
        log.info("controller: re-forming the world at round %d from %s", round, stem)
        return True

    # ------------------------------------------------------------------ inbound (Upstream of self.router)

    def auth_failed(self, error: str) -> None:
        self.formation.auth_failed(error)

    def has_exited(self, rank: int) -> bool:
        return self.started and self.core.liveness.state(rank) is RankState.EXITED

    def is_gone(self, rank: int) -> bool:
        return self.started and not self.core.liveness.is_live(rank)

    def on_rank_record(self, rank: int, record: Any) -> None:
        """A rank's control record, in the order it sent them."""
        if isinstance(record, rec.Exiting):
            # Acknowledged at once: after its goodbye a rank gets no beacons, and it waits for this.
            self.router.send_rank(rank, rec.CoordHeartbeat())
        if isinstance(record, rec.RankHello):
            self._on_hello(rank, record)
            return
        if not self.started:
            return  # heartbeats and the like before the world formed: nothing to schedule yet
        if isinstance(record, rec.Batch):
            self.report.step()
        if isinstance(record, rec.Exiting) and self.ended is None and self.core.liveness.is_live(rank):
            self.report.events.write("exit", rank=rank, reason="its loop broke or raised: it said goodbye")
            log.warning("rank %d left the run before its end (it said goodbye); training goes on without it", rank)
        if isinstance(record, (rec.EvalResult, rec.CheckpointResult)) and record.error is not None:
            self._callback_failed(record.error)
        # A record the core refuses (CoordinatorError, before any change) raises to the router's boundary,
        # which makes it this rank's violation (`violation`).
        self._perform(self.core.on_record(rank, record, time.monotonic()))

    def violation(self, ranks: tuple[int, ...], reason: str) -> None:
        """Acting on their record raised: they are out, as if they had died; a peer must not end the run."""
        for rank in ranks:
            self.router.send_rank(rank, rec.Shutdown())  # declared dead, it must not train on alone
            self.declare_dead(rank, reason)

    def _on_hello(self, rank: int, hello: rec.RankHello) -> None:
        outcome = self.formation.hello(rank, hello)
        if isinstance(outcome, Ignored):
            self.counts[outcome.why] += 1
            if outcome.why == "departed_hello" or self.is_gone(rank):
                self.router.send_rank(rank, rec.Shutdown())  # counted out: it must not wait for plans
        elif isinstance(outcome, Failed):
            self._formation_failed(outcome)
        elif isinstance(outcome, Formed):
            self._formed(outcome)

    def _formed(self, formed: Formed) -> None:
        self.started = True
        self.report.started({h: list(rs) for h, rs in self.world.items()}, self.world_size, self.core.avg_count,
                            restarted=self._carried is None and bool(self.job.resume_from))  # a re-form logs `join`
        for rank, reason in formed.absent.items():  # one lost before a re-form keeps its cause (run_controller)
            self.deaths.setdefault(rank, (time.time(), f"before the world formed: {reason}"))
        if not self.job.quiet:
            gone = "lost before this re-form" if self._carried is not None else "gone before it formed"
            absent = f", without rank(s) {sorted(formed.absent)} ({gone})" if formed.absent else ""
            print(f"world formed: {len(formed.hellos)} of {self.world_size} ranks on {len(self.world)} hosts"
                  f"{absent}, mode {self.job.mode}", flush=True)
        self._perform(self.core.start(time.monotonic(), absent=formed.absent))

    # ------------------------------------------------------------------ membership (controller command)

    def _on_membership(self) -> None:
        """Act on what the agents reported: the fast path to declaring ranks dead."""
        assert self.link is not None
        for report in self.link.reports():
            if isinstance(report, HostLost):  # a shard it ran is lost with it
                for rank in report.ranks:
                    self._exited(rank, None, f"host {report.host} lost: {report.why}")
                self._stop_with(shard_lost(self.shards, report.host, f"was lost ({report.why})"))
            else:
                self._on_exit(report, environment.reported_exit(report.host, report.code))

    def _on_exit(self, report: ChildExit, said: str | None = None) -> None:
        """A relay or rank of this run exited, as the launcher or (`said`) an agent reports it, at once."""
        if report.rank is not None:
            self._exited(report.rank, report.code, said or f"it exited with code {report.code}")
        elif report.code != 0:  # its ranks lost their only path to us
            for rank in self.world.get(report.host, ()):
                self.declare_dead(rank, f"the relay of {report.host} exited with code {report.code}")
            self._stop_with(shard_lost(self.shards, report.host, f"exited with code {report.code}"))

    def _exited(self, rank: int, code: int | None, reason: str) -> None:
        """A rank is gone (`code` None: its host): dead, but a clean exit (a goodbye) once the world formed, and one
        stopped by SIGTERM (its agent's or launcher's), which it answers with a goodbye (RankTerminated) it may outrun."""
        if self.started and code in (0, environment.TERMINATED_EXIT):
            self._perform(self.core.on_record(rank, rec.Exiting(rank=rank), time.monotonic()))
        else:
            self.declare_dead(rank, reason)

    def declare_dead(self, rank: int, reason: str) -> None:
        if not self.started:
            outcome = self.formation.rank_left(rank, reason)
            if isinstance(outcome, Failed):
                self._formation_failed(outcome)
            elif isinstance(outcome, Formed):
                self._formed(outcome)
            elif isinstance(outcome, Ignored):
                self.counts[outcome.why] += 1
            else:
                log.warning("rank %d left before the world formed (%s); forming without it", rank, reason)
            return
        if self.core.liveness.is_live(rank):
            self._record_death(rank, reason)
        self._perform(self.core.on_rank_death(rank, reason, time.monotonic()))

    def _record_death(self, rank: int, reason: str) -> None:
        """A rank failed: kept for `status`, written to the run log, logged."""
        self.deaths[rank] = (time.time(), reason)
        self.report.events.write("death", rank=rank, reason=reason)
        log.warning("rank %d declared dead: %s", rank, reason)

    def _report_status(self) -> None:
        """Hand the coordinator's view to whoever serves `flodl-zmq status` (`status_sink`)."""
        if self.status_sink is None:
            return
        states = [self.core.liveness.state(r) for r in range(self.world_size)]
        snapshot = {
            "started": self.started,
            "alive": [r for r, st in enumerate(states) if st is RankState.LIVE],
            "exited": [r for r, st in enumerate(states) if st is RankState.EXITED],
            "dead": [r for r, st in enumerate(states) if st is RankState.DEAD],
            "deaths": {str(r): {"at": at, "reason": why} for r, (at, why) in sorted(self.deaths.items())},
            "epoch": self.core.last_aggregated + 1,
            "epochs": self.job.epochs,
            "round": self.core.round,
            "rounds_done": self.core.avg_count,
            "global_step": self.core.global_step,
            "last_round_ms": self.result.round_ms[-1] if self.result.round_ms else None,
            "last_round_at": self._last_round_at,
            "incarnation": self.incarnation,
            "checkpoint": self.kept.status(),
            # Per rank, for `status --watch`: ElChe's window, and the last epoch's share and samples/s.
            "window": list(self.core.elche.batch_counts),
            "share": list(self.result.epochs[-1].get("batch_share") or []) if self.result.epochs else [],
            "throughput": [x * 1000.0 for x in self.result.epochs[-1].get("throughput") or []]
            if self.result.epochs else [],
            "ended": None if self.ended is None else (self.ended.reason.value if self.ended.reason else "completed"),
            "links": self.router.links_status(),
        }
        for sink in (self.status_sink, self.metrics):  # `flodl-zmq status`, and the metrics' scrape
            if sink is not None:
                sink.report_training(snapshot)

    def _formation_failed(self, failed: Failed) -> None:
        """The world will not form: tell every rank that spoke, and end the start-up with the reason."""
        if self.stop_error is not None:
            return
        self.stop_error = failed.error()
        for r in self.formation.hellos:
            self.router.send_rank(r, rec.Shutdown())

    def _callback_failed(self, error: str) -> None:
        print(f"callback error: {error}", flush=True)
        self._stop_with(self.job.stop_on_callback_error("a user callback", error))

    def _stop_with(self, error: FlodlError | None) -> None:
        """End the run for `error` (None: go on): every live rank is told to stop, the run raises it."""
        if error is not None and self.stop_error is None:
            self.stop_error = error
            for r in self.core.liveness.live:
                self.router.send_rank(r, rec.Shutdown())

    # ------------------------------------------------------------------ outbound

    def _perform(self, outs: list[Any]) -> None:
        for out in outs:
            if out.dest is REDUCER:
                if isinstance(out.record, rec.DeclareDead):
                    rank = out.record.rank
                    if rank not in self.deaths and self.core.liveness.state(rank) is RankState.DEAD:
                        self._record_death(rank, "silent past the coordinator's heartbeat timeout, or unreachable")
                    if rank in self.router.host_of:  # a vacancy was never the reducer's (no host serves it)
                        self.reducer.declare_dead(rank)
                elif isinstance(out.record, MassBound):
                    self.reducer.bound_round(out.record.round, dict(out.record.bounds), out.record.opens)
                else:
                    self.counts["unexpected.reducer"] += 1
            elif isinstance(out.record, RoundOpened):
                # The reducer learns each round from its first HostFrame; the round clock starts here.
                self._round_started[out.record.round] = time.perf_counter()
            elif out.dest is CONTROLLER:
                self._on_effect(out.record)
            else:
                self.router.send_rank(out.dest, out.record)

    # ------------------------------------------------------------------ controller effects

    def _on_effect(self, r: Any) -> None:
        if isinstance(r, rec.EpochAggregated):
            self.kept.epoch_ended()
            row = self._row(r)
            if self._carried is not None and not self._carried.marked:
                self._carried.marked = True
                row["world_change"] = self._carried.describe()  # the first epoch line of the new world
            self.report.epoch(row)
            self.router.reconnects_this_epoch = 0
        elif isinstance(r, EpochProgress):
            self.report.progress({**self._row(r.metrics), "fraction": r.fraction})
        elif isinstance(r, (Evaluated, EvalsMerged)):
            self.report.eval_notice(r)
        elif isinstance(r, SaveState):
            if self.job.save_path:
                self._save(r.reason.value, r.state)
            print(f"shutdown with save ({r.reason.value}): " + (f"wrote {self.result.saved}" if self.result.saved else
                  "nothing written: the run has no save_path"), flush=True)
        elif isinstance(r, RunEnded):
            self.ended = r

    def _save(self, reason: str, state: dict[str, Any]) -> str:
        """Save the kept consensus with the coordinator's state (what `resume_from` continues)."""
        snap = self.kept.snapshot(reason, state)
        return self.report.save(self.kept.state_dict_of(torch.from_numpy(snap.consensus)), snap.meta,
                                None if snap.outer_momentum is None else torch.from_numpy(snap.outer_momentum))

    def _row(self, r: rec.EpochAggregated) -> dict[str, Any]:
        """The row of `TrainResult.epochs` (and `metrics_fn`) for an aggregated epoch, or the part of one so far."""
        return epoch_row(r.epoch, r.avg_loss, r.epoch_ms, list(r.per_rank_batch_share), list(r.per_rank_throughput),
                         dict(r.scalars), per_rank_samples=list(r.per_rank_samples), round=self.kept.round,
                         reconnects=self.router.reconnects_this_epoch)


def run_controller(job: Job, penv: ProcessEnv, link: MembershipLink | None = None) -> TrainResult:
    """Entry point of the controller role (`link`: the membership, under `flodl-zmq controller`).

    Under `flodl-zmq controller` hosts may join mid-run: a service that ends on a re-form checkpoint is
    followed by one for the larger world, resumed from it (PROTOCOL.md 13.1), until the run ends.
    """
    # Served across re-forms (one port, counters that keep counting); `flodl-zmq controller` binds it first.
    held = nullcontext(link.metrics) if link is not None else served(penv.settings.metrics_port, penv.controller.host)
    with held as metrics, environment.behind_the_ranks():
        service = ControllerService(job, penv, link, metrics=metrics)
        result = service.run()
        while service.reform_stem is not None:
            assert link is not None  # only a membership has joiners
            change = link.reform(penv.world, str(service.reform_stem), result)
            service.report.events.write("join", **change.join_event(bundle.load_meta(service.reform_stem)))
            service.report.events.close()
            job, penv = change.resumed(job, penv, str(service.report.events.run_dir))
            service = ControllerService(job, penv, link, carried=change, metrics=metrics, deaths=service.deaths)
            result = service.run()
    if result.final_eval is None and result.epochs and result.epochs[-1].get("eval") is not None:
        result.final_eval = result.epochs[-1]["eval"]
    if not job.quiet and result.final_eval is not None and not math.isnan(result.final_eval):
        print(f"final eval: {result.final_eval:.4f} in {result.wall_s:.1f} s", flush=True)
    return result
