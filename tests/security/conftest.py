"""Helpers for the attack tests: a ZeroMQ context, and this process's memory as the kernel counts it."""

from __future__ import annotations

import gc

import pytest
import zmq


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakRss:
    """The growth of this process's peak resident set since `reset` (Linux clear_refs)."""

    def reset(self) -> None:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        self.base_kib = _status_kib("VmRSS")

    def growth_mb(self) -> float:
        return (_status_kib("VmHWM") - self.base_kib) / 1024


@pytest.fixture
def peak_rss() -> PeakRss:
    try:
        p = PeakRss()
        p.reset()
    except OSError as exc:
        pytest.skip(f"needs /proc/self/clear_refs: {exc}")
    return p


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)
