"""A bench-only probe inside a cluster node's worker 0, for `bench.sections.cluster`.

Loaded by `bench/harness/cluster_hook/sitecustomize.py` when a node is started with
RQ_BENCH_PROBE=<directory> (and that hook directory on PYTHONPATH); a node started
any other way never imports this. It wraps two methods of the keeper, leaving what
they do unchanged:

- `keeper.feed.Feed.drain`: each batch the feed hands to the keeper is stamped with
  `time.monotonic_ns()` just before it is applied (one deque append per batch, on the
  keeper's thread), so the bench can match each written key to the moment its owner's
  keeper received it.
- `keeper.runner.Keeper.run` and `step`: the keeper thread's native id is written to
  `keeper.json` (the bench reads that thread's CPU with psutil), and on request the
  keeper thread itself copies what it holds (hash, due, version of every held row),
  between two steps, so the copy never races the keeper's own writes.

Requests are files in the directory, served by one daemon thread ("bench-probe")
that looks every 50 ms: `lag.req` -> `lag.bin` (msgpack [[key, ns], ...] of the
batches stamped since the last request), `held.req` -> `held.bin`, `status.req` ->
`status.bin` (held count, phase, exact, member view: read at once, where queue-state's
counts are rewritten only every 5 s). The thread does
its work only when asked, outside the bench's measured windows.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

_STAMPS: collections.deque[tuple[int, Any]] = collections.deque()
_HELD_WANTED = threading.Event()
_HELD_DONE = threading.Event()
_HELD: list[bytes] = []
_STARTED = threading.Event()
_KEEPER: list[Any] = []  # the running keeper, for `status`


def install(directory: str) -> None:
    import msgspec

    from keeper import feed as feed_module
    from keeper import runner
    from store.rows import row_event_from

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    original_drain = feed_module.Feed.drain
    original_run = runner.Keeper.run
    original_step = runner.Keeper.step

    def drain(self: Any, apply: Any, until_ms: int, apply_records: Any = None) -> bool:
        def stamped(events: Any, now: int) -> None:
            _STAMPS.append((time.monotonic_ns(), events))
            apply(events, now)

        def stamped_records(records: Any, now: int) -> None:
            # A SQLite feed's row records (store.base.RowRecords): their events' keys.
            _STAMPS.append((time.monotonic_ns(), [row_event_from(r) for r in records]))
            apply_records(records, now)

        records = None if apply_records is None else stamped_records
        return bool(original_drain(self, stamped, until_ms, records))

    def run(self: Any, stop: threading.Event) -> None:
        (path / "keeper.json").write_text(
            json.dumps({"pid": os.getpid(), "tid": threading.get_native_id()})
        )
        _KEEPER[:] = [self]
        if not _STARTED.is_set():
            _STARTED.set()
            threading.Thread(
                target=_serve, args=(path, msgspec), name="bench-probe", daemon=True
            ).start()
        original_run(self, stop)

    def step(self: Any) -> float:
        if _HELD_WANTED.is_set():
            _HELD[:] = _held(self)
            _HELD_WANTED.clear()
            _HELD_DONE.set()
        return float(original_step(self))

    feed_module.Feed.drain = drain  # type: ignore[method-assign]
    runner.Keeper.run = run  # type: ignore[method-assign]
    runner.Keeper.step = step  # type: ignore[method-assign]


def _held(keeper: Any) -> list[bytes]:
    import numpy as np

    from keeper.slots import RECORD

    queue = keeper.core.queue
    table = np.frombuffer(queue.slots._table, dtype=np.int32)
    live = table[table >= 0]
    records = np.frombuffer(queue.rec, dtype=RECORD)[live]
    return [records["hash"].tobytes(), records["due"].tobytes(), records["version"].tobytes()]


def _status() -> dict[str, Any]:
    """What the keeper holds now, read from this thread: lengths and flags only."""
    if not _KEEPER:
        return {}
    keeper = _KEEPER[0]
    cluster = keeper.cluster
    return {
        "held": len(keeper.core.queue),
        "phase": keeper.phase,
        "exact": keeper.lifecycle.exact,
        "view": list(cluster.view or ()) if cluster is not None else [],
    }


def _serve(path: Path, msgspec: Any) -> None:
    lag_req, held_req, status_req = path / "lag.req", path / "held.req", path / "status.req"
    while True:
        time.sleep(0.02)
        if status_req.exists():
            _write(path / "status.bin", msgspec.msgpack.encode(_status()))
            status_req.unlink()
        if lag_req.exists():
            out: list[tuple[str, int]] = []
            for _ in range(len(_STAMPS)):
                ns, events = _STAMPS.popleft()
                out.extend((event.key, ns) for event in events if hasattr(event, "key"))
            _write(path / "lag.bin", msgspec.msgpack.encode(out))
            lag_req.unlink()
        if held_req.exists():
            _HELD_DONE.clear()
            _HELD_WANTED.set()
            if _HELD_DONE.wait(30):
                _write(path / "held.bin", msgspec.msgpack.encode(_HELD))
                _HELD.clear()
            held_req.unlink()


def _write(target: Path, data: bytes) -> None:
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
