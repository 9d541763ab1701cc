"""The hot paths stage by stage: CPU per key in each stage of a claim and of a completion.

`python -m bench hot [--quick]`

- In process, as bench/sections/stages.py runs the node (its store, its segments, a keeper thread,
  the API's own `grant_from_ring` and `apply`), on SQLite and on PostgreSQL, batches of
  10, 100 and 1000: claim then complete, all rendered, and the calling thread's CPU per
  key in each stage. A claim: decode (its body), ring, grant, marks, post-grant read,
  the rest of `grant_from_ring` (its Python around the calls) and encode (the answer).
  A completion: decode, check, SQL, commit, release, marks, the rest of `apply`, encode,
  and the keeper thread's CPU per completed key (keeper apply).
- Through HTTP, a SQLite node with two workers: claims alone (leases left to run), two
  claimant processes, each batch size: every node process's CPU over the arm per
  claimed key (psutil, as bench/sections/node.py measures it), against 4 µs at batch 100.

A stage is timed by wrapping the functions that do it while an arm runs (`CLAIM_STAGES`,
`COMPLETION_STAGES`: each names every function that does the stage, so the table reads
the same before and after a stage changes how it is done; a stage none of whose
functions exists on a backend is left unmeasured). The wrapper's own cost is measured
and taken off each call. Each figure is thread or process CPU (user + system); compare
rows of one run.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import msgspec

from bench.harness import report
from bench.harness.postgres import host_port
from bench.harness.workload import PG_DSN, Rows, Workload, due_count, generate, reachable

BATCHES = (10, 100, 1000)
BACKENDS = ("sqlite", "postgres")
LEASE_S = 300
HTTP_CLAIMANTS = 2
HTTP_TARGET_US = 4.0  # node CPU per claimed key, claims alone through HTTP, batch 100
IDLE_S = 2.0  # the node's idle CPU is measured this long before each arm

# Each stage: the functions that do it, as (module, attribute path). Several may name one
# stage: the path a claim took before a change and the one it takes after.
Hook = tuple[str, str]
CLAIM_STAGES: dict[str, tuple[Hook, ...]] = {
    "ring": (("shm.ring", "ReadyRing.claim"), ("shm.ring", "ReadyRing.claim_batch")),
    "grant": (("shm.leases", "LeaseTable.grant"), ("shm.leases", "LeaseTable.grant_batch")),
    "marks": (
        ("shm.marks", "WriteMarks.unwritten_since"),
        ("shm.marks", "WriteMarks.unwritten_mask"),
        ("shm.marks", "WriteMarks.class_of"),
    ),
    "post-grant read": (
        ("store.core", "SqlStore.get_many"),
        ("store.sqlite.store", "SqliteStore.get_many"),
        ("store.postgres.store", "PostgresStore.get_many"),
    ),
}
COMPLETION_STAGES: dict[str, tuple[Hook, ...]] = {
    "SQL": (
        ("store.sqlite.store", "_apply_round"),
        ("store.sqlite.store", "_apply_observed"),
    ),
    "commit": (),
    "store, the rest": (
        ("store.sqlite.store", "SqliteStore.complete"),
        ("store.postgres.store", "PostgresStore.complete"),
    ),
    "release": (("shm.leases", "LeaseTable.complete"), ("shm.leases", "LeaseTable.fail")),
    "marks": (("shm.marks", "WriteMarks.stamp"),),
}
# Stages timed inside another, taken off it: (outer, inner).
NESTED = (("store, the rest", "SQL"), ("store, the rest", "commit"))

CLAIM_ROWS = ("decode", "ring", "grant", "marks", "post-grant read", "claim, the rest", "encode")
COMPLETION_ROWS = (
    "decode",
    "check",
    "SQL",
    "commit",
    "store, the rest",
    "release",
    "marks",
    "completion, the rest",
    "encode",
    "keeper apply",
)


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    keys_per_arm: int  # keys claimed and completed at each batch size, in process
    http_rows: int
    http_keys_per_arm: int
    http_max_s: float


# Through HTTP an arm runs well under a second at batch 100; psutil reads a process's CPU
# in clock ticks (10 ms), so the arm takes enough keys for a tick to be a few percent.
FULL = Config(
    rows=200_000, keys_per_arm=12_000, http_rows=600_000, http_keys_per_arm=36_000, http_max_s=20
)
QUICK = Config(
    rows=20_000, keys_per_arm=1000, http_rows=20_000, http_keys_per_arm=1000, http_max_s=8
)


def resolve(hook: Hook) -> tuple[Any, str] | None:
    """(the owner of the function, its name), or None where this tree has no such one."""
    module_name, path = hook
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return (owner, name) if callable(getattr(owner, name, None)) else None


class Stopwatch:
    """The calling threads' CPU inside named functions, each wrapped in place while
    `timing()` lasts; `calls` counts them, so the wrapper's own cost can be taken off."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.measured: set[str] = set()
        self._wrapped: list[tuple[Any, str, Any]] = []

    def wrap_stages(self, stages: dict[str, tuple[Hook, ...]]) -> None:
        for label, hooks in stages.items():
            self.spent.setdefault(label, 0.0)
            self.calls.setdefault(label, 0)
            for hook in hooks:
                found = resolve(hook)
                if found is not None:
                    self.wrap(*found, label)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        own = isinstance(owner, type) and name in owner.__dict__
        original = inspect.getattr_static(owner, name)
        spent, calls = self.spent, self.calls
        spent.setdefault(label, 0.0)
        calls.setdefault(label, 0)
        clock = time.thread_time
        mine = threading.get_ident()  # the keeper thread calls some of them too
        self.measured.add(label)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != mine:
                return original(*args, **kwargs)
            started = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += clock() - started
                calls[label] += 1

        self._wrapped.append(
            (owner, name, original if own or not isinstance(owner, type) else None)
        )
        setattr(owner, name, timed)

    @contextmanager
    def timing(self) -> Iterator[Stopwatch]:
        try:
            yield self
        finally:
            for owner, name, original in reversed(self._wrapped):
                if original is None:
                    delattr(owner, name)  # inherited: the base's own shows through again
                else:
                    setattr(owner, name, original)
            self._wrapped.clear()


