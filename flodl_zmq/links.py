"""The seams every service shares: who a frame is from, and how a link's socket behaves.

Names. A rank's DEALERs carry its global rank in ASCII decimal as their
routing identity (`rank_identity`), which is also the route frame a relay
puts in front of the rank's records upstream; `RELAY_ROUTE` (empty) marks a
relay's own records. Every signer has one codec sender name: `rank:N`,
`relay:HOST`, `reducer`, `coordinator`. A receiver checks that a record's
authenticated sender is the one its route names (`wire.Codec.decode_from`).

Sockets. Every link's queues are bounded in records, a socket never lingers
on close, and a send gives up after one poll tick (`tune`); a model-carrying
link between two processes of this machine gets a small kernel send buffer
(`tune_loopback`). `send` waits through back-pressure for at most its
`timeout_s` (a peer that stops reading must never block a service), then
reports the send failed; `drain` handles what is queued, bounded so no socket
starves the others.

Reconnects (PROTOCOL.md, Reconnects). ZeroMQ re-dials a dropped TCP
connection under the socket; what it does not keep by itself is the routing
identity, which a ROUTER assigns at random to a peer that sets none. So every
DEALER whose route a ROUTER checks sets one that lives as long as its process
(`relay_identity`: host plus a random incarnation; a rank's is its rank), and
the routers a relay dials take over a route from a half-open connection when
the same identity comes back (`take_over_routes`). Every tcp:// socket beats
(`keep_alive`): ZeroMQ heartbeats close a connection that stays silent past
the link's silence limit, so a dead path (NAT timeout, cable pulled) is
re-dialled instead of waited on, and TCP keepalive keeps middleboxes awake.

Receiving. Every receiving socket refuses frames over its kind's size (`limit_receive`)
and every receive loop reads through `recv_bounded`, which never keeps more
frames of a message than its socket may legally carry (PROTOCOL.md 6.1). A
record the codec refuses is counted by cause, logged and dropped, never raised
into a poll loop (`decode_or_count`). What a service then does with a record
it accepted runs inside `act_for_peer`: anything that raises is the signer's
violation, which drops that peer only, never the service.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import hmac
import logging
import os
import stat
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from flodl_zmq.endpoints import is_loopback_endpoint
from flodl_zmq.errors import AttributionError, FlodlError, PrivateDirError, WireError
from flodl_zmq.wire import Attribution, Envelope, Limits
from flodl_zmq.wire.records import MAX_RANK, Channel
from flodl_zmq.wire.shm import private_dir_name

RELAY_ROUTE = b""  # route frame of the relay's own control records
TAG_DATA = Channel.DATA.value.encode()
TAG_BCAST = Channel.BROADCAST.value.encode()
REDUCER_SENDER = "reducer"
COORDINATOR_SENDER = "coordinator"
# Links that carry one signer's records only: the reducer's (a relay's upstream data
# socket and every SUB), the coordinator's (a relay's control DEALER, a rank's control).
FROM_COORDINATOR = Attribution.signed_by(COORDINATOR_SENDER, "the coordinator's link")


def reducer_sender(shard: int) -> str:
    """The codec sender name of reducer shard `shard` (shards.py): 0, the controller's, is `reducer`.

    One name per shard: each signs its own stream, whose sequence numbers a relay checks apart.
    """
    return REDUCER_SENDER if shard == 0 else f"{REDUCER_SENDER}:{int(shard)}"


def from_reducer(shard: int) -> Attribution:
    """Records on a link of reducer shard `shard`: signed by that shard alone."""
    return Attribution.signed_by(reducer_sender(shard), "the reducer's link" if shard == 0 else f"reducer shard {shard}'s link")


FROM_REDUCER = from_reducer(0)


def coordinator_sender(rank: int) -> str:
    """The coordinator's sender name on its control stream to `rank` (PROTOCOL.md 10.7).

    One counter per rank makes each stream gap-free, so a rank can tell a lost
    record from one sent to another rank; and a record to one rank is never
    accepted by another (attribution refuses it).
    """
    return f"{COORDINATOR_SENDER}:{int(rank)}"


def rank_identity(rank: int) -> bytes:
    """The ZeroMQ routing identity of a rank's DEALERs (and its route frame upstream)."""
    return str(int(rank)).encode()


