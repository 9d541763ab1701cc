"""systemd's notify protocol (sd_notify(3)), spoken by the supervisor under `Type=notify`.

The protocol is one datagram per message on the AF_UNIX socket `NOTIFY_SOCKET` names (a
path, or `@name` in the abstract namespace), each a few `KEY=value` lines. The supervisor
says:

- `READY=1` once the node can grant a claim (the judgement /readyz makes);
- `STATUS=` the claim status and its reason (`systemctl status`), at once when the status
  changes, and its reason's newer figures every few seconds;
- `WATCHDOG=1` every half `WATCHDOG_USEC` while the keeper is live (publishing within its
  stall limit), so a keeper that stalls stops the pings and systemd acts (WatchdogSec=);
- `STOPPING=1` when a stop begins.

`Notices` decides what to say and when, from what the supervisor reads (pure, no I/O);
`Notifier` sends it. Without `NOTIFY_SOCKET` there is no notifier and nothing is sent.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

# A STATUS= text longer than this is cut: systemd shows one line, and a datagram stays small.
MAX_STATUS_CHARS = 400
# A status whose kind (before the colon) is unchanged is said again at most this often: its
# reason carries ages that change at every look.
STATUS_REFRESH_S = 5.0
# While a ping is overdue, the keeper is looked at this many times a ping interval.
OVERDUE_LOOKS = 10


def socket_address(value: str) -> str | bytes | None:
    """The address `NOTIFY_SOCKET` names: a filesystem path, or `@name` for the abstract
    namespace (a leading NUL byte). None for anything else (systemd also knows vsock
    addresses, which a node has no use for)."""
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def watchdog_interval_s(environ: Mapping[str, str], pid: int) -> float | None:
    """Half of `WATCHDOG_USEC` (as sd_watchdog_enabled(3) advises), in seconds; None when
    it is absent or malformed, or `WATCHDOG_PID` names another process."""
    owner = environ.get("WATCHDOG_PID")
    if owner and owner.strip() != str(pid):
        return None
    raw = environ.get("WATCHDOG_USEC", "").strip()
    if not raw.isdigit() or int(raw) == 0:
        return None
    return int(raw) / 2 / 1_000_000


def encode(*assignments: str) -> bytes:
    """One datagram: each `KEY=value` on a line of its own (a value's own line breaks
    would start a new assignment, so they become spaces)."""
    lines = [" ".join(line.splitlines()) for line in assignments]
    return "\n".join(lines).encode() + b"\n"


def status_line(status: str, reason: str) -> str:
    text = f"{status}: {reason}"
    return text if len(text) <= MAX_STATUS_CHARS else text[: MAX_STATUS_CHARS - 3] + "..."


@dataclass
class Notices:
    """What to tell systemd at each look, from the node's state at that moment."""

    watchdog_s: float | None = None
    ready_sent: bool = False
    stopping_sent: bool = False
    last_status: str | None = None
    last_status_at: float = 0.0  # monotonic
    next_ping_at: float = 0.0  # monotonic

    def due(
        self,
        now: float,
        *,
        can_grant: bool,
        keeper_live: bool,
        status: str,
        stopping: bool = False,
    ) -> list[str]:
        """The assignments to send now (empty: nothing). `now` is monotonic seconds."""
        said: list[str] = []
        if stopping and not self.stopping_sent:
            self.stopping_sent = True
            said.append("STOPPING=1")
        if self._status_due(now, status):
            self.last_status, self.last_status_at = status, now
            said.append(f"STATUS={status}")
        if stopping:
            return said
        if can_grant and not self.ready_sent:
            self.ready_sent = True
            said.append("READY=1")
        if self.watchdog_s is not None and keeper_live and now >= self.next_ping_at:
            self.next_ping_at = now + self.watchdog_s
            said.append("WATCHDOG=1")
        return said

    def _status_due(self, now: float, status: str) -> bool:
        last = self.last_status
        if last is None or last.partition(":")[0] != status.partition(":")[0]:
            return True
        return status != last and now - self.last_status_at >= STATUS_REFRESH_S

    def wait_s(self, now: float) -> float | None:
        """How long until the next look for a ping (None: no watchdog, or stopping). Once a
        ping is overdue (the keeper was not live at the last look), the next look is a
        fraction of the interval on: a resumed keeper's ping is that late at most, and the
        supervisor's loop does not spin while its keeper is silent."""
        if self.watchdog_s is None or self.stopping_sent:
            return None
        due_in = self.next_ping_at - now
        return due_in if due_in > 0 else self.watchdog_s / OVERDUE_LOOKS


class Notifier:
    """Sends to `NOTIFY_SOCKET`. A send that fails is dropped: systemd gone or the socket
    full must never stop the node (the watchdog, if set, tells systemd the rest)."""

    def __init__(self, address: str | bytes) -> None:
        self.address = address
        self.sent = 0
        self.failed = 0
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._socket.setblocking(False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier | None:
        value = (os.environ if environ is None else environ).get("NOTIFY_SOCKET", "")
        address = socket_address(value)
        return None if address is None else cls(address)

    def send(self, *assignments: str) -> bool:
        if not assignments:
            return True
        try:
            self._socket.sendto(encode(*assignments), self.address)
        except OSError:
            self.failed += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.close()


# The variables systemd sets for the main process only: a worker must not inherit them.
ENVIRONMENT = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
