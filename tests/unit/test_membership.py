"""The join window's pure ledger: admission, rank assignment, verdicts over a fabricated clock."""

from __future__ import annotations

import json
import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flodl_zmq.environment import SpawnSpec
from flodl_zmq.errors import ConfigError, MembershipError
from flodl_zmq.host_links import HostLinks
from flodl_zmq.join import (
    MAX_HOST_CHARS,
    Accepted,
    JoinConfig,
    JoinWindow,
    Member,
    ReformGate,
    Rejected,
    WindowPhase,
)
from flodl_zmq.links import relay_sender
from flodl_zmq.trust import (
    OPEN_JOIN_KEY,
    TrustMode,
    check_open_admission_bind,
    join_key,
    resolve_trust,
)
from flodl_zmq.wire import PROTOCOL_VERSION, Codec
from flodl_zmq.wire.records import Channel, JoinHello, RankExit

SIG_A = bytes([0xA1]) * 32
SIG_B = bytes([0xB2]) * 32


def hello(
    host: str,
    n: int = 1,
    *,
    sig: bytes = SIG_A,
    model: bytes | None = None,
    protocol: int = PROTOCOL_VERSION,
    devices: list[str] | None = None,
) -> JoinHello:
    devs = devices if devices is not None else [f"cpu:{i}" for i in range(n)]
    return JoinHello(host=host, devices=devs, dataset_sig=sig, protocol=protocol, model_sig=model, nonce=bytes(16))


def window(**cfg) -> JoinWindow:
    defaults = {"min_ranks": 2, "join_window_s": 10.0, "join_cap_s": 30.0}
    defaults.update(cfg)
    return JoinWindow(JoinConfig(**defaults), opened_at=100.0)


def rejected(outcome) -> str:
    assert isinstance(outcome, Rejected), outcome
    return outcome.reason


# --------------------------------------------------------------------------- admission


def test_admission_assigns_contiguous_ranks_in_order():
    w = window()
    assert w.admit(hello("a", 1), 100.0).ranks == (0,)
    assert w.admit(hello("b", 2), 101.0).ranks == (1, 2)
    assert w.admit(hello("c", 3), 102.0).ranks == (3, 4, 5)
    assert [m.host for m in w.members] == ["a", "b", "c"]
    assert w.joined_ranks == 6


@given(st.lists(st.integers(min_value=1, max_value=8), min_size=1, max_size=20))
def test_ranks_cover_zero_to_n_exactly_once_whatever_the_host_sizes(sizes):
    w = window()
    for i, n in enumerate(sizes):
        w.admit(hello(f"h{i}", n), 100.0)
    ranks = [r for m in w.members for r in m.ranks]
    assert ranks == list(range(sum(sizes)))


def test_a_resumed_window_gives_each_host_its_old_ranks_whatever_the_order_and_forms_when_all_are_back():
    w = JoinWindow(JoinConfig(min_ranks=4, target_ranks=4, join_window_s=10.0, join_cap_s=30.0), opened_at=100.0,
                   resumed={"w1": (0, 1), "w2": (2, 3)})
    assert w.admit(hello("w2", 2), 100.0).ranks == (2, 3)
    assert w.poll(101.0).phase is WindowPhase.OPEN
    assert w.admit(hello("w1", 2), 102.0).ranks == (0, 1)
    verdict = w.poll(102.0)
    assert verdict.phase is WindowPhase.FORMED and {m.host: m.ranks for m in verdict.members} == {"w1": (0, 1), "w2": (2, 3)}


def test_a_resumed_window_that_fails_names_the_hosts_that_did_not_rejoin_not_the_minimum_ranks():
    # Its minimum is the checkpoint's world: "lower the minimum ranks" was advice the user could not take.
    w = JoinWindow(JoinConfig(min_ranks=4, target_ranks=4, join_window_s=10.0, join_cap_s=30.0), opened_at=100.0,
                   resumed={"w1": (0, 1), "w2": (2, 3)})
    w.admit(hello("w2", 2), 100.0)
    verdict = w.poll(131.0)
    assert verdict.phase is WindowPhase.FAILED
    assert "the resumed run's hosts ['w1'] did not rejoin within the hard cap of 30 s" in verdict.reason
    assert "minimum ranks" not in verdict.reason