def wrapper_cost_s(rounds: int = 20_000) -> float:
    """CPU a wrapped call books to its stage beyond the call itself (its clock reads)."""

    class Probe:
        @staticmethod
        def nothing() -> None:
            return None

    watch = Stopwatch()
    watch.wrap(Probe, "nothing", "probe")
    with watch.timing():
        for _ in range(rounds):
            Probe.nothing()
    return watch.spent["probe"] / rounds


class Arm(msgspec.Struct, kw_only=True):
    """One backend and batch size: µs per key by stage (None: not measured here)."""

    backend: str
    batch: int
    keys: int
    claim: dict[str, float | None]
    completion: dict[str, float | None]
    claim_total_us: float
    completion_total_us: float


def per_key_stages(
    watch: Stopwatch, labels: dict[str, tuple[Hook, ...]], overhead_s: float, keys: int
) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for label in labels:
        if label not in watch.measured:
            out[label] = None
            continue
        spent = max(0.0, watch.spent[label] - watch.calls[label] * overhead_s)
        out[label] = spent / keys * 1e6
    return out


def in_process(config: Config, rows: Rows, backend: str) -> list[Arm]:
    """Claim then complete at each batch size on one backend, stage by stage."""
    from api.body import decode_json
    from api.claims import grant_from_ring
    from api.completions import apply, check
    from bench.peers.renderqueue import InProcessClaimant, LocalNode, RenderqueuePeer
    from wire.schemas import ClaimRequest, ClaimResponse, CompletionsRequest

    encode = msgspec.json.Encoder().encode  # as api.body encodes every answer
    scratch = None
    peer = RenderqueuePeer()
    if backend == "postgres":
        from bench.harness.postgres import Scratch, db_url

        scratch = Scratch()
        peer.drop()
        peer.node = LocalNode(db=db_url(scratch.create("hot")))
        peer.store = peer.node.open_store()
    overhead_s = wrapper_cost_s()
    arms: list[Arm] = []
    try:
        report.progress(f"hot: {backend}: loading {len(rows):,} rows, starting the keeper")
        peer.load(rows)
        peer.settle()
        keeper = next(t for t in threading.enumerate() if t.name == "keeper")
        claimant = InProcessClaimant(peer.spec().params)
        node = claimant.node
        try:
            for batch in BATCHES:
                claim_body = msgspec.json.encode(
                    {"max": batch, "worker": "hot", "lease_s": LEASE_S}
                )
                claims, completions = Stopwatch(), Stopwatch()
                # Twice: once as it runs, for each whole (the claim, the completion, the
                # keeper), once with its stages wrapped, for their parts; a wrapper's clock
                # reads fall partly outside the call it times, so the parts of a path that
                # makes many calls would swell the whole they are taken from.
                passes: dict[bool, tuple[dict[str, float], int, float]] = {}
                for instrumented in (False, True):
                    inline = {"claim decode": 0.0, "claim encode": 0.0, "grant_from_ring": 0.0}
                    inline |= {
                        "completion decode": 0.0,
                        "check": 0.0,
                        "apply": 0.0,
                        "completion encode": 0.0,
                    }
                    keys = 0
                    empty = 0
                    keeper_before = report.thread_cpu_s(keeper)
                    with ExitStack() as wrapped:
                        if instrumented:
                            claims.wrap_stages(CLAIM_STAGES)
                            completions.wrap_stages(COMPLETION_STAGES)
                            wrapped.enter_context(claims.timing())
                            wrapped.enter_context(completions.timing())
                        while keys < config.keys_per_arm // 2 and empty < 300:
                            t0 = time.thread_time()
                            request = decode_json(claim_body, ClaimRequest)
                            t1 = time.thread_time()
                            leases = grant_from_ring(node, request.max, LEASE_S * 1000)
                            t2 = time.thread_time()
                            encode(ClaimResponse(leases=leases, status="ready"))
                            t3 = time.thread_time()
                            if not leases:
                                empty += 1
                                time.sleep(0.01)  # the keeper's next publish
                                continue
                            empty = 0
                            inline["claim decode"] += t1 - t0
                            inline["grant_from_ring"] += t2 - t1
                            inline["claim encode"] += t3 - t2
                            # The fleet's completion body, made outside the clocks.
                            done = msgspec.json.encode(
                                {"items": [{"key": lease.key, "token": lease.token,
                                            "outcome": "rendered"} for lease in leases]}
                            )  # fmt: skip
                            t4 = time.thread_time()
                            completing = decode_json(done, CompletionsRequest)
                            t4b = time.thread_time()
                            check(completing)
                            t5 = time.thread_time()
                            (results,) = apply(node, [completing], wait=True)
                            t6 = time.thread_time()
                            encode(results)
                            t7 = time.thread_time()
                            refused = [r for r in results.results if not r.ok]
                            if refused:
                                raise RuntimeError(
                                    f"{len(refused)} completions refused: {refused[0]}"
                                )
                            inline["completion decode"] += t4b - t4
                            inline["check"] += t5 - t4b
                            inline["apply"] += t6 - t5
                            inline["completion encode"] += t7 - t6
                            keys += len(leases)
                    time.sleep(0.5)  # the keeper's last events: a few ms to apply what was written
                    if not keeper.is_alive():
                        raise RuntimeError(f"{backend} batch {batch}: the keeper thread ended")
                    keeper_s = report.thread_cpu_s(keeper) - keeper_before
                    if not keys:
                        raise RuntimeError(f"{backend} batch {batch}: nothing was claimable")
                    passes[instrumented] = (inline, keys, keeper_s)
                inline, keys, keeper_s = passes[False]
                keys_wrapped = passes[True][1]
                arms.append(arm_of(backend, batch, keys, keys_wrapped, claims, completions, inline,
                                   keeper_s, overhead_s))  # fmt: skip
                last = arms[-1]
                report.progress(
                    f"hot: {backend} batch {batch}: claim {last.claim_total_us:.2f}, completion "
                    f"{last.completion_total_us:.2f} µs/key ({keys:,} keys)"
                )
        finally:
            claimant.close()
    finally:
        peer.drop()
        if scratch is not None:
            scratch.drop_all()
    return arms


