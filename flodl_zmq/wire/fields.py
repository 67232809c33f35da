"""How a decoded msgpack map becomes a record, and a record a map (PROTOCOL.md 3.3, 7).

Every field is checked against its annotation (wire/records.py: the ranged
types `Count`, `Rank`, ...; optional, list, map and nested record fields)
before a record exists: a missing, unknown or mistyped field, a bool where
a number is meant or a value out of its range is a SchemaError naming the
field. Each annotation's validator is built once, so a decode reads no
typing machinery: that took half of a control record's decode time.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Union

from flodl_zmq.errors import SchemaError

_DATACLASS = "__dataclass_fields__"  # what dataclasses.is_dataclass looks for, without its call
_PLAIN = {int: int, float: (int, float), str: str, bytes: bytes, bool: bool}
Check = Callable[[Any, str], Any]  # (decoded value, where it sits) -> the value, normalised; SchemaError if bad


@functools.cache
def _checker(tp: Any) -> Check:
    """The validator of one annotation, built once per type (the module docstring says why)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:  # a ranged type: its base type, then its bounds
        base, bounds = _checker(args[0]), args[1]

        def ranged(value: Any, where: str) -> Any:
            value = base(value, where)
            if (refusal := bounds.refusal(value)) is not None:
                raise SchemaError(f"{where}: {refusal}")
            return value
        return ranged
    if tp in _PLAIN:
        want, is_bool = _PLAIN[tp], tp is bool

        def plain(value: Any, where: str) -> Any:
            # bool is an int subclass in Python; refuse it where an int or float is meant and vice versa.
            if isinstance(value, bool) != is_bool or not isinstance(value, want):
                raise SchemaError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
            return float(value) if tp is float else value
        return plain
    if origin in (Union, types.UnionType):
        nullable, inner = type(None) in args, _checker(next(a for a in args if a is not type(None)))
        return lambda value, where: None if value is None and nullable else inner(value, where)
    if origin is list:
        item = _checker(args[0])

        def listed(value: Any, where: str) -> list[Any]:
            if not isinstance(value, list):
                raise SchemaError(f"{where}: expected a list, got {type(value).__name__}")
            return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return listed
    if origin is dict:
        entry = _checker(args[1])

        def mapped(value: Any, where: str) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise SchemaError(f"{where}: expected a map, got {type(value).__name__}")
            for k in value:
                if not isinstance(k, str):
                    raise SchemaError(f"{where}: map keys must be strings, got {type(k).__name__}")
            return {k: entry(v, f"{where}[{k!r}]") for k, v in value.items()}
        return mapped
    if dataclasses.is_dataclass(tp):  # a nested structure (EpochPlan), or a record merged into another
        return lambda value, where: from_fields(tp, value, where)
    raise TypeError(f"annotation {tp!r} has no wire validator")  # a records.py bug, not input


@functools.cache
def _fields(cls: type) -> tuple[tuple[tuple[str, Check], ...], frozenset[str]]:
    """(name, validator) pairs and the name set of `cls`, computed once per class."""
    hints = typing.get_type_hints(cls, include_extras=True)  # keep the ranges
    pairs = tuple((f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls))
    return pairs, frozenset(name for name, _ in pairs)


def from_fields(cls: type, fields: Any, where: str = "") -> Any:
    """Build `cls` from a decoded msgpack map, refusing missing, unknown or mistyped fields."""
    where = where or cls.__name__
    if not isinstance(fields, dict):
        raise SchemaError(f"{where}: fields must be a map, got {type(fields).__name__}")
    pairs, names = _fields(cls)
    if fields.keys() != names:
        unknown = set(fields) - names
        if unknown:
            raise SchemaError(f"{where}: unknown field(s) {sorted(map(str, unknown))}")
        raise SchemaError(f"{where}: missing field(s) {[n for n, _ in pairs if n not in fields]}")
    return cls(**{n: check(fields[n], f"{where}.{n}") for n, check in pairs})


def to_fields(rec: Any) -> dict[str, Any]:
    """The msgpack map of a record (a nested EpochPlan or merged record becomes a map)."""
    out = {}
    for name, _ in _fields(type(rec))[0]:
        v = getattr(rec, name)
        if hasattr(v, _DATACLASS):  # a nested structure
            v = to_fields(v)
        elif type(v) is list and v and hasattr(v[0], _DATACLASS):  # records merged into this one
            v = [to_fields(x) for x in v]
        out[name] = v
    return out
