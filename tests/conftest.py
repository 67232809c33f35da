"""Shared by every test: a run a test starts logs into that test's temp dir, not `runs/` of the checkout."""

from __future__ import annotations

import os

import pytest


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
