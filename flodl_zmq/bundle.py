"""Save and resume bundles: the consensus model plus what the coordinator needs to continue.

A bundle with stem `runs/digits` is two files:

    runs/digits.pt         the consensus `state_dict` (torch.save, loadable with torch.load)
    runs/digits.meta.json  {"format": 1, "epoch", "global_step", "reason", "world_size",
                            "coordinator": {...},  (ElChe state, coverage, counters)
                            "digests": {"model": ..., "outer": ...}}

and, for a run with an outer optimizer, a third file written before the meta:

    runs/digits.outer.pt   {"momentum": flat f32 tensor} (the meta's "outer" names the step)

Rules this module keeps: each file is written atomically and private
(`private_files.write_atomic`: a fresh 0600 temp file, fsynced, renamed), model
first, meta last, so a meta on disk always names a complete model and no other
local user can read it or steer the write through a planted symlink; a
directory it creates is 0700. The meta holds each file's digest: a save over
an older bundle that stopped between its files leaves the older meta beside
the newer model, and a load refuses that pair, by name, instead of resuming
the newer model with the older state. (A meta without digests, from before
they were written, is read as before.) A bundle is read only from files of this user,
never through a symlink (`private_files.read_own`), with a loud error naming
the missing file, the refused one or the format it does not know.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import IO, Any

import torch

from flodl_zmq.errors import ConfigError
from flodl_zmq.private_files import make_dirs, read_own, write_atomic

FORMAT = 1


def stem_of(path: str | os.PathLike[str]) -> str:
    """A bundle's stem, named by itself or by one of its files: `TrainResult.saved` is its meta file's path,
    which a user hands to `resume_from` as it is. A stem that is a bundle stays one (`save_path="m.pt"` wrote
    m.pt.pt and m.pt.meta.json); a name that is neither is returned as given, for the reader to name."""
    s = str(path)
    if not paths(s)[1].exists():
        for suffix in (".meta.json", ".pt"):
            if s.endswith(suffix) and paths(s[: -len(suffix)])[1].exists():
                return s[: -len(suffix)]
    return s


def paths(stem: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(model path, meta path) of bundle `stem`."""
    s = str(stem)
    return Path(s + ".pt"), Path(s + ".meta.json")


def _new_digest() -> Any:
    """The digest a meta records per file: blake2b-128 tells apart the files of two saves at a fraction of a read's cost."""
    return hashlib.blake2b(digest_size=16)


def _write_torch(path: Path, obj: Any) -> str:
    """Write `obj` to `path`; returns the digest the meta records for it."""
    # Serialized in memory first: torch reports a failed write (a full disk) as an opaque
    # RuntimeError, a plain write names the cause (ENOSPC, EROFS, ...).
    data = io.BytesIO()
    torch.save(obj, data)
    write_atomic(path, lambda f: f.write(data.getbuffer()))
    digest = _new_digest()
    digest.update(data.getbuffer())
    return digest.hexdigest()


def outer_path(stem: str | os.PathLike[str]) -> Path:
    """The outer optimizer's state file of bundle `stem`."""
    return Path(str(stem) + ".outer.pt")


def save(stem: str | os.PathLike[str], state_dict: dict[str, torch.Tensor], meta: dict[str, Any],
         outer_momentum: torch.Tensor | None = None) -> Path:
    """Write the bundle atomically (files mode 0600), the outer momentum if given; returns the meta path."""
    model_path, meta_path = paths(stem)
    make_dirs(model_path.parent)
    digests = {"model": _write_torch(model_path, state_dict)}
    if outer_momentum is not None:
        digests["outer"] = _write_torch(outer_path(stem), {"momentum": outer_momentum})
    text = json.dumps({"format": FORMAT, **meta, "digests": digests}, indent=2, sort_keys=True)
    write_atomic(meta_path, lambda f: f.write(text.encode()))
    return meta_path


def load(stem: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, meta) of bundle `stem`."""
    meta = load_meta(stem)
    return _load_torch(paths(stem)[0], stem, "model", meta), meta


def load_into(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], stem: str | os.PathLike[str]) -> None:
    """Load a bundle's `state_dict` into the job's `model`, or ConfigError naming resume_from: a bundle of
    another model (other layers or shapes) is the user's mix-up, not a failure inside the framework."""
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as exc:
        detail = "; ".join(line.strip().rstrip(".") for line in str(exc).splitlines()[1:] if line.strip())
        raise ConfigError(
            f"resume_from={str(stem)!r} holds another model than the job's: {detail}; resume with the model "
            "that wrote it, or drop resume_from to start fresh"
        ) from None


def load_meta(stem: str | os.PathLike[str]) -> dict[str, Any]:
    """The meta of bundle `stem` (checked complete and of this format), without reading the model."""
    model_path, meta_path = paths(stem)
    for p in (model_path, meta_path):
        if not p.exists():
            raise ConfigError(f"resume_from={str(stem)!r}: {p} does not exist (a bundle is {model_path.name} + {meta_path.name})")
    with _reading(meta_path) as f:
        meta = json.loads(f.read())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{meta_path}: bundle format {meta.get('format')!r} is not {FORMAT}; written by another version")
    digests = meta.get("digests", {})
    if not (isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())):
        raise ConfigError(f"{meta_path}: its 'digests' are not a map of file digests: the meta was damaged or edited; "
                          "resume from another bundle")
    return meta


def load_outer(stem: str | os.PathLike[str]) -> torch.Tensor | None:
    """The outer momentum saved with bundle `stem`, or None when the run that wrote it had no outer step."""
    path = outer_path(stem)
    if not os.path.lexists(path):  # a symlink planted at the name is refused below, not taken for none
        return None
    return _load_torch(path, stem, "outer", load_meta(stem))["momentum"]


def _reading(path: Path) -> IO[bytes]:
    """`path` open for reading (a file of ours, not a symlink), or ConfigError naming it and why."""
    try:
        return read_own(path)
    except OSError as exc:
        raise ConfigError(f"bundle file {path}: cannot read it ({exc.strerror or exc}); a bundle is read only from "
                          "files of this user, never through a symlink") from None


def _load_torch(path: Path, stem: str | os.PathLike[str], part: str, meta: dict[str, Any]) -> Any:
    """Bundle file `path`, checked against the digest `meta` recorded for `part` (a meta from before
    digests has none)."""
    with _reading(path) as f:
        expected = meta.get("digests", {}).get(part)
        if expected is not None:
            if hashlib.file_digest(f, _new_digest).hexdigest() != expected:
                raise ConfigError(
                    f"bundle file {path} is not the one {paths(stem)[1].name} was written with: a save over this "
                    "bundle stopped between its files, or the file was replaced; resume from another bundle (a "
                    "ckpt-r* in the checkpoint directory) or from a fresh start"
                )
            f.seek(0)
        return torch.load(f, map_location="cpu", weights_only=True)