def test_a_resumed_window_refuses_a_stranger_and_a_host_with_other_devices_by_name():
    w = JoinWindow(JoinConfig(min_ranks=4, target_ranks=4), opened_at=100.0, resumed={"w1": (0, 1), "w2": (2, 3)})
    assert "host 'w3' is not part of the run this controller resumes" in rejected(w.admit(hello("w3", 2), 100.0))
    assert "rejoins with 1 device(s) but ran ranks [0, 1]" in rejected(w.admit(hello("w1", 1), 100.0))
    assert w.joined_ranks == 0


def test_accept_tells_the_remaining_hard_cap_budget():
    w = window(join_cap_s=30.0)
    outcome = w.admit(hello("a"), 112.0)
    assert isinstance(outcome, Accepted)
    assert outcome.formation_wait_s == pytest.approx(18.0)


def test_duplicate_host_is_refused_and_burns_no_rank_ids():
    w = window()
    w.admit(hello("a"), 100.0)
    reason = rejected(w.admit(hello("a", 2), 101.0))
    assert "duplicate join" in reason and "'a'" in reason
    # An operator restarting a crashed agent at once meets this too: the message names the wait, not only
    # "stop the old agent" (which is dead).
    assert "--host-silence" in reason and "retry once the old one is lost" in reason
    assert w.admit(hello("b"), 102.0).ranks == (1,)


def test_dataset_signature_first_member_seeds_the_expectation():
    w = window()
    w.admit(hello("a", sig=SIG_A), 100.0)
    reason = rejected(w.admit(hello("b", sig=SIG_B), 101.0))
    assert "dataset signature mismatch" in reason
    assert SIG_B[:4].hex() in reason and SIG_A[:4].hex() in reason
    assert "same dataset" in reason


def test_dataset_signature_controller_seed_wins_over_the_first_member():
    w = JoinWindow(JoinConfig(), opened_at=0.0, dataset_sig=SIG_B)
    assert "dataset signature mismatch" in rejected(w.admit(hello("a", sig=SIG_A), 0.0))
    assert isinstance(w.admit(hello("b", sig=SIG_B), 0.0), Accepted)


def test_a_box_building_a_different_model_is_refused_and_none_gates_nothing():
    w = window()
    w.admit(hello("a", model=None), 100.0)  # None seeds nothing
    w.admit(hello("b", model=SIG_A), 100.0)  # first signature seeds
    assert "model signature mismatch" in rejected(w.admit(hello("c", model=SIG_B), 100.0))
    assert isinstance(w.admit(hello("d", model=None), 100.0), Accepted)
    seeded = JoinWindow(JoinConfig(), opened_at=0.0, model_sig=SIG_B)
    assert "model signature mismatch" in rejected(seeded.admit(hello("a", model=SIG_A), 0.0))


def test_protocol_version_skew_is_refused_by_name():
    w = window()
    reason = rejected(w.admit(hello("a", protocol=PROTOCOL_VERSION + 1), 100.0))
    assert "protocol version skew" in reason and "same flodl-zmq version" in reason


@pytest.mark.parametrize(
    ("h", "needle"),
    [
        (hello("a", devices=[]), "no devices"),
        (hello("a", devices=[f"cpu:{i}" for i in range(100_000)]), "more than the 256"),
        (hello("a", devices=["cuda:0", "cuda:0"]), "repeated device"),
        (hello("a", devices=["cuda:0", "  "]), "blank or repeated device"),
        (hello("   ", 1), "invalid host name"),
        (hello("a\nb", 1), "invalid host name"),
        (hello("x" * 300, 1), "invalid host name"),
    ],
)
def test_hostile_hellos_are_refused_and_leave_the_window_open(h, needle):
    w = window()
    assert needle in rejected(w.admit(h, 100.0))
    assert w.members == () and w.phase is WindowPhase.OPEN
    assert w.admit(hello("honest"), 100.0).ranks == (0,)