def rank_of(identity: bytes) -> int | None:
    """The rank a routing identity names, or None when it names none.

    Only the canonical form names one (`rank_identity`'s: no sign, no leading zero, a Rank's range): the
    replies to a rank go to `rank_identity(rank)`, so a peer whose identity spells it otherwise (`b"03"`)
    would be served under a name it never receives on.
    """
    if not identity.isdigit() or len(identity) > 10 or int(identity) > MAX_RANK:
        return None
    rank = int(identity)
    return rank if rank_identity(rank) == identity else None


def rank_sender(rank: int) -> str:
    """The codec sender name a rank signs with."""
    return f"rank:{int(rank)}"


def relay_sender(host: str) -> str:
    """The codec sender name a host's relay signs with."""
    return f"relay:{host}"


HOST_TOKEN_LABEL = b"flodl-zmq/host-token\x00"
ROUTE_SECRET_BYTES = 32
HOST_TOKEN_BYTES = 32  # an HMAC-SHA256


def host_token(route_secret: bytes, host: str) -> bytes:
    """The secret `host`'s relay proves its `relay.hello` with (PROTOCOL.md 10.5).

    Why: every member holds the session key, so a hello's MAC says "a member", not
    "this host"; the token is handed to the host alone at admission. It is derived
    from the controller's route secret, so the controller, the launcher and a
    re-formed world compute the same token without keeping a table.
    """
    return hmac.new(route_secret, HOST_TOKEN_LABEL + host.encode(), hashlib.sha256).digest()


def hello_signer(route_secret: bytes, hello: Any, where: str) -> Attribution:
    """Who may sign `hello` on `where`: its host's relay, when it carries that host's token; else nobody.

    Checked as the attribution (PROTOCOL.md 7, step 21), so a hello with a wrong
    token is refused before its sequence number is recorded: a member naming
    another host neither moves that host's route nor burns its sequence numbers.
    """
    if not hmac.compare_digest(hello.token, host_token(route_secret, hello.host)):
        return Attribution.nobody(where, f"its token is not host {hello.host!r}'s: another member speaking for "
                                         "that host, or a relay of another run or controller incarnation")
    return Attribution.signed_by(relay_sender(hello.host), where)


RELAY_IDENTITY_HOST_BYTES = 200  # with "relay:", ":" and 16 hex digits: 223 bytes at most


def relay_identity(host: str, incarnation: bytes) -> bytes:
    """The routing identity of a relay's upstream DEALERs: its host and its process's incarnation.

    Stable for the process, so a reconnect keeps its route at the controller;
    a restarted relay (a new incarnation) is a different peer. ZeroMQ allows
    1..255 bytes not starting with a zero byte, so a long host name is cut to
    RELAY_IDENTITY_HOST_BYTES of UTF-8 at a character boundary (a cut in
    characters let a valid non-ASCII name overflow the limit, and the relay's
    socket setup fail); the incarnation keeps it unique.
    """
    name = host.encode()[:RELAY_IDENTITY_HOST_BYTES].decode(errors="ignore")
    return f"relay:{name}:{incarnation.hex()}".encode()


def _local_dir_path(key: bytes, incarnation: bytes, base: str | None) -> str:
    base = base or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, private_dir_name(key, incarnation, "ipc"))


def remove_local_dir(key: bytes, incarnation: bytes, base: str | None = None) -> None:
    """Remove the run's `local_dir` and what is left in it (a SIGKILLed relay's sockets); never raises.

    Whoever started the run's processes calls it once they are gone; a path
    that is not our own private directory is left alone.
    """
    path = _local_dir_path(key, incarnation, base)
    try:
        st = os.lstat(path)
        if not _is_private(st):
            return
        for name in os.listdir(path):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, name))
        os.rmdir(path)
    except OSError:
        pass


