"""The consumer's calls (`ConsumerFlow`) driven step by step: each step a flow yields is
answered here, by a scripted group of one partition, on a hand-driven clock. No driver,
no sockets, no private attributes: what both drivers do is what these steps say."""

from __future__ import annotations

import pytest

from zbroker.client.consumer_core import ConsumerCore
from zbroker.client.consumer_flow import ConsumerFlow
from zbroker.client.steps import Connect, Coordinator, Done, Endpoint, Notify, Send, Sleep, Wait, WaitAny, resume
from zbroker.client.core import MetadataCache
from zbroker.client.transport import Coordinators, Correlation
from zbroker.protocol import messages as m
from zbroker.protocol.batch import build_batch_header, encode_values
from zbroker.protocol.codec import Envelope
from zbroker.protocol.errors import Fenced, RequestTimeout


class Cut(BaseException):
    """Stands for asyncio's CancelledError (a BaseException): the caller gave up mid-step."""


def frame(first: int, count: int) -> bytes:
    payload = encode_values([b"v%d" % o for o in range(first, first + count)], 0)
    return build_batch_header(payload, base_offset=first, record_count=count, append_time_ms=0) + payload


class Group:
    """A coordinator and one partition actor ("actor"), answering each request when it is sent.
    ``polls``: what successive Polls get (a PollReply, an error, or None: parked, never answered).
    ``cut_at``: the step type at which the caller gives up (`Cut` is thrown into the flow)."""

    def __init__(self, polls: list, generation: int = 1) -> None:
        self.polls = list(polls)
        self.generation = generation
        self.correlation = Correlation()
        self.coordinators = Coordinators("coordinator")
        self.url = "coordinator"
        self.request_timeout = 1.0
        self.metadata = MetadataCache()
        self.now = 100.0
        self.sent: list[m.Message] = []
        self.steps: list[str] = []
        self.cut_at: type | None = None
        self._ids = 0

    def collect(self) -> None:
        pass  # replies are filed in `correlation` as requests are sent

    def answer(self, msg: m.Message):
        if isinstance(msg, m.Poll):
            return self.polls.pop(0) if self.polls else m.PollReply(
                generation=self.generation, deliveries=[], ack_timeout_ms=30_000, acked=sum(r[4] - r[3] for r in msg.acks),
                stale=[])
        if isinstance(msg, m.Ack):
            return m.AckReply(applied=sum(r[4] - r[3] for r in msg.ranges))
        if isinstance(msg, m.Fetch):
            return m.FetchReply(log_start=0, log_end=msg.offset + 3), [frame(msg.offset, 3)]
        raise AssertionError(f"unexpected {msg!r}")

    def perform(self, step):
        self.steps.append(type(step).__name__)
        if self.cut_at is not None and isinstance(step, self.cut_at):
            raise Cut()
        if isinstance(step, Send):
            self.sent.append(step.msg)
            corr = self.correlation.allocate(1 + (getattr(step.msg, "follow", 0) or 0))
            outcome = self.answer(step.msg)
            if isinstance(outcome, Exception):
                self.correlation.early[corr] = Envelope(op="r", corr_id=corr, error=outcome)
            elif isinstance(outcome, tuple):
                self.correlation.early[corr] = Envelope(op="r", corr_id=corr, msg=outcome[0], frames=outcome[1])
            elif outcome is not None:
                self.correlation.early[corr] = Envelope(op="r", corr_id=corr, msg=outcome)
            return corr
        if isinstance(step, Wait):
            env = self.correlation.early.pop(step.corr, None)
            if env is None:  # parked: the wait runs out on the hand-driven clock
                self.now += self.request_timeout if step.timeout is None else step.timeout
                raise RequestTimeout("no reply", corr_id=step.corr)
            return env
        if isinstance(step, (WaitAny, Sleep)):
            self.now += step[0]
            return None
        if isinstance(step, Endpoint):
            return "actor"
        if isinstance(step, Coordinator):
            assert isinstance(step.msg, m.Join)
            self.generation += 1
            return m.JoinReply(member_id="m", generation=self.generation, mode="exclusive",
                               assignment=[["t", 0]], ack_timeout_ms=30_000)
        if isinstance(step, (Connect, Notify)):
            return None
        raise AssertionError(step)

    def run(self, flow):
        """As the drivers run a flow, performing each step here."""
        step = resume(flow, None, None)
        while not isinstance(step, Done):
            try:
                result, error = self.perform(step), None
            except BaseException as err:  # noqa: B036 - the flow's to handle, as in the drivers
                result, error = None, err
            step = resume(flow, result, error)
        return step.value


def member(group: Group, **options) -> ConsumerFlow:
    core = ConsumerCore(group="g", topics=["t"], read_ahead=False, **options)
    flow = ConsumerFlow(core, group, lambda: group.now, session_timeout_ms=10_000)
    group.run(flow.join())
    return flow


def leased(generation: int, *deliveries: list) -> m.PollReply:
    return m.PollReply(generation=generation, deliveries=list(deliveries), ack_timeout_ms=30_000, acked=0, stale=[])


def test_a_poll_sends_a_poll_then_one_fetch_per_lease_and_hands_out_the_records():
    group = Group(polls=[leased(2, ["t", 0, 7, 0, 3, 1, "new"])])
    flow = member(group)
    records = group.run(flow.poll(max_records=10, timeout=1.0))
    assert [(r.offset, r.value, r.lease_id) for r in records] == [(0, b"v0", 7), (1, b"v1", 7), (2, b"v2", 7)]
    assert [type(msg).__name__ for msg in group.sent] == ["Poll", "Fetch"]