def test_every_admitted_host_name_leaves_its_relay_a_sender_name_receivers_accept():
    # The relay signs as `relay:<host>`, and a receiver refuses a sender name over 256 code points
    # (PROTOCOL.md 3.2): a host admitted with a longer one would run a relay nobody hears.
    w = window()
    longest = "h" * MAX_HOST_CHARS
    assert w.admit(hello(longest), 100.0).ranks == (0,)
    key, run = bytes(32), bytes(16)
    frames = Codec(key, run, relay_sender(longest)).encode(RankExit(rank=0), channel=Channel.DATA)
    assert Codec(key, run, "reducer").decode(frames, Channel.DATA).sender == relay_sender(longest)
    assert "invalid host name" in rejected(w.admit(hello(longest + "h"), 100.0))


@pytest.mark.parametrize("name", ["a=b", "a;b", " a", "a "])
def test_a_host_name_the_world_string_cannot_carry_is_refused_and_the_world_still_forms(name):
    # Admitted, it made every host's agent refuse the formed world's spawn artifacts.
    w = window(target_ranks=2)
    assert "invalid host name" in rejected(w.admit(hello(name), 100.0))
    w.admit(hello("a"), 100.0)
    w.admit(hello("b"), 100.0)
    assert w.poll(100.0).phase is WindowPhase.FORMED
    spawn = SpawnSpec(("train.py",), {}, w.world)
    assert SpawnSpec.from_json(spawn.to_json()).world == {"a": (0,), "b": (1,)}


def test_retract_last_returns_rank_ids_to_the_pool():
    w = window()
    w.admit(hello("a"), 100.0)
    w.admit(hello("b", 2), 100.0)
    with pytest.raises(MembershipError, match="most recent"):
        w.retract_last("a")
    w.retract_last("b")
    assert w.admit(hello("c", 2), 100.0).ranks == (1, 2)


def test_after_formation_a_joiner_is_pending_with_fresh_ranks_until_the_world_re_forms():
    w = window(target_ranks=2)
    w.admit(hello("a", 2), 100.0)
    assert w.poll(100.0).phase is WindowPhase.FORMED
    late = w.admit(hello("late", 2), 101.0)
    assert isinstance(late, Accepted) and late.ranks == (2, 3) and late.formation_wait_s == 30.0
    assert w.world == {"a": (0, 1)} and [m.host for m in w.pending] == ["late"]
    assert w.reform() == {"a": (0, 1), "late": (2, 3)} and w.pending == ()
    assert w.poll(200.0).phase is WindowPhase.FORMED  # the verdict stays final


def test_a_joiner_after_formation_passes_the_same_checks_and_the_rank_cap():
    w = window(target_ranks=2, max_ranks=4)
    w.admit(hello("a", 2), 100.0)
    w.poll(100.0)
    assert "dataset signature mismatch" in rejected(w.admit(hello("b", sig=SIG_B), 101.0))
    assert "protocol version skew" in rejected(w.admit(hello("b", protocol=PROTOCOL_VERSION + 1), 101.0))
    assert "duplicate join" in rejected(w.admit(hello("a"), 101.0))
    assert "world full" in rejected(w.admit(hello("b", 3), 101.0))
    assert w.admit(hello("b", 2), 101.0).ranks == (2, 3)  # refusals burnt no ranks
    assert "world full" in rejected(w.admit(hello("c"), 102.0))


