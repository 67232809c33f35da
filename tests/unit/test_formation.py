"""The formation check, driven directly: rank hellos in, verdicts out, no sockets and no clock."""

from __future__ import annotations

import pytest

from flodl_zmq.errors import AuthError, TrainingError
from flodl_zmq.formation import Failed, Formation, FormationPhase, Formed, Ignored, Waiting
from flodl_zmq.wire.records import RankHello

WORLD = {"a": (0, 1), "b": (2,)}
MODEL, DATA = b"m" * 32, b"d" * 32
DEADLINE = 100.0


def formation(minimum: int = 3) -> Formation:
    return Formation(WORLD, MODEL, DATA, deadline=DEADLINE, timeout_s=120.0, minimum=minimum)


def hello(rank: int, host: str | None = None, model: bytes = MODEL, data: bytes = DATA, world: int = 3) -> RankHello:
    host = host if host is not None else next(h for h, rs in WORLD.items() if rank in rs)
    return RankHello(rank=rank, world_size=world, host=host, model_sig=model, dataset_sig=data)


def test_the_world_forms_once_every_rank_agrees():
    f = formation()
    assert f.hello(0, hello(0)) == Waiting((1, 2))
    assert f.hello(2, hello(2)) == Waiting((1,))
    v = f.hello(1, hello(1))
    assert isinstance(v, Formed) and sorted(v.hellos) == [0, 1, 2]
    assert f.phase is FormationPhase.FORMED
    assert f.hello(1, hello(1)) == Ignored("late_hello")
    assert f.poll(DEADLINE + 1) == v  # a formed world never times out


def test_a_vacancy_of_a_re_formed_world_starts_absent_and_counts_toward_no_quorum():
    world = {"a": (0,), "c": (3,)}  # b (ranks 1, 2) left before the world re-formed
    f = Formation(world, MODEL, DATA, deadline=DEADLINE, timeout_s=120.0, minimum=2)
    assert f.world_size == 4
    f.hello(0, RankHello(rank=0, world_size=4, host="a", model_sig=MODEL, dataset_sig=DATA))
    v = f.hello(3, RankHello(rank=3, world_size=4, host="c", model_sig=MODEL, dataset_sig=DATA))
    assert isinstance(v, Formed) and sorted(v.hellos) == [0, 3] and sorted(v.absent) == [1, 2]
    assert "its host left" in v.absent[1]


def test_mismatches_fail_naming_every_rank_only_once_all_have_spoken():
    f = formation()
    assert isinstance(f.hello(0, hello(0, data=b"x" * 32)), Waiting)
    assert isinstance(f.hello(1, hello(1, model=b"y" * 32)), Waiting)
    v = f.hello(2, hello(2, world=4))
    assert isinstance(v, Failed) and v.ranks == (0, 1, 2)
    assert "dataset mismatch: rank(s) [0]" in v.reason
    assert "model mismatch: rank(s) [1]" in v.reason
    assert "world size mismatch: rank(s) [2]" in v.reason
    assert isinstance(v.error(), TrainingError)


def test_a_rank_known_to_have_left_fails_the_formation_at_once_naming_it_below_the_minimum():
    f = formation()
    f.hello(0, hello(0))
    v = f.rank_left(2, "it exited with code -9")
    assert isinstance(v, Failed) and v.ranks == (2,)
    assert "rank 2 (it exited with code -9)" in v.reason and "2 of 3 ranks remain" in v.reason
    assert "minimum of 3 (--min-ranks)" in v.reason
    # A rank giving up waiting at its start-up timeout was blamed alone, on a healthy host, where the
    # cause was a host whose ranks never started (its word of the world lost): name the silent ones.
    assert "rank(s) [1] on host(s) ['a'] had not said hello yet: check that host's log too" in v.reason
    assert f.phase is FormationPhase.FAILED
    # Final: later hellos and the clock return the same verdict.
    assert f.hello(1, hello(1)) is v and f.hello(2, hello(2)) is v and f.poll(DEADLINE + 1) is v


