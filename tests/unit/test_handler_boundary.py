"""The handler boundary every service puts around acting on a peer's record (`links.act_for_peer`)."""

from __future__ import annotations

import collections
import logging

import pytest

from flodl_zmq.errors import CoordinatorError
from flodl_zmq.links import act_for_peer

log = logging.getLogger("test")


def boundary(act):
    dropped: list[str] = []
    count: collections.Counter[str] = collections.Counter()
    ok = act_for_peer("rank 3", act, dropped.append, count, "control", log, "controller")
    return ok, dropped, count


def test_a_record_acted_on_without_error_drops_nobody():
    assert boundary(lambda: None) == (True, [], collections.Counter())


def test_a_rule_the_peer_broke_drops_it_with_the_cause_counted_as_a_violation():
    def refused():
        raise CoordinatorError("rank 3 claims rank 1")

    ok, dropped, count = boundary(refused)
    assert not ok and dropped == ["protocol violation: rank 3 claims rank 1"]
    assert count == {"violation.control": 1}


def test_any_other_failure_drops_the_peer_and_stays_visible_with_its_traceback(caplog):
    def overflow():
        raise OverflowError("Integer value out of range")

    with caplog.at_level(logging.ERROR, logger="test"):
        ok, dropped, count = boundary(overflow)
    assert not ok and dropped == ["controller failed acting on its record: OverflowError: Integer value out of range"]
    assert count == {"handler_error.control": 1}
    assert "Traceback" in caplog.text and "rank 3" in caplog.text


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_or_an_exit_is_never_taken_for_a_peers_fault(stop):
    def interrupted():
        raise stop()

    with pytest.raises(stop):
        boundary(interrupted)
