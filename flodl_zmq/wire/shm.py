"""Payload by reference: tensor bytes in shared memory, the record on the socket (same host only).

A rank and its relay share a machine when the relay's local endpoint is
ipc://. Sending a model through that socket costs a copy into the kernel and
one out of it, per rank and direction, plus fresh pages on the receiving side
for every message. Instead, the owner of a reused shared-memory segment writes
the payload there once and sends the message with its payload frames left out
(normative text: protocol/PROTOCOL.md, 3.5):

    [SHM_TAG, locator, header, mac]     locator = msgpack [name, [[offset, nbytes], ...]]

Rules this module keeps:

- The header is exactly the framed message's header (it describes every
  payload frame); the MAC covers the header and the locator, under its own
  label, and not the payload bytes. Those are guarded by the segment itself:
  a receiver trusts only a regular file (never through a symlink) owned by
  its own user with no group or other permission bits. Whoever can write
  such a file runs as the run's user and can read the session key as well,
  so a payload MAC would stop nobody; it would only cost passes over the
  bytes (~4 ms per 40 MB, three per rank and round: sign, verify the
  deposit, verify the consensus).
- The MAC is checked before the locator is opened, and the locator may only
  name what the receiver expects: a segment of this run and of the owner the
  receiver attributes the message to (a rank's own segment for its deposit,
  its relay's for a consensus), in the shared-memory directory, with every
  frame inside the segment. A receiver never opens any other file.
- Segments live in the run's private directory, ``<shm>/flodl-<24 hex>``
  (``run_dir``), its name an HMAC of the incarnation id under the session key
  (``private_dir_name``): every process of the run finds it without being
  told, and no one without the key can predict it. It is created 0700 by the
  run's first process on the host (mkdir: exclusive), and used by the others
  only if it is a real directory (never a symlink) of their own user that no
  group or other user may enter. Segment names are predictable and /dev/shm
  is world-writable, so without it a local user could squat a name ahead of
  the owner (its exclusive create would fail) or plant files for cleanup to
  trip on; with a name derived from the incarnation id alone (world-readable in
  every header) a user could squat the directory itself. A directory that
  fails the check raises ShmError naming the cause and fix; the relay and the
  ranks then send payloads framed instead (slower, never stopped).
- Cleanup never raises: it unlinks only inside a run directory that passes
  the check, and a file it cannot remove is skipped.
- A segment is created by its owner (exclusive create, mode 0600), reused for
  every round while the layout fits, replaced by a new generation when it does
  not, and unlinked by its owner when it closes. A rank that dies without
  closing leaves its segment behind: its relay unlinks every segment of that
  rank when the rank leaves, and whoever started the run's processes (the
  launcher, an agent) unlinks whatever of the run is left once they are gone.
- A payload is not rewritten while a reader may still need it; the round
  protocol's ping-pong guarantees it (a rank writes its next snapshot only after
  the consensus of the previous round, which exists only after its relay
  shipped; a relay writes the next consensus only after every live rank
  deposited again, i.e. loaded this one). Readers map segments read-only.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import itertools
import mmap
import os
import re
import stat
import tempfile
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from flodl_zmq import threads
from flodl_zmq.errors import AuthError, FramingError, LimitError, SchemaError, ShmError
from flodl_zmq.wire.codec import Codec, Envelope, Sender
from flodl_zmq.wire.mac import byte_view
from flodl_zmq.wire.records import Channel

SHM_TAG = b"shm"
ALIGN = 64  # cache-line aligned frames: the fold and the MAC read them at full speed
MAX_FRAMES = 65_536
PLACE_BLOCK = 1 << 22  # bytes per piece of a copy into a segment
_NAME = re.compile(r"^flodl-[0-9a-f]{32}-[a-z0-9]{1,32}-[0-9]{1,10}$")


def shm_dir() -> str:
    """Where segments live: /dev/shm (memory-backed) when the system has it, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def private_dir_name(key: bytes, incarnation: bytes, use: str) -> str:
    """The name of one of the run's private directories on a host: `flodl-` and 24 hex digits.

    An HMAC of the incarnation id (PROTOCOL.md 4.1) under the session key: the run's processes agree on it
    without being told, and a local user without the key cannot predict it, so
    cannot create it first (squat) to block or redirect the run.
    """
    mac = hmac.new(key, b"flodl-zmq/private-dir\x00" + use.encode() + b"\x00" + incarnation, hashlib.sha256)
    return "flodl-" + mac.hexdigest()[:24]


