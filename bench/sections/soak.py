"""Soak: a node under a fleet at full speed, writers and faults, judged from the clients' logs.

`python -m bench soak [--minutes N] [--quick]` (default 10 minutes; quick: 2, as CI runs
it) on SQLite; `python -m bench soak_postgres [--minutes N]` the same on a scratch
PostgreSQL database. Bounded: the load stops at N minutes, the checks follow, and every
process the soak started is stopped on the way out.

The load, all through the node's HTTP API:

- **the fleet**: processes running `fleet.runner.FleetRunner` with the async client, at
  full speed (`concurrency` renders each, a render of a few ms, a few that outlast half
  their lease and are renewed); outcomes rendered (the next render a few seconds ahead,
  given in the completion, so the keys come round again), failed and gone.
- **the writers**: one process upserting and deleting rows of its own (due in a day,
  so the fleet never takes them), importing sitemaps (a fixed set of documents, re-imported
  in turn: the first round adds rows the fleet then renders, later rounds add back what
  the fleet found gone), and pausing and resuming the fleet's routes.
- **the faults**, on a schedule spread over the run: SIGKILL of a random worker (worker 0
  first) about every minute, SIGSTOP of worker 0 for 10 s, SIGTERM of the node and a new
  start (same instance, so the lease snapshot carries the leases over) every few minutes;
  on PostgreSQL also `pg_terminate_backend` of one of the node's backends and of all of
  them at once, and a restart of the server (one the soak runs for itself, since the
  machine's server is shared; with `--shared-server` no restart).

Each client logs what it saw: every HTTP answer or transport error, every grant (token,
expiry, route, send and answer time), renewal, completion and write. `bench/sections/soak_check.py`
judges from those logs alone: no key held by two at once, no paused route's key granted,
no row lost, stale or resurrected, no 5xx (a 503 with Retry-After is accepted inside a
fault that leaves the node unready and `UNREADY_GRACE_S` after it; connection resets from
a killed worker are counted apart). After the load: queue-state exact and equal to the
table, the lease table's census with no parked slot (after a sweep), and each node
role's RSS flat (its peak over the run's second half within 5% of its peak over the first
half after the warm-up, whichever process held the role, unless the process that reached
it was born at that level and did not climb: see `soak_check.rss_by_role`). Charts over time in
`var/bench/soak*.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import http.client
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from bench.harness import report
from bench.harness.node import ADMIN_TOKEN, FLEET_TOKEN, Node
from bench.sections import soak_check

UNREADY_GRACE_S = 30.0
F_ROUTES = ("f-a", "f-b", "f-c", "f-d")
W_ROUTES = ("w-a", "w-b")
DAY_MS = 86_400_000


class Config(msgspec.Struct, frozen=True, kw_only=True):
    minutes: float = 10.0
    fleet_keys: int = 40_000
    writer_keys: int = 20_000
    sitemaps: int = 6
    sitemap_urls: int = 500
    fleets: int = 2
    concurrency: int = 256
    lease_s: int = 10
    revisit_s: tuple[float, float] = (0.2, 2.0)  # a rendered key's next render, ahead
    long_share: float = 0.003  # renders that outlast half their lease (renewed)
    failed_share: float = 0.05
    gone_share: float = 0.005
    write_every_s: float = 0.05
    write_batch: int = 10
    import_every_s: float = 8.0
    pause_every_s: float = 20.0
    pause_s: float = 5.0
    kill_every_s: float = 60.0
    stop_every_s: float = 150.0
    stop_s: float = 10.0
    restart_every_s: float = 210.0
    pg_kill_every_s: float = 75.0
    pg_kill_all_every_s: float = 170.0
    pg_restart_every_s: float = 200.0
    # Completions the fleet never sends (a render worker that died with its leases): the
    # keys come back only after their leases expire, the regrants the overlap check needs.
    abandon_share: float = 0.005
    warmup_s: float = 20.0
    quiet_tail_s: float = 15.0  # no fault starts this close to the end
    sample_every_s: float = 2.0
    min_life_s: float = 60.0  # a process younger than this is listed, not judged for RSS
    rss_growth_max: float = 0.05


QUICK = Config(
    minutes=2.0,
    fleet_keys=20_000,
    writer_keys=6_000,
    sitemaps=3,
    sitemap_urls=300,
    kill_every_s=40.0,
    stop_every_s=120.0,
    restart_every_s=75.0,
    pg_kill_every_s=35.0,
    pg_kill_all_every_s=70.0,
    pg_restart_every_s=70.0,
    warmup_s=15.0,
    min_life_s=40.0,
    # Two minutes with a worker 0 killed every 40 s is mostly warm-up: a respawned worker's
    # RSS is still climbing to its role's level, and the rows grow with the writer's. The
    # bound here catches a gross leak; the long run's 5% is the judgement on drift.
    rss_growth_max=0.10,
)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# --- the fleet ---------------------------------------------------------------------------


class Attempts:
    """One client call's HTTP attempts, counted by the transport: all of them, and those
    that may have reached the node (every one but a refused or timed-out connect), with the
    first such one's send time: a completion cannot have landed before it."""

    def __init__(self) -> None:
        self.count = 0
        self.reached = 0
        self.first_reached = 0


_ATTEMPTS: contextvars.ContextVar[Attempts | None] = contextvars.ContextVar(
    "soak_attempts", default=None
)


LISTS = ("http", "grants", "renewals", "completions", "claims", "writes", "pauses")
FLUSH_EVERY = 50_000
DETAIL_BYTES = 300  # of a 5xx body kept with its answer: the problem's title and detail


class Book:
    """One client process's log: lists of tuples, appended to its file as length-prefixed
    msgpack chunks every FLUSH_EVERY records (a long run's log never sits in memory), the
    last chunk with the totals and notes."""

    def __init__(self, who: str, path: Path) -> None:
        self.who = who
        self.path = path
        self.path.write_bytes(b"")
        self.http: list[tuple[str, int, int, str, str, int, str, str]] = []
        self.grants: list[tuple[Any, ...]] = []
        self.renewals: list[tuple[Any, ...]] = []
        self.completions: list[tuple[Any, ...]] = []
        self.claims: list[tuple[int, int]] = []  # (answered, µs) of single-attempt claims
        self.writes: list[tuple[Any, ...]] = []
        self.pauses: list[tuple[Any, ...]] = []
        self.abandoned = 0
        self.note: dict[str, Any] = {}

    def answer(
        self, sent: int, method: str, path: str, status: int, extra: str, body: bytes = b""
    ) -> None:
        """One attempt's answer; a 5xx keeps the start of its body, which says why."""
        detail = body[:DETAIL_BYTES].decode(errors="replace") if status >= 500 else ""
        self.http.append((self.who, sent, now_ms(), method, path, status, extra, detail))

    def flush(self, final: bool = False) -> None:
        if not final and sum(len(getattr(self, name)) for name in LISTS) < FLUSH_EVERY:
            return
        chunk: dict[str, Any] = {name: getattr(self, name) for name in LISTS}
        if final:
            chunk.update(who=self.who, abandoned=self.abandoned, note=self.note)
        data = msgspec.msgpack.encode(chunk)
        with self.path.open("ab") as out:
            out.write(len(data).to_bytes(8, "little") + data)
        for name in LISTS:
            setattr(self, name, [])


