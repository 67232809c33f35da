"""Finding 9 (issue 15): a local user must not kill, slow or hijack a run, or its cleanup, through /dev/shm.

Segment names are predictable (run id and host hash), the run id is in every
header, and /dev/shm and /tmp are world-writable. The run's private
directories are therefore named by an HMAC of the run id under the session
key: nobody without the key can take them first. The attacks: squat every
name the run id gives away before the run starts (the run goes by reference
as usual); take the run directory itself, as only a key holder could (the
relay keeps serving, payloads go framed with a named error); plant files
another user owns where cleanup looks (cleanup never raises).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat

import numpy as np
import pytest
import zmq
from transport.dataplane_helpers import WAIT_S, FakeController, FakeRank, endpoints

from flodl_zmq.errors import ShmError
from flodl_zmq.links import _local_dir_path as local_dir_path
from flodl_zmq.links import local_dir, remove_local_dir
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import Consensus, RelayHello, RoundFrame
from flodl_zmq.wire.shm import (
    Segment,
    SegmentMap,
    by_reference,
    host_owner,
    is_by_reference,
    rank_owner,
    run_dir,
    segment_prefix,
    shm_dir,
    unlink_run,
)

pytestmark = pytest.mark.timeout(60)

NOBODY = 65534


def squat(path: str, *, directory: bool) -> None:
    """Create `path` as another user would: mode 0777, owned by nobody when we may chown."""
    if directory:
        os.mkdir(path)
    else:
        open(path, "wb").close()
    os.chmod(path, 0o777)
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def run_one_round(tmp_path, key: bytes, run_id: bytes) -> tuple[bool, bool]:
    """A relay and one rank that deposits by reference when it can: (deposited by reference, consensus came so)."""
    ctx = zmq.Context()
    eps = endpoints("ipc", tmp_path)
    ctl = FakeController(ctx, key, run_id, eps)
    relay = Relay(RelayConfig("a", (0,), key, run_id, eps["control"], eps["data"], eps["bcast"], eps["a-control"],
                              eps["a-data"], rank_silence_at_relay_s=30.0, consensus_wait_at_relay_s=30.0,
                              host_token=bytes(32)), ctx)
    rank = FakeRank(ctx, 0, key, run_id, eps["a-control"], eps["a-data"])
    segment, shared = None, False
    try:
        relay.start()
        assert isinstance(ctl.data_record().record, RelayHello)
        x = np.arange(256, dtype=np.float32)
        try:  # as a real rank does: by reference when its segment can be made, else framed
            segment = Segment(key, run_id, rank_owner(0))
            placed = np.frombuffer(segment.layout([x.nbytes])[0], np.float32)
            placed[:] = x
            rank.data.send_multipart(by_reference(rank.codec, RoundFrame(1, 0, 1.0), [placed], segment))
            shared = True
        except ShmError as exc:
            assert "remove it" in str(exc) and run_dir(key, run_id) in str(exc)
            rank.deposit(1, 1.0, [x])
        hf = ctl.data_record()
        np.testing.assert_array_equal(hf.payload[0], x)
        # The consensus goes back; with by-reference ranks the relay writes it into its own segment.
        ctl.data.send_multipart([ctl.data_route, b"bcast", *ctl.codec.encode(Consensus(1, 1.0), [x],
                                                                            channel=Channel.BROADCAST)])
        assert rank.data.poll(int(WAIT_S * 1000)), "no consensus reached the rank"
        msg = rank.data.recv_multipart()
        env = SegmentMap(run_id, run_dir(key, run_id)).decode(Codec(key, run_id, "test"), msg, host_owner("a"),
                                                              Channel.BROADCAST, replay=False)
        np.testing.assert_array_equal(env.payload[0], x)
        assert relay.running and relay.error is None, f"the relay stopped: {relay.error!r}"
        return shared, is_by_reference(msg)
    finally:
        if segment is not None:
            segment.close()
        rank.close()
        relay.stop()
        ctx.destroy(0)
        unlink_run(key, run_id)


def test_squatting_every_name_the_run_id_gives_away_neither_stops_nor_degrades_the_run(tmp_path, monkeypatch):
    key, run_id = new_key(), os.urandom(16)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    # The run id is in every header (readable on the wire without CURVE). Every name it
    # yields is taken by "another user" before the run starts: the segment directory and the
    # ipc directory of earlier versions, and a flat segment name in /dev/shm.
    squatted = [
        (os.path.join(shm_dir(), f"flodl-{run_id.hex()}"), True),
        (os.path.join(str(tmp_path), "flodl-" + hashlib.sha256(b"flodl-ipc\0" + run_id).hexdigest()[:16]), True),
        (os.path.join(shm_dir(), segment_prefix(run_id, host_owner("a")) + "1"), False),
    ]
    for path, directory in squatted:
        squat(path, directory=directory)
    try:
        shared, consensus_shared = run_one_round(tmp_path, key, run_id)
        assert shared and consensus_shared, "the run fell back to framed payloads: a squatter slowed it down"
    finally:
        for path, _ in squatted:
            remove(path)


def test_the_run_directories_are_named_by_the_key_private_and_exclusive(tmp_path):
    key, run_id = new_key(), os.urandom(16)
    names = {run_dir(key, run_id), run_dir(new_key(), run_id), local_dir_path(key, run_id, str(tmp_path)),
             local_dir_path(new_key(), run_id, str(tmp_path))}
    assert len({os.path.basename(n) for n in names}) == 4, "a name must depend on the key and on its use"
    assert not any(run_id.hex()[:8] in n for n in names), "a name must not give away the run id"
    seg = Segment(key, run_id, rank_owner(0))
    try:
        st = os.lstat(run_dir(key, run_id))
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        ipc = local_dir(key, run_id, str(tmp_path))
        assert stat.S_IMODE(os.lstat(ipc).st_mode) == 0o700
    finally:
        seg.close()
        remove_local_dir(key, run_id, str(tmp_path))


def test_a_run_directory_taken_by_another_user_is_refused_by_name_and_payloads_go_framed(tmp_path):
    # Only a holder of the key can know the name; a stale directory of another user (or a
    # leaked key) still must not stop the relay: the run goes framed and says why.
    key, run_id = new_key(), os.urandom(16)
    squat(run_dir(key, run_id), directory=True)
    try:
        shared, consensus_shared = run_one_round(tmp_path, key, run_id)
        assert not shared and not consensus_shared
    finally:
        remove(run_dir(key, run_id))


@pytest.mark.skipif(os.geteuid() != 0, reason="playing a second user needs root (setuid in a forked child)")
def test_cleanup_never_raises_on_files_another_user_owns():
    key, run_id = new_key(), os.urandom(16)
    # Another user's files where cleanup looks: a flat name with the run's prefix next to the
    # run directory, and the run directory itself with a segment in it.
    flat = os.path.join(shm_dir(), segment_prefix(run_id, rank_owner(0)) + "1")
    open(flat, "wb").close()
    os.mkdir(run_dir(key, run_id), 0o700)
    inner = os.path.join(run_dir(key, run_id), segment_prefix(run_id, rank_owner(0)) + "1")
    open(inner, "wb").close()
    try:
        pid = os.fork()
        if pid == 0:  # the run's own user is "nobody"; every file above is root's
            code = 1
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                unlink_run(key, run_id)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "unlink_run raised on another user's file"
        assert os.path.exists(inner), "cleanup must not touch a directory that is not the run user's"
    finally:
        remove(flat)
        remove(run_dir(key, run_id))


def test_cleanup_removes_the_run_directory_and_leaves_dev_shm_clean():
    key, run_id = new_key(), os.urandom(16)
    seg = Segment(key, run_id, rank_owner(3))
    seg.layout([128])
    assert os.stat(run_dir(key, run_id)).st_mode & 0o777 == 0o700
    assert unlink_run(key, run_id) == 1
    assert not os.path.exists(run_dir(key, run_id))
    seg.close()  # the owner closing after the cleanup: nothing left, nothing raised
    assert not os.path.exists(run_dir(key, run_id))
