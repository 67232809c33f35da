"""Every test here runs real processes and takes seconds to minutes: marked `cluster`.

`pytest -m "not cluster"` runs the fast layers alone (unit, transport, security).

Under pytest-xdist (`scripts/test.sh` runs two workers, `--dist loadgroup`) the tests that
use the network namespaces (the `net` fixture: hosts named `controller`, `worker1`, ... on
one bridge) run one after another on one worker, since two of them would fight over those
names; every other test may run beside them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)
            if "net" in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group("netns"))