def local_dir(key: bytes, incarnation: bytes, base: str | None = None) -> str:
    """The run's private directory for ipc:// socket files: created 0700, or checked to be ours.

    Under $XDG_RUNTIME_DIR (per user) when set, else the temp dir. Its name is an
    HMAC of the incarnation id under the session key (`private_dir_name`): a
    world-listable /tmp shows nothing of the run, and nobody without the key
    can create it first to block the relay. A path that is not a directory of
    this user with mode 0700 raises PrivateDirError: another user could
    otherwise bind a relay's socket first.
    """
    return _private_dir(_local_dir_path(key, incarnation, base))


# Tries at the run's socket directory: every host of a run on one machine shares it, and the last
# socket removed takes it with it (`remove_ipc`), so another host's relay may remove it between our
# mkdir and our look at it; it is then made again.
PRIVATE_DIR_TRIES = 3


def _private_dir(path: str) -> str:
    """Create `path` 0700, or check that it is ours and 0700 (`local_dir`); returns it."""
    for _ in range(PRIVATE_DIR_TRIES):
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            pass
        except FileNotFoundError:
            continue  # removed by another host's relay right after our mkdir
        except OSError as exc:
            raise PrivateDirError(f"cannot create the run's socket directory {path}: {exc.strerror}; "
                                  "set XDG_RUNTIME_DIR or TMPDIR to a writable directory") from None
        with contextlib.suppress(FileNotFoundError):
            return _checked_private(path, os.lstat(path))
    raise PrivateDirError(f"the run's socket directory {path} vanished {PRIVATE_DIR_TRIES} times as it was made: "
                          "something keeps removing it; set XDG_RUNTIME_DIR to a directory only this run uses")


def _is_private(st: os.stat_result) -> bool:
    """Whether `st` (an lstat) is a directory of this user with mode 0700: nobody else can plant a socket in it."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _checked_private(path: str, st: os.stat_result) -> str:
    """`path` if `st` (its lstat) is private (`_is_private`), else PrivateDirError."""
    if not _is_private(st):
        raise PrivateDirError(
            f"the run's socket directory {path} is not private (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}, {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a directory'}); "
            f"it must be a directory of uid {os.geteuid()} with mode 0700: remove it, or set XDG_RUNTIME_DIR "
            "to a directory only you can write"
        )
    return path


def local_endpoints(key: bytes, incarnation: bytes, host: str, directory: str | None = None) -> tuple[str, str]:
    """Default ipc:// endpoints (control, data) of a host's relay, in the run's private `local_dir`."""
    d = directory or local_dir(key, incarnation)
    name = hashlib.sha256(host.encode()).hexdigest()[:12]
    return f"ipc://{os.path.join(d, name)}-control", f"ipc://{os.path.join(d, name)}-data"


