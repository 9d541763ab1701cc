"""Wake-up semaphores: a post per pending commit at most, and nothing posted once dropped."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import posix_ipc
import pytest

from store.sqlite.wake import WakePoster, WakeWaiter, new_wake_name, unlink, wake_prefix


@pytest.fixture
def name() -> Iterator[str]:
    made = new_wake_name(f"/rq-test-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    yield made
    unlink(made)


def test_posts_do_not_pile_up_while_one_is_pending(name: str) -> None:
    waiter = WakeWaiter(name)
    poster = WakePoster()
    poster.refresh([name])
    for _ in range(5):
        poster.post()
    stats = poster.statistics()
    assert (stats.targets, stats.posts, stats.skipped) == (1, 1, 4)
    assert waiter.wait(0.0) is True
    assert waiter.wait(0.0) is False  # one pending post covered all five commits
    poster.post()
    waiter.clear()
    assert waiter.wait(0.0) is False
    waiter.close()
    poster.close()


def test_a_refresh_stops_posting_dropped_names(name: str) -> None:
    waiter = WakeWaiter(name)
    poster = WakePoster()
    poster.refresh([name, "/rq-test-never-created"])
    assert poster.statistics().targets == 1 and poster.statistics().errors == 1
    poster.refresh([])
    poster.post()
    assert waiter.wait(0.0) is False
    assert poster.statistics().targets == 0
    waiter.close()
    poster.close()


def test_a_waiter_times_out(name: str) -> None:
    waiter = WakeWaiter(name)
    assert waiter.wait(0.01) is False
    waiter.close()


def test_prefixes() -> None:
    assert wake_prefix("/tmp/a.db", None) == wake_prefix("/tmp/./a.db", None)
    assert wake_prefix("/tmp/a.db", None) != wake_prefix("/tmp/b.db", None)
    assert wake_prefix("/tmp/a.db", "node-1") == "/node-1"
    with pytest.raises(ValueError, match="wake_name"):
        wake_prefix("/tmp/a.db", "bad name/x")
    assert new_wake_name("/p") != new_wake_name("/p")


def test_unlink_of_a_missing_name_is_quiet() -> None:
    unlink("/rq-test-missing-" + uuid.uuid4().hex)
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.Semaphore("/rq-test-missing-" + uuid.uuid4().hex)
