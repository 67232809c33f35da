"""The controller's side of a sharded run (flodl_zmq/controller_shards.py, settings, launch): what it refuses
at start and names, the slices it expects, and who is given the shards' map and the route secret."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from flodl_zmq import cli, launch
from flodl_zmq.controller import ControllerOptions
from flodl_zmq.controller_service import ControllerService
from flodl_zmq.controller_shards import check_sharded, shard_cut, shard_starts
from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.environment import CHILD_SCOPES, ProcessEnv
from flodl_zmq.errors import ConfigError
from flodl_zmq.job import Job
from flodl_zmq.join import JoinConfig
from flodl_zmq.outer import OuterConfig, OuterOptimizer, outer_from_start
from flodl_zmq.settings import Settings
from flodl_zmq.shards import ShardMap
from flodl_zmq.wire_format import BF16, CHUNK_VALUES, F32, INT8

pytestmark = pytest.mark.usefixtures("alone")  # tests/conftest.py: no role, runs under tmp_path

TWO = ShardMap.parse("h1=tcp://10.0.0.2:7400,h2=tcp://10.0.0.3:7400")  # three shards: the controller's and two
HOSTS = ("h0", "h1", "h2")


def sizes(shards: ShardMap = TWO, hosts: tuple[str, ...] = HOSTS, n_values: int = 5 * CHUNK_VALUES, wire=F32
          ) -> list[int]:
    cut = shard_cut(shards, hosts, n_values, wire)
    return [cut.frames(k) for k in range(len(cut.parts))]


@pytest.mark.parametrize("wire", [F32, BF16], ids=["f32", "bf16"])
def test_each_shard_expects_a_frame_for_each_chunk_its_values_meet(wire):
    # 5 chunks (the last one short) over 3 shards, a third of the values each: chunks 0-1, 1-3 and 3-4.
    assert sizes(n_values=5 * CHUNK_VALUES - 7, wire=wire) == [2, 3, 2]


def test_under_int8_a_shard_expects_values_and_scales_for_each_part():
    assert sizes(n_values=5 * CHUNK_VALUES - 7, wire=INT8) == [4, 6, 4]


@pytest.mark.parametrize(("kw", "named"), [
    ({"hosts": ("h0", "h1")}, r"lists h2, not hosts of this world \(h0, h1\)"),
    ({"n_values": 8000}, r"3 shards for a model of 8000 values \(2 block\(s\) of 4096\).*list at most 1 host"),
], ids=["host-not-in-world", "fewer-blocks-than-shards"])
def test_a_sharded_run_refuses_what_it_does_not_run_yet_naming_the_cause_and_the_fix(kw, named):
    with pytest.raises(ConfigError, match=named) as err:
        sizes(**kw)
    assert "shards" in str(err.value)


def test_each_host_shard_starts_from_its_slice_of_the_outer_state_and_shard_0_steps_its_own():
    # 5 chunks over 3 shards; the first 4 chunks and 5 values are parameters, the rest buffers.
    n, params = 5 * CHUNK_VALUES - 7, 4 * CHUNK_VALUES + 5
    whole = OuterOptimizer(OuterConfig("nesterov", 0.7, 0.9), np.arange(n, dtype=np.float32),
                           np.linspace(-1, 1, n, dtype=np.float32), stepped=params)
    cut = shard_cut(TWO, HOSTS, n, F32)
    outer0, starts = shard_starts(TWO, cut, whole)
    assert sorted(starts) == ["h1", "h2"]
    assert outer0 is not None and outer0.config == whole.config and outer0.stepped == len(cut.values(0))
    np.testing.assert_array_equal(outer0.global_model, whole.global_model[cut.values(0).start:cut.values(0).stop])
    for k, host in ((1, "h1"), (2, "h2")):
        start, frames = starts[host]
        values = cut.values(k)
        assert (start.shard, start.outer, start.lr, start.momentum) == (k, "nesterov", 0.7, 0.9)
        assert start.stepped == min(max(params - values.start, 0), len(values))
        # The model's frames, then the momentum's, f32, none longer than a chunk, the same shapes pair by pair.
        assert all(f.dtype == np.float32 and f.size <= CHUNK_VALUES for f in frames)
        assert [f.shape for f in frames[: len(frames) // 2]] == [f.shape for f in frames[len(frames) // 2:]]
        half = len(frames) // 2
        np.testing.assert_array_equal(np.concatenate(frames[:half]), whole.global_model[values.start:values.stop])
        np.testing.assert_array_equal(np.concatenate(frames[half:]), whole.momentum[values.start:values.stop])
        rebuilt = outer_from_start(start, frames, f"shard {k}")
        assert rebuilt.stepped == start.stepped
        np.testing.assert_array_equal(rebuilt.momentum, whole.momentum[values.start:values.stop])
    assert 0 < starts["h2"][0].stepped < len(cut.values(2))  # the last slice holds the buffers after its parameters


def test_a_run_without_an_outer_step_starts_each_host_shard_from_a_bare_record():
    cut = shard_cut(TWO, HOSTS, 5 * CHUNK_VALUES, F32)
    outer0, starts = shard_starts(TWO, cut, None)
    assert outer0 is None
    assert {h: (s.shard, s.outer, f) for h, (s, f) in starts.items()} == {"h1": (1, "none", []), "h2": (2, "none", [])}


def _job(**kw: Any) -> Job:
    data = TensorDataset(torch.zeros(16, 1), torch.zeros(16, dtype=torch.long))
    return Job(model=lambda: torch.nn.Linear(1, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
               train_step=lambda m, b: F.cross_entropy(m(b[0]), b[1]), dataset=data, batch_size=4, epochs=1,
               quiet=True, **kw)


def test_the_controller_refuses_a_sharded_run_of_a_model_too_small_before_it_binds_anything():
    # A 4-value model is one block: a second shard would have nothing to reduce and wait forever.
    penv = ProcessEnv(role="controller", controller=ControllerAddress("127.0.0.1", 7300), key=bytes(32),
                      run_id=bytes(16), incarnation=bytes(16), world={"a": (0,), "b": (1,)},
                      settings=Settings(shards="b=tcp://127.0.0.1:7400"), route_secret=bytes(32))
    with pytest.raises(ConfigError, match=r"2 shards for a model of 4 values \(1 block"):
        ControllerService(_job(), penv)


@pytest.mark.parametrize(("kw", "named"), [
    ({"curve": True}, r"with CURVE: the links to host shards cannot be encrypted"),
    ({"open_admission": True}, r"with --open-admission: any agent could claim a shard host's name"),
], ids=["curve", "open-admission"])
def test_flodl_zmq_controller_refuses_a_sharded_run_whose_shard_links_it_could_not_protect(kw, named):
    with pytest.raises(ConfigError, match=named):
        check_sharded(**{"curve": False, "open_admission": False, **kw})


def test_flodl_zmq_controller_takes_a_sharded_run_with_a_preshared_key():
    opts = ControllerOptions(ControllerAddress("127.0.0.1", 7300), ("train.py",), JoinConfig(), key=bytes(32),
                             settings=Settings(shards="h1=tcp://10.0.0.2:7400"))
    assert opts.settings.shard_map.shard_of("h1") == 1


def _launched(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> dict[str, ProcessEnv]:
    """The environment of each process `launch` would start (nothing is started)."""
    spawned: dict[str, ProcessEnv] = {}
    monkeypatch.setattr(launch, "runnable", lambda argv: False)  # no warm interpreter
    monkeypatch.setattr(launch.Cluster, "_spawn", lambda self, label, penv, **_: spawned.__setitem__(label, penv))
    cluster = launch.Cluster(argv=["train.py"], ranks_per_host=1, **kw)
    try:
        cluster.start()
    finally:
        cluster.shutdown()  # the pipes it opened for the children
    return spawned


def test_launch_with_shards_tells_every_process_the_map_and_only_shard_hosts_the_route_secret(monkeypatch):
    monkeypatch.delenv("FLODL_SHARDS", raising=False)
    spawned = _launched(monkeypatch, hosts=3, shards=2)
    controller = spawned["controller"]
    shards = controller.settings.shard_map
    assert [host for host, _ in shards.hosts] == ["h0", "h1"]
    assert {p.to_environ()["FLODL_SHARDS"] for p in spawned.values()} == {str(shards)}
    secret = controller.route_secret.hex()
    assert spawned["h0:relay"].to_environ()["FLODL_ROUTE_SECRET"] == secret
    assert spawned["h1:relay"].to_environ()["FLODL_ROUTE_SECRET"] == secret
    assert "FLODL_ROUTE_SECRET" not in spawned["h2:relay"].to_environ()
    assert not any("FLODL_ROUTE_SECRET" in spawned[f"h{h}:{h}"].to_environ() for h in range(3))  # never a rank
    # Each shard's two ports are its own, past the controller's four.
    base = controller.controller.port
    assert [shards.endpoints(k) for k in (1, 2)] == [
        (f"tcp://127.0.0.1:{base + 4}", f"tcp://127.0.0.1:{base + 5}"),
        (f"tcp://127.0.0.1:{base + 6}", f"tcp://127.0.0.1:{base + 7}")]


def test_launch_reads_the_shards_from_the_environment_like_every_run_setting(monkeypatch):
    monkeypatch.setenv("FLODL_SHARDS", "h1=tcp://127.0.0.1:7400")
    spawned = _launched(monkeypatch, hosts=2)
    assert spawned["h0:0"].to_environ()["FLODL_SHARDS"] == "h1=tcp://127.0.0.1:7400"
    assert "FLODL_ROUTE_SECRET" in spawned["h1:relay"].to_environ()
    assert "FLODL_ROUTE_SECRET" not in spawned["h0:relay"].to_environ()


def test_launch_hands_its_controller_the_host_silence_that_judges_a_stopped_shard_host(monkeypatch):
    # Under launch the variable was not read at all: a shard host was judged by the default 10 s, and a bad
    # value passed without a word, though the controller's error names FLODL_HOST_SILENCE as the fix.
    monkeypatch.setenv("FLODL_HOST_SILENCE", "30")
    spawned = _launched(monkeypatch, hosts=2, shards=1)
    controller = ProcessEnv.from_environ(spawned["controller"].to_environ())  # what the controller reads back
    assert controller is not None and controller.settings.host_silence_at_controller_s == 30.0


@pytest.mark.parametrize(("args", "env", "named"), [
    (["--hosts", "2", "--shards", "3"], {}, r"--shards 3: .* at most --hosts \(2\)"),
    (["--hosts", "2", "--shards", "1"], {"FLODL_SHARDS": "h1=tcp://127.0.0.1:7400"},
     r"--shards 1 and FLODL_SHARDS=.* give one of them"),
    # Under launch the variable was not read at all: -3 passed without a word.
    (["--hosts", "2", "--shards", "1"], {"FLODL_HOST_SILENCE": "-3"},
     r"host_silence_at_controller_s = -3\.0 is not allowed: it must be a finite number > 0"),
], ids=["more-shards-than-hosts", "flag-and-variable", "bad-host-silence"])
def test_launch_refuses_a_sharded_run_it_cannot_run_before_it_starts_any_process(args, env, named, tmp_path,
                                                                                 monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.delenv("FLODL_SHARDS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def started(*_: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(launch, "warm_interpreter", started)
    monkeypatch.setattr(launch.Cluster, "_spawn_cohort", started)
    assert cli.main(["launch", *args, "train.py"]) == 2
    assert re.search(named, capsys.readouterr().err)


def test_a_bad_shards_entry_is_refused_by_name_when_the_settings_are_read():
    with pytest.raises(ConfigError, match=r"shards entry h1=10\.0\.0\.2:7400: .*tcp://ADDRESS:PORT.*FLODL_SHARDS"):
        Settings.from_environ({"FLODL_SHARDS": "h1=10.0.0.2:7400"})


def test_the_shards_are_a_run_setting_every_child_reads_back():
    settings = Settings.from_environ({"FLODL_SHARDS": "h1=tcp://10.0.0.2:7400"})
    assert settings.shard_map.endpoints(1) == ("tcp://10.0.0.2:7400", "tcp://10.0.0.2:7401")
    assert Settings.from_environ(settings.to_environ(("run",)), CHILD_SCOPES).shards == settings.shards
    assert Settings().shard_map.count == 1  # unset: the controller's reducer alone