def arm_of(
    backend: str,
    batch: int,
    keys: int,
    keys_wrapped: int,
    claims: Stopwatch,
    completions: Stopwatch,
    inline: dict[str, float],
    keeper_s: float,
    overhead_s: float,
) -> Arm:
    def us(seconds: float) -> float:
        return seconds / keys * 1e6

    claim = per_key_stages(claims, CLAIM_STAGES, overhead_s, keys_wrapped)
    grant_us = us(inline["grant_from_ring"])
    claim["claim, the rest"] = max(0.0, grant_us - sum(v or 0.0 for v in claim.values()))
    claim["decode"] = us(inline["claim decode"])
    claim["encode"] = us(inline["claim encode"])
    completion = per_key_stages(completions, COMPLETION_STAGES, overhead_s, keys_wrapped)
    for outer, inner in NESTED:
        if completion.get(outer) is not None and completion.get(inner) is not None:
            completion[outer] = max(0.0, (completion[outer] or 0.0) - (completion[inner] or 0.0))
    apply_us = us(inline["apply"])
    inside_apply = sum(v or 0.0 for v in completion.values())
    completion["completion, the rest"] = max(0.0, apply_us - inside_apply)
    completion["decode"] = us(inline["completion decode"])
    completion["check"] = us(inline["check"])
    completion["encode"] = us(inline["completion encode"])
    completion["keeper apply"] = us(keeper_s)
    return Arm(
        backend=backend,
        batch=batch,
        keys=keys,
        claim=claim,
        completion=completion,
        claim_total_us=round(sum(v or 0.0 for v in claim.values()), 3),
        completion_total_us=round(
            sum(v or 0.0 for k, v in completion.items() if k != "keeper apply"), 3
        ),
    )


