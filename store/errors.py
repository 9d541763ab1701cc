"""What the store raises beyond ValueError and the feed's cursor errors in `store.base`."""

from __future__ import annotations


class StoreError(Exception):
    """A failure of the durable store that a caller may act on."""


class SchemaTooNew(StoreError):
    """The database was written by a newer schema than this build knows: refuse, never guess."""


class StoreBusy(StoreError):
    """Other writers held the database past the store's bounded retry; nothing was written."""
