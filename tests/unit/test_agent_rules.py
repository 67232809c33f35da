"""The agent's pure rules at a host's end (flodl_zmq.agent_rules)."""

from __future__ import annotations

from flodl_zmq.agent_rules import may_be_declared_lost


def test_a_host_whose_ranks_all_failed_asks_whether_it_was_declared_lost_and_one_whose_rank_finished_does_not():
    # A SIGSTOPped host's ranks are declared dead and exit non-zero: the controller's silence then means "lost",
    # and the host dials in again. A rank that exited 0 finished the run: a controller that exited right after it
    # is silent too, and the host re-dialled it for its whole grace period (seen with one of its ranks killed).
    assert may_be_declared_lost(failed=2, finished=0)
    assert not may_be_declared_lost(failed=1, finished=1)
    assert not may_be_declared_lost(failed=0, finished=2)  # a clean end: nothing to ask
