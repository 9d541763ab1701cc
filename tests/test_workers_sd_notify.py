"""systemd's notify protocol: the pure pieces, the datagrams, and a real node under a
listening NOTIFY_SOCKET (ready, status, watchdog pings that stop with its keeper, stopping)."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from node_harness import NodeProcess, node_db, seed_rows, wait_for

from workers import sd_notify


def test_the_socket_address_is_a_path_or_abstract() -> None:
    assert sd_notify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sd_notify.socket_address("@rq/notify") == b"\0rq/notify"
    for unusable in ("", "@", "vsock:2:1234", "relative/path"):
        assert sd_notify.socket_address(unusable) is None


def test_the_watchdog_interval_is_half_of_watchdog_usec_for_this_process() -> None:
    assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "2000000"}, 7) == 1.0
    assert (
        sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "7"}, 7) == 1.5
    )
    assert (
        sd_notify.watchdog_interval_s({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "8"}, 7) is None
    )
    for bad in ("", "0", "-5", "1.5", "ten"):
        assert sd_notify.watchdog_interval_s({"WATCHDOG_USEC": bad}, 7) is None
    assert sd_notify.watchdog_interval_s({}, 7) is None


def test_a_datagram_is_one_assignment_a_line() -> None:
    assert sd_notify.encode("READY=1", "STATUS=ready: fine") == b"READY=1\nSTATUS=ready: fine\n"
    assert sd_notify.encode("STATUS=a\nWATCHDOG=1") == b"STATUS=a WATCHDOG=1\n"
    long = sd_notify.status_line("stalled", "x" * 1000)
    assert len(long) == sd_notify.MAX_STATUS_CHARS and long.endswith("...")


def test_the_notices_follow_the_node() -> None:
    notices = sd_notify.Notices(watchdog_s=0.5)
    look = notices.due
    assert look(0.0, can_grant=False, keeper_live=False, status="unready: x") == [
        "STATUS=unready: x"
    ]
    assert look(0.1, can_grant=False, keeper_live=False, status="unready: x") == []
    assert look(0.2, can_grant=True, keeper_live=True, status="ready: y") == [
        "STATUS=ready: y",
        "READY=1",
        "WATCHDOG=1",
    ]
    assert notices.wait_s(0.3) == pytest.approx(0.4)
    assert look(0.3, can_grant=True, keeper_live=True, status="ready: y") == []
    assert look(0.7, can_grant=True, keeper_live=True, status="ready: y") == ["WATCHDOG=1"]
    # A keeper that is not live gets no ping, however long; READY=1 is said once.
    # The same status with newer figures is said again, but not at every look.
    assert look(1.6, can_grant=True, keeper_live=False, status="draining: z 2.1 s") == [
        "STATUS=draining: z 2.1 s"
    ]
    assert look(1.7, can_grant=True, keeper_live=False, status="draining: z 2.2 s") == []
    # An overdue ping is looked for again a fraction of the interval on, not at once.
    assert notices.wait_s(1.7) == pytest.approx(0.5 / sd_notify.OVERDUE_LOOKS)
    later = 1.6 + sd_notify.STATUS_REFRESH_S
    assert look(later, can_grant=True, keeper_live=False, status="draining: z 7 s") == [
        "STATUS=draining: z 7 s"
    ]
    assert look(9.0, can_grant=False, keeper_live=False, status="stalled: z") == [
        "STATUS=stalled: z"
    ]
    assert look(9.1, can_grant=True, keeper_live=True, status="ready: y") == [
        "STATUS=ready: y",
        "WATCHDOG=1",
    ]
    stop = look(9.2, can_grant=False, keeper_live=False, status="stopping: SIGTERM", stopping=True)
    assert stop == ["STOPPING=1", "STATUS=stopping: SIGTERM"]
    assert (
        look(20.0, can_grant=True, keeper_live=True, status="stopping: SIGTERM", stopping=True)
        == []
    )
    assert notices.wait_s(20.0) is None


def test_no_watchdog_no_pings() -> None:
    notices = sd_notify.Notices()
    assert notices.due(0, can_grant=True, keeper_live=True, status="ready: y") == [
        "STATUS=ready: y",
        "READY=1",
    ]
    assert notices.wait_s(0) is None


class Listener:
    """A datagram socket standing in for systemd's: every message with when it came."""

    def __init__(self, address: str | bytes) -> None:
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(address)
        self.socket.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._stop:
            try:
                data = self.socket.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append((time.monotonic(), data.decode()))

    def assignments(self) -> list[tuple[float, str]]:
        with self._lock:
            return [(at, line) for at, text in self.messages for line in text.splitlines()]

    def said(self, line: str) -> list[float]:
        return [at for at, said in self.assignments() if said == line]

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.socket.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    heard = Listener(b"\0rq-notify-" + uuid.uuid4().hex.encode())
    yield heard
    heard.close()


