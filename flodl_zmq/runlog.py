"""The run directory's event log: `RUN_DIR/events.jsonl`, one JSON object per line.

Every run, in a cluster or alone, leaves one behind so that a finished (or
crashed) run can be looked at afterwards: `flodl-zmq report RUN_DIR` draws it
(flodl_zmq/runreport.py), and next to it TensorBoard event files of the same
events' scalars (`events.out.tfevents.<time>.<host>`: loss, eval, shares,
throughput, round time; flodl_zmq/tfevents.py), for `tensorboard --logdir
RUN_DIR`. A `listener` (the controller's Prometheus metrics,
flodl_zmq/metrics.py) is handed every event too: the figures reach every
place users look from this one stream. Each line is `{"t": unix seconds, "kind": KIND, ...}`:

    start       mode, epochs, world {host: [ranks]}, world_size
    epoch       epoch, avg_loss, epoch_ms, samples (trained by all ranks, or the one process alone), batch_share[r], throughput[r] (samples/s)
    eval        epoch, metric
    round       round, round_ms, masses {host: its ranks' mass in the round, 0 when they trained
                nothing}, global_step, epoch, counts[r] (ElChe's window), anchor,
                verdict (the guard's: stable, suppress_growth, nudge_down), divergence
    death       rank, reason
    exit        rank: a rank that left before the run's end (it said goodbye: its loop broke or raised)
    pending     hosts, round: hosts admitted mid-run wait to join, seen after that round
    join        epoch, round (the consensus it starts from), world {host: [ranks]}, joined,
                left [hosts], host, reason: the world re-formed with hosts that joined
                mid-run (PROTOCOL.md 13.1)
    restart     checkpoint, epoch, round, incarnation, reason: the run resumed from a checkpoint or a save (a
                controller restarted after a crash, --resume, resume_from=); after a restart the rounds after
                `round` are trained again, and the lines after it are the new incarnation's
    checkpoint  path, reason, epoch
    end         reason, wall_s

Rules it keeps:

- The log never stalls or ends a run. Lines are written by the controller
  side only (never a rank), each flushed as written, and the event file's
  records with them (a crash loses at most the line being written); a directory that cannot be made or a write that
  fails (read-only, disk full) is reported once, with the path and the
  error, and the run goes on without its log.
- The directory is this user's alone (`private_files.own_dir`): made 0700,
  or refused (`PrivateDirError`, the run does not start) when another user
  owns it or others may write in it; the log is appended 0600 and never
  through a symlink planted at its name.
- Where: `Trainer(run_dir=...)`, else `--run-dir` / FLODL_RUN_DIR of the
  command that started the controller, else a fresh `runs/<time>-<id>` in
  the working directory (`run_dir_for`, the one rule).
- A directory given to another run is appended to, said in a warning when
  its log ends with an `end` line: a run's lines follow the previous run's
  end (a re-formed world and a restarted controller write none), which is
  how `flodl-zmq report` tells the last run from the earlier ones.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from flodl_zmq import tfevents
from flodl_zmq.private_files import open_own, own_dir, read_own

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
RUN_DIR = "run directory (--run-dir, Trainer(run_dir=...))"
DEFAULT_PARENT = "runs"


def default_run_dir() -> Path:
    """A fresh run directory under `runs/` in the working directory: `runs/20260101-120000-1a2b3c`."""
    return Path(DEFAULT_PARENT) / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"


def run_dir_for(job_run_dir: str | os.PathLike[str] | None, settings_run_dir: str | None) -> Path:
    """The run directory: the Trainer's `run_dir`, else the command's `--run-dir`, else a fresh default."""
    chosen = job_run_dir if job_run_dir is not None else settings_run_dir
    return Path(chosen) if chosen else default_run_dir()


def check_dir(run_dir: str | os.PathLike[str]) -> None:
    """Refuse now (PrivateDirError) a run directory the run would refuse when its world forms: another user's,
    open to others, or not a directory. One that cannot be made only disables the log, then as now."""
    try:
        own_dir(run_dir, RUN_DIR)
    except OSError:
        pass


def _ended(path: Path) -> bool:
    """Whether the log at `path` ends with a run's `end` line (read from its tail: a log may be long)."""
    try:
        with read_own(path) as f:  # never through a symlink planted at its name, as it is appended
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            last = f.read().splitlines()[-1:]
        return bool(last) and json.loads(last[0]).get("kind") == "end"
    except (OSError, ValueError, AttributeError):
        return False  # none yet, or a torn line: nothing said


class RunLog:
    """Appends events to `run_dir/events.jsonl` (module docstring: the kinds and the rules).

    The directory is made or checked here, before the run starts: another
    user's is refused (PrivateDirError), one that cannot be made disables the log.
    """

    def __init__(self, run_dir: str | os.PathLike[str],
                 listener: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / EVENTS_FILE
        self.listener = listener
        self._file: IO[str] | None = None
        self._scalars: IO[bytes] | None = None  # the TensorBoard event file, opened at its first scalar
        self._broken = False
        try:
            own_dir(self.run_dir, RUN_DIR)
        except OSError as exc:
            self._disable(exc)
            return
        if _ended(self.path):  # not a re-formed world's or a restarted controller's: their run goes on
            log.warning("run log %s holds an earlier run's events; this run's follow them (flodl-zmq report draws "
                        "the last run; a run directory of its own keeps each run apart)", self.path)

    def write(self, kind: str, **fields: Any) -> None:
        """Write one line `{"t": now, "kind": kind, **fields}` and its scalars; a failure is logged once, never raised."""
        plain = {k: _plain(v) for k, v in fields.items()}
        if self.listener is not None:
            self.listener(kind, plain)
        if self._broken:
            return
        now = time.time()
        line = json.dumps({"t": now, "kind": kind, **plain}, allow_nan=False)
        try:
            if self._file is None:
                fd = open_own(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                self._file = os.fdopen(fd, "a", encoding="utf-8")  # held for the run
            self._file.write(line + "\n")
            self._file.flush()
            self._write_scalars(kind, plain, now)
        except OSError as exc:
            self._disable(exc)

    def _write_scalars(self, kind: str, fields: dict[str, Any], now: float) -> None:
        """The event's TensorBoard scalars (`tfevents.series`), flushed as the line is."""
        scalars = tfevents.series(kind, fields)
        if scalars is None:
            return
        if self._scalars is None:
            name = f"{tfevents.FILE_PREFIX}.{int(now)}.{socket.gethostname()}"
            self._scalars = os.fdopen(open_own(self.run_dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")
            self._scalars.write(tfevents.first_record(now))
        step, values = scalars
        self._scalars.write(tfevents.record(tfevents.event(now, step, values)))
        self._scalars.flush()

    def _disable(self, exc: OSError) -> None:
        self._broken = True
        log.warning("run log %s disabled, the run goes on without it: %s", self.path, exc)
        self.close()

    def close(self) -> None:
        for f in (self._file, self._scalars):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass  # the failed flush was reported by write()
        self._file = self._scalars = None


def _plain(value: Any) -> Any:
    """JSON's subset of a value: tuples as lists, NaN and infinities as null, numpy scalars as numbers."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float) or hasattr(value, "item"):
        value = value.item() if hasattr(value, "item") else value
        if isinstance(value, float) and not math.isfinite(value):
            return None
    return value
