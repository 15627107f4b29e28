"""The zbroker Python client: sync (`Admin`, `Producer`, `Consumer`) and asyncio (`zbroker.client.aio`)."""

from zbroker.protocol.batch import Record
from zbroker.client.core import ConsumedRecord, DeliveryHandle, Deduper, record_id
from zbroker.client.sync import DEFAULT_URL, Admin, Connection, Consumer, ProduceError, Producer, fetch

__all__ = ["Admin", "Connection", "Consumer", "ConsumedRecord", "DEFAULT_URL", "Deduper", "DeliveryHandle",
           "ProduceError", "Producer", "Record", "fetch", "record_id"]
