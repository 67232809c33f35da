"""`flodl-zmq agent`: the command line of a worker host's agent (flodl_zmq/agent.py)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from flodl_zmq.agent import Agent, run_nvidia_smi
from flodl_zmq.agent_rules import AgentConfig, parse_script, resolve_devices
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.errors import ConfigError
from flodl_zmq.security import CurveKeys
from flodl_zmq.settings import Settings, add_arguments
from flodl_zmq.warm import check_target
from flodl_zmq.wire import session_key


def add_command(sub: Any) -> None:
    """Register `flodl-zmq agent` on the sub-command parser."""
    p = sub.add_parser(
        "agent",
        help="join a controller's run as a worker host and run its ranks",
        description=(
            "Dial the controller's join endpoint (PORT+3), join its run, then start this host's relay and one "
            "rank per device running the controller's program, which must be the one given here by --script "
            "(or FLODL_SCRIPT): SCRIPT or -m MODULE. The session key comes from FLODL_KEY (64 hex "
            "characters, the controller's); without it the agent asks for open admission, which needs the "
            "controller's CURVE public key (FLODL_CURVE_SERVER or --curve-server) to authenticate it. With "
            "that key every link of this host is encrypted. Exit status: 0 when "
            "the host did its part (even if a rank failed), 1 when the host was torn down, 2 when the join was "
            "refused or failed."
        ),
    )
    add_arguments(p, "agent")  # flags and their variables: flodl_zmq/settings.py
    p.set_defaults(func=_agent_command)


def _agent_command(args: Any) -> int:
    settings = Settings.from_args(args)
    if not settings.controller or not settings.script:  # without a program it could run nothing it is sent
        raise ConfigError("the agent needs the controller's address, --controller HOST:PORT (FLODL_CONTROLLER), and "
                          "the program it agrees to run, --script SCRIPT or '-m MODULE' (FLODL_SCRIPT)")
    host = settings.agent_host or socket.gethostname()
    logging.basicConfig(level=logging.INFO, format=f"[{host}:agent] %(levelname)s %(message)s")
    try:
        sig = bytes.fromhex(settings.dataset_sig) if settings.dataset_sig else bytes(32)
    except ValueError:
        raise ConfigError("--dataset-sig must be 64 hex characters") from None
    devices = settings.devices
    explicit = [d.strip() for d in devices.split(",") if d.strip()] if devices else None
    controller = ControllerAddress.parse(settings.controller)
    controller.check_resolves("--controller HOST:PORT (FLODL_CONTROLLER)")
    config = AgentConfig(
        controller=controller, host=host,
        devices=resolve_devices(explicit, settings.cpu_slots, os.environ, None if explicit else run_nvidia_smi()),
        key=session_key(os.environ),
        dataset_sig=sig, join_reply_timeout_s=settings.join_reply_timeout_s,
        join_heartbeat_period_s=settings.join_heartbeat_period_s,
        controller_silence_at_agent_s=settings.controller_silence_at_agent_s,
        controller_grace_s=settings.controller_grace_s,
        curve=CurveKeys.for_client(os.environ, settings.curve_secret_file, settings.curve_server_file),
        script=tuple(check_target(parse_script(settings.script), "agent")),
    )
    agent = Agent(config)
    try:
        return agent.run()
    finally:
        agent.close()