def read_book(path: Path) -> dict[str, Any]:
    """A Book's file back as one dict of lists (and its last chunk's notes)."""
    book: dict[str, Any] = {name: [] for name in LISTS}
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        size = int.from_bytes(data[offset : offset + 8], "little")
        chunk = msgspec.msgpack.decode(data[offset + 8 : offset + 8 + size])
        offset += 8 + size
        for name in LISTS:
            book[name].extend(chunk.pop(name))
        book.update(chunk)
    if "who" not in book:
        raise RuntimeError(f"{path}: the log has no final chunk (its process did not finish)")
    return book


class LoggingTransport(httpx.AsyncBaseTransport):
    """Every attempt's answer (status, Retry-After) or transport error, into the book."""

    def __init__(self, book: Book) -> None:
        self.book = book
        self.inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=16))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        attempts = _ATTEMPTS.get()
        sent = now_ms()
        if attempts is not None:
            attempts.count += 1
            attempts.reached += 1
            attempts.first_reached = attempts.first_reached or sent
        try:
            response = await self.inner.handle_async_request(request)
        except Exception as exc:
            self.book.answer(sent, request.method, request.url.path, 0, type(exc).__name__)
            if attempts is not None and isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                attempts.reached -= 1  # no connection: nothing was sent
                if attempts.first_reached == sent:
                    attempts.first_reached = 0
            raise
        body = await response.aread() if response.status_code >= 500 else b""
        self.book.answer(
            sent,
            request.method,
            request.url.path,
            response.status_code,
            response.headers.get("retry-after") or "",
            body,
        )
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _fleet_client(port: int, book: Book, fleet: int, abandon: float, rng: random.Random) -> Any:
    from fleet.client import AsyncFleetClient, FleetError, RetryPolicy

    class LoggingClient(AsyncFleetClient):
        # Every claim goes through claim_completing (a plain claim completes nothing), and
        # a claim may carry the previous batch's results: both are logged here.
        async def claim_completing(self, max: int, items: Any, **kw: Any) -> Any:
            items = self._abandoning(items)
            attempts = Attempts()
            mark = _ATTEMPTS.set(attempts)
            sent, started = now_ms(), time.perf_counter()
            try:
                leases, results = await super().claim_completing(max, items, **kw)
            except FleetError:
                self._log_lost(items, attempts)
                raise
            finally:
                _ATTEMPTS.reset(mark)
            answered = now_ms()
            lease_ms = int(kw.get("lease_s", 300)) * 1000
            for lease in leases:
                book.grants.append(
                    (fleet, lease.key, lease.token, lease.route, lease.lease_expires_at,
                     lease_ms, sent, answered)
                )  # fmt: skip
            if leases and attempts.count == 1:
                book.claims.append((answered, int((time.perf_counter() - started) * 1e6)))
            self._log_results(items, results, attempts, answered)
            book.flush()
            return leases, results

        async def renew(self, leases: Any, *, lease_s: int | None = None) -> Any:
            sent = now_ms()
            try:
                results = await super().renew(leases, lease_s=lease_s)
            except FleetError:
                for lease in leases:
                    book.renewals.append((fleet, lease.key, lease.token, sent, 0, False, 0))
                raise
            answered = now_ms()
            by_key = {lease.key: lease.token for lease in leases}
            for result in results:
                book.renewals.append(
                    (fleet, result.key, by_key.get(result.key, ""), sent, answered, result.ok,
                     result.lease_expires_at or 0)
                )  # fmt: skip
            return results

        async def complete(self, items: Any) -> Any:
            items = self._abandoning(items)
            if not items:
                return []
            attempts = Attempts()
            mark = _ATTEMPTS.set(attempts)
            try:
                results = await super().complete(items)
            except FleetError:
                self._log_lost(items, attempts)
                raise
            finally:
                _ATTEMPTS.reset(mark)
            self._log_results(items, results, attempts, now_ms())
            return results

        def _abandoning(self, items: Any) -> list[Any]:
            kept = [item for item in items if rng.random() >= abandon]
            book.abandoned += len(items) - len(kept)
            return kept

        def _log_lost(self, items: Any, attempts: Attempts) -> None:
            # Lost, unless no attempt ever reached the node.
            fate = "lost" if attempts.reached else "unsent"
            for item in items:
                book.completions.append(
                    (fleet, item.key, item.token, item.outcome, item.next_render_at or 0,
                     attempts.first_reached, 0, fate, attempts.reached)
                )  # fmt: skip

        def _log_results(self, items: Any, results: Any, attempts: Attempts, answered: int) -> None:
            sent = attempts.first_reached
            by_key = {result.key: result for result in results}
            for item in items:
                result = by_key.get(item.key)
                verdict = "missing" if result is None else "ok" if result.ok else result.error
                book.completions.append(
                    (fleet, item.key, item.token, item.outcome, item.next_render_at or 0,
                     sent, answered, verdict or "error", attempts.reached)
                )  # fmt: skip

    policy = RetryPolicy(attempts=60, base_s=0.05, factor=1.5, cap_s=1.0, max_retry_after_s=2.0)
    return LoggingClient(
        f"http://127.0.0.1:{port}",
        token=FLEET_TOKEN,
        worker=f"soak-{fleet}",
        timeout_s=15.0,
        retry=policy,
        transport=LoggingTransport(book),
    )


class SoakRenderer:
    """A few ms per render, a few that outlast half the lease; rendered (next render a few
    seconds ahead), failed or gone."""

    def __init__(self, config: Config, rng: random.Random) -> None:
        self.config = config
        self.rng = rng

    async def __call__(self, lease: Any) -> Any:
        from fleet.renderers import RenderResult

        config, rng = self.config, self.rng
        if rng.random() < config.long_share:
            await asyncio.sleep(config.lease_s * rng.uniform(0.6, 1.3))
        else:
            await asyncio.sleep(rng.lognormvariate(-5.0, 0.6))  # about 8 ms
        draw = rng.random()
        if draw < config.gone_share:
            return RenderResult(outcome="gone")
        if draw < config.gone_share + config.failed_share:
            return RenderResult(outcome="failed", detail="")
        low, high = config.revisit_s
        return RenderResult(
            outcome="rendered", next_render_at=now_ms() + int(rng.uniform(low, high) * 1000)
        )


def fleet_process(config: Config, fleet: int, port: int, stop: Any, out: str) -> None:
    from fleet.runner import FleetConfig, FleetRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    book = Book(f"fleet {fleet}", Path(out))

    async def main() -> None:
        client = _fleet_client(port, book, fleet, config.abandon_share, random.Random(2000 + fleet))
        runner = FleetRunner(
            client,
            SoakRenderer(config, random.Random(1000 + fleet)),
            FleetConfig(
                concurrency=config.concurrency,
                lease_s=config.lease_s,
                wait_s=2,
                grace_s=5.0,
                completion_batch=100,
                completion_linger_s=0.02,
                state_every_s=0,
                renew_every_s=1.0,
            ),
        )
        task = asyncio.create_task(runner.run())
        while not stop.is_set() and not task.done():
            await asyncio.sleep(0.2)
        runner.request_stop()
        statistics = await task
        book.note = {"statistics": msgspec.to_builtins(statistics)}
        await client.aclose()

    try:
        asyncio.run(main())
    finally:
        book.flush(final=True)


# --- the writers -------------------------------------------------------------------------


def writer_key(i: int) -> str:
    return f"https://soak.example/w/{i:07d}"


