"""The status endpoint of a controller that has no membership service (`flodl-zmq launch`, compose).

Under `flodl-zmq controller` the membership service answers `flodl-zmq
status` on the join endpoint (PORT+3). A controller started any other way
(the local launcher, a compose file: the world is fixed, no agent joins) has
nothing on that port, so this small service takes it and answers the same
exchange (PROTOCOL.md 10.4: `join.challenge_request` -> `join.challenge`,
then `join.status_request` signed with that nonce -> `join.status_reply`)
with the same object: the fixed world as formed hosts, and the coordinator's
view the controller reports (`report_training`, as to the membership).

Rules it keeps: it answers only requests signed with the session key
(anything else is dropped unanswered, as the membership does); a nonce is
good once; every receive is bounded (frames, bytes, messages per wake-up) and
every send is non-blocking; one socket, owned by its thread, which runs on a
ServiceLoop (flodl_zmq/service_loop.py): asleep until a request or `close`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from flodl_zmq.errors import WireError
from flodl_zmq.io_threads import keep_off_the_data_plane
from flodl_zmq.join import Challenges
from flodl_zmq.links import CONTROL_MAX_FRAME_BYTES, JOIN_MAX_FRAMES, drain, limit_receive
from flodl_zmq.membership import JOIN_LEDGER_CAP, JOIN_RECV_BUDGET, SENDER, EndWatch
from flodl_zmq.service_loop import ServiceLoop
from flodl_zmq.trust import JOIN_RUN_ID
from flodl_zmq.wire import Attribution, Channel, Codec
from flodl_zmq.wire.records import ChallengeRequest, StatusReply, StatusRequest

log = logging.getLogger(__name__)


class StatusServer:
    """Answers `flodl-zmq status` for a fixed world (module docstring). `start()`, then `close()`."""

    def __init__(
        self, endpoint: str, key: bytes, world: Mapping[str, Sequence[int]], context: zmq.Context,
    ) -> None:
        self._codec = Codec(key, JOIN_RUN_ID, SENDER, max_ledger=JOIN_LEDGER_CAP)
        self._challenges = Challenges()
        self._end_watch = EndWatch()
        self._world = {h: list(rs) for h, rs in world.items()}
        # Replaced whole by the controller's thread, read whole by ours: a reference swap needs no lock.
        self._training: dict[str, Any] | None = None
        self.dropped = 0
        self._loop = ServiceLoop("status")
        self._sock = context.socket(zmq.ROUTER)
        keep_off_the_data_plane(self._sock)
        self._sock.setsockopt(zmq.LINGER, 0)
        limit_receive(self._sock, CONTROL_MAX_FRAME_BYTES)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="flodl-status", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def report_training(self, snapshot: dict[str, Any]) -> None:
        """The coordinator's current view (JSON-able), served as `training`."""
        self._training = snapshot

    def status(self) -> dict[str, Any]:
        """The object `join.status_reply` carries, as the membership service builds it."""
        out: dict[str, Any] = {
            "phase": "formed",
            "reason": "a fixed world (launched, not joined)",
            "joined_ranks": sum(len(rs) for rs in self._world.values()),
            "hosts": {h: {"ranks": rs, "state": "live"} for h, rs in self._world.items()},
        }
        if self._training is not None:
            out["training"] = self._training
        return out

    def close(self, timeout: float = 2.0) -> None:
        self._end_watch.hold(self._training, time.monotonic())
        self._loop.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._sock.close(0)
            self._loop.close()

    def _run(self) -> None:
        self._loop.on_socket(self._sock, self._drained)
        self._loop.run()

    def _drained(self) -> None:
        oversized = drain(
            self._sock, lambda frames: self._on_message(bytes(frames[0].bytes), frames[1:]),
            copy=False, budget=JOIN_RECV_BUDGET, max_frames=JOIN_MAX_FRAMES,
        )
        self.dropped += oversized  # not `+= drain(...)`: the handler counts drops too

    def _on_message(self, ident: bytes, frames: list[Any]) -> None:
        try:
            env = self._codec.decode_from(frames, Channel.JOIN, Attribution.anyone("a status link", scope=ident.hex()))
        except WireError as exc:
            self.dropped += 1  # a wrong key looks like this: no reply at all
            log.warning("status request dropped without reply: %s", exc)
            return
        r, now = env.record, time.monotonic()
        challenge = self._challenges.answer(ident, r, now) if isinstance(r, ChallengeRequest) else None
        if challenge is not None:
            self._send(ident, challenge)
        elif isinstance(r, StatusRequest) and self._challenges.take(ident, r.nonce, now) == "ok":
            status = self.status()
            self._send(ident, StatusReply(json.dumps(status), r.nonce))
            self._end_watch.answered(status.get("training"), now)
        else:
            self.dropped += 1  # anything else, a replayed or stale nonce: answered by nothing
            log.warning("status endpoint dropped %s: not a fresh challenge or status request", env.kind)

    def _send(self, ident: bytes, record: Any) -> None:
        try:
            self._sock.send_multipart([ident, *self._codec.encode(record, channel=Channel.JOIN)], zmq.NOBLOCK)
        except zmq.ZMQError:
            log.warning("status reply to a client not sent (it is gone or not reading)")
