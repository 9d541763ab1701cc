"""The node's listening sockets: its port bound once, then one set of listeners per worker.

A plain bind first proves the port is free (and picks one for port 0): a socket with
SO_REUSEPORT would share a port with another node's instead of failing. Then, with
`reuse_port`, each worker gets listeners of its own on that port and the kernel spreads
new connections evenly over all the listeners. On one shared socket the workers race to
accept, and one often takes nearly all of a few long-lived fleet connections; when that
one is worker 0, the keeper and every claim share one GIL. Worker 0 gets one listener
and every other worker `per_worker`, so worker 0 is handed a smaller share of the
connections (a third, with two workers).
"""

from __future__ import annotations

import socket

BACKLOG = 2048


class ListenFailed(Exception):
    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address
        self.reason = reason


def listen(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A listening TCP socket a spawned worker can inherit."""
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    # proto must be IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only
    # when the listener says TCP, and without it Nagle and delayed ACKs add about 40 ms
    # to every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((bare, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenFailed(f"{host}:{port}", str(exc)) from exc
    sock.set_inheritable(True)
    return sock


class Listeners:
    """The port, and each worker's listeners on it (or the one shared socket)."""

    def __init__(self, host: str, port: int, *, workers: int, per_worker: int, reuse_port: bool):
        self.host = host
        self.workers = workers
        self.per_worker = per_worker
        self._by_worker: dict[int, list[socket.socket]] = {}
        probe = listen(host, port, reuse_port=False)
        self.port = int(probe.getsockname()[1])
        self._shared: socket.socket | None = None
        if not reuse_port:
            self._shared = probe
            return
        probe.close()
        for index in range(workers):
            self.of(index)

    def count_for(self, index: int) -> int:
        return 1 if index == 0 and self.workers > 1 else self.per_worker

    def of(self, index: int) -> list[socket.socket]:
        """Worker `index`'s listeners, opened again if `close_for` closed them."""
        if self._shared is not None:
            return [self._shared]
        socks = self._by_worker.setdefault(index, [])
        while len(socks) < self.count_for(index):
            socks.append(listen(self.host, self.port, reuse_port=True))
        return socks

    def has_own(self, index: int) -> bool:
        return bool(self._by_worker.get(index))

    def close_for(self, index: int) -> None:
        for sock in self._by_worker.pop(index, []):
            sock.close()

    def close(self) -> None:
        for index in list(self._by_worker):
            self.close_for(index)
        if self._shared is not None:
            self._shared.close()
            self._shared = None
