"""Offset storage: the interface, its SQLite and PostgreSQL backends, migrations.

`open_offset_store(url)` picks the backend from an ``--offsets`` URL; see
`storage.offsets.base` for the row model and the monotonic guard.
"""

from zbroker.storage.offsets.base import (
    InvalidOffsetsUrl,
    OffsetRow,
    OffsetStore,
    OffsetStoreError,
    fold,
    open_offset_store,
    winner,
)

__all__ = [
    "InvalidOffsetsUrl",
    "OffsetRow",
    "OffsetStore",
    "OffsetStoreError",
    "fold",
    "open_offset_store",
    "winner",
]
