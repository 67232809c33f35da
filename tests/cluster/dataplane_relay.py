"""A relay process for the data-plane process tests (the product runs relays through `Trainer.run()`).

Starts one host's `Relay` exactly as `flodl_zmq.relay.run_relay` does, but from
flags instead of the FLODL_* role contract, with local endpoints the test
chooses; prints `relay HOST ready`, runs until SIGTERM/SIGINT (exit 0) or a
fatal error (exit 1). Key from FLODL_KEY.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.wire import key_from_hex
from flodl_zmq.wire_format import named


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", required=True)
    p.add_argument("--ranks", required=True, help="comma-separated global ranks, e.g. 0,1")
    p.add_argument("--controller", required=True, help="HOST:PORT")
    p.add_argument("--run-id", required=True, help="32 hex characters")
    p.add_argument("--local-control", required=True)
    p.add_argument("--local-data", required=True)
    p.add_argument("--wire-dtype", default="f32", help="the run's wire format (FLODL_WIRE_DTYPE in the product)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"[{args.host}:relay] %(levelname)s %(message)s")
    cfg = RelayConfig.for_controller(
        args.host, [int(r) for r in args.ranks.split(",")], key_from_hex(os.environ["FLODL_KEY"]),
        bytes.fromhex(args.run_id), ControllerAddress.parse(args.controller), (args.local_control, args.local_data),
        wire=named(args.wire_dtype), host_token=bytes.fromhex(os.environ["FLODL_HOST_TOKEN"]),
    )
    relay = Relay(cfg)
    relay.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: relay.stop(timeout=0))
    print(f"relay {cfg.host} ready", flush=True)
    while not relay.wait(0.5):
        pass
    relay.stop()
    return 1 if relay.error else 0


if __name__ == "__main__":
    sys.exit(main())