def http_claims(config: Config, rows: Rows) -> dict[int, dict[str, Any]]:
    """Claims alone through HTTP on a SQLite node: node CPU per claimed key, by batch."""
    from bench.harness.node import Node, process_cpu_s
    from bench.sections.node import run_our_arm

    node = Node(rows)
    out: dict[int, dict[str, Any]] = {}
    try:
        node.start()
        for batch in BATCHES:
            # The node's idle rate (its keeper publishes every second, its supervisor
            # watches), taken off the arm's CPU as the stages section takes it off a request's:
            # on a loaded machine an arm's length, not its claims, would decide it.
            processes = node.processes()
            before, started = sum(process_cpu_s(processes).values()), time.perf_counter()
            time.sleep(IDLE_S)
            idle_rate = (sum(process_cpu_s(processes).values()) - before) / (
                time.perf_counter() - started
            )
            arm = run_our_arm(
                node.port,
                batch,
                HTTP_CLAIMANTS,
                config.http_keys_per_arm,
                config.http_max_s,
                node.worker_of(),
                complete=False,
                node_processes=node.processes(),
            )
            if arm.granted_twice:
                raise RuntimeError(f"HTTP batch {batch}: {arm.granted_twice} keys granted twice")
            node_s = sum(arm.node_cpu_s.values())
            out[batch] = {
                "keys": arm.keys,
                "keys_per_s": arm.keys_per_s,
                "seconds": arm.seconds,
                "idle_cpu_per_s": round(idle_rate, 4),
                "node_us_per_key": arm.cpu_us_per_key(max(0.0, node_s - idle_rate * arm.seconds)),
                "node_with_idle_us_per_key": arm.cpu_us_per_key(node_s),
                "by_process": {k: arm.cpu_us_per_key(v) for k, v in arm.node_cpu_s.items()},
                "claim_p50_us": arm.claim_p50_us,
                "worker0_share": arm.worker0_share,  # of the claims (worker 0 hosts the keeper)
            }
            report.progress(
                f"hot: HTTP claims alone, batch {batch}: node {out[batch]['node_us_per_key']} "
                f"µs/key, {arm.keys_per_s:,.0f} keys/s ({arm.keys:,} keys)"
            )
    finally:
        node.drop()
    return out


def figures(arms: list[Arm], http: dict[int, dict[str, Any]]) -> list[report.Figure]:
    out: list[report.Figure] = []
    for kind, rows in (("claim", CLAIM_ROWS), ("completion", COMPLETION_ROWS)):
        for backend in BACKENDS:
            table = f"CPU per key by stage of a {kind}, in process, {backend} (µs/key)"
            for arm in (a for a in arms if a.backend == backend):
                spent = arm.claim if kind == "claim" else arm.completion
                for stage in rows:
                    value = spent.get(stage)
                    out.append(
                        report.Figure(table=table, what=f"batch {arm.batch}: {stage}",
                                      unit="µs/key",
                                      ours=None if value is None else round(value, 3))
                    )  # fmt: skip
                total = arm.claim_total_us if kind == "claim" else arm.completion_total_us
                out.append(
                    report.Figure(table=table, what=f"batch {arm.batch}: {kind}, every stage",
                                  unit="µs/key", ours=round(total, 3))
                )  # fmt: skip
    table = (
        "Claims alone through HTTP, SQLite, two workers, two claimants: every node process's "
        "CPU per claimed key (its idle rate before the arm taken off)"
    )
    for batch, got in sorted(http.items()):
        out.append(
            report.Figure(table=table, what=f"batch {batch}: node CPU, less its idle rate",
                          unit="µs/key", ours=got["node_us_per_key"],
                          target=f"<= {HTTP_TARGET_US:g}" if batch == 100 else "",
                          note=f"with idle {got['node_with_idle_us_per_key']}: " + ", ".join(
                              f"{k} {v}" for k, v in sorted(got["by_process"].items())))
        )  # fmt: skip
        out.append(
            report.Figure(table=table, what=f"batch {batch}: keys/s", unit="keys/s",
                          ours=got["keys_per_s"])
        )  # fmt: skip
    return out


