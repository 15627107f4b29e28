"""The asyncio consumer's membership and polls, against a scripted coordinator."""

from __future__ import annotations

import asyncio
import contextlib

from zbroker.protocol import messages as m
from zbroker.protocol.batch import build_batch_header, encode_values
from zbroker.protocol.errors import Fenced, UnknownMember
from tests.support.aio_coordinator import ScriptedCoordinator, offline_consumer
from zbroker.client.core import ConsumedRecord


def poll_reply(generation: int, deliveries: list | None = None) -> m.PollReply:
    return m.PollReply(generation=generation, deliveries=deliveries or [], ack_timeout_ms=30_000, acked=0, stale=[])


class RestartedCoordinator(ScriptedCoordinator):
    """Knows no member (it restarted); its generation continues from its store."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 5
        self.members: list[str] = []

    def answer(self, msg):
        if isinstance(msg, m.Join):
            member = msg.member_id or f"member-{len(self.members) + 1}"
            if member not in self.members:
                self.members.append(member)
                self.generation += 1
            return m.JoinReply(member_id=member, generation=self.generation, mode="exclusive", assignment=[],
                               ack_timeout_ms=30_000)
        if msg.generation != self.generation:
            return Fenced("fenced", generation=self.generation, member_known=msg.member_id in self.members)
        if msg.member_id not in self.members:
            return UnknownMember("unknown member", member_id=msg.member_id)
        return poll_reply(self.generation) if isinstance(msg, m.Poll) else m.HeartbeatReply(
            generation=self.generation, assignment=[])


def test_the_heartbeat_and_a_poll_refused_together_re_join_as_one_member():
    coordinator = RestartedCoordinator()
    consumer = offline_consumer(coordinator)
    consumer.member_id, consumer.generation = "old-member", 5

    async def main():
        # A beat and a poll both on their way when the coordinator refuses the old member: each
        # learns it, and they must re-join once between them, not once each. No timers: both are
        # sent before either reply comes (the scripted round trip), whatever the machine's load.
        await asyncio.gather(consumer.beat(), consumer.poll(timeout=0.05))
        for _ in range(3):  # and afterwards the member polls and beats as itself
            await asyncio.gather(consumer.beat(), consumer.poll(timeout=0.05))

    asyncio.run(asyncio.wait_for(main(), 30))
    refused = [type(msg).__name__ for msg in coordinator.sent
               if not isinstance(msg, m.Join) and msg.member_id == "old-member"]
    assert sorted(refused) == ["Heartbeat", "Poll"]  # both were on their way as the old member
    assert coordinator.members == ["member-1"]
    assert (consumer.member_id, consumer.generation) == ("member-1", 6)


class ParksPolls(ScriptedCoordinator):
    """Parks the first ``parked_polls`` polls (the test answers them); answers the others with nothing."""

    def __init__(self, parked_polls: int, request_timeout: float = 5.0) -> None:
        super().__init__()
        self.to_park = parked_polls
        self.request_timeout = request_timeout

    def answer(self, msg):
        if isinstance(msg, m.Poll) and self.to_park:
            self.to_park -= 1
            return None
        return poll_reply(1)

    def polls(self) -> list[m.Poll]:
        return [msg for msg in self.sent if isinstance(msg, m.Poll)]


def fetch_offsets(consumer):
    """Stands in for the fetch from the partition actors: (topic, partition, offset) per record."""
    def fetch():
        while consumer.flow.to_fetch:
            topic, partition, _lease, offset, end, _attempt, _reason = consumer.flow.to_fetch.pop(0)
            consumer.core.held.append([(topic, partition, o) for o in range(offset, end)])
        yield from ()
    return fetch


async def cancelled_poll(consumer, timeout: float) -> None:
    """A poll() whose caller gives up while its Poll waits at the coordinator."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(consumer.poll(timeout=timeout), 0.01)


def test_the_lease_of_a_cancelled_poll_goes_to_the_next_poll():
    coordinator = ParksPolls(1)
    consumer = offline_consumer(coordinator)
    consumer.flow._fetch = fetch_offsets(consumer)

    async def main():
        await cancelled_poll(consumer, timeout=5.0)
        before_the_lease = await consumer.poll(timeout=0.0)  # still waiting: nothing, and no second Poll
        coordinator.reply_to_parked(poll_reply(1, [["t", 0, 7, 0, 3, 1, "new"]]))
        return before_the_lease, await consumer.poll(max_records=2, timeout=1.0), await consumer.poll(timeout=0.0)

    before_the_lease, first, rest = asyncio.run(main())
    assert (before_the_lease, first, rest) == ([], [("t", 0, 0), ("t", 0, 1)], [("t", 0, 2)])
    assert len(coordinator.polls()) == 1


