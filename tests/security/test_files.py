"""Finding 10 (issue 15): bundles and ipc socket files are private and cannot be steered.

Attacks: a symlink planted at the bundle's temp name (a fixed name would be
followed and the victim file overwritten); bundle files readable by other
users; ipc socket files in a shared /tmp, named after the run id, left behind
after the run; a run's socket directory created ahead of it by another user.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import pytest
import torch
import zmq
from transport.dataplane_helpers import FakeController, endpoints

from flodl_zmq import bundle
from flodl_zmq.errors import PrivateDirError
from flodl_zmq.links import (
    bind_local,
    local_dir,
    local_endpoints,
    remove_host_sockets,
    remove_local_dir,
)
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.wire import new_key

pytestmark = pytest.mark.timeout(60)


def test_a_symlink_at_the_bundle_temp_name_is_not_followed_and_bundles_are_0600(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    stem = tmp_path / "runs" / "digits"
    stem.parent.mkdir()
    # Every temp name a fixed-name writer could use, pointing at the victim.
    for name in ("digits.pt.tmp", "digits.meta.json.tmp", "digits.pt.tmp.tmp"):
        os.symlink(victim, stem.parent / name)
    state = {"w": torch.arange(4.0)}
    meta = bundle.save(stem, state, {"epoch": 1})
    assert victim.read_bytes() == b"precious", "the bundle write followed a planted symlink"
    model_path, meta_path = bundle.paths(stem)
    for p in (model_path, meta_path):
        assert not p.is_symlink()
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, f"{p.name} is readable by other users"
    loaded, got = bundle.load(stem)
    assert torch.equal(loaded["w"], state["w"]) and got["epoch"] == 1 and meta == meta_path
    leftovers = [p.name for p in stem.parent.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]
    assert leftovers == []


@pytest.fixture
def runtime(monkeypatch):
    """A short $XDG_RUNTIME_DIR (ipc paths are limited to 107 bytes; pytest's tmp_path is long)."""
    base = tempfile.mkdtemp(prefix="fz-", dir="/tmp")
    monkeypatch.setenv("XDG_RUNTIME_DIR", base)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_ipc_sockets_live_in_a_private_directory_named_without_the_run_id_and_are_removed(runtime, tmp_path):
    key, run_id = new_key(), os.urandom(16)
    control, data = local_endpoints(key, run_id, "host-a")
    d = local_dir(key, run_id)
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    for ep in (control, data):
        assert ep.startswith(f"ipc://{d}/") and run_id.hex()[:8] not in ep and "host-a" not in ep
    ctx = zmq.Context()
    eps = endpoints("ipc", tmp_path)
    ctl = FakeController(ctx, key, run_id, eps)
    relay = Relay(RelayConfig("host-a", (0,), key, run_id, eps["control"], eps["data"], eps["bcast"], control, data,
                              rank_silence_at_relay_s=30.0, host_token=bytes(32)), ctx)
    try:
        relay.start()
        ctl.data_record()
        assert sorted(os.listdir(d)) == sorted(os.path.basename(ep) for ep in (control, data))
    finally:
        relay.stop()
        ctx.destroy(0)
    assert not os.path.exists(d), "the relay's socket files (and their directory) must go when it stops"
    remove_local_dir(key, run_id)  # the launcher's cleanup after a clean stop: nothing left, nothing raised


def test_a_relay_binds_after_another_hosts_agent_removed_the_shared_socket_directory(runtime):
    # Hosts of one run on one machine share the directory; at a re-form the agent of a host whose old
    # relay is gone removes it once empty, maybe just after a new relay made it (a CI failure).
    key, run_id = new_key(), os.urandom(16)
    control, _ = local_endpoints(key, run_id, "host-a")
    directory = os.path.dirname(control[len("ipc://"):])
    remove_host_sockets(key, run_id, "host-b")
    assert not os.path.exists(directory)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        bind_local(sock, control)
        assert os.path.exists(control[len("ipc://"):])
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
    finally:
        sock.close(0)
        ctx.term()
        remove_local_dir(key, run_id)


def test_a_socket_directory_created_ahead_of_the_run_is_refused_with_a_named_error(runtime):
    key, run_id = new_key(), os.urandom(16)
    path = local_dir(key, run_id)
    os.chmod(path, 0o777)  # as if another user made it first, open for them to bind in
    with pytest.raises(PrivateDirError, match="not private.*remove it"):
        local_endpoints(key, run_id, "host-a")
    remove_local_dir(key, run_id)
    assert os.path.exists(path), "cleanup must leave a directory that is not private alone"
    os.rmdir(path)
