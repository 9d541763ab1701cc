"""What the supervisor tells a worker it spawns (sent as JSON on the worker's stdin, so the
tokens in the settings and the hash secret never show in a process listing)."""

from __future__ import annotations

import msgspec

from workers.config import Settings
from workers.segments import SegmentNames


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    listen_fds: list[int]  # the supervisor's listening sockets for this worker, inherited
    status_fd: int  # write end of a pipe: the worker writes "ready\n" once it serves
    supervisor_pid: int
    node: str
    instance: str
    segments: SegmentNames
    settings: Settings
    # The store's key-hash secret, read once by the supervisor, so every process of the
    # node hashes under the one its lease snapshot was checked against.
    hash_secret: bytes
    # In a cluster: this start's incarnation (store.postgres.membership), and until when
    # the previous run's leases may live when its lease table was not taken over.
    incarnation: int = 0
    predecessor_until_ms: int = 0