def run_dir(key: bytes, incarnation: bytes, base: str | None = None) -> str:
    """The path of the run's private segment directory (not created; see ``ensure_run_dir``)."""
    return os.path.join(base or shm_dir(), private_dir_name(key, incarnation, "shm"))


def _check_private(path: str) -> None:
    """Raise ShmError unless ``path`` is a directory (not a symlink) of this user, mode 0700 or tighter."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise ShmError(f"shared-memory directory {path} cannot be checked: {exc.strerror}; "
                       "check that the shared-memory filesystem is mounted and writable") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        raise ShmError(
            f"shared-memory directory {path} is {what} owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}; a run's segments need a directory of its own user (uid "
            f"{os.geteuid()}) with mode 0700. Another user may have created it ahead of this run: remove it, "
            "or start the run afresh; payloads go framed until then"
        )


def ensure_run_dir(key: bytes, incarnation: bytes, base: str | None = None) -> str:
    """The run's private segment directory, created 0700 if absent; ShmError if it is not private to us."""
    path = run_dir(key, incarnation, base)
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass  # another process of this run (or a squatter: the check below tells)
    except OSError as exc:
        raise ShmError(f"cannot create shared-memory directory {path}: {exc.strerror}; "
                       "check that the shared-memory filesystem is mounted and writable") from None
    _check_private(path)
    return path


def rank_owner(rank: int) -> str:
    """The owner tag of a rank's deposit segment."""
    return f"r{int(rank)}"


def host_owner(host: str) -> str:
    """The owner tag of a host relay's consensus segment (host names may hold any character)."""
    return "h" + hashlib.sha256(host.encode()).hexdigest()[:16]


def segment_prefix(incarnation: bytes, owner: str) -> str:
    """Every segment name of `owner` in this run starts with this."""
    return f"flodl-{incarnation.hex()}-{owner}-"


def is_by_reference(msg: Sequence[Any]) -> bool:
    """Whether a received message is the by-reference form (its first frame is SHM_TAG)."""
    return len(msg) == 4 and byte_view(msg[0]) == SHM_TAG


def unlink_owner(incarnation: bytes, owner: str, directory: str) -> int:
    """Unlink every segment of `owner` in this run (a dead rank's leftovers) in `directory`; returns how many."""
    return _unlink(segment_prefix(incarnation, owner), directory)


def unlink_run(key: bytes, incarnation: bytes, directory: str | None = None) -> int:
    """Unlink every segment of this run and its directory: whoever started its processes does it
    once they are gone. Never raises; returns how many segments it removed."""
    path = directory or run_dir(key, incarnation)
    removed = _unlink(f"flodl-{incarnation.hex()}-", path)
    if directory is None:
        _rmdir(path)
    return removed


def unlink_host(key: bytes, incarnation: bytes, host: str, ranks: Sequence[int], base: str | None = None) -> int:
    """Unlink the segments of one host's relay and ranks, and the run's directory once empty.

    An agent cleans up after its own host only: other hosts' relays and ranks
    may share this machine's shared memory (several agents on one machine), and
    their live segments are not its to remove. Never raises; returns how many.
    """
    path = run_dir(key, incarnation, base)
    removed = sum(_unlink(segment_prefix(incarnation, owner), path) for owner in (host_owner(host), *map(rank_owner, ranks)))
    _rmdir(path)
    return removed


