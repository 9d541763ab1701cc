"""`renderqueue import-sitemap FILE|URL|- [--route-rules FILE] [--db PATH | --node URL]`.

Writes straight into the store (`--db`, the default: var/renderqueue.sqlite, which a
running node picks up through its change feed), or through a node's schedule API
(`--node`, with an admin token from --token or $RENDERQUEUE_ADMIN_TOKEN). Progress
goes to stderr, the report to stdout (`--json` for the machine-readable one).
Exit 0 when the import ran (bad URLs are skipped and reported, not fatal), 1 when a
document was refused (nothing written) or the target failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import TextIO

import msgspec

from sitemap.errors import SitemapError
from sitemap.importer import (
    ImportLimits,
    ImportProgress,
    ImportReport,
    ScheduleTarget,
    import_sitemap,
)
from sitemap.node_target import NodeScheduleTarget, NodeTargetError
from sitemap.rules import RouteRules, RouteRulesError
from sitemap.source import SourceLimits, child_opener_for, open_location

DEFAULT_DB = "var/renderqueue.sqlite"
ADMIN_TOKEN_ENV = "RENDERQUEUE_ADMIN_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="renderqueue import-sitemap",
        description="Import a sitemap or sitemap index (XML, gzip too) into the schedule.",
    )
    parser.add_argument("source", help="a file, an http(s) URL, or - for stdin")
    parser.add_argument(
        "--route-rules", metavar="FILE", help='URL-pattern rules (TOML); default: route "page"'
    )
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--db", help=f"the store: a SQLite path or store URL ({DEFAULT_DB})")
    target.add_argument("--node", metavar="URL", help="write through a node's schedule API")
    parser.add_argument(
        "--token", help=f"the node's admin token (prefer ${ADMIN_TOKEN_ENV}: flags are visible)"
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=SourceLimits().max_bytes,
        help="refuse a document larger than this, decompressed (default: the protocol's 50 MB)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


class _Progress:
    """Progress on stderr: redrawn in place on a TTY, a line every few seconds otherwise."""

    def __init__(self, stream: TextIO, quiet: bool) -> None:
        self._stream = stream
        self._quiet = quiet
        self._tty = stream.isatty()
        self._started = time.monotonic()
        self._last = self._started

    def __call__(self, progress: ImportProgress) -> None:
        if self._quiet:
            return
        now = time.monotonic()
        if now - self._last < (0.2 if self._tty else 5.0):
            return
        self._last = now
        rate = progress.urls_seen / max(now - self._started, 1e-6)
        if progress.phase == "reading":
            line = (
                f"reading: {progress.urls_seen:,} URLs from {progress.sitemaps_read} sitemap(s), "
                f"{progress.bytes_read / 1e6:.1f} MB ({rate:,.0f} URLs/s)"
            )
        else:
            line = f"writing: {progress.written:,} of {progress.to_write:,} rows"
        if self._tty:
            self._stream.write("\r\x1b[2K" + line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def done(self) -> None:
        if self._tty and not self._quiet and self._last > self._started:
            self._stream.write("\r\x1b[2K")
            self._stream.flush()


def format_report(report: ImportReport, source: str) -> str:
    seconds = max(report.elapsed_ms, 1) / 1000
    lines = [
        f"imported {report.imported:,}, updated {report.updated:,}, "
        f"skipped {report.skipped:,} from {source}",
        f"  {report.urls_seen:,} URLs in {report.sitemaps_read} sitemap(s), "
        f"{report.bytes_read / 1e6:.1f} MB, {seconds:.2f} s "
        f"({report.urls_seen / seconds:,.0f} URLs/s)",
    ]
    if report.skipped_by_reason:
        reasons = ", ".join(f"{name} {count:,}" for name, count in report.skipped_by_reason.items())
        lines.append(f"  skipped: {reasons}")
    if report.notes:
        notes = ", ".join(f"{name} {count:,}" for name, count in report.notes.items())
        lines.append(f"  imported with a field ignored: {notes}")
    for example in report.examples[:10]:
        lines.append(f"    {example.reason}: {example.loc!r} in {example.sitemap}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rules = RouteRules.load(args.route_rules) if args.route_rules else RouteRules.default()
    except RouteRulesError as exc:
        print(f"import-sitemap: {exc}", file=sys.stderr)
        return 2
    if args.max_bytes <= 0:
        parser.error("--max-bytes must be positive")
    source_limits = SourceLimits(
        max_bytes=args.max_bytes, max_download_bytes=max(args.max_bytes, SourceLimits().max_bytes)
    )
    limits = ImportLimits(source=source_limits)
    progress = _Progress(sys.stderr, args.quiet)
    now_ms = time.time_ns() // 1_000_000
    try:
        with contextlib.ExitStack() as stack:
            target: ScheduleTarget
            if args.node:
                token = args.token or os.environ.get(ADMIN_TOKEN_ENV)
                target = stack.enter_context(NodeScheduleTarget(args.node, token=token))
            else:
                from store import open_store

                store = open_store(args.db or DEFAULT_DB)
                stack.callback(store.close)
                target = store
            raw = open_location(args.source, limits=source_limits)
            stack.callback(progress.done)
            report = import_sitemap(
                raw,
                target,
                rules,
                now_ms,
                progress,
                location=args.source,
                open_child=child_opener_for(args.source, limits=source_limits),
                limits=limits,
            )
    except SitemapError as exc:
        print(f"import-sitemap: refused, nothing written: {exc}", file=sys.stderr)
        return 1
    except (NodeTargetError, OSError, ValueError) as exc:
        print(f"import-sitemap: failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    else:
        print(format_report(report, args.source))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
