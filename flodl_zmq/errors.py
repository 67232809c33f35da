"""One exception hierarchy for the whole package.

Every message names the cause and, where there is one, the fix: a user reading
a log line from a rank on a machine they cannot see must know what to change.
"""

from __future__ import annotations


class FlodlError(Exception):
    """Base of every error flodl-zmq raises on purpose."""


class ConfigError(FlodlError):
    """A configuration value is invalid; the message names the setting and the allowed range."""


class WireError(FlodlError):
    """A received message was rejected by the codec (base of every rejection cause)."""


class AuthError(WireError):
    """The MAC did not verify: wrong session key, tampering, or a frame from another run."""


class IncarnationError(AuthError):
    """An authentic frame of another incarnation: of another run, or of this run before a controller
    restart or a re-form (PROTOCOL.md 4.1). A replay of a recorded frame, or a process that outlived its
    incarnation; refused like a frame of another run, never answered."""


class VersionError(WireError):
    """The peer speaks another protocol version."""


class SchemaError(WireError):
    """The header or a record's fields do not match the specification."""


class LimitError(WireError):
    """A size or count exceeds a configured limit (checked before allocating)."""


class FramingError(WireError):
    """Wrong number of frames, or a payload frame whose length or shape disagrees with its header."""


class AttributionError(WireError):
    """An authentic frame whose signer is not the one its route names: a peer speaking for another.

    `kind` is the record kind, `signer` the authenticated sender, `expected` the
    signer the route names (None when the route names nobody: an unknown peer).
    """

    def __init__(self, message: str, *, kind: str = "", signer: str = "", expected: str | None = None):
        super().__init__(message)
        self.kind, self.signer, self.expected = kind, signer, expected


class ReplayError(WireError):
    """A sequence or round number did not increase: a replayed or reordered message."""


class ProtocolError(FlodlError):
    """A peer broke a protocol rule (double deposit, schema drift inside a round, wrong state)."""


class FoldError(ProtocolError):
    """A deposit cannot join this round's fold; the round is torn down, never shipped."""


class PoisonedDeposit(ProtocolError):
    """A deposit whose values or mass cannot be trusted: a non-finite element, or more mass than
    its sender's realized work. It is refused before it touches the round; its sender is declared
    dead and the round completes without it (one host must not NaN or dominate the consensus)."""


class MassOverBound(PoisonedDeposit):
    """A frame's mass over the coordinator's bound for its ranks. The bound may still rise: a rank's last
    steps reach the coordinator on the control path while its frame travels the data path, so the
    reducer holds such a frame a while (`reducer_service.MASS_WAIT_S`) before refusing it."""


class ShmError(FlodlError):
    """Shared memory for by-reference payloads cannot be used safely (a squatted or foreign path)."""


class RunComplete(FlodlError):
    """`--resume auto` found the run already completed: nothing to resume, and nothing is started (exit 0)."""


class PrivateDirError(FlodlError):
    """A run's private directory (ipc socket files) is missing its privacy: another user's, or open."""


class CoordinatorError(FlodlError):
    """The coordinator received an input that is illegal in its current state."""


class MembershipError(FlodlError):
    """A join was refused or the world could not form."""


class NoStatusReply(MembershipError):
    """`flodl-zmq status` had no reply in time: kept apart from a reply refused, so that a watch the
    controller has answered says it stopped answering, not that the key may differ."""


class SessionError(FlodlError):
    """A `Session` used out of its order: a batch not reported with `step`, `batches()` outside the with block."""


class TrainingError(FlodlError):
    """The training run cannot continue (dataset mismatch, all ranks lost, user callback failure)."""
