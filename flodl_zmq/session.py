"""Bring your own loop: `Session`, the role machinery a training loop the user keeps runs through.

    import flodl_zmq as fz
    model = Net()                                        # on its device already
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fz.Session(model, optimizer, train_set, batch_size=32, epochs=10,
                    eval_dataset=test_set, eval_fn=accuracy) as s:
        for batch in s.batches():
            loss = my_loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            s.step(loss)                                  # once per optimizer step
    print(s.result.final_eval)                            # controller, or alone

The keywords after `batch_size` are Trainer's (flodl_zmq.job.Job), less the
ones the user's loop now owns (train_step, autocast, grad_accumulation,
max_grad_norm); `epochs` defaults to 1. `Trainer` runs through the same
machinery: its loop is `for batch in s.batches(): s.step(stepper.step(batch))`.

Entering the block plays the process's role (FLODL_ROLE and the other
FLODL_* variables, flodl_zmq/environment.py, or the role `hosted` hands over):

- unset (alone): `batches()` yields every sample of each epoch once, in the
  seeded order Trainer alone and the cluster use; evals, `metrics_fn`, the
  progress and the bundle (`save_path`) as under Trainer; `s.result` is set
  when the block ends.
- controller: entering runs the whole coordination (coordinator, reducer,
  evals, checkpoints, deaths and joins) and sets `s.result`; `batches()`
  then yields nothing, so the loop body never runs there.
- relay: entering serves the host's relay and ends the process
  (`SystemExit` with its exit status); the block never runs.
- rank: `batches()` yields the batches ElChe dispatches to this rank (the
  chunk pool's exact coverage holds: every sample of an epoch once across
  the world); averaging rounds are served between two batches, never inside
  a step. Leaving the block says goodbye (`Exiting`) and ends the process
  (`SystemExit`), as Trainer's rank does: the code after the block runs only
  where a result exists.

Rules this module keeps:

- **One starting replica.** The user builds the model in every process, seeded
  or not, so a Session's ranks do not start from their own: every rank loads
  the controller's model, shipped as round 0's consensus before its first
  batch (`Job.ship_start`, PROTOCOL.md 13), as a resumed world's ranks do.
- **One step per batch.** `s.step(loss=None)` after each batch's optimizer
  step: it counts the step (the averaging mass, ElChe's timings, the global
  step) and reports the loss (one number: a float or a one-element tensor;
  None reports no loss; anything else is a SessionError naming it). A
  batch not reported is a `SessionError` at the next one.
- **The schedule.** `scheduler=` (a factory `optimizer -> scheduler`, as
  Trainer's) is stepped to the global step before each batch; a scheduler
  the loop steps itself follows this process's own steps only.
- **Epochs.** `s.epoch` is the epoch of the batch in hand; `epoch_fn` runs
  as under Trainer.
- **One role a process.** A Session (or Trainer.run) entered inside another's block under a role is a
  SessionError (`_PLAYING`): it would play the role a second time.
- **Leaving early** (`break`, an exception) is a clean exit: a rank says
  goodbye and leaves the run, which trains on without it; alone, the result
  holds the epochs finished and the bundle is saved with reason "stopped".
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from flodl_zmq import checkpoints
from flodl_zmq.alone import AloneLoop
from flodl_zmq.environment import (
    TERMINATED_EXIT,
    UNPLAYED_EXIT,
    ProcessEnv,
    RaisingHandler,
    interrupted_exit,
    raise_interrupt_on_sigterm,
    stop_as_on_sigterm,
    training_failed,
    watch_lifeline,
)
from flodl_zmq.errors import ConfigError, SessionError
from flodl_zmq.job import Job, coordinator_config
from flodl_zmq.rank import RankRuntime, keep_to_share, pick_device
from flodl_zmq.rank_link import RankConfig
from flodl_zmq.result import TrainResult
from flodl_zmq.training import Stepper, one_number, recording

if TYPE_CHECKING:
    from flodl_zmq.membership_link import MembershipLink

log = logging.getLogger(__name__)

# Trainer keywords a Session refuses: the user's loop does these itself.
LOOP_OWNED = ("train_step", "autocast", "grad_accumulation", "max_grad_norm")


class RankTerminated(SystemExit):
    """A rank's SIGTERM: its agent or launcher stops it, and reports its exit (a shell's status for SIGTERM).
    A SystemExit, not the controller's SigtermInterrupt: the rank exits with it, it unwinds no abort."""

    def __init__(self) -> None:
        super().__init__(TERMINATED_EXIT)


