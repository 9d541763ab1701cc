"""Worker 0's keeper thread: a keeper that raises is restarted, with backoff, until it
returns or the host is stopped."""

from __future__ import annotations

import threading

from workers.keeper_host import KeeperHost


def test_a_crashing_keeper_is_restarted_until_it_runs() -> None:
    runs: list[int] = []
    ran = threading.Event()

    def run_once(stop: threading.Event) -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError("keeper bug")
        ran.set()
        stop.wait()

    host = KeeperHost(run_once)
    host.start()
    assert ran.wait(10)
    assert host.crashes == 2 and runs == [0, 1, 2]
    assert host.stop(5)


def test_stop_interrupts_the_backoff() -> None:
    def run_once(stop: threading.Event) -> None:
        raise RuntimeError("always")

    host = KeeperHost(run_once)
    host.start()
    assert host.stop(5)
    assert host.crashes >= 1
