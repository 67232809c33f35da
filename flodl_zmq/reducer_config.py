"""A reducer's configuration: the world, the session, its endpoints; validated on construction.

Apart from the service (``reducer_service.ReducerService``), as the relay's
is (``relay_config.py``): the controller builds one for its reducer, a
shard host's relay one for its shard. Timings default to the settings table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.errors import ConfigError
from flodl_zmq.links import DATA_MAX_FRAME_BYTES, ROUTE_SECRET_BYTES
from flodl_zmq.security import CurveKeys
from flodl_zmq.settings import DEFAULTS
from flodl_zmq.wire import Channel
from flodl_zmq.wire_format import F32, WireFormat


@dataclass(frozen=True)
class ReducerConfig:
    """The world (host -> global ranks), the session, and the two endpoints to bind."""

    world: Mapping[str, tuple[int, ...]]
    key: bytes
    incarnation: bytes
    data_bind: str
    bcast_bind: str
    probe_interval_s: float = 0.1
    hwm_records: int = 8
    curve: CurveKeys | None = None  # CURVE server keys for both sockets (None: cleartext)
    # Largest frame the data socket accepts (ZMQ_MAXMSGSIZE): the controller passes its
    # model's (links.data_max_frame_bytes); the codec's payload bound by default (PROTOCOL.md 6.1).
    max_frame_bytes: int = DATA_MAX_FRAME_BYTES
    link_heartbeat_period_s: float = DEFAULTS.link_heartbeat_period_s  # ZeroMQ heartbeats on tcp://
    link_silence_s: float = DEFAULTS.link_silence_s  # a relay's connection silent this long is dropped
    # The run's wire format (Job.wire): a host frame of another is refused at the first. None (a host's shard in
    # a run that announces none, FLODL_WIRE_DTYPE): the first host frame's format holds, as in a relay's fold.
    wire: WireFormat | None = F32
    # What each host's token derives from (links.host_token): a hello without its host's is refused.
    # Required: a reducer without it could not tell a host's relay from any other member.
    route_secret: bytes = b""
    aggregation: str = "mean"  # how the ledger combines the deposits (robust.py; relays ship unfolded under others)
    shard: int = 0  # which reducer shard this is (shards.py): 0 the controller's; it signs as links.reducer_sender(shard)
    # The hosts whose relays hold a reducer shard (flodl_zmq/shards.py): the controller's reducer tells them
    # every death too, for their shards to count the rank out; a host's own shard has none.
    shard_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.world:
            raise ConfigError("reducer world must name at least one host")
        if len(self.route_secret) != ROUTE_SECRET_BYTES:
            raise ConfigError(f"reducer route_secret must be {ROUTE_SECRET_BYTES} bytes (the controller's, "
                              f"FLODL_ROUTE_SECRET), got {len(self.route_secret)}")
        if not self.probe_interval_s > 0:
            raise ConfigError("reducer probe_interval_s must be > 0")
        if not 0 < self.link_heartbeat_period_s < self.link_silence_s:
            raise ConfigError("reducer link_heartbeat_period_s must be > 0 and below link_silence_s")
        if self.hwm_records < 1:
            raise ConfigError("reducer hwm_records must be at least 1 record")

    @classmethod
    def for_controller(
        cls, world: Mapping[str, Iterable[int]], key: bytes, incarnation: bytes, controller: ControllerAddress, **kw: Any
    ) -> ReducerConfig:
        """Bind the controller's data and broadcast endpoints (ControllerAddress rule)."""
        return cls(
            world={h: tuple(sorted(rs)) for h, rs in world.items()},
            key=key,
            incarnation=incarnation,
            data_bind=controller.endpoint(Channel.DATA),
            bcast_bind=controller.endpoint(Channel.BROADCAST),
            **kw,
        )
