"""The producer's sends and resends (`ProducerFlow`) driven step by step: each step a flow
yields is answered here, on a hand-driven clock. No driver, no sockets: what both producers
do with the broker is what these steps say."""

from __future__ import annotations

import pytest

from zbroker.client.core import MetadataCache
from zbroker.client.producer_core import ProduceError, ProducerCore
from zbroker.client.producer_flow import ProducerFlow
from zbroker.client.steps import Coordinator, Done, Endpoint, Send, resume
from zbroker.protocol import messages as m
from zbroker.protocol.errors import NotLeader, Unavailable


class Cut(BaseException):
    """A cancellation (or Ctrl-C) thrown into a flow at the step it waits on."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def producer(**options) -> tuple[ProducerFlow, ProducerCore, MetadataCache, Clock]:
    core, metadata, clock = ProducerCore(**options), MetadataCache(), Clock()
    metadata.update([{"name": "t", "partitions": [{"partition": p, "endpoint": f"ep-{p % 2}"} for p in range(4)]}])
    return ProducerFlow(core, metadata, clock), core, metadata, clock


def admitted_batch(core: ProducerCore, partition: int, n: int = 2):
    for i in range(n):
        core.acc.add("t", partition, [0, None, b"v%d" % i, None], 20, now=0.0)
    batch = core.acc.close(("t", partition))
    core.admit(batch)
    return batch


def answer_endpoints(flow, step, metadata: MetadataCache):
    """Answer every Endpoint step from the metadata, as a driver does; return the next other step."""
    while isinstance(step, Endpoint):
        step = resume(flow, metadata.endpoint(step.topic, step.partition), None)
    return step


def test_batches_go_to_their_actors_one_request_each_and_wait_in_the_window_for_their_replies():
    flow, core, metadata, clock = producer()
    a, b, c = admitted_batch(core, 0), admitted_batch(core, 1), admitted_batch(core, 2)
    run = flow.send([a, b, c])
    step = answer_endpoints(run, resume(run, None, None), metadata)
    assert isinstance(step, Send) and step.endpoint == "ep-0" and step.msg.op == "produce_many"
    assert step.frames == (a.payload + c.payload,)
    step = resume(run, 11, None)
    assert isinstance(step, Send) and (step.endpoint, step.msg.op, step.frames) == ("ep-1", "produce", (b.payload,))
    assert resume(run, 12, None) == Done(None)
    assert list(core.in_flight) == [11, 12] and core.in_flight_records == 6
    core.settle(12, None, m.ProduceReply(base_offset=40, count=2, duplicate=False), clock())
    assert b.outcome.base_offset == 40 and core.in_flight_records == 4


def test_a_batch_whose_actor_is_unknown_or_unreachable_is_an_attempt_that_failed_and_goes_again():
    flow, core, metadata, clock = producer()
    a, b = admitted_batch(core, 0), admitted_batch(core, 1)
    run = flow.send([a, b])
    step = resume(run, None, None)
    step = resume(run, None, Unavailable("no live owner", topic="t", partition=0))  # a's Endpoint
    step = answer_endpoints(run, step, metadata)
    assert resume(run, None, Unavailable("no connection", endpoint="ep-1")) == Done(None)  # b's Send
    assert not core.in_flight and [x.attempts for x in (a, b)] == [1, 1]
    assert sorted(batch.partition for _at, batch in core.retrying) == [0, 1]
    assert core.in_flight_records == 4 and core.take_failure() is None  # still in the window, not failed


def test_a_send_that_breaks_with_an_unexpected_error_fails_the_batch_for_the_flush_to_report():
    flow, core, metadata, _clock = producer(retries=0)
    batch = admitted_batch(core, 0)
    run = flow.send([batch])
    answer_endpoints(run, resume(run, None, None), metadata)
    assert resume(run, None, OSError("socket gone")) == Done(None)
    failure = core.take_failure()
    assert isinstance(failure, ProduceError) and "socket gone" in failure.message
    assert isinstance(batch.outcome.error, ProduceError) and core.in_flight_records == 0


@pytest.mark.parametrize("cut_at", ["endpoint", "send"])
def test_a_flow_cut_short_leaves_nothing_admitted_behind_unsent_and_unaccounted(cut_at):
    flow, core, metadata, clock = producer()
    a, b, c = admitted_batch(core, 0), admitted_batch(core, 1), admitted_batch(core, 2)
    run = flow.send([a, b, c])
    step = resume(run, None, None)
    if cut_at == "send":
        step = answer_endpoints(run, step, metadata)
        step = resume(run, 21, None)  # a and c went as one produce_many; b's request is cut
    with pytest.raises(Cut):
        resume(run, None, Cut())
    sent = [batch for corr, (entry, _at) in core.in_flight.items() for batch in getattr(entry, "batches", [entry])]
    retrying = [batch for _at, batch in core.retrying]
    assert sorted(x.partition for x in sent + retrying) == [0, 1, 2]  # each batch is somewhere
    assert all(x.outcome.error is None for x in (a, b, c)) and core.in_flight_records == 6
    assert sent == ([a, c] if cut_at == "send" else [])


def test_a_retry_goes_to_the_leader_the_error_named_after_one_metadata_question_per_topic():
    flow, core, metadata, clock = producer()
    a, b = admitted_batch(core, 0), admitted_batch(core, 2)
    for corr, batch in ((1, a), (2, b)):
        batch.attempts = 1
        core.sent(corr, batch, clock())
    core.settle(1, NotLeader("moved", leader={"endpoint": "ep-new", "leader_epoch": 3}), None, clock())
    core.settle(2, Unavailable("restarting"), None, clock())
    assert list(flow.resend_due()) == []  # nothing due yet: the backoff runs
    clock.now += 1.0
    later = admitted_batch(core, 1)
    run = flow.resend_due(also=lambda: [later])
    step = resume(run, None, None)
    assert step == Coordinator(m.Metadata(topics=["t"]))  # once for the topic of both
    assert metadata.endpoint("t", 0) == "ep-new"  # the hint was written before the question
    reply = m.MetadataReply(topics=[{"name": "t", "partitions": [
        {"partition": p, "endpoint": "ep-new" if p == 0 else f"ep-{p % 2}"} for p in range(4)]}])
    step = answer_endpoints(run, resume(run, reply, None), metadata)
    requests = []
    while isinstance(step, Send):
        requests.append((step.endpoint, step.msg.op))
        step = resume(run, 30 + len(requests), None)
    assert step == Done(None)
    assert sorted(requests) == [("ep-0", "produce"), ("ep-1", "produce"), ("ep-new", "produce")]
    assert [x.attempts for x in (a, b, later)] == [2, 2, 1] and not core.retrying


def test_a_resend_cut_while_it_asks_for_metadata_keeps_its_batches_for_the_next_round():
    flow, core, metadata, clock = producer()
    batch = admitted_batch(core, 0)
    batch.attempts = 1
    core.sent(1, batch, clock())
    core.settle(1, Unavailable("restarting"), None, clock())
    clock.now += 1.0
    run = flow.resend_due()
    assert isinstance(resume(run, None, None), Coordinator)
    with pytest.raises(Cut):
        resume(run, None, Cut())
    assert [b for _at, b in core.retrying] == [batch] and batch.outcome.error is None
    assert core.take_failed() == [] and core.in_flight_records == 2
