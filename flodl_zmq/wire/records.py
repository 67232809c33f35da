"""Every record of the protocol, as typed dataclasses.

Rules this module keeps:

- A record kind is a string `family.name` that appears in the header; it maps
  to exactly one dataclass here and to the channels it may travel on. A kind
  on the wrong channel is a schema error, so a data-channel forger cannot make
  a rank obey a control record.
- Fields are plain msgpack types: int, float, str, bytes, bool, None, lists,
  string-keyed maps, and the nested `EpochPlan`. Decoding checks every field's
  type against the annotation and refuses missing or unknown fields
  (wire/fields.py): loose dicts never travel past the codec.
- Every number a peer supplies has a range, in its field's type (`Count`,
  `Rank`, `Seq`, `Signed`, `Duration`; PROTOCOL.md 3.3), checked at decode
  and nowhere else: a value the codec accepted can neither overflow a later
  encode (msgpack holds -2^63..2^64-1) nor an arithmetic the services do with
  it (a sum of counters, an int() of a time), so a member holding the key
  cannot kill a service with one signed number.
- Records that carry tensors (`carries_payload`) receive them as separate raw
  frames; tensor bytes never go inside msgpack.

The normative list with meanings is protocol/PROTOCOL.md; tests check that
both agree.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from flodl_zmq.errors import SchemaError


class Channel(str, enum.Enum):
    """The four logical channels; each is its own socket (see PROTOCOL.md, Endpoints)."""

    CONTROL = "control"  # coordinator <-> ranks (via the relay), relay control
    DATA = "data"  # ranks -> relay -> reducer: parameter frames
    BROADCAST = "bcast"  # reducer PUB -> relays SUB: consensus, probes
    JOIN = "join"  # agents <-> membership


@dataclass(frozen=True)
class RecordSpec:
    kind: str
    cls: type
    channels: tuple[Channel, ...]
    carries_payload: bool


REGISTRY: dict[str, RecordSpec] = {}
_BY_CLASS: dict[type, RecordSpec] = {}


def record(kind: str, *channels: Channel, payload: bool = False):
    """Class decorator: register a frozen dataclass as record `kind` on `channels`."""

    def wrap(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        if kind in REGISTRY:
            raise ValueError(f"record kind {kind!r} registered twice")
        spec = RecordSpec(kind, cls, tuple(channels), payload)
        REGISTRY[kind] = spec
        _BY_CLASS[cls] = spec
        cls.KIND = kind
        return cls

    return wrap


@dataclass(frozen=True)
class Bounds:
    """The values a numeric field may take, inclusive (PROTOCOL.md 3.3); a float within them is also finite."""

    name: str
    lo: int | float
    hi: int | float

    def refusal(self, value: int | float) -> str | None:
        """Why `value` is out of range, or None."""
        if self.lo <= value <= self.hi:  # False for NaN
            return None
        return f"{value!r} is outside {self.name} {self.lo}..{self.hi}"


MAX_COUNT = 2**53 - 1  # exact in a float64; a sum of 1,024 of them still fits msgpack's int64
MAX_RANK = 2**31 - 1
MAX_SEQ = 2**63 - 1  # the header's `seq` range (PROTOCOL.md 5.1)

# The field types with a range (PROTOCOL.md 3.3, normative). Plain `int` is left only to the coordinator's
# sums (`global_step`, `per_rank_samples`), which no peer supplies. Plain `float` is a value of the user's
# model or function (a loss, a metric, a norm, a learning rate, a mass): any float64, NaN and infinities
# included, since an honest run can produce them; its users must cope with any.
Count = Annotated[int, Bounds("Count", 0, MAX_COUNT)]  # steps, samples, batches, epochs, rounds, ids, versions
Rank = Annotated[int, Bounds("Rank", 0, MAX_RANK)]  # a global rank
Seq = Annotated[int, Bounds("Seq", 0, MAX_SEQ)]  # a sequence number or an acknowledgement of one; a nonce
Signed = Annotated[int, Bounds("Signed", -MAX_COUNT, MAX_COUNT)]  # an exit status; -1 for "none"
Duration = Annotated[float, Bounds("Duration", 0.0, float(MAX_COUNT))]  # a measured time (ms, or s by name)


def spec_of(rec: object) -> RecordSpec:
    try:
        return _BY_CLASS[type(rec)]
    except KeyError:
        raise SchemaError(f"{type(rec).__name__} is not a registered record") from None


# --------------------------------------------------------------------------- shared


@dataclass(frozen=True)
class EpochPlan:
    """A contiguous span [offset, offset + size) of epoch `epoch`'s global permutation.

    `deposit`: the round the rank deposits in, unasked, when it has trained the span (its window
    ends there, PROTOCOL.md 10.1); None: it waits for `RequestParams`.
    """

    epoch: Count
    offset: Count
    size: Count
    deposit: Count | None = None


# --------------------------------------------------------------------------- control: coordinator -> rank

C, D, B, J = Channel.CONTROL, Channel.DATA, Channel.BROADCAST, Channel.JOIN


@record("control.request_params", C)
class RequestParams:
    """Snapshot your parameters and deposit a RoundFrame for `round` on the data channel."""

    round: Count


@record("control.update", C)
class Update:
    """The consensus of `round` is coming on the broadcast channel; `next_plan` is your next chunk."""

    round: Count
    next_plan: EpochPlan | None


@record("control.start_epoch", C)
class StartEpoch:
    plan: EpochPlan


@record("control.extend_partition", C)
class ExtendPartition:
    """Append the span [offset, offset + size) of `epoch` to the partition in flight (Sync redistribution)."""

    epoch: Count
    offset: Count
    size: Count


@record("control.declare_dead", C)
class DeclareDead:
    rank: Rank


@record("control.throttle", C)
class Throttle:
    """You are too far ahead: stop training until the next command."""


@record("control.set_global_step", C)
class SetGlobalStep:
    global_step: int


@record("control.checkpoint", C)
class Checkpoint:
    version: Count
    target_rank: Rank


@record("control.execute_eval", C)
class ExecuteEval:
    schedule_id: Count
    epoch: Count
    target_rank: Rank
    adopt_consensus: bool


@record("control.set_epoch_role", C)
class SetEpochCallbackRole:
    rank: Rank


@record("control.shutdown", C)
class Shutdown:
    pass


@record("control.shutdown_with_save", C)
class ShutdownWithSave:
    reason: str


@record("control.epoch_aggregated", C)
class EpochAggregated:
    epoch: Count
    avg_loss: float
    epoch_ms: float
    per_rank_throughput: list[float]
    per_rank_batch_share: list[float]
    per_rank_loss: list[float | None]
    per_rank_samples: list[int]
    scalars: dict[str, float]


@record("control.eval_broadcast", C)
class EvalBroadcast:
    epoch: Count
    metric: float


@record("control.coord_heartbeat", C)
class CoordHeartbeat:
    ack: Seq = 0  # the rank's control records accepted without a gap (PROTOCOL.md 10.7)


# --------------------------------------------------------------------------- timing: rank -> coordinator


@record("rank.hello", C)
class RankHello:
    """A rank's first record: who it is and what it trains, so mismatches stop the run by name."""

    rank: Rank
    world_size: Count
    host: str
    model_sig: bytes
    dataset_sig: bytes