def test_a_host_that_left_comes_back_with_fresh_ranks_and_its_old_ones_stay_given():
    w = window(target_ranks=4)
    w.admit(hello("a", 2), 100.0)
    w.admit(hello("b", 2), 100.0)
    w.poll(100.0)
    w.depart("b")
    assert "duplicate" not in str(w.admit(hello("b", 2), 101.0))
    assert w.last_admitted.ranks == (4, 5)
    w.retract_last("b")  # its accept could not be sent: the ranks are given again, not skipped
    assert w.admit(hello("b", 2), 102.0).ranks == (4, 5)
    assert w.reform() == {"a": (0, 1), "b": (4, 5)} and [m.ranks for m in w.departed] == [(2, 3)]


def test_a_host_whose_ranks_all_exited_is_taken_back_with_fresh_ranks_and_a_running_one_is_still_a_duplicate():
    # Its agent lost the controller for a while and stopped its ranks (each exit reported):
    # the link says done, and its re-dial must not be refused as a duplicate forever.
    w = window(target_ranks=4)
    w.admit(hello("a", 2), 100.0)
    w.admit(hello("b", 2), 100.0)
    w.poll(100.0)
    links = HostLinks(timeout_s=30.0)
    for m in w.members:
        links.add(m, 100.0)
    links.rank_exited("b", 2, 101.0)
    assert links.state("b") == "live"
    assert "duplicate join" in rejected(w.admit(hello("b", 2), 102.0, finished=links.state("b") == "done"))
    links.rank_exited("b", 3, 103.0)
    assert links.state("b") == "done"
    outcome = w.admit(hello("b", 2), 104.0, finished=links.state("b") == "done")
    assert isinstance(outcome, Accepted) and outcome.ranks == (4, 5)
    assert [m.host for m in w.departed] == ["b"] and [m.host for m in w.pending] == ["b"]
    assert w.reform() == {"a": (0, 1), "b": (4, 5)}
    assert "duplicate join" in rejected(w.admit(hello("a", 2), 105.0, finished=links.state("a") == "done"))


def test_a_finished_host_is_refused_by_the_other_checks_and_keeps_its_membership():
    w = window(target_ranks=2)
    w.admit(hello("a", 2), 100.0)
    w.poll(100.0)
    assert "dataset signature mismatch" in rejected(w.admit(hello("a", 2, sig=SIG_B), 101.0, finished=True))
    assert [m.host for m in w.members] == ["a"] and not w.departed


def test_a_failed_window_refuses_late_joiners_by_name():
    failed = window()
    failed.abort("operator gave up")
    assert "operator gave up" in rejected(failed.admit(hello("late"), 100.0))


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"min_ranks": 0}, ">= 2"),
        ({"min_ranks": 1}, ">= 2"),
        ({"min_ranks": 3, "target_ranks": 2}, "target ranks"),
        ({"join_window_s": 60.0, "join_cap_s": 30.0}, "join cap"),
        ({"join_window_s": -1.0}, "join window"),
        ({"join_window_s": float("nan")}, "join window"),
    ],
)
def test_config_cross_field_validation(cfg, needle):
    with pytest.raises(ConfigError, match=needle):
        JoinConfig(**cfg)


# --------------------------------------------------------------------------- verdicts


def test_verdict_target_closes_early():
    w = window(target_ranks=3)
    w.admit(hello("a", 2), 100.0)
    assert w.poll(101.0).phase is WindowPhase.OPEN
    w.admit(hello("b", 1), 101.0)
    v = w.poll(101.0)
    assert v.phase is WindowPhase.FORMED and v.reason == "target ranks reached"
    assert v.world_size == 3 and [m.host for m in v.members] == ["a", "b"]


def test_verdict_quorum_early_does_not_close_the_window():
    w = window(min_ranks=2, join_window_s=10.0)
    w.admit(hello("a", 2), 100.0)
    assert w.poll(109.9).phase is WindowPhase.OPEN
    v = w.poll(110.0)
    assert v.phase is WindowPhase.FORMED and "with quorum" in v.reason