def fleet_key(i: int) -> str:
    return f"https://soak.example/f/{i:07d}"


def sitemap_url(doc: int, i: int) -> str:
    return f"https://soak.example/s/{doc}/{i:05d}"


def sitemap_document(doc: int, urls: int) -> bytes:
    body = "".join(f"<url><loc>{sitemap_url(doc, i)}</loc></url>" for i in range(urls))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">{body}</urlset>'
    ).encode()


class Http:
    """One keep-alive connection that reopens after an error; every answer is logged."""

    def __init__(self, port: int, token: str, book: Book | None, timeout_s: float) -> None:
        self.port = port
        self.token = token
        self.book = book
        self.timeout_s = timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def call(
        self, method: str, path: str, body: bytes | None = None, content_type: str = ""
    ) -> tuple[int, bytes]:
        """(status, body); status 0 with the error's name on a transport error."""
        headers = {"Authorization": f"Bearer {self.token}"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        sent = now_ms()
        try:
            if self.conn is None:
                self.conn = http.client.HTTPConnection(
                    "127.0.0.1", self.port, timeout=self.timeout_s
                )
            self.conn.request(method, path, body=body, headers=headers)
            response = self.conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            if self.book is not None:
                self.book.answer(sent, method, path, 0, type(exc).__name__)
            return 0, type(exc).__name__.encode()
        if self.book is not None:
            self.book.answer(
                sent, method, path, response.status, response.getheader("Retry-After") or "", data
            )
        if response.getheader("Connection", "").lower() == "close":
            self.close()
        return response.status, data

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
        self.conn = None


def writer_process(config: Config, port: int, stop: Any, out: str, seed: int) -> None:
    """Schedule writes, sitemap imports, route pauses; each request retried until answered
    (a 4xx ends the writer: the soak's own requests must be valid)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    book = Book("writer", Path(out))
    rng = random.Random(seed)
    client = Http(port, ADMIN_TOKEN, book, 15.0)
    lost_until: dict[str, int] = {}  # keys a lost attempt may still change: left alone
    documents = [sitemap_document(doc, config.sitemap_urls) for doc in range(config.sitemaps)]
    next_import = time.monotonic()
    next_pause = time.monotonic() + config.pause_every_s / 2
    paused: tuple[str, float] | None = None
    imports = 0
    counts = {"batches": 0, "imports": 0, "pauses": 0, "retries": 0}

    def send(
        method: str, path: str, body: bytes, kind: str, on_attempt: Callable[[int, int], None]
    ) -> None:
        """Until a 2xx; on_attempt(sent, answered or 0) for every attempt."""
        delay = 0.05
        while True:
            sent = now_ms()
            status, data = client.call(method, path, body, kind)
            on_attempt(sent, now_ms() if 200 <= status < 300 else 0)
            if 200 <= status < 300:
                return
            if 400 <= status < 500:
                raise RuntimeError(f"{method} {path}: HTTP {status}: {data[:300]!r}")
            counts["retries"] += 1
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)

    def pause(route: str, paused: bool) -> None:
        def logged(sent: int, answered: int) -> None:
            book.pauses.append((route, paused, sent, answered))

        body = b'{"paused": true}' if paused else b'{"paused": false}'
        send("PUT", f"/v1/routes/{route}", body, "", logged)

    try:
        while not stop.is_set():
            started = time.monotonic()
            now = now_ms()
            if started >= next_import:
                doc = imports % config.sitemaps
                imports += 1
                keys = [sitemap_url(doc, i) for i in range(config.sitemap_urls)]

                def imported(sent: int, answered: int, keys: list[str] = keys) -> None:
                    book.writes.extend((key, "import", "", 0, sent, answered) for key in keys)

                send("POST", "/v1/sitemaps", documents[doc], "application/xml", imported)
                counts["imports"] += 1
                next_import = started + config.import_every_s
            if paused is None and started >= next_pause:
                route = rng.choice(F_ROUTES)
                pause(route, True)
                counts["pauses"] += 1
                paused = (route, started + config.pause_s)
            elif paused is not None and started >= paused[1]:
                route = paused[0]
                pause(route, False)
                paused = None
                next_pause = started + config.pause_every_s
            ops: dict[str, tuple[str, str, int]] = {}
            for _ in range(config.write_batch):
                key = writer_key(rng.randrange(config.writer_keys))
                if key in ops or lost_until.get(key, 0) > now:
                    continue
                if rng.random() < 0.5:
                    nra = now + DAY_MS + rng.randrange(DAY_MS)
                    ops[key] = ("upsert", rng.choice(W_ROUTES), nra)
                else:
                    ops[key] = ("delete", "", 0)
            if ops:
                body = msgspec.json.encode(
                    {
                        "upsert": [
                            {"key": k, "route": r, "next_render_at": n, "cadence_s": 86400}
                            for k, (op, r, n) in ops.items()
                            if op == "upsert"
                        ],
                        "delete": [k for k, (op, _, _) in ops.items() if op == "delete"],
                    }
                )

                def wrote(
                    sent: int, answered: int, ops: dict[str, tuple[str, str, int]] = ops
                ) -> None:
                    for key, (op, route, nra) in ops.items():
                        book.writes.append((key, op, route, nra, sent, answered))
                        if not answered:
                            lost_until[key] = sent + soak_check.LOST_WINDOW_MS

                send("POST", "/v1/schedule", body, "", wrote)
                counts["batches"] += 1
            book.flush()
            time.sleep(max(0.0, config.write_every_s - (time.monotonic() - started)))
        if paused is not None:
            route = paused[0]
            pause(route, False)
    except Exception as exc:
        book.note["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        book.note["counts"] = counts
        client.close()
        book.flush(final=True)


# --- the node, its processes and its faults -----------------------------------------------


def preload(url: str, config: Config, now: int, rng: random.Random) -> list[soak_check.Write]:
    """The fleet's rows (all due) and half the writers' (due in a day), straight into the
    store before the node starts; logged as writes certain at `now`."""
    from store import open_store
    from store.rows import RowWrite

    written: list[soak_check.Write] = []
    rows: list[RowWrite] = []
    for i in range(config.fleet_keys):
        nra = now - rng.randrange(600_000)
        rows.append(
            RowWrite(key=fleet_key(i), route=F_ROUTES[i % 4], next_render_at=nra, cadence_s=3600)
        )
    for i in range(0, config.writer_keys, 2):
        nra = now + DAY_MS + rng.randrange(DAY_MS)
        rows.append(
            RowWrite(key=writer_key(i), route=W_ROUTES[i % 2], next_render_at=nra, cadence_s=86400)
        )
    store = open_store(url)
    try:
        for start in range(0, len(rows), 5000):
            store.write(upsert=rows[start : start + 5000])
    finally:
        store.close()
    for row in rows:
        written.append(
            soak_check.Write(row.key, "preload", row.route, row.next_render_at, now, now)
        )
    return written


class Fault(msgspec.Struct, kw_only=True):
    at_s: float  # planned, from the load's start
    kind: str  # kill | stop | restart | pg_kill | pg_kill_all
    worker: int | None = None
    pid: int | None = None
    started: int = 0  # epoch ms
    ended: int = 0
    detail: str = ""


def plan(
    config: Config, postgres: bool, rng: random.Random, server_restarts: bool = False
) -> list[Fault]:
    """The faults, in time order and never two at once: kills of a random worker (worker 0
    first), SIGSTOPs of worker 0, restarts, and on PostgreSQL backend terminations and (on
    a server of the soak's own) server restarts."""
    duration = config.minutes * 60
    last = duration - config.quiet_tail_s
    faults: list[Fault] = []

    def every(kind: str, period: float, first: float) -> None:
        at = first
        while at < last:
            faults.append(Fault(at_s=at, kind=kind))
            at += period * rng.uniform(0.85, 1.15)

    every("kill", config.kill_every_s, config.warmup_s + 5)
    every("stop", config.stop_every_s, config.warmup_s + config.kill_every_s / 2 + 3)
    every("restart", config.restart_every_s, config.restart_every_s * 0.8)
    if postgres:
        every("pg_kill", config.pg_kill_every_s, config.warmup_s + 12)
        every("pg_kill_all", config.pg_kill_all_every_s, config.pg_kill_all_every_s * 0.6)
        if server_restarts:
            every("pg_restart", config.pg_restart_every_s, config.pg_restart_every_s * 0.65)
    faults.sort(key=lambda f: f.at_s)
    kills = 0
    for fault in faults:
        if fault.kind == "kill":
            fault.worker = 0 if kills == 0 else rng.randrange(2)
            kills += 1
        elif fault.kind == "stop":
            fault.worker = 0
    return faults


class Monitor:
    """Every `every_s`: each node process's RSS (role from the overview's worker list) and
    queue-state's due count. The monitor's own reads are not the fleet's: its 503s (a
    queue-state that cannot vouch) are recorded, not judged."""

    def __init__(self, node: Node, every_s: float) -> None:
        self.node = node
        self.every_s = every_s
        self.rss: list[tuple[int, int, str, int]] = []
        self.due: list[tuple[int, int]] = []
        self.roles: dict[int, str] = {}
        # CPU seconds (user + system) by pid, with a name: the node's processes and the
        # soak's own clients (`clients`, pid -> name), to say which side was the limit.
        self.cpu: list[tuple[int, int, str, float]] = []
        self.clients: dict[int, str] = {}
        self.stop = threading.Event()
        self.paused = threading.Event()  # set while the node is being restarted
        self.thread = threading.Thread(target=self.run, name="soak-monitor", daemon=True)

    def run(self) -> None:
        while not self.stop.wait(self.every_s):
            if self.paused.is_set():
                continue
            try:
                self.sample()
            except Exception as exc:  # a sample is a view: never let it end the soak
                report.progress(f"soak: monitor sample failed: {type(exc).__name__}: {exc}")

    def sample(self) -> None:
        import psutil

        process = self.node.process
        if process is None or process.poll() is not None:
            return
        client = Http(self.node.port, ADMIN_TOKEN, None, 1.5)
        try:
            status, data = client.call("GET", "/prerender_admin/overview")
            if status == 200:
                overview = msgspec.json.decode(data)
                for worker in (overview.get("supervisor") or {}).get("workers") or []:
                    if worker.get("pid"):
                        self.roles[int(worker["pid"])] = f"worker {worker['index']}"
            status, data = client.call("GET", "/prerender_admin/queue-state")
            if status == 200:
                self.due.append((now_ms(), int(msgspec.json.decode(data)["now"]["due"])))
        finally:
            client.close()
        at = now_ms()
        supervisor = psutil.Process(process.pid)
        members = [(supervisor, "supervisor")]
        members += [(child, "") for child in supervisor.children(recursive=False)]
        for member, role in members:
            with contextlib.suppress(psutil.Error):
                rss = member.memory_info().rss
                named = role or self.roles.get(member.pid, "? worker")
                self.rss.append((at, member.pid, named, rss))
                times = member.cpu_times()
                self.cpu.append((at, member.pid, f"node {named}", times.user + times.system))
        for pid, name in self.clients.items():
            with contextlib.suppress(psutil.Error):
                times = psutil.Process(pid).cpu_times()
                self.cpu.append((at, pid, name, times.user + times.system))

    def pid_of(self, worker: int, tries: int = 20) -> int:
        """The worker's pid from the supervisor's overview (any worker serves it)."""
        for _ in range(tries):
            client = Http(self.node.port, ADMIN_TOKEN, None, 1.0)
            try:
                status, data = client.call("GET", "/prerender_admin/overview")
            finally:
                client.close()
            if status == 200:
                for found in msgspec.json.decode(data)["supervisor"]["workers"]:
                    if found["index"] == worker and found.get("pid"):
                        return int(found["pid"])
            time.sleep(0.25)
        raise RuntimeError(f"no pid for worker {worker} from the overview")


class Postgres:
    """The soak's database, and the faults done to it.

    By default a PostgreSQL server of the soak's own (initdb into the node's directory, on a
    free port, run as the `postgres` user when the soak runs as root), so that restarting
    it disturbs no one: the machine's server is shared with other work. With
    `shared=True`, or when no server binaries are found, a scratch database on the server
    of RENDERQUEUE_TEST_PG instead, and no restart: terminating every backend of the node
    at once is the nearest fault that leaves the others' work alone."""

    def __init__(self, shared: bool) -> None:
        # Its own directory, not the node's: the server's user must be able to reach it.
        self.directory = Path(tempfile.mkdtemp(prefix="rqsoak_pg_"))
        self.bin = None if shared else _pg_bin()
        self.scratch: Any = None
        self.port = 0
        if self.bin is None:
            from bench.harness.postgres import Scratch, db_url

            self.directory.rmdir()
            self.scratch = Scratch()
            self.name = self.scratch.create("soak")
            self.url = db_url(self.name)
            self.admin_url = db_url("postgres")
            return
        from bench.harness.node import free_port

        self.port = free_port()
        (self.directory / "sock").mkdir()
        self.name = "soak"
        self.admin_url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/soak"
        try:
            self._as_owner(
                ["chown", "-R", "postgres:postgres", str(self.directory)], root_only=True
            )
            self._pg("initdb", "-D", str(self.directory / "data"), "-A", "trust", "-U",
                     "postgres", "--no-instructions", "-E", "UTF8")  # fmt: skip
            self.start()
            import psycopg

            with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute("CREATE DATABASE soak")
        except BaseException:
            self.drop()
            raise
        report.progress(f"soak: a PostgreSQL server of its own on port {self.port}")

    @property
    def private(self) -> bool:
        return self.bin is not None

    def _as_owner(self, command: list[str], root_only: bool = False) -> None:
        if os.geteuid() != 0:
            if root_only:
                return
        elif not root_only:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}: {done.stderr[-800:]}")

    def _pg(self, tool: str, *args: str) -> None:
        assert self.bin is not None
        self._as_owner([str(self.bin / tool), *args])

    def _options(self) -> str:
        return (
            f"-p {self.port} -c listen_addresses=127.0.0.1 "
            f"-c unix_socket_directories={self.directory / 'sock'} -c max_connections=100"
        )

    def start(self) -> None:
        self._pg("pg_ctl", "-D", str(self.directory / "data"), "-o", self._options(),
                 "-l", str(self.directory / "server.log"), "-w", "-t", "60", "start")  # fmt: skip

    def restart(self) -> None:
        """Fast shutdown (every session ended, a checkpoint) and a new start."""
        self._pg("pg_ctl", "-D", str(self.directory / "data"), "-o", self._options(),
                 "-l", str(self.directory / "server.log"), "-m", "fast", "-w", "-t", "60",
                 "restart")  # fmt: skip

    def backends(self) -> list[int]:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (self.name,),
            ).fetchall()
        return [int(row[0]) for row in rows]

    def terminate(self, pids: list[int]) -> int:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=5) as conn:
            done = 0
            for pid in pids:
                row = conn.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()
                done += bool(row and row[0])
        return done

    def drop(self) -> None:
        if self.scratch is not None:
            self.scratch.drop_all()
            return
        if (self.directory / "data" / "postmaster.pid").exists():
            with contextlib.suppress(Exception):
                self._pg("pg_ctl", "-D", str(self.directory / "data"), "-m", "immediate", "-w",
                         "stop")  # fmt: skip
        shutil.rmtree(self.directory, ignore_errors=True)