def test_a_rank_that_leaves_after_its_hello_still_fails_the_formation():
    f = formation()
    f.hello(1, hello(1))
    assert isinstance(f.rank_left(1, "its agent on a reported exit code 1"), Failed)


def test_the_world_forms_without_a_rank_that_left_while_enough_remain():
    f = formation(minimum=2)
    f.hello(0, hello(0))
    assert f.rank_left(1, "it exited with code -9") == Waiting((2,))
    assert f.hello(1, hello(1)) == Ignored("departed_hello")  # gone stays gone
    assert f.rank_left(1, "again") == Ignored("duplicate_exit")
    v = f.hello(2, hello(2))
    assert isinstance(v, Formed) and sorted(v.hellos) == [0, 2]
    assert v.absent == {1: "it exited with code -9"}


def test_a_rank_leaving_last_forms_the_world_of_those_that_spoke():
    f = formation(minimum=1)
    f.hello(0, hello(0))
    f.hello(2, hello(2))
    v = f.rank_left(1, "it exited with code 1")
    assert isinstance(v, Formed) and sorted(v.hellos) == [0, 2] and list(v.absent) == [1]


def test_deaths_past_the_minimum_fail_naming_every_rank_gone():
    f = formation(minimum=2)
    f.hello(1, hello(1))
    assert isinstance(f.rank_left(0, "it exited with code -9"), Waiting)
    v = f.rank_left(1, "it exited with code 3")  # after its hello
    assert isinstance(v, Failed) and v.ranks == (0, 1)
    assert "rank 0 (it exited with code -9); rank 1 (it exited with code 3)" in v.reason


def test_a_rank_leaving_after_formation_is_not_a_formation_matter():
    f = formation()
    for r in (0, 1, 2):
        f.hello(r, hello(r))
    assert f.rank_left(0, "gone") == Ignored("late_exit")
    assert f.phase is FormationPhase.FORMED


def test_duplicate_and_unknown_hellos_change_nothing():
    f = formation()
    f.hello(0, hello(0))
    assert f.hello(0, hello(0, data=b"x" * 32)) == Ignored("duplicate_hello")
    assert f.hello(7, hello(7, host="a")) == Ignored("unknown_rank")
    assert f.rank_left(7, "?") == Ignored("unknown_rank")
    assert f.hellos[0].dataset_sig == DATA and f.phase is FormationPhase.FORMING
    f.hello(1, hello(1))
    assert isinstance(f.hello(2, hello(2)), Formed)  # the first hello of rank 0 stood


@pytest.mark.parametrize("bad, named", [
    (RankHello(rank=1, world_size=3, host="b", model_sig=MODEL, dataset_sig=DATA), "claims rank 1"),
    (RankHello(rank=2, world_size=3, host="a", model_sig=MODEL, dataset_sig=DATA), "names host 'a'"),
])
def test_a_hello_that_lies_about_its_rank_or_host_fails_naming_it(bad, named):
    f = formation()
    v = f.hello(2, bad)
    assert isinstance(v, Failed) and v.ranks == (2,) and named in v.reason
    assert f.hellos == {}


def test_the_deadline_fails_naming_the_silent_ranks():
    f = formation()
    f.hello(0, hello(0))
    assert isinstance(f.poll(DEADLINE), Waiting)
    v = f.poll(DEADLINE + 0.1)
    assert isinstance(v, Failed) and v.ranks == (1, 2) and not v.auth
    assert "rank(s) [1, 2] never said hello within 120 s (FLODL_STARTUP_TIMEOUT)" in v.reason


def test_authentication_failures_make_the_time_out_an_auth_error():
    f = formation()
    f.auth_failed("bad MAC")
    f.auth_failed("bad MAC again")
    v = f.poll(DEADLINE + 1)
    assert isinstance(v, Failed) and v.auth and isinstance(v.error(), AuthError)
    assert "2 control record(s) failed authentication while the world formed (bad MAC again)" in v.reason
    assert "check FLODL_KEY" in v.reason