def test_verdict_grace_range_waits_for_quorum_then_forms():
    w = window(min_ranks=2, join_window_s=10.0, join_cap_s=30.0)
    w.admit(hello("a", 1), 100.0)
    assert w.poll(115.0).phase is WindowPhase.OPEN
    w.admit(hello("b", 1), 120.0)
    assert w.poll(120.0).phase is WindowPhase.FORMED


def test_verdict_cap_expiry_fails_loudly():
    w = window(min_ranks=2, join_window_s=10.0, join_cap_s=30.0)
    w.admit(hello("a", 1), 100.0)
    assert w.poll(129.9).phase is WindowPhase.OPEN
    v = w.poll(130.0)
    assert v.phase is WindowPhase.FAILED
    assert "quorum not met" in v.reason and "1/2" in v.reason


def test_verdicts_are_final():
    w = window(target_ranks=2)
    w.admit(hello("a", 2), 100.0)
    formed = w.poll(100.0)
    assert w.poll(10_000.0) == formed
    assert w.abort("too late") == formed


def test_next_due_is_the_window_end_then_the_cap_then_none_once_final():
    w = window(min_ranks=2, join_window_s=10.0, join_cap_s=30.0)
    assert w.next_due(100.0) == 110.0
    w.admit(hello("a", 1), 101.0)
    assert w.poll(110.0).phase is WindowPhase.OPEN
    assert w.next_due(110.0) == 130.0  # after the window only the cap (or a quorum admission) closes it
    assert w.poll(130.0).phase is WindowPhase.FAILED
    assert w.next_due(130.0) is None


def test_abort_fails_an_open_window_with_the_reason():
    w = window()
    v = w.abort("launcher aborted before the world formed")
    assert v.phase is WindowPhase.FAILED and "launcher aborted" in v.reason


# --------------------------------------------------------------------------- trust


def test_open_admission_uses_the_all_zero_key_and_pre_shared_the_session_key():
    key = bytes(range(32))
    assert join_key(TrustMode.OPEN, key) == OPEN_JOIN_KEY == bytes(32)
    assert join_key(TrustMode.PRE_SHARED, key) == key


@pytest.mark.parametrize(
    "addr", ["127.0.0.1", "10.231.0.1", "192.168.1.5", "172.16.0.9", "::1", "fd00::1"]
)
def test_open_admission_is_allowed_on_loopback_and_private_binds(addr):
    check_open_admission_bind(addr)


@pytest.mark.parametrize("addr", ["8.8.8.8", "0.0.0.0", "::", "2001:4860::1", "controller"])
def test_open_admission_is_refused_on_public_wildcard_or_unresolved_binds(addr):
    with pytest.raises(ConfigError, match="pre-shared key"):
        check_open_admission_bind(addr)


def test_resolve_trust_follows_the_knob_and_warns_on_open(caplog):
    assert resolve_trust(False, "8.8.8.8") is TrustMode.PRE_SHARED
    with caplog.at_level(logging.WARNING, logger="flodl_zmq.membership"):
        assert resolve_trust(True, "10.231.0.1") is TrustMode.OPEN
    assert "open admission" in caplog.text
    with pytest.raises(ConfigError):
        resolve_trust(True, "0.0.0.0")


# --------------------------------------------------------------------------- host links


def member(host: str, *ranks: int) -> Member:
    return Member(host, ranks, tuple(f"cpu:{i}" for i in range(len(ranks))), 0.0)


def test_a_silent_host_is_lost_once_with_its_unreported_ranks():
    links = HostLinks(timeout_s=5.0)
    links.add(member("a", 0, 1), 0.0)
    links.add(member("b", 2), 0.0)
    links.rank_exited("a", 0, 1.0)
    links.heard("b", 4.0)
    assert links.lost(5.5) == []
    assert links.lost(6.5) == ["a"]
    assert links.live_ranks("a") == (1,)
    assert links.lost(100.0) == ["b"]
    assert links.lost(200.0) == []


