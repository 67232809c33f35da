"""Save and resume bundles: the consensus model plus what the coordinator needs to continue.

A bundle with stem `runs/digits` is two files:

    runs/digits.pt         the consensus `state_dict` (torch.save, loadable with torch.load)
    runs/digits.meta.json  {"format": 1, "epoch", "global_step", "reason", "world_size",
                            "coordinator": {...}}  (ElChe state, coverage, counters)

and, for a run with an outer optimizer, a third file written before the meta:

    runs/digits.outer.pt   {"momentum": flat f32 tensor} (the meta's "outer" names the step)

Rules this module keeps: a write is a fresh private temp file (mkstemp, mode
0600, fsynced) + atomic rename, model first, meta last, so a meta on disk
always names a complete model and no other local user can read it or steer the
write through a planted symlink; a bundle is read
back with a loud error naming the missing file or the format it does not know.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from flodl_zmq.errors import ConfigError

FORMAT = 1


def paths(stem: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(model path, meta path) of bundle `stem`."""
    s = str(stem)
    return Path(s + ".pt"), Path(s + ".meta.json")


def _write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` atomically: a fresh 0600 temp file in its directory, fsynced, renamed over it.

    mkstemp never follows or reuses an existing name (a fixed temp name would
    follow a planted symlink), and 0600 keeps the model from other local users.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable (not every filesystem allows it)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _write_torch(path: Path, obj: Any) -> None:
    # Serialized in memory first: torch reports a failed write (a full disk) as an opaque
    # RuntimeError, a plain write names the cause (ENOSPC, EROFS, ...).
    data = io.BytesIO()
    torch.save(obj, data)
    _write(path, lambda f: f.write(data.getbuffer()))


def outer_path(stem: str | os.PathLike[str]) -> Path:
    """The outer optimizer's state file of bundle `stem`."""
    return Path(str(stem) + ".outer.pt")


def save(stem: str | os.PathLike[str], state_dict: dict[str, torch.Tensor], meta: dict[str, Any],
         outer_momentum: torch.Tensor | None = None) -> Path:
    """Write the bundle atomically (files mode 0600), the outer momentum if given; returns the meta path."""
    model_path, meta_path = paths(stem)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    _write_torch(model_path, state_dict)
    if outer_momentum is not None:
        _write_torch(outer_path(stem), {"momentum": outer_momentum})
    text = json.dumps({"format": FORMAT, **meta}, indent=2, sort_keys=True)
    _write(meta_path, lambda f: f.write(text.encode()))
    return meta_path


def load(stem: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, meta) of bundle `stem`."""
    meta = load_meta(stem)
    return torch.load(paths(stem)[0], map_location="cpu", weights_only=True), meta


def load_meta(stem: str | os.PathLike[str]) -> dict[str, Any]:
    """The meta of bundle `stem` (checked complete and of this format), without reading the model."""
    model_path, meta_path = paths(stem)
    for p in (model_path, meta_path):
        if not p.exists():
            raise ConfigError(f"resume_from={str(stem)!r}: {p} does not exist (a bundle is {model_path.name} + {meta_path.name})")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{meta_path}: bundle format {meta.get('format')!r} is not {FORMAT}; written by another version")
    return meta


def load_outer(stem: str | os.PathLike[str]) -> torch.Tensor | None:
    """The outer momentum saved with bundle `stem`, or None when the run that wrote it had no outer step."""
    path = outer_path(stem)
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=True)["momentum"]
