"""What the store raises beyond ValueError and the feed's cursor errors in `store.base`."""

from __future__ import annotations


class StoreError(Exception):
    """A failure of the durable store that a caller may act on."""


class SchemaTooNew(StoreError):
    """The database was written by a newer schema than this build knows: refuse, never guess."""


def refuse_newer(version: int, latest: int, where: str) -> None:
    """Raise SchemaTooNew for a database a newer renderqueue wrote."""
    if version > latest:
        raise SchemaTooNew(
            f"{where} was written by renderqueue schema version {version}; this build knows "
            f"versions up to {latest}. Run a renderqueue at least as new as the one that wrote "
            "it (a downgrade would lose or misread data)."
        )


class StoreBusy(StoreError):
    """Other writers held the database past the store's bounded retry; nothing was written."""


class StoreFull(StoreError):
    """The store could not write: its disk is full, or failing (an I/O error). Nothing was
    written by the call that raised it; writes succeed again once the disk has room."""


class StoreUnavailable(StoreError):
    """The store could not be reached (a lost connection, a server restarting); nothing was
    written by the call that raised it, and a later call may succeed."""
