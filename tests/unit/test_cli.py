"""The `flodl-zmq` command line as a user types it: a value it cannot use is named, with the fix."""

from __future__ import annotations

import re

import pytest

from flodl_zmq import cli
from flodl_zmq.launch import free_port_base


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


@pytest.mark.parametrize(("bind", "metrics", "named"), [
    ("nosuchhost.invalid:{port}", None, r"the host name 'nosuchhost\.invalid' does not resolve here"),
    ("192.0.2.1:{port}", None, r"192\.0\.2\.1 is not an address of this machine"),
    ("127.0.0.1:{port}", 1, r"metrics port {metrics} \(--metrics-port / FLODL_METRICS_PORT\) is one of the "
                            r"controller's own ports: the controller at 127\.0\.0\.1:{port} binds {port}\.\.{last}"),
], ids=["unknown-host-name", "another-machines-address", "metrics-port-among-the-controllers"])
def test_controller_names_a_bind_it_cannot_have_by_its_cause_with_exit_status_2(
        bind, metrics, named, tmp_path, capsys, monkeypatch):
    # A user trial met all three as "(another controller?) ... choose another PORT, or stop what holds it".
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setenv("FLODL_KEY", "00" * 32)
    monkeypatch.setattr("flodl_zmq.controller.restart_with_service_tunables", lambda: None)  # it would exec pytest
    port = free_port_base()
    args = ["controller", "--bind", bind.format(port=port), "--join-window", "0.5", "--join-cap", "0.5"]
    if metrics is not None:
        args += ["--metrics-port", str(port + metrics)]
    assert cli.main([*args, "--", "train.py"]) == 2
    err = capsys.readouterr().err
    assert re.search("flodl-zmq: error: .*" + named.format(port=port, metrics=port + (metrics or 0), last=port + 3), err)
    assert "(another controller?)" not in err and "stop what holds it" not in err


def test_a_run_directory_the_run_would_refuse_is_refused_before_any_host_joins(tmp_path, capsys, monkeypatch):
    # It was refused only once the world formed, every agent torn down: the checkpoint directory's rule.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("FLODL_KEY", "00" * 32)
    monkeypatch.setattr("flodl_zmq.controller.restart_with_service_tunables", lambda: None)  # it would exec pytest
    args = ["controller", "--bind", f"127.0.0.1:{free_port_base()}", "--run-dir", "afile", "--join-window", "0.5", "--join-cap", "0.5"]
    assert cli.main([*args, "--", "train.py"]) == 2
    assert "run directory (--run-dir, Trainer(run_dir=...)) afile is not a directory" in capsys.readouterr().err
