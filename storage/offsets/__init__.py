"""Offset storage: the interface, its SQLite and PostgreSQL backends, migrations.

`open_offset_store(url)` (in `storage.offsets.urls`) picks the backend from an
``--offsets`` URL; see `storage.offsets.base` for the row model and the
monotonic guard.
"""

from zbroker.storage.offsets.base import OffsetRow, OffsetStore, OffsetStoreError, fold, winner
from zbroker.storage.offsets.urls import InvalidOffsetsUrl, open_offset_store

__all__ = [
    "InvalidOffsetsUrl",
    "OffsetRow",
    "OffsetStore",
    "OffsetStoreError",
    "fold",
    "open_offset_store",
    "winner",
]