@record("timing.batch", C)
class Batch:
    """The steps taken since the rank's last report, one list entry per step, oldest first.

    Coalesced (PROTOCOL.md): a record per step cost the rank's core more than
    a small model's step; the lists keep every step's numbers for ElChe.
    """

    rank: Rank
    step_count: Count
    batch_ms: list[Duration]
    data_ms: list[Duration]
    batch_loss: list[float]

    def __post_init__(self) -> None:
        if not len(self.batch_ms) == len(self.data_ms) == len(self.batch_loss):
            raise SchemaError(
                f"Batch from rank {self.rank}: batch_ms, data_ms and batch_loss have "
                f"{len(self.batch_ms)}, {len(self.data_ms)} and {len(self.batch_loss)} entries; "
                "a report lists each step once in all three"
            )


@record("timing.sync_ack", C)
class SyncAck:
    rank: Rank
    round: Count
    step_count: Count
    divergence: float | None
    post_norm: float | None
    pre_norm: float | None


@record("timing.exiting", C)
class Exiting:
    """Clean-exit latch: this rank is leaving on purpose; do not count it as a failure."""

    rank: Rank


@record("timing.lr_update", C)
class LrUpdate:
    rank: Rank
    lr: float


@record("timing.heartbeat", C)
class Heartbeat:
    rank: Rank
    step_count: Count
    ack: Seq = 0  # the coordinator's control records to this rank accepted without a gap (PROTOCOL.md 10.7)


@record("timing.snapshot_ready", C)
class SnapshotReady:
    rank: Rank
    round: Count


@record("timing.eval_result", C)
class EvalResult:
    rank: Rank
    schedule_id: Count
    epoch: Count
    metric: float
    elapsed_ms: Duration
    error: str | None


@record("timing.checkpoint_result", C)
class CheckpointResult:
    rank: Rank
    version: Count
    elapsed_ms: Duration
    error: str | None


@record("timing.epoch_fn_elapsed", C)
class EpochFnElapsed:
    rank: Rank
    epoch: Count
    elapsed_ms: Duration


# --------------------------------------------------------------------------- metrics: rank -> coordinator