def remove_ipc(endpoint: str) -> None:
    """Unlink a bound ipc:// endpoint's socket file, and its `local_dir` once empty; never raises."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    for remove, target in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        if remove is os.rmdir and not os.path.basename(target).startswith("flodl-"):
            return  # only the run's own directory, never a caller's
        try:
            remove(target)
        except OSError:
            pass  # gone already, not empty (the other socket, another relay), or not ours


def bind_local(sock: zmq.Socket, endpoint: str) -> None:
    """Bind a relay's local endpoint, in a run's `local_dir` re-created if it went.

    Every host of a run on one machine shares that directory, and the last
    socket removed takes it with it (`remove_ipc`): at a re-form another host's
    agent may remove it, empty, between this relay's `local_endpoints` and its
    bind. A bound socket file keeps it from going, so a few tries always do.
    """
    directory = os.path.dirname(endpoint[len("ipc://"):])
    for attempt in range(3):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            ours = endpoint.startswith("ipc://") and os.path.basename(directory).startswith("flodl-")
            if exc.errno != errno.ENOENT or not ours or attempt == 2:
                raise
            _private_dir(directory)


def remove_host_sockets(key: bytes, incarnation: bytes, host: str, base: str | None = None) -> None:
    """Remove `host`'s relay socket files (a SIGKILLed relay leaves them), and the run's `local_dir` once empty.

    An agent removes only its own host's: another host's relay on the same
    machine may be bound there still. Never raises.
    """
    for endpoint in local_endpoints(key, incarnation, host, _local_dir_path(key, incarnation, base)):
        remove_ipc(endpoint)


def tune(sock: zmq.Socket, hwm: int, send_retry_s: float) -> None:
    """Bounded queues (in records), no linger on close, and a blocked send that returns after
    `send_retry_s` (SNDTIMEO), so `send` can look at its stop flag and deadline before it retries."""
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_retry_s * 1000)))


def keep_alive(sock: zmq.Socket, endpoint: str, heartbeat_s: float, silence_s: float) -> None:
    """Heartbeats and TCP keepalive on a socket that binds or connects the tcp:// ``endpoint`` (else nothing).

    Set before bind/connect. ZMQ_HEARTBEAT_IVL pings the peer every
    ``heartbeat_s``; a connection that carries nothing (not even the pong)
    for ``silence_s`` is closed (HEARTBEAT_TIMEOUT here, HEARTBEAT_TTL for the
    peer), and a connecting socket re-dials at once. A flap shorter than
    ``silence_s`` costs only time: TCP retransmits what was in flight.
    """
    if not endpoint.startswith("tcp://"):
        return
    ivl_ms, silence_ms = max(1, int(heartbeat_s * 1000)), max(1, int(silence_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, silence_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(silence_ms, 6_553_500))  # TTL is carried in deciseconds, 16 bits
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, int(silence_s)))
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, int(heartbeat_s)))
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    # Re-dial after half a beat, not ZeroMQ's 100 ms: the ROUTER must first read what the old
    # connection delivered. Messages it has not read when the same identity comes back are
    # handed over under a temporary identity, which no route check accepts (lost, counted).
    sock.setsockopt(zmq.RECONNECT_IVL, max(100, ivl_ms // 2))
    dial_afresh(sock, heartbeat_s)


def dial_afresh(sock: zmq.Socket, heartbeat_s: float) -> None:
    """A dial into a cut link gives up after a beat and starts again with a fresh SYN, instead of
    following the kernel's SYN backoff (1, 2, 4 s, ...) long after the link is back. Set before connect."""
    sock.setsockopt(zmq.CONNECT_TIMEOUT, max(100, int(heartbeat_s * 1000)))


def take_over_routes(sock: zmq.Socket) -> None:
    """A ROUTER whose peers set stable identities: a reconnect with a held identity takes the route.

    Without it the ROUTER ignores a connection whose identity a half-open
    pipe still holds (until heartbeats drop that pipe, seconds of silence).
    Anyone who knows the identity may take the route this way; what they
    receive is what the link carries anyway (CURVE keeps it private), and what
    they send is dropped unless its MAC verifies and its signer is the one
    the route names.
    """
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)


# The kernel send buffer of a model-carrying TCP socket whose peers are all on
# this machine (it binds or connects on loopback). A small buffer keeps sender
# and receiver copying the same bytes in lockstep, while they are still in
# cache; rounds got 5-15% shorter (bench/round.py, A/B against the autotuned
# buffer). Elsewhere the kernel's autotuning stays: a fixed buffer caps a link
# at buffer / round-trip time, which would starve a long-distance link.
LOOPBACK_SNDBUF = 256 * 1024


def monitor_events(monitor: zmq.Socket) -> Iterator[dict[str, Any]]:
    """The events queued on a socket's monitor (`get_monitor_socket`) now, oldest first, without waiting."""
    while monitor.poll(0):
        yield recv_monitor_message(monitor)