def test_hearing_a_host_says_how_long_it_was_silent():
    # The membership repeats a host's word of its world after a silence (PROTOCOL.md 10.4): it reads it here.
    links = HostLinks(timeout_s=5.0)
    links.add(member("a", 0), 1.0)
    assert links.heard("a", 1.5) == 0.5
    assert links.heard("a", 4.0) == 2.5
    assert links.heard("b", 4.0) == 0.0  # not watched
    assert links.silent_for("a", 7.0) == 3.0 and links.silent_for("b", 7.0) == 0.0
    links.cut("a")
    assert links.silent_for("a", 9.0) == 0.0  # lost: no longer a member whose silence counts


def test_every_host_lost_to_silence_at_once_points_at_the_controllers_own_link():
    # A 15 s outage of the controller's link lost every host within half a second, and the run ended
    # with a message that blamed the ranks.
    links = HostLinks(timeout_s=5.0)
    for host, rank in (("a", 0), ("b", 1), ("c", 2)):
        links.add(member(host, rank), 0.0)
    assert links.lost(5.5) == ["a", "b", "c"] and links.all_silent_together()
    links = HostLinks(timeout_s=5.0)
    links.add(member("a", 0), 0.0)
    links.add(member("b", 1), 0.0)
    links.heard("b", 20.0)
    assert links.lost(6.0) == ["a"] and not links.all_silent_together()  # b still speaks
    assert links.lost(26.0) == ["b"] and not links.all_silent_together()  # 20 s apart: each its own cut
    links = HostLinks(timeout_s=5.0)
    links.add(member("a", 0), 0.0)
    links.add(member("b", 1), 0.0)
    links.rank_exited("b", 1, 1.0)  # done, not silent
    assert links.lost(6.0) == ["a"] and not links.all_silent_together()


def test_links_next_due_is_when_the_quietest_open_host_turns_lost():
    links = HostLinks(timeout_s=5.0)
    assert links.next_due() is None
    links.add(member("a", 0), 0.0)
    links.add(member("b", 1), 2.0)
    due = links.next_due()
    assert 5.0 < due < 5.0001 and links.lost(5.0) == [] and links.lost(due) == ["a"]
    assert 7.0 < links.next_due() < 7.0001
    links.rank_exited("b", 1, 3.0)  # done: never lost, nothing left to time
    assert links.next_due() is None


def test_a_host_whose_ranks_all_exited_is_done_and_never_lost():
    links = HostLinks(timeout_s=5.0)
    links.add(member("a", 0, 1), 0.0)
    assert links.rank_exited("a", 0, 1.0) is False
    assert links.rank_exited("a", 0, 1.0) is False  # a repeated report changes nothing
    assert links.rank_exited("a", 1, 1.0) is True
    assert links.lost(100.0) == []


def test_at_a_re_form_the_exits_of_the_old_ranks_retire_and_never_count_for_the_new_world():
    links = HostLinks(timeout_s=5.0)
    links.add(member("a", 0, 1), 0.0)
    links.rank_exited("a", 1, 1.0)  # died before the re-form: not retiring
    links.reform(member("a", 0, 1))  # the new world runs ranks 0 and 1 on a again
    assert links.retiring() == ["a"]
    assert links.retire("a", 1) is False  # not one of the old incarnation's live ranks
    assert links.retire("a", 0) is True and links.retiring() == []
    assert links.live_ranks("a") == (0, 1)  # the new world's ranks, both live
    assert links.retire("a", 0) is False  # from now on an exit is the new rank 0's


def test_a_host_lost_and_admitted_again_is_watched_afresh():
    links = HostLinks(timeout_s=5.0)
    links.add(member("b", 1), 0.0)
    assert links.lost(10.0) == ["b"] and links.running() == []
    links.add(member("b", 2), 20.0)
    assert links.running() == ["b"] and links.state("b") == "live" and links.live_ranks("b") == (2,)


# --------------------------------------------------------------------------- spawn artifacts