@record("metrics.epoch", C)
class EpochMetrics:
    rank: Rank
    epoch: Count
    avg_loss: float
    batches_processed: Count
    samples_processed: Count
    epoch_ms: Duration
    compute_only_ms: Duration
    data_starve_ms: Duration
    scalar_sums: dict[str, float]
    scalar_counts: dict[str, Count]


# --------------------------------------------------------------------------- relay control


@record("relay.hello", C, D)
class RelayHello:
    """A relay's first record on each upstream socket: the host and its global ranks.

    `token` is the host's secret from its admission (PROTOCOL.md 10.5): another
    member holds the session key too, so only the token says the hello is the host's.
    """

    host: str
    ranks: list[Rank]
    model_sigs: list[bytes]
    token: bytes


@record("relay.hello_ack", C, D)
class RelayHelloAck:
    pass


@record("relay.rank_exit", C, D)
class RankExit:
    """A local rank said goodbye or stopped heartbeating (the relay's first-hand view)."""

    rank: Rank


@record("relay.reports", C)
class HostReports:
    """A host's step reports, heartbeats, snapshot notices and acks, merged by its relay (PROTOCOL.md 9.4).

    One record per host and period instead of one per rank: the controller's
    decode work and the per-message bytes (header, MAC, routes) grow with
    hosts, not with ranks per host. Each merged record keeps its fields and
    its sequence number in its rank's stream (`seqs`, in the order of the
    lists below, concatenated), so the coordinator hands it on in order and
    acknowledges it as if it had come alone (10.7 item 9).
    """

    seqs: list[Seq]
    heartbeats: list[Heartbeat]
    batches: list[Batch]
    snapshots: list[SnapshotReady]
    sync_acks: list[SyncAck]

    def __post_init__(self) -> None:
        held = len(self.heartbeats) + len(self.batches) + len(self.snapshots) + len(self.sync_acks)
        if len(self.seqs) != held:
            raise SchemaError(f"HostReports: {len(self.seqs)} sequence numbers for {held} merged records; "
                              "each record has exactly one")

    @classmethod
    def merge(cls, items: Sequence[tuple[int, Any]]) -> HostReports:
        """One record of `(seq, record)` pairs (each of a kind in MERGEABLE)."""
        by_kind: dict[type, list[tuple[int, Any]]] = {k: [] for k in MERGEABLE}
        for seq, r in items:
            by_kind[type(r)].append((seq, r))
        groups = [by_kind[k] for k in MERGEABLE]
        return cls([seq for g in groups for seq, _ in g], *([r for _, r in g] for g in groups))

    def unmerge(self) -> list[tuple[int, Any]]:
        """The `(seq, record)` pairs this record carries, grouped by kind (the receiver orders by `seq`)."""
        return list(zip(self.seqs, [*self.heartbeats, *self.batches, *self.snapshots, *self.sync_acks], strict=True))


# The rank records a relay merges into `relay.reports`, in the order of its lists. The others (a
# chunk's metrics, a goodbye, a callback's result) go up alone and at once: a rank waits on their answers.
MERGEABLE: tuple[type, ...] = (Heartbeat, Batch, SnapshotReady, SyncAck)


@record("relay.declare_dead", D)
class RelayDeclareDead:
    """The controller declared `rank` dead: drop it from the fold barrier."""

    rank: Rank


# --------------------------------------------------------------------------- data plane


@record("data.round_frame", D, payload=True)
class RoundFrame:
    """A rank's deposit: tensors pre-multiplied by `mass`, the rank's realized work this round."""

    round: Count
    rank: Rank
    mass: float


@record("data.host_frame", D, payload=True)
class HostFrame:
    """A host's fold: the plain sum of its ranks' deposits and of their masses (never divided)."""

    round: Count
    host: str
    ranks: list[Rank]
    mass: float


@record("data.consensus", B, D, payload=True)
class Consensus:
    """The averaged parameters of `round`; mass 0 means nothing was realized: keep local state."""

    round: Count
    mass: float


@record("data.shard_start", D, payload=True)
class ShardStart:
    """What host shard `shard` starts from, sent by the controller's reducer to that shard's relay at its first
    hello and while it hellos on (PROTOCOL.md 10.9 item 11): the run's outer step over the shard's slice,
    `stepped` of whose leading values are parameters, and as payload the slice of the starting global model,
    then of its momentum (f32, `shards.state_frames`); with `outer` "none", nothing else."""

    shard: Count
    outer: str
    lr: float
    momentum: float
    stepped: Count


@record("data.outer_state_request", D)
class OuterStateRequest:
    """The controller's reducer to a shard host's relay, for its shard: send the outer step's state of your slice
    as of the first round you publish at or after `round` (now, if you already have): a bundle is due
    (PROTOCOL.md 10.9 item 12)."""

    round: Count


@record("data.outer_state", D, payload=True)
class OuterState:
    """Shard `shard`'s outer state after its step of `round`, through its relay to the controller's reducer:
    as payload the slice's global model, then its momentum, as in `ShardStart`."""

    shard: Count
    round: Count


