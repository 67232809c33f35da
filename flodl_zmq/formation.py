"""Formation: whether the world the controller was started for has assembled, checked rank by rank.

After the relays registered, every rank of the world says `RankHello`
(rank, world size, host, model and dataset signatures) through its relay.
`Formation` is the pure check the controller runs on those hellos before a
step is trained; `ControllerService` (flodl_zmq/controller_service.py) is
the I/O shell around it, as `MembershipService` is around `JoinWindow`.
Inputs in, outcomes out, the time always an argument.

Rules the check keeps:

- **Every check before any change.** A hello that is refused or ignored
  changes nothing; once the verdict is formed or failed it is final, and
  every later input only returns it.
- **Mismatches stop the run by name, before training.** Once all W ranks
  have spoken, their dataset, model and world-size claims are compared with
  the controller's own; a cohort training on different data or models would
  average nonsense silently. The failure names every rank that differs.
- **A rank that lies about itself fails the formation.** A hello whose rank
  or host disagrees with where the relay says it came from is a misconfigured
  process (FLODL_RANK, FLODL_HOST): the world cannot form with it.
- **A rank known to have left is acted on at once** (`rank_left`), never
  found by the start-up timeout minutes later. The world forms without it
  when the ranks left are still at least `minimum`: it keeps its number and
  is simply absent (`Formed.absent`), so every other rank's number and the
  exact coverage of every epoch stay as they are. Below the minimum the
  formation fails at once, naming each rank gone and why (its exit code).
- **A vacancy starts dead.** A rank of the rank space that no host holds
  (its host left before the world formed or re-formed, PROTOCOL.md 13.1) is absent
  from the start, like a rank that left, and counts toward no quorum.
- **Ignored, not fatal:** a hello from outside the world (the shell has
  already refused its route) and a second hello from the same rank (the first
  stands); both come back as `Ignored` for the shell to count.
- **Time-out.** Past `deadline` without every hello the formation fails,
  as an authentication failure when records failed authentication meanwhile
  (a process with another FLODL_KEY is the usual reason a rank is never
  heard), else naming the ranks never heard from.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flodl_zmq.errors import AuthError, FlodlError, TrainingError
from flodl_zmq.wire.records import RankHello


def rank_space(world: Mapping[str, Sequence[int]]) -> int:
    """The world size: the highest rank + 1, vacancies included (see environment.parse_world)."""
    return 1 + max((r for rs in world.values() for r in rs), default=-1)


def vacancies(world: Mapping[str, Sequence[int]]) -> tuple[int, ...]:
    """Ranks of the rank space no host holds: they start dead."""
    held = {r for rs in world.values() for r in rs}
    return tuple(r for r in range(rank_space(world)) if r not in held)


class FormationPhase(str, enum.Enum):
    """Where the ranks' hellos stand (every rank of the world checked in, or not); the join window has its own,
    `join.WindowPhase`."""

    FORMING = "forming"
    FORMED = "formed"
    FAILED = "failed"


@dataclass(frozen=True)
class Waiting:
    """Not every rank has spoken yet; `missing` are the ranks not heard from."""

    missing: tuple[int, ...]


@dataclass(frozen=True)
class Formed:
    """Every rank still there said hello and agrees with the controller: start training.

    `absent`: ranks that left before the world formed (rank -> why); the run
    starts with them dead.
    """

    hellos: Mapping[int, RankHello]
    absent: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    """The world will not form. `auth`: the likely cause is a wrong session key (raise AuthError)."""

    reason: str
    ranks: tuple[int, ...] = ()
    auth: bool = False

    def error(self) -> FlodlError:
        return AuthError(self.reason) if self.auth else TrainingError(self.reason)


@dataclass(frozen=True)
class Ignored:
    """A hello that changes nothing (`why` is a counter name: `late_hello`, `duplicate_hello`,
    `departed_hello`, `unknown_rank`, `late_exit`, `duplicate_exit`)."""

    why: str


Outcome = Waiting | Formed | Failed | Ignored


class Formation:
    """The rank-hello ledger of one start-up.

    `world`: host -> its global ranks. `model_sig`, `dataset_sig`: the
    controller's own, which every rank must match. `minimum`: the fewest
    ranks the world may form with when some left before it formed.
    `deadline` and every `now` are seconds on one monotonic clock the caller
    owns; `timeout_s` is only named in the failure message.
    """

    def __init__(
        self,
        world: Mapping[str, tuple[int, ...]],
        model_sig: bytes,
        dataset_sig: bytes,
        deadline: float,
        timeout_s: float,
        minimum: int,
    ) -> None:
        self.host_of = {r: h for h, rs in world.items() for r in rs}
        self.world_size = rank_space(world)
        self.vacant = {r: "no host holds it: its host left before the world formed" for r in vacancies(world)}
        self.model_sig = model_sig
        self.dataset_sig = dataset_sig
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.minimum = minimum
        self.hellos: dict[int, RankHello] = {}
        self.left: dict[int, str] = {}  # rank -> why, ranks gone before the world formed
        self.auth_failures = 0
        self.last_auth_error = ""
        self._verdict: Waiting | Formed | Failed = Waiting(tuple(sorted(self.host_of)))

    @property
    def phase(self) -> FormationPhase:
        v = self._verdict
        return FormationPhase.FORMED if isinstance(v, Formed) else FormationPhase.FAILED if isinstance(v, Failed) else FormationPhase.FORMING

    @property
    def verdict(self) -> Waiting | Formed | Failed:
        return self._verdict

    # ------------------------------------------------------------------ inputs

    def hello(self, rank: int, hello: RankHello) -> Outcome:
        """`rank` (the route its relay vouched for) said `hello`."""
        if self.phase is FormationPhase.FORMED:
            return Ignored("late_hello")
        if self.phase is FormationPhase.FAILED:
            return self._verdict
        if rank not in self.host_of:
            return Ignored("unknown_rank")
        if rank in self.left:
            return Ignored("departed_hello")  # declared gone, it stays gone: its number is not reused
        if rank in self.hellos:
            return Ignored("duplicate_hello")
        if hello.rank != rank:
            return self._fail(
                f"rank {rank}'s hello claims rank {hello.rank}: the process was started with another "
                f"FLODL_RANK than its relay's; check how that host starts its ranks", (rank,),
            )
        if hello.host != self.host_of[rank]:
            return self._fail(
                f"rank {rank}'s hello names host {hello.host!r}, but it belongs to {self.host_of[rank]!r}: "
                f"check FLODL_HOST on that host", (rank,),
            )
        self.hellos[rank] = hello
        return self._settle()

    def rank_left(self, rank: int, reason: str) -> Outcome:
        """`rank` is known to be gone (its launcher, agent or relay saw it exit): form without it, or fail."""
        if self.phase is not FormationPhase.FORMING:
            return self._verdict if self.phase is FormationPhase.FAILED else Ignored("late_exit")
        if rank not in self.host_of:
            return Ignored("unknown_rank")
        if rank in self.left:
            return Ignored("duplicate_exit")
        self.left[rank] = reason
        self.hellos.pop(rank, None)  # a hello said before it died does not bring it back
        remaining = len(self.host_of) - len(self.left)
        if remaining < self.minimum:
            # Found only by the start-up timeout otherwise, minutes later; stop now, naming each.
            gone = "; ".join(f"rank {r} ({why})" for r, why in sorted(self.left.items()))
            return self._fail(
                f"rank(s) failed before training started: {gone}; {remaining} of {len(self.host_of)} ranks "
                f"remain, fewer than the minimum of {self.minimum} (--min-ranks); their output is in their "
                f"host's log{self._silent_note()}", tuple(sorted(self.left)),
            )
        return self._settle()

    def auth_failed(self, error: str) -> None:
        """A control record failed authentication while the world formed (counted for the time-out)."""
        if self.phase is FormationPhase.FORMING:
            self.auth_failures += 1
            self.last_auth_error = error

    def poll(self, now: float) -> Waiting | Formed | Failed:
        """The verdict at `now`: fails once `deadline` passes without every hello."""
        if self.phase is not FormationPhase.FORMING or now <= self.deadline:
            return self._verdict
        if self.auth_failures:
            return self._fail(
                f"{self.auth_failures} control record(s) failed authentication while the world formed "
                f"({self.last_auth_error}); a process runs with another session key: check FLODL_KEY on "
                f"every process",
                self._missing(), auth=True,
            )
        missing = list(self._missing())
        return self._fail(
            f"rank(s) {missing} never said hello within {self.timeout_s:.0f} s "
            f"(FLODL_STARTUP_TIMEOUT); check that they started and reach their relay",
            tuple(missing),
        )

    # ------------------------------------------------------------------ internals

    def _settle(self) -> Waiting | Formed | Failed:
        """Waiting while a rank still there has not spoken; else compare the claims and form or fail."""
        missing = self._missing()
        if missing:
            self._verdict = Waiting(missing)
            return self._verdict
        problems, bad = self._disagreements()
        if problems:
            return self._fail("; ".join(problems), bad)
        self._verdict = Formed(dict(self.hellos), {**self.vacant, **self.left})
        return self._verdict

    def _silent_note(self) -> str:
        """The ranks still silent when others left: a rank waiting for the world gives up at its own start-up
        timeout, so the ranks it waited for, and their hosts, are where the cause may be."""
        missing = self._missing()
        if not missing:
            return ""
        hosts = sorted({self.host_of[r] for r in missing})
        return f"; rank(s) {list(missing)} on host(s) {hosts} had not said hello yet: check that host's log too"

    def _missing(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.host_of) - set(self.hellos) - set(self.left)))

    def _disagreements(self) -> tuple[list[str], tuple[int, ...]]:
        hellos = self.hellos
        bad_data = sorted(r for r, h in hellos.items() if h.dataset_sig != self.dataset_sig)
        bad_model = sorted(r for r, h in hellos.items() if h.model_sig != self.model_sig)
        bad_world = sorted(r for r, h in hellos.items() if h.world_size != self.world_size)
        problems = []
        if bad_data:
            problems.append(
                f"dataset mismatch: rank(s) {bad_data} load a dataset whose signature differs from the "
                f"controller's; every process must build the same dataset (same files, same split)"
            )
        if bad_model:
            problems.append(f"model mismatch: rank(s) {bad_model} build a model with other tensors than the controller's")
        if bad_world:
            problems.append(f"world size mismatch: rank(s) {bad_world} were started for another world")
        return problems, tuple(sorted(set(bad_data + bad_model + bad_world)))

    def _fail(self, reason: str, ranks: tuple[int, ...], auth: bool = False) -> Failed:
        self._verdict = Failed(reason, ranks, auth)
        return self._verdict