def chart(result: report.SectionResult, arms: list[Arm]) -> str:
    """A stacked bar per backend and batch: the claim's stages, then the completion's."""
    from bench.harness.charts import plt, save

    figure, axes = plt.subplots(1, 2, figsize=(15, 2.6 + 0.5 * len(arms)))
    for axis, kind, rows in ((axes[0], "claim", CLAIM_ROWS), (axes[1], "completion",
                                                               COMPLETION_ROWS)):  # fmt: skip
        labels = [f"{a.backend}\nbatch {a.batch}" for a in arms]
        left = [0.0] * len(arms)
        for stage in rows:
            values = [((a.claim if kind == "claim" else a.completion).get(stage) or 0.0)
                      for a in arms]  # fmt: skip
            axis.barh(labels, values, left=left, label=stage)
            left = [x + y for x, y in zip(left, values, strict=True)]
        axis.set_xlabel(f"CPU µs per key, {kind} (lower is better)")
        axis.grid(axis="x", alpha=0.3)
        axis.invert_yaxis()
        axis.legend(fontsize=7, ncol=2, loc="lower right")
    config: Any = result.raw.get("config") or {}
    figure.suptitle(
        f"The hot paths by stage, in process: {config.get('rows', 0):,} rows, 20% due "
        f"({'quick' if result.quick else 'full scale'}; {result.machine.get('cpus', '?')} CPUs, "
        f"load {result.machine.get('load_avg_1m', '?')})",
        fontsize=10,
    )
    return str(save(figure, result, dpi=80))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench hot", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=0)
    parser.add_argument("--no-http", action="store_true", help="in process only")
    parser.add_argument("--http-only", action="store_true", help="through HTTP only")
    parser.add_argument("--backend", choices=BACKENDS, action="append")
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    if args.rows:
        config = msgspec.structs.replace(config, rows=args.rows, http_rows=args.rows)
    result = report.new_result("hot", args.quick)
    report.progress(f"hot: generating {config.rows:,} rows")
    rows = generate(Workload(rows=config.rows, now_ms=time.time_ns() // 1_000_000))
    due = due_count(rows, time.time_ns() // 1_000_000)
    if due < config.keys_per_arm * (len(BATCHES) + 1):
        config = msgspec.structs.replace(config, keys_per_arm=due // (len(BATCHES) + 1))
    failures: list[str] = []
    arms: list[Arm] = []
    http: dict[int, dict[str, Any]] = {}
    steps: list[tuple[str, Callable[[], None]]] = []
    for backend in [] if args.http_only else args.backend or BACKENDS:
        down = reachable(*host_port(PG_DSN)) if backend == "postgres" else None
        if down:
            failures.append(f"postgres: {down}")
            continue
        steps.append((backend, lambda b=backend: arms.extend(in_process(config, rows, b))))  # type: ignore[misc]
    if not args.no_http:
        http_rows = rows if config.http_rows == config.rows else generate(
            Workload(rows=config.http_rows, now_ms=time.time_ns() // 1_000_000)
        )  # fmt: skip
        steps.append(("HTTP", lambda: http.update(http_claims(config, http_rows))))
    for name, step in steps:
        try:
            step()
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            report.progress(f"hot: {name} FAILED: {exc}")
    result.figures = figures(arms, http)
    result.promised = [figure.key for figure in result.figures]
    result.pending = {
        figure.key: "no function of this tree does this stage apart (COMPLETION_STAGES)"
        for figure in result.figures
        if figure.ours is None and figure.unit == "µs/key"
    }
    result.raw = {
        "config": msgspec.to_builtins(config),
        "arms": msgspec.to_builtins(arms),
        "http": {str(b): v for b, v in http.items()},
        "wrapper_cost_us": round(wrapper_cost_s() * 1e6, 3),
        "failures": failures,
    }
    if arms:
        report.progress(f"hot: chart {chart(result, arms)}")
    status = report.emit(result)
    if failures:
        report.progress("hot: FAILED: " + "; ".join(failures))
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
