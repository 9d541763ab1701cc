"""A node's schedule API as an import target: the importer's reads and writes over HTTP.

Rows are read one GET /v1/schedule?key= at a time (the API has no batch read), a
few in parallel, and written with POST /v1/schedule, one request per batch, each
all or nothing on the node. The import then behaves exactly as it does against the
store directly, only slower.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec

from store.rows import Route, Row, RowWrite

READ_THREADS = 8


class NodeTargetError(Exception):
    """The node refused or failed a request; the message carries its problem detail."""


class _Routes(msgspec.Struct, frozen=True, kw_only=True):
    routes: list[Route]
    default_cadence_s: int


class _Upsert(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    key: str
    route: str
    next_render_at: int
    sitemap: bool
    cadence_s: int | None = None


class _ScheduleRequest(msgspec.Struct, frozen=True, kw_only=True):
    upsert: list[_Upsert]
    delete: list[str]


def _problem(response: httpx.Response) -> str:
    try:
        body = msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        return response.text[:300]
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("title") or body)
    return str(body)


class NodeScheduleTarget:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_connections=READ_THREADS + 2),
        )
        self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="sitemap-read")
        self._routes: _Routes | None = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def __enter__(self) -> NodeScheduleTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self, response: httpx.Response, what: str) -> None:
        if response.status_code != 200:
            raise NodeTargetError(
                f"{what}: HTTP {response.status_code} from {self._http.base_url}: "
                f"{_problem(response)}"
            )

    def _get_row(self, key: str) -> Row | None:
        response = self._http.get("/v1/schedule", params={"key": key})
        if response.status_code == 404:
            return None
        self._check(response, "reading a row")
        return msgspec.json.decode(response.content, type=Row)

    def get_many(self, keys: Sequence[str]) -> dict[str, Row]:
        rows = self._pool.map(self._get_row, keys)
        return {key: row for key, row in zip(keys, rows, strict=True) if row is not None}

    def write(self, upsert: Sequence[RowWrite] = (), delete: Sequence[str] = ()) -> None:
        body = _ScheduleRequest(
            upsert=[
                _Upsert(
                    key=row.key,
                    route=row.route,
                    next_render_at=row.next_render_at,
                    sitemap=row.sitemap,
                    cadence_s=row.cadence_s,
                )
                for row in upsert
            ],
            delete=list(delete),
        )
        response = self._http.post(
            "/v1/schedule",
            content=msgspec.json.encode(body),
            headers={"content-type": "application/json"},
        )
        self._check(response, "writing rows")

    def _load_routes(self) -> _Routes:
        if self._routes is None:
            response = self._http.get("/v1/routes")
            self._check(response, "reading routes")
            self._routes = msgspec.json.decode(response.content, type=_Routes)
        return self._routes

    def routes(self) -> list[Route]:
        return self._load_routes().routes

    def default_cadence_s(self) -> int:
        return self._load_routes().default_cadence_s
