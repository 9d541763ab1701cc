"""Worker 0's keeper thread: opens its own store, runs the keeper until asked to stop, and
restarts it (with backoff) if it ever raises, so a keeper bug degrades the node instead of
stopping it. A restarted keeper reloads from the table, as a respawned worker 0's does."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from workers import logs

log = logs.get_logger("keeper_host")
BACKOFF_CAP_S = 30.0


class KeeperHost:
    def __init__(self, run_once: Callable[[threading.Event], None]) -> None:
        self._run_once = run_once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keeper", daemon=True)
        self.crashes = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        delay = 0.5
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._run_once(self._stop)
            except Exception:
                self.crashes += 1
                if time.monotonic() - started > 60:
                    delay = 0.5
                logs.event(
                    log,
                    "keeper_crashed",
                    logging.ERROR,
                    crashes=self.crashes,
                    restart_in_s=delay,
                    exc_info=True,
                )
                self._stop.wait(delay)
                delay = min(BACKOFF_CAP_S, delay * 2)
            else:
                return
