"""Import a sitemap (or a sitemap index and its children) into the schedule.

Two passes, so a refused document writes nothing: the first reads every document
(streaming, defused, capped) and spools each usable URL as a compact candidate to a
temporary file; only when every document has been read whole does the second pass
write, in batches of 1,000 rows, each batch one transaction. Memory is bounded by the
batch, plus 8 bytes-ish per distinct URL for duplicate detection.

Each row is a sitemap row (`sitemap=True`) on the route the rules choose. Its cadence
is the entry's changefreq (see sitemap.fields), else the matching rule's cadence_s,
else left to the route's default. next_render_at:

- a new key: lastmod + effective cadence if that is still ahead, else now; no
  lastmod: now. A page changed long ago is due at once; one changed an hour ago on
  a daily cadence comes due in 23 hours, which spreads a fresh import's first
  renders over the cadence instead of all at once.
- a key already scheduled: its next_render_at stands (an import never pushes a
  render back), except that it is pulled forward to now when lastmod is later than
  its last render (the page changed since), and to last render + the new cadence
  when the cadence shrank. A key whose route, cadence, sitemap flag and due time
  would not change is skipped as "unchanged", so re-importing a sitemap is a no-op.
- a retired key (its origin answered not found, store.rows.Row.retired_at) is skipped as
  "retired" unless its lastmod is later than its retirement: a sitemap that goes on
  listing a dead URL does not bring it back, a page changed since it was found missing does.

lastmod later than now (a clock ahead) is read as now.
"""

from __future__ import annotations

import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, BinaryIO, Protocol

import msgspec

from sitemap.errors import SitemapError
from sitemap.fields import cadence_for_changefreq, parse_w3c_datetime, url_problem
from sitemap.parse import SitemapRef, UrlEntry, parse_document
from sitemap.rules import RouteRules
from sitemap.source import ChildOpener, SourceLimits, bytes_counted, open_document
from store.rows import Route, Row, RowWrite

BATCH_ROWS = 1_000
MAX_EXAMPLES = 20


class ImportLimits(msgspec.Struct, frozen=True, kw_only=True):
    source: SourceLimits = SourceLimits()
    max_children: int = 50_000  # sitemaps.org: at most 50,000 sitemaps in an index
    max_depth: int = 2  # an index of indexes, at most; the protocol allows none
    batch_rows: int = BATCH_ROWS


DEFAULT_LIMITS = ImportLimits()


class SkippedExample(msgspec.Struct, frozen=True, kw_only=True):
    reason: str
    loc: str
    sitemap: str


class ImportReport(msgspec.Struct, frozen=True, kw_only=True):
    imported: int  # keys new to the schedule
    updated: int  # keys already scheduled whose row changed
    skipped: int  # entries not written, by reason in skipped_by_reason
    skipped_by_reason: dict[str, int]
    notes: dict[str, int]  # imported all the same: bad_lastmod, bad_changefreq, future_lastmod
    examples: list[SkippedExample]  # the first few skipped entries, to find them
    urls_seen: int
    sitemaps_read: int
    bytes_read: int  # after decompression
    elapsed_ms: int


class ImportProgress(msgspec.Struct, frozen=True, kw_only=True):
    phase: str  # "reading" or "writing"
    urls_seen: int
    sitemaps_read: int
    bytes_read: int
    written: int  # imported + updated so far
    to_write: int  # candidates spooled by the read pass


ProgressCallback = Callable[[ImportProgress], None]


class ScheduleTarget(Protocol):
    """What the importer needs of a schedule; store.base.ScheduleStore is one."""

    def get_many(self, keys: Sequence[str]) -> dict[str, Row]: ...

    def write(self, upsert: Sequence[RowWrite] = (), delete: Sequence[str] = ()) -> None: ...

    def routes(self) -> list[Route]: ...

    def default_cadence_s(self) -> int: ...


class _Candidate(msgspec.Struct, array_like=True, frozen=True):
    key: str
    route: str
    cadence_s: int | None
    lastmod: int | None


_FRAME = struct.Struct("<I")


class _Spool:
    """Candidates on a temporary file, in framed msgpack batches, written then replayed."""

    def __init__(self, batch_rows: int) -> None:
        self._file: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=2 << 20)  # noqa: SIM115 - lives as long as the spool
        self._pending: list[_Candidate] = []
        self._batch_rows = batch_rows
        self._encoder = msgspec.msgpack.Encoder()
        self.count = 0

    def add(self, candidate: _Candidate) -> None:
        self._pending.append(candidate)
        self.count += 1
        if len(self._pending) >= self._batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            frame = self._encoder.encode(self._pending)
            self._file.write(_FRAME.pack(len(frame)))
            self._file.write(frame)
            self._pending = []

    def batches(self) -> Iterator[list[_Candidate]]:
        self._flush()
        self._file.seek(0)
        decoder = msgspec.msgpack.Decoder(list[_Candidate])
        while header := self._file.read(_FRAME.size):
            (size,) = _FRAME.unpack(header)
            yield decoder.decode(self._file.read(size))

    def close(self) -> None:
        self._file.close()


