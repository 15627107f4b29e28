"""Key -> partition mapping, stable across processes and languages.

``partition = crc32(key) % partitions`` where crc32 is the IEEE CRC-32 used by
zlib, gzip and PNG (Python ``zlib.crc32``, Node ``zlib.crc32``, Go
``hash/crc32.ChecksumIEEE``, Java ``java.util.zip.CRC32``), taken as an
unsigned 32-bit integer. Python's built-in ``hash()`` is salted per process and
so can never be used here.
"""

from __future__ import annotations

import zlib


def partition_for_key(key: bytes, partitions: int) -> int:
    if partitions <= 0:
        raise ValueError("partitions must be positive")
    return zlib.crc32(key) % partitions

