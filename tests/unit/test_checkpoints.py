"""Checkpoints (flodl_zmq/checkpoints.py): when one is due, keep-last-K, failed writes, the kept consensus, a re-form.

The writer is tested against real filesystems: a path that cannot be a
directory, and (as root) a tmpfs too small for a second checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from flodl_zmq import bundle, checkpoints, int8
from flodl_zmq.checkpoints import CheckpointPolicy, CheckpointWriter, ShardedOuter, Snapshot
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import ProcessEnv
from flodl_zmq.errors import ConfigError, RunComplete
from flodl_zmq.job import Job
from flodl_zmq.result import TrainResult
from flodl_zmq.settings import Settings
from flodl_zmq.shards import Cut, ShardMap, state_frames
from flodl_zmq.tensors import bf16_from_f32, f32_from_bf16
from flodl_zmq.wire import records as rec
from flodl_zmq.wire_format import CHUNK_MAX_BYTES, CHUNK_VALUES, INT8, named


def writer(directory, keep=2) -> CheckpointWriter:
    return CheckpointWriter(directory, keep, lambda flat: {"w": flat.clone()})


def snap(round: int, n: int = 16) -> Snapshot:
    return Snapshot(round, np.full(n, float(round), dtype=np.float32), {"round": round})


def test_policy_is_due_after_the_period_an_epoch_end_or_n_rounds_never_without_a_new_round():
    p = CheckpointPolicy(every_s=10.0, every_rounds=0, started_at=0.0)
    assert not p.due(5.0, 3)
    assert p.due(10.0, 3)
    p.taken(10.0, 3)
    assert not p.due(30.0, 3), "no round since the last checkpoint: nothing new to write"
    assert not p.due(15.0, 4)
    p.epoch_ended = True
    assert p.due(15.0, 4)
    p.taken(15.0, 4)
    assert not p.epoch_ended
    r = CheckpointPolicy(every_s=0.0, every_rounds=3, started_at=0.0)
    assert not r.due(1e9, 2) and r.due(0.0, 3)


def test_the_writer_keeps_the_newest_k_and_newest_names_the_last(tmp_path):
    for r in (3, 7, 12):  # one writer each: none is replaced before it is written
        w = writer(tmp_path, keep=2)
        w.submit(snap(r))
        assert w.close(10.0)
    assert [s.name for s in checkpoints.complete(tmp_path)] == ["ckpt-r000000007", "ckpt-r000000012"]
    state, meta = bundle.load(checkpoints.newest(tmp_path))
    assert meta["round"] == 12 and torch.equal(state["w"], torch.full((16,), 12.0))
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_an_outer_step_s_momentum_is_kept_with_its_checkpoint_and_pruned_with_it(tmp_path):
    for r in (3, 7, 12):
        w = writer(tmp_path, keep=2)
        s = snap(r)
        w.submit(Snapshot(s.round, s.consensus, s.meta, np.full(16, -float(r), dtype=np.float32)))
        assert w.close(10.0)
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".outer.pt")) == [
        "ckpt-r000000007.outer.pt", "ckpt-r000000012.outer.pt"]
    assert torch.equal(bundle.load_outer(checkpoints.newest(tmp_path)), torch.full((16,), -12.0))


def test_a_newer_snapshot_replaces_one_not_yet_written(tmp_path):
    w = writer(tmp_path, keep=5)
    with w._cv:  # hold the writer back: both submits land before it looks
        w.submit(snap(1))
        w.submit(snap(2))
    assert w.close(10.0)
    assert [s.name for s in checkpoints.complete(tmp_path)] == ["ckpt-r000000002"]


def test_an_empty_or_missing_directory_has_no_newest(tmp_path):
    assert checkpoints.newest(tmp_path) is None
    assert checkpoints.newest(tmp_path / "absent") is None


def test_an_unwritable_path_is_reported_with_the_path_and_the_error_and_nothing_stops(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    w = writer(blocker / "ckpts")
    w.submit(snap(5))
    assert w.close(10.0)
    assert w.status.failed == 1 and w.status.written == 0
    assert str(blocker / "ckpts" / "ckpt-r000000005") in w.status.last_error
    assert "could not write" in caplog.text and "not-a-dir" in caplog.text


@contextlib.contextmanager
def small_disk(tmp_path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (a full disk to write to): needs root; skips where it cannot be mounted."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_full_disk_keeps_the_previous_checkpoint_valid_and_leaves_no_partial_files(tmp_path):
    with small_disk(tmp_path, "96k") as mnt:
        n = 12 * 1024  # 48 KiB of f32: one checkpoint fits in 96 KiB, two do not
        w = writer(mnt, keep=3)
        w.submit(snap(1, n))
        w.close(10.0)
        w = writer(mnt, keep=3)
        w.submit(snap(2, n))
        assert w.close(10.0)
        assert w.status.failed == 1
        assert str(mnt / "ckpt-r000000002") in w.status.last_error
        assert "No space left on device" in w.status.last_error
        assert checkpoints.newest(mnt) == mnt / "ckpt-r000000001"
        state, _ = bundle.load(checkpoints.newest(mnt))
        assert state["w"].numel() == n
        assert sorted(os.listdir(mnt)) == ["ckpt-r000000001.meta.json", "ckpt-r000000001.pt"]


def test_resume_names_a_stem_a_directory_s_newest_or_auto_s_newest_if_any(tmp_path):
    assert checkpoints.resolve(None, str(tmp_path)) is None
    assert checkpoints.resolve("auto", str(tmp_path)) is None  # the first start of a restartable run
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        checkpoints.resolve(str(tmp_path), None)
    with pytest.raises(ConfigError, match="--checkpoint-dir, which is not set"):
        checkpoints.resolve("auto", None)
    for r in (4, 9):
        w = writer(tmp_path)
        w.submit(snap(r))
        w.close(10.0)
    newest = tmp_path / "ckpt-r000000009"
    assert checkpoints.resolve("auto", str(tmp_path)) == newest
    assert checkpoints.resolve(str(tmp_path), None) == newest
    assert checkpoints.resolve(str(tmp_path / "ckpt-r000000004"), None) == tmp_path / "ckpt-r000000004"
    assert checkpoints.resolve(str(tmp_path / "ckpt-r000000004.meta.json"), None) == tmp_path / "ckpt-r000000004"
    # A typo was named as the Trainer's resume_from, a setting the user never gave.
    with pytest.raises(ConfigError, match=r"--resume nope \(FLODL_RESUME\): no checkpoint directory and no bundle"):
        checkpoints.resolve("nope", None)
    # Pinned once by what starts the run: every process then continues that stem, whatever comes later.
    pinned = checkpoints.pin_resume(Settings(resume="auto", checkpoint_dir=str(tmp_path)))
    assert pinned.resume == str(newest) and checkpoints.pin_resume(pinned) == pinned
    assert checkpoints.pin_resume(Settings(checkpoint_dir=str(tmp_path))).resume is None


def keeper(n: int = 4, wire_dtype: str = "f32", **settings) -> checkpoints.Keeper:
    """A controller's keeper of an `n`-parameter model, for a world of ranks 0 and 1 on host a."""
    job = Job(model=lambda: torch.nn.Linear(n - 1, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
              train_step=lambda m, b: m(b[0]).sum(), dataset=TensorDataset(torch.zeros(8, n - 1)), batch_size=2,
              epochs=1, wire_dtype=wire_dtype)
    penv = ProcessEnv(role="controller", controller=ControllerAddress.parse("127.0.0.1:7300"), key=b"k" * 32,
                      run_id=b"r" * 16, incarnation=b"i" * 16, world={"a": (0, 1)}, settings=Settings(**settings))
    return checkpoints.Keeper(job, penv, incarnation=2, consensus=np.zeros(n, dtype=np.float32))


def test_resume_auto_after_the_run_completed_resumes_nothing_and_says_the_run_is_complete(tmp_path):
    w = writer(tmp_path)
    w.submit(snap(7))
    w.close(10.0)
    keeper(checkpoint_dir=str(tmp_path)).mark_completed(saved=None)
    assert oct(os.stat(tmp_path / checkpoints.COMPLETED).st_mode & 0o777) == "0o600"
    # RunComplete: `flodl-zmq` exits 0 with this message (the compose restart test runs the command).
    with pytest.raises(RunComplete, match=f"run {(b'r' * 16).hex()[:8]} is complete .*nothing was started"):
        checkpoints.resolve("auto", str(tmp_path))
    # A checkpoint named outright is the user's explicit choice: still resumed.
    assert checkpoints.resolve(str(tmp_path), None) == tmp_path / "ckpt-r000000007"


def test_the_keeper_keeps_the_newest_positive_mass_consensus_of_the_runs_wire_format_in_f32():
    k = keeper()
    k.keep(rec.Consensus(round=3, mass=1.0), [np.full(4, 2.0, dtype=np.float32)])
    assert k.round == 3 and k.consensus.tolist() == [2.0] * 4
    k.keep(rec.Consensus(round=2, mass=1.0), [np.full(4, 9.0, dtype=np.float32)])  # older: not kept
    k.keep(rec.Consensus(round=4, mass=0.0), [np.full(4, 9.0, dtype=np.float32)])  # nothing realized
    k.keep(rec.Consensus(round=5, mass=1.0), [np.full(3, 9.0, dtype=np.float32)])  # not this model's size
    assert k.round == 3 and k.consensus.tolist() == [2.0] * 4
    bf16 = [bf16_from_f32(np.full(4, 1.5, dtype=np.float32), np.empty(4, dtype=np.uint16))]
    k.keep(rec.Consensus(round=6, mass=1.0), bf16)  # not this run's wire format
    assert k.round == 3 and k.consensus.tolist() == [2.0] * 4
    k = keeper(wire_dtype="bf16")
    k.keep(rec.Consensus(round=6, mass=1.0), bf16)
    assert k.round == 6 and k.consensus.dtype == np.float32 and k.consensus.tolist() == [1.5] * 4
    k = keeper(wire_dtype="int8")
    k.keep(rec.Consensus(round=7, mass=1.0), INT8.resume_payload(np.full(4, 1.5, dtype=np.float32)))
    assert k.round == 7 and k.consensus.dtype == np.float32 and k.consensus.tolist() == [1.5] * 4


def test_the_keeper_checkpoints_only_the_round_the_coordinator_counted_finished(tmp_path):
    k = keeper(checkpoint_dir=str(tmp_path), checkpoint_every_rounds=1)
    k.start(0.0, 0, None)
    k.keep(rec.Consensus(round=1, mass=1.0), [np.ones(4, dtype=np.float32)])
    k.maybe_checkpoint(1.0, 1, lambda: {"epoch": 0})  # the coordinator has not counted round 1 yet
    assert k.status()["written"] == 0
    k.completed_round = 1
    k.maybe_checkpoint(1.0, 1, lambda: {"epoch": 0, "global_step": 5})
    k.close()
    _, meta = bundle.load(checkpoints.newest(tmp_path))
    assert checkpoints.newest(tmp_path).name == "ckpt-r000000001"
    assert meta["incarnation"] == 2 and meta["consensus_round"] == 1 and meta["world"] == {"a": [0, 1]}
    assert k.status()["written"] == 1


def test_a_bundle_of_a_copy_behind_the_last_finished_round_says_which_round_it_holds(caplog):
    k = keeper()
    k.keep(rec.Consensus(round=3, mass=1.0), [np.ones(4, dtype=np.float32)])
    k.completed_round = 3
    with caplog.at_level(logging.WARNING):
        assert k.snapshot("completed", {"epoch": 0}).meta["consensus_round"] == 3
    assert not caplog.records
    k.completed_round = 4  # a host shard's slice of round 4 never reached the controller
    with caplog.at_level(logging.WARNING):
        assert k.snapshot("completed", {"epoch": 0}).meta["consensus_round"] == 3
    assert "the completed bundle holds the consensus of round 3, not of round 4" in caplog.text


def test_a_world_change_resumes_the_new_world_from_its_checkpoint_in_the_same_run():
    k = keeper()
    change = checkpoints.WorldChange(TrainResult(model=None), {"a": (0, 1)}, {"a": (0, 1), "b": (2, 3)}, "/c/ckpt",
                                         b"i" * 16)
    job, penv = change.resumed(k.job, k.penv, "/runs/x")
    assert job.resume_from == "/c/ckpt" and job.run_dir == "/runs/x"
    assert penv.world == {"a": (0, 1), "b": (2, 3)} and penv.settings.resume == "/c/ckpt"
    assert change.describe() == "2 -> 4 ranks (+b)"
    event = change.join_event({"epoch": 1, "consensus_round": 7})
    assert (event["epoch"], event["round"]) == (1, 7)
    assert event["reason"] == "world re-formed at epoch 2, round 7: 2 -> 4 ranks (+b)"


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16", "int8"])
def test_a_consensus_in_chunks_is_kept_and_checkpointed_as_the_flat_vector_it_encodes(tmp_path, wire_dtype):
    n = 2 * CHUNK_VALUES + 4321
    k = keeper(n, wire_dtype, checkpoint_dir=str(tmp_path), checkpoint_every_rounds=1)
    wire = named(wire_dtype)
    flat = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    payload = wire.resume_payload(flat)  # the reducer's broadcast: one frame per chunk (two under int8)
    assert len(payload) == 3 * (2 if wire is INT8 else 1) and all(f.nbytes <= CHUNK_MAX_BYTES for f in payload)
    want = np.empty(n, np.float32)  # the flat vector's own rounding, not chunk by chunk
    if wire is INT8:
        q, scales = np.empty(n, np.int8), np.empty(int8.blocks(n), np.float32)
        int8.quantize(flat, q, scales)
        int8.dequantize(q, scales, want)
    elif wire_dtype == "bf16":
        f32_from_bf16(bf16_from_f32(flat, np.empty(n, np.uint16)), want)
    else:
        want = flat
    k.start(0.0, 0, None)
    k.keep(rec.Consensus(round=1, mass=1.0), payload)
    assert k.round == 1 and np.array_equal(k.consensus, want)
    k.completed_round = 1
    k.maybe_checkpoint(1.0, 1, lambda: {"epoch": 0})
    k.close()
    state, _ = bundle.load(checkpoints.newest(tmp_path))
    assert np.array_equal(torch.cat([state["weight"].reshape(-1), state["bias"]]).numpy(), want)


def test_resuming_from_a_bundle_of_another_model_names_resume_from_and_the_mismatch(tmp_path):
    # Was a RuntimeError from torch's load_state_dict, alone and in the controller, naming neither.
    from flodl_zmq.api import train_alone

    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    bundle.save(tmp_path / "wide", torch.nn.Linear(4, 8).state_dict(), {"epoch": 1})
    job = Job(model=lambda: torch.nn.Linear(4, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
              train_step=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), dataset=data, batch_size=8, epochs=2,
              quiet=True, resume_from=str(tmp_path / "wide"), run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"resume_from='.*wide' holds another model .* size mismatch for weight"):
        train_alone(job)


@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_final_save_to_a_full_disk_names_save_path_and_keeps_the_bundle_there(tmp_path):
    # Was a bare OSError from deep in bundle.py, naming neither the setting nor the fix.
    from flodl_zmq.api import train_alone
    from flodl_zmq.errors import TrainingError

    with small_disk(tmp_path, "64k") as mnt:
        def job(width: int) -> Job:
            return Job(model=lambda: torch.nn.Linear(4, width), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                       train_step=lambda m, b: m(b[0]).square().mean(), dataset=TensorDataset(torch.randn(16, 4)),
                       batch_size=8, epochs=1, quiet=True, save_path=str(mnt / "m"), run_dir=str(tmp_path / "run"))

        train_alone(job(2))
        with pytest.raises(TrainingError, match=r"save_path='.*m': the bundle could not be written \(No space left"):
            train_alone(job(8192))  # 160 KiB of weights: more than the disk holds
        assert bundle.load(mnt / "m")[0]["weight"].shape == (2, 4)


def test_a_save_that_stopped_between_its_files_is_refused_by_name_not_resumed_with_the_older_state(tmp_path):
    # The final save writes over the same stem each run: model first, meta last. Killed in between, the
    # older meta lay beside the newer model, and resume trained the newer model from the older epoch.
    stem = tmp_path / "m"
    bundle.save(stem, {"w": torch.zeros(3)}, {"epoch": 1}, outer_momentum=torch.zeros(3))
    model_path, meta_path = bundle.paths(stem)
    older = meta_path.read_bytes()
    bundle.save(stem, {"w": torch.ones(3)}, {"epoch": 4}, outer_momentum=torch.ones(3))
    assert bundle.load(stem)[1]["epoch"] == 4 and bundle.load_outer(stem).sum() == 3
    meta_path.write_bytes(older)  # the newer save's meta never landed
    with pytest.raises(ConfigError, match=r"m\.pt is not the one m\.meta\.json was written with.*ckpt-r"):
        bundle.load(stem)
    with pytest.raises(ConfigError, match=r"m\.outer\.pt is not the one m\.meta\.json was written with"):
        bundle.load_outer(stem)


def test_a_meta_without_digests_still_loads_and_damaged_digests_are_named(tmp_path):
    stem = tmp_path / "m"
    bundle.save(stem, {"w": torch.ones(2)}, {"epoch": 2})
    meta_path = bundle.paths(stem)[1]
    meta = json.loads(meta_path.read_text())
    del meta["digests"]  # a bundle written before the digests
    meta_path.write_text(json.dumps(meta))
    assert bundle.load(stem)[0]["w"].sum() == 2
    meta_path.write_text(json.dumps({**meta, "digests": ["x"]}))
    with pytest.raises(ConfigError, match=r"m\.meta\.json: its 'digests' are not a map"):
        bundle.load(stem)


# ---------------------------------------------------------------- a sharded run's outer state (PROTOCOL.md 10.9 item 12)


def test_a_sharded_bundle_waits_for_every_shards_outer_state_of_the_kept_round_or_a_later_one(caplog):
    cut = Cut.of(ShardMap.parse("h1=tcp://10.0.0.2:7400"), 2 * 4096, 1)  # two shards, a block each
    asked: list[int] = []
    kept = {"round": 7}
    outer = ShardedOuter(cut, asked.append, lambda: kept["round"])
    model, momentum = np.arange(8192, dtype=np.float32), np.full(8192, 0.5, np.float32)

    def send(shard: int, round_id: int) -> None:
        v = cut.values(shard)
        outer.add(shard, round_id, state_frames(model[v.start:v.stop], momentum[v.start:v.stop]))

    assert not outer.ready() and asked == [7]  # due at round 7: every shard is asked
    assert not outer.ready() and asked == [7]  # once a round
    send(0, 6)
    send(1, 6)  # whole, but older than the kept round: the bundle's model would lose round 7
    assert not outer.ready()
    send(0, 7)
    kept["round"] = 8  # the kept copy moved on before shard 1 answered: asked again (a request may be lost)
    send(1, 7)
    assert not outer.ready() and asked == [7, 8]
    send(0, 9)
    send(1, 9)  # a later round than the kept one does: the coordinator's state is never newer than the model
    assert outer.ready()
    got = outer.state()
    assert got is not None
    np.testing.assert_array_equal(got[0], model)
    np.testing.assert_array_equal(got[1], momentum)
    # The next bundle takes the same state while no round was kept since; one written before the shards
    # answer for a newer kept round holds no momentum (its model is the kept consensus), and says so.
    assert outer.ready() and outer.state() is not None
    kept["round"] = 10
    with caplog.at_level("WARNING"):
        assert outer.state() is None
    assert "without the outer momentum" in caplog.text
    assert not outer.ready() and asked == [7, 8, 10]


def test_a_sharded_bundle_whose_shard_never_answers_is_written_without_the_momentum_after_a_while(caplog):
    cut = Cut.of(ShardMap.parse("h1=tcp://10.0.0.2:7400"), 2 * 4096, 1)
    clock = {"now": 100.0}
    outer = ShardedOuter(cut, lambda r: None, lambda: 7, clock=lambda: clock["now"])
    assert not outer.ready()
    clock["now"] += checkpoints.OUTER_WAIT_S - 1
    assert not outer.ready()
    clock["now"] += 2  # shard 1's relay never answered: the bundle goes out rather than none at all
    assert outer.ready()
    with caplog.at_level("WARNING"):
        assert outer.state() is None
    assert "cut off from the controller" in caplog.text
    assert not outer.ready()  # the next bundle waits afresh
