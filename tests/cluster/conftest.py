"""Every test here runs real processes and takes seconds to minutes: marked `cluster`.

`pytest -m "not cluster"` runs the fast layers alone (unit, transport, security).

Under pytest-xdist (`scripts/test.sh` runs three workers, `--dist loadgroup`) the tests of
one module that use the network namespaces (its `net` fixture: hosts named `controller`,
`worker1`, ... on one bridge) run one after another on one worker: two such fixtures alive in
one process would fight over those names (a worker's namespaces carry its pid, so two workers
never do). Every other test, and another module's namespaces, may run beside them.

The runs a test starts with `flodl_zmq.launch.Cluster` fork their controller and ranks from
one warm interpreter per worker (the `warm` fixture): torch is imported once per worker, not
once per run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl_zmq.launch import warm_interpreter
from flodl_zmq.warm import WarmServer

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)
            if "net" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(f"netns-{Path(item.fspath).stem}"))


@pytest.fixture(scope="session")
def warm() -> Iterator[WarmServer]:
    server = warm_interpreter()
    yield server
    server.close()
