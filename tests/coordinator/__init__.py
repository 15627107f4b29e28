"""Tests of the group coordinator's pure core, and a small driver they share.

`Driver` plays the shell: it owns the clock (advanced by hand), hands out
reply tokens, collects every effect and routes late replies (parked polls)
to their tokens. No sockets, no threads, no sleeping.
"""

from __future__ import annotations

import itertools
from typing import Any

from zbroker.actors.group_coordinator.core import GroupConfig, GroupCoordinatorCore
from zbroker.actors.group_coordinator.effects import DeadLetter, Log, PersistOffsets, Reply, ReplyError
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ZBrokerError

PARKED = object()  # what Driver.call returns for a poll that is waiting


class Driver:
    def __init__(self, topics: dict[str, int] | None = None, *, config: GroupConfig = GroupConfig(),
                 logs: dict[tuple[str, int], tuple[int, int]] | None = None, max_persisted_holes: int = 1000,
                 lease_id_base: int = 1_000, load: bool = True, rows: list | None = None, now: int = 1_000):
        self.core = GroupCoordinatorCore(lease_id_base=lease_id_base, default_config=config,
                                         max_persisted_holes=max_persisted_holes)
        self.now = now
        self.tokens = itertools.count(1)
        self.effects: list = []
        self.answers: dict[Any, Any] = {}  # token -> reply message or ZBrokerError
        for topic, partitions in (topics or {"t": 1}).items():
            self.core.set_topic(topic, partitions)
        for (topic, partition), (start, end) in (logs or {}).items():
            self.feed(self.core.on_log_range(topic, partition, start, end, self.now))
        if load:
            self.feed(self.core.load_offsets(rows or [], self.now))

    # -- plumbing -----------------------------------------------------------------------

    def feed(self, effects: list) -> list:
        self.effects.extend(effects)
        for e in effects:
            if isinstance(e, Reply):
                assert e.token not in self.answers, f"token {e.token} answered twice"
                self.answers[e.token] = e.msg
            elif isinstance(e, ReplyError):
                assert e.token not in self.answers, f"token {e.token} answered twice"
                self.answers[e.token] = e.error
        return effects

    def call(self, method: str, msg: m.Message, token: Any = None) -> Any:
        """Send one request; return its reply (message or error), or PARKED."""
        token = next(self.tokens) if token is None else token
        effects = self.feed(getattr(self.core, method)(token, msg, self.now))
        mine = [e for e in effects if isinstance(e, (Reply, ReplyError)) and e.token == token]
        assert len(mine) <= 1
        if not mine:
            assert method == "poll", f"{method} left its token unanswered"
            return PARKED
        return self.answers[token]

    def ok(self, method: str, msg: m.Message) -> Any:
        reply = self.call(method, msg)
        assert not isinstance(reply, ZBrokerError), reply
        return reply

    def advance(self, ms: int) -> list:
        self.now += ms
        return self.feed(self.core.tick(self.now))

    def log_range(self, topic: str, partition: int, start: int, end: int) -> list:
        return self.feed(self.core.on_log_range(topic, partition, start, end, self.now))

    def mark(self) -> int:
        return len(self.effects)

    def since(self, mark: int, kind: type) -> list:
        return [e for e in self.effects[mark:] if isinstance(e, kind)]

    # -- group requests -----------------------------------------------------------------

    def join(self, group: str = "g", topics: list[str] | None = None, member_id: str = "",
             session_timeout_ms: int = 10_000) -> m.JoinReply:
        return self.ok("join", m.Join(group=group, topics=topics or ["t"], member_id=member_id,
                                      session_timeout_ms=session_timeout_ms))

    def poll(self, member: m.JoinReply, group: str = "g", max_records: int = 1000, max_wait_ms: int = 0,
             generation: int | None = None) -> Any:
        gen = member.generation if generation is None else generation
        return self.call("poll", m.Poll(group=group, member_id=member.member_id, generation=gen,
                                        max_records=max_records, max_wait_ms=max_wait_ms))

    def settle(self, op: str, member: m.JoinReply, ranges: list, group: str = "g",
               generation: int | None = None, **fields) -> Any:
        gen = member.generation if generation is None else generation
        cls = {"ack": m.Ack, "nack": m.Nack, "extend": m.Extend, "reject": m.Reject}[op]
        return self.call(op, cls(group=group, member_id=member.member_id, generation=gen, ranges=ranges, **fields))

    def resync(self, member: m.JoinReply, group: str = "g", topics: list[str] | None = None) -> m.JoinReply:
        return self.join(group, topics, member_id=member.member_id)

    def describe(self, group: str = "g") -> dict:
        return self.ok("describe_group", m.DescribeGroup(group=group)).group

    def partition(self, topic: str = "t", partition: int = 0, group: str = "g") -> dict:
        return next(p for p in self.describe(group)["partitions"]
                    if (p["topic"], p["partition"]) == (topic, partition))

    def committed(self, topic: str = "t", partition: int = 0, group: str = "g") -> int:
        return self.partition(topic, partition, group)["committed_pending"]

    # -- effects ------------------------------------------------------------------------

    def persisted(self, since: int = 0) -> list[PersistOffsets]:
        return [e for e in self.effects[since:] if isinstance(e, PersistOffsets)]

    def dead_letters(self, since: int = 0) -> list[DeadLetter]:
        return [e for e in self.effects[since:] if isinstance(e, DeadLetter)]

    def dead_letter(self, offset: int, topic: str = "t", partition: int = 0) -> DeadLetter:
        """The newest DeadLetter effect for this record: what the shell hands back."""
        return [e for e in self.dead_letters() if (e.topic, e.partition, e.offset) == (topic, partition, offset)][-1]

    def logs(self, event: str, since: int = 0) -> list[Log]:
        return [e for e in self.effects[since:] if isinstance(e, Log) and e.event == event]


def deliveries_of(reply: m.PollReply) -> list[tuple]:
    return [tuple(d) for d in reply.deliveries]


def ranges_of(reply: m.PollReply) -> list[list]:
    """The ack ranges that settle a whole poll reply."""
    return [[t, p, lease, s, e] for t, p, lease, s, e, _attempt, _reason in reply.deliveries]
