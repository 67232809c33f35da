"""ZeroMQ CURVE on inter-host links, and a warning for links that run without it.

What CURVE adds, and what it does not replace:

- CURVE encrypts each TCP connection (the controller is the CURVE server on
  every socket it binds; relays and agents are clients). Parameters, metrics
  and, under open admission, the run key then cross the network unreadable.
- The HMAC keeps authenticating every record, CURVE or not: encryption is per
  connection, the MAC is per record and binds run, channel and sequence, so a
  replayed or cross-run frame is still refused inside an encrypted stream.

Who may connect (the decision this module takes):

- The workers authenticate the controller: a client completes the CURVE
  handshake only with the holder of the secret key whose public key it was
  given (FLODL_CURVE_SERVER). That is what makes open admission safe to
  answer: a fake controller cannot speak to a pinned agent at all.
- The controller's `flodl-zmq controller` always runs a ZAP handler with CURVE
  (`CurveGate`): the join socket takes any client key (a host must be able to
  ask), every other socket only the keys of admitted agents and its own, so
  the model on the PUB is readable by admitted hosts only. Workers need
  nothing but the controller's public key; their own keypair is generated per
  process (the agent hands it to its relay).
- Optionally the controller takes a directory of client public certificates
  (`*.key`, zmq.auth format) and refuses any other key even on the join
  socket. That stops an unknown host before it can open a connection and make
  the codec spend work on junk, and revokes a host by deleting one file.

Key sources (checked when loaded, errors name the variable or file and the
fix): zmq.auth certificate files (`flodl-zmq curve-keygen` writes them), or
Z85 text in FLODL_CURVE_SECRET (this process's secret key), FLODL_CURVE_PUBLIC
(its public key, optional: derived from the secret, checked when given) and
FLODL_CURVE_SERVER (the controller's public key, on workers). A value given
both as a file and in the environment is refused rather than one silently
winning.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.z85 import Z85CHARS

from flodl_zmq.endpoints import is_private_address
from flodl_zmq.errors import ConfigError

SECRET_ENV = "FLODL_CURVE_SECRET"
PUBLIC_ENV = "FLODL_CURVE_PUBLIC"
SERVER_ENV = "FLODL_CURVE_SERVER"

_Z85_KEY = re.compile(b"[" + re.escape(Z85CHARS) + b"]{40}")
_KEYGEN_HINT = "generate a keypair with `flodl-zmq curve-keygen DIR`"


def _z85_key(text: str | bytes, source: str) -> bytes:
    """`text` as a 40-character Z85 CURVE key (bytes), or ConfigError naming `source`."""
    raw = (text.encode() if isinstance(text, str) else text).strip()
    if not _Z85_KEY.fullmatch(raw):
        raise ConfigError(
            f"{source}: not a CURVE key (expected 40 Z85 characters, got {len(raw)} characters); "
            f"copy the key from a zmq certificate file, or {_KEYGEN_HINT}"
        )
    return raw


def _read_certificate(path: str | os.PathLike[str], want_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a zmq.auth certificate file, validated; ConfigError naming the file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"CURVE certificate {path}: cannot read it ({exc}); {_KEYGEN_HINT}") from None
    if want_secret and secret is None:
        raise ConfigError(
            f"CURVE certificate {path} holds only a public key; this side needs its secret "
            f"certificate (the `.key_secret` file next to it)"
        )
    public = _z85_key(public, f"CURVE certificate {path} (public-key)")
    secret = _z85_key(secret, f"CURVE certificate {path} (secret-key)") if secret is not None else None
    return public, secret


def _pair(secret: bytes, public: bytes | None, source: str) -> tuple[bytes, bytes]:
    """(public, secret), the public key derived from the secret and checked against a given one."""
    derived = zmq.curve_public(secret)
    if public is not None and public != derived:
        raise ConfigError(
            f"{source}: the public key does not belong to the secret key; "
            f"take both from the same certificate, or drop {PUBLIC_ENV} (it is derived from the secret)"
        )
    return derived, secret


def _own_keys(env: Mapping[str, str], secret_file: str | os.PathLike[str] | None) -> tuple[bytes, bytes] | None:
    """This process's (public, secret) from a certificate file or the environment, or None."""
    in_env = SECRET_ENV in env or PUBLIC_ENV in env
    if secret_file is not None:
        if in_env:
            raise ConfigError(
                f"CURVE secret given twice: as the file {secret_file} and in {SECRET_ENV}/{PUBLIC_ENV}; "
                "keep one"
            )
        public, secret = _read_certificate(secret_file, want_secret=True)
        assert secret is not None  # _read_certificate refused a public-only file
        return _pair(secret, public, f"CURVE certificate {secret_file}")
    if not in_env:
        return None
    if SECRET_ENV not in env:
        raise ConfigError(f"{PUBLIC_ENV} is set but {SECRET_ENV} is not: set the secret key too")
    secret = _z85_key(env[SECRET_ENV], SECRET_ENV)
    public = _z85_key(env[PUBLIC_ENV], PUBLIC_ENV) if PUBLIC_ENV in env else None
    return _pair(secret, public, f"{SECRET_ENV}/{PUBLIC_ENV}")


