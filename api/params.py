"""Query and path parameters, checked against the types `/openapi.json` states for them.

The endpoint table names each parameter's type (`Param`); the document's
schema for it and this check are both made from that type, and a rule beyond it (a key's
size in UTF-8 bytes) is the store's own check, so a value the document calls valid is not
refused here and one it refuses is a 422 naming the parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from api.problems import invalid_query


@dataclass(frozen=True)
class Param:
    """A query or path parameter: its value is checked against `schema`, the type the
    document states for it (the handler runs the same check)."""

    name: str
    description: str
    schema: Any = str
    # A rule beyond the schema's own keywords, as the store checks it (raises ValueError).
    check: Callable[[str], object] | None = None
    # The value when the request gives none; None makes the parameter required, unless
    # it is `optional` (then a request may leave it out, and its handler sees no value).
    default: str | None = None
    optional: bool = False


def checked(param: Param, value: str | None) -> str | None:
    """The value, checked; the default when absent (None for an optional parameter)."""
    if value is None:
        if param.default is not None or param.optional:
            return param.default
        raise invalid_query(param.name, f"required: {param.description}")
    try:
        # Not strict: a query's value is text, and an integer parameter takes its digits.
        msgspec.convert(value, param.schema, strict=False)
        if param.check is not None:
            param.check(value)
    except msgspec.ValidationError as exc:
        raise invalid_query(param.name, str(exc)) from None
    except ValueError as exc:  # the store's check says "what: why"
        raise invalid_query(param.name, str(exc).partition(": ")[2] or str(exc)) from None
    return value


def as_int(value: str) -> int:
    """A value `checked` against an integer schema, as the integer."""
    number: int = msgspec.convert(value, int, strict=False)
    return number


def read_params(params: tuple[Param, ...], values: Mapping[str, str]) -> dict[str, str]:
    """Every declared parameter, checked; `values` are the request's query or path values.
    An optional parameter the request does not give is left out."""
    out: dict[str, str] = {}
    for param in params:
        value = checked(param, values.get(param.name))
        if value is not None:
            out[param.name] = value
    return out
