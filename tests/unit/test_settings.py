"""The one settings table (flodl_zmq.settings): flags, variables, children, and the doc that lists them."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from flodl_zmq.api import Trainer
from flodl_zmq.errors import ConfigError
from flodl_zmq.settings import SCOPES, SETTINGS, Settings, add_arguments, env_names

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"


def parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p, command)
    return p


def doc_rows() -> dict[str, tuple[str, str, str]]:
    """The `### Every setting` table of docs/operations.md: field -> (flags, variables, default)."""
    text = OPERATIONS.read_text()
    section = text.split("### Every setting", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = tuple(cells[1:4])
    return rows


def names(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def test_every_field_of_the_object_is_a_row_whose_default_it_holds():
    assert len({s.field for s in SETTINGS}) == len(SETTINGS) == len(dataclasses.fields(Settings))
    for s in SETTINGS:
        assert getattr(Settings(), s.field) == s.default, s.field


def test_the_operations_doc_lists_every_setting_and_nothing_else():
    rows = doc_rows()
    assert sorted(rows) == sorted(s.field for s in SETTINGS), "docs/operations.md and settings.SETTINGS disagree"
    for s in SETTINGS:
        flags, env, default = rows[s.field]
        assert names(flags) == s.flags, s.field
        assert names(env) == s.env, s.field
        assert default == s.shown_default, s.field


def test_every_variable_and_flag_names_one_setting_per_command():
    env = [e for s in SETTINGS for e in s.env]
    assert len(env) == len(set(env))
    for command in ("controller", "agent", "status"):
        flags = [f for s in SETTINGS if command in s.commands for f in s.flags]
        assert len(flags) == len(set(flags)), command


def test_a_flag_wins_over_its_variable_and_an_unset_flag_leaves_the_variable():
    environ = {"FLODL_MIN_RANKS": "3", "FLODL_JOIN_WINDOW": "40"}
    args = parser("controller").parse_args(["--min-ranks", "4"])
    s = Settings.from_args(args, environ)
    assert s.min_ranks == 4 and s.join_window_s == 40.0 and s.effective_join_cap_s == 80.0


def test_heartbeat_timeout_keeps_meaning_what_it_meant_for_each_command():
    controller = Settings.from_args(parser("controller").parse_args(["--heartbeat-timeout", "3"]), {})
    agent = Settings.from_args(parser("agent").parse_args(["--heartbeat-timeout", "4"]), {})
    assert controller.host_silence_at_controller_s == 3.0
    assert agent.controller_silence_at_agent_s == 4.0
    assert Settings.from_environ({"FLODL_HEARTBEAT_TIMEOUT": "5"}).host_silence_at_controller_s == 5.0


def test_two_spellings_of_one_setting_that_disagree_are_refused():
    with pytest.raises(ConfigError, match="FLODL_HOST_SILENCE.*FLODL_HEARTBEAT_TIMEOUT.*disagree"):
        Settings.from_environ({"FLODL_HOST_SILENCE": "4", "FLODL_HEARTBEAT_TIMEOUT": "5"})


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({"FLODL_MIN_RANKS": "two"}, "FLODL_MIN_RANKS='two'.*whole number"),
        ({"FLODL_SLOWDOWN": "0.5"}, "slowdown = 0.5.*>= 1.*FLODL_SLOWDOWN"),
        ({"FLODL_STARTUP_TIMEOUT": "0"}, "startup_timeout_s = 0.0.*> 0.*--startup-timeout"),
        ({"FLODL_OPEN_ADMISSION": "maybe"}, "FLODL_OPEN_ADMISSION='maybe'"),
        ({"FLODL_RANK_SILENCE_AT_RELAY": "0.4"}, "rank_silence_at_relay_s.*must exceed rank_heartbeat_period_s"),
        ({"FLODL_JOIN_HEARTBEAT_PERIOD": "20"}, "host_silence_at_controller_s.*must exceed join_heartbeat_period_s"),
        ({"FLODL_METRICS_PORT": "99999"}, "metrics_port = 99999 is not allowed: it must be an integer >= 1 and <= 65535.*FLODL_METRICS_PORT"),
    ],
)
def test_a_bad_value_names_the_setting_the_value_and_the_fix(environ, match):
    with pytest.raises(ConfigError, match=match):
        Settings.from_environ(environ)


@pytest.mark.parametrize("name", env_names(SCOPES))
@pytest.mark.parametrize("blank", ["", "  "])
def test_a_variable_set_but_empty_is_refused_by_name_with_its_default(name, blank):
    # `FLODL_STARTUP_TIMEOUT=` silently ran with the default: a value forgotten in a unit file or a
    # compose file looked like one given.
    row = next(s for s in SETTINGS if name in s.env)
    with pytest.raises(ConfigError, match=rf"{name} is set but empty: give it a value .* or unset it "
                                          rf"\(`unset {name}`\) for the default \({re.escape(row.shown_default)}\)"):
        Settings.from_environ({name: blank})


def test_a_bad_flag_is_refused_by_the_parser():
    with pytest.raises(argparse.ArgumentError, match="--min-ranks='x'"):
        parser("controller").parse_args(["--min-ranks", "x"])


def test_what_a_child_reads_round_trips_and_a_commands_own_settings_stay_home():
    s = Settings(rank_heartbeat_period_s=0.2, slowdown=2.0, bind="10.0.0.5:7300", startup_timeout_s=7.5)
    env = s.to_environ(("run", "process"))
    assert "FLODL_BIND" not in env
    back = Settings.from_environ(env, ("run", "process"))
    assert back == Settings(rank_heartbeat_period_s=0.2, slowdown=2.0, startup_timeout_s=7.5)
    assert "FLODL_SLOWDOWN" not in s.to_environ(("run",))  # a host's slowdown is its own


def test_an_unknown_trainer_keyword_is_named_with_its_close_matches():
    with pytest.raises(TypeError, match=r"'epoch' \(did you mean 'epochs'"):
        Trainer(model=lambda: torch.nn.Linear(4, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                train_step=lambda m, b: m(b).sum(), dataset=torch.zeros(8, 4), batch_size=2, epoch=3)


def test_the_job_takes_its_shared_definitions_from_settings_not_from_the_coordinator():
    # The job is what the user's script defines; the scheduler's policy types it shares live below both.
    # It builds the coordinator's configuration (`coordinator_config`), so that one module it may import.
    tree = ast.parse((ROOT / "flodl_zmq" / "job.py").read_text())
    names = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module for a in n.names}
    assert {m for m, _ in names if m.startswith("flodl_zmq.coordinator")} <= {"flodl_zmq.coordinator.config"}
    assert ("flodl_zmq.settings", "MaxFailure") in names


def test_a_child_of_an_agent_runs_with_the_controllers_timings_and_its_hosts_slowdown(monkeypatch):
    import os

    from flodl_zmq.agent import Agent
    from flodl_zmq.agent_rules import AgentConfig, Joined
    from flodl_zmq.endpoints import ControllerAddress
    from flodl_zmq.environment import ProcessEnv, SpawnSpec
    from flodl_zmq.wire import new_key

    monkeypatch.setenv("FLODL_SLOWDOWN", "2")  # this host's own
    monkeypatch.setenv("FLODL_RANK_SILENCE_AT_RELAY", "9")  # overruled: the run's timings are the controller's
    controller = Settings(rank_silence_at_relay_s=3.0, rank_heartbeat_period_s=0.25)
    spawn = SpawnSpec(("train.py",), env=controller.to_environ(("run",)), world={"h0": (0, 1)})
    agent = Agent(AgentConfig(ControllerAddress("127.0.0.1", 7300), "h0", ("cpu:0", "cpu:1"), key=new_key()))
    try:
        joined = Joined(ranks=(0, 1), session_key=new_key(), run_id=os.urandom(16), incarnation=os.urandom(16),
                        world_size=2, spawn=spawn, host_token=os.urandom(32), route_secret=b"")
        penv = ProcessEnv.from_environ(agent.child_environ(joined, "rank", 1, 1))
        relay = ProcessEnv.from_environ(agent.child_environ(joined, "relay", None, None))
    finally:
        agent.close()
    assert penv is not None and penv.rank == 1
    assert penv.settings.rank_silence_at_relay_s == 3.0 and penv.settings.rank_heartbeat_period_s == 0.25
    assert penv.slowdown == 2.0
    # The host's token goes to its relay alone: a rank never needs it (PROTOCOL.md 10.5 item 3).
    assert relay is not None and relay.host_token == joined.host_token and penv.host_token is None
