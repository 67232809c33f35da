"""Consensus checkpoints: the consensus a controller keeps, when a checkpoint is due, the writer that
keeps the last K, the newest one; what a controller resumes from one, and the re-formed world that
continues from one.

A checkpoint is a bundle (flodl_zmq/bundle.py) named after the round whose
consensus it holds, `DIR/ckpt-r000000042.pt` + `.meta.json`; its meta is
what `resume_from` continues (the coordinator's state as of that consensus),
plus the run id and the world, so a restarted controller can re-admit the
same hosts with their old ranks.

Rules this module keeps:

- The kept consensus (`Keeper`) is the newest of positive mass on the
  reducer's broadcast, f32 whatever the wire carries; a checkpoint holds it
  only when it is the round the coordinator last counted finished: the
  coordinator's state then describes exactly that consensus (resume.py).

- A checkpoint never stalls a round. The controller hands a copy of the
  consensus and the coordinator's state to one writer thread and goes on; a
  newer snapshot replaces one the writer has not started (only the newest
  matters), so a slow disk costs checkpoints, never rounds.
- Atomic: `bundle.save` writes each file to a fresh temp file, fsyncs and
  renames it, model first and meta last; a checkpoint exists once its meta
  does, so a crash mid-write leaves the previous checkpoints whole.
- The last K are kept: older ones are removed only after a newer one is
  complete, so there is always a valid one once the first write succeeded.
- A failed write (a full disk, an unwritable path) is logged with the path
  and the error, and kept for `status`; the run goes on, the partial files
  are removed, and the previous checkpoint stays the newest.
- The checkpoint directory is this user's alone (`private_files.own_dir`):
  another user's, or one others may write in, is refused at start and never
  resumed from; files are written 0600 and read never through a symlink.
- A completed run stays completed: its controller writes `completed.json`
  into the checkpoint directory (atomically) before it exits, and `--resume
  auto` on a directory holding it starts nothing (`RunComplete`, exit 0), so
  an orchestrator that starts the same command again (a Job's pod, `docker
  compose up`) never trains the run's tail twice.
- A resumed controller is the next incarnation of the one that saved the
  bundle; a re-formed world is not a restart: it continues the run's result
  and incarnation (`WorldChange`), resumed from the re-form checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flodl_zmq import bundle
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.errors import ConfigError, ProtocolError, RunComplete
from flodl_zmq.job import Job
from flodl_zmq.outer import OuterOptimizer
from flodl_zmq.payload import load_flat, refresh_estimates
from flodl_zmq.private_files import own_dir, read_own, write_atomic
from flodl_zmq.result import TrainResult
from flodl_zmq.settings import Settings
from flodl_zmq.shards import Cut, OuterGather
from flodl_zmq.wire import records as rec

log = logging.getLogger(__name__)

_STEM = re.compile(r"^ckpt-r(\d{9})\.meta\.json$")
CHECKPOINT_DIR = "checkpoint directory (--checkpoint-dir)"
COMPLETED = "completed.json"  # the completion marker of the run whose checkpoints a directory holds
CLOSE_TIMEOUT_S = 60.0  # how long the run's end waits for a checkpoint being written


def stem_for(directory: Path, round: int) -> Path:
    """The bundle stem of the checkpoint of round `round` in `directory`."""
    return directory / f"ckpt-r{round:09d}"


def complete(directory: str | Path) -> list[Path]:
    """The stems of the complete checkpoints in `directory` (their meta exists), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = sorted((int(m.group(1)), d / m.group(0).removesuffix(".meta.json"))
                   for m in (_STEM.match(p.name) for p in d.iterdir()) if m)
    return [stem for _, stem in found]


def newest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint's stem in `directory`, or None when it holds none."""
    found = complete(directory)
    return found[-1] if found else None