class _Tally:
    def __init__(self) -> None:
        self.skipped: dict[str, int] = {}
        self.notes: dict[str, int] = {}
        self.examples: list[SkippedExample] = []
        self.urls_seen = 0
        self.sitemaps_read = 0
        self.bytes_read = 0
        self.imported = 0
        self.updated = 0

    def skip(self, reason: str, loc: str | None, sitemap: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if reason != "unchanged" and len(self.examples) < MAX_EXAMPLES:
            shown = (loc or "")[:200]
            self.examples.append(SkippedExample(reason=reason, loc=shown, sitemap=sitemap))

    def note(self, what: str) -> None:
        self.notes[what] = self.notes.get(what, 0) + 1


class _Reader:
    """The first pass: documents in, candidates spooled, nothing written."""

    def __init__(
        self,
        *,
        rules: RouteRules,
        now_ms: int,
        limits: ImportLimits,
        open_child: ChildOpener | None,
        tally: _Tally,
        spool: _Spool,
        progress: Callable[[str], None],
    ) -> None:
        self._rules = rules
        self._now_ms = now_ms
        self._limits = limits
        self._open_child = open_child
        self._tally = tally
        self._spool = spool
        self._progress = progress
        self._seen: set[int] = set()
        self._visited: set[str] = set()
        self._children = 0
        self.current: BinaryIO | None = None  # the document being read, for progress

    def read(self, raw: BinaryIO, *, location: str, depth: int = 0) -> None:
        try:
            stream = open_document(raw, location=location, limits=self._limits.source)
        except BaseException:
            raw.close()
            raise
        self.current = stream
        try:
            document = parse_document(stream, location=location)
            self._tally.sitemaps_read += 1
            if document.kind == "urlset":
                for entry in document:
                    assert isinstance(entry, UrlEntry)
                    self._add(entry, location)
            else:
                refs = [ref for ref in document if isinstance(ref, SitemapRef)]
                self._read_children(refs, location=location, depth=depth)
        finally:
            self._tally.bytes_read += bytes_counted(stream)
            self.current = None
            stream.close()

    def _read_children(self, refs: list[SitemapRef], *, location: str, depth: int) -> None:
        if depth + 1 > self._limits.max_depth:
            raise SitemapError(
                "index_limit",
                f"sitemap indexes nested more than {self._limits.max_depth} deep",
                location=location,
            )
        if self._open_child is None:
            raise SitemapError(
                "index_limit",
                "this is a sitemap index, and no way to read its children was given "
                "(import each child sitemap instead)",
                location=location,
            )
        for ref in refs:
            if ref.loc is None:
                self._tally.skip("missing_loc", None, location)
                continue
            self._children += 1
            if self._children > self._limits.max_children:
                raise SitemapError(
                    "index_limit",
                    f"more than {self._limits.max_children:,} child sitemaps",
                    location=location,
                )
            if ref.loc in self._visited:
                self._tally.skip("duplicate_sitemap", ref.loc, location)
                continue
            self._visited.add(ref.loc)
            where, raw = self._open_child(ref.loc)
            self.read(raw, location=where, depth=depth + 1)

    def _add(self, entry: UrlEntry, location: str) -> None:
        tally = self._tally
        tally.urls_seen += 1
        if tally.urls_seen % 1000 == 0:
            self._progress("reading")
        problem = url_problem(entry.loc)
        if problem is not None:
            tally.skip(problem, entry.loc, location)
            return
        key = entry.loc
        assert key is not None
        fingerprint = hash(key)
        if fingerprint in self._seen:
            tally.skip("duplicate", key, location)
            return
        match = self._rules.match(key)
        if match is None:
            tally.skip("no_route", key, location)
            return
        self._seen.add(fingerprint)
        cadence = cadence_for_changefreq(entry.changefreq)
        if cadence is None:
            if entry.changefreq is not None:
                tally.note("bad_changefreq")
            cadence = match.cadence_s
        lastmod = None
        if entry.lastmod is not None:
            lastmod = parse_w3c_datetime(entry.lastmod)
            if lastmod is None:
                tally.note("bad_lastmod")
            elif lastmod > self._now_ms:
                tally.note("future_lastmod")
                lastmod = self._now_ms
        self._spool.add(_Candidate(key, match.route, cadence, lastmod))


def _next_render_at(
    candidate: _Candidate, existing: Row | None, effective_cadence_s: int, now_ms: int
) -> int:
    cadence_ms = effective_cadence_s * 1000
    if existing is None:
        if candidate.lastmod is None:
            return now_ms
        return max(now_ms, candidate.lastmod + cadence_ms)
    due = existing.next_render_at
    rendered = existing.last_rendered_at
    if rendered is not None:
        if candidate.lastmod is not None and candidate.lastmod > rendered:
            due = min(due, now_ms)
        due = min(due, max(now_ms, rendered + cadence_ms))
    return due


class _Writer:
    """The second pass: candidates against current rows, written in batches."""

    def __init__(self, target: ScheduleTarget, *, now_ms: int, tally: _Tally) -> None:
        self._target = target
        self._now_ms = now_ms
        self._tally = tally
        self._route_cadence = {
            route.route: route.default_cadence_s
            for route in target.routes()
            if route.default_cadence_s is not None
        }
        self._default_cadence_s = target.default_cadence_s()

    def _effective_cadence(self, candidate: _Candidate) -> int:
        if candidate.cadence_s is not None:
            return candidate.cadence_s
        return self._route_cadence.get(candidate.route, self._default_cadence_s)

    def write(self, batch: list[_Candidate]) -> None:
        existing = self._target.get_many([candidate.key for candidate in batch])
        upsert: list[RowWrite] = []
        created = 0
        for candidate in batch:
            row = existing.get(candidate.key)
            if (
                row is not None
                and row.retired_at is not None
                and (candidate.lastmod is None or candidate.lastmod <= row.retired_at)
            ):
                self._tally.skip("retired", candidate.key, "")
                continue
            due = _next_render_at(candidate, row, self._effective_cadence(candidate), self._now_ms)
            if (
                row is not None
                and row.route == candidate.route
                and row.cadence_s == candidate.cadence_s
                and row.sitemap
                and row.next_render_at == due
            ):
                self._tally.skip("unchanged", candidate.key, "")
                continue
            created += row is None
            upsert.append(
                RowWrite(
                    key=candidate.key,
                    route=candidate.route,
                    next_render_at=due,
                    cadence_s=candidate.cadence_s,
                    sitemap=True,
                )
            )
        if upsert:
            self._target.write(upsert=upsert)
        self._tally.imported += created
        self._tally.updated += len(upsert) - created


def import_sitemap(
    source: BinaryIO,
    store: ScheduleTarget,
    rules: RouteRules,
    now_ms: int,
    progress: ProgressCallback | None = None,
    *,
    location: str = "<input>",
    open_child: ChildOpener | None = None,
    limits: ImportLimits = DEFAULT_LIMITS,
) -> ImportReport:
    """Read a sitemap or sitemap index from `source` (raw bytes, gzip or not) into `store`.

    `open_child` resolves an index's child locs (see sitemap.source.child_opener_for
    and url_child_opener); without it an index is refused. Raises SitemapError, with
    nothing written, when any document is unsafe, malformed, oversized or unreadable;
    bad URLs inside a good document are skipped and counted instead.
    """
    started = time.monotonic()
    tally = _Tally()
    spool = _Spool(limits.batch_rows)

    reader: _Reader | None = None

    def report_progress(phase: str) -> None:
        if progress is not None:
            current = reader.current if reader is not None else None
            progress(
                ImportProgress(
                    phase=phase,
                    urls_seen=tally.urls_seen,
                    sitemaps_read=tally.sitemaps_read,
                    bytes_read=tally.bytes_read + (bytes_counted(current) if current else 0),
                    written=tally.imported + tally.updated,
                    to_write=spool.count,
                )
            )

    try:
        reader = _Reader(
            rules=rules,
            now_ms=now_ms,
            limits=limits,
            open_child=open_child,
            tally=tally,
            spool=spool,
            progress=report_progress,
        )
        reader.read(source, location=location)
        report_progress("reading")
        writer = _Writer(store, now_ms=now_ms, tally=tally)
        for batch in spool.batches():
            writer.write(batch)
            report_progress("writing")
    finally:
        spool.close()
    return ImportReport(
        imported=tally.imported,
        updated=tally.updated,
        skipped=sum(tally.skipped.values()),
        skipped_by_reason=dict(sorted(tally.skipped.items())),
        notes=dict(sorted(tally.notes.items())),
        examples=tally.examples,
        urls_seen=tally.urls_seen,
        sitemaps_read=tally.sitemaps_read,
        bytes_read=tally.bytes_read,
        elapsed_ms=int((time.monotonic() - started) * 1000),
    )