class RankOrphaned(RankTerminated):
    """The rank's lifeline closed: the agent or launcher that started it is gone (SIGKILLed, say). The rank leaves
    without a goodbye: its relay reports it gone, and the run counts it as a failure, not as leaving on purpose."""


def _hang_up() -> None:
    """A rank's end of its lifeline: SIGHUP, which its handler turns into RankOrphaned in the main thread (or,
    before the rank set that handler, ends the process outright: a rank not yet started says nothing either)."""
    os.kill(os.getpid(), signal.SIGHUP)


@dataclass
class Hosted:
    """A role handed to the user's script by the process that runs it: the role, the membership link, and
    whether a Trainer.run() or Session played it (`played`; see `unplayed`)."""

    penv: ProcessEnv
    link: MembershipLink | None = None
    played: bool = False


# The one hand-off from a process that runs the user's script itself (runpy) to that
# script's Trainer or Session: the script builds them, so no argument can carry the
# role there, and putting it in os.environ would leak it to everything the script
# starts and outlive the run. Set only through `hosted`.
_HOSTED: contextvars.ContextVar[Hosted | None] = contextvars.ContextVar("flodl_hosted", default=None)


# Set while a Session plays this process's role: one inside it (a nested Session, a Trainer.run)
# would play the role a second time, a second rank with this rank's id or a second coordination
# waiting for ranks that never come, and hang the run.
_PLAYING: contextvars.ContextVar[bool] = contextvars.ContextVar("flodl_playing", default=False)


@contextlib.contextmanager
def _playing_role() -> Iterator[None]:
    if _PLAYING.get():
        raise SessionError(
            "a Session (or Trainer.run) inside another Session's with block: a process plays its role (rank, "
            "controller, relay) once; train both models in one Session's loop, or give each run a script of its own"
        )
    token = _PLAYING.set(True)
    try:
        yield
    finally:
        _PLAYING.reset(token)


@contextlib.contextmanager
def hosted(penv: ProcessEnv, link: MembershipLink | None = None) -> Iterator[Hosted]:
    """Within the block, `Trainer.run()` and `Session` play `penv`'s role (with `link`), not the environment's;
    the hand-off it yields says afterwards whether one did (`unplayed`)."""
    host = Hosted(penv, link)
    token = _HOSTED.set(host)
    try:
        yield host
    finally:
        _HOSTED.reset(token)


def unplayed(host: Hosted) -> int:
    """The exit status of a process whose script ended (returned or exited 0) holding `host`'s role: 0 once
    the role was played, else UNPLAYED_EXIT, said on stderr. Such a process trained nothing, and the run it
    was started for never happened: exiting 0 left `launch` ending 0 with no word of it."""
    if host.played:
        return 0
    penv = host.penv
    who = penv.role if penv.rank is None else f"rank {penv.rank} on {penv.host}"
    print(f"flodl-zmq: the script ended without playing this process's role ({who}): it never called "
          "Trainer(...).run() nor entered a Session in its main thread, so nothing trained. The same script runs "
          "in every process and that call picks each one's role: make every process reach it", file=sys.stderr,
          flush=True)
    return UNPLAYED_EXIT


def played_role() -> Hosted | None:
    """The role this process plays: the one `hosted` hands over, else the environment's; None alone."""
    host = _HOSTED.get()
    if host is not None:
        return host
    penv = ProcessEnv.from_environ()
    return None if penv is None else Hosted(penv)


