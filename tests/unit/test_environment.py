"""The FLODL_* environment contract (flodl_zmq.environment)."""

from __future__ import annotations

import os

import pytest

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv, parse_world
from flodl_zmq.errors import ConfigError
from flodl_zmq.wire import new_key


def rank_env() -> ProcessEnv:
    return ProcessEnv(
        role="rank", controller=ControllerAddress("127.0.0.1", 7300), key=new_key(), run_id=os.urandom(16),
        world={"h0": (0, 1), "h1": (2, 3)}, host="h1", rank=3, local_rank=1, slowdown=3.0,
    )


def test_to_environ_and_back_is_the_same_process_env():
    env = rank_env()
    assert ProcessEnv.from_environ(env.to_environ()) == env
    assert env.world_size == 4


def test_no_role_means_a_single_process_run():
    assert ProcessEnv.from_environ({}) is None


def test_a_missing_variable_is_named():
    environ = rank_env().to_environ()
    del environ["FLODL_KEY"]
    with pytest.raises(ConfigError, match="FLODL_KEY"):
        ProcessEnv.from_environ(environ)


def test_a_rank_outside_its_host_is_refused():
    environ = rank_env().to_environ()
    environ["FLODL_RANK"] = "0"
    with pytest.raises(ConfigError, match="not one of host h1"):
        ProcessEnv.from_environ(environ)


@pytest.mark.parametrize("text", ["", "h0=0,1;h1=1,2", "h0=1", "h0=0;h1=", "=0"])
def test_a_world_must_number_ranks_once_from_zero(text):
    with pytest.raises(ConfigError):
        parse_world(text)
