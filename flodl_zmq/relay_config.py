"""A relay's configuration: everything it needs, validated on construction.

Apart from the service (``relay.Relay``) so that both of the relay's
threads can read it: ``relay.py`` imports ``relay_data.py``, which must not
import it back. Timings default to the settings table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flodl_zmq.endpoints import ControllerAddress
from flodl_zmq.errors import ConfigError
from flodl_zmq.links import HOST_TOKEN_BYTES, local_endpoints
from flodl_zmq.security import CurveKeys
from flodl_zmq.settings import DEFAULTS
from flodl_zmq.shards import ShardMap
from flodl_zmq.wire import Channel
from flodl_zmq.wire_format import F32, WireFormat


@dataclass(frozen=True)
class RelayConfig:
    """Everything a relay needs; validated on construction."""

    host: str
    ranks: tuple[int, ...]
    key: bytes
    incarnation: bytes
    control_upstream: str
    data_upstream: str
    bcast_upstream: str
    local_control: str
    local_data: str
    rank_silence_at_relay_s: float = DEFAULTS.rank_silence_at_relay_s
    rank_first_record_at_relay_s: float = DEFAULTS.rank_first_record_at_relay_s
    consensus_wait_at_relay_s: float = DEFAULTS.consensus_wait_at_relay_s
    hwm_records: int = 64
    data_hwm_records: int = 4  # data records are model-sized: a few in flight is plenty
    send_retry_s: float = 0.05  # a send held by a full queue looks this often whether the relay stopped (SNDTIMEO)
    curve: CurveKeys | None = None  # CURVE client keys for the three upstream sockets (None: cleartext)
    link_heartbeat_period_s: float = DEFAULTS.link_heartbeat_period_s  # ZeroMQ heartbeats on the tcp:// upstream links
    link_silence_s: float = DEFAULTS.link_silence_s  # an upstream link silent this long is re-dialled
    peer_send_timeout_s: float = DEFAULTS.peer_send_timeout_s  # a send to a peer that stopped reading fails after this
    hello_retry_s: float = 1.0  # a RelayHello not acknowledged by then is sent again (one lost in a reset)
    # The run's wire format: a deposit of another is refused at the first frame. `run_relay` gives None
    # where the run announces none (no FLODL_WIRE_DTYPE): the ranks' first deposit's format then holds.
    wire: WireFormat | None = F32
    # The host's token from its admission (links.host_token), which every RelayHello carries: the
    # controller takes a hello for this host from no one without it. Required (FLODL_HOST_TOKEN).
    host_token: bytes = b""
    # The run's aggregation (settings.py): under any but mean each rank's deposit ships unfolded (PROTOCOL.md 9.5).
    aggregation: str = "mean"
    # The run's shard map (FLODL_SHARDS, shards.py): which reducers a host frame is cut between. A host
    # it lists runs one of them in its relay's process (relay.Relay's `shard`).
    shards: ShardMap = ShardMap()

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("relay host name must not be empty")
        if len(self.host_token) != HOST_TOKEN_BYTES:
            raise ConfigError(f"relay host_token must be {HOST_TOKEN_BYTES} bytes (FLODL_HOST_TOKEN, given by the agent or the "
                              f"launcher), got {len(self.host_token)}")
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ConfigError(f"relay ranks {self.ranks} must be distinct non-negative global ranks, at least one")
        for name in ("rank_silence_at_relay_s", "rank_first_record_at_relay_s", "consensus_wait_at_relay_s", "send_retry_s",
                     "link_heartbeat_period_s", "link_silence_s", "peer_send_timeout_s", "hello_retry_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"relay {name} must be > 0, got {getattr(self, name)}")
        if self.hwm_records < 1 or self.data_hwm_records < 1:
            raise ConfigError("relay high-water marks must be at least 1 record")

    def upstream(self, shard: int) -> tuple[str, str]:
        """(data, broadcast) endpoints of reducer shard `shard`: 0 the controller's, others a host's."""
        return (self.data_upstream, self.bcast_upstream) if shard == 0 else self.shards.endpoints(shard)

    @classmethod
    def for_controller(
        cls,
        host: str,
        ranks: Iterable[int],
        key: bytes,
        incarnation: bytes,
        controller: ControllerAddress,
        local: tuple[str, str] | None = None,
        **timing: Any,
    ) -> RelayConfig:
        """A relay of `controller`; local endpoints default to per-run ipc:// paths."""
        control, data = local or local_endpoints(key, incarnation, host)
        return cls(
            host=host,
            ranks=tuple(sorted(int(r) for r in ranks)),
            key=key,
            incarnation=incarnation,
            control_upstream=controller.endpoint(Channel.CONTROL),
            data_upstream=controller.endpoint(Channel.DATA),
            bcast_upstream=controller.endpoint(Channel.BROADCAST),
            local_control=control,
            local_data=data,
            **timing,
        )