# Round 0 is never averaged (the coordinator counts rounds from 1): it names the consensus a
# resumed or re-formed world starts from, which its ranks ask the reducer for (PROTOCOL.md 13).
RESUME_ROUND = 0


@record("data.consensus_request", D)
class ConsensusRequest:
    """A relay (or a rank, of its relay) missed the consensus of `round` and asks for it point-to-point."""

    round: Count


@record("data.consensus_gone", D)
class ConsensusGone:
    """The reducer no longer holds `round`; `latest` is the newest round it can resend."""

    round: Count
    latest: Signed


@record("data.frame_request", D)
class FrameRequest:
    """The frame its receiver sent for `round` never arrived (lost in a reset): send it again."""

    round: Count


@record("bcast.probe", B)
class Probe:
    """Readiness probe on PUB; a subscriber answers with SubscriberReady to be counted."""

    nonce: Seq


@record("data.subscriber_ready", D)
class SubscriberReady:
    host: str
    nonce: Seq


# --------------------------------------------------------------------------- join (agents <-> membership)


@record("join.challenge_request", J)
class ChallengeRequest:
    """Before a hello or a status request: ask the membership for a fresh challenge nonce.

    `nonce` is the asker's own fresh random nonce, echoed in `join.challenge`, so a
    challenge recorded earlier cannot be replayed to it (PROTOCOL.md 10.4).
    """

    nonce: bytes


@record("join.challenge", J)
class Challenge:
    """The membership's fresh nonce for this connection, valid once, for `ttl_s` seconds."""

    client_nonce: bytes
    nonce: bytes
    ttl_s: Duration


@record("join.hello", J)
class JoinHello:
    """`nonce`: the challenge nonce this connection was issued (under the MAC: a hello is good once)."""

    host: str
    devices: list[str]
    dataset_sig: bytes
    protocol: Count
    model_sig: bytes | None
    nonce: bytes


@record("join.accept", J)
class JoinAccept:
    """Admitted: `incarnation` keys every later frame of this link (with the session key).

    `run_id` names the run (an agent taken back by a restarted controller
    checks it is its own); `incarnation` is the controller's, fresh at each of
    its starts, so a frame recorded on a link to an earlier one is refused.
    `session_key` travels only under open admission; a pre-shared key is never resent.
    """

    ranks: list[Rank]
    session_key: bytes | None
    formation_wait_s: Duration
    run_id: bytes
    incarnation: bytes
    nonce: bytes  # the hello's challenge nonce: the accept answers that hello and no other
    host_token: bytes  # this host's secret, which its relay's hello proves (PROTOCOL.md 10.5); no other member has it


@record("join.reject", J)
class JoinReject:
    """`nonce`: the refused hello's challenge nonce (empty when the message had none, e.g. version skew)."""

    reason: str
    nonce: bytes


@record("join.world_formed", J)
class WorldFormed:
    """`incarnation`: the formed (or re-formed) world's, which its relay and ranks sign and check in every
    control, data and broadcast record (FLODL_INCARNATION); fresh at each re-form."""

    world_size: Count
    spawn_json: str
    incarnation: bytes
    # The run's route secret for a host whose relay runs a reducer shard (PROTOCOL.md 10.9), empty for any other.
    route_secret: bytes


@record("join.rank_exited", J)
class RankExited:
    """A rank process ended; `code` is its exit status, negative for the signal that killed it."""

    rank: Rank
    code: Signed


@record("join.relay_exited", J)
class RelayExited:
    code: Signed  # non-zero, not its agent's doing: the host's ranks lost their path, a shard it ran is gone


@record("join.abort", J)
class Abort:
    reason: str


@record("join.heartbeat", J)
class JoinHeartbeat:
    """Liveness on an admitted join link, both ways: ZeroMQ will not report a vanished peer."""


@record("join.status_request", J)
class StatusRequest:
    """`flodl-zmq status` asks for the cohort's state, keyed like a hello; `nonce` as in a hello."""

    nonce: bytes


@record("join.status_reply", J)
class StatusReply:
    """The cohort's state as a JSON object (schema: PROTOCOL.md, `join.status_reply`); `nonce` echoes the request's."""

    json: str
    nonce: bytes


# What a rank may send on its control link (through its relay, to the coordinator). Every
# other control kind is the coordinator's or a relay's: a rank that sends one is broken or
# hostile, and its relay refuses it rather than carry it upstream (PROTOCOL.md 7).
RANK_CONTROL_RECORDS: frozenset[type] = frozenset({
    RankHello, Heartbeat, Batch, SyncAck, SnapshotReady, Exiting, LrUpdate,
    EvalResult, CheckpointResult, EpochFnElapsed, EpochMetrics,
})