class _AllowList:
    """ThreadAuthenticator credentials provider: admits exactly the listed client keys."""

    def __init__(self, keys: frozenset[bytes]):
        self._keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE keys of one process (Z85 bytes), loaded and checked.

    A controller's keys have no `server` (it is the server); a worker's have the
    controller's public key as `server`. `allowed_clients` is the controller's
    optional allow-list (None: any client key, the HMAC authenticates).
    """

    public: bytes
    secret: bytes
    server: bytes | None = None
    allowed_clients: frozenset[bytes] | None = None

    def __repr__(self) -> str:  # never print a secret key into a log
        return f"CurveKeys(public={self.public.decode()}, server={self.server and self.server.decode()})"

    @classmethod
    def for_server(
        cls,
        env: Mapping[str, str],
        secret_file: str | os.PathLike[str] | None = None,
        clients_dir: str | os.PathLike[str] | None = None,
    ) -> CurveKeys | None:
        """The controller's keys, or None when CURVE is not configured (cleartext)."""
        own = _own_keys(env, secret_file)
        if own is None:
            if SERVER_ENV in env or clients_dir is not None:
                raise ConfigError(
                    f"CURVE on the controller needs its own secret key ({SECRET_ENV} or a secret "
                    f"certificate file); {SERVER_ENV} is what the workers set; {_KEYGEN_HINT}"
                )
            return None
        allowed = _load_allow_list(clients_dir) if clients_dir is not None else None
        return cls(public=own[0], secret=own[1], allowed_clients=allowed)

    @classmethod
    def for_client(
        cls,
        env: Mapping[str, str],
        secret_file: str | os.PathLike[str] | None = None,
        server_file: str | os.PathLike[str] | None = None,
    ) -> CurveKeys | None:
        """A worker's keys, or None when CURVE is not configured (cleartext).

        Without a secret of its own the worker uses a fresh keypair: enough when
        the controller accepts any client key.
        """
        if server_file is not None and SERVER_ENV in env:
            raise ConfigError(f"controller key given twice: as the file {server_file} and in {SERVER_ENV}; keep one")
        if server_file is not None:
            server: bytes | None = _read_certificate(server_file, want_secret=False)[0]
        elif SERVER_ENV in env:
            server = _z85_key(env[SERVER_ENV], SERVER_ENV)
        else:
            server = None
        own = _own_keys(env, secret_file)
        if server is None:
            if own is not None:
                raise ConfigError(
                    f"a CURVE secret is set but not the controller's public key: set {SERVER_ENV} "
                    "(the public-key line of the controller's `.key` certificate)"
                )
            return None
        public, secret = own if own is not None else zmq.curve_keypair()
        return cls(public=public, secret=secret, server=server)


