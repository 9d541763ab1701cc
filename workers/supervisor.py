"""The supervisor: one per node. Binds the socket once, creates the shared memory, runs
N workers by index (worker 0 also hosts the keeper) and keeps them running.

- A dead worker is respawned; one that dies while booting is respawned with exponential
  backoff, so a boot error never becomes a respawn storm. If no worker has ever come up
  and a slot keeps failing to boot, the node gives up and exits non-zero.
- SIGTERM stops gracefully: workers stop accepting, finish the requests in flight, and
  the lease table outlives them: once they have exited, the supervisor writes it to the
  lease snapshot file, and the next start loads it before any worker spawns, so live
  leases stay valid for their term across the restart (shm/lease_snapshot.py). SIGINT
  stops quickly and writes no snapshot. A crash (the node SIGKILLed whole) writes none
  but leaves the lease table in shared memory, and the next start adopts its slots
  before any worker spawns (shm/lease_survivor.py says what it checks first, and why
  such a table wins over a snapshot file; workers/lease_carryover.py takes either). A
  second signal while stopping kills what is left (a second SIGINT also drops the
  snapshot).
- The segments are unlinked on every exit path the process survives.

Each event is one log line (workers.logs), and `statistics()` is also published into a small
shared-memory buffer so any worker can serve it (`/prerender_admin/overview`, `/metrics`).
Under systemd (`NOTIFY_SOCKET` set) it also tells systemd when the node is ready, its claim
status, that its keeper is live (the watchdog) and that it is stopping (workers.sd_notify).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from api import site_history
from api.report import MAX_REPORT_BYTES, REPORT_PREFIX, WorkerReport, decode_report_line
from api.status import SegmentView, claim_status
from keeper.state import decode_site_list
from shm.keys import fingerprint
from shm.leases import LeaseCensus
from shm.segment import monotonic_ms, now_ms
from store.rows import NodeRecord
from store.sqlite.wal import WalState, read_wal_state
from workers import logs, sd_notify
from workers.config import Settings, api_settings
from workers.lease_carryover import LeaseCarryover, LeaseRecovery
from workers.listeners import Listeners, ListenFailed
from workers.membership import MembershipHeartbeat, MembershipStatistics
from workers.segments import SegmentNames, Segments, SiteTableSettings
from workers.spec import WorkerSpec

log = logs.get_logger("supervisor")

# A worker that dies before it reports ready, or within this long of starting, failed to
# boot; its slot backs off before the next try.
BOOT_GRACE_S = 10.0
BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
GIVE_UP_AFTER_BOOT_FAILURES = 5
QUICK_STOP_S = 5.0
# How often the supervisor counts the lease table (a read-only scan of every slot)
# for the workers' in-flight and expired-unanswered counts.
CENSUS_INTERVAL_S = 1.0
# A worker's status lines are "ready" and its reports; anything longer is not one of them.
MAX_STATUS_LINE_BYTES = MAX_REPORT_BYTES


class WorkerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    state: str  # starting | ready | backoff | stopped
    pid: int | None
    started_at: int | None
    restarts: int
    boot_failures: int
    last_exit: str | None
    # The worker's latest report of its own counts (api.report); None until its first,
    # and from each restart, since a new process counts from zero.
    report: WorkerReport | None = None
    bad_reports: int = 0  # status lines from the worker that were not a valid report


class SupervisorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    node: str
    instance: str
    host: str
    port: int
    state: str  # starting | running | stopping | stopped
    started_at: int
    written_at: int
    restarts: int
    boot_failures: int
    lease_sweeps: int
    lease_slots_reclaimed: int
    workers: list[WorkerStatistics]
    # A full scan of the lease table, every CENSUS_INTERVAL_S: the workers' in-flight and
    # expired-unanswered counts (api.status), which the ops' counters cannot give.
    lease_census: LeaseCensus | None = None
    membership: MembershipStatistics | None = None  # in a cluster (a PostgreSQL store)
    # A SQLite store's WAL, read from its wal-index with the census: None on PostgreSQL,
    # and while no connection has the database open.
    wal: WalState | None = None
    lease_recovery: LeaseRecovery | None = None  # None until the segments are set up


@dataclass(eq=False)
class WorkerSlot:
    index: int
    process: subprocess.Popen[bytes] | None = None
    status_fd: int | None = None
    status_buffer: bytes = b""
    started_at: float = 0.0
    started_at_ms: int | None = None
    ready: bool = False
    restarts: int = 0
    boot_failures: int = 0  # consecutive
    total_boot_failures: int = 0
    next_start_at: float | None = 0.0  # monotonic; None: do not start
    last_exit: str | None = None
    report: WorkerReport | None = None
    bad_reports: int = 0  # across restarts

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def state(self) -> str:
        if self.process is not None:
            return "ready" if self.ready else "starting"
        return "backoff" if self.next_start_at is not None else "stopped"


def default_instance(settings: Settings, port: int) -> str:
    digest = hashlib.sha1(f"{settings.store_url()}|{port}".encode()).hexdigest()
    return "rq" + digest[:12]


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


@dataclass(eq=False)
class Supervisor:
    settings: Settings
    node: str = field(default_factory=socket.gethostname)
    instance: str = ""
    slots: list[WorkerSlot] = field(default_factory=list)
    state: str = "starting"
    started_at_ms: int = field(default_factory=now_ms)
    port: int = 0
    exit_code: int = 0
    _listeners: Listeners | None = None
    _segments: Segments | None = None
    _selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    _signals: list[int] = field(default_factory=list)
    _wake_r: socket.socket | None = None
    _wake_w: socket.socket | None = None
    _stop_deadline: float | None = None
    _any_ready: bool = False
    _all_ready_logged: bool = False
    on_ready: Callable[[], object] | None = None  # called once, when every worker first serves
    _next_sweep: float = 0.0
    lease_sweeps: int = 0
    lease_slots_reclaimed: int = 0
    _next_census: float = 0.0
    _census: LeaseCensus | None = None
    _in_flight: site_history.InFlightHistory | None = None  # per site, the last hour
    _snapshot_on_exit: bool = False  # the stop was graceful (SIGTERM) and not overridden
    _carryover: LeaseCarryover | None = None  # the lease table across restarts
    _membership: MembershipHeartbeat | None = None
    _incarnation: int = 0
    _predecessor_until_ms: int = 0
    _loop_ended: bool = False
    _hash_secret: bytes = b""  # the store's, read by _prepare_store
    _sqlite_path: str | None = None  # a SQLite store's file, whose WAL the census reads
    _wal: WalState | None = None
    _wal_unreadable: bool = False  # the last read failed (logged when it began)
    _notifier: sd_notify.Notifier | None = None  # under systemd's Type=notify
    _notices: sd_notify.Notices = field(default_factory=sd_notify.Notices)
    _view: SegmentView | None = None  # what the claim status reads, for the notices
    _stopping_reason: str = ""

    # --- lifecycle ---------------------------------------------------------------------

    def run(self) -> int:
        """Serve until stopped; returns the process exit code."""
        try:
            self._setup()
            self._loop()
            self._loop_ended = True
        except ListenFailed as exc:
            logs.event(log, "listen_failed", logging.ERROR, address=exc.address, error=exc.reason)
            self.exit_code = 1
        except Exception as exc:
            # The store or the segments could not be set up: say so in one line and exit.
            logs.event(log, "start_failed", logging.ERROR, error=str(exc), kind=type(exc).__name__)
            self.exit_code = 1
        finally:
            self._teardown()
        return self.exit_code

    def _setup(self) -> None:
        settings = self.settings
        self.node = settings.node or self.node
        self._notifier = sd_notify.Notifier.from_environ()
        if self._notifier is not None:
            self._notices.watchdog_s = sd_notify.watchdog_interval_s(os.environ, os.getpid())
        self._install_signals()
        self._prepare_store()
        self.slots = [WorkerSlot(index=i) for i in range(settings.workers)]
        self.port = self._bind()
        self.instance = settings.instance or default_instance(settings, self.port)
        names = SegmentNames.for_instance(self.instance)
        carryover = LeaseCarryover(settings, self.instance, self._hash_secret)
        self._carryover = carryover
        # Read before the create, which replaces a killed run's segments with empty ones.
        # The wait is the longest a killed supervisor's workers take to stop, as told by
        # their parent's death (workers/worker.py): then the slots are their last.
        survivor = carryover.find_survivor(
            names.leases, wait_s=settings.graceful_timeout_s + QUICK_STOP_S
        )
        self._segments = Segments.create(
            names,
            ring_entries=settings.ring_entries,
            lease_slots=settings.lease_slots,
            hash_secret=self._hash_secret,
            sites=SiteTableSettings.of(settings),
        )
        carryover.restore(self._segments.leases, survivor)
        if self._notifier is not None:  # only the notices read it
            self._view = SegmentView(
                settings=api_settings(
                    settings,
                    node=self.node,
                    instance=self.instance,
                    worker=-1,  # none: the supervisor serves nothing
                    advertised_url=settings.advertised(self.port),
                ),
                ring=self._segments.ring,
                marks=self._segments.marks,
                keeper_statistics=self._segments.keeper,
            )
        try:
            if settings.clustered:
                self._join_cluster()
        except BaseException:
            carryover.keep_if_inherited(self._segments.leases)
            raise
        logs.event(
            log,
            "listening",
            host=settings.host,
            port=self.port,
            workers=settings.workers,
            instance=self.instance,
            node=self.node,
            db=settings.store_url(),
            auth="on" if settings.admin_token else "fleet only" if settings.auth_enabled else "off",
        )
        if not settings.auth_enabled:
            logs.event(
                log,
                "auth_disabled",
                logging.WARNING,
                detail="no RENDERQUEUE_ADMIN_TOKEN / RENDERQUEUE_FLEET_TOKEN: "
                "listening on loopback only, every endpoint open to local callers",
            )
        elif settings.admin_token is None:
            logs.event(
                log,
                "admin_auth_disabled",
                logging.WARNING,
                detail="no RENDERQUEUE_ADMIN_TOKEN: listening on loopback only, the admin "
                "and schedule endpoints open to local callers",
            )
        self.state = "running"
        self._publish()

    def _prepare_store(self) -> None:
        """Open the store once here, so a bad URL or schema fails before any worker boots,
        and read the key-hash secret the workers and the lease snapshot use."""
        from store import open_store

        sqlite_path = self.settings.sqlite_path()
        if sqlite_path is not None:
            os.makedirs(sqlite_path.parent, exist_ok=True)
            self._sqlite_path = str(sqlite_path)
        store = open_store(self.settings.store_url())
        try:
            self._hash_secret = store.hash_secret()
        finally:
            store.close()

    def _join_cluster(self) -> None:
        """Become a member, as a new incarnation, before any worker spawns: a name a live
        process holds, or settings that differ from the live cluster's, stop here."""
        from store.postgres.membership import NodeMembership

        settings = self.settings
        membership = NodeMembership(
            settings.store_url(),
            self.node,
            instance=self.instance,
            advertised_url=settings.advertised(self.port),
            ttl_s=settings.node_ttl_s,
            max_lease_ms=settings.max_lease_s * 1000,
            heartbeat_s=settings.heartbeat_s,
            secret_fingerprint=fingerprint(self._hash_secret),
            site_policy=settings.site_policy(),
            ownership=settings.ownership,
        )
        self._membership = MembershipHeartbeat(
            membership,
            settings.heartbeat_s,
            self._wake,
            keeper_heard_at=self._keeper_heard_at,
            keeper_silence_ms=int(settings.node_ttl_s * 1000),
        )
        joined = self._membership.join()
        self._incarnation = joined.incarnation
        self._predecessor_until_ms = self._predecessor_fence(joined.predecessor)
        if self._inherited_leases():
            self._take_back_leases()

    def _take_back_leases(self) -> None:
        """Before any worker spawns: the leases restored from the previous run are taken
        back from its hand-over, so no other node completes them from now on, and those
        another node completed while this one was down end here (a second completion of
        one lease must find it ended)."""
        assert self._membership is not None and self._segments is not None
        leases = self._segments.leases
        now = now_ms()
        hashes, _, _, tokens = leases.live_leases(now)
        restored = list(zip(hashes.tolist(), tokens.tolist(), strict=True))
        done = self._membership.membership.take_back(restored)
        for hashed, token in done:
            leases.complete(hashed, token, now)
        logs.event(
            log,
            "leases_taken_back",
            restored=len(restored),
            completed_elsewhere=len(done),
        )

    def _inherited_leases(self) -> bool:
        """The previous run's leases were restored or adopted into this run's table."""
        return self._carryover is not None and self._carryover.inherited

    def _keeper_heard_at(self) -> int:
        """When the keeper was last heard going round (monotonic ms), for the heartbeat
        thread. A worker 0 not spawned yet, or still booting (its keeper not heard since
        its spawn), is not judged: a boot slowed by a loaded machine must not cost the
        node its membership, and a boot that fails is the respawn's business. A worker 0
        that has died is silent from its last spawn."""
        heard = self._segments.marks.keeper_heard_at() if self._segments is not None else 0
        slot = self.slots[0] if self.slots else None
        if slot is None or not slot.started_at:
            return monotonic_ms()
        spawned = int(slot.started_at * 1000)
        if slot.process is not None and heard < spawned:
            return monotonic_ms()
        return max(heard, spawned)

    def _predecessor_fence(self, predecessor: NodeRecord | None) -> int:
        """Until when the leases of the incarnation this start replaced may live (this
        node's clock), when its lease table was not taken over; 0 when none may."""
        if predecessor is None or self._inherited_leases():
            return 0
        now = now_ms()
        if predecessor.left:
            assert self._membership is not None
            return predecessor.lease_horizon_ms - self._membership.offset_ms
        max_lease = predecessor.max_lease_ms or self.settings.max_lease_s * 1000
        window = int(self.settings.node_ttl_s * 500)
        until = now - predecessor.heartbeat_age_ms + int(self.settings.node_ttl_s * 1000)
        until += window + max_lease
        if predecessor.lease_horizon_ms > 0:  # its published lease ceiling (keeper.ceiling)
            assert self._membership is not None
            until = min(until, predecessor.lease_horizon_ms - self._membership.offset_ms)
        if until > now:
            logs.event(
                log,
                "predecessor_fenced",
                logging.WARNING,
                incarnation=predecessor.incarnation,
                until_ms=until,
                detail="the previous run of this node stopped without handing its leases "
                "over and its lease table was not taken over: its keys wait until its "
                "leases could have ended",
            )
        return max(0, until)

    def _leave_cluster(self) -> None:
        """After the workers exited: nothing is granted any more, so hand the live leases
        over; the others fence exactly those keys, each until its lease ends."""
        if self._membership is None or self._segments is None:
            return
        self._membership.leave(self._segments.leases)

    def _bind(self) -> int:
        """Bind the node's port once (workers/listeners.py) and return it."""
        settings = self.settings
        self._listeners = Listeners(
            settings.host,
            settings.port,
            workers=settings.workers,
            per_worker=settings.listeners_per_worker,
            reuse_port=settings.reuse_port,
        )
        return self._listeners.port

    def _install_signals(self) -> None:
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signals.append(signum)

    def _teardown(self) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
                slot.process.wait()
            self._close_status(slot)
        if self._listeners is not None:
            self._listeners.close()
        self.state = "stopped"
        self._leave_cluster()
        if self._segments is not None:
            if self._snapshot_on_exit and self._loop_ended and self._carryover is not None:
                self._carryover.save(self._segments.leases)
            with contextlib.suppress(Exception):
                self._publish()
            self._segments.close()
            self._segments.unlink()
            logs.event(log, "segments_unlinked", instance=self.instance)
        if self._notifier is not None:
            self._notifier.close()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        for end in (self._wake_r, self._wake_w):
            if end is not None:
                end.close()
        logs.event(log, "stopped", exit_code=self.exit_code)

    # --- the loop ----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            self._handle_signals()
            self._reap()
            self._notify()
            if self.state == "stopping":
                if all(slot.process is None for slot in self.slots):
                    return
                if self._stop_deadline is not None and time.monotonic() >= self._stop_deadline:
                    self._kill_all("stop deadline passed")
                    self._stop_deadline = None
            else:
                self._start_due()
                self._sweep_leases()
                self._take_census()
            for key, _ in self._selector.select(self._select_timeout()):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        while self._wake_r is not None and self._wake_r.recv(4096):
                            pass
                else:
                    self._read_status(key.data)

    def _notify(self) -> None:
        """Tell systemd what changed, and ping its watchdog while the keeper is live."""
        notifier, view = self._notifier, self._view
        if notifier is None or view is None:
            return
        now = now_ms()
        if self.state == "stopping":
            said = self._notices.due(
                time.monotonic(),
                can_grant=False,
                keeper_live=False,
                status=sd_notify.status_line("stopping", self._stopping_reason),
                stopping=True,
            )
        else:
            status = claim_status(view, now, fences=True)
            said = self._notices.due(
                time.monotonic(),
                can_grant=status.can_grant,
                keeper_live=view.keeper_publishing(now),
                status=sd_notify.status_line(status.status, status.reason),
            )
        notifier.send(*said)

    def _sweep_leases(self) -> None:
        if self._segments is None or time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + self.settings.lease_sweep_interval_s
        try:
            reclaimed = self._segments.leases.sweep(now_ms())
            # Site entries idle for a minute (no setting, block, live permit or memory).
            self._segments.sites.sweep(now_ms())
        except Exception as exc:
            logs.event(log, "lease_sweep_failed", logging.ERROR, error=str(exc))
            return
        self.lease_sweeps += 1
        self.lease_slots_reclaimed += reclaimed
        self._publish()

    def _take_census(self) -> None:
        """Every CENSUS_INTERVAL_S: the lease table's census and a SQLite store's WAL."""
        if self._segments is None or time.monotonic() < self._next_census:
            return
        self._next_census = time.monotonic() + CENSUS_INTERVAL_S
        if self._sqlite_path is not None:
            try:
                self._wal = read_wal_state(self._sqlite_path)
                self._wal_unreadable = False
            except OSError as exc:  # unreadable (permissions, I/O): said once, serving goes on
                self._wal = None
                if not self._wal_unreadable:
                    logs.event(log, "wal_read_failed", logging.WARNING, error=str(exc))
                self._wal_unreadable = True
        try:
            self._census = self._segments.leases.census(now_ms())
        except Exception as exc:
            logs.event(log, "lease_census_failed", logging.ERROR, error=str(exc))
            return
        self._count_in_flight_by_site()
        self._publish()

    def _count_in_flight_by_site(self) -> None:
        """With the census: every live lease by its site, into the hour's history, which
        goes into its buffer for the workers to serve (api.site_history)."""
        segments = self._segments
        if segments is None:
            return
        if self._in_flight is None:
            self._in_flight = site_history.InFlightHistory(self.node)
        history = self._in_flight
        try:
            now = now_ms()
            history.record(now, *segments.leases.live_by_site(now))
            history.name(now, lambda: self._listed_site_names(segments))
            segments.site_history.write(site_history.encode(history.snapshot(now)), now)
        except Exception as exc:
            logs.event(log, "site_history_failed", logging.ERROR, error=str(exc))

    @staticmethod
    def _listed_site_names(segments: Segments) -> dict[int, str]:
        """Site hash to name from the keeper's sites listing; none while it has none."""
        snapshot = segments.site_list.read()
        if snapshot is None:
            return {}
        try:
            listing = decode_site_list(snapshot.payload)
        except msgspec.DecodeError:
            return {}
        return {h: row.site for h, row in zip(listing.site_hashes, listing.sites.top, strict=False)}

    def _select_timeout(self) -> float:
        now = time.monotonic()
        timeout = max(0.0, min(1.0, self._next_sweep - now, self._next_census - now))
        ping_in = self._notices.wait_s(now) if self._notifier is not None else None
        if ping_in is not None:
            timeout = min(timeout, ping_in)
        if self.state != "stopping":
            for slot in self.slots:
                if slot.process is None and slot.next_start_at is not None:
                    timeout = min(timeout, max(0.0, slot.next_start_at - now))
        elif self._stop_deadline is not None:
            timeout = min(timeout, max(0.0, self._stop_deadline - now))
        return timeout

    def _wake(self) -> None:
        """From another thread: make the loop look at its state now."""
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def _handle_signals(self) -> None:
        if (
            self._membership is not None
            and self._membership.superseded
            and self.state != "stopping"
        ):
            # Another incarnation holds this node's name: every key this one would grant
            # may be that one's. Stop at once; its leases are not this process's to leave.
            logs.event(log, "superseded", logging.ERROR, node=self.node)
            self.exit_code = 3
            self._signals.append(signal.SIGINT)
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGCHLD:
                continue  # reaped by the loop
            if signum == signal.SIGHUP:
                logs.event(log, "signal_ignored", signal="SIGHUP")
                continue
            name = signal.Signals(signum).name
            if self.state == "stopping":
                logs.event(log, "stop_forced", signal=name)
                self._kill_all(f"second {name}")
                if signum == signal.SIGINT:
                    self._snapshot_on_exit = False
                continue
            graceful = signum == signal.SIGTERM
            self._snapshot_on_exit = graceful
            self.state = "stopping"
            self._stopping_reason = f"{name}, {'graceful' if graceful else 'quick'}"
            timeout = self.settings.graceful_timeout_s + 5.0 if graceful else QUICK_STOP_S
            self._stop_deadline = time.monotonic() + timeout
            logs.event(log, "stopping", signal=name, mode="graceful" if graceful else "quick")
            for slot in self.slots:
                slot.next_start_at = None
                if slot.process is not None:
                    with contextlib.suppress(ProcessLookupError):
                        slot.process.send_signal(signum)
            self._publish()

    def _kill_all(self, reason: str) -> None:
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                logs.event(
                    log, "worker_killed", worker=slot.index, worker_pid=slot.pid, reason=reason
                )
                with contextlib.suppress(ProcessLookupError):
                    slot.process.kill()

    # --- workers -----------------------------------------------------------------------

    def _start_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            due = slot.next_start_at
            if slot.process is None and due is not None and due <= now:
                self._spawn(slot)

    def _spawn(self, slot: WorkerSlot) -> None:
        assert self._segments is not None and self._listeners is not None
        try:
            listeners = self._listeners.of(slot.index)
        except ListenFailed as exc:
            self._boot_failed(slot, f"listen failed: {exc.reason}")
            return
        status_r, status_w = os.pipe()
        spec = WorkerSpec(
            index=slot.index,
            listen_fds=[sock.fileno() for sock in listeners],
            status_fd=status_w,
            supervisor_pid=os.getpid(),
            node=self.node,
            instance=self.instance,
            segments=self._segments.names,
            settings=self.settings,
            hash_secret=self._hash_secret,
            incarnation=self._incarnation,
            predecessor_until_ms=self._predecessor_until_ms,
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "workers.worker"],
                # systemd's notify socket is the supervisor's to speak on, not a worker's.
                env={k: v for k, v in os.environ.items() if k not in sd_notify.ENVIRONMENT},
                stdin=subprocess.PIPE,
                pass_fds=(*[sock.fileno() for sock in listeners], status_w),
                close_fds=True,
            )
        except OSError as exc:
            os.close(status_r)
            os.close(status_w)
            self._boot_failed(slot, f"spawn failed: {exc}")
            return
        finally:
            with contextlib.suppress(OSError):
                os.close(status_w)
        assert process.stdin is not None
        try:
            process.stdin.write(msgspec.json.encode(spec))
            process.stdin.close()
        except BrokenPipeError:
            pass  # the worker died at once; the reaper sees it
        os.set_blocking(status_r, False)
        slot.process = process
        slot.status_fd = status_r
        slot.status_buffer = b""
        slot.ready = False
        slot.report = None
        slot.started_at = time.monotonic()
        slot.started_at_ms = now_ms()
        slot.next_start_at = None
        self._selector.register(status_r, selectors.EVENT_READ, slot)
        logs.event(log, "worker_started", worker=slot.index, worker_pid=process.pid)
        self._publish()

    def _read_status(self, slot: WorkerSlot) -> None:
        if slot.status_fd is None:
            return
        try:
            data = os.read(slot.status_fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self._close_status(slot)
            return
        slot.status_buffer += data
        *lines, slot.status_buffer = slot.status_buffer.split(b"\n")
        if len(slot.status_buffer) > MAX_STATUS_LINE_BYTES:
            slot.status_buffer = b""  # not a line this protocol writes: dropped, not kept
            slot.bad_reports += 1
        for line in lines:
            if line.startswith(REPORT_PREFIX):
                report = decode_report_line(line)
                if report is None:
                    slot.bad_reports += 1
                else:
                    slot.report = report
                continue
            if line.strip() == b"ready" and not slot.ready:
                slot.ready = True
                self._any_ready = True
                logs.event(
                    log,
                    "worker_ready",
                    worker=slot.index,
                    worker_pid=slot.pid,
                    boot_ms=int((time.monotonic() - slot.started_at) * 1000),
                )
                if not self._all_ready_logged and all(s.ready for s in self.slots):
                    self._all_ready_logged = True
                    logs.event(log, "node_ready", port=self.port, workers=len(self.slots))
                    if self.on_ready is not None:
                        self.on_ready()
                self._publish()

    def _close_status(self, slot: WorkerSlot) -> None:
        if slot.status_fd is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(slot.status_fd)
            with contextlib.suppress(OSError):
                os.close(slot.status_fd)
            slot.status_fd = None

    def _reap(self) -> None:
        for slot in self.slots:
            process = slot.process
            if process is None or process.poll() is None:
                continue
            # Drain a ready line written just before the exit, then forget the pipe.
            self._read_status(slot)
            self._close_status(slot)
            slot.process = None
            exit_text = describe_exit(process.returncode)
            slot.last_exit = exit_text
            uptime = time.monotonic() - slot.started_at
            if self.state == "stopping":
                logs.event(
                    log, "worker_exited", worker=slot.index, worker_pid=process.pid, exit=exit_text
                )
                continue
            if not slot.ready or uptime < BOOT_GRACE_S:
                self._boot_failed(slot, exit_text, pid=process.pid)
            else:
                slot.boot_failures = 0
                slot.restarts += 1
                slot.next_start_at = time.monotonic()
                logs.event(
                    log,
                    "worker_died",
                    logging.WARNING,
                    worker=slot.index,
                    worker_pid=process.pid,
                    exit=exit_text,
                    uptime_s=round(uptime, 1),
                    respawn_in_s=0,
                )
            slot.ready = False
            self._publish()

    def _boot_failed(self, slot: WorkerSlot, reason: str, pid: int | None = None) -> None:
        slot.boot_failures += 1
        slot.total_boot_failures += 1
        slot.restarts += 1
        delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (slot.boot_failures - 1))
        if not self._any_ready and slot.boot_failures >= GIVE_UP_AFTER_BOOT_FAILURES:
            logs.event(
                log,
                "boot_failed",
                logging.ERROR,
                worker=slot.index,
                exit=reason,
                attempts=slot.boot_failures,
                detail="no worker ever came up; giving up",
            )
            self.state = "stopping"
            self._stopping_reason = f"worker {slot.index} failed to boot; giving up"
            self.exit_code = 1
            self._stop_deadline = time.monotonic() + QUICK_STOP_S
            for other in self.slots:
                other.next_start_at = None
                if other.process is not None:
                    with contextlib.suppress(ProcessLookupError):
                        other.process.send_signal(signal.SIGINT)
            return
        slot.next_start_at = time.monotonic() + delay
        if self._listeners is not None and self._listeners.has_own(slot.index) and delay >= 1.0:
            # Connections the kernel hashes to these listeners would wait out the backoff;
            # closed, their share goes to the workers that serve.
            self._listeners.close_for(slot.index)
        logs.event(
            log,
            "worker_boot_failed",
            logging.WARNING,
            worker=slot.index,
            worker_pid=pid,
            exit=reason,
            attempt=slot.boot_failures,
            respawn_in_s=delay,
        )

    # --- statistics --------------------------------------------------------------------

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(
            pid=os.getpid(),
            node=self.node,
            instance=self.instance,
            host=self.settings.host,
            port=self.port,
            state=self.state,
            started_at=self.started_at_ms,
            written_at=now_ms(),
            restarts=sum(slot.restarts for slot in self.slots),
            boot_failures=sum(slot.total_boot_failures for slot in self.slots),
            lease_sweeps=self.lease_sweeps,
            lease_slots_reclaimed=self.lease_slots_reclaimed,
            lease_census=self._census,
            lease_recovery=self._carryover.recovery if self._carryover else None,
            membership=None if self._membership is None else self._membership.statistics(),
            wal=self._wal,
            workers=[
                WorkerStatistics(
                    index=slot.index,
                    state=slot.state,
                    pid=slot.pid,
                    started_at=slot.started_at_ms,
                    restarts=slot.restarts,
                    boot_failures=slot.total_boot_failures,
                    last_exit=slot.last_exit,
                    report=slot.report,
                    bad_reports=slot.bad_reports,
                )
                for slot in self.slots
            ],
        )

    def _publish(self) -> None:
        if self._segments is not None:
            self._segments.supervisor.write(msgspec.msgpack.encode(self.statistics()), now_ms())