def test_the_notifier_sends_to_an_abstract_and_a_path_socket(listener: Listener) -> None:
    address = listener.socket.getsockname()
    notifier = sd_notify.Notifier.from_environ({"NOTIFY_SOCKET": "@" + address[1:].decode()})
    assert notifier is not None and notifier.send("READY=1", "STATUS=ok")
    wait_for(lambda: listener.said("STATUS=ok"), 10, "the datagram", 0.02)
    notifier.close()
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:  # short: sun_path is 108 bytes
        path = os.path.join(directory, "notify")
        by_path = Listener(path)
        try:
            notifier = sd_notify.Notifier.from_environ({"NOTIFY_SOCKET": path})
            assert notifier is not None and notifier.send("WATCHDOG=1")
            wait_for(lambda: by_path.said("WATCHDOG=1"), 10, "the datagram", 0.02)
        finally:
            by_path.close()
    assert sd_notify.Notifier.from_environ({}) is None
    gone = sd_notify.Notifier("/nonexistent/notify")
    assert gone.send("READY=1") is False and gone.failed == 1  # dropped, never raised


WATCHDOG_USEC = 1_000_000  # pings every 0.5 s
PING_S = WATCHDOG_USEC / 2 / 1e6


def test_a_node_tells_systemd_ready_status_watchdog_and_stopping(
    tmp_path: Path, listener: Listener
) -> None:
    seed_rows(node_db(tmp_path), 50, due_share=0.5)
    name = listener.socket.getsockname()
    env = {"NOTIFY_SOCKET": "@" + name[1:].decode(), "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    node = NodeProcess(tmp_path, workers=2, env=env)
    keeper_pid: int | None = None
    try:
        node.start()
        assert node.process is not None
        wait_for(lambda: listener.said("READY=1"), 60, "READY=1", 0.05)
        ready_at = listener.said("READY=1")[0]
        statuses = [line for at, line in listener.assignments() if line.startswith("STATUS=")]
        assert any(s.startswith("STATUS=ready") for s in statuses), statuses
        wait_for(
            lambda: len([t for t in listener.said("WATCHDOG=1") if t >= ready_at]) >= 3,
            60,
            "watchdog pings after READY=1",
            0.05,
        )
        # Only the supervisor may speak on the socket: its workers do not inherit it.
        keeper_pid = node.worker_pid(0)
        for index in (0, 1):
            environ = Path(f"/proc/{node.worker_pid(index)}/environ").read_bytes().split(b"\0")
            assert not [v for v in environ if v.startswith((b"NOTIFY_SOCKET=", b"WATCHDOG_"))]

        os.kill(keeper_pid, signal.SIGSTOP)
        stopped_at = time.monotonic()

        def pings_stopped() -> bool:
            last = max(listener.said("WATCHDOG=1"))
            return time.monotonic() - last > 6 * PING_S

        wait_for(pings_stopped, 60, "the watchdog pings to stop with the keeper", 0.05)
        silent_from = max(listener.said("WATCHDOG=1"))
        judged_at = [
            at
            for at, line in listener.assignments()
            if at > stopped_at and line.startswith(("STATUS=draining", "STATUS=stalled"))
        ]
        assert judged_at
        assert silent_from <= judged_at[0]  # pings ended once the keeper was judged stalled

        os.kill(keeper_pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        wait_for(
            lambda: [t for t in listener.said("WATCHDOG=1") if t > resumed_at],
            60,
            "the pings to resume with the keeper",
            0.05,
        )
        keeper_pid = None
        node.signal(signal.SIGTERM)
        wait_for(lambda: listener.said("STOPPING=1"), 60, "STOPPING=1", 0.05)
        assert node.wait(60) == 0
        stopping_at = listener.said("STOPPING=1")[0]
        assert not [t for t in listener.said("WATCHDOG=1") if t > stopping_at]
        assert len(listener.said("READY=1")) == 1
    finally:
        if keeper_pid is not None:
            os.kill(keeper_pid, signal.SIGCONT)
        node.stop()
