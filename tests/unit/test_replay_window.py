"""The anti-replay window as a pure core (PROTOCOL.md 5.1): fresh numbers in, each accepted once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl_zmq.wire.codec import ReplayWindow


def admit(window: ReplayWindow, seq: int) -> bool:
    if window.refusal(seq) is not None:
        return False
    window.accept(seq)
    return True


def test_in_order_numbers_are_accepted_and_a_repeat_is_a_replay() -> None:
    w = ReplayWindow(8)
    assert [admit(w, s) for s in (1, 2, 3)] == [True, True, True]
    assert w.refusal(3) == "was already accepted: a replayed frame"
    assert w.refusal(1) is not None


def test_a_resend_of_a_lost_number_is_accepted_once_after_later_ones() -> None:
    w = ReplayWindow(8)
    for s in (1, 3, 4, 5):  # 2 was lost in a reset
        assert admit(w, s)
    assert admit(w, 2)  # resent, byte-identical: never seen, so accepted
    assert not admit(w, 2)  # a second copy is a replay


def test_numbers_at_or_beyond_the_window_are_refused_as_too_old() -> None:
    w = ReplayWindow(8)
    assert admit(w, 10)
    assert admit(w, 3)  # 7 behind: inside a window of 8
    assert "outside the window of 8" in (w.refusal(2) or "")  # 8 behind
    assert admit(w, 100)  # a jump past the window forgets everything below it
    assert not admit(w, 92) and admit(w, 93)


def test_an_empty_window_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ReplayWindow(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=400), st.integers(1, 64))
def test_the_window_accepts_each_number_at_most_once_and_every_fresh_one_in_reach(
    arrivals: list[int], size: int
) -> None:
    w = ReplayWindow(size)
    accepted: set[int] = set()
    for seq in arrivals:
        top = max(accepted, default=0)
        fresh = seq not in accepted and seq > top - size
        assert admit(w, seq) == fresh, (seq, sorted(accepted), size)
        if fresh:
            accepted.add(seq)