def test_a_cancelled_poll_is_given_up_at_its_own_deadline_and_its_acks_go_again():
    coordinator = ParksPolls(1, request_timeout=1.0)  # the parked poll's deadline: 50 ms + 1 s after it left
    consumer = offline_consumer(coordinator)
    consumer.acks.add_range(["t", 0, 7, 0, 5])

    async def main():
        await cancelled_poll(consumer, timeout=0.05)
        assert await consumer.poll(timeout=0.0) == []
        assert len(coordinator.polls()) == 1  # kept: its deadline has not passed
        # Waits past that deadline (a bound, not a sleep: it returns once the new Poll is answered).
        return await consumer.poll(timeout=10.0)

    assert asyncio.run(main()) == []
    assert [poll.acks for poll in coordinator.polls()] == [[["t", 0, 7, 0, 5]]] * 2
    assert not consumer.acks


def consumed(offset: int, lease_id: int = 7) -> ConsumedRecord:
    return ConsumedRecord("t", 0, offset, 0, None, b"v", None, lease_id, 1, "new")


class ParksTheFirstAck(ScriptedCoordinator):
    def answer(self, msg):
        if isinstance(msg, m.Ack):
            first = not any(isinstance(earlier, m.Ack) for earlier in self.sent[:-1])
            return None if first else m.AckReply(applied=sum(r[4] - r[3] for r in msg.ranges))
        return m.LeaveReply()


def test_acks_whose_interval_request_is_still_waiting_at_close_are_sent_by_close():
    coordinator = ParksTheFirstAck()
    consumer = offline_consumer(coordinator, ack_interval_ms=1)

    async def main():
        for offset in range(3):
            await consumer.ack(consumed(offset))
        while not coordinator.parked:  # the interval is up: its Ack request waits at the coordinator
            await asyncio.sleep(0.001)
        await consumer.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert [msg.ranges for msg in coordinator.sent if isinstance(msg, m.Ack)] == [[["t", 0, 7, 0, 3]]] * 2
    assert not consumer.acks


class LeasesThenSlowFetches(ScriptedCoordinator):
    """One poll leases two partitions; the fetch of partition 1 is parked (a slow actor)."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata.update([{"name": "t", "partitions": [{"partition": p, "endpoint": f"actor-{p}", "actor_id": "a"}
                                                            for p in (0, 1)]}])

    def answer(self, msg):
        if isinstance(msg, m.Poll):
            return poll_reply(1, [["t", 0, 7, 0, 3, 1, "new"], ["t", 1, 8, 0, 2, 1, "new"]])
        assert isinstance(msg, m.Fetch)
        if msg.partition == 1 and not any(isinstance(e, m.Fetch) and e.partition == 1 for e in self.sent[:-1]):
            return None  # the first fetch of partition 1 never gets its reply
        values = [b"p%d-%d" % (msg.partition, o) for o in range(msg.offset, 3 if msg.partition == 0 else 2)]
        payload = encode_values(values, 0)
        header = build_batch_header(payload, base_offset=msg.offset, record_count=len(values), append_time_ms=0)
        return m.FetchReply(log_start=0, log_end=3), [header + payload]


def test_a_poll_cancelled_while_it_fetches_leaves_its_leases_to_the_next_poll():
    """The coordinator leased both partitions to this poll: cancelled while fetching the
    second, the records must not be stranded until the ack timeout (a delivery attempt each)."""
    coordinator = LeasesThenSlowFetches()
    consumer = offline_consumer(coordinator)

    async def main():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(consumer.poll(timeout=1.0), 0.2)  # waits on partition 1's fetch
        return await consumer.poll(max_records=10, timeout=1.0)

    got = asyncio.run(asyncio.wait_for(main(), 10))
    assert sorted((r.partition, r.offset, r.value) for r in got) == [
        (0, 0, b"p0-0"), (0, 1, b"p0-1"), (0, 2, b"p0-2"), (1, 0, b"p1-0"), (1, 1, b"p1-1")]
    assert all(r.lease_id == (7 if r.partition == 0 else 8) for r in got)
    assert [type(e).__name__ for e in coordinator.sent].count("Poll") == 1, "no second Poll was needed"