def _unlink(prefix: str, directory: str) -> int:
    """Unlink `prefix`* in `directory` if it is ours and private; skip what cannot be removed."""
    try:
        _check_private(directory)
    except ShmError:
        return 0  # absent, or not ours: nothing in it is ours to remove
    removed = 0
    for path in glob.glob(os.path.join(directory, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass  # gone already, or not ours to remove: cleanup never stops its caller
    return removed


def _rmdir(path: str) -> None:
    """Remove the run directory once empty (another process may still hold segments in it)."""
    try:
        _check_private(path)
        os.rmdir(path)
    except (OSError, ShmError):
        pass


class Segment:
    """The owner's side: one reused, writable segment holding one message's payload frames.

    ``layout(sizes)`` returns one writable byte view per frame (the segment is
    replaced by a larger generation only when they do not fit); ``locator()``
    names where the current layout lies; ``close()`` unlinks it.
    """

    def __init__(self, key: bytes, incarnation: bytes, owner: str, directory: str | None = None) -> None:
        """``directory`` defaults to the run's private directory (created here; ShmError if unusable)."""
        self._key, self._incarnation = key, incarnation
        self._private = directory is None  # the run directory: re-checked at each create, removed when empty
        self.directory = ensure_run_dir(key, incarnation) if directory is None else directory
        self.prefix = segment_prefix(incarnation, owner)
        self._gen = itertools.count(1)
        self.name: str | None = None
        self._map: mmap.mmap | None = None
        self.frames: list[tuple[int, int]] = []  # (offset, nbytes) of each frame of the current layout

    def layout(self, sizes: Sequence[int]) -> list[memoryview]:
        """Writable views of ``sizes`` bytes each, consecutive and ALIGN-aligned, in this segment."""
        frames, at = [], 0
        for n in sizes:
            frames.append((at, int(n)))
            at += -(-int(n) // ALIGN) * ALIGN
        if self._map is None or len(self._map) < max(at, 1):
            self._replace(max(at, 1))
        assert self._map is not None
        self.frames = frames
        view = memoryview(self._map)
        return [view[off : off + n] for off, n in frames]

    def span(self) -> memoryview:
        """The current layout's frames as one view, first to last: one flat vector where they lie back to
        back (every frame but the last a multiple of ALIGN bytes, as a payload's f32 chunks are)."""
        if not self.frames or any(off != prev + n for (prev, n), (off, _) in itertools.pairwise(self.frames)):
            raise FramingError("the segment's frames do not lie back to back: no one flat view holds them")
        assert self._map is not None
        return memoryview(self._map)[self.frames[0][0] : self.frames[-1][0] + self.frames[-1][1]]

    def place(self, frames: Sequence[Any]) -> None:
        """Copy ``frames`` (byte buffers, e.g. received payload frames) into the segment as its layout.

        In PLACE_BLOCK pieces on the worker threads (numpy copies without the GIL).
        """
        bufs = [np.frombuffer(byte_view(f), np.uint8) for f in frames]
        pieces = []
        for dst, src in zip(self.layout([b.nbytes for b in bufs]), bufs, strict=True):
            out = np.frombuffer(dst, np.uint8)
            pieces += [(out[i : i + PLACE_BLOCK], src[i : i + PLACE_BLOCK]) for i in range(0, src.size, PLACE_BLOCK)]
        threads.each(lambda piece: np.copyto(*piece), pieces)

    def arrays(self, like: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The current layout's frames as arrays of ``like``'s dtypes and shapes (what ``place`` put there)."""
        if self._map is None or len(like) != len(self.frames):
            raise FramingError(f"{len(like)} arrays asked of a segment whose layout holds {len(self.frames)} frames")
        view = memoryview(self._map)
        return [np.frombuffer(view[off : off + n], a.dtype).reshape(a.shape)
                for (off, n), a in zip(self.frames, like, strict=True)]

    def locator(self) -> bytes:
        """The locator frame of the current layout."""
        if self.name is None:
            raise FramingError("the segment holds no layout yet; call layout() first")
        return msgpack.packb([self.name, [list(f) for f in self.frames]], use_bin_type=True)

    def close(self, _keep_dir: bool = False) -> None:
        """Unlink the segment, and the run directory once empty (readers keep their mapping until they drop it)."""
        if self.name is not None:
            try:
                os.unlink(os.path.join(self.directory, self.name))
            except OSError:
                pass  # gone already: closing never raises
        if self._private and not _keep_dir:
            _rmdir(self.directory)  # also when it never held a segment: the constructor made the directory
        self.name, self._map, self.frames = None, None, []

    def _replace(self, size: int) -> None:
        # The old mapping is dropped, not closed: views of it may still be in flight.
        self.close(_keep_dir=True)
        name = f"{self.prefix}{next(self._gen)}"
        path = os.path.join(self.directory, name)
        for attempt in (1, 2):
            if self._private:
                ensure_run_dir(self._key, self._incarnation)  # another process of the run removes it when it empties
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                break
            except FileNotFoundError:
                if attempt == 2 or not self._private:
                    raise ShmError(f"cannot create shared-memory segment {path}: its directory vanished "
                                   "twice; check who removes it") from None
            except OSError as exc:
                raise ShmError(f"cannot create shared-memory segment {path}: {exc.strerror}; another process "
                               "with this incarnation id holds that name (two runs with one id?), or the "
                               "directory is not writable") from None
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name = name


def by_reference(
    codec: Codec,
    rec: Any,
    payload: Sequence[Any],
    segment: Segment,
    *,
    channel: Channel | None = None,
    dtypes: Sequence[str] | None = None,
) -> list[Any]:
    """``[SHM_TAG, locator, header, mac]`` for ``rec``, its payload frames left in ``segment``.

    ``payload`` are the arrays as they lie in the segment's current layout (or
    their exact copies there): their dtypes and shapes go into the header.
    """
    if len(payload) != len(segment.frames):
        raise FramingError(f"{len(payload)} payload frames but the segment's layout holds {len(segment.frames)}")
    locator = segment.locator()
    header, mac = codec.encode_reference(rec, payload, locator, channel=channel, dtypes=dtypes)
    return [SHM_TAG, locator, header, mac]


class SegmentMap:
    """The reader's side: maps the segments messages point at (read-only) and decodes them.

    One mapping is kept per owner; a new generation replaces it.
    """

    def __init__(self, incarnation: bytes, directory: str) -> None:
        """``directory``: where the owners' segments lie (``run_dir`` of the run)."""
        self.incarnation = incarnation
        self.directory = directory
        self._maps: dict[str, tuple[str, mmap.mmap]] = {}

    def decode(self, codec: Codec, msg: Sequence[Any], owner: str, channel: Channel, *,
               sender: Sender | None = None, replay: bool = True) -> Envelope:
        """Authenticate and decode a message from ``owner``, framed or by reference; raises a WireError subclass.

        By reference, the MAC over header and locator is checked first; then the
        locator may only name a segment of ``owner`` in this run, private to this
        user, with every frame inside it. With ``sender``, the signer is
        attributed as in ``Codec.decode_from``, in the same order.
        """
        if not is_by_reference(msg):
            if sender is None:
                return codec.decode(msg, channel, replay=replay)
            return codec.decode_from(msg, channel, sender, replay=replay)
        return codec.decode_reference(msg[2], msg[1], msg[3], lambda loc: self._views(loc, owner), channel,
                                      sender=sender, replay=replay)

    def _views(self, locator: memoryview, owner: str) -> list[memoryview]:
        try:
            loc = msgpack.unpackb(locator, raw=False, max_str_len=256, max_bin_len=0,
                                  max_array_len=MAX_FRAMES, max_map_len=0, max_ext_len=0)
        except Exception as exc:  # msgpack raises assorted types on bad input
            raise SchemaError(f"shared-memory locator is not valid msgpack: {type(exc).__name__}: {exc}") from None
        if not (isinstance(loc, list) and len(loc) == 2 and isinstance(loc[0], str) and isinstance(loc[1], list)):
            raise SchemaError("shared-memory locator must be [name, [[offset, nbytes], ...]]")
        name, frames = loc
        if not name.startswith(segment_prefix(self.incarnation, owner)) or not _NAME.match(name):
            raise FramingError(
                f"shared-memory locator names segment {name!r}, which is not one of {owner}'s in this run"
            )
        if len(frames) > MAX_FRAMES:
            raise LimitError(f"shared-memory locator names {len(frames)} frames, over {MAX_FRAMES}")
        view = memoryview(self._map(owner, name))
        out = []
        for f in frames:
            ok = isinstance(f, list) and len(f) == 2 and all(type(x) is int and x >= 0 for x in f)
            if not ok or f[0] + f[1] > len(view):
                raise FramingError(f"shared-memory frame {f!r} does not lie inside segment {name} ({len(view)} bytes)")
            out.append(view[f[0] : f[0] + f[1]])
        return out

    def forget(self, owner: str) -> None:
        """Drop the mapping of ``owner``'s segment (views still in use keep it alive)."""
        self._maps.pop(owner, None)

    def _map(self, owner: str, name: str) -> mmap.mmap:
        held = self._maps.get(owner)
        if held is not None and held[0] == name:
            return held[1]
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise FramingError(f"shared-memory segment {name} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                # The payload bytes carry no MAC: only a segment no other user can write is trusted.
                raise AuthError(
                    f"shared-memory segment {name} is not private to this user (owner uid {st.st_uid}, "
                    f"mode {stat.S_IMODE(st.st_mode):04o}); a run's segments are created 0600 by its own "
                    "processes: remove this file and check who else runs with this incarnation id"
                )
            size = st.st_size
            if size == 0:
                raise FramingError(f"shared-memory segment {name} is empty")
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps[owner] = (name, mapped)
        return mapped