class DialWatch:
    """What came of a dialling socket's connection attempts, to say why no reply came.

    A silent peer has four causes an operator tells apart by what to fix: no TCP connection at all (refused,
    unreachable, filtered: the address or a firewall), a listener that is not a ZeroMQ peer (its handshake
    failed: the port), a CURVE handshake refused (the server key), or a handshake made and no answer (the
    session key, or another run). One message listing them all left the operator to guess.
    """

    _FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
               | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | self._FAILED)
        self._seen = 0  # the events that came, or-ed

    def why_silent(self, address: str) -> str:
        """The likeliest cause, from what came of the connection attempts to `address` so far."""
        for event in monitor_events(self.monitor):
            self._seen |= event["event"]
        if self._seen & zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return ("it is there (a ZeroMQ handshake was made) and dropped our hello: its key differs from ours "
                    "(FLODL_KEY must be the same on every host; an open-admission controller takes no key)")
        if self._seen & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "its CURVE handshake refused us: FLODL_CURVE_SERVER is not that controller's public key"
        if self._seen & self._FAILED:
            return (f"something listens at {address} but is not a flodl-zmq controller (the ZeroMQ handshake "
                    "failed): check the port, the controller's PORT of --bind")
        if self._seen & zmq.EVENT_CONNECTED:
            return (f"something at {address} accepted a TCP connection and made no ZeroMQ handshake: it is not a "
                    "flodl-zmq controller (check the port, the controller's PORT of --bind), or a proxy is in the way")
        return (f"no TCP connection to {address} could be made (refused, unreachable or filtered): is the "
                "controller running there, and its ports open to this host?")

    def close(self) -> None:
        if not self._sock.closed:  # a re-dial may have replaced and closed it
            self._sock.disable_monitor()
        self.monitor.close(0)


