"""A TCP proxy on loopback that a test can take down and bring back: to its clients, what
a database server restarting looks like (every connection cut, new ones refused, then
accepted again), without restarting the server other tests share. Or blackhole: every
connection stays open and nothing is forwarded either way, with no reset, as when a
server or the network between vanishes.

A blackhole here is one at the application's level: the proxy's own kernel still
acknowledges what the client sends, and answers its keepalive probes, so the client's
TCP settings (keepalives, `tcp_user_timeout`) never fire; only a deadline of the
client's own does. A server behind a live host that stops answering looks the same."""

from __future__ import annotations

import contextlib
import select
import socket
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._running = False
        self._flowing = threading.Event()
        self._flowing.set()
        # Held from a pump's check of `_flowing` to the end of its read, so that once
        # `blackhole()` returns no pump forwards anything sent after it.
        self._gate = threading.Lock()

    def start(self) -> TcpProxy:
        """Listen (on the same port as before, after a stop) and forward."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._running = True
        self._flowing.set()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Cut every connection and refuse new ones until `start`."""
        self._running = False
        if self._listener is not None:
            # Wakes the accept() blocked in another thread: close() alone would leave the
            # socket listening until that call returned, one connection later.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def blackhole(self) -> None:
        """Forward nothing, either way, on every connection and on new ones (which the
        kernel still accepts), and close none of them, until `heal`."""
        with self._gate:
            self._flowing.clear()

    def heal(self) -> None:
        """Forward again: what was held back goes on, as a network that recovers delivers
        what it had been retransmitting."""
        self._flowing.set()

    def _accept(self, listener: socket.socket) -> None:
        while self._running:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                if not self._flowing.wait(0.2):
                    if a.fileno() < 0 or b.fileno() < 0:
                        return  # cut by stop() while blackholed
                    continue
                readable, _, _ = select.select([a, b], [], [], 0.2)
                for s in readable:
                    with self._gate:
                        if not self._flowing.is_set():
                            break
                        data = s.recv(65536)
                    if not data:
                        return
                    peers[s].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
