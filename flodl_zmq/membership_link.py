"""The controller role's link to the membership service it runs next to, under `flodl-zmq controller`.

Under `flodl-zmq controller` (flodl_zmq/controller.py) the controller role
runs in the same process as the membership service, linked through a
`MembershipLink` (handed over with the role by `api.hosted`): a rank exit
an agent reports (non-zero code) and a host whose agent fell silent are
deaths declared at once, seconds before rank heartbeats would tell; the
coordinator's view is reported to the membership for `flodl-zmq status`
(started any other way, `flodl-zmq launch` or compose, the controller
answers status itself: flodl_zmq/status_server.py);
and the controller's sockets are CURVE servers when
the link carries keys.

Rules this module keeps: a death the agents report is named with its cause;
a re-form drops the old world's events before the new world starts (a rank
exit of the world before must not kill a rank of the new one with the same
number); the wait for the hosts to stop their old ranks is bounded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flodl_zmq.checkpoints import WorldChange
from flodl_zmq.environment import ChildExit
from flodl_zmq.host_links import HostLost, RankExitReported, RelayExitReported
from flodl_zmq.membership import MembershipService
from flodl_zmq.metrics import RunMetrics
from flodl_zmq.result import TrainResult
from flodl_zmq.security import CurveKeys
from flodl_zmq.wire import new_incarnation

log = logging.getLogger(__name__)

REFORM_STOP_S = 15.0  # how long the hosts get to stop their ranks of the world before a re-form


@dataclass(frozen=True)
class MembershipLink:
    """What `flodl-zmq controller` hands the controller role it runs in its own process.

    `membership`: the running service whose events (rank exits the agents
    report, hosts lost) the coordinator acts on, and which serves the status
    the coordinator reports. `curve`: the controller's CURVE server keys
    (None: cleartext). `metrics`: the Prometheus metrics the command already
    serves (bound before its join window opened; None: no `--metrics-port`).
    """

    membership: MembershipService
    curve: CurveKeys | None = None
    metrics: RunMetrics | None = None

    def reports(self) -> list[ChildExit | HostLost]:
        """What the agents reported since the last call: a rank's or (rank None) a relay's exit, in the
        launcher's terms, or a host whose agent fell silent; the fast path to declaring ranks dead."""
        reports: list[ChildExit | HostLost] = []
        for event in self.membership.events.drain():
            if isinstance(event, RankExitReported):
                reports.append(ChildExit(event.host, event.rank, event.code))
            elif isinstance(event, RelayExitReported):
                reports.append(ChildExit(event.host, None, event.code))
            elif isinstance(event, HostLost):
                reports.append(event)
        return reports

    def reform(self, before: dict[str, tuple[int, ...]], stem: str, result: TrainResult) -> WorldChange:
        """Send every host the re-formed world and wait (bounded) until each stopped its old ranks.

        The old incarnation's events are dropped once the new world is sent: a rank
        exit reported for the world before (a clean one among them, which the new
        service, not yet formed, would take for a rank of its own that never comes)
        must not kill a rank of the new one with the same number. Dropped before the
        send, an old rank's exit reported before the join thread marked its host's
        ranks retiring would reach the new service; after it, the membership service
        tells the retiring ranks' exits apart (host_links.HostLinks).
        The new world is a new incarnation (PROTOCOL.md 4.1, 13.1): a fresh id, so
        nothing its relays and ranks signed before (or a recording of it) reaches it.
        """
        incarnation = new_incarnation()
        after = self.membership.reform({"FLODL_RESUME": stem}, incarnation)
        self.membership.events.drain()  # returns once the join thread sent it: every earlier report is queued
        late = self.membership.wait_reformed(REFORM_STOP_S)
        if late:
            log.warning("controller: host(s) %s did not stop their ranks within %g s of the re-form; the new world "
                        "starts anyway (ranks that do not say hello in time are left out)", late, REFORM_STOP_S)
        return WorldChange(result, dict(before), after, stem, incarnation)