def check_dir(checkpoint_dir: str | None) -> None:
    """A ConfigError for a checkpoint directory this process cannot create or write, before the run starts; a disk
    that fills later is the run's to report write by write (it goes on). Another user's: PrivateDirError."""
    if checkpoint_dir is None:
        return
    try:
        own_dir(checkpoint_dir, CHECKPOINT_DIR)
    except OSError as exc:
        raise ConfigError(f"{CHECKPOINT_DIR} {checkpoint_dir}: cannot create it ({exc.strerror or exc}): name a "
                          "directory this user can write, or unset it for no periodic checkpoints") from exc
    if not os.access(checkpoint_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"{CHECKPOINT_DIR} {checkpoint_dir} is not writable (a read-only mount?): name a directory "
                          "this user can write, or unset it for no periodic checkpoints")


def resolve(resume: str | None, checkpoint_dir: str | None) -> Path | None:
    """The bundle stem `--resume` names (settings.py), or None for a fresh run.

    `auto`: the newest checkpoint of `checkpoint_dir`, None when it holds none
    (the first start of a run that may later restart); a directory: its newest
    checkpoint, which must exist; anything else: a bundle stem. A directory
    must be this user's, writable by nobody else (`private_files.own_dir`).
    """
    if resume is None:
        return None
    if resume == "auto":
        if checkpoint_dir is None:
            raise ConfigError("--resume auto continues the newest checkpoint of --checkpoint-dir, which is not set: "
                              "set --checkpoint-dir (FLODL_CHECKPOINT_DIR), or name a checkpoint directory")
        if not os.path.exists(checkpoint_dir):
            return None
        # Another user's directory could hold a checkpoint they planted: never continued.
        directory = own_dir(checkpoint_dir, CHECKPOINT_DIR)
        done = completion(directory)
        if done is not None:
            raise RunComplete(
                f"run {str(done.get('run_id'))[:8]} is complete ({directory / COMPLETED}): --resume auto has nothing "
                "to resume, so nothing was started; to train a new run, give it another --checkpoint-dir"
            )
        return newest(directory)
    if Path(resume).is_dir():
        stem = newest(own_dir(resume, f"--resume {resume}: the checkpoint directory"))
        if stem is None:
            raise ConfigError(f"--resume {resume}: the directory holds no complete checkpoint (ckpt-r*.meta.json); "
                              "name the directory the controller wrote them to (--checkpoint-dir)")
        return stem
    stem = bundle.stem_of(resume)
    if not any(p.exists() for p in bundle.paths(stem)):  # named as the user gave it, before the bundle's reader
        raise ConfigError(f"--resume {resume} (FLODL_RESUME): no checkpoint directory and no bundle of that name "
                          f"({stem}.pt, {stem}.meta.json): name a checkpoint directory, a checkpoint's stem "
                          "(DIR/ckpt-rNNNNNNNNN), or auto (the newest of --checkpoint-dir)")
    return Path(stem)


def completion(directory: str | Path) -> dict[str, Any] | None:
    """The completion marker of the run in checkpoint directory `directory` (module docstring), or None."""
    path = Path(directory) / COMPLETED
    if not os.path.lexists(path):
        return None
    try:
        with read_own(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read ({type(exc).__name__}: {exc}): it marks the run complete; remove "
                          "it to resume the run from its newest checkpoint") from None


def pin_resume(settings: Settings) -> Settings:
    """`settings` with `resume` resolved to the one checkpoint stem the run continues (None: a fresh run).

    Done once, by what starts the run (the controller command, the launcher),
    and shipped as it is: `auto` read again later, or by another process,
    could name a newer checkpoint than the one every process continues.
    """
    stem = resolve(settings.resume, settings.checkpoint_dir)
    return replace(settings, resume=None if stem is None else str(stem))


