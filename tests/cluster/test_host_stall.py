"""A host whose every process stalled past the controller's --host-silence (a SIGSTOP, a laptop's suspend)
comes back with new ranks, as a host whose link was cut does (docs/operations.md, "When a host dies or the
network is cut").

The controller declares it lost and its ranks dead; on waking, the ranks see their death and exit before the
agent's own silence clock says anything. The agent finished "degraded" and left the run for good: the
controller drops a lost host's frames unanswered, so the agent now reads that silence as its loss and dials in
again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

import pytest

from tests.cluster.test_orphans import (
    children_of,
    controller_and_agents,
    next_line,
    wait_for_an_epoch,
)

pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(sys.platform != "linux", reason="/proc, signals")]


def test_a_host_stalled_past_the_host_silence_is_admitted_again_with_new_ranks():
    controller, agents = controller_and_agents("2", "--controller-silence", "2")
    stalled: list[int] = []
    try:
        lines = wait_for_an_epoch(controller)
        stalled = [agents[0].pid, *children_of(agents[0].pid)]
        for pid in stalled:  # every process of the host at once, as a machine that sleeps
            os.kill(pid, signal.SIGSTOP)
        lost = next_line(lines, lambda line: "host 'h0' lost" in line, 60)
        assert lost is not None, "the controller never declared the stalled host lost"
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
        seen: list[str] = []
        back = next_line(lines, lambda line: seen.append(line) or "admitted 'h0' as ranks" in line, 60)
        assert back is not None and "pending" in back, back
        # Its agent's frames meanwhile are this run's, from a host it declared lost: not "another run's".
        assert not [line for line in seen if "a record of another run" in line], seen
        formed = next_line(lines, lambda line: "world re-formed" in line, 60)
        assert formed is not None and "(joined: ['h0'])" in formed, formed
    finally:
        for pid in stalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for proc in (*agents, controller):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)  # each agent's children stop on its lifeline
