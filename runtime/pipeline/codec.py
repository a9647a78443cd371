"""JSON encoding of step values with type round-trip.

A step's result is stored as JSON; on replay it is decoded into the type the code asks for:
dataclasses, pydantic models, lists, tuples and dicts of them, ``Optional`` and unions,
``datetime``/``date``/``UUID``/``Decimal``/``Enum`` and plain JSON values.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import types
import typing
import uuid
from collections.abc import Mapping
from typing import Any

from db.errors import DarError


class CodecError(DarError):
    """A value could not be encoded to JSON or decoded into the type asked for."""


def encode(value: Any) -> Any:
    """A JSON-compatible copy of ``value``."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # pydantic v2
        return dump(mode="json")
    if isinstance(value, enum.Enum):
        return encode(value.value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID | decimal.Decimal):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [encode(v) for v in value]
    raise CodecError(
        f"cannot store a {type(value).__name__} as a step result: return JSON values, "
        "dataclasses or pydantic models"
    )


def decode(data: Any, tp: Any) -> Any:
    """``data`` (as :func:`encode` made it) as an instance of ``tp``; ``Any``/``None``
    returns the JSON value unchanged."""
    if tp is None or tp is Any or tp is object:
        return data
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return decode(data, arg)
            except (CodecError, TypeError, ValueError) as e:
                errors.append(str(e))
        raise CodecError(f"{data!r} matches none of {tp}: {'; '.join(errors)}")
    if origin is typing.Literal:
        if data not in args:
            raise CodecError(f"{data!r} is not one of {args}")
        return data
    if origin in (list, set, frozenset) or tp in (list, set, frozenset):
        inner = args[0] if args else Any
        items = [decode(v, inner) for v in _seq(data, tp)]
        return (origin or tp)(items)
    if origin is tuple or tp is tuple:
        seq = _seq(data, tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(v, args[0]) for v in seq)
        if args:
            return tuple(decode(v, a) for v, a in zip(seq, args, strict=True))
        return tuple(seq)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(data, dict):
            raise CodecError(f"expected an object for {tp}, got {data!r}")
        value_type = args[1] if len(args) == 2 else Any
        return {k: decode(v, value_type) for k, v in data.items()}
    if isinstance(tp, type):
        return _decode_class(data, tp)
    return data


def _seq(data: Any, tp: Any) -> list[Any]:
    if not isinstance(data, list):
        raise CodecError(f"expected a list for {tp}, got {data!r}")
    return data


def _decode_class(data: Any, tp: type) -> Any:
    if tp is bool or tp is str:
        if not isinstance(data, tp):
            raise CodecError(f"expected {tp.__name__}, got {data!r}")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise CodecError(f"expected int, got {data!r}")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise CodecError(f"expected float, got {data!r}")
        return float(data)
    if issubclass(tp, enum.Enum):
        return tp(data)
    if tp is dt.datetime:
        return dt.datetime.fromisoformat(data)
    if tp is dt.date:
        return dt.date.fromisoformat(data)
    if tp is uuid.UUID:
        return uuid.UUID(data)
    if tp is decimal.Decimal:
        return decimal.Decimal(data)
    validate = getattr(tp, "model_validate", None)
    if callable(validate):  # pydantic v2
        return validate(data)
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise CodecError(f"expected an object for {tp.__name__}, got {data!r}")
        hints = typing.get_type_hints(tp)
        kwargs = {
            f.name: decode(data[f.name], hints.get(f.name, Any))
            for f in dataclasses.fields(tp)
            if f.init and f.name in data
        }
        return tp(**kwargs)
    if isinstance(data, tp):
        return data
    raise CodecError(f"cannot decode {data!r} into {tp.__name__}")


def return_type(fn: Any) -> Any:
    """The declared return type of ``fn``, or ``Any`` when it has none (a lambda)."""
    try:
        return typing.get_type_hints(fn).get("return", Any)
    except (NameError, TypeError):
        return Any