@dataclass
class CheckpointPolicy:
    """When a checkpoint is due; pure: the caller gives the time and the rounds done.

    Due at the first finished round after `every_s` seconds since the last one
    (or since the start), after `every_rounds` rounds (0: off), or after an
    epoch ended (`epoch_ended`), whichever comes first.
    """

    every_s: float
    every_rounds: int
    started_at: float
    last_at: float | None = None
    last_rounds: int = 0
    epoch_ended: bool = False

    def due(self, now: float, rounds_done: int) -> bool:
        if rounds_done <= self.last_rounds:
            return False  # nothing new since the last checkpoint
        if self.epoch_ended:
            return True
        if self.every_rounds and rounds_done - self.last_rounds >= self.every_rounds:
            return True
        since = now - (self.last_at if self.last_at is not None else self.started_at)
        return self.every_s > 0 and since >= self.every_s

    def taken(self, now: float, rounds_done: int) -> None:
        self.last_at, self.last_rounds, self.epoch_ended = now, rounds_done, False


@dataclass(frozen=True)
class Snapshot:
    """What one checkpoint holds: the consensus of `round` (a copy), its meta, the outer momentum if any."""

    round: int
    consensus: np.ndarray
    meta: dict[str, Any]
    outer_momentum: np.ndarray | None = None

    @classmethod
    def of(cls, round: int, consensus: np.ndarray, meta: dict[str, Any],
           outer: tuple[np.ndarray, np.ndarray] | None) -> Snapshot:
        """A copy of the consensus of `round`; with an outer step, `outer`: the reducer's f32 global
        model and momentum of one round (not the broadcast copy, which the wire may have rounded)."""
        if outer is None:
            return cls(round, consensus.copy(), meta)
        return cls(round, outer[0], meta, outer[1])


def bundle_meta(reason: str, state: dict[str, Any], penv: ProcessEnv, *, incarnation: int, consensus_round: int,
                outer: str | None) -> dict[str, Any]:
    """A bundle's meta: the coordinator's state, and the run and world a restart re-admits."""
    return {
        "epoch": state.get("epoch", 0),
        "global_step": state.get("global_step", 0),
        "reason": reason,
        "world_size": penv.world_size,
        "world": {host: list(ranks) for host, ranks in penv.world.items()},
        "run_id": penv.run_id.hex(),
        "incarnation": incarnation,
        "consensus_round": consensus_round,
        "coordinator": state,
        "outer": outer,
    }


@dataclass(frozen=True)
class Resumed:
    """What a controller continues from the bundle `resume_from` names (nothing for a fresh run).

    `coordinator`: the coordinator's state (resume.py); `epoch`: the first
    epoch to train; `incarnation`: this controller's place in the run's line
    of restarts (status, bundles), one after the bundle's.
    """

    model_state: dict[str, torch.Tensor] | None = None
    meta: dict[str, Any] | None = None
    coordinator: dict[str, Any] | None = None
    epoch: int = 0
    incarnation: int = 1

    stem: str | None = None

    @classmethod
    def load(cls, stem: str | None) -> Resumed:
        if not stem:
            return cls()
        state, meta = bundle.load(stem)
        return cls(state, meta, meta.get("coordinator"), int(meta.get("epoch", 0)),
                   int(meta.get("incarnation", 0)) + 1, stem)

    def outer_optimizer(self, job: Job, consensus: np.ndarray, stepped: int) -> OuterOptimizer | None:
        """The outer optimizer from the initial (or resumed) model, its momentum resumed when saved by the same step;
        `stepped`: the model's parameter values (its float buffers are averaged, never stepped)."""
        config = job.outer_config()
        if config is None:
            return None
        if stepped == 0:
            raise ConfigError(f"outer={config.kind!r} on a model without parameters: an outer step needs parameters "
                              "to step; use outer='none'")
        momentum = None
        if self.meta is not None and self.meta.get("outer") == config.kind:
            saved = bundle.load_outer(self.stem)
            momentum = None if saved is None else saved.numpy()
        if self.meta is not None and not job.quiet:  # a resume's outcome is the user's to see
            print(f"outer {config.kind} momentum " + ("starts at zero (the bundle has none for this step)"
                  if momentum is None else f"resumes from {self.stem}"), flush=True)
        return OuterOptimizer(config, consensus, momentum, stepped)


# The longest a bundle waits for the shards' outer state: one whose shard never answers (its relay's link to the
# controller down) is then written without it, saying so, rather than no bundle being written at all.
OUTER_WAIT_S = 60.0


