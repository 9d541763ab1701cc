"""How long a SQLite store's WAL is, read from outside any connection.

SQLite keeps a header for its WAL in the wal-index (the `-shm` file beside the
database, https://sqlite.org/walformat.html): how many frames the log holds since it
last started over (`mxFrame`), and how many of them checkpoints have copied into the
database (`nBackfill`). Reading those takes no lock and no connection, so a process
that has none (the supervisor) can watch the log once a second: a log whose
uncheckpointed frames keep growing is one no checkpoint can finish (a reader holding an old
snapshot, a checkpointer starved), and on disk it grows with every write.

The file is another process's memory, so what is read is checked before it is
believed: SQLite writes the header twice and a reader trusts it only when both copies
agree (a writer may be between them); a header of another version, or one not yet
initialised, is not read at all.
"""

from __future__ import annotations

import os
import struct
import sys

import msgspec

WALINDEX_VERSION = 3_007_000
# One header copy: iVersion, unused, iChange, isInit, bigEndCksum, szPage, mxFrame, nPage,
# then checksums and salts up to 48 bytes.
_HEADER = struct.Struct("=IIIBBHII")
_HEADER_BYTES = 48
_BACKFILL_AT = 96  # WalCkptInfo.nBackfill, after the two header copies
_READ_BYTES = _BACKFILL_AT + 4
_ATTEMPTS = 3  # a header caught mid-write is read again; a writer rewrites it in microseconds


class WalState(msgspec.Struct, frozen=True, kw_only=True):
    page_size: int
    frames: int  # frames in the log since it last started over
    checkpointed: int  # of them, the frames checkpoints have copied into the database
    file_bytes: int  # the -wal file's length: it keeps its size when the log starts over

    @property
    def uncheckpointed(self) -> int:
        """Frames no checkpoint has copied yet: a crash replays them, and while any remain
        the log cannot start over."""
        return self.frames - self.checkpointed


def read_wal_state(db_path: str | os.PathLike[str]) -> WalState | None:
    """The WAL of the database at `db_path`, or None: no wal-index (never opened in WAL
    mode, or every connection closed and SQLite removed it) or none that reads true."""
    path = os.fspath(db_path)
    try:
        with open(f"{path}-shm", "rb", buffering=0) as shm:
            for _ in range(_ATTEMPTS):
                state = _parse(os.pread(shm.fileno(), _READ_BYTES, 0))
                if state is not None:
                    break
            else:
                return None
    except FileNotFoundError:
        return None
    try:
        file_bytes = os.stat(f"{path}-wal").st_size
    except FileNotFoundError:
        file_bytes = 0
    page_size, frames, checkpointed = state
    return WalState(
        page_size=page_size, frames=frames, checkpointed=checkpointed, file_bytes=file_bytes
    )


def _parse(data: bytes) -> tuple[int, int, int] | None:
    """(page size, frames, checkpointed frames) from the wal-index's first bytes, or None
    when they are short, of another version, uninitialised or caught mid-write."""
    if len(data) < _READ_BYTES:
        return None
    if data[:_HEADER_BYTES] != data[_HEADER_BYTES : 2 * _HEADER_BYTES]:
        return None
    version, _, _, initialised, _, size_field, frames, _ = _HEADER.unpack_from(data)
    if version != WALINDEX_VERSION or initialised != 1:
        return None
    # 65,536 does not fit the u16 field: SQLite stores it as 1.
    page_size = 65_536 if size_field == 1 else size_field
    if page_size < 512 or page_size & (page_size - 1):
        return None
    checkpointed = int.from_bytes(data[_BACKFILL_AT:_READ_BYTES], sys.byteorder)
    if checkpointed > frames:
        return None
    return page_size, frames, checkpointed
