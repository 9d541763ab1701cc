"""Reading request bodies under a size limit, and writing msgspec-encoded responses."""

from __future__ import annotations

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


async def read_json(request: Request, type_: type[T], limit: int) -> T:
    data = await read_body(request, limit)
    if not data.strip():
        raise ApiError(400, "Empty body", "this endpoint needs a JSON body", field="$")
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        return decoder.decode(data)  # type: ignore[no-any-return]
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None


def json_response(
    content: Any, status_code: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(
        _encoder.encode(content),
        status_code=status_code,
        media_type="application/json",
        headers=headers,
    )