def _load_allow_list(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"CURVE client directory {path} does not exist; create it and put each worker's `.key` file there")
    keys = frozenset(_read_certificate(cert, want_secret=False)[0] for cert in sorted(path.glob("*.key")))
    if not keys:
        # An empty allow-list would refuse every worker: surely a wrong directory.
        raise ConfigError(f"CURVE client directory {path} holds no `.key` certificates; copy each worker's public certificate there")
    return keys


def apply_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE server (call before bind)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def apply_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` a CURVE client of the controller (call before connect)."""
    if keys.server is None:
        raise ConfigError(f"these are a controller's CURVE keys; a client needs the controller's public key ({SERVER_ENV})")
    sock.curve_serverkey = keys.server
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def start_allow_list(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator | None:
    """Start the ZAP handler enforcing `keys.allowed_clients` on every CURVE server socket of `ctx`.

    Returns None when there is no allow-list (any key is accepted). Start it
    before binding, and `stop()` it when the context's sockets are closed.
    """
    if keys.allowed_clients is None:
        return None
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _AllowList(keys.allowed_clients))
    return auth


def client_key(frames: list[Any]) -> bytes | None:
    """The CURVE client key (Z85) the ZAP handler approved for this message's connection, or None."""
    try:
        key = frames[0].get("User-Id")
    except (zmq.ZMQError, AttributeError, IndexError):
        return None
    return key.encode() if key else None  # pyzmq gives message properties as str


JOIN_ZAP_DOMAIN = b"join"  # the join socket's ZAP domain: the one door a not-yet-admitted key may use


class CurveGate:
    """The controller's CURVE allow-list, learned at admission (the default whenever CURVE is on).

    Why: CURVE encrypts, but without a ZAP handler libzmq accepts any client
    key, so anyone who can reach the PUB could subscribe and read the model
    every round. The gate keeps two doors:

    - the join socket (ZAP domain `join`): any client key, or only the keys of
      `--curve-clients DIR` when given: a host must be able to ask to join
      before anyone knows its key;
    - every other CURVE server socket of the context (control, reducer data
      and PUB): only the controller's own key and the keys of admitted agents.
      The membership calls `admit(key)` with the key the handshake of the
      admitted hello proved (ZeroMQ's User-Id property); an agent's relay dials
      with the agent's keys, so the relay of an admitted host passes.

    `callback` runs on the ZAP thread, `admit` on the membership thread: the
    admitted set is replaced whole, never mutated in place.
    """

    def __init__(self, own: bytes, clients: frozenset[bytes] | None = None):
        self.own = own
        self.clients = clients
        self._admitted: frozenset[bytes] = frozenset()
        self._key_of: dict[str, bytes] = {}  # host -> the key that first joined it (membership thread only)

    @property
    def admitted(self) -> frozenset[bytes]:
        return self._admitted

    def admit(self, key: bytes | str, host: str) -> None:
        """Let `key` (Z85) through every socket from now on; `host`'s name is this key's for the run."""
        raw = key.encode() if isinstance(key, str) else bytes(key)
        self._admitted = self._admitted | {raw}
        self._key_of.setdefault(host, raw)

    def name_taken(self, host: str, key: bytes | None) -> str:
        """Why `key` may not join as `host` ("" when it may).

        A host name belongs, for the rest of the run, to the key that first
        joined it: another admitted key must not take a departed (or any) host's
        name, and with it that host's token and route.
        """
        bound = self._key_of.get(host)
        if bound is None or key == bound:
            return ""
        return (f"host name {host!r} belongs to another CURVE key in this run: pick another --host, or join "
                "with the keys that joined it first")

    def callback(self, domain: str | bytes, key: bytes) -> bool:
        if (domain.encode() if isinstance(domain, str) else domain) == JOIN_ZAP_DOMAIN:
            return self.clients is None or key in self.clients or key == self.own
        return key == self.own or key in self._admitted


def start_gate(ctx: zmq.Context, keys: CurveKeys) -> tuple[CurveGate, ThreadAuthenticator]:
    """Start the ZAP handler enforcing a `CurveGate` on every CURVE server socket of `ctx`.

    Start it before binding; `stop()` the authenticator when the context's
    sockets are closed. The join socket must carry `JOIN_ZAP_DOMAIN`.
    """
    gate = CurveGate(keys.public, keys.allowed_clients)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", gate)  # sockets without a domain: the data plane
    auth.configure_curve_callback(JOIN_ZAP_DOMAIN.decode(), gate)
    return gate, auth


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write `name.key` (public) and `name.key_secret` (mode 0600) in `directory`; refuses to overwrite."""
    base = Path(directory)
    if not base.is_dir():
        raise ConfigError(f"key directory {base} does not exist; create it first")
    public, secret = base / f"{name}.key", base / f"{name}.key_secret"
    for existing in (public, secret):
        if existing.exists():
            raise ConfigError(f"{existing} already exists; remove it or pick another --name (a key is never overwritten)")
    # Create the secret file 0600 before pyzmq writes it: open() keeps the mode, so
    # the secret is never readable by others, not even for a moment.
    os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    zmq.auth.create_certificates(base, name)
    return public, secret


def _keygen_command(args: argparse.Namespace) -> int:
    if args.dotenv:
        # For a compose `.env` (or a secrets store): nothing is written to disk by us.
        public, secret = zmq.curve_keypair()
        # Single quotes: Z85 has $ and #, which a .env reader would interpolate or cut; it has no '.
        print(f"{SECRET_ENV}='{secret.decode()}'\n{SERVER_ENV}='{public.decode()}'")
        return 0
    if args.directory is None:
        raise ConfigError("curve-keygen needs a DIRECTORY to write the certificates in (or --dotenv)")
    public_file, secret_file = keygen(args.directory, args.name)
    public = _read_certificate(public_file, want_secret=False)[0].decode()
    print(f"public certificate: {public_file}\nsecret certificate: {secret_file}\npublic key: {public}")
    print(
        f"On the controller, give it the secret certificate or {SECRET_ENV} (its secret-key line).\n"
        f"On every worker: {SERVER_ENV}={public}"
    )
    return 0


def add_commands(sub: Any) -> None:
    """Register `curve-keygen` on the `flodl-zmq` sub-command parser."""
    cmd = sub.add_parser(
        "curve-keygen", help="write a CURVE keypair (zmq certificate files) for encrypted inter-host links",
        description="Write NAME.key (public) and NAME.key_secret (secret, mode 0600) in DIRECTORY; or, with "
        "--dotenv, print a fresh keypair as FLODL_CURVE_SECRET=... (the controller's) and FLODL_CURVE_SERVER=... "
        "(what every agent pins) lines for a `.env` file.",
    )
    cmd.add_argument("directory", nargs="?", help="where to write the two certificate files (must exist)")
    cmd.add_argument("--dotenv", action="store_true", help="print the keypair as .env lines instead of writing files")
    cmd.add_argument("--name", default="controller", help="file name stem (default: controller)")
    cmd.set_defaults(func=_keygen_command)


def _is_local(peer_host: str) -> bool:
    """True when every address `peer_host` names is loopback or private (False if unresolvable)."""
    host = peer_host.strip("[]")
    try:
        ipaddress.ip_address(host)
        return is_private_address(host)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return all(is_private_address(str(info[4][0])) for info in infos)


class CleartextWarner:
    """Logs one warning per peer reached in cleartext outside loopback and private networks.

    One instance per process role; it remembers which peers it warned about so
    a reconnecting or chatty peer does not flood the log.
    """

    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._warned: set[str] = set()

    def warn_if_cleartext(self, peer_host: str, encrypted: bool) -> bool:
        """Warn (once for this peer) when the link is unencrypted and not local; True if it warned now."""
        if encrypted or peer_host in self._warned or _is_local(peer_host):
            return False
        self._warned.add(peer_host)
        self._logger.warning(
            "link to %s is not encrypted and %s is neither loopback nor private: parameters and metrics "
            "cross it readable by anyone on the path; turn on CURVE (`flodl-zmq curve-keygen`, then %s "
            "on the controller and %s on the workers)",
            peer_host, peer_host, SECRET_ENV, SERVER_ENV,
        )
        return True
