"""Every socket address derives from the one controller address the user gives.

Rule (PROTOCOL.md, Endpoints): for `host:port`, the controller binds

    control   tcp://host:port       ROUTER  relays' control DEALERs
    data      tcp://host:port+1     ROUTER  relays' data DEALERs
    broadcast tcp://host:port+2     PUB     relays' SUBs
    join      tcp://host:port+3     ROUTER  agents' DEALERs

One address to type, one firewall range to open, and control and data on
separate TCP connections so a model frame never delays a heartbeat.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

from flodl_zmq.errors import ConfigError
from flodl_zmq.wire.records import Channel

OFFSETS = {Channel.CONTROL: 0, Channel.DATA: 1, Channel.BROADCAST: 2, Channel.JOIN: 3}


@dataclass(frozen=True)
class ControllerAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> ControllerAddress:
        """Parse `host:port` (IPv6 literals in brackets: `[::1]:7300`)."""
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host:
            raise ConfigError(f"controller address {text!r} must be HOST:PORT, e.g. 10.0.0.5:7300")
        try:
            number = int(port)
        except ValueError:
            raise ConfigError(f"controller address {text!r}: port {port!r} is not a number") from None
        return cls(host.strip("[]"), number)

    def __post_init__(self) -> None:
        # Every address is checked, parsed or built (launch's --port): a bad port is named at start.
        if not 1 <= self.port <= 65535 - max(OFFSETS.values()):
            raise ConfigError(
                f"controller address {self}: port must be in 1..{65535 - max(OFFSETS.values())} "
                f"(the controller also uses the next {max(OFFSETS.values())} ports)"
            )

    def endpoint(self, channel: Channel) -> str:
        """The tcp:// endpoint of `channel` (for connect; the controller binds the same)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port + OFFSETS[channel]}"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def check_resolves(self, setting: str) -> None:
        """A ConfigError when the controller's host name does not exist: ZeroMQ would retry it in silence, and
        the dialer learn only after its reply timeout that nothing answered, among every other cause. A name
        the resolver cannot look up now (EAI_AGAIN) is left to those retries."""
        try:
            socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_AGAIN:
                return
            raise ConfigError(f"controller {self}: the host name {self.host!r} does not resolve here ({exc.strerror}); "
                              f"fix the name in {setting}, or give the controller's IP address") from None

    def ports(self, extra: int = 0) -> range:
        """The ports the controller binds, PORT..PORT+3, and `extra` after them (launch's host shards)."""
        return range(self.port, self.port + max(OFFSETS.values()) + 1 + extra)

    def check_free(self, setting: str = "--bind HOST:PORT", extra: int = 0) -> None:
        """A ConfigError naming the first of `ports(extra)` that cannot be bound here, before any is: the
        data ports are bound only once the world forms, where a clash would end a run its hosts joined.
        `setting`: where the user gave PORT."""
        bind_host = "" if self.host == "*" else self.host
        ports = self.ports(extra)
        for port in ports:
            with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
                try:
                    probe.bind((bind_host, port))
                except OSError as exc:
                    raise bind_error(
                        exc, what=f"controller port {port} on {self.host}", host=self.host, port_setting=setting,
                        in_use=f" (another controller?); the controller uses PORT..PORT+{len(ports) - 1} of "
                        f"{setting}: choose another PORT, or stop what holds it") from exc

    def check_apart(self, metrics_port: int | None, extra: int = 0) -> None:
        """A ConfigError when the metrics port is one of `ports(extra)`, before either is bound: the second
        bind would fail as a port in use, and send the user looking for a process that does not exist."""
        ports = self.ports(extra)
        if metrics_port in ports:
            raise ConfigError(
                f"metrics port {metrics_port} (--metrics-port / FLODL_METRICS_PORT) is one of the controller's "
                f"own ports: the controller at {self} binds {ports[0]}..{ports[-1]}; choose a metrics port outside "
                "them, or another PORT for the controller")


def bind_error(exc: Exception, *, what: str, host: str, port_setting: str, in_use: str) -> ConfigError:
    """The ConfigError for a failed bind of `what` ("controller port 7300 on HOST"), worded by its cause.

    One rule for every port a user names. Only EADDRINUSE is a port another process holds: an unknown
    host name, an address of another machine and a privileged port were all reported as one, and sent
    users looking for a process that did not exist. `exc`: what the bind raised (an OSError, or a
    ZMQError: both carry errno); `port_setting`: the setting that names the port; `in_use`: what
    follows the cause when the port is held.
    """
    reason = getattr(exc, "strerror", None) or str(exc)
    code = getattr(exc, "errno", None)
    if isinstance(exc, socket.gaierror):
        return ConfigError(f"{what}: the host name {host!r} does not resolve here ({reason}); fix the name in "
                           "--bind HOST:PORT, or give an IP address of this machine")
    if code == errno.EADDRNOTAVAIL:
        return ConfigError(f"{what}: {host} is not an address of this machine ({reason}); bind one of its own "
                           "addresses (`ip -brief address` lists them), or 0.0.0.0 or * for every interface")
    if code == errno.EADDRINUSE:
        return ConfigError(f"{what}: {reason}{in_use}")
    if code == errno.EACCES:
        return ConfigError(f"{what}: {reason}: a port below 1024 needs root (or CAP_NET_BIND_SERVICE); give "
                           f"{port_setting} a port of 1024 or above")
    return ConfigError(f"{what}: {reason}; check {port_setting}")


# RFC 6598 shared space: carrier NAT, and the addresses of Tailscale-style overlays.
_SHARED = ipaddress.ip_network("100.64.0.0/10")


def is_private_address(address: str) -> bool:
    """True for a loopback, private, link-local or shared-space IP literal.

    Not for a wildcard (it listens on public interfaces too) nor a host name.
    An IPv4-mapped IPv6 address is judged by the IPv4 address inside.
    """
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_unspecified:
        return False
    return ip.is_loopback or ip.is_private or ip.is_link_local or ip in _SHARED


def tcp_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` endpoint (an IPv6 literal without its brackets); None for another transport."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for a tcp:// endpoint on a loopback address: a socket bound there has peers on this machine only."""
    host = tcp_host(endpoint)
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
