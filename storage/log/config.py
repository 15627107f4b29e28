"""Per-partition log settings.

Theory of operation
-------------------
A `LogConfig` arrives as a plain map (topic configuration, travelling as
msgpack), so `from_dict` ignores keys it does not know (a newer coordinator
may send more) but rejects a known key with a bad value: a silently clamped
retention setting would delete data nobody asked to delete.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

# Index entries store file positions as u32, so a batch must start below 4 GiB.
MAX_SEGMENT_BYTES = 0xFFFFFFFF


class InvalidSetting(ValueError):
    """A known log setting with a bad value: which one, and what it was."""

    def __init__(self, field: str, got: Any, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.got = got


@dataclass(frozen=True)
class LogConfig:
    segment_bytes: int = 64 * 1024 * 1024      # roll when the active segment would exceed this
    index_interval_bytes: int = 4096            # one sparse index entry per this many bytes
    retention_bytes: int = -1                   # per partition; -1 = unlimited
    retention_ms: int = 7 * 24 * 3600 * 1000    # -1 = unlimited
    producer_window_segments: int = 2           # idempotence state is rebuilt from the last N segments

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            # bool is an int subclass; True as a segment size is a bug, not a setting.
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidSetting(field.name, repr(value)[:100],
                                     f"log config {field.name} must be an integer, got {repr(value)[:100]}")
        if not 1 <= self.segment_bytes <= MAX_SEGMENT_BYTES:
            raise InvalidSetting("segment_bytes", self.segment_bytes,
                                 f"segment_bytes must be in 1..{MAX_SEGMENT_BYTES}, got {self.segment_bytes}")
        if self.index_interval_bytes < 1:
            raise InvalidSetting("index_interval_bytes", self.index_interval_bytes,
                                 f"index_interval_bytes must be >= 1, got {self.index_interval_bytes}")
        if self.retention_bytes < -1:
            raise InvalidSetting("retention_bytes", self.retention_bytes,
                                 f"retention_bytes must be -1 (unlimited) or >= 0, got {self.retention_bytes}")
        if self.retention_ms < -1:
            raise InvalidSetting("retention_ms", self.retention_ms,
                                 f"retention_ms must be -1 (unlimited) or >= 0, got {self.retention_ms}")
        if self.producer_window_segments < 1:
            raise InvalidSetting("producer_window_segments", self.producer_window_segments,
                                 f"producer_window_segments must be >= 1, got {self.producer_window_segments}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "LogConfig":
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"log config must be a map, got {type(d).__name__}")
        known = {field.name for field in fields(cls)}
        return cls(**{key: value for key, value in d.items() if key in known})

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