class Connections:
    """Which TCP connection each peer's records arrive on, so a reconnect can be counted.

    A reconnect is invisible to a ROUTER's reader (the identity is kept, the
    route handed over), so a person could not tell a flapping link from a
    quiet one. `watch` turns on the socket's accept events; a peer whose
    record arrives on a connection accepted after the one it last used
    reconnected. Connections are told apart by (fd, accept number), since a
    new connection often gets the old one's fd.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self._sock = sock
        self._accepts = 0
        self._accepted: dict[int, int] = {}  # fd -> its accept number
        self._last: dict[str, tuple[int, int]] = {}  # peer -> (fd, accept number) it last used
        self.reconnects: dict[str, int] = {}

    def read_events(self) -> None:
        """Take the accept events queued on `monitor` (before reading the socket's records)."""
        for event in monitor_events(self.monitor):
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepts += 1
                self._accepted[int(event["value"])] = self._accepts

    def arrived(self, peer: str, frame: zmq.Frame) -> bool:
        """`peer`'s authenticated record came in `frame`; True when it came over a new connection."""
        fd = frame.get(zmq.SRCFD)
        conn = (fd, self._accepted.get(fd, 0))
        last, self._last[peer] = self._last.get(peer), conn
        if last is None or last == conn:
            return False
        self.reconnects[peer] = self.reconnects.get(peer, 0) + 1
        return True

    def close(self) -> None:
        self._sock.disable_monitor()
        self.monitor.close(linger=0)


def tune_loopback(sock: zmq.Socket, endpoint: str) -> None:
    """Give ``sock`` the LOOPBACK_SNDBUF send buffer if ``endpoint``, where it binds or connects, is loopback."""
    if is_loopback_endpoint(endpoint):
        sock.setsockopt(zmq.SNDBUF, LOOPBACK_SNDBUF)


def send(sock: zmq.Socket, frames: Sequence[Any], stop: threading.Event, timeout_s: float,
         copy: bool = True) -> bool:
    """Send one message, waiting through full queues until `stop` is set or `timeout_s` passed; False if it never went.

    A full queue (HWM) is back-pressure, not an error: the caller's thread waits,
    which stops it reading its own peers, but never longer than `timeout_s`: a
    peer that stopped reading must not wedge a service; its message is lost
    and the peer's silence gets it declared dead. EHOSTUNREACH
    (ROUTER_MANDATORY, peer gone) raises zmq.ZMQError for the caller to count.
    """
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            sock.send_multipart(frames, copy=copy)
            return True
        except zmq.Again:
            continue
    return False


# Receive limits (PROTOCOL.md, 6. Limits: "Receive limits per socket"). Anyone who can
# reach a port can send a frame or a message of any size; without these a 400 MB frame
# or a message of 3 million empty frames is allocated whole (and, read with
# recv_multipart, turned into as many Python objects) before any check runs.
_LIMITS = Limits()
# Largest frame a socket that carries no payload may receive (ZMQ_MAXMSGSIZE): the header
# is its largest frame (route, tag and MAC frames are short). Join and control sockets.
CONTROL_MAX_FRAME_BYTES = _LIMITS.max_header_bytes
# Largest frame on a data socket when the model's size is not known to it: one payload
# frame is at most the message's payload bound. A service that knows the model sets less.
DATA_MAX_FRAME_BYTES = _LIMITS.max_payload_bytes
# Most frames a message may have as received, envelope included: a ROUTER's identity
# frame, a route or tag frame (3.1), then header and MAC, plus payload frames on data.
JOIN_MAX_FRAMES = 1 + 2  # identity, header, mac (a DEALER receives one less)
CONTROL_MAX_FRAMES = 2 + 2  # identity, route, header, mac
DATA_MAX_FRAMES = 2 + 2 + _LIMITS.max_payload_frames  # identity or tag, route, header, payload..., mac
# While discarding an oversized message, call the caller's `tick` this often (in frames)
# so its timers (heartbeats) keep running: a long discard must not read as our silence.
DISCARD_TICK_FRAMES = 1 << 14
# A discarded message at least this long (in frames) hands its memory back to the kernel
# (`release_freed_memory`); shorter ones are not worth the heap walk.
RELEASE_AFTER_FRAMES = DISCARD_TICK_FRAMES


def send_by_reference(sock: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> zmq.MessageTracker:
    """Send `frames` as one message without copying them; the tracker is done once the socket let go of
    every frame (pyzmq's `send_multipart(track=True)` tracks only the last one, often a small copied MAC)."""
    last = len(frames) - 1
    return zmq.MessageTracker(*(sock.send(f, flags | (zmq.SNDMORE if i < last else 0), copy=False, track=True)
                                for i, f in enumerate(frames)))


def data_max_frame_bytes(largest_payload_frame: int) -> int:
    """The frame bound of a data or broadcast socket whose receiver knows the model: its largest
    payload frame (`WireFormat.largest_frame_bytes`), or the header when that is larger."""
    return max(CONTROL_MAX_FRAME_BYTES, int(largest_payload_frame))


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


_MALLOC_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Give the heap's free pages back to the kernel (glibc `malloc_trim(0)`, every thread's arena).

    ZeroMQ holds a message's frames (64 bytes each) until it is read; once a
    flood of millions of empty frames is discarded, glibc keeps the freed
    pages in its arenas, so without this the process stays that much larger
    for good (PROTOCOL.md 6.1). Elsewhere than glibc nothing is done.
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def limit_receive(sock: zmq.Socket, max_frame_bytes: int) -> None:
    """Refuse frames over `max_frame_bytes`: ZeroMQ drops the sender's connection before allocating them.

    Applies to connections made after the call: set it before bind/connect.
    """
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_frame_bytes))


def recv_bounded(
    sock: zmq.Socket,
    max_frames: int,
    flags: int = 0,
    copy: bool = True,
    tick: Callable[[], None] | None = None,
) -> list[Any] | None:
    """Receive one message frame by frame; None if it had more than `max_frames` frames.

    An oversized message is read to its end (the socket stays usable) but nothing
    past the limit is kept, so a flood of empty frames costs no memory here and
    never reaches a decoder; `tick` runs every DISCARD_TICK_FRAMES frames of it.
    A discarded message of RELEASE_AFTER_FRAMES or more hands its memory back
    (`release_freed_memory`). Raises zmq.Again like `recv` when `flags` has
    NOBLOCK and nothing is queued.
    """
    recv, more = sock.recv, sock.getsockopt  # bound once: this loop may run millions of times
    frames = [recv(flags, copy=copy)]
    while more(zmq.RCVMORE):
        if len(frames) < max_frames:
            frames.append(recv(copy=copy))
            continue
        n = len(frames)
        frames.clear()
        while True:
            recv(copy=True)  # frames already queued: ZeroMQ delivers a message whole
            n += 1
            if not more(zmq.RCVMORE):
                if n >= RELEASE_AFTER_FRAMES:
                    release_freed_memory()
                return None
            if tick is not None and n % DISCARD_TICK_FRAMES == 0:
                tick()
    return frames


