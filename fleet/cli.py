"""`renderqueue fleet`: a render fleet against a node or a cluster, running a command per
key or simulating renders, with live progress and a graceful stop on SIGINT / SIGTERM.

`--node` names one node or several (repeat it): the fleet reads the cluster's member list
from whichever answers (`GET /v1/cluster`), claims from every live node, follows joins
and leaves, and sends each result to the node that granted its lease."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

import msgspec

from fleet.client import AsyncFleetClient
from fleet.cluster import ClusterDirectory
from fleet.progress import ProgressPrinter, progress_line
from fleet.renderers import (
    DEFAULT_RETRY_AFTER_S,
    NOT_FOUND_EXIT,
    RETRY_AFTER_EXIT,
    CommandRenderer,
    Renderer,
    SimulatedRenderer,
)
from fleet.runner import FleetConfig, FleetRunner

TOKEN_ENV = "RENDERQUEUE_FLEET_TOKEN"
ADMIN_TOKEN_ENV = "RENDERQUEUE_ADMIN_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="renderqueue fleet",
        description="Claim due keys from a node, render them, report back.",
    )
    parser.add_argument(
        "--node",
        required=True,
        action="append",
        help="a node's base URL, e.g. http://127.0.0.1:8080; repeat it to name more of a "
        "cluster's nodes (any one is enough: the rest are found through it)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="renders at once (default 8)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--exec",
        dest="command",
        metavar='"CMD {key}"',
        help="run CMD per key ({key}, {route} substituted; no shell): exit 0 rendered, "
        "--gone-exit gone, --not-found-exit not_found, anything else failed",
    )
    mode.add_argument("--simulate", action="store_true", help="pretend to render (demos, load)")
    parser.add_argument("--render-ms", type=float, default=800.0, help="simulated mean render time")
    parser.add_argument(
        "--failure-rate", type=float, default=0.02, help="simulated failure probability"
    )
    parser.add_argument("--seed", type=int, default=None, help="simulation random seed")
    parser.add_argument("--gone-exit", type=int, default=10, help="exit status meaning gone (10)")
    parser.add_argument(
        "--retry-after-exit",
        type=int,
        default=RETRY_AFTER_EXIT,
        help=f"exit status meaning the origin pushed back ({RETRY_AFTER_EXIT}); a stderr line "
        "`RETRY-AFTER <seconds>` says so with any status",
    )
    parser.add_argument(
        "--retry-after-s",
        type=float,
        default=DEFAULT_RETRY_AFTER_S,
        help=f"how long the site waits after --retry-after-exit with no RETRY-AFTER line "
        f"({DEFAULT_RETRY_AFTER_S:g})",
    )
    parser.add_argument(
        "--not-found-exit",
        type=int,
        default=NOT_FOUND_EXIT,
        help=f"exit status meaning the origin answered 404 or 410 ({NOT_FOUND_EXIT}); a "
        "stderr line `NOT-FOUND` says so with any status",
    )
    parser.add_argument(
        "--render-timeout", type=float, default=120.0, help="kill a command after S seconds"
    )
    parser.add_argument("--token", default=None, help=f"fleet token (default ${TOKEN_ENV})")
    parser.add_argument(
        "--admin-token",
        default=None,
        help=f"token for queue-state in the progress view (default ${ADMIN_TOKEN_ENV}, "
        "else the fleet token)",
    )
    parser.add_argument("--worker", default=None, help="worker name (default host-pid)")
    parser.add_argument("--lease-s", type=int, default=300, help="lease length, 5..3600 (300)")
    parser.add_argument("--wait-s", type=int, default=10, help="claim long-poll, 0..30 (10)")
    parser.add_argument("--grace-s", type=float, default=30.0, help="stop's grace period (30)")
    parser.add_argument("--duration", type=float, default=None, help="stop after S seconds")
    parser.add_argument(
        "--progress-every", type=float, default=None, help="seconds between progress lines"
    )
    parser.add_argument(
        "--stats-json", action="store_true", help="print the final statistics as JSON"
    )
    parser.add_argument(
        "--discover-every",
        type=float,
        default=3.0,
        help="seconds between reads of the cluster's member list (3)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="a line for every failed render (default: a sample, at most 5 per 10 s; none "
        "for --simulate)",
    )
    return parser


def _renderer(args: argparse.Namespace) -> Renderer:
    if args.simulate:
        import random

        return SimulatedRenderer(
            mean_ms=args.render_ms,
            failure_rate=args.failure_rate,
            rng=random.Random(args.seed),
        )
    return CommandRenderer(
        args.command,
        timeout_s=args.render_timeout,
        gone_exit=args.gone_exit,
        retry_after_exit=args.retry_after_exit,
        retry_after_s=args.retry_after_s,
        not_found_exit=args.not_found_exit,
    )


async def _run(args: argparse.Namespace, renderer: Renderer, printer: ProgressPrinter) -> int:
    token = args.token or os.environ.get(TOKEN_ENV)
    admin_token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    config = FleetConfig(
        concurrency=args.concurrency,
        lease_s=args.lease_s,
        wait_s=args.wait_s,
        grace_s=args.grace_s,
        discover_every_s=args.discover_every,
    )
    worker = args.worker or f"{socket.gethostname()}-{os.getpid()}"

    def client_for(url: str) -> AsyncFleetClient:
        return AsyncFleetClient(
            url.rstrip("/"),
            token=token,
            admin_token=admin_token,
            worker=worker,
            max_connections=max(8, min(args.concurrency, 64) + 4),
        )

    log = printer.log if args.verbose else _sampled_failures(printer.log, keep=not args.simulate)
    directory = ClusterDirectory(args.node, client_for, token=token, log=printer.log)
    runner = FleetRunner(None, renderer, config, log=log, directory=directory)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, runner.request_stop)
    printer.log(
        f"fleet {worker}: {args.concurrency} at once against {', '.join(args.node)} "
        f"({'simulated' if args.simulate else args.command}); Ctrl-C stops gracefully"
    )
    display = asyncio.create_task(
        printer.run(lambda: progress_line(runner.statistics(), runner.node_view))
    )
    timer = None
    if args.duration is not None:
        timer = loop.call_later(args.duration, runner.request_stop)
    try:
        stats = await runner.run()
    finally:
        display.cancel()
        if timer is not None:
            timer.cancel()
        await directory.aclose()
    printer.finish("stopped: " + progress_line(stats, runner.node_view))
    if args.stats_json:
        sys.stdout.write(msgspec.json.encode(stats).decode() + "\n")
        sys.stdout.flush()
    if stats.fatal:
        printer.log(f"error: {stats.fatal}")
        return 1
    return 0


def _sampled_failures(
    log: Callable[[str], None], *, keep: bool, per_window: int = 5, window_s: float = 10.0
) -> Callable[[str], None]:
    """Every line but per-render failures; of those, a few per window, then a count.

    A fleet failing fast fails thousands of times a minute: a line each would bury the
    stop and fatal lines, and the progress line already counts failures.
    """
    window_started = 0.0
    shown = 0
    hidden = 0

    def filtered(message: str) -> None:
        nonlocal window_started, shown, hidden
        if not message.startswith("failed "):
            log(message)
            return
        if not keep:
            return
        now = time.monotonic()
        if now - window_started >= window_s:
            if hidden:
                log(f"... and {hidden} more failure(s) not shown (--verbose shows all)")
            window_started, shown, hidden = now, 0, 0
        if shown < per_window:
            shown += 1
            log(message)
        else:
            hidden += 1

    return filtered


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if not 5 <= args.lease_s <= 3600:
        parser.error("--lease-s must be within 5..3600")
    if not 0 <= args.wait_s <= 30:
        parser.error("--wait-s must be within 0..30")
    try:
        renderer = _renderer(args)
    except ValueError as exc:
        parser.error(str(exc))
    printer = ProgressPrinter(sys.stdout, every_s=args.progress_every)
    return asyncio.run(_run(args, renderer, printer))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
