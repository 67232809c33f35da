"""Save and resume bundles: the consensus model plus what the coordinator needs to continue.

A bundle with stem `runs/digits` is two files:

    runs/digits.pt         the consensus `state_dict` (torch.save, loadable with torch.load)
    runs/digits.meta.json  {"format": 1, "epoch", "global_step", "reason", "world_size",
                            "coordinator": {...}}  (ElChe state, coverage, counters)

Rules this module keeps: a write is temp file + atomic rename, model first,
meta last, so a meta on disk always names a complete model; a bundle is read
back with a loud error naming the missing file or the format it does not know.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from flodl_zmq.errors import ConfigError

FORMAT = 1


def paths(stem: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(model path, meta path) of bundle `stem`."""
    s = str(stem)
    return Path(s + ".pt"), Path(s + ".meta.json")


def save(stem: str | os.PathLike[str], state_dict: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write the bundle atomically; returns the meta path."""
    model_path, meta_path = paths(stem)
    model_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = model_path.with_suffix(".pt.tmp")
    torch.save(state_dict, tmp)
    os.replace(tmp, model_path)
    tmp_meta = meta_path.with_suffix(".json.tmp")
    tmp_meta.write_text(json.dumps({"format": FORMAT, **meta}, indent=2, sort_keys=True))
    os.replace(tmp_meta, meta_path)
    return meta_path


def load(stem: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, meta) of bundle `stem`."""
    model_path, meta_path = paths(stem)
    for p in (model_path, meta_path):
        if not p.exists():
            raise ConfigError(f"resume_from={str(stem)!r}: {p} does not exist (a bundle is {model_path.name} + {meta_path.name})")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{meta_path}: bundle format {meta.get('format')!r} is not {FORMAT}; written by another version")
    return torch.load(model_path, map_location="cpu", weights_only=True), meta