def drain(
    sock: zmq.Socket,
    handle: Callable[[list[Any]], None],
    copy: bool = True,
    budget: int = 256,
    max_frames: int = DATA_MAX_FRAMES,
    tick: Callable[[], None] | None = None,
) -> int:
    """Handle what is queued on `sock` now, bounded so no socket starves the others.

    Messages over `max_frames` frames are discarded unread (`recv_bounded`);
    returns how many were, for the caller to count.
    """
    rejected = 0
    for _ in range(budget):
        try:
            msg = recv_bounded(sock, max_frames, zmq.NOBLOCK, copy=copy, tick=tick)
        except zmq.Again:
            break
        if msg is None:
            rejected += 1
        else:
            handle(msg)
    return rejected


class Refusal(NamedTuple):
    """Why a record was refused, as a service's status counts it, and how loudly it is logged."""

    counter: str
    level: int = logging.WARNING


def decode_or_count(decode: Callable[[], Envelope], count: collections.Counter[str],
                    refusal: Callable[[WireError], Refusal], log: logging.Logger, who: str) -> Envelope | None:
    """Decode one inbound message; a refused one is counted, logged and dropped (None).

    The rule of every service's receive path: a record the codec refuses
    (forged, replayed, malformed, over a limit) never raises out of a poll loop
    and never reaches the service; `refusal` names the counter its cause is
    counted under (the names the service's status reports) and the level it
    is logged at, in the service's own `log`.
    """
    try:
        return decode()
    except WireError as exc:
        why = refusal(exc)
        count[why.counter] += 1
        log.log(why.level, "%s: rejected a record: %s", who, exc)
        return None


@functools.cache  # one per link name, not one per received record
def route_refusal(where: str) -> Callable[[WireError], Refusal]:
    """A relay link's refusals: `forged_route.WHERE` when the sender is not the one the route names, else
    `rejected.WHERE`."""
    return lambda exc: Refusal(f"{'forged_route' if isinstance(exc, AttributionError) else 'rejected'}.{where}")


def act_for_peer(peer: str, act: Callable[[], None], drop: Callable[[str], None], count: collections.Counter[str],
                 where: str, log: logging.Logger, who: str) -> bool:
    """Act on one accepted record of `peer` (the handler, the core's reaction, the replies it causes); False when
    that raised and `peer` was dropped.

    The rule of every service's handler boundary (PROTOCOL.md 8.2): a record a peer signed may break a rule
    only the service's state can see (a FlodlError: counted `violation.WHERE`), or make the service's own
    code fail (any other Exception: counted `handler_error.WHERE`, logged with its traceback, since it may be
    our bug and must stay visible). Either way `drop(reason)` removes that peer, as for any death, and the
    service goes on serving the others: no record a member can sign ends a service. KeyboardInterrupt and
    SystemExit are not caught; an exception from `drop` itself is the service's own failure and is raised.
    """
    try:
        act()
        return True
    except FlodlError as exc:
        count[f"violation.{where}"] += 1
        log.error("%s: %s broke the protocol, dropping it: %s", who, peer, exc)
        reason = f"protocol violation: {exc}"
    except Exception as exc:  # noqa: BLE001 - attributed to the peer whose record caused it, and logged whole
        count[f"handler_error.{where}"] += 1
        log.error("%s: acting on a record of %s failed, dropping it (a bug here if it is not the peer's doing):\n%s",
                  who, peer, traceback.format_exc())
        reason = f"{who} failed acting on its record: {type(exc).__name__}: {exc}"
    drop(reason)
    return False
