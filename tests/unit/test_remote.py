"""`flodl-zmq run --hosts`: the host list, the remote command's quoting, and the key kept out of every argv."""

from __future__ import annotations

import io
import shlex
import signal
import subprocess
import sys
import threading

import pytest

from flodl_zmq import remote
from flodl_zmq.cli import build_parser
from flodl_zmq.environment import SigtermInterrupt
from flodl_zmq.errors import ConfigError
from flodl_zmq.remote import (
    AGENT_ARGV0,
    Fleet,
    RemoteHost,
    WholeLines,
    agent_argv,
    parse_hosts,
    read_hosts,
    remote_command,
    secrets_input,
    ssh_argv,
)
from flodl_zmq.wire import new_key

pytestmark = pytest.mark.timeout(60)


def test_a_host_file_and_a_comma_list_give_the_same_hosts_and_slots():
    text = "# my machines\ndesktop slots=2\n\nme@laptop   # no slots: the agent's default\n"
    want = (RemoteHost("desktop", 2), RemoteHost("me@laptop"))
    assert parse_hosts(text, from_file=True) == want
    assert parse_hosts("desktop:2, me@laptop", from_file=False) == want
    assert want[1].address == "laptop"


@pytest.mark.parametrize("text, from_file, match", [
    ("-oProxyCommand=touch /tmp/x", True, "is not `HOST`"),
    ("a,-oProxyCommand=x", False, "is not `HOST`"),
    ("a slots=0", True, "slots must be a whole number >= 1"),
    ("a 2", True, "slots must be"),
    ("a:x", False, "slots must be"),
    ("a,b,me@a", False, "names a twice"),
    ("# nothing\n", True, "names no host"),
])
def test_a_bad_host_list_is_refused_naming_the_line_and_the_fix(text, from_file, match):
    with pytest.raises(ConfigError, match=match):
        parse_hosts(text, from_file=from_file)


def test_hosts_name_a_file_when_one_is_there_and_a_missing_path_is_not_taken_for_a_host(tmp_path):
    (tmp_path / "hosts").write_text("desktop slots=2\n")
    assert read_hosts(str(tmp_path / "hosts")) == (RemoteHost("desktop", 2),)
    assert read_hosts("desktop:2") == (RemoteHost("desktop", 2),)
    with pytest.raises(ConfigError, match="no such host file"):
        read_hosts(str(tmp_path / "hots"))


def test_the_remote_shell_gets_back_every_word_of_the_agent_and_the_secrets_from_stdin(tmp_path):
    # What the remote login shell does with SSH's command string: `sh -c STRING`. An "agent" that
    # prints its environment's secrets and its words shows what the real agent would get.
    cwd = tmp_path / "a dir with 'quotes' and $HOME"
    cwd.mkdir()
    words = ["-m", "pkg.mod", "--name", "it's a \"test\"; rm -rf /", "$(id)", "`id`", "*"]
    agent = ["sh", "-c", 'pwd; printf "%s\\n" "$FLODL_KEY" "$FLODL_CURVE_SERVER" "$@"', "agent", *words]
    secrets = {"FLODL_KEY": new_key().hex(), "FLODL_CURVE_SERVER": "public-key"}
    command = remote_command(agent, str(cwd), list(secrets))
    done = subprocess.run(["sh", "-c", command], input=secrets_input(secrets), capture_output=True, timeout=30,
                          check=True)
    assert done.stdout.decode().splitlines() == [str(cwd), *secrets.values(), *words]
    assert not any(value in command for value in secrets.values())


def test_the_agent_is_pinned_to_the_controllers_whole_program_and_named_after_its_host():
    program = ["train.py", "--data", "my data"]
    argv = agent_argv(RemoteHost("me@desktop", 2), "10.0.0.5:7300", program, "/opt/py/bin/python")
    assert argv == ["/opt/py/bin/python", "-m", "flodl_zmq.cli", "agent", "--controller", "10.0.0.5:7300",
                    "--host", "desktop", "--script", "train.py --data 'my data'", "--cpu-slots", "2"]
    assert ssh_argv('ssh -o "BatchMode yes"', RemoteHost("me@desktop"), "CMD") == \
        ["ssh", "-o", "BatchMode yes", "me@desktop", "CMD"]