def test_acks_ride_on_the_next_poll():
    group = Group(polls=[leased(2, ["t", 0, 7, 0, 3, 1, "new"])])
    flow = member(group)
    for record in group.run(flow.poll(max_records=10, timeout=1.0)):
        flow.core.ack(record)
    group.run(flow.poll(max_records=10, timeout=0.0))
    assert group.sent[-1].acks == [["t", 0, 7, 0, 3]]
    assert flow.core.stats["acked"] == 3


def test_a_poll_whose_time_runs_out_at_the_coordinator_stays_in_flight_for_the_next_one():
    group = Group(polls=[None])  # parked
    flow = member(group)
    flow.core.acks.add_range(["t", 0, 5, 0, 2])
    group.cut_at = Wait
    with pytest.raises(Cut):
        group.run(flow.poll(max_records=10, timeout=0.5))
    assert flow.poll_in_flight is not None and flow.poll_in_flight.acks == [["t", 0, 5, 0, 2]]
    group.cut_at = None
    # Answered meanwhile: the next poll takes that reply, sending no second Poll.
    group.correlation.early[flow.poll_in_flight.reply] = Envelope(
        op="r", corr_id=flow.poll_in_flight.reply, msg=leased(2, ["t", 0, 8, 0, 3, 1, "new"]))
    records = group.run(flow.poll(max_records=10, timeout=0.5))
    assert [r.lease_id for r in records] == [8, 8, 8]
    assert [type(msg).__name__ for msg in group.sent] == ["Poll", "Fetch"]


def test_a_poll_without_a_reply_by_its_deadline_is_given_up_and_its_acks_go_with_the_next():
    group = Group(polls=[None, leased(2)])
    flow = member(group)
    flow.core.acks.add_range(["t", 0, 5, 0, 2])
    with pytest.raises(RequestTimeout):  # its wait and the request timeout ran out
        group.run(flow.poll(max_records=10, timeout=0.2))
    assert flow.poll_in_flight is None
    assert group.run(flow.poll(max_records=10, timeout=0.2)) == []
    assert [poll.acks for poll in group.sent] == [[["t", 0, 5, 0, 2]], [["t", 0, 5, 0, 2]]]


def test_a_fenced_poll_re_joins_and_is_sent_again_with_its_acks():
    group = Group(polls=[Fenced("fenced", generation=3), leased(3, ["t", 0, 9, 0, 3, 1, "new"])])
    flow = member(group)
    flow.core.acks.add_range(["t", 0, 5, 0, 2])
    records = group.run(flow.poll(max_records=10, timeout=0.5))
    assert [r.lease_id for r in records] == [9, 9, 9]
    assert group.steps.count("Coordinator") == 2  # the first join, and the re-join
    polls = [msg for msg in group.sent if isinstance(msg, m.Poll)]
    assert [(p.generation, p.acks) for p in polls] == [(2, [["t", 0, 5, 0, 2]]), (3, [["t", 0, 5, 0, 2]])]


def test_a_poll_cut_short_while_fetching_leaves_the_rest_to_the_next_and_hands_nothing_out_twice():
    group = Group(polls=[leased(2, ["t", 0, 7, 0, 6, 1, "new"])])  # each fetch brings 3 records
    flow = member(group)
    fetches = 0
    answer = group.answer

    def cut_after_one_fetch(msg):
        nonlocal fetches
        if isinstance(msg, m.Fetch):
            fetches += 1
            if fetches == 2:
                group.cut_at = Wait  # the second fetch is sent; the caller gives up waiting for it
        return answer(msg)
    group.answer = cut_after_one_fetch
    with pytest.raises(Cut):
        group.run(flow.poll(max_records=10, timeout=1.0))
    assert flow.to_fetch == [["t", 0, 7, 3, 6, 1, "new"]]  # from where it lacks records
    group.cut_at = None
    records = group.run(flow.poll(max_records=10, timeout=1.0))
    assert [r.offset for r in records] == [0, 1, 2, 3, 4, 5]
    assert [type(msg).__name__ for msg in group.sent].count("Poll") == 1


def test_a_heartbeat_that_heard_of_a_rebalance_makes_the_next_call_re_join_first():
    group = Group(polls=[])
    flow = member(group)
    flow.needs_rejoin = True
    group.run(flow.poll(max_records=10, timeout=0.0))
    assert group.steps[:4] == ["Coordinator", "Connect", "Coordinator", "Connect"]  # join, then re-join
    assert not flow.needs_rejoin and flow.core.stats["rejoins"] == 1
    assert group.sent[0].generation == 3


def test_a_flush_that_waits_sends_again_the_acks_of_a_request_never_answered():
    group = Group(polls=[])
    flow = member(group)
    answer = group.answer
    group.answer = lambda msg: None if isinstance(msg, m.Ack) else answer(msg)  # lost
    flow.core.acks.add_range(["t", 0, 5, 0, 2])
    group.run(flow.flush_acks(wait=False))
    group.answer = answer  # the coordinator is back
    group.run(flow.flush_acks(wait=True))
    assert [msg.ranges for msg in group.sent] == [[["t", 0, 5, 0, 2]]] * 2
    assert not flow.ack_requests and flow.core.stats["acked"] == 2
