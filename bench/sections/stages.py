"""Where a key's CPU goes: the claim, the completion and the keeper, stage by stage.

`python -m bench stages [--quick]`

- In process, as bench/peers/renderqueue.py runs the node (its store, its segments, a
  keeper thread, the API's own `grant_from_ring` and `apply`), claim then complete, all
  rendered, at batch 10 and 100 on 1M rows (quick 20k), 20% due: the calling thread's CPU
  per key in each stage and its parts (the post-grant read of the keys written since
  the keeper's view, the store's completion, its UPDATE statements, the handoff into the
  keeper's feed ring), and the keeper thread's CPU per completed key with its parts
  (waiting on the feed, reading it, applying the events, publishing, the top check).
- Through HTTP, a node with one worker: a request's fixed cost, the worker's CPU per
  `GET /healthz` and per one-key claim, less what the idle worker spends meanwhile.
- The app alone: the same requests, and claims of 100 keys, called on the worker's ASGI
  app in process with no server or socket, the calling thread's CPU each. Beside the
  HTTP figures it splits a request's cost between the app and the server.
- The bodies: decoding and checking a 100-item completion, encoding a 100-lease answer.

Each figure is thread or process CPU (user + system), so another process's load moves it
less than it moves a wall-clock figure; compare rows of one run.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from bench.harness import report
from bench.harness.workload import Workload, due_count, generate, key_of

BATCHES = (10, 100)
LEASE_MS = 300_000


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    keys_per_batch: int  # keys claimed and completed at each batch size
    requests: int  # HTTP requests per kind
    http_rows: int
    codec_rounds: int


FULL = Config(rows=1_000_000, keys_per_batch=40_000, requests=3000, http_rows=20_000,
              codec_rounds=3000)  # fmt: skip
QUICK = Config(rows=20_000, keys_per_batch=1500, requests=300, http_rows=2000, codec_rounds=300)


class Stopwatch:
    """The calling threads' CPU inside named functions: each is wrapped in place while
    `timing()` lasts, and put back after."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._wrapped: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        spent = self.spent
        spent.setdefault(label, 0.0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += time.thread_time() - started

        self._wrapped.append((owner, name, original))
        setattr(owner, name, timed)

    @contextmanager
    def timing(self) -> Iterator[Stopwatch]:
        try:
            yield self
        finally:
            for owner, name, original in reversed(self._wrapped):
                setattr(owner, name, original)
            self._wrapped.clear()


def in_process(config: Config, rows: Any, app: dict[str, float]) -> dict[int, dict[str, float]]:
    """Per batch size: stage label -> CPU µs per key. `app` takes `app_costs`, measured on
    the same node after the arms."""
    import store.sqlite.feed
    import store.sqlite.feed_ring
    import store.sqlite.store
    from bench.peers.renderqueue import InProcessClaimant, RenderqueuePeer
    from keeper.core import KeeperCore
    from keeper.feed import Feed
    from keeper.runner import Keeper
    from keeper.topcheck import TopCheck

    peer = RenderqueuePeer()
    out: dict[int, dict[str, float]] = {}
    try:
        report.progress(f"stages: loading {len(rows):,} rows and starting the keeper")
        peer.load(rows)
        peer.settle()
        keeper = next(t for t in threading.enumerate() if t.name == "keeper")
        claimant = InProcessClaimant(peer.spec().params)
        try:
            for batch in BATCHES:
                watch = Stopwatch()
                watch.wrap(store.sqlite.store.SqliteStore, "get_many", "post-grant read")
                watch.wrap(store.sqlite.store.SqliteStore, "complete", "store.complete")
                watch.wrap(store.sqlite.store, "_apply_round", "UPDATE statements")
                watch.wrap(store.sqlite.feed_ring.FeedHandoff, "hand_over", "feed handoff")
                # The keeper thread's parts: only it calls these.
                watch.wrap(Feed, "wait", "feed waits")
                watch.wrap(store.sqlite.feed.SqliteSubscription, "poll_records", "feed reads")
                watch.wrap(KeeperCore, "apply_records", "event apply")
                watch.wrap(Keeper, "_publish", "publishes")
                watch.wrap(TopCheck, "_read", "top-check reads")
                claim_s = complete_s = 0.0
                keys = 0
                keeper_before = report.thread_cpu_s(keeper)
                with watch.timing():
                    empty = 0
                    while keys < config.keys_per_batch and empty < 300:
                        started = time.thread_time()
                        got = claimant.claim(batch, 0, LEASE_MS)
                        claimed = time.thread_time()
                        if not got:
                            empty += 1
                            time.sleep(0.01)  # the keeper's next publish
                            continue
                        empty = 0
                        claimant.complete(got, 0)
                        claim_s += claimed - started
                        complete_s += time.thread_time() - claimed
                        keys += len(got)
                    # The keeper's last events: it takes a few ms to apply what was written.
                    time.sleep(0.5)
                if not keeper.is_alive():
                    raise RuntimeError(f"batch {batch}: the keeper thread ended during the arm")
                keeper_s = report.thread_cpu_s(keeper) - keeper_before
                if not keys:
                    raise RuntimeError(f"batch {batch}: nothing was claimable")
                per_key = {label: spent / keys * 1e6 for label, spent in watch.spent.items()}
                per_key.update(
                    claim=claim_s / keys * 1e6,
                    completion=complete_s / keys * 1e6,
                    keeper=keeper_s / keys * 1e6,
                    keys=float(keys),
                )
                out[batch] = per_key
                report.progress(
                    f"stages: batch {batch}: claim {per_key['claim']:.1f}, completion "
                    f"{per_key['completion']:.1f}, keeper {per_key['keeper']:.1f} µs/key "
                    f"({keys:,} keys)"
                )
            due_left = due_count(rows, time.time_ns() // 1_000_000) - sum(
                int(spent["keys"]) for spent in out.values()
            )
            app.update(app_costs(config, claimant.node, due_left))
        finally:
            claimant.close()
    finally:
        peer.drop()
    return out


def request_costs(config: Config) -> dict[str, float]:
    """A request's fixed cost: one worker's CPU per request, less its idle rate."""
    from bench.harness.node import Node, NodeClient, process_cpu_s

    rows = generate(Workload(rows=config.http_rows, now_ms=time.time_ns() // 1_000_000))
    node = Node(rows)
    out: dict[str, float] = {}
    try:
        node.start(args=["--workers", "1"])
        worker = {"worker 0": node.processes()["worker 0"]}

        def cpu() -> float:
            return process_cpu_s(worker)["worker 0"]

        before, started = cpu(), time.perf_counter()
        time.sleep(2.0)
        idle_rate = (cpu() - before) / (time.perf_counter() - started)
        client = NodeClient(node.port)
        try:
            calls: dict[str, Callable[[], Any]] = {
                "GET /healthz": lambda: client.call("GET", "/healthz"),
                "POST /v1/claims, max 1": lambda: client.call(
                    "POST", "/v1/claims", {"max": 1, "worker": "stages", "lease_s": 300}
                ),
            }
            for what, call in calls.items():
                for _ in range(min(200, config.requests)):
                    call()
                before, started = cpu(), time.perf_counter()
                for _ in range(config.requests):
                    status, _ = call()
                    if status != 200:
                        raise RuntimeError(f"{what}: HTTP {status}")
                elapsed = time.perf_counter() - started
                spent = cpu() - before - idle_rate * elapsed
                out[what] = max(0.0, spent) / config.requests * 1e6
                report.progress(f"stages: {what}: {out[what]:.0f} µs of worker CPU a request")
        finally:
            client.close()
    finally:
        node.drop()
    return out


APP_CLAIM_KEYS = 100


def app_costs(config: Config, node: Any, due_left: int) -> dict[str, float]:
    """The worker's ASGI app called in process, no server: the calling thread's CPU per
    request (and per key of a 100-key claim). A claim answered short (the ring ran low
    before the keeper's refill) is not counted. The claims take at most half of the
    `due_left` rows between them, so the ring's refills keep up."""
    import asyncio

    from api.app import build_services, create_app

    app = create_app(node, build_services(node))

    async def call(method: str, path: str, body: bytes) -> tuple[int, bytes]:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())],
        }  # fmt: skip
        received = False
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            nonlocal received
            if received:  # a request is whole in one message: nothing more comes
                await asyncio.Event().wait()
            received = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        await app(scope, receive, send)
        return int(sent[0]["status"]), b"".join(m.get("body", b"") for m in sent[1:])

    def claim_body(keys: int) -> bytes:
        return msgspec.json.encode({"max": keys, "worker": "stages", "lease_s": 300})

    # (method, path, body, keys a full answer holds, requests)
    one_key = max(1, min(config.requests, due_left // 4))
    hundred = max(1, min(config.requests // 10, due_left // 4 // APP_CLAIM_KEYS))
    calls = {
        "GET /healthz": ("GET", "/healthz", b"", 0, config.requests),
        "POST /v1/claims, max 1": ("POST", "/v1/claims", claim_body(1), 1, one_key),
        f"POST /v1/claims, max {APP_CLAIM_KEYS}": (
            "POST", "/v1/claims", claim_body(APP_CLAIM_KEYS), APP_CLAIM_KEYS, hundred,
        ),
    }  # fmt: skip

    async def run() -> dict[str, float]:
        out: dict[str, float] = {}
        for what, (method, path, body, keys, requests) in calls.items():
            spent, counted, short = 0.0, 0, 0
            while counted < requests:
                started = time.thread_time()
                status, answer = await call(method, path, body)
                elapsed = time.thread_time() - started
                if status != 200:
                    raise RuntimeError(f"{what}: HTTP {status}: {answer[:200]!r}")
                if keys and answer.count(b'"token"') < keys:
                    short += 1
                    if short > 10 * requests:
                        raise RuntimeError(f"{what}: the ring kept running short")
                    await asyncio.sleep(0.02)  # the keeper's refill
                    continue
                spent += elapsed
                counted += 1
            out[what] = spent / counted * 1e6
            report.progress(f"stages: the app alone: {what}: {out[what]:.0f} µs a request")
        return out

    return asyncio.run(run())


def body_costs(config: Config) -> dict[str, float]:
    from api.body import decode_json
    from api.completions import check
    from wire.schemas import ClaimResponse, CompletionsRequest, Lease

    keys = [key_of(i * 7919) for i in range(100)]
    body = msgspec.json.encode(
        {"items": [{"key": k, "token": str(4294967297 + i), "outcome": "rendered"}
                   for i, k in enumerate(keys)]}
    )  # fmt: skip
    leases = [
        Lease(key=k, token=str(4294967297 + i), route="product", due_at=1, lease_expires_at=2,
              sitemap=False, cadence_s=3600)
        for i, k in enumerate(keys)
    ]  # fmt: skip
    answer = ClaimResponse(leases=leases, status="ready")
    encode = msgspec.json.Encoder().encode  # as api.body encodes every answer

    def decoded() -> None:
        check(decode_json(body, CompletionsRequest))

    out: dict[str, float] = {}
    for what, work in (
        ("decode and check a 100-item completion body", decoded),
        ("encode a 100-lease claim answer", lambda: encode(answer)),
    ):
        started = time.process_time()
        for _ in range(config.codec_rounds):
            work()
        out[what] = (time.process_time() - started) / config.codec_rounds * 1e6
    return out


STAGE_ROWS = (
    ("claim", "claim (api.claims.grant_from_ring)"),
    ("post-grant read", "of the claim: the post-grant read (store.get_many)"),
    ("completion", "completion (api.completions.apply)"),
    ("store.complete", "of the completion: store.complete"),
    ("UPDATE statements", "of store.complete: its UPDATE statements"),
    ("feed handoff", "of store.complete: the handoff into the keeper's feed ring"),
    ("keeper", "keeper thread, per completed key"),
    ("feed waits", "of the keeper: waiting on the feed (its wake-ups)"),
    ("feed reads", "of the keeper: reading the feed (poll_records)"),
    ("event apply", "of the keeper: applying the events (KeeperCore.apply_records)"),
    ("publishes", "of the keeper: publishing"),
    ("top-check reads", "of the keeper: the top check's reads"),
)


def figures(
    config: Config,
    stages: dict[int, dict[str, float]],
    requests: dict[str, float],
    app: dict[str, float],
    bodies: dict[str, float],
) -> list[report.Figure]:
    table = (
        f"Where a key's CPU goes, in process: {config.rows:,} rows, 20% due, claim then "
        "complete (the claimant thread's CPU per key, the keeper's beside it)"
    )
    out: list[report.Figure] = []
    for batch in BATCHES:
        spent = stages.get(batch, {})
        for label, what in STAGE_ROWS:
            out.append(
                report.Figure(table=table, what=f"batch {batch}: {what}", unit="µs/key",
                              ours=round(spent[label], 2) if label in spent else None)
            )  # fmt: skip
        whole = [spent.get(name) for name in ("claim", "completion", "keeper")]
        out.append(
            report.Figure(
                table=table,
                what=f"batch {batch}: claim, completion and keeper together",
                unit="µs/key",
                ours=round(sum(v for v in whole if v is not None), 2)
                if all(v is not None for v in whole) else None,
            )
        )  # fmt: skip
    fixed = "A request's fixed cost through HTTP (one worker; its CPU per request, less idle)"
    for what, value in requests.items():
        out.append(report.Figure(table=fixed, what=what, unit="µs", ours=round(value, 1)))
    alone = "The worker's app alone, in process with no server (CPU per request)"
    for what, value in app.items():
        out.append(report.Figure(table=alone, what=what, unit="µs", ours=round(value, 1)))
    claim = f"POST /v1/claims, max {APP_CLAIM_KEYS}"
    if claim in app:
        out.append(
            report.Figure(table=alone, what=f"{claim}, per key", unit="µs/key",
                          ours=round(app[claim] / APP_CLAIM_KEYS, 2))
        )  # fmt: skip
    codec = "Bodies, msgspec (CPU per request)"
    for what, value in bodies.items():
        out.append(report.Figure(table=codec, what=what, unit="µs", ours=round(value, 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench stages", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=0)
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    if args.rows:
        config = msgspec.structs.replace(config, rows=args.rows)
    result = report.new_result("stages", args.quick)
    report.progress(f"stages: generating {config.rows:,} rows")
    rows = generate(Workload(rows=config.rows, now_ms=time.time_ns() // 1_000_000))
    due = due_count(rows, time.time_ns() // 1_000_000)
    if due < config.keys_per_batch * len(BATCHES):
        config = msgspec.structs.replace(config, keys_per_batch=due // (len(BATCHES) + 1))
    failures: list[str] = []
    stages: dict[int, dict[str, float]] = {}
    requests: dict[str, float] = {}
    app: dict[str, float] = {}
    bodies: dict[str, float] = {}
    steps: list[tuple[str, Callable[[], None]]] = [
        ("in process", lambda: stages.update(in_process(config, rows, app))),
        ("HTTP", lambda: requests.update(request_costs(config))),
        ("bodies", lambda: bodies.update(body_costs(config))),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            report.progress(f"stages: {name} FAILED: {exc}")
    result.figures = figures(config, stages, requests, app, bodies)
    result.promised = [figure.key for figure in result.figures]
    result.raw = {
        "config": msgspec.to_builtins(config),
        "stages": {str(b): v for b, v in stages.items()},
        "requests": requests,
        "app": app,
        "bodies": bodies,
        "failures": failures,
    }
    if stages:
        report.progress(f"stages: chart {stages_chart(result, stages)}")
    status = report.emit(result)
    if failures:
        report.progress("stages: FAILED: " + "; ".join(failures))
        return 1
    return status


def stages_chart(result: report.SectionResult, stages: dict[int, dict[str, float]]) -> Path:
    """bench/sections/stages: a key's CPU by stage, one stacked bar per batch size."""
    from bench.harness.charts import plt, save

    # (stage, legend, the stages inside it, drawn apart)
    parts: tuple[tuple[str, str, tuple[str, ...]], ...] = (
        ("post-grant read", "claim: post-grant read", ()),
        ("claim", "claim: the rest", ("post-grant read",)),
        ("UPDATE statements", "completion: UPDATE statements", ()),
        ("feed handoff", "completion: feed handoff", ()),
        (
            "store.complete",
            "completion: rest of store.complete",
            ("UPDATE statements", "feed handoff"),
        ),
        ("completion", "completion: the API's part", ("store.complete",)),
        ("feed waits", "keeper: feed waits", ()),
        ("feed reads", "keeper: feed reads", ()),
        ("event apply", "keeper: event apply", ()),
        ("publishes", "keeper: publishes", ()),
        ("top-check reads", "keeper: top-check reads", ()),
        (
            "keeper",
            "keeper: the rest",
            ("feed waits", "feed reads", "event apply", "publishes", "top-check reads"),
        ),
    )
    batches = sorted(stages)
    figure, axis = plt.subplots(figsize=(11, 2.4 + 1.1 * len(batches)))
    left = [0.0] * len(batches)
    colours = plt.get_cmap("tab20")  # twelve parts: the default cycle repeats after ten
    for index, (label, name, inside) in enumerate(parts):
        values = []
        for batch in batches:
            spent = stages[batch]
            value = spent.get(label, 0.0)
            values.append(max(0.0, value - sum(spent.get(m, 0.0) for m in inside)))
        axis.barh(
            [f"batch {b}" for b in batches], values, left=left, label=name, color=colours(index)
        )
        left = [a + b for a, b in zip(left, values, strict=True)]
    axis.set_xlabel("CPU µs per claimed and completed key (lower is better)")
    axis.grid(axis="x", alpha=0.3)
    axis.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    config: Any = result.raw.get("config") or {}
    figure.suptitle(
        f"Where a key's CPU goes, in process: {config.get('rows', 0):,} rows, 20% due "
        f"({'quick' if result.quick else 'full scale'}; {result.machine.get('cpus', '?')} CPUs, "
        f"load {result.machine.get('load_avg_1m', '?')})",
        fontsize=10,
    )
    return save(figure, result, dpi=80)


if __name__ == "__main__":
    sys.exit(main())
