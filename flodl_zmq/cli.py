"""The `flodl-zmq` command line."""

from __future__ import annotations

import argparse
import sys

from flodl_zmq.errors import FlodlError, RunComplete
from flodl_zmq.wire import new_key


def _keygen(_: argparse.Namespace) -> int:
    print(new_key().hex())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flodl-zmq", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    keygen = sub.add_parser("keygen", help="print a fresh 32-byte session key as hex (for FLODL_KEY)")
    keygen.set_defaults(func=_keygen)
    from flodl_zmq.agent_cli import add_command as add_agent_command
    from flodl_zmq.controller import add_commands as add_controller_commands
    from flodl_zmq.launch import add_commands as add_launch_commands
    from flodl_zmq.remote import add_command as add_run_command
    from flodl_zmq.runreport import add_command as add_report_command
    from flodl_zmq.security import add_commands as add_security_commands

    add_launch_commands(sub)
    add_run_command(sub)
    add_controller_commands(sub)
    add_agent_command(sub)
    add_security_commands(sub)
    add_report_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        # A bad flag or FLODL_* variable is a ConfigError from flodl_zmq/settings.py: exit status 2.
        args = build_parser().parse_args(argv)
        return args.func(args)
    except RunComplete as done:
        # What an orchestrator restarts after the end (a Job's pod, `docker compose up` again) must
        # find the run finished, not train it again: a success, said.
        print(f"flodl-zmq: {done}", file=sys.stderr)
        return 0
    except FlodlError as exc:
        print(f"flodl-zmq: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
