"""workers/listeners.py: the port bound once, per-worker listeners on it, and a taken port."""

from __future__ import annotations

import socket

import pytest

from workers.listeners import Listeners, ListenFailed, listen


def test_port_0_picks_a_free_port_and_each_worker_gets_its_listeners() -> None:
    listeners = Listeners("127.0.0.1", 0, workers=3, per_worker=2, reuse_port=True)
    try:
        assert listeners.port > 0
        counts = [len(listeners.of(i)) for i in range(3)]
        assert counts == [1, 2, 2], "worker 0 (the keeper's) takes a smaller share"
        ports = {sock.getsockname()[1] for i in range(3) for sock in listeners.of(i)}
        assert ports == {listeners.port}
        assert all(sock.get_inheritable() for sock in listeners.of(1))
        # A connection is accepted by one of them.
        with socket.create_connection(("127.0.0.1", listeners.port), timeout=2):
            pass
    finally:
        listeners.close()


def test_closed_listeners_of_a_worker_are_opened_again_when_it_respawns() -> None:
    listeners = Listeners("127.0.0.1", 0, workers=2, per_worker=2, reuse_port=True)
    try:
        first = listeners.of(1)
        listeners.close_for(1)
        assert not listeners.has_own(1) and all(sock.fileno() == -1 for sock in first)
        again = listeners.of(1)
        assert len(again) == 2 and listeners.has_own(1)
    finally:
        listeners.close()


def test_without_reuse_port_every_worker_shares_the_one_socket() -> None:
    listeners = Listeners("127.0.0.1", 0, workers=2, per_worker=2, reuse_port=False)
    try:
        assert listeners.of(0) == listeners.of(1) and len(listeners.of(0)) == 1
        assert not listeners.has_own(0)
    finally:
        listeners.close()


def test_a_port_another_process_holds_fails_naming_the_address() -> None:
    held = listen("127.0.0.1", 0, reuse_port=False)
    try:
        port = held.getsockname()[1]
        # The plain bind comes first, so SO_REUSEPORT can never share another node's port.
        with pytest.raises(ListenFailed) as failed:
            Listeners("127.0.0.1", port, workers=2, per_worker=2, reuse_port=True)
        assert failed.value.address == f"127.0.0.1:{port}"
        assert "in use" in failed.value.reason
    finally:
        held.close()
