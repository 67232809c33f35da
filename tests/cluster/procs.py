"""Processes as /proc shows them: whose child each one is, and whether it still runs (Linux)."""

from __future__ import annotations

import os
from pathlib import Path


def children(pid: int) -> list[int]:
    """The live and zombie processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry))
        except (OSError, ValueError):
            continue  # gone meanwhile
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its (dead) parent would reap it


def policies(pid: int) -> set[int]:
    """The scheduling policies (os.SCHED_*) of `pid`'s threads."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    return found
