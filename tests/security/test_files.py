"""Finding 10 (issue 15), issue 27 item 6: the files a run owns are private and cannot be steered.

Attacks: a symlink planted at the bundle's temp name (a fixed name would be
followed and the victim file overwritten); bundle files readable by other
users; ipc socket files in a shared /tmp, named after the run id, left behind
after the run; a run's socket directory created ahead of it by another user;
a `--run-dir` or `--checkpoint-dir` made by another user, or open to others
(they could delete checkpoints, or plant one that `--resume auto` follows);
symlinks planted in a run or checkpoint directory (the controller appended to
or overwrote the file they name).

"Another user" is uid 65534 (nobody): the directory is chowned to it, which
needs root; those tests are skipped otherwise.
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

from flodl_zmq import bundle, checkpoints
from flodl_zmq.errors import ConfigError, PrivateDirError
from flodl_zmq.links import (
    bind_local,
    local_dir,
    local_endpoints,
    remove_host_sockets,
    remove_local_dir,
)
from flodl_zmq.relay import Relay
from flodl_zmq.relay_config import RelayConfig
from flodl_zmq.runlog import EVENTS_FILE, RunLog
from flodl_zmq.runreport import REPORT_FILE, write_report
from flodl_zmq.settings import Settings
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


def test_a_rank_finds_the_socket_directory_another_hosts_relay_removed_right_after_its_mkdir(runtime, monkeypatch):
    # Three agents on one machine (CI): host c's relay, stopped when its rank left, removed the empty shared
    # directory between rank 0's mkdir and chmod, and rank 0 died with "No such file or directory".
    key, run_id = new_key(), os.urandom(16)
    chmod, raced = os.chmod, []

    def chmod_after_the_other_host(path, mode):
        if not raced:
            raced.append(path)
            os.rmdir(path)  # the other host's remove_ipc, once the directory was empty
        chmod(path, mode)

    monkeypatch.setattr(os, "chmod", chmod_after_the_other_host)
    control, _ = local_endpoints(key, run_id, "host-a")
    directory = os.path.dirname(control[len("ipc://"):])
    assert raced == [directory]
    assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
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


# ---------------------------------------------------------------------------- issue 27: run and checkpoint dirs

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's (chown) needs root")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def checkpoint_in(directory, round: int = 7) -> str:
    """A complete checkpoint of round `round` in `directory`; its stem."""
    stem = checkpoints.stem_for(directory, round)
    bundle.save(stem, {"w": torch.full((4,), float(round))}, {"epoch": 1, "world": {"a": [0]}})
    return str(stem)


@needs_root
def test_a_run_directory_owned_by_another_user_is_refused_naming_its_owner_and_the_fix(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, NOBODY, NOBODY)
    with pytest.raises(PrivateDirError, match=rf"run directory .*{run_dir}.*owner uid {NOBODY}.*use a directory of your own"):
        RunLog(run_dir)
    assert os.listdir(run_dir) == []


def test_a_run_directory_others_may_write_in_is_refused_with_chmod_700_as_the_fix(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chmod(run_dir, 0o777)
    with pytest.raises(PrivateDirError, match=rf"mode 0777.*chmod 700 {run_dir}"):
        RunLog(run_dir)


def test_symlinks_planted_in_a_run_directory_are_never_followed(tmp_path, caplog):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.symlink(victim, run_dir / EVENTS_FILE)  # the log would append to the victim
    os.symlink(victim, run_dir / REPORT_FILE)  # `flodl-zmq report` would overwrite it
    log = RunLog(run_dir)
    log.write("start", mode="alone")
    log.close()
    assert victim.read_bytes() == b"precious", "the run log followed a planted symlink"
    assert "disabled" in caplog.text and EVENTS_FILE in caplog.text  # said once; the run goes on without it
    with pytest.raises(ConfigError, match=f"cannot read {run_dir / EVENTS_FILE}"):
        write_report(run_dir)  # the planted log is not read either
    (run_dir / EVENTS_FILE).unlink()
    RunLog(run_dir).write("start", mode="alone")
    write_report(run_dir)
    assert victim.read_bytes() == b"precious", "the report followed a planted symlink"
    assert not (run_dir / REPORT_FILE).is_symlink() and mode(run_dir / REPORT_FILE) == 0o600


def test_directories_the_run_creates_are_0700_and_its_files_0600(tmp_path):
    umask = os.umask(0o022)  # the usual one: it would leave 0755 directories and 0644 files
    try:
        run_dir = tmp_path / "runs" / "today"
        RunLog(run_dir).write("start", mode="alone")
        ckpt = tmp_path / "ckpt" / "run-1"
        checkpoint_in(ckpt)
    finally:
        os.umask(umask)
    for d in (run_dir.parent, run_dir, ckpt.parent, ckpt):
        assert mode(d) == 0o700, f"{d} is {mode(d):04o}"
    for f in (run_dir / EVENTS_FILE, *ckpt.iterdir()):
        assert mode(f) == 0o600, f"{f} is {mode(f):04o}"


@needs_root
def test_resume_auto_never_continues_a_checkpoint_in_another_users_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    checkpoint_in(ckpt)  # planted by the directory's owner
    os.chown(ckpt, NOBODY, NOBODY)
    with pytest.raises(PrivateDirError, match=rf"checkpoint directory .*owner uid {NOBODY}"):
        checkpoints.resolve("auto", str(ckpt))
    with pytest.raises(PrivateDirError, match=f"owner uid {NOBODY}"):
        checkpoints.resolve(str(ckpt), None)


def test_resume_auto_refuses_a_checkpoint_directory_others_may_write_in(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    checkpoint_in(ckpt)
    os.chmod(ckpt, 0o775)
    with pytest.raises(PrivateDirError, match=rf"mode 0775.*chmod 700 {ckpt}"):
        checkpoints.pin_resume(Settings(resume="auto", checkpoint_dir=str(ckpt)))


@needs_root
def test_the_controller_does_not_start_checkpointing_into_another_users_directory(tmp_path):
    from unit.test_checkpoints import keeper

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    os.chown(ckpt, NOBODY, NOBODY)
    k = keeper(checkpoint_dir=str(ckpt))
    with pytest.raises(PrivateDirError, match=r"checkpoint directory \(--checkpoint-dir\)"):
        k.start(0.0, 0, None)
    assert k.writer is None


def test_a_checkpoint_planted_as_symlinks_is_refused_not_resumed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = checkpoint_in(elsewhere, 99)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    checkpoint_in(ckpt, 7)
    for suffix in (".pt", ".meta.json"):  # a newer "checkpoint" that is only symlinks to another file
        os.symlink(planted + suffix, str(checkpoints.stem_for(ckpt, 99)) + suffix)
    stem = checkpoints.resolve("auto", str(ckpt))
    with pytest.raises(ConfigError, match="never through a symlink"):
        checkpoints.Resumed.load(str(stem))


@needs_root
def test_a_checkpoint_file_of_another_user_is_not_read(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    stem = checkpoint_in(ckpt)
    os.chown(stem + ".pt", NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"{stem}\.pt: cannot read it .*owner uid {NOBODY}"):
        bundle.load(stem)


def test_a_completion_marker_planted_as_a_symlink_is_not_followed_to_read_or_to_write(tmp_path):
    from unit.test_checkpoints import keeper

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(mode=0o700)
    checkpoint_in(ckpt)
    victim = tmp_path / "victim"
    victim.write_bytes(b'{"run_id": "planted"}')
    os.symlink(victim, ckpt / checkpoints.COMPLETED)
    # Read: refused by name (a symlink could make --resume auto believe any run complete), never followed.
    with pytest.raises(ConfigError, match=f"{checkpoints.COMPLETED} cannot be read"):
        checkpoints.resolve("auto", str(ckpt))
    # Written: the marker replaces the symlink, the file it pointed at is untouched.
    keeper(checkpoint_dir=str(ckpt)).mark_completed(saved=None)
    assert victim.read_bytes() == b'{"run_id": "planted"}'
    assert not (ckpt / checkpoints.COMPLETED).is_symlink() and mode(ckpt / checkpoints.COMPLETED) == 0o600
