"""The asyncio consumer's membership and polls, against a scripted coordinator."""

from __future__ import annotations

import asyncio

from protocol import messages as m
from protocol.errors import Fenced, UnknownMember
from tests.support.aio_coordinator import ScriptedCoordinator, offline_consumer


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
    consumer = offline_consumer(coordinator, session_timeout_ms=45)  # a beat every 15 ms
    consumer.member_id, consumer.generation = "old-member", 5

    async def main():
        heartbeat = asyncio.create_task(consumer._heartbeat())
        try:
            for _ in range(5):
                await consumer.poll(timeout=0.0)
                await asyncio.sleep(0.01)
        finally:
            heartbeat.cancel()
            await asyncio.gather(heartbeat, return_exceptions=True)

    asyncio.run(main())
    assert coordinator.members == ["member-1"]
    assert (consumer.member_id, consumer.generation) == ("member-1", 6)
