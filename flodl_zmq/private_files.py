"""Files the controller owns: its run directory, its checkpoints and bundles, read and written safely.

Why: a checkpoint directory decides what `--resume auto` continues, and a run
directory is written for the whole run. Another local user who may write in
either could delete checkpoints, plant one the next restart follows, or plant
a symlink that makes the controller append to or overwrite a file of theirs
choosing.

Rules this module keeps:

- A directory is ours (`own_dir`): one we create is 0700 (its missing
  parents too); one that exists must be owned by this user and writable by
  nobody else, else it is refused (`PrivateDirError`) naming its owner, its
  mode and the fix. It is not otherwise changed: the user chose it.
- A file is never reached through a symlink: every open is O_NOFOLLOW, so a
  symlink planted in place of a file is refused, never followed.
- A file read is ours (`open_own`): one owned by another user, or not a
  regular file, is refused.
- A file is written whole or not at all (`write_atomic`): a fresh temp file
  in its directory (O_EXCL|O_NOFOLLOW, mode 0600), fsynced, renamed over the
  name; a rename replaces whatever sits at the name (a planted symlink
  included), it never writes through it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from flodl_zmq.errors import PrivateDirError

DIR_MODE = 0o700
FILE_MODE = 0o600


def own_dir(path: str | os.PathLike[str], what: str) -> Path:
    """`path` as a directory of ours: created 0700 (parents too), or checked ours and writable by us alone.

    `what` names it in the error (e.g. "checkpoint directory (--checkpoint-dir)").
    """
    p = Path(path)
    make_dirs(p)
    st = os.stat(p)  # the directory the path leads to: a symlink to a directory of ours is the user's choice
    if not stat.S_ISDIR(st.st_mode):
        raise PrivateDirError(f"{what} {p} is not a directory: name a directory of your own")
    foreign = st.st_uid != os.geteuid()
    if foreign or st.st_mode & 0o022:
        raise PrivateDirError(
            f"{what} {p} is not private: owner uid {st.st_uid} (this process runs as uid {os.geteuid()}), mode "
            f"{stat.S_IMODE(st.st_mode):04o}; another user who may write in it could delete or plant checkpoints "
            "and files the controller then follows: "
            + ("use a directory of your own" if foreign else f"chmod 700 {p}, or use a directory of your own")
        )
    return p


def make_dirs(path: str | os.PathLike[str]) -> None:
    """Create `path` and its missing parents 0700 (mkdir's mode is filtered by the umask); existing ones stay."""
    p = Path(path)
    missing = [d for d in (p, *p.parents) if not os.path.lexists(d)]
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked by the caller like any existing one
            os.mkdir(d, DIR_MODE)
            os.chmod(d, DIR_MODE)


def open_own(path: str | os.PathLike[str], flags: int = os.O_RDONLY) -> int:
    """A descriptor of `path` (a regular file of ours, never through a symlink); OSError names the cause.

    `flags` may add O_WRONLY|O_APPEND|O_CREAT (created 0600). A symlink at the
    name fails with ELOOP; a file of another user or not a regular file with
    EPERM, so callers handle every refusal as the OSError they already handle.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(
            1, f"not a regular file of uid {os.geteuid()} (owner uid {st.st_uid}); refused, never read or "
            "written: remove it, or copy it to a file of your own", str(path))
    return fd


def read_own(path: str | os.PathLike[str]) -> IO[bytes]:
    """`path` opened for reading as a binary file (`open_own`'s checks)."""
    return os.fdopen(open_own(path), "rb")


def write_atomic(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` through `write(file)` atomically, mode 0600 (module docstring); OSError on failure."""
    p = Path(path)
    # mkstemp: O_EXCL|O_NOFOLLOW, mode 0600, a fresh name (a fixed temp name would follow a planted symlink).
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable (not every filesystem allows it)
        dfd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
