"""The durable partition log: segment files, sparse offset index, recovery, retention,
idempotent-producer state. `PartitionLog` is the whole public surface."""

from zbroker.storage.log.config import LogConfig
from zbroker.storage.log.partition_log import PartitionLog
from zbroker.storage.log.recovery import RecoveryReport

__all__ = ["LogConfig", "PartitionLog", "RecoveryReport"]