def _own_loop(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    raise SessionError("a Session's step is the user's loop: nothing calls train_step")


class Session:
    """A training loop the user keeps, run as this process's role (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset,
                 batch_size: int, epochs: int = 1, **keywords: Any) -> None:
        owned = sorted(set(keywords) & set(LOOP_OWNED))
        if owned:
            raise TypeError(f"Session() got {', '.join(owned)}: a Session's loop does that itself "
                            "(use Trainer to have it done for you)")
        _check_replica(model, optimizer)
        job = Job.from_keywords(
            # The controller's model is the run's start (ship_start), a copy taken as the run begins.
            model=lambda: copy.deepcopy(model), optimizer=lambda params: optimizer, train_step=_own_loop,
            dataset=dataset, batch_size=batch_size, epochs=epochs, ship_start=True, **keywords,
        )
        self._setup(job, (model, optimizer))

    @classmethod
    def of_job(cls, job: Job, alone: bool = False) -> Session:
        """Trainer's session: the replica built from `job`'s factories where one trains; `alone` ignores the role."""
        session = cls.__new__(cls)
        session._setup(job, None, alone)
        return session

    def _setup(self, job: Job, replica: tuple[torch.nn.Module, torch.optim.Optimizer] | None,
               alone: bool = False) -> None:
        coordinator_config(job)  # every scheduling setting is checked now, in every process
        self.job = job
        self.result: TrainResult | None = None
        self._replica = replica
        self._alone = alone
        self._loop: AloneLoop | RankRuntime | None = None
        self._held: contextlib.ExitStack | None = None
        # A rank's process state given back once its block ends (after its goodbye): the handlers its stops
        # replaced, and the cores it had before its share; a stop that fired, or its share, must not hold
        # the next rank or test this process runs (raise_lost_signal, rank.keep_to_share).
        self._given_back = contextlib.ExitStack()
        self._owed = False

    # -- the role ----------------------------------------------------------

    def __enter__(self) -> Session:
        role = None if self._alone else played_role()
        self._held = contextlib.ExitStack()
        if role is None:
            self._loop = AloneLoop(self.job, *self._alone_replica())
        else:
            with contextlib.ExitStack() as entering:  # left at once if entering the role fails or ends (relay)
                entering.enter_context(_playing_role())
                role.played = True  # the process's script did what it was started for (`unplayed`)
                self._enter_role(role.penv, role.link)
                self._held.enter_context(entering.pop_all())
        if self._loop is not None:  # record_scalar adds to this process's epoch reports
            self._held.enter_context(recording(self._loop.scalars))
        return self

    def _enter_role(self, penv: ProcessEnv, link: MembershipLink | None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise SessionError(
                f"Trainer(...).run() or a Session ran outside the main thread of a cluster process ({penv.role}): "
                "its role stops on SIGTERM, which Python delivers to the main thread only; call it from the "
                "script's main thread (alone, in one process, any thread works)")
        if penv.lifeline_fd is not None and penv.role != "relay":  # the relay watches its own (run_relay)
            watch_lifeline(penv.lifeline_fd, _hang_up if penv.role == "rank" else stop_as_on_sigterm)
        job = self.job
        job.check_settings(penv.settings)  # the run's settings agree with the job (wire format, beats)
        # A relay's comings and goings (ranks joining, leaving) are what an operator reads
        # when a host misbehaves; ranks and the controller print progress, not chatter.
        level = logging.INFO if penv.role == "relay" else logging.WARNING
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        if penv.role == "controller":
            from flodl_zmq.controller_service import run_controller

            # A restart or re-form: only the controller reads the checkpoint (PROTOCOL.md 13).
            stem = checkpoints.resolve(penv.settings.resume, penv.settings.checkpoint_dir)
            if stem is not None:
                job = dataclasses.replace(job, resume_from=str(stem))
            if link is not None:  # `flodl-zmq controller` serves its own signals (controller.serve)
                self.result = run_controller(job, penv, link)
                return
            # launch stops its controller with SIGTERM: the run log must end saying so (the
            # service's `end` line), and the process exit as a shell's would, with no traceback.
            previous = raise_interrupt_on_sigterm()
            try:
                self.result = run_controller(job, penv, link)
            except KeyboardInterrupt as stop:
                raise SystemExit(interrupted_exit(stop)) from None
            finally:
                signal.signal(signal.SIGTERM, previous)
            return
        if penv.role == "relay":
            from flodl_zmq.relay import run_relay

            raise SystemExit(run_relay(penv, job.wire))  # a script run as the relay knows the format
        for signum, stop in ((signal.SIGTERM, RankTerminated), (signal.SIGHUP, RankOrphaned)):
            self._given_back.callback(signal.signal, signum, signal.signal(signum, RaisingHandler(stop)))
        self._loop = self._rank(penv)
        self._loop.start()

    def _alone_replica(self) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.device]:
        torch.set_num_threads(self.job.torch_threads)
        if self._replica is None:
            model = self.job.build_model()
            return model, self.job.build_optimizer(model), torch.device("cpu")
        model, optimizer = self._replica
        return model, optimizer, _device_of(model)

    def _rank(self, penv: ProcessEnv) -> RankRuntime:
        """This process's rank: connected to its host's relay, trains what it is dispatched."""
        from flodl_zmq.links import local_endpoints

        assert penv.host is not None and penv.rank is not None and penv.local_rank is not None
        control, data = local_endpoints(penv.key, penv.incarnation, penv.host)
        s, job = penv.settings, self.job
        cfg = RankConfig(
            # Resumed (the job's resume_from, or the checkpoint the controller ships, FLODL_RESUME) or a
            # shipped start: the rank loads the starting model from the reducer before its first step.
            resumed=bool(job.resume_from) or s.resume is not None or job.ship_start,
            rank=penv.rank, local_rank=penv.local_rank, world_size=penv.world_size, host=penv.host,
            key=penv.key, incarnation=penv.incarnation, control_endpoint=control, data_endpoint=data,
            slowdown=s.slowdown, rank_heartbeat_period_s=s.rank_heartbeat_period_s,
            coordinator_silence_at_rank_s=s.coordinator_silence_at_rank_s,
            coordinator_first_contact_at_rank_s=s.coordinator_first_contact_at_rank_s,
            consensus_wait_at_relay_s=s.consensus_wait_at_relay_s,
            sharded=s.shard_map.count > 1,
        )
        # Before the rank starts a thread or a loader worker: they keep to its cores too.
        if (cores := keep_to_share(penv.local_rank, len(penv.world[penv.host]), job.torch_threads + job.num_workers)):
            self._given_back.callback(os.sched_setaffinity, 0, cores)
        if self._replica is None:
            return RankRuntime(job, cfg, pick_device(penv.local_rank))
        return RankRuntime(job, cfg, _device_of(self._replica[0]), self._replica)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._held is not None:  # record_scalar's recording, and the role played (_PLAYING)
            self._held.close()
        loop = self._loop
        if isinstance(loop, AloneLoop):
            if kind is None:
                self.result = loop.finish()
            elif issubclass(kind, KeyboardInterrupt):
                loop.interrupted()
            else:
                loop.release()
        elif isinstance(loop, RankRuntime):
            if kind is not None and issubclass(kind, Exception):
                log.error("%s", training_failed(loop.cfg.rank, exc), exc_info=(kind, exc, tb))  # type: ignore[arg-type]
            try:
                # Stopped by a signal: who sent it reports the exit, so nobody's acknowledgement is awaited.
                code = loop.close(failed=kind is not None, linger=not isinstance(exc, RankTerminated),
                                  goodbye=not isinstance(exc, RankOrphaned))
            finally:
                self._given_back.close()
            if kind is None or issubclass(kind, Exception):
                raise SystemExit(code)
        # The controller's result is set on entering; a relay never gets here.

    # -- the loop ----------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """This process's batches, on the model's device; report each one's optimizer step with `step`."""
        if self._loop is None:
            if self.result is None:
                raise SessionError("Session.batches() is for inside its with block: `with fz.Session(...) as s:`")
            return  # the controller: the run is over, nothing to train here
        for batch in self._loop.batches():
            self._owed = True
            yield batch
            if self._owed:
                raise SessionError(
                    "a batch of Session.batches() was not reported: call s.step(loss) once after each "
                    "batch's optimizer step, so its work counts in the averaging and the schedule"
                )

    def step(self, loss: float | torch.Tensor | None = None) -> None:
        """The optimizer step on the last batch is done; `loss` (optional) goes into the epoch's reports."""
        if self._loop is None or not self._owed:
            raise SessionError("Session.step() without a batch: call it once after each batch of s.batches()")
        value = float("nan") if loss is None else one_number(loss)
        if value is None:
            raise SessionError(
                f"Session.step(loss) got {type(loss).__name__} {loss!r:.80}: the loss must be one number (a float "
                "or a one-element tensor); pass the batch's mean loss, e.g. loss.mean(), or nothing"
            )
        self._owed = False
        self._loop.step(value)

    @property
    def epoch(self) -> int | None:
        """The epoch of the batch in hand (None before the first and on the controller)."""
        return None if self._loop is None else self._loop.epoch

    @property
    def stepper(self) -> Stepper:
        """The job's step on this process's replica (Trainer's loop)."""
        assert self._loop is not None, "the stepper exists where batches are trained"
        return self._loop.stepper


def _check_replica(model: Any, optimizer: Any) -> None:
    """The loop's own model and optimizer, the one over the other: a Trainer-style factory failed deep
    inside, and an optimizer over another model's parameters trained nothing, in silence."""
    for name, value, kind, label in (("model", model, torch.nn.Module, "torch.nn.Module"),
                                     ("optimizer", optimizer, torch.optim.Optimizer, "torch.optim.Optimizer")):
        if not isinstance(value, kind):
            raise ConfigError(f"Session({name}=...) got {type(value).__name__}: it takes the {name} the loop uses, "
                              f"built (a {label}); Trainer is the one that takes a factory")
    own = {id(p) for p in model.parameters()}
    if own and not any(id(p) in own for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError("Session(optimizer=...) holds none of the model's parameters, so its steps would never "
                          "change the model: build it from this model, e.g. torch.optim.SGD(model.parameters(), ...)")


def _device_of(model: torch.nn.Module) -> torch.device:
    """Where the user put the model: its batches go there."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


__all__ = ["Session", "hosted", "played_role"]
