"""RFC 9457 problem details: every error the API returns, with a message a person can act on."""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec
from starlette.responses import Response

PROBLEM_TYPE = "application/problem+json"
_encoder = msgspec.json.Encoder()


class Problem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    field: str | None = None  # the JSON path of the offending input, for 400 and 422


class ApiError(Exception):
    """Raised by a handler; rendered as a problem response."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        *,
        field: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail or title)
        self.status = status
        self.title = title
        self.detail = detail
        self.field = field
        self.headers = dict(headers or {})

    def problem(self, instance: str | None = None) -> Problem:
        return Problem(
            title=self.title,
            status=self.status,
            detail=self.detail,
            instance=instance,
            field=self.field,
        )


def problem_response(error: ApiError, instance: str | None = None) -> Response:
    return Response(
        _encoder.encode(error.problem(instance)),
        status_code=error.status,
        media_type=PROBLEM_TYPE,
        headers=error.headers,
    )


def invalid_field(field: str, detail: str) -> ApiError:
    return ApiError(422, "Invalid request body", f"{field}: {detail}", field=field)


def invalid_query(name: str, detail: str) -> ApiError:
    return ApiError(422, "Invalid query parameter", f"{name}: {detail}", field=name)


def not_found(detail: str) -> ApiError:
    return ApiError(404, "Not found", detail)


_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")


def from_validation_error(exc: msgspec.ValidationError) -> ApiError:
    """msgspec says "... - at `$.items[0].token`"; the problem names that path as `field`."""
    text, _, at = str(exc).partition(" - at `")
    path = at.rstrip("`") if at else "$"
    missing = _MISSING.match(text)
    unknown = _UNKNOWN.match(text)
    if missing:
        path = f"{path}.{missing['name']}"
        text = "required field is missing"
    elif unknown:
        path = f"{path}.{unknown['name']}"
        text = "unknown field"
    return invalid_field(path, text)


def from_decode_error(exc: msgspec.DecodeError) -> ApiError:
    return ApiError(400, "Malformed JSON", f"the body is not valid JSON: {exc}", field="$")
