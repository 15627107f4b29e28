"""The admin calls, once for both drivers: the request each sends and what of the reply it returns.

Theory of operation
-------------------
An admin call is a pass-through (the coordinator decides): a function here builds
the request from the caller's arguments and names the part of the reply the
caller gets. `sync_method` and `async_method` turn one into a method of
`sync.Admin` or `aio.AsyncAdmin`, which only send it (following NOT_COORDINATOR,
see `transport.Coordinators`). A call added here exists in both clients at once,
with one signature, so the two cannot drift apart again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from zbroker.protocol import messages as m

Request = tuple[m.Message, Callable[[Any], Any]]


def _fields(reply: Any) -> dict:
    return reply.to_fields()


def hello() -> Request:
    return m.Hello(versions=list(m.SUPPORTED_VERSIONS), client="zbroker-python"), _fields


def create_topic(name: str, partitions: int = 1, config: dict | None = None, *,
                 replication_factor: int = 1, min_insync: int | None = None) -> Request:
    return m.CreateTopic(topic=name, partitions=partitions, config=config, replication_factor=replication_factor,
                         min_insync=min_insync), _fields


def reassign_partition(topic: str, partition: int, replicas: list[str]) -> Request:
    return m.ReassignPartition(topic=topic, partition=partition, replicas=replicas), _fields


def list_topics() -> Request:
    return m.ListTopics(), lambda reply: reply.topics


def describe_topic(name: str) -> Request:
    return m.DescribeTopic(topic=name), _fields


def metadata(topics: list[str] | None = None) -> Request:
    return m.Metadata(topics=topics), lambda reply: reply.topics


def status() -> Request:
    return m.Status(), _fields


def list_groups() -> Request:
    return m.ListGroups(), lambda reply: reply.groups


def describe_group(group: str) -> Request:
    return m.DescribeGroup(group=group), lambda reply: reply.group


def configure_group(group: str, **config: Any) -> Request:
    return m.ConfigureGroup(group=group, **config), lambda reply: reply.config


def list_quarantine(group: str) -> Request:
    """The quarantined keys of a key_shared group (PROTOCOL.md, list_quarantine)."""
    return m.ListQuarantine(group=group), lambda reply: reply.keys


def release_key(group: str, *, key: str | bytes | None = None, key_hash: int | None = None,
                topic: str | None = None, to_dlq: bool = False) -> Request:
    """Let a quarantined key flow again, or send its held records to the DLQ."""
    return (m.ReleaseKey(group=group, key=key, key_hash=key_hash, topic=topic, to_dlq=to_dlq),
            lambda reply: reply.released)


def reset_group(group: str, topic: str, to: str | int) -> Request:
    return m.ResetGroup(group=group, topic=topic, to=to), _fields


def alter_topic(name: str, **changes: Any) -> Request:
    """Grow partitions or change retention (PROTOCOL.md s.8.5)."""
    return m.AlterTopic(topic=name, **changes), _fields


def reset_group_to_time(group: str, topic: str, time_ms: int) -> Request:
    """Each partition to its first offset appended at or after `time_ms` (wall-clock ms)."""
    return m.ResetGroup(group=group, topic=topic, to_time_ms=time_ms), _fields


def delete_group(group: str) -> Request:
    return m.DeleteGroup(group=group), _fields


def delete_topic(name: str) -> Request:
    """Delete a topic, its partitions' files and its groups' offsets (PROTOCOL.md, delete_topic)."""
    return m.DeleteTopic(topic=name), _fields


# The coordinator holds a delete_topic reply until the partition actors have deleted the
# files and the commit writer has the offsets' tombstones (up to 4 s, then it answers with
# what is pending), so its request waits longer than the default 5 s.
delete_topic.timeout_s = 10.0  # type: ignore[attr-defined]


ADMIN_CALLS: dict[str, Callable[..., Request]] = {call.__name__: call for call in (
    hello, create_topic, reassign_partition, list_topics, describe_topic, metadata, status, list_groups,
    describe_group, configure_group, list_quarantine, release_key, reset_group, alter_topic,
    reset_group_to_time, delete_group, delete_topic)}


def _named_like(method: Callable, build: Callable) -> Callable:
    functools.update_wrapper(method, build, assigned=("__module__", "__name__", "__doc__"), updated=())
    del method.__wrapped__  # its signature has no `self`: introspection of a bound method would drop an argument
    method.__qualname__ = build.__name__
    return method


def _timeout(build: Callable, default_s: float) -> float:
    """A call that waits on the broker's own work (``timeout_s``) gets at least that long."""
    return max(getattr(build, "timeout_s", 0.0), default_s)


def sync_method(build: Callable[..., Request]) -> Callable:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        msg, pick = build(*args, **kwargs)
        return pick(self.conn.coordinator(msg, timeout=_timeout(build, self.conn.request_timeout)))
    return _named_like(method, build)


def async_method(build: Callable[..., Request]) -> Callable:
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        msg, pick = build(*args, **kwargs)
        return pick(await self.conn.coordinator(msg, timeout=_timeout(build, self.conn.request_timeout)))
    return _named_like(method, build)


def with_admin_calls(method: Callable[[Callable[..., Request]], Callable]) -> Callable[[type], type]:
    """A class decorator adding every admin call, made into methods by ``method``."""
    def add(cls: type) -> type:
        for name, build in ADMIN_CALLS.items():
            setattr(cls, name, method(build))
        return cls
    return add
