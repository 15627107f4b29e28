"""A fixed client workload for instruction counts: the sync driver's per-record paths, no broker.

`Producer.send` of ``--records`` 100-byte key-less records (batches of 1,000, closed by
size: the linger is an hour, so the count does not depend on how slow valgrind makes
the clock), each batch answered at once by a stand-in for the connection's sockets;
``produce_unbatched``: the same with ``batch_size=1, linger_ms=0`` (a request per
record); ``ack``: `Consumer.ack` of as many records, handed out in deliveries of 1,000
and acked in order.
Run it under callgrind at two sizes; the difference over the records between them is
the cost per record (bench/PROFILE.md, nineteenth pass):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python bench/client_instructions.py --records {10000,30000} --part {produce,produce_unbatched,ack}

It imports `zbroker` from whichever tree the interpreter's venv points at, so the same
file measures a before and an after tree.
"""

from __future__ import annotations

import argparse
import itertools

from zbroker.client.core import ConsumedRecord, MetadataCache
from zbroker.client.sync import Consumer, Producer
from zbroker.client.transport import Coordinators, Correlation
from zbroker.protocol import codec
from zbroker.protocol import messages as m

BATCH = 1000


def produce(records: int, batch_size: int = BATCH) -> None:
    linger_ms = 0 if batch_size == 1 else 3_600_000
    producer = Producer("tcp://127.0.0.1:1", linger_ms=linger_ms, batch_size=batch_size,
                        max_in_flight_records=1 << 30, max_in_flight_bytes=1 << 40)
    conn = producer.conn
    conn.metadata.update([{"name": "t", "partitions": [{"endpoint": "tcp://127.0.0.1:2"}]}])
    replies: list = []

    def send(endpoint, msg, frames=(), **_options):
        corr = conn.correlation.allocate()
        replies.append(codec.Envelope(op="produce", corr_id=corr,
                                      msg=m.ProduceReply(base_offset=0, count=batch_size, duplicate=False)))
        return corr

    def recv_nowait_all():
        out = replies[:]
        replies.clear()
        return out

    conn.send, conn.recv_nowait_all = send, recv_nowait_all
    conn.recv = lambda timeout_s: replies.pop(0) if replies else None
    value = b"x" * 100
    for _ in range(records):
        producer.send("t", value)
    producer.flush()
    conn.close()


class AcksSent:
    """The connection of a joined consumer, as far as acks need one: sends go nowhere."""

    def __init__(self) -> None:
        self.correlation = Correlation()
        self._early = self.correlation.early
        self._ids = itertools.count(1)
        self.request_timeout = 1e9  # no ack request is ever overdue, however slow the run
        self.url = "inproc://coordinator"
        self.coordinators = Coordinators(self.url)
        self.metadata = MetadataCache()

    def coordinator(self, msg, timeout=None):
        return m.JoinReply(member_id="m", generation=1, mode="shared", assignment=[], ack_timeout_ms=30000)

    def send(self, endpoint, msg, frames=(), replies=1):
        return next(self._ids)

    def recv_nowait_all(self):
        return []

    def collect(self):
        pass

    def close(self):
        pass


def ack(records: int) -> None:
    consumer = Consumer("inproc://coordinator", group="g", topics=["t"], ack_batch=BATCH, heartbeat=False,
                        read_ahead=False, conn=AcksSent())
    for first in range(0, records, BATCH):
        batch = [ConsumedRecord("t", 0, o, 0, None, b"v", None, 7, 1, "new") for o in range(first, first + BATCH)]
        consumer.core.held = [batch]
        for record in consumer.core.hand_out(BATCH):
            consumer.ack(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--part", choices=["produce", "produce_unbatched", "ack"], required=True)
    args = parser.parse_args()
    if args.part == "ack":
        ack(args.records)
    else:
        produce(args.records, 1 if args.part == "produce_unbatched" else BATCH)


if __name__ == "__main__":
    main()
