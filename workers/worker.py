"""A worker process: `python -m workers.worker`, spawned by the supervisor with its spec on
stdin. It serves the whole API on the inherited socket through uvicorn's `Server`; worker 0
also hosts the keeper in a thread.

SIGTERM: stop accepting, finish the requests in flight, then exit. SIGINT: exit quickly.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from types import FrameType

import msgspec
import uvicorn

from api.app import build_services, create_app
from api.lane import StoreLane
from api.node import Node
from api.report import encode_report_line, worker_report
from keeper import heap
from shm.keys import use_secret
from shm.lease_journal import LeaseJournal
from workers import logs
from workers.body_limit import BodyLimit
from workers.config import api_settings, keeper_config
from workers.keeper_host import KeeperHost
from workers.protocol import PROTOCOLS
from workers.segments import Segments
from workers.spec import WorkerSpec

log = logs.get_logger("worker")
PR_SET_PDEATHSIG = 1


# At shutdown, how long the store lane may take to finish the calls queued on it (each is
# bounded by the store's own deadline).
LANE_STOP_S = 10.0

# uvicorn's main loop ticks every 0.1 s: a report about once a second.
REPORT_EVERY_TICKS = 10


class WorkerServer(uvicorn.Server):
    """uvicorn's Server with this node's signal semantics, a ready line, and a report
    (api.report) to the supervisor about once a second.

    uvicorn re-raises a captured signal after shutdown, which would kill the process before
    the keeper stops and the store closes; this server handles the signal and returns.
    """

    def __init__(
        self, config: uvicorn.Config, status_fd: int, report: Callable[[], bytes | None]
    ) -> None:
        super().__init__(config)
        self._status_fd = status_fd
        self._report = report
        self.reports_dropped = 0  # the pipe was full: the supervisor is not reading
        # A stopped or busy supervisor must never block the event loop on this pipe.
        os.set_blocking(status_fd, False)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            with contextlib.suppress(OSError):
                os.write(self._status_fd, b"ready\n")
                self._send_report()

    async def on_tick(self, counter: int) -> bool:
        if counter % REPORT_EVERY_TICKS == 0 and self.started:
            self._send_report()
        return await super().on_tick(counter)

    def _send_report(self) -> None:
        line = self._report()
        if line is None:
            return
        try:
            os.write(self._status_fd, line)
        except BlockingIOError:
            self.reports_dropped += 1
        except OSError:  # the supervisor is gone; this worker is about to be told to stop
            pass


def die_with_parent(supervisor_pid: int) -> None:
    """A SIGKILLed supervisor must not leave workers holding the port."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if os.getppid() != supervisor_pid:
        os.kill(os.getpid(), signal.SIGTERM)


# The keeper's walks read each page of the table once a pass, so a page cache
# gains them nothing; filled by the load, it would stay in worker 0 as long as it runs.
KEEPER_PAGE_CACHE_KIB = 2_000


def start_keeper(spec: WorkerSpec, segments: Segments) -> KeeperHost:
    from keeper.runner import (
        Acknowledge,
        ClusterSettings,
        Keeper,
        Members,
        RaiseLeaseCeiling,
    )
    from store import open_store
    from store.base import cluster_membership

    config = keeper_config(spec.settings)

    settings = spec.settings
    cluster = (
        ClusterSettings(
            ttl_s=settings.node_ttl_s,
            max_lease_s=settings.max_lease_s,
            peers=list(settings.peers),
            peer_wait_s=settings.peer_wait_s,
            incarnation=spec.incarnation,
            predecessor_until_ms=spec.predecessor_until_ms,
            by_site=settings.ownership == "site",
        )
        if settings.clustered
        else None
    )

    def run_once(stop: threading.Event) -> None:
        store = open_store(settings.store_url(), page_cache_kib=KEEPER_PAGE_CACHE_KIB)
        members: Members | None = None
        acknowledge: Acknowledge | None = None
        raise_lease_ceiling: RaiseLeaseCeiling | None = None
        try:
            if cluster is not None:
                # The keeper reads the member list, acknowledges views and publishes its
                # lease ceiling through the store.
                membership = cluster_membership(store)
                members = functools.partial(membership.members, cluster.ttl_s)
                acknowledge = functools.partial(membership.acknowledge, spec.node)
                raise_lease_ceiling = functools.partial(
                    membership.raise_lease_ceiling, spec.node, cluster.ttl_s
                )
            keeper = Keeper(
                store,
                segments.ring,
                segments.leases,
                segments.state,
                config,
                node=spec.node,
                statistics_buffer=segments.keeper,
                site_list_buffer=segments.site_list,
                marks=segments.marks,
                site_table=segments.sites,
                cluster=cluster,
                members=members,
                acknowledge=acknowledge,
                raise_lease_ceiling=raise_lease_ceiling,
            )
            keeper.run(stop)
        finally:
            store.close()

    host = KeeperHost(run_once)
    host.start()
    return host


