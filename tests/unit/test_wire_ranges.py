"""Every number a peer supplies has a range, checked at decode (PROTOCOL.md 3.3): one signed value must
not overflow a later encode or arithmetic of the service that accepted it."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import types
import typing
from typing import Any, Union

import pytest

from flodl_zmq.coordinator import roles
from flodl_zmq.coordinator.roles import FINAL_EVAL_ID
from flodl_zmq.errors import SchemaError
from flodl_zmq.wire import REGISTRY, Channel, Codec, EpochPlan
from flodl_zmq.wire.records import (
    _BY_CLASS,
    MAX_COUNT,
    Bounds,
    Count,
    Duration,
    EvalResult,
    Heartbeat,
    HostReports,
    Rank,
    Seq,
    Signed,
)

KEY = bytes(range(32))
RUN = bytes(range(100, 116))


def sample(tp: Any) -> Any:
    """A valid value of annotation `tp`: the bounds' lower end for a ranged type."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        base, bounds = typing.get_args(tp)
        return base(bounds.lo)
    if origin in (Union, types.UnionType):
        return sample(next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is list:
        return [sample(typing.get_args(tp)[0])]
    if origin is dict:
        return {"k": sample(typing.get_args(tp)[1])}
    if dataclasses.is_dataclass(tp):
        return sample_record(tp)
    return {int: 1, float: 0.5, str: "x", bytes: b"", bool: False}[tp]


def sample_record(cls: type) -> Any:
    if cls is HostReports:  # one merged record, with its one sequence number
        return HostReports([1], [Heartbeat(0, 0, 0)], [], [], [])
    if cls is EpochPlan:
        return EpochPlan(0, 0, 1)
    hints = typing.get_type_hints(cls, include_extras=True)
    return cls(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(cls)})


def bounds_of(tp: Any) -> Bounds | None:
    """The range of a field's values: its own, or its list's or map's items'."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return typing.get_args(tp)[1]
    if origin in (Union, types.UnionType, list, dict):
        return next(filter(None, (bounds_of(a) for a in typing.get_args(tp))), None)
    return None


def out_of_range(tp: Any) -> list[Any]:
    bounds = bounds_of(tp)
    assert bounds is not None
    if isinstance(bounds.lo, int):
        return [bounds.lo - 1, bounds.hi + 1]
    return [bounds.lo - 1.0, bounds.hi * 2, math.inf, -math.inf, math.nan]


def with_value(tp: Any, bad: Any) -> Any:
    """The field's valid sample with `bad` where its ranged number is."""
    origin = typing.get_origin(tp)
    if origin is list:
        return [bad]
    if origin is dict:
        return {"k": bad}
    return bad


RANGED = [
    (kind, name, tp)
    for kind, spec in REGISTRY.items()
    for name, tp in typing.get_type_hints(spec.cls, include_extras=True).items()
    if bounds_of(tp) is not None
]


@pytest.mark.parametrize(("kind", "name", "tp"), RANGED, ids=[f"{k}.{n}" for k, n, _ in RANGED])
def test_a_number_outside_its_fields_range_is_refused_at_decode_naming_the_field(kind: str, name: str, tp: Any) -> None:
    spec = REGISTRY[kind]
    channel: Channel = spec.channels[0]
    tx, rx = Codec(KEY, RUN, "tx"), Codec(KEY, RUN, "rx")
    good = sample_record(spec.cls)
    assert rx.decode(tx.encode(good, channel=channel), channel).record == good  # the lower end is accepted
    for bad in out_of_range(tp):
        record = sample_record(spec.cls)
        if spec.cls is not HostReports or name == "seqs":
            object.__setattr__(record, name, with_value(tp, bad))
            if name in ("batch_ms", "data_ms"):  # a Batch lists each step in all three lists
                object.__setattr__(record, "batch_loss", [0.5])
        with pytest.raises(SchemaError, match=rf"{kind}\.{name}.*: .* is outside "):
            rx.decode(tx.encode(record, channel=channel), channel)


