"""Finding 9 (issue 15): a local user must not kill a relay, or its cleanup, through /dev/shm.

Segment names are predictable (run id and host hash) and /dev/shm is
world-writable. The attacks: squat the relay's segment name and the run's
segment directory before the run starts; plant files another user owns where
cleanup looks. Afterwards the relay keeps serving (payloads go framed, with a
named error in the log) and cleanup never raises.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import zmq
from transport.dataplane_helpers import WAIT_S, FakeController, FakeRank, endpoints

from flodl_zmq.errors import ShmError
from flodl_zmq.relay import Relay, RelayConfig
from flodl_zmq.wire import Channel, Codec, new_key
from flodl_zmq.wire.records import Consensus, RelayHello, RoundFrame
from flodl_zmq.wire.shm import (
    Segment,
    SegmentMap,
    by_reference,
    host_owner,
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


def test_a_squatted_segment_name_and_directory_do_not_stop_the_relay(tmp_path):
    key, run_id = new_key(), os.urandom(16)
    # Where the relay's consensus segment is created (the name a squatter can predict), and
    # the run's segment directory: both taken by "another user" before the run starts.
    squatted = [os.path.join(shm_dir(), segment_prefix(run_id, host_owner("a")) + "1"), run_dir(run_id)]
    squat(squatted[0], directory=False)
    squat(squatted[1], directory=True)
    ctx = zmq.Context()
    eps = endpoints("ipc", tmp_path)
    ctl = FakeController(ctx, key, run_id, eps)
    relay = Relay(RelayConfig("a", (0,), key, run_id, eps["control"], eps["data"], eps["bcast"], eps["a-control"],
                              eps["a-data"], heartbeat_deadline_s=30.0, consensus_deadline_s=30.0), ctx)
    rank = FakeRank(ctx, 0, key, run_id, eps["a-control"], eps["a-data"])
    segment = None
    try:
        relay.start()
        assert isinstance(ctl.data_record().record, RelayHello)
        x = np.arange(256, dtype=np.float32)
        try:  # as a real rank does: by reference when its segment can be made, else framed
            segment = Segment(run_id, rank_owner(0))
            view = segment.layout([x.nbytes])[0]
            placed = np.frombuffer(view, np.float32)
            placed[:] = x
            rank.data.send_multipart(by_reference(rank.codec, RoundFrame(1, 0, 1.0), [placed], segment))
        except ShmError as exc:
            assert "remove it" in str(exc) and run_dir(run_id) in str(exc)
            rank.deposit(1, 1.0, [x])
        hf = ctl.data_record()
        np.testing.assert_array_equal(hf.payload[0], x)
        # The consensus goes back; with by-reference ranks the relay writes it into its own segment.
        ctl.data.send_multipart([ctl.data_route, b"bcast", *ctl.codec.encode(Consensus(1, 1.0), [x],
                                                                            channel=Channel.BROADCAST)])
        assert rank.data.poll(int(WAIT_S * 1000)), "no consensus reached the rank"
        env = SegmentMap(run_id).decode(Codec(key, run_id, "test"), rank.data.recv_multipart(), host_owner("a"),
                                        Channel.BROADCAST, replay=False)
        np.testing.assert_array_equal(env.payload[0], x)
        assert relay.running and relay.error is None, f"the relay stopped: {relay.error!r}"
    finally:
        if segment is not None:
            segment.close()
        rank.close()
        relay.stop()
        ctx.destroy(0)
        for path in squatted:
            remove(path)
        unlink_run(run_id)


@pytest.mark.skipif(os.geteuid() != 0, reason="playing a second user needs root (setuid in a forked child)")
def test_cleanup_never_raises_on_files_another_user_owns():
    run_id = os.urandom(16)
    # Another user's files where cleanup looks: a flat name with the run's prefix next to the
    # run directory, and the run directory itself with a segment in it.
    flat = os.path.join(shm_dir(), segment_prefix(run_id, rank_owner(0)) + "1")
    open(flat, "wb").close()
    os.mkdir(run_dir(run_id), 0o700)
    inner = os.path.join(run_dir(run_id), segment_prefix(run_id, rank_owner(0)) + "1")
    open(inner, "wb").close()
    try:
        pid = os.fork()
        if pid == 0:  # the run's own user is "nobody"; every file above is root's
            code = 1
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                unlink_run(run_id)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "unlink_run raised on another user's file"
        assert os.path.exists(inner), "cleanup must not touch a directory that is not the run user's"
    finally:
        remove(flat)
        remove(run_dir(run_id))


def test_cleanup_removes_the_run_directory_and_leaves_dev_shm_clean():
    run_id = os.urandom(16)
    seg = Segment(run_id, rank_owner(3))
    seg.layout([128])
    assert os.stat(run_dir(run_id)).st_mode & 0o777 == 0o700
    assert unlink_run(run_id) == 1
    assert not os.path.exists(run_dir(run_id))
    seg.close()  # the owner closing after the cleanup: nothing left, nothing raised
    assert not [n for n in os.listdir(shm_dir()) if n.startswith(f"flodl-{run_id.hex()}")]
