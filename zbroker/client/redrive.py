"""Redriving dead letters: move the records of a dead-letter topic back to their source.

Theory of operation
-------------------
It runs in the client, as an admin operation made of ordinary requests, because every
step it needs already has a guarantee: the dead-letter topic is read through a consumer
group (the *cursor*, ``zb-redrive`` unless told), each letter is produced to its source
topic by an idempotent producer, and the letter is acked in the cursor only once that
produce is acknowledged. So nothing is lost: a crash or error between the produce and
the ack leaves the letter unacked, and the next run sends it again (a duplicate in the
source topic, at least once, as every redelivery is). A coordinator-side redrive would
need the same produce-then-ack protocol inside the coordinator, plus its own progress
store, and would put record bytes through the actor that must never touch them.

What a letter becomes (`redriven_copy`, pure): its key, value and headers, provenance
headers (``zb-dlq-*``) kept, plus ``zb-dlq-redrives`` counting this attempt (1 on the
first redrive, one more each time the record comes back). It goes to its source
partition when the topic still has it, else by key. A letter whose value was dropped
(``zb-dlq-value-dropped``: it did not fit the dead-letter topic) takes key, value and
headers from the source offset, where the original is while retention keeps it.

A letter that cannot be redriven (no provenance headers, its source topic gone, the
original of a dropped value gone) is left unacked and listed in ``skipped`` with why:
it stays in the dead-letter topic, and the next run meets it again. A run ends when a
poll finds nothing more, or after ``max_records`` redriven. An empty dead-letter topic
is a result (``redriven`` 0), not an error; an unknown one is UNKNOWN_TOPIC.
"""

from __future__ import annotations

from contextlib import closing
from typing import Any

from zbroker.protocol.errors import ErrorCode, ZBrokerError

DEFAULT_CURSOR_GROUP = "zb-redrive"
REDRIVES_HEADER = "zb-dlq-redrives"
SOURCE_TOPIC = "zb-dlq-source-topic"
SOURCE_PARTITION = "zb-dlq-source-partition"
SOURCE_OFFSET = "zb-dlq-source-offset"
VALUE_DROPPED = "zb-dlq-value-dropped"
# Records per poll: one produce batch per source partition, then their acks.
POLL_RECORDS = 500
# A poll that waits this long and finds nothing ends the run (the letters are all out).
IDLE_POLL_S = 1.0


class NotRedrivable(Exception):
    """Why one letter cannot go back (it stays in the dead-letter topic)."""


def provenance(headers: dict | None) -> tuple[str, int, int]:
    """(source topic, partition, offset) from a letter's headers."""
    headers = headers or {}
    try:
        return (_text(headers[SOURCE_TOPIC]), int(_text(headers[SOURCE_PARTITION])),
                int(_text(headers[SOURCE_OFFSET])))
    except (KeyError, ValueError, UnicodeDecodeError):
        raise NotRedrivable("no zb-dlq-source-* headers: not a dead letter") from None


