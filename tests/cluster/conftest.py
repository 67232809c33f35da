"""Every test here runs real processes and takes seconds to minutes: marked `cluster`.

`pytest -m "not cluster"` runs the fast layers alone (unit, transport, security).
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(pytest.mark.cluster)