def test_a_merged_records_number_is_checked_as_in_a_message_of_its_own() -> None:
    tx, rx = Codec(KEY, RUN, "tx"), Codec(KEY, RUN, "rx")
    bad = HostReports([1], [Heartbeat(0, 2**64 - 1, 0)], [], [], [])
    with pytest.raises(SchemaError, match=r"relay\.reports\.heartbeats\[0\]\.step_count: .* is outside Count"):
        rx.decode(tx.encode(bad, channel=Channel.CONTROL), Channel.CONTROL)


def test_the_top_of_each_range_is_accepted() -> None:
    tx, rx = Codec(KEY, RUN, "tx"), Codec(KEY, RUN, "rx")
    top = Heartbeat(rank=2**31 - 1, step_count=MAX_COUNT, ack=2**63 - 1)
    assert rx.decode(tx.encode(top, channel=Channel.CONTROL), Channel.CONTROL).record == top


def test_the_final_evals_request_and_its_result_are_within_their_ranges() -> None:
    # The coordinator's own sentinel crosses the wire both ways: outside Count, every rank
    # would refuse the final eval and the run would never end.
    tx, rx = Codec(KEY, RUN, "tx"), Codec(KEY, RUN, "rx")
    for record in (roles.final_eval(3, 0), EvalResult(0, FINAL_EVAL_ID, 3, 0.5, 12.0, None)):
        assert rx.decode(tx.encode(record, channel=Channel.CONTROL), Channel.CONTROL).record == record


def test_every_integer_a_peer_sends_has_a_range() -> None:
    # Plain int is the full msgpack range, which a sum overflows: only the coordinator's own sums keep it.
    plain = sorted(f"{kind}.{name}" for kind, spec in REGISTRY.items()
                   for name, tp in typing.get_type_hints(spec.cls, include_extras=True).items()
                   if tp is int or (typing.get_origin(tp) is list and typing.get_args(tp)[0] is int))
    assert plain == ["control.epoch_aggregated.per_rank_samples", "control.set_global_step.global_step"]


# ---------------------------------------------------------------- PROTOCOL.md says the same

SPEC = (pathlib.Path(__file__).resolve().parents[2] / "protocol" / "PROTOCOL.md").read_text()


def spec_type(tp: Any) -> str:
    """How PROTOCOL.md 9 writes annotation `tp` in a field table (3.3's type names)."""
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return typing.get_args(tp)[1].name
    if origin in (Union, types.UnionType):
        return " \\| ".join("None" if a is type(None) else spec_type(a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp)
        return f"list[`{_BY_CLASS[item].kind}`]" if item in _BY_CLASS else f"list[{spec_type(item)}]"
    if origin is dict:
        return f"dict[str, {spec_type(typing.get_args(tp)[1])}]"
    return tp.__name__


@pytest.mark.parametrize("cls", [*(spec.cls for spec in REGISTRY.values()), EpochPlan], ids=lambda c: c.__name__)
def test_spec_field_tables_give_each_field_its_type_and_range(cls: type) -> None:
    title = "EpochPlan" if cls is EpochPlan else _BY_CLASS[cls].kind
    section = re.search(rf"^#+ [^\n]*`{re.escape(title)}`[^\n]*\n(.*?)(?=^#)", SPEC, re.M | re.S)
    assert section, f"PROTOCOL.md has no section for {title}"
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        row = f"| `{name}` | {spec_type(tp)} |"
        assert row in section.group(1), f"PROTOCOL.md {title}: the row of {name!r} should begin {row!r}"
    for bounds in {typing.get_args(tp)[1] for tp in (Count, Rank, Seq, Signed, Duration)}:
        assert re.search(rf"^\| `{bounds.name}` \|", SPEC, re.M), f"PROTOCOL.md 3.3 does not define {bounds.name}"