def test_spawn_spec_round_trips_and_refuses_malformed_json():
    spec = SpawnSpec(
        ("-m", "flodl_zmq", "demo"), {"FLODL_STARTUP_TIMEOUT": "30"}, {"a": (0,), "b": (1, 2)}
    )
    assert SpawnSpec.from_json(spec.to_json()) == spec
    good = {"argv": ["x"], "env": {}, "world": "a=0;b=1"}
    bads = [
        {**good, "argv": []},
        {**good, "env": {"a": 1}},
        {**good, "extra": 1},
        {**good, "world": "a=0;b=0"},
        {"argv": ["x"], "env": {}},
    ]
    for bad in ["not json", "[]", *map(json.dumps, bads)]:
        with pytest.raises(MembershipError):
            SpawnSpec.from_json(bad)


# --------------------------------------------------------------------------- the re-form point (PROTOCOL.md 13.1 item 2)


def test_a_progressive_run_reforms_at_the_first_round_finished_after_the_joiner_was_noticed_within_the_epoch():
    gate = ReformGate(progressive=True, epochs=1)
    assert not gate.due(round=5, epoch=0, reported=0, evals_owed=False)  # nobody noticed yet
    assert gate.notice(round=5, epoch=0)
    assert not gate.due(round=5, epoch=0, reported=0, evals_owed=False)  # the consensus it was noticed at: the round in flight may land
    assert not gate.notice(round=6, epoch=0)  # noticed again: no news, and the point does not move
    assert gate.due(round=6, epoch=0, reported=0, evals_owed=False)  # a one-epoch run takes the joiner mid-epoch


def test_no_reform_between_an_epochs_row_and_the_first_consensus_holding_that_epoch_whole():
    gate = ReformGate(progressive=True, epochs=4)
    gate.notice(round=5, epoch=1)
    assert not gate.due(round=6, epoch=1, reported=2, evals_owed=False)  # epoch 1 has its row: the new world would write it again
    assert gate.due(round=7, epoch=2, reported=2, evals_owed=False)


def test_a_sync_run_reforms_only_from_a_consensus_holding_the_epoch_it_was_noticed_in():
    gate = ReformGate(progressive=False, epochs=3)
    gate.notice(round=5, epoch=1)
    assert not gate.due(round=9, epoch=1, reported=1, evals_owed=False)  # rounds pass within epoch 1: a resume would redo them
    assert gate.due(round=10, epoch=2, reported=2, evals_owed=False)


def test_no_reform_once_every_epoch_is_in_the_consensus_nor_after_notice_in_the_last_sync_epoch():
    done = ReformGate(progressive=True, epochs=2)
    assert not done.notice(round=8, epoch=2)
    assert not done.due(round=9, epoch=2, reported=2, evals_owed=False)
    last = ReformGate(progressive=False, epochs=2)
    last.notice(round=5, epoch=1)
    assert not last.due(round=9, epoch=2, reported=2, evals_owed=False)  # the run is over: the joiner is aborted, not re-formed in


def test_no_reform_while_an_eval_is_owed_its_score_would_be_lost_with_the_old_world():
    gate = ReformGate(progressive=False, epochs=3)
    gate.notice(round=5, epoch=1)
    assert not gate.due(round=10, epoch=2, reported=2, evals_owed=True)  # epoch 1's eval is being scored
    assert gate.due(round=11, epoch=2, reported=2, evals_owed=False)


def test_a_failed_reform_checkpoint_is_not_tried_again_before_the_next_epoch():
    gate = ReformGate(progressive=True, epochs=3)
    gate.notice(round=5, epoch=0)
    assert gate.due(round=6, epoch=0, reported=0, evals_owed=False)
    gate.failed(epoch=0)
    assert not gate.due(round=7, epoch=0, reported=0, evals_owed=False) and not gate.due(round=12, epoch=0, reported=0, evals_owed=False)
    assert gate.due(round=13, epoch=1, reported=1, evals_owed=False)
