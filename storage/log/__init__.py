"""The durable partition log: segment files, sparse offset index, recovery, retention,
idempotent-producer state. `PartitionLog` is the whole public surface."""

from storage.log.config import LogConfig
from storage.log.partition_log import PartitionLog
from storage.log.recovery import RecoveryReport

__all__ = ["LogConfig", "PartitionLog", "RecoveryReport"]