def _pg_bin() -> Path | None:
    """The newest installed PostgreSQL's binaries, if initdb and pg_ctl are there."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: p.parent)
    for initdb in reversed(found):
        if (initdb.parent / "pg_ctl").exists():
            return initdb.parent
    return None


class Soak:
    def __init__(self, config: Config, postgres: bool, quick: bool, shared: bool = False) -> None:
        self.config = config
        self.quick = quick
        self.node = Node(None, load=False)
        try:
            self.postgres = Postgres(shared) if postgres else None
        except BaseException:
            self.node.drop()
            raise
        if self.postgres is not None:
            self.node.db = self.postgres.url
        self.instance = f"rqsoak{os.getpid()}"
        self.args = ["--lease-snapshot", str(self.node.dir / "leases.snapshot")]
        self.monitor = Monitor(self.node, config.sample_every_s)
        self.faults: list[Fault] = []
        self.restarts: list[tuple[int, int]] = []  # (stopped at, live again at)
        self.ctx = mp.get_context("spawn")
        self.stop = self.ctx.Event()
        self.children: list[Any] = []

    def start_node(self) -> None:
        self.node.start(instance=self.instance, args=self.args, wait_s=180)

    def run_fault(self, fault: Fault) -> None:
        fault.started = now_ms()
        if fault.kind == "kill":
            assert fault.worker is not None
            fault.pid = self.monitor.pid_of(fault.worker)
            os.kill(fault.pid, signal.SIGKILL)
            fault.ended = now_ms()
            if fault.worker == 0:
                self.back_live(fault)
        elif fault.kind == "stop":
            fault.pid = self.monitor.pid_of(0)
            os.kill(fault.pid, signal.SIGSTOP)
            try:
                time.sleep(self.config.stop_s)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(fault.pid, signal.SIGCONT)
            self.back_live(fault)
        elif fault.kind == "restart":
            self.monitor.paused.set()
            try:
                self.node.stop()
                stopped = now_ms()
                self.start_node()
            finally:
                self.monitor.paused.clear()
            fault.ended = now_ms()
            fault.detail = f"down for {(fault.ended - stopped) / 1000:.1f} s until live and exact"
            self.restarts.append((stopped, fault.ended))
        elif fault.kind == "pg_restart":
            assert self.postgres is not None
            self.postgres.restart()
            fault.ended = now_ms()
            fault.detail = f"server restarted in {(fault.ended - fault.started) / 1000:.1f} s"
        elif fault.kind in ("pg_kill", "pg_kill_all"):
            assert self.postgres is not None
            pids = self.postgres.backends()
            chosen = pids if fault.kind == "pg_kill_all" else random.sample(pids, min(1, len(pids)))
            done = self.postgres.terminate(chosen)
            fault.ended = now_ms()
            fault.detail = f"terminated {done} of the node's {len(pids)} backends"
        report.progress(
            f"soak: fault {fault.kind}"
            + (f" worker {fault.worker} (pid {fault.pid})" if fault.worker is not None else "")
            + (f": {fault.detail}" if fault.detail else "")
        )

    def back_live(self, fault: Fault) -> None:
        """A fault to worker 0 lasts until its keeper is live and exact again (a new worker
        boots and loads the table, on a loaded machine for longer): the 503s before then
        are the node telling the truth."""
        signalled = now_ms()
        self.node.wait_live(180, since_ms=signalled)
        fault.ended = now_ms()
        fault.detail = f"live and exact {(fault.ended - signalled) / 1000:.1f} s after"

    def windows(self) -> list[tuple[int, int]]:
        """Where a 503 with Retry-After is the node telling the truth: from a fault that
        leaves it unready (worker 0 killed or stopped, a restart, its database connections
        cut) to UNREADY_GRACE_S after that fault ended (for worker 0 and a restart: after
        the keeper was live and exact again)."""
        grace = int(UNREADY_GRACE_S * 1000)
        return sorted(
            (f.started, (f.ended or f.started) + grace)
            for f in self.faults
            if f.started and (f.kind != "kill" or f.worker == 0)
        )

    # --- the run ----------------------------------------------------------------------------

    def run(self, seed: int) -> dict[str, Any]:
        config = self.config
        rng = random.Random(seed)
        logs = self.node.dir / "logs"
        logs.mkdir()
        report.progress(
            f"soak: preloading {config.fleet_keys:,} fleet rows and {config.writer_keys // 2:,} "
            f"writer rows into {'PostgreSQL' if self.postgres else 'SQLite'}"
        )
        writes = preload(self.node.db, config, now_ms(), rng)
        self.start_node()
        report.progress(
            f"soak: node live on port {self.node.port}; log {self.node.dir / 'node.log'}"
        )
        self.monitor.thread.start()
        for fleet in range(config.fleets):
            self.children.append(
                self.ctx.Process(
                    target=fleet_process,
                    args=(
                        config,
                        fleet,
                        self.node.port,
                        self.stop,
                        str(logs / f"fleet{fleet}.bin"),
                    ),
                    name=f"soak-fleet-{fleet}",
                )
            )
        self.children.append(
            self.ctx.Process(
                target=writer_process,
                args=(config, self.node.port, self.stop, str(logs / "writer.bin"), seed),
                name="soak-writer",
            )
        )
        for child in self.children:
            child.start()
            self.monitor.clients[child.pid] = child.name
        self.faults = plan(
            config,
            self.postgres is not None,
            rng,
            server_restarts=self.postgres is not None and self.postgres.private,
        )
        report.progress(
            f"soak: {config.minutes:g} min of load, {len(self.faults)} faults planned: "
            + ", ".join(f"{f.kind}@{f.at_s:.0f}s" for f in self.faults)
        )
        started = time.monotonic()
        load_started = now_ms()
        duration = config.minutes * 60
        pending = list(self.faults)
        next_progress = started + 15
        while (elapsed := time.monotonic() - started) < duration:
            dead = [c.name for c in self.children if not c.is_alive()]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} ended during the load; logs in {logs}")
            if self.node.process is None or self.node.process.poll() is not None:
                raise RuntimeError(f"the node exited by itself; see {self.node.dir / 'node.log'}")
            if pending and pending[0].at_s <= elapsed:
                self.run_fault(pending.pop(0))
                continue
            if time.monotonic() >= next_progress:
                next_progress += 15
                self.progress(elapsed, duration)
            time.sleep(0.2)
        report.progress("soak: load over; stopping the fleet and the writers")
        self.stop.set()
        for child in self.children:
            child.join(90)
            if child.is_alive():
                child.terminate()
                raise RuntimeError(f"{child.name} did not stop within 90 s")
        load_ended = now_ms()
        end = self.settle(load_ended)
        self.monitor.stop.set()
        self.monitor.thread.join(10)
        books = [read_book(p) for p in sorted(logs.glob("*.bin"))]
        for book in books:
            if book["note"].get("error"):
                raise RuntimeError(f"{book['who']}: {book['note']['error']}")
        return {
            "books": books,
            "preload": writes,
            "load_started": load_started,
            "load_ended": load_ended,
            **end,
        }

    def progress(self, elapsed: float, duration: float) -> None:
        latest: dict[str, int] = {}
        for _at, pid, role, value in self.monitor.rss[-12:]:
            latest[role or str(pid)] = value
        due = self.monitor.due[-1][1] if self.monitor.due else None
        done = sum(1 for f in self.faults if f.started)
        shown = ", ".join(
            f"{role} {value / 2**20:.0f} MB" for role, value in sorted(latest.items())
        )
        report.progress(
            f"soak: {elapsed:.0f}/{duration:.0f} s, due {due}, faults {done}/{len(self.faults)}, "
            f"RSS {shown}"
        )

    def settle(self, load_ended: int) -> dict[str, Any]:
        """The load has stopped: every route resumed, the node live and exact with counts
        taken after the last write, a lease sweep after the last fault; then queue-state,
        the lease census and the table."""
        from store import open_store

        admin = Http(self.node.port, ADMIN_TOKEN, None, 5.0)
        try:
            for route in F_ROUTES:
                status, data = admin.call("PUT", f"/v1/routes/{route}", b'{"paused": false}')
                if status != 200:
                    raise RuntimeError(f"resume {route}: HTTP {status}: {data[:200]!r}")
            resumed = now_ms()
            deadline = time.monotonic() + 120
            sweeps_at_start: int | None = None
            while True:
                status, data = admin.call("GET", "/prerender_admin/overview")
                overview = msgspec.json.decode(data) if status == 200 else {}
                supervisor = overview.get("supervisor") or {}
                sweeps = int(supervisor.get("lease_sweeps", 0))
                if sweeps_at_start is None and supervisor:
                    sweeps_at_start = sweeps
                status, data = admin.call("GET", "/prerender_admin/queue-state")
                state = msgspec.json.decode(data) if status == 200 else {}
                trust = state.get("trust") or {}
                census = supervisor.get("lease_census") or {}
                if (
                    status == 200
                    and trust.get("exact")
                    and trust.get("phase") == "live"
                    and int(trust.get("counts_at", 0)) > resumed + 500
                    and sweeps_at_start is not None
                    and sweeps > sweeps_at_start
                    and int(census.get("now", 0)) > resumed
                ):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the node did not settle within 120 s after the load: queue-state "
                        f"{status}, trust {trust}, sweeps {sweeps_at_start}->{sweeps}"
                    )
                time.sleep(0.5)
        finally:
            admin.close()
        store = open_store(self.node.db)
        table: list[soak_check.TableRow] = []
        try:
            after: str | None = None
            while rows := store.walk(after, 5000):
                table.extend(
                    soak_check.TableRow(r.key, r.route, r.next_render_at, r.sitemap) for r in rows
                )
                after = rows[-1].key
            paused = {route.route for route in store.routes() if route.paused}
        finally:
            store.close()
        report.progress(f"soak: settled {(now_ms() - load_ended) / 1000:.1f} s after the load")
        return {
            "queue_state": state,
            "census": census,
            "lease_sweeps": [sweeps_at_start, sweeps],
            "table": table,
            "paused_routes": sorted(paused),
        }

    def close(self, keep: bool) -> None:
        self.stop.set()
        self.monitor.stop.set()
        for child in self.children:
            if child.is_alive():
                child.terminate()
                child.join(10)
        for fault in self.faults:
            # A SIGSTOP cut short by an error must never leave worker 0 stopped.
            if fault.kind == "stop" and fault.pid and not fault.ended:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(fault.pid, signal.SIGCONT)
        # Each step on its own: one that fails must not leave the next undone.
        for step in (self.node.stop, self.postgres.drop if self.postgres else None):
            if step is None:
                continue
            try:
                step()
            except Exception as exc:
                report.progress(f"soak: cleanup step failed: {type(exc).__name__}: {exc}")
        if keep:
            self.node.log.close()
            report.progress(f"soak: node directory and logs kept in {self.node.dir}")
        else:
            self.node.drop()


# --- the verdict ---------------------------------------------------------------------------


def judge(
    soak: Soak, outcome: dict[str, Any]
) -> tuple[list[report.Figure], dict[str, Any], list[str]]:
    config = soak.config
    books = outcome["books"]
    fleets = [b for b in books if b["who"].startswith("fleet")]
    writer = next(b for b in books if b["who"] == "writer")
    grants = [soak_check.Grant(*g) for b in fleets for g in b["grants"]]
    renewals = [soak_check.Renewal(*r) for b in fleets for r in b["renewals"]]
    completions = [soak_check.Completion(*c) for b in fleets for c in b["completions"]]
    for b in fleets:  # a long run's raw lists are large: only the typed copies are kept
        b["grants"], b["renewals"], b["completions"] = [], [], []
    writes = list(outcome["preload"]) + [soak_check.Write(*w) for w in writer["writes"]]
    pauses = [soak_check.Pause(*p) for p in writer["pauses"]]
    table: list[soak_check.TableRow] = outcome["table"]
    report.progress(
        f"soak: judging {len(grants):,} grants, {len(renewals):,} renewals, "
        f"{len(completions):,} completions, {len(writes):,} row writes, {len(table):,} rows"
    )
    overlaps = soak_check.double_holds(grants, renewals, completions)
    regrants = soak_check.regrants_unanswered(grants, completions)
    on_paused = soak_check.paused_grants(grants, pauses)
    row_faults, open_keys = soak_check.final_rows(writes, completions, table)
    http = soak_check.judge_http(
        [tuple(a) for b in books for a in b["http"]],
        soak.windows(),
    )
    state = outcome["queue_state"]
    diffs = soak_check.queue_state_vs_table(
        state["now"], int(state["trust"]["counts_at"]), table, set(outcome["paused_routes"])
    )
    census = outcome["census"]
    parked = int(census.get("removing", -1))
    growth = soak_check.rss_growth(soak.monitor.rss, int(config.min_life_s * 1000))
    judged = [g for g in growth if g.judged]
    worst = max(judged, key=lambda g: g.growth, default=None)
    roles = soak_check.rss_by_role(
        soak.monitor.rss,
        outcome["load_started"],
        outcome["load_ended"],
        int(config.warmup_s * 1000),
    )
    worst_role = max(roles, key=lambda g: g.growth, default=None)
    kinds = {kind: sum(1 for f in soak.faults if f.kind == kind and f.started) for kind in
             ("kill", "stop", "restart", "pg_kill", "pg_kill_all", "pg_restart")}  # fmt: skip
    if soak.postgres is None:
        kinds.pop("pg_kill")
        kinds.pop("pg_kill_all")
    if soak.postgres is None or not soak.postgres.private:
        kinds.pop("pg_restart")
    lost = sum(1 for f in row_faults if f.kind == "lost")
    stale = sum(1 for f in row_faults if f.kind == "stale")
    resurrected = sum(1 for f in row_faults if f.kind == "resurrected")
    seconds = (outcome["load_ended"] - outcome["load_started"]) / 1000
    claim_us = [us for b in fleets for _, us in b["claims"]]
    outcomes = {o: sum(1 for c in completions if c.outcome == o and c.result == "ok")
                for o in ("rendered", "failed", "gone")}  # fmt: skip
    refused = sum(1 for c in completions if c.result not in ("ok", "lost"))
    lost_completions = sum(1 for c in completions if c.result == "lost")

    cpu = cpu_shares(soak.monitor.cpu)

    failures: list[str] = []

    def must(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)

    must(not overlaps, f"{len(overlaps)} key(s) held by two at once")
    must(not on_paused, f"{len(on_paused)} grant(s) on a paused route")
    must(not row_faults, f"{lost} row(s) lost, {stale} stale, {resurrected} resurrected")
    must(not http.failures, f"{len(http.failures)} HTTP 5xx answer(s)")
    must(not diffs, f"queue-state differs from the table: {diffs}")
    must(bool(state["trust"].get("exact")), "queue-state not exact after the load")
    must(parked == 0, f"{parked} parked lease slot(s) after a sweep")
    must(
        {r.role for r in roles} >= {"supervisor", "worker 0", "worker 1"},
        f"RSS not sampled in both halves for every role: {[r.role for r in roles]}",
    )
    must(
        all(r.growth <= config.rss_growth_max for r in roles),
        "RSS grew past the limit: "
        + ", ".join(f"{r.role} {r.growth:+.1%}" for r in roles if r.growth > config.rss_growth_max),
    )
    must(len(grants) > 1000, f"only {len(grants)} grants: the fleet did not run")
    must(all(kinds.values()), f"a kind of fault never ran: {kinds}")

    table_name = (
        f"Soak invariants, {config.minutes:g} min on {'PostgreSQL' if soak.postgres else 'SQLite'} "
        "(from the clients' own logs)"
    )
    load_name = "Soak load and faults"
    figures = [
        report.Figure(table=table_name, what="keys held by two workers at once", unit="keys",
                      ours=float(len(overlaps)), target="0"),
        report.Figure(table=load_name, what="regrants after an unanswered lease", unit="grants",
                      ours=float(regrants), better="higher",
                      note="the previous lease expired, was stranded by a kill or a stop: where "
                      "a double hold could happen"),
        report.Figure(table=table_name, what="grants on a paused route", unit="grants",
                      ours=float(len(on_paused)), target="0"),
        report.Figure(table=table_name, what="rows lost", unit="rows", ours=float(lost),
                      target="0"),
        report.Figure(table=table_name, what="rows stale (a write lost)", unit="rows",
                      ours=float(stale), target="0"),
        report.Figure(table=table_name, what="rows resurrected", unit="rows",
                      ours=float(resurrected), target="0"),
        report.Figure(table=table_name, what="HTTP 5xx answers", unit="answers",
                      ours=float(len(http.failures)), target="0",
                      note=f"besides {http.unready_accepted} 503 + Retry-After inside a "
                      "fault's window"),
        report.Figure(table=table_name, what="queue-state counts unlike the table's", unit="fields",
                      ours=float(len(diffs)), target="0",
                      note="held, due, due_sitemap, paused at trust.counts_at; exact: "
                      f"{bool(state['trust'].get('exact'))}"),
        report.Figure(table=table_name, what="parked lease slots after a sweep", unit="slots",
                      ours=float(parked), target="0"),
        report.Figure(table=table_name,
                      what="RSS growth: peak in the run's second half over the first's, worst "
                      "role (unless the process that reached it was born there and stayed flat)",
                      unit="%", ours=round(100 * worst_role.growth, 2) if worst_role else None,
                      target=f"<= {100 * config.rss_growth_max:g}",
                      note=f"{worst_role.role}: {worst_role.first_peak_mb} -> "
                      f"{worst_role.second_peak_mb} MB; "
                      + ", ".join(f"{r.role} {100 * r.across_halves:+.1f}% across the halves, "
                                  "its peak's process "
                                  + ("too young to say" if r.peak_pid_growth is None
                                     else f"{100 * r.peak_pid_growth:+.1f}% over its own life")
                                  + f" ({r.pids} pids)" for r in roles)
                      if worst_role else ""),
        report.Figure(table=load_name,
                      what="RSS growth over its own second half, worst process (not judged)",
                      unit="%", ours=round(100 * worst.growth, 2) if worst else None,
                      note=f"{worst.role}, pid {worst.pid}, {worst.rss_mid_mb} -> "
                      f"{worst.rss_end_mb} MB; {len(judged)} of {len(growth)} processes lived "
                      f"{config.min_life_s:g} s+ (a respawned worker climbs back to its role's "
                      "level late: warm-up, which the role's figure above tells apart)"
                      if worst else ""),
        report.Figure(table=load_name, what="keys granted", unit="keys", ours=float(len(grants)),
                      better="higher"),
        report.Figure(table=load_name, what="keys granted per second, mean", unit="keys/s",
                      ours=round(len(grants) / seconds, 1) if seconds else None, better="higher"),
        report.Figure(table=load_name, what="claim p50 (answered at the first attempt)", unit="µs",
                      ours=report.percentile(claim_us, 50)),
        report.Figure(table=load_name, what="claim p99 (answered at the first attempt)", unit="µs",
                      ours=report.percentile(claim_us, 99)),
        report.Figure(table=load_name, what="completions accepted: rendered / failed / gone",
                      unit="items", ours=float(sum(outcomes.values())), better="higher",
                      note=f"{outcomes['rendered']:,} / {outcomes['failed']:,} / "
                      f"{outcomes['gone']:,}; "
                      f"{refused:,} refused (lease_not_held), {lost_completions:,} unanswered"),
        report.Figure(table=load_name, what="renewals accepted", unit="items",
                      ours=float(sum(1 for r in renewals if r.ok)), better="higher"),
        report.Figure(table=load_name, what="row writes sent (upserts, deletes, imported URLs)",
                      unit="rows", ours=float(len(writes) - len(outcome["preload"])),
                      better="higher",
                      note=f"{writer['note']['counts']}"),
        report.Figure(table=load_name, what="CPU over the run, all processes", unit="cores",
                      ours=round(sum(cpu.values()), 2),
                      note=", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items()))),
        report.Figure(table=load_name, what="faults", unit="faults",
                      ours=float(sum(kinds.values())),
                      note=", ".join(f"{k} {v}" for k, v in kinds.items())),
        report.Figure(table=load_name, what="transport errors (resets, refused, time-outs)",
                      unit="requests", ours=float(http.transport_errors),
                      note=", ".join(f"{k} {v}" for k, v in sorted(http.transport_by_kind.items()))
                      + f"; of {http.requests:,} requests"),
        report.Figure(table=load_name, what="keys whose final row the logs leave open",
                      unit="keys", ours=float(open_keys),
                      note="an answer lost, or two writers' requests overlapping"),
    ]  # fmt: skip
    raw = {
        "config": msgspec.to_builtins(config),
        "backend": "postgresql" if soak.postgres else "sqlite",
        "postgres_server": None
        if soak.postgres is None
        else "the soak's own server, restarted among the faults"
        if soak.postgres.private
        else "the shared server: no restart; every backend of the node terminated instead",
        "abandoned_completions": sum(b.get("abandoned", 0) for b in fleets),
        "faults": [msgspec.to_builtins(f) for f in soak.faults],
        "restarts_ms": [end - stop for stop, end in soak.restarts],
        "accept_503_rule": f"a 503 with Retry-After from a fault that leaves the node unready "
        f"(worker 0 killed or stopped, a restart, backends terminated) until {UNREADY_GRACE_S:g} s "
        "after it ended (worker 0's faults and restarts end once the keeper is live and exact "
        "again); every other 5xx fails",
        "overlaps": [msgspec.to_builtins(o) for o in overlaps[:20]],
        "paused_grants": [msgspec.to_builtins(p) for p in on_paused[:20]],
        "row_faults": [msgspec.to_builtins(f) for f in row_faults[:50]],
        "http_failures": [msgspec.to_builtins(f) for f in http.failures[:50]],
        "queue_state_diffs": [msgspec.to_builtins(d) for d in diffs],
        "queue_state_now": state.get("now"),
        "census": census,
        "rss": [msgspec.to_builtins(g) for g in growth],
        "rss_by_role": [msgspec.to_builtins(r) for r in roles],
        "fleet_statistics": [b["note"].get("statistics") for b in fleets],
        "writer": writer["note"],
        "failures": failures,
    }
    return figures, raw, failures


def cpu_shares(samples: list[tuple[int, int, str, float]]) -> dict[str, float]:
    """Cores used on average, by name (a node role's successive pids summed), over the span
    each pid was sampled."""
    by_pid: dict[int, list[tuple[int, str, float]]] = {}
    for at, pid, name, seconds in samples:
        by_pid.setdefault(pid, []).append((at, name, seconds))
    used: dict[str, float] = {}
    first = min((at for at, _, _, _ in samples), default=0)
    last = max((at for at, _, _, _ in samples), default=0)
    for points in by_pid.values():
        points.sort()
        name = points[-1][1]
        name = "fleet" if name.startswith("soak-fleet") else name
        used[name] = used.get(name, 0.0) + points[-1][2] - points[0][2]
    span = (last - first) / 1000
    return {name: round(seconds / span, 2) for name, seconds in used.items()} if span else {}


def series(soak: Soak, outcome: dict[str, Any]) -> dict[str, Any]:
    """The chart's time series, seconds from the load's start."""
    t0 = outcome["load_started"]
    fleets = [b for b in outcome["books"] if b["who"].startswith("fleet")]
    bucket = 5000
    claims: dict[int, int] = {}
    for b in fleets:
        for g in b["grants"]:
            claims[(g[7] - t0) // bucket] = claims.get((g[7] - t0) // bucket, 0) + 1
    p99: dict[int, list[int]] = {}
    for b in fleets:
        for at, us in b["claims"]:
            p99.setdefault((at - t0) // 10_000, []).append(us)
    rss: dict[str, list[tuple[float, float]]] = {}
    for at, pid, role, value in soak.monitor.rss:
        rss.setdefault(f"{role} ({pid})", []).append(((at - t0) / 1000, value / 2**20))
    return {
        "claims_per_s": [
            (k * bucket / 1000, v / (bucket / 1000)) for k, v in sorted(claims.items())
        ],
        "claim_p99_ms": [
            (k * 10.0, (report.percentile(v, 99) or 0) / 1000) for k, v in sorted(p99.items())
        ],
        "due": [((at - t0) / 1000, due) for at, due in soak.monitor.due],
        "rss_mb": rss,
        "faults": [
            ((f.started - t0) / 1000, ((f.ended or f.started) - t0) / 1000, f.kind)
            for f in soak.faults
            if f.started
        ],
    }


def main(argv: list[str] | None = None, *, postgres: bool = False) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 minutes, fewer rows (CI)")
    parser.add_argument("--minutes", type=float, default=None, help="load duration (default 10)")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--keep", action="store_true", help="keep the node's directory and logs")
    parser.add_argument(
        "--shared-server",
        action="store_true",
        help="PostgreSQL: a scratch database on RENDERQUEUE_TEST_PG's server, never restarted",
    )
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else Config()
    if args.minutes is not None:
        if not 0.5 <= args.minutes <= 240:
            parser.error("--minutes: between 0.5 and 240")
        config = msgspec.structs.replace(config, minutes=args.minutes)
    section = "soak_postgres" if postgres else "soak"
    result = report.new_result(section, args.quick)
    soak = Soak(config, postgres, args.quick, shared=args.shared_server)
    failures: list[str] = []
    keep = args.keep
    try:
        outcome = soak.run(args.seed)
        drawn = series(soak, outcome)
        figures, raw, failures = judge(soak, outcome)
        result.figures = figures
        result.raw = raw

        path = soak_chart(result, drawn)
        report.progress(f"soak: chart {path}")
    except BaseException as exc:
        failures.append(f"{type(exc).__name__}: {exc}")
        result.raw = {"config": msgspec.to_builtins(config), "failures": failures,
                      "faults": [msgspec.to_builtins(f) for f in soak.faults]}  # fmt: skip
        keep = True
        if not isinstance(exc, Exception):
            raise
    finally:
        soak.close(keep or bool(failures))
    result.promised = [figure.key for figure in result.figures]
    status = report.emit(result)
    if failures:
        report.progress("soak: FAILED: " + "; ".join(failures))
        return 1
    report.progress("soak: every invariant held")
    return status


def soak_chart(result: report.SectionResult, series: dict[str, Any]) -> Path:
    """bench/sections/soak: claims/s, claim p99, due and each node process's RSS over the run, with
    the faults marked."""
    from bench.harness.charts import plt, save

    figure, axes = plt.subplots(4, 1, figsize=(14, 15), sharex=True)
    claims, p99, due, rss = axes
    for axis, key, title, unit in (
        (claims, "claims_per_s", "keys granted per second (5 s buckets)", "keys/s"),
        (p99, "claim_p99_ms", "claim p99, first-attempt answers (10 s buckets)", "ms"),
        (due, "due", "due (queue-state, while it vouches)", "rows"),
    ):
        points = series[key]
        axis.plot([p[0] for p in points], [p[1] for p in points], ".-", linewidth=1, markersize=2)
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.grid(alpha=0.3)
    p99.set_yscale("log")
    for label, points in sorted(series["rss_mb"].items()):
        rss.plot([p[0] for p in points], [p[1] for p in points], linewidth=1, label=label)
    rss.set_title("RSS per node process (a new pid after each kill or restart)")
    rss.set_ylabel("MB")
    rss.set_xlabel("seconds from the start of the load")
    rss.grid(alpha=0.3)
    rss.legend(fontsize=7, ncol=4)
    colours = {"kill": "red", "stop": "orange", "restart": "purple"}
    for axis in axes:
        for start, end, kind in series["faults"]:
            colour = colours.get(kind, "brown")
            if end - start >= 0.5:  # a stop, a restart: the span it lasted
                axis.axvspan(start, end, color=colour, alpha=0.15, linewidth=0)
            axis.axvline(start, color=colour, alpha=0.5, linewidth=0.8)
    backend = result.raw.get("backend", "")
    config: Any = result.raw.get("config") or {}
    figure.suptitle(
        f"renderqueue soak on {backend}, {config.get('minutes', 0):g} min; faults: "
        "kill (red), SIGSTOP worker 0 (orange), restart (purple), PostgreSQL backends (brown); "
        f"{result.machine.get('cpus', '?')} CPUs, load {result.machine.get('load_avg_1m', '?')}",
        fontsize=10,
    )
    return save(figure, result, dpi=80)


if __name__ == "__main__":
    sys.exit(main())
