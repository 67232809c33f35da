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
(`tune_loopback`). `send` waits through back-pressure until told to stop;
`drain` handles what is queued, bounded so no socket starves the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from flodl_zmq.endpoints import is_loopback_endpoint
from flodl_zmq.errors import PrivateDirError
from flodl_zmq.wire import Attribution
from flodl_zmq.wire.records import Channel

RELAY_ROUTE = b""  # route frame of the relay's own control records
TAG_DATA = Channel.DATA.value.encode()
TAG_BCAST = Channel.BROADCAST.value.encode()
REDUCER_SENDER = "reducer"
COORDINATOR_SENDER = "coordinator"
# Links that carry one signer's records only: the reducer's (a relay's upstream data
# socket and every SUB), the coordinator's (a relay's control DEALER, a rank's control).
FROM_REDUCER = Attribution.signed_by(REDUCER_SENDER, "the reducer's link")
FROM_COORDINATOR = Attribution.signed_by(COORDINATOR_SENDER, "the coordinator's link")


def rank_identity(rank: int) -> bytes:
    """The ZeroMQ routing identity of a rank's DEALERs (and its route frame upstream)."""
    return str(int(rank)).encode()


def rank_of(identity: bytes) -> int | None:
    """The rank a routing identity names, or None when it names none."""
    if not identity or not identity.isdigit() or len(identity) > 10:
        return None
    return int(identity)


def rank_sender(rank: int) -> str:
    """The codec sender name a rank signs with."""
    return f"rank:{int(rank)}"


def relay_sender(host: str) -> str:
    """The codec sender name a host's relay signs with."""
    return f"relay:{host}"


def _local_dir_path(run_id: bytes, base: str | None) -> str:
    base = base or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, "flodl-" + hashlib.sha256(b"flodl-ipc\0" + run_id).hexdigest()[:16])


def remove_local_dir(run_id: bytes, base: str | None = None) -> None:
    """Remove the run's `local_dir` and what is left in it (a SIGKILLed relay's sockets); never raises.

    Whoever started the run's processes calls it once they are gone; a path
    that is not our own private directory is left alone.
    """
    path = _local_dir_path(run_id, base)
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return
        for name in os.listdir(path):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, name))
        os.rmdir(path)
    except OSError:
        pass


def local_dir(run_id: bytes, base: str | None = None) -> str:
    """The run's private directory for ipc:// socket files: created 0700, or checked to be ours.

    Under $XDG_RUNTIME_DIR (per user) when set, else the temp dir. Its name is a
    hash of the run id, so a world-listable /tmp shows nothing of the run. A
    path that is not a directory of this user with mode 0700 raises
    PrivateDirError: another user could otherwise bind a relay's socket first.
    """
    path = _local_dir_path(run_id, base)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise PrivateDirError(f"cannot create the run's socket directory {path}: {exc.strerror}; "
                              "set XDG_RUNTIME_DIR or TMPDIR to a writable directory") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PrivateDirError(
            f"the run's socket directory {path} is not private (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}, {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a directory'}); "
            f"it must be a directory of uid {os.geteuid()} with mode 0700: remove it, or set XDG_RUNTIME_DIR "
            "to a directory only you can write"
        )
    return path


def local_endpoints(run_id: bytes, host: str, directory: str | None = None) -> tuple[str, str]:
    """Default ipc:// endpoints (control, data) of a host's relay, in the run's private `local_dir`."""
    d = directory or local_dir(run_id)
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


def tune(sock: zmq.Socket, hwm: int, poll_s: float) -> None:
    """Bounded queues (in records), no linger on close, sends that give up after one poll tick."""
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(poll_s * 1000)))


# The kernel send buffer of a model-carrying TCP socket whose peers are all on
# this machine (it binds or connects on loopback). A small buffer keeps sender
# and receiver copying the same bytes in lockstep, while they are still in
# cache; rounds got 5-15% shorter (bench/round.py, A/B against the autotuned
# buffer). Elsewhere the kernel's autotuning stays: a fixed buffer caps a link
# at buffer / round-trip time, which would starve a long-distance link.
LOOPBACK_SNDBUF = 256 * 1024


def tune_loopback(sock: zmq.Socket, endpoint: str) -> None:
    """Give ``sock`` the LOOPBACK_SNDBUF send buffer if ``endpoint``, where it binds or connects, is loopback."""
    if is_loopback_endpoint(endpoint):
        sock.setsockopt(zmq.SNDBUF, LOOPBACK_SNDBUF)


def send(sock: zmq.Socket, frames: Sequence[Any], stop: threading.Event, copy: bool = True) -> bool:
    """Send one message, waiting through full queues until `stop` is set; False if it never went.

    A full queue (HWM) is back-pressure, not an error: the caller's thread waits,
    which stops it reading its own peers. EHOSTUNREACH (ROUTER_MANDATORY, peer
    gone) raises zmq.ZMQError for the caller to count.
    """
    while not stop.is_set():
        try:
            sock.send_multipart(frames, copy=copy)
            return True
        except zmq.Again:
            continue
    return False


def drain(sock: zmq.Socket, handle: Callable[[list[Any]], None], copy: bool = True, budget: int = 256) -> None:
    """Handle what is queued on `sock` now, bounded so no socket starves the others."""
    for _ in range(budget):
        try:
            msg = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return
        handle(msg)