class ShardedOuter:
    """A sharded run's outer state for its bundles (PROTOCOL.md 10.9 item 12): the shards hold it in slices, so a
    bundle that is due asks every shard for its slice (`ask`: the controller's reducer's `want_state`, which
    asks the host shards too), again each round, until they are all in for the kept round or a later one (or
    OUTER_WAIT_S passed): the bundle's model is then that round's global model, its momentum that round's,
    and its coordinator's state the kept round's, never newer than its model (as with one reducer)."""

    def __init__(self, cut: Cut, ask: Callable[[int], None], kept_round: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`ask`: the controller's reducer's `want_state`; `kept_round`: the round of the kept consensus."""
        self.gather = OuterGather(cut)
        self._ask, self._kept_round, self._clock = ask, kept_round, clock
        self._waiting_since: float | None = None  # when the bundle now due first asked
        self._last_ask = -1

    def add(self, shard: int, round_id: int, payload: list[Any]) -> None:
        try:
            self.gather.add(shard, round_id, payload)
        except ProtocolError as exc:  # a shard of another map or model: its state is not this run's
            log.warning("controller: %s", exc)

    def ready(self) -> bool:
        """Whether every shard's state of the kept round (or a later one) is in; if not, ask (once a round)."""
        kept, whole = self._kept_round(), self.gather.whole
        if whole is not None and whole[0] >= kept:
            return True
        if self._waiting_since is None:
            self._waiting_since = self._clock()
        elif self._clock() - self._waiting_since > OUTER_WAIT_S:
            return True  # written without it (`state` says so)
        if self._last_ask < kept:
            self._last_ask = kept
            self._ask(kept)
        return False

    def state(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The (global model, momentum) for the bundle written now, of the kept round or a later one; None, said
        in the log, when they have not come (the bundle then holds the kept consensus and no momentum)."""
        self._waiting_since, whole = None, self.gather.whole  # the next bundle waits afresh
        if whole is None or whole[0] < self._kept_round():
            log.warning("controller: a bundle of this sharded run is written without the outer momentum: not every "
                        "shard's state of the kept round had come (a bundle that could not wait, or a shard host's "
                        "relay cut off from the controller for %g s); a resume from it starts the momentum at zero",
                        OUTER_WAIT_S)
            return None
        return whole[1], whole[2]


@dataclass
class WriterStatus:
    """What `status` shows of the checkpoints: the last written, the last failure."""

    written: int = 0
    failed: int = 0
    last_path: str | None = None
    last_round: int | None = None
    last_at: float | None = None  # unix time
    last_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def write(stem: Path, snapshot: Snapshot, to_state_dict: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> Path:
    """Write `snapshot` as the bundle `stem`; its meta path. On OSError nothing of it is left (a
    model without its meta is no checkpoint) and the error is raised."""
    try:
        state = to_state_dict(torch.from_numpy(snapshot.consensus))
        momentum = None if snapshot.outer_momentum is None else torch.from_numpy(snapshot.outer_momentum)
        return bundle.save(stem, state, snapshot.meta, momentum)
    except OSError:
        for p in (*bundle.paths(stem), bundle.outer_path(stem)):
            with contextlib.suppress(OSError):
                p.unlink()
        raise


@dataclass
class CheckpointWriter:
    """Writes snapshots on its own thread into `directory`, keeping the newest `keep`.

    `to_state_dict(flat)`: the model's state_dict with the flat consensus loaded
    (built on the writer's thread, off the controller's loop).
    """

    directory: Path
    keep: int
    to_state_dict: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    status: WriterStatus = field(default_factory=WriterStatus)

    def __post_init__(self) -> None:
        self._cv = threading.Condition()
        self._pending: Snapshot | None = None
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="flodl-checkpoint", daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Queue `snapshot` (replacing one not started yet); never waits on the disk."""
        with self._cv:
            self._pending = snapshot
            self._cv.notify()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Write what is queued, then stop; False if the writer was still busy after `timeout_s`."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("checkpoint: a write into %s did not finish within %g s; it goes on as the run ends",
                      self.directory, timeout_s)
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closing:
                    self._cv.wait()
                snapshot, self._pending = self._pending, None
                if snapshot is None:
                    return
            self._write(snapshot)

    def _write(self, snapshot: Snapshot) -> None:
        stem = stem_for(self.directory, snapshot.round)
        try:
            meta_path = write(stem, snapshot, self.to_state_dict)
        except OSError as exc:
            self.status.failed += 1
            self.status.last_error = f"{stem}: {type(exc).__name__}: {exc}"
            log.error("checkpoint: could not write %s (%s: %s); the run goes on and %s stays the newest "
                      "checkpoint: free space or fix the path (--checkpoint-dir)", stem, type(exc).__name__, exc,
                      newest(self.directory) or "none")
            return
        self.status.written += 1
        self.status.last_path, self.status.last_round = str(stem), snapshot.round
        self.status.last_at, self.status.last_error = time.time(), None
        log.info("checkpoint: wrote %s (round %d)", meta_path, snapshot.round)
        for old in complete(self.directory)[:-self.keep]:
            # Meta first: a model without its meta is no checkpoint.
            for p in (*reversed(bundle.paths(old)), bundle.outer_path(old)):
                with contextlib.suppress(OSError):
                    p.unlink()


class Keeper:
    """The consensus a controller keeps, and the checkpoints and bundles it writes of it.

    `consensus`: the newest positive-mass consensus (the initial or resumed
    model until the first), of round `round`; `completed_round`: the last
    round the coordinator counted finished.
    """

    def __init__(self, job: Job, penv: ProcessEnv, incarnation: int, consensus: np.ndarray) -> None:
        self.job, self.penv, self.incarnation = job, penv, incarnation
        self.consensus = consensus
        self.round = -1
        self.completed_round = -1
        # The periodic checkpoints (`checkpoint_dir`, settings.py): the policy says when, the writer writes.
        self.writer: CheckpointWriter | None = None
        self.policy: CheckpointPolicy | None = None
        self._outer_state: Callable[[], tuple[np.ndarray, np.ndarray] | None] = lambda: None
        self.sharded_outer: ShardedOuter | None = None  # `gather_outer`

    @property
    def consistent(self) -> bool:
        """The kept consensus is the round the coordinator last counted finished (its state describes it)."""
        return self.round == self.completed_round

    def start(self, now: float, rounds_done: int,
              outer_state: Callable[[], tuple[np.ndarray, np.ndarray] | None] | None) -> None:
        """Start the periodic checkpoints (if set); `outer_state`: the outer step's f32 model and momentum (a
        sharded run's come from its shards: `gather_outer`)."""
        if outer_state is not None:
            self._outer_state = outer_state
        settings = self.penv.settings
        if settings.checkpoint_dir is None:
            return
        directory = Path(settings.checkpoint_dir)
        check_dir(settings.checkpoint_dir)
        self.writer = CheckpointWriter(directory, settings.checkpoint_keep, self.state_dict_of)
        self.policy = CheckpointPolicy(settings.checkpoint_every_s, settings.checkpoint_every_rounds, started_at=now,
                                       last_rounds=rounds_done)

    def keep(self, record: rec.Consensus, payload: list[np.ndarray]) -> None:
        """A consensus from the broadcast: kept when of positive mass and newer than the kept one."""
        if not (record.mass > 0.0 and record.round > self.round and payload):
            return
        wire = self.job.wire
        if not wire.is_payload(payload) or wire.numel(payload) != self.consensus.size:
            return
        # The kept consensus (the result and the saved model) is f32 whatever the wire
        # carries: a bf16 round is widened once, here, exactly (int8: values times scales).
        wire.widen(payload, self.consensus)
        self.round = record.round

    def epoch_ended(self) -> None:
        if self.policy is not None:
            self.policy.epoch_ended = True

    def outer_ready(self) -> bool:
        """Whether a bundle can hold the outer state now (a sharded run's shards are asked if not)."""
        return self.sharded_outer is None or self.sharded_outer.ready()

    def gather_outer(self, cut: Cut, ask: Callable[[int], None]) -> None:
        """A sharded run with an outer step: its bundles' outer state comes from its shards (ShardedOuter)."""
        self.sharded_outer = ShardedOuter(cut, ask, lambda: self.round)
        self._outer_state = self.sharded_outer.state

    def outer_slice(self, shard: int, round_id: int, payload: list[Any]) -> None:
        """A shard's slice of the outer state, as the controller's reducer passed it on."""
        if self.sharded_outer is not None:
            self.sharded_outer.add(shard, round_id, payload)

    def _final_waits_for_shards(self) -> bool:
        """Whether the run's final save holds outer state that only the shards have (a sharded run's outer step)."""
        return self.sharded_outer is not None and bool(self.job.save_path)

    def end_wait_s(self, drain_s: float) -> float:
        """How long the run's end may wait for what the final save needs: `drain_s`, or up to OUTER_WAIT_S for
        the shards' outer state."""
        return OUTER_WAIT_S if self._final_waits_for_shards() else drain_s

    def settled(self) -> bool:
        """At the run's end: the kept consensus is the last round, and the final save can hold the outer state
        (asked for at once, while the shards' relays are still up)."""
        outer = not self._final_waits_for_shards() or self.outer_ready()
        return self.consistent and outer

    def maybe_checkpoint(self, now: float, rounds_done: int, state: Callable[[], dict[str, Any]]) -> None:
        """Hand the writer a copy of the kept consensus when a checkpoint is due (and the outer state with it
        can be had); never waits on it."""
        if self.writer is None or self.policy is None or not self.consistent:
            return
        if self.policy.due(now, rounds_done) and self.outer_ready():
            self.policy.taken(now, rounds_done)
            self.writer.submit(self.snapshot("checkpoint", state()))

    def snapshot(self, reason: str, state: dict[str, Any]) -> Snapshot:
        """A copy of the kept consensus with its meta, for a bundle (with an outer step, the reducer's). A copy
        behind the coordinator's last finished round (the final save or a stop's, where nothing waits longer for
        it) is said: what the ranks trained since is not in it."""
        if not self.consistent:
            log.warning("controller: the %s bundle holds the consensus of round %d, not of round %d, the last one "
                        "finished: the controller's copy of the later rounds had not come in whole (a slice lost "
                        "on a shard's link, or the run stopped before its broadcast), so their training is not in it",
                        reason, self.round, self.completed_round)
        meta = bundle_meta(reason, state, self.penv, incarnation=self.incarnation, consensus_round=self.round,
                           outer=self.job.outer)
        return Snapshot.of(self.round, self.consensus, meta, self._outer_state())

    def state_dict_of(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The job's model's state_dict holding the flat parameters `flat`."""
        model = self.job.model()
        load_flat(model, flat)
        refresh_estimates(model)  # the bundle's model is scored as it stands
        return model.state_dict()

    def write_reform(self, state: dict[str, Any], run_dir: Path) -> Path | None:
        """Write the re-form checkpoint of the kept consensus, synchronously: the run cannot go on without it.

        Next to the periodic ones, else under the run's directory. None when it
        could not be written: the run goes on as it is.
        """
        if self.writer is not None:
            self.writer.close()  # its last write may be this very round: one writer per file
        directory = Path(self.penv.settings.checkpoint_dir) if self.penv.settings.checkpoint_dir else run_dir / "reform"
        stem = stem_for(directory.resolve(), self.round)
        try:
            write(stem, self.snapshot("reform", state), self.state_dict_of)
        except OSError as exc:
            log.error("controller: could not write the re-form checkpoint %s (%s); hosts waiting to join wait "
                      "for the next epoch boundary", stem, exc)
            return None
        return stem

    def mark_completed(self, saved: str | None) -> None:
        """Mark the checkpoint directory's run complete (module docstring); `saved`: its final bundle, if any."""
        if self.penv.settings.checkpoint_dir is None:
            return
        path = Path(self.penv.settings.checkpoint_dir) / COMPLETED
        marker = {"run_id": self.penv.run_id.hex(), "completed_at": time.time(), "saved": saved}
        try:
            write_atomic(path, lambda f: f.write(json.dumps(marker).encode()))
        except OSError as exc:
            log.error("checkpoint: could not write %s (%s: %s): a restart with --resume auto would resume this "
                      "completed run from its newest checkpoint", path, type(exc).__name__, exc)

    @property
    def newest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint of the checkpoint directory, the one `--resume DIR` continues (None: none
        yet, or checkpoints are off): this run's, or the one it resumed from before it wrote its own."""
        directory = self.penv.settings.checkpoint_dir
        return None if directory is None else newest(directory)

    def status(self) -> dict[str, Any] | None:
        """What `status` shows of the periodic checkpoints (None: off)."""
        return None if self.writer is None else self.writer.status.to_dict()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


@dataclass
class WorldChange:
    """A re-formed world (elastic join): the run's result so far, and the world before and after.

    Handed to the next `ControllerService`, which continues `result` and
    marks its first epoch line with `describe()`. `incarnation`: the new
    world's id (PROTOCOL.md 4.1), which its services sign and check with.
    """

    result: TrainResult
    before: dict[str, tuple[int, ...]]
    after: dict[str, tuple[int, ...]]
    checkpoint: str
    incarnation: bytes
    marked: bool = False

    @property
    def joined(self) -> list[str]:
        """Hosts with new ranks: new hosts, and hosts that left and came back."""
        return [h for h in self.after if self.after[h] != self.before.get(h)]

    @property
    def left(self) -> list[str]:
        return [h for h in self.before if h not in self.after]

    def describe(self) -> str:
        """E.g. `4 -> 6 ranks (+w3)`: the ranks hosts hold before and after; + joined, - left."""
        before, after = (sum(map(len, w.values())) for w in (self.before, self.after))
        moved = [f"+{h}" for h in self.joined] + [f"-{h}" for h in self.left]
        return f"{before} -> {after} ranks ({' '.join(moved)})"

    def summary(self, epoch: int) -> dict[str, Any]:
        """`TrainResult.world_changes` entry (JSON-able)."""
        return {
            "epoch": epoch, "checkpoint": self.checkpoint,
            "before": {h: list(rs) for h, rs in self.before.items()},
            "after": {h: list(rs) for h, rs in self.after.items()},
        }

    def carry_on(self, model: torch.nn.Module, start_epoch: int, quiet: bool) -> TrainResult:
        """The run's result, continued by the new world's `model` from `start_epoch`: not a restart."""
        self.result.model = model
        self.result.world_changes.append(self.summary(start_epoch))
        if not quiet:
            print(f"world re-formed at epoch {start_epoch + 1}: {self.describe()}", flush=True)
        return self.result

    def join_event(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The run log's `join` event for a re-form from the checkpoint whose bundle meta is `meta`: its epoch
        (the first the consensus does not hold whole) and round (the new world's first is the next)."""
        epoch, round = meta["epoch"], meta["consensus_round"]
        return {"epoch": epoch, "round": round, "world": self.after, "joined": self.joined, "left": self.left,
                "host": " ".join(self.joined),
                "reason": f"world re-formed at epoch {epoch + 1}, round {round}: {self.describe()}"}

    def resumed(self, job: Job, penv: ProcessEnv, run_dir: str) -> tuple[Job, ProcessEnv]:
        """The job and process environment of the new world: resumed from the re-form checkpoint, in the
        same run directory, every host told that checkpoint, under the new world's incarnation."""
        job = replace(job, resume_from=self.checkpoint, run_dir=run_dir)
        penv = replace(penv, world=self.after, incarnation=self.incarnation,
                       settings=replace(penv.settings, resume=self.checkpoint))
        return job, penv