def redriven_copy(key: bytes | None, value: bytes, headers: dict | None,
                  original: tuple[bytes | None, bytes, dict | None] | None = None) -> tuple:
    """(key, value, headers) to produce for a letter. `original`: the source record's
    (key, value, headers), needed when the letter's value was dropped."""
    headers = dict(headers or {})
    if VALUE_DROPPED in headers:
        if original is None:
            raise NotRedrivable("its value was dropped and the original is gone from the source")
        key, value = original[0], original[1]
        headers = {**(original[2] or {}), **{k: v for k, v in headers.items()
                                             if k.startswith("zb-dlq-") and not k.endswith("-dropped")}}
    try:
        count = int(_text(headers.get(REDRIVES_HEADER, b"0")))
    except (ValueError, UnicodeDecodeError):
        count = 0
    headers[REDRIVES_HEADER] = str(count + 1).encode()
    return key, value, headers


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def redrive_dead_letters(url: str, dlq_topic: str, *, group: str = DEFAULT_CURSOR_GROUP,
                         max_records: int | None = None, request_timeout: float = 5.0,
                         curve: Any = None) -> dict:
    """Move the letters of `dlq_topic` back to their source topics (see the module doc).

    Returns {dlq_topic, group, redriven, by_topic: {topic: n}, skipped: [{partition,
    offset, reason}]}. Raises UNKNOWN_TOPIC for a topic that does not exist."""
    from zbroker.client.sync import Admin, Connection, Consumer, Producer, fetch

    with Admin(url, request_timeout=request_timeout, curve=curve) as admin:
        admin.describe_topic(dlq_topic)  # UNKNOWN_TOPIC before any group is made
        # The cursor reads from the first letter, and a letter that keeps failing to go
        # back is not dead-lettered again by its own lease timeouts.
        admin.configure_group(group, start="earliest", max_deliveries=1_000_000)
        partitions = {t["name"]: len(t["partitions"]) for t in admin.metadata()}
    result: dict[str, Any] = {"dlq_topic": dlq_topic, "group": group, "redriven": 0, "by_topic": {},
                              "skipped": []}
    skipped: set[tuple[int, int]] = set()
    with Consumer(url, group=group, topics=[dlq_topic], curve=curve) as consumer, \
            Producer(url, linger_ms=1, request_timeout=request_timeout, curve=curve) as producer, \
            closing(Connection(url, request_timeout=request_timeout, curve=curve)) as conn:
        while max_records is None or result["redriven"] < max_records:
            wanted = POLL_RECORDS if max_records is None else min(POLL_RECORDS, max_records - result["redriven"])
            letters = [r for r in consumer.poll(max_records=wanted, timeout=IDLE_POLL_S)
                       if (r.partition, r.offset) not in skipped]
            if not letters:
                break
            sent = []
            for letter in letters:
                try:
                    topic, partition, offset = provenance(letter.headers)
                    if topic not in partitions:
                        raise NotRedrivable(f"its source topic {topic!r} does not exist")
                    original = _original(conn, fetch, topic, partition, offset) \
                        if VALUE_DROPPED in (letter.headers or {}) else None
                    key, value, headers = redriven_copy(letter.key, letter.value, letter.headers, original)
                except NotRedrivable as why:
                    skipped.add((letter.partition, letter.offset))
                    result["skipped"].append({"partition": letter.partition, "offset": letter.offset,
                                              "reason": str(why)})
                    continue
                target = partition if partition < partitions[topic] else None
                sent.append((letter, topic, producer.send(topic, value, key=key, headers=headers,
                                                          partition=target)))
            try:
                producer.flush()
            except ZBrokerError:
                pass  # each handle says whether its copy was acknowledged
            for letter, topic, handle in sent:
                if handle.error is not None:
                    skipped.add((letter.partition, letter.offset))
                    result["skipped"].append({"partition": letter.partition, "offset": letter.offset,
                                              "reason": f"produce failed: {handle.error}"})
                    continue
                consumer.ack(letter)  # only now: the copy is acknowledged in the source topic
                result["redriven"] += 1
                result["by_topic"][topic] = result["by_topic"].get(topic, 0) + 1
        consumer.flush_acks(wait=True)
    return result


async def redrive_dead_letters_async(url: str, dlq_topic: str, **options: Any) -> dict:
    """`redrive_dead_letters` for asyncio code: the same run on a worker thread.

    A redrive is a bulk admin operation, not a per-record path: running the one
    implementation off the event loop keeps a single produce-then-ack sequence to
    reason about (the console's redrive action does the same)."""
    import asyncio
    return await asyncio.to_thread(redrive_dead_letters, url, dlq_topic, **options)


def _original(conn: Any, fetch: Any, topic: str, partition: int, offset: int) -> tuple | None:
    try:
        records = fetch(conn, topic, partition, offset, max_records=1)[0]
    except ZBrokerError as err:
        if err.code in (ErrorCode.OFFSET_OUT_OF_RANGE, ErrorCode.UNKNOWN_TOPIC):
            return None
        raise
    if not records or records[0].offset != offset:
        return None
    return records[0].key, records[0].value, records[0].headers
