"""Reading request bodies under a size limit, and writing msgspec-encoded responses."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.problems import ApiError, from_decode_error, from_validation_error

T = TypeVar("T")
_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def too_large(limit: int) -> ApiError:
    return ApiError(413, "Request body too large", f"the body must be at most {limit} bytes")


def check_media_type(content_type: str | None, accepted: Iterable[str]) -> None:
    """415 unless the Content-Type's media type (its parameters aside, in any case) is one
    of `accepted`."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    names = list(accepted)
    if media_type not in names:
        sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise ApiError(
            415,
            "Unsupported media type",
            f"{sent}: send the body as one of {', '.join(names)}",
        )


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "Bad Content-Length", "Content-Length is not a number") from None
        if size > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def integral(value: Any) -> Any:
    """The decoded body with every integer-valued number (`300.0`) as the integer.

    JSON Schema counts `300.0` as an integer, so the document's `integer` fields accept it;
    msgspec's typed decoding refuses a float for an `int`. No request field holds a number
    that is not an `int` or a `float` (which takes an int as well), so turning them all is
    exact. `1.5` stays a float and is refused where an integer is wanted."""
    kind = type(value)
    if kind is float:
        return int(value) if value.is_integer() else value
    if kind is list:
        return [integral(item) for item in value]
    if kind is dict:
        return {name: integral(item) for name, item in value.items()}
    return value


def decode_json(data: bytes, type_: type[T]) -> T:
    """The body as `type_`, or the ApiError that says what is wrong (400 or 422).

    Typed decoding first, the fast path every well-formed client takes; only a body it
    refuses is decoded again number-tolerantly (integral, then the same type's checks), so
    a refusal names the same field and reason either way."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None
    try:
        return msgspec.convert(integral(msgspec.json.decode(data)), type_, strict=True)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:  # the typed pass refused it before reading it all
        raise from_decode_error(exc) from None


async def read_json(request: Request, type_: type[T], limit: int) -> T:
    data = await read_body(request, limit)
    if not data.strip():
        raise ApiError(400, "Empty body", "this endpoint needs a JSON body", field="$")
    return decode_json(data, type_)


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        _encoder.encode(content),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )
