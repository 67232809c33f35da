"""Shared by every test: a run a test starts logs into that test's temp dir, not `runs/` of the checkout; under
pytest-xdist each worker's runs listen on ports of their own."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from flodl_zmq import launch


@pytest.fixture(autouse=True, scope="session")
def _ports_of_this_worker() -> Iterator[None]:
    """Each xdist worker draws its runs' ports (`launch.free_port_base`) from a slice of the range of its own.

    A port is probed free, then bound seconds later by a process the run starts (a relay binds its shard's
    ports once the world has formed); meanwhile another worker's run could draw and bind the same one. Seen
    under load: a host shard's PUB "Address already in use", and another run's broadcasts at its SUB.
    """
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        yield
        return
    index, workers = int(worker[2:]), int(count)
    whole = launch._listening_port_range

    def own_slice(span: int) -> range:
        bases = whole(span)
        size = len(bases) // workers
        return bases[index * size:(index + 1) * size - span]  # no run of this worker reaches the next slice

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "_listening_port_range", own_slice)
        yield


@pytest.fixture(autouse=True)
def _run_dir_in_tmp(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    # FLODL_RUN_DIR is read by a run alone and by every controller a test launches
    # (flodl_zmq/runlog.py); a test that cares about the place sets its own.
    monkeypatch.setenv("FLODL_RUN_DIR", str(tmp_path_factory.mktemp("run")))


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No FLODL_* role or setting in the environment (a process alone), and run directories under tmp_path."""
    for name in list(os.environ):
        if name.startswith("FLODL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
