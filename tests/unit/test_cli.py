"""The `flodl-zmq` command line as a user types it: a value it cannot use is named, with the fix."""

from __future__ import annotations

import pytest

from flodl_zmq import cli


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf"])
def test_status_watch_refuses_an_interval_that_never_redraws_naming_it(interval, capsys, monkeypatch):
    # inf passed the check (the watch could never redraw); 0, -1 and nan were refused as if --json had
    # been given, a flag the user never typed.
    monkeypatch.setenv("FLODL_KEY", "00" * 32)
    args = ["status", "--controller", "127.0.0.1:7300", "--timeout", "0.1", "--watch", "--interval", interval]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"--interval {float(interval)}: the seconds between two redraws, a finite number > 0" in err
    assert "--json" not in err