def serve(spec: WorkerSpec) -> int:
    from store import open_store

    settings = spec.settings
    heap.map_large_blocks()  # before the keeper's buffers grow (keeper.heap)
    use_secret(spec.hash_secret)  # before the keeper or any request hashes a key
    sockets = [socket.socket(fileno=fd) for fd in spec.listen_fds]
    segments = Segments.attach(spec.segments)
    if settings.lease_journal_dir:
        segments.leases.journal = LeaseJournal(Path(settings.lease_journal_dir), spec.node)
    # Opened on the lane that will make the API's store calls (api.lane): on PostgreSQL
    # the connection it opens is the one those calls use, not an idle second one.
    lane = StoreLane()
    store = lane.call_blocking(lambda: open_store(settings.store_url()))
    keeper: KeeperHost | None = None
    try:
        if spec.index == 0:
            # The keeper thread shares this process's GIL with the event loop; a short
            # switch interval bounds how long it can hold up a claim.
            sys.setswitchinterval(settings.keeper_switch_interval_ms / 1000)
            keeper = start_keeper(spec, segments)
        node = Node(
            settings=api_settings(
                settings,
                node=spec.node,
                instance=spec.instance,
                worker=spec.index,
                # What GET /v1/cluster lists, as the supervisor registered it.
                advertised_url=settings.advertised(sockets[0].getsockname()[1]),
            ),
            store=store,
            ring=segments.ring,
            leases=segments.leases,
            state=segments.state,
            supervisor_state=segments.supervisor,
            keeper_statistics=segments.keeper,
            site_list=segments.site_list,
            site_history=segments.site_history,
            marks=segments.marks,
            lane=lane,
        )
        services = build_services(node)
        config = uvicorn.Config(
            BodyLimit(create_app(node, services), settings.max_body_bytes),
            http=PROTOCOLS[settings.http],
            proxy_headers=False,
            # uvloop: a request's fixed cost, the server's share of every claim, is
            # lower than on asyncio's own loop (bench stages measures both).
            loop="uvloop",
            lifespan="off",
            log_config=None,
            access_log=settings.access_log,
            server_header=False,
            timeout_graceful_shutdown=math.ceil(settings.graceful_timeout_s),
            backlog=2048,
        )
        server = WorkerServer(
            config,
            spec.status_fd,
            lambda: encode_report_line(worker_report(node, services.completions.statistics())),
        )
        # Everything allocated so far lives as long as the worker: out of the collector's
        # sight, a full collection walks only what came after (walking the imports and the
        # app too would stall every request and feed event in flight).
        gc.freeze()
        logs.event(log, "worker_serving", worker=spec.index)
        server.run(sockets=sockets)
    finally:
        if keeper is not None and not keeper.stop():
            logs.event(log, "keeper_stop_timeout", worker=spec.index)
        # A connection is never closed under a call still waiting on it in the lane: the
        # process's exit closes it instead.
        if lane.close(LANE_STOP_S):
            store.close()
        else:
            logs.event(log, "store_lane_stop_timeout", worker=spec.index)
        segments.close()
        with contextlib.suppress(OSError):
            os.close(spec.status_fd)
    logs.event(log, "worker_stopped", worker=spec.index)
    return 0


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    settings = spec.settings
    logs.configure(
        f"worker-{spec.index}",
        settings.log_level,
        settings.log_format,
        node=spec.node,
        worker=spec.index,
    )
    die_with_parent(spec.supervisor_pid)
    return serve(spec)


if __name__ == "__main__":
    sys.exit(main())