def test_the_key_reaches_each_host_on_stdin_never_in_an_argv_and_an_unreachable_host_is_named(tmp_path,
                                                                                                monkeypatch):
    # A stand-in for ssh: records its argv, its environment's key and its stdin; `down` fails as ssh does.
    fake = tmp_path / "ssh"
    fake.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$0.$1.argv"\nprintf "%s" "$FLODL_KEY" > "$0.$1.env"\n'
        'cat > "$0.$1.stdin"\n[ "$1" = down ] && { echo "ssh: Could not resolve hostname down" >&2; exit 255; }\n'
        "exit 0\n"
    )
    fake.chmod(0o755)
    key = new_key().hex()
    monkeypatch.setenv("FLODL_KEY", key)  # the controller's: no SSH command may inherit it
    lines: list[str] = []
    fleet = Fleet([RemoteHost("up"), RemoteHost("down")], shlex.quote(str(fake)), "10.0.0.5:7300",
                  ["-m", "flodl_zmq.demo"], {"FLODL_KEY": key}, lines.append)
    fleet.start()
    fleet.stop()
    assert {p.returncode for p in fleet.procs.values()} == {0, 255}
    for host in ("up", "down"):
        argv = (tmp_path / f"ssh.{host}.argv").read_text()
        assert "flodl_zmq.cli agent --controller 10.0.0.5:7300" in argv and AGENT_ARGV0 in argv
        assert key not in argv
        assert (tmp_path / f"ssh.{host}.env").read_text() == ""
        assert (tmp_path / f"ssh.{host}.stdin").read_text() == key + "\n"
    assert "[down] ssh: Could not resolve hostname down" in lines
    assert any(line.startswith("[run] host 'down' unreachable") for line in lines), lines
    assert "[run] host 'up': its agent finished" in lines
    assert sys.executable in (tmp_path / "ssh.up.argv").read_text()


def test_stop_ends_the_ssh_commands_that_outlive_the_run_and_reaps_them(tmp_path):
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    lines: list[str] = []
    fleet = Fleet([RemoteHost("a"), RemoteHost("b")], str(fake), "10.0.0.5:7300", ["x.py"], {"FLODL_KEY": "k"},
                  lines.append)
    fleet.start()
    fleet.stop(grace_s=0.0)
    assert {p.returncode for p in fleet.procs.values()} == {-15}  # SIGTERM, and reaped
    assert any(line.startswith("[run] host 'b': its agent exited -15") for line in lines), lines


def test_a_line_forwarded_while_the_program_prints_lands_beside_its_line_not_inside_it():
    # `print` writes a line, then its newline: a host's line forwarded between the two must not split it.
    out = io.StringIO()
    lines = WholeLines(out)
    lines.write('RESULT {"accuracy": 0.9}')  # the program's line, its newline not yet written
    forward = threading.Thread(target=print, args=("[worker1] a host's line",), kwargs={"file": lines})
    forward.start()
    forward.join(10)
    lines.write("\n")
    assert out.getvalue().splitlines() == ["[worker1] a host's line", 'RESULT {"accuracy": 0.9}']


@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt, 130), (SigtermInterrupt, 143)])
def test_a_run_stopped_before_its_join_window_exits_as_a_shell_says_for_its_signal(monkeypatch, stop, status):
    """SIGTERM before `serve` took over is 143, not Ctrl-C's 130: a supervisor reads the cause from it."""

    def stopped(_opts):
        raise stop

    monkeypatch.setattr(remote, "restart_with_service_tunables", lambda: None)
    monkeypatch.setattr(remote, "serve", stopped)
    monkeypatch.setattr(Fleet, "start", lambda self: None)
    monkeypatch.setattr(Fleet, "stop", lambda self: None)
    monkeypatch.setattr(sys, "stdout", sys.stdout)  # the command wraps it for the hosts' lines
    args = build_parser().parse_args(["run", "--hosts", "a,b", "--bind", "127.0.0.1:7300", "--", "x.py"])
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert args.func(args) == status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
