"""How a controller trusts the hosts that dial its join port, and the checks that keep open admission safe.

Trust modes (`TrustMode`):

- **Pre-shared key.** Every join frame is keyed with the run's session key
  from the first byte. A hello that fails its MAC is dropped without a reply,
  so a stranger learns nothing, not even that a controller listens.
- **Open admission.** Pre-admission frames (hello, accept, reject) are keyed
  with the well-known all-zero key, so the MAC proves nothing; the accept
  delivers the session key, which keys everything after it. It therefore
  needs CURVE (refused without it): the agents pin the controller's public
  key, so only the controller can answer a hello, and the accept with its
  session key travels encrypted. Anyone who can reach the port can join, so
  open admission is refused unless the join endpoint is bound to a loopback
  or private address, and it always logs a warning.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import socket

from flodl_zmq.endpoints import is_private_address, tcp_host
from flodl_zmq.errors import ConfigError
from flodl_zmq.security import CurveKeys
from flodl_zmq.wire import KEY_BYTES, RUN_ID_BYTES

log = logging.getLogger(__name__)

# Pre-admission frames are keyed with this key under open admission, and carry this run id under
# every mode: a joiner knows neither the session key (open admission) nor the run yet.
OPEN_JOIN_KEY = bytes(KEY_BYTES)
JOIN_RUN_ID = bytes(RUN_ID_BYTES)


class TrustMode(str, enum.Enum):
    PRE_SHARED = "pre-shared"
    OPEN = "open"


def join_key(mode: TrustMode, session_key: bytes) -> bytes:
    """The key of pre-admission frames: the session key, or all zeros under open admission."""
    return OPEN_JOIN_KEY if mode is TrustMode.OPEN else session_key


def check_open_admission_bind(address: str) -> None:
    """Raise ConfigError unless `address` (an IP literal) is a loopback or private address.

    A wildcard bind (0.0.0.0, ::) is refused too: it listens on every
    interface, public ones included.
    """
    if not is_private_address(address):
        raise ConfigError(
            f"open admission refused on {address}: anyone who reaches that address could join the "
            "run and poison training; bind the controller to a loopback or private address, or "
            "give every host the same pre-shared key (FLODL_KEY, `flodl-zmq keygen`)"
        )


def check_open_admission_curve(curve: CurveKeys | None) -> None:
    """Raise ConfigError when open admission would run without CURVE.

    Before admission the MAC key is all zeros: without CURVE nothing tells an
    agent the real controller from anyone who answers its hello (and would
    then choose what it runs), and the session key would cross the network in
    the clear.
    """
    if curve is None:
        raise ConfigError(
            "open admission without CURVE refused: the agents could not tell this controller from an "
            "impostor, and the session key would travel in the clear; give the controller a CURVE secret "
            "(`flodl-zmq curve-keygen DIR`, then --curve-secret DIR/controller.key_secret or "
            "FLODL_CURVE_SECRET) and every agent its public key (FLODL_CURVE_SERVER), or use a pre-shared "
            "FLODL_KEY instead of --open-admission"
        )


def resolve_trust(open_admission: bool, bind_address: str) -> TrustMode:
    """The trust mode for a controller bound to `bind_address` (an IP literal)."""
    if not open_admission:
        return TrustMode.PRE_SHARED
    check_open_admission_bind(bind_address)
    log.warning(
        "open admission on %s: any host that can reach this address may join and receives the "
        "session key; use a pre-shared key (FLODL_KEY) on shared networks",
        bind_address,
    )
    return TrustMode.OPEN


def endpoint_ip(endpoint: str) -> str:
    """The IP address a `tcp://host:port` endpoint binds (hostnames resolved)."""
    host = tcp_host(endpoint)
    if host is None:
        raise ConfigError(f"open admission needs a tcp:// join endpoint, got {endpoint!r}")
    if host in ("*", ""):
        return "0.0.0.0"
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None)[0][4][0]
    except OSError as exc:
        raise ConfigError(f"cannot resolve the join endpoint host {host!r}: {exc}") from None
