"""The consumer's conversations with the broker, written once for both drivers.

Theory of operation
-------------------
`ConsumerCore` decides what one reply or one moment means. `ConsumerFlow`
orders those decisions into what one call of the consumer does: a poll (the
Poll in flight or a new one, the leases' fetches, read-ahead, poll-ahead and
lease-ahead), an ack flush, a join, a group request and its retries, a nack,
extend or reject, and closing. Each is a generator that yields *steps*, the
blocking I/O it needs next (`steps`: Send, Wait, WaitAny, Endpoint,
Coordinator, Sleep, Notify, Connect), which the sync driver performs by
blocking and the asyncio driver by awaiting. Between steps a flow reads
replies that are already in from the connection's `transport.Correlation`
(after ``conn.collect()``, which files what has arrived without waiting) and
drops the ones it gave up on there. The clock is the driver's monotonic
clock, passed in.

Cancellation (asyncio): the driver throws CancelledError into the flow at the
step it was awaiting. Cleanup in the flows does no I/O: a Poll in flight stays
in flight (the next poll takes its reply), deliveries not fetched yet stay in
`to_fetch` and records fetched go to `core.held` (the next poll hands them out,
nothing twice), and acks not known to be sent are held again.

Joins happen only inside a flow (`needs_rejoin` is how a heartbeat asks for
one), so a driver that runs one flow at a time never joins twice at once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import structlog

from zbroker.client.consumer_core import (ACK_FAILED, ACK_REJOIN, ACK_STALE, FOLLOW, RAISE, READ_AHEAD_WAIT_S, REJOIN,
                                          AckRequests, ConsumerCore, GroupCallRetry, PollSent, connection_field,
                                          core_field, max_wait_ms)
from zbroker.client.core import ChunkedSettle, ConsumedRecord, group_by_lease, in_request_sized_chunks
from zbroker.client.fetch_round import FetchRound
from zbroker.client.steps import (Connect, Coordinator, Endpoint, Flow, Notify, Send, Sleep, Wait, WaitAny,
                                  step_methods)
from zbroker.protocol import messages as m
from zbroker.protocol.codec import Envelope
from zbroker.protocol.errors import RequestTimeout, StaleLease, UnknownMember, ZBrokerError

log = structlog.get_logger("zbroker.client")


class ConsumerDriver:
    """What both consumer drivers share around their `ConsumerFlow`: the consumer's state under
    the names a user reads it by (the core's and the flow's), and the table of the driver's own
    methods that perform each step."""

    conn = connection_field()

    member_id = core_field("member_id")
    generation = core_field("generation")
    assignment = core_field("assignment")
    mode = core_field("mode")
    ack_timeout_ms = core_field("ack_timeout_ms")
    group = core_field("group")
    topics = core_field("topics")
    read_ahead = core_field("read_ahead")
    lease_ahead = core_field("lease_ahead")
    poll_ahead = core_field("poll_ahead")
    ack_batch = core_field("ack_batch")
    ack_interval_s = core_field("ack_interval_s")
    acks = core_field("acks")
    ahead = core_field("ahead")
    stats = core_field("stats")
    stale = core_field("stale")
    session_timeout_ms = property(lambda self: self.flow.session_timeout_ms)

    def step_methods(self) -> dict[type, Callable]:
        return step_methods(self)


class ConsumerFlow:
    """One consumer's calls, as generators of steps (module docstring).

    It reads ``conn.correlation``, ``conn.coordinators`` and ``conn.request_timeout``,
    and calls ``conn.collect()`` (files the replies that have arrived, without
    waiting); every other use of the connection is a step.
    """

    def __init__(self, core: ConsumerCore, conn: Any, clock: Callable[[], float], *, session_timeout_ms: int,
                 on_assign: Callable[[list], Any] | None = None,
                 on_revoke: Callable[[list], Any] | None = None) -> None:
        self.core = core
        self.conn = conn
        self.clock = clock
        self.session_timeout_ms = session_timeout_ms
        self.on_assign = on_assign
        self.on_revoke = on_revoke
        self.poll_in_flight: PollSent | None = None  # sent ahead, or by a poll cut short; reply is a corr id
        self.ack_requests = AckRequests()  # sent on their own, not answered yet
        # Deliveries of a poll reply not fetched yet, each [topic, partition, lease, next offset,
        # end, attempt, reason]: a poll cut short (cancelled) leaves them to the next one, instead
        # of stranding their leases until the ack timeout (each strand costs a delivery attempt).
        self.to_fetch: list[list] = []
        # Set by a heartbeat answered FENCED or UNKNOWN_MEMBER: the next flow re-joins first.
        self.needs_rejoin = False

    # -- small helpers --------------------------------------------------------------------------

    def _give_up(self, ranges: list[tuple[int, int]]) -> None:
        """Replies under these id ranges (read-ahead fetches the core gave up on) are dropped when they come."""
        if ranges:
            self.conn.correlation.orphan_ranges(ranges)

    def _hold_again(self, ranges: Iterable[list]) -> None:
        self.core.hold_again(ranges, self.clock())

    def call(self, endpoint: str | None, msg: m.Message, timeout: float | None = None) -> Flow:
        """Send and wait; an error reply is raised. A reply that comes after the timeout is dropped."""
        corr = yield Send(endpoint, msg)
        try:
            env = yield Wait(corr, timeout)
        except RequestTimeout:
            self.conn.correlation.orphan(corr)
            raise
        if env.error is not None:
            raise env.error
        return env

    # -- membership -----------------------------------------------------------------------------

    def join(self) -> Flow:
        """Join (or re-join) the group; its Poll in flight, deliveries not fetched and read-ahead
        keep only what the new assignment lets stand (`ConsumerCore.joined`)."""
        core = self.core
        previous_member, was_lost = core.member_id, core.member_lost
        try:
            reply = yield Coordinator(core.join_request(self.session_timeout_ms))
        except UnknownMember:
            reply = yield Coordinator(core.join_as_new(self.session_timeout_ms))
        revoked, assigned, given_up = core.joined(reply, previous_member)
        self.needs_rejoin = False
        self._give_up(given_up)
        self.to_fetch = core.standing_deliveries(self.to_fetch, previous_member, was_lost)
        self._keep_what_stands_of_the_poll_in_flight(previous_member, was_lost)
        topics = sorted({topic for topic, _partition in core.assignment})
        if topics:
            # Connect to the assigned partitions' actors now, while the first poll goes to the
            # coordinator: the first fetch then waits for neither a metadata request nor a TCP
            # and ZeroMQ handshake (about 2 ms of a first poll's 4.5).
            yield Connect(topics, core.assignment)
        if revoked and self.on_revoke:
            yield Notify(self.on_revoke, revoked)
        if assigned and self.on_assign:
            yield Notify(self.on_assign, assigned)

    def _keep_what_stands_of_the_poll_in_flight(self, previous_member: str, was_lost: bool) -> None:
        """A Poll of the old generation answered before the rebalance is kept, with only its
        deliveries whose leases still stand (the others went to another member: handed out,
        they would be acked stale and processed twice; dropped, a kept lease would come back
        only at its ack timeout). One not answered yet is given up: it is answered FENCED.
        A Poll sent in this same generation may have been fenced on arrival all the same:
        the acks it carries go again (a repeat is harmless; a loss costs a redelivery)."""
        sent = self.poll_in_flight
        if sent is None:
            return
        if sent.generation == self.core.generation:
            self._hold_again(sent.take_acks())
            return
        self.conn.collect()
        answered = self.conn.correlation.early.get(sent.reply)
        if answered is None or answered.error is not None:
            self.abandon_poll_in_flight()
        else:
            answered.msg.deliveries = self.core.standing_deliveries(answered.msg.deliveries, previous_member,
                                                                    was_lost)

    def rejoin(self) -> Flow:
        self.core.stats["rejoins"] += 1
        yield from self.join()

    def group_call(self, make: Callable[[], m.Message], timeout: float | None = None) -> Flow:
        """A group request, sent again after a re-join or a move as `GroupCallRetry` decides."""
        retry = GroupCallRetry(self.conn.coordinators)
        while True:
            if self.needs_rejoin:
                yield from self.rejoin()
            member_id, generation = self.core.member_id, self.core.generation  # what make() puts in it
            try:
                return (yield from self.call(None, make(), timeout))
            except ZBrokerError as err:
                yield from self._after_group_error(retry, err, member_id, generation)

    def _after_group_error(self, retry: GroupCallRetry, err: ZBrokerError, member_id: str, generation: int) -> Flow:
        """`GroupCallRetry`'s decision on ``err`` carried out; raises it when the caller must see it."""
        decision = retry.after(err)
        if decision == REJOIN:
            if self.core.rejoin_after(err, member_id, generation):
                yield from self.rejoin()
        elif decision == FOLLOW:
            log.info("coordinator.redirected", group=self.core.group, code=err.code.value, to=self.conn.url)
            yield Sleep(self.conn.coordinators.backoff())
            self.needs_rejoin = True  # the new coordinator learns of this member by its join
        else:
            assert decision == RAISE
            raise err

    # -- polling --------------------------------------------------------------------------------

    def poll(self, max_records: int, timeout: float) -> Flow:
        """Lease up to ``max_records`` and return their records (possibly fewer, possibly none).
        The acks held when a Poll goes out ride on it; those it does not take leave on their
        own when `ack_batch` or the interval says so."""
        records = yield from self._poll(max_records, timeout)
        try:
            yield from self.flush_acks_if_due()
        except ZBrokerError as err:
            if not records:
                raise
            # The records are leased and fetched: hand them out. The acks are held again
            # and go with the next request.
            log.warning("ack.deferred", group=self.core.group, error=str(getattr(err.code, "value", err.code)))
        return records

    def _poll(self, max_records: int, timeout: float) -> Flow:
        core = self.core
        if core.held and not self.to_fetch:
            # Leased by a Poll sent ahead for more than this call asked for: hand them out first.
            return core.hand_out(max_records)
        deadline = self.clock() + timeout
        correlation = self.conn.correlation
        if correlation.has_orphans():  # the replies kept of requests given up on go now
            correlation.drop_orphans()
        if not core.held and not self.to_fetch and core.ahead_leases:
            records = yield from self._records_ahead(max_records, deadline)
            if records:
                return records
            timeout = max(0.0, deadline - self.clock())  # what is left of it for the Polls and fetches
        if not core.held and not self.to_fetch:
            reply = yield from self._poll_reply(max_records, deadline)
            if reply is None:
                return []
            self.to_fetch = core.take_ahead_leases(reply.deliveries)
        if self.to_fetch:  # this poll's, or what one cut short left
            yield from self._fetch()
        records = core.hand_out(max_records)
        if core.poll_ahead_now(self.poll_in_flight is not None):
            yield from self._send_poll_ahead(max_records, max_wait_ms(timeout))
        if core.reading_ahead:
            yield from self.send_read_ahead(timeout)
        if not records and core.ahead_leases:
            records = yield from self._records_ahead(max_records, deadline)
        return records

    def _poll_reply(self, max_records: int, deadline: float) -> Flow:
        """The reply of the Poll in flight, or of a new one; None when the one in flight is still
        parked at the coordinator at ``deadline`` (the next poll takes it)."""
        if self.poll_in_flight is not None and self.needs_rejoin:
            yield from self.rejoin()  # keeps an answered Poll in flight, with what still stands of it
        if self.poll_in_flight is not None:
            sent = self.poll_in_flight
            try:
                env = yield from self._wait_sending_acks(sent.reply, min(deadline, sent.give_up_at) - self.clock())
            except RequestTimeout:
                if self.clock() < sent.give_up_at:
                    return None  # still parked at the coordinator: kept for the next poll
                self.abandon_poll_in_flight()
            else:
                self.poll_in_flight = None
                reply = self.core.poll_replied(sent, env, self.clock())
                if reply is not None:
                    return reply
                if self.core.rejoin_after(env.error, sent.member_id, sent.generation):
                    yield from self.rejoin()
        return (yield from self._poll_now(max_records, max(0.0, deadline - self.clock())))

    def _poll_now(self, max_records: int, timeout: float) -> Flow:
        """A Poll that waits for its reply (its acks re-sent if it is fenced and sent again).
        Cut short (cancelled), it stays in flight: the next poll takes its reply."""
        retry = GroupCallRetry(self.conn.coordinators)
        while True:
            if self.needs_rejoin:
                yield from self.rejoin()
            member_id, generation = self.core.member_id, self.core.generation
            try:
                sent = yield from self._send_poll(max_records, max_wait_ms(timeout))
                try:
                    env = yield from self._wait_sending_acks(sent.reply, sent.give_up_at - self.clock())
                except RequestTimeout:
                    self.abandon_poll_in_flight()
                    raise
                self.poll_in_flight = None
                reply = self.core.poll_replied(sent, env, self.clock())
                if reply is not None:
                    return reply
                raise env.error  # FENCED or UNKNOWN_MEMBER: the acks are held again
            except ZBrokerError as err:
                yield from self._after_group_error(retry, err, member_id, generation)

    def _send_poll(self, max_records: int, wait_ms: int) -> Flow:
        """Send a Poll carrying the held acks; it is the Poll in flight until its reply is taken."""
        acks = yield from self._acks_for_poll()
        poll = self.core.poll_request(max_records, wait_ms, acks)
        try:
            corr = yield Send(None, poll)
        except BaseException:
            self._hold_again(acks)  # not known to be sent: they go again (a repeated ack is harmless)
            raise
        self.poll_in_flight = self.core.poll_sent(corr, poll, self.clock(), self.conn.request_timeout)
        return self.poll_in_flight

    def _send_poll_ahead(self, max_records: int, wait_ms: int) -> Flow:
        """Ask for the next lease now, so the coordinator works while the caller handles this batch."""
        if self.needs_rejoin:
            return  # the next poll re-joins first
        try:
            yield from self._send_poll(max_records, wait_ms)
        except ZBrokerError:
            pass  # the next poll asks the usual way

    def abandon_poll_in_flight(self) -> None:
        """Stop waiting for the Poll in flight; the acks it carried are held again."""
        sent, self.poll_in_flight = self.poll_in_flight, None
        if sent is not None:
            self.conn.correlation.orphan(sent.reply)
            self.conn.correlation.early.pop(sent.reply, None)
            self._hold_again(sent.acks)

    def _wait_sending_acks(self, corr: int, wait: float) -> Flow:
        """Wait for the reply to ``corr``, sending the held acks when their interval is up meanwhile.

        When the acks are due and the reply is already in, they stay held: the Poll sent as
        soon as this batch is handed out takes them along. Otherwise they go now; the Poll
        may be waiting for exactly the capacity they free.
        """
        deadline = self.clock() + max(0.0, wait)
        while True:
            due = self.core.acks_due_at(self.clock())
            until = deadline if due is None else min(deadline, due)
            try:
                return (yield Wait(corr, max(0.0, until - self.clock())))
            except RequestTimeout:
                if until >= deadline:
                    raise
                self.conn.collect()
                if corr in self.conn.correlation.early:
                    return (yield Wait(corr, 0.0))
                yield from self.flush_acks(wait=False)

    # -- fetching the leases' records -----------------------------------------------------------

    def _fetch(self) -> Flow:
        """Fetch the records of `to_fetch` into `core.held`, as `fetch_round.FetchRound` plans and
        folds them: what the read-ahead holds first, a `fetch_many` per actor, the rest of a lease
        max_bytes cut short. Cut short, what was filed is handed out and the rest fetched by the
        next poll; nothing twice."""
        core, correlation = self.core, self.conn.correlation
        fetches = FetchRound(core, self.to_fetch)
        waiting: set[int] = set()
        try:
            ahead_deadline = self.clock() + READ_AHEAD_WAIT_S
            for i, d in enumerate(fetches.deliveries):
                if core.reading_ahead and fetches.lacking[i] is not None:
                    yield from self._serve_from_read_ahead(fetches, i, ahead_deadline)
                if fetches.lacking[i] is not None:
                    yield from self._route(fetches, (i, d, fetches.lacking[i]))
            yield from self._send_fetches(fetches, waiting)
            while (corr := fetches.next_awaited()) is not None:
                waiting.discard(corr)
                env, err = None, None
                try:
                    env = yield Wait(corr)
                except RequestTimeout as timeout:
                    correlation.orphan(corr)  # a reply that comes after all is dropped
                    err = timeout
                for item in fetches.replied(corr, env, err, self.clock()):
                    yield from self._route(fetches, item, alone=True)
                yield from self._send_fetches(fetches, waiting)
        finally:
            for corr in waiting:
                correlation.orphan(corr)
            core.held.extend(part for part in fetches.parts if part)
            self.to_fetch = fetches.unfinished()

    def _route(self, fetches: FetchRound, item: tuple, alone: bool = False) -> Flow:
        d = item[1]
        try:
            endpoint = yield Endpoint(d[0], d[1])
        except ZBrokerError as err:
            fetches.unroutable(item, err, self.clock())
            return
        fetches.route(item, endpoint, alone=alone)

    def _send_fetches(self, fetches: FetchRound, waiting: set[int]) -> Flow:
        for request in fetches.requests():
            try:
                corr = yield Send(request[0], request[1])
            except ZBrokerError as err:
                fetches.send_failed(request, err, self.clock())
                continue
            fetches.sent(corr, request)
            waiting.add(corr)
        self._give_up(fetches.take_given_up())

    def _serve_from_read_ahead(self, fetches: FetchRound, i: int, deadline: float) -> Flow:
        """Hand what the read-ahead holds of delivery ``i`` to its part of ``fetches``, waiting
        until ``deadline`` (one for the poll) for the fetch out that may bring it."""
        core = self.core
        delivery = fetches.deliveries[i]
        key = (delivery[0], delivery[1])
        while True:
            pos, awaited, given_up = core.serve_lease_from_read_ahead(delivery, fetches.lacking[i],
                                                                      fetches.parts[i], self.clock())
            fetches.served(i, pos)
            self._give_up(given_up)
            if awaited is None:
                break
            try:
                # The lease proves the records exist, so a live actor answers at once; one that
                # died with the fetch parked never will: give up soon, with one deadline for the
                # whole poll (not one per partition the dead actor held).
                env = yield Wait(awaited, max(0.005, deadline - self.clock()))
            except RequestTimeout:
                self.conn.correlation.orphan(awaited)  # this reply, and later ones of its fetch, are dropped
                self._give_up(core.give_up_read_ahead(key, self.clock()))
            else:
                core.read_ahead_replied(key, awaited, env, self.clock())
        core.lease_served(delivery)

    # -- read-ahead and ahead leases --------------------------------------------------------------

    def _collect_read_ahead(self) -> None:
        self.conn.collect()
        self._give_up(self.core.collect_read_ahead(self.conn.correlation.early, self.clock()))

    def send_read_ahead(self, timeout: float, collected: bool = False) -> Flow:
        """Send the read-ahead fetches the core wants. ``collected``: the replies that came in
        were just filed (one receive fewer on the path of every record under an ahead lease)."""
        if not collected:
            self._collect_read_ahead()
        for key, fetch in self.core.read_ahead_fetches(max_wait_ms(timeout), self.clock()):
            try:
                corr = yield Send((yield Endpoint(*key)), fetch)
            except ZBrokerError:
                corr = None  # not reachable now: the next lease is fetched the usual way
            self.core.read_ahead_sent(key, corr, fetch, self.clock(), self.conn.request_timeout)

    def _records_ahead(self, max_records: int, deadline: float) -> Flow:
        """Hand out what the parked fetches brought under the ahead leases, waiting until
        ``deadline`` for some; returns early (empty) when the Poll in flight is answered."""
        core = self.core
        while True:
            self._collect_read_ahead()
            parts, given_up = core.ahead_records(max_records, self.clock())
            self._give_up(given_up)
            if parts:
                core.held.extend(parts)
                records = core.hand_out(max_records)
                if self.poll_in_flight is None and core.ahead_leases:
                    yield from self._send_poll_ahead(max_records, max_wait_ms(deadline - self.clock()))
                yield from self.send_read_ahead(max(0.0, deadline - self.clock()), collected=True)
                return records
            sent = self.poll_in_flight
            if not core.ahead_leases or (sent is not None and sent.reply in self.conn.correlation.early):
                return []  # all used up, or the coordinator answered: the caller takes it from here
            if sent is None:
                # Redeliveries, and the next ahead lease once this one is used up, come from a poll.
                yield from self._send_poll_ahead(max_records, max_wait_ms(deadline - self.clock()))
            yield from self.send_read_ahead(max(0.0, deadline - self.clock()), collected=True)
            now = self.clock()
            due = core.acks_due_at(now)
            until = deadline if due is None else min(deadline, due)
            if until <= now:
                if due is not None and due <= now:
                    yield from self.flush_acks(wait=False)
                    continue
                return []
            yield WaitAny(until - now)

    # -- acks -----------------------------------------------------------------------------------

    def _acks_for_poll(self) -> Flow:
        """Take the held acks for the Poll about to be sent (`ConsumerCore.acks_for_poll`); those
        one header cannot hold go first, on their own."""
        riding, rest = self.core.acks_for_poll()
        if rest:
            try:
                yield from self._send_acks(rest, [])
            except BaseException:
                self._hold_again(riding)
                raise
        return riding

    def flush_acks_if_due(self) -> Flow:
        due = self.core.acks_due_at(self.clock())
        if due is not None and due <= self.clock():
            yield from self.flush_acks(wait=False)
        elif self.ack_requests:
            yield from self._collect_ack_replies(block=False)

    def flush_acks(self, wait: bool = True) -> Flow:
        """Send the held acks; with ``wait``, until every ack made before the call is applied.

        Acks riding on a Poll still waiting at the coordinator were applied when it arrived:
        an ack request sent after it on the same socket, answered, proves it (the coordinator
        serves one connection's requests in order), so ``wait`` sends one, empty if need be.
        """
        core = self.core
        if wait:
            # Requests sent earlier and not answered yet go again with these (one lost with a
            # coordinator that restarted would otherwise fail the flush after the request
            # timeout; a repeated ack is harmless): answered, the new request proves them all.
            for corr in self.ack_requests.waiting():
                self.conn.correlation.orphan(corr)
                self._hold_again(self.ack_requests.lost(corr))
        core.fold_in_order_acks()
        sent = self.poll_in_flight
        riding = sent.acks if sent is not None else []
        if core.acks or (wait and riding):
            ranges = core.take_acks()
            # Answered => the Poll sent before it in this generation applied its acks (or was
            # fenced, and then so is this request: see ack_replied).
            before = sent.take_acks() if wait and riding else []
            yield from self._send_acks(ranges, before)
        core.acks_since = None
        yield from self._collect_ack_replies(block=wait)

    def _send_acks(self, ranges: list, before: list) -> Flow:
        """The ack requests for ``ranges`` (`AckRequests.requests`, the last one also standing for
        ``before``); what could not be sent is held again (and the error raised)."""
        requests = AckRequests.requests(ranges, before)
        for i, (chunk, rode) in enumerate(requests):
            try:
                corr = yield Send(None, self.core.member_request(m.Ack, ranges=chunk))
            except BaseException:
                self._hold_again([r for rest, rode_on in requests[i:] for r in (*rode_on, *rest)])
                raise
            self.ack_requests.sent(corr, chunk, rode, self.clock())

    def _collect_ack_replies(self, block: bool) -> Flow:
        """Take the replies of the ack requests out, each as it comes (one that never comes must
        not hide the others: a FENCED one among them means re-join now). With ``block``, wait for
        all of them. A request without a reply within the request timeout has its ranges held
        again, to go with the next request; with ``block`` its timeout is raised once the others
        are taken."""
        lost: RequestTimeout | None = None
        requests, correlation = self.ack_requests, self.conn.correlation
        while requests:
            if not block:
                self.conn.collect()
            for corr in requests.waiting():
                env = None
                if block or corr in correlation.early:
                    try:
                        env = yield Wait(corr)
                    except RequestTimeout as err:
                        lost = err
                    except BaseException:
                        # Cut short (cancelled, interrupted): every request not answered is given up
                        # on, its acks held again (sent again, a repeated ack is harmless).
                        for waiting in requests.waiting():
                            correlation.orphan(waiting)
                            self._hold_again(requests.lost(waiting))
                        raise
                elif not requests.overdue(corr, self.clock(), self.conn.request_timeout):
                    continue  # still on its way
                if env is None:
                    correlation.orphan(corr)
                    self._hold_again(requests.lost(corr))
                    continue
                yield from self.ack_replied(env, *requests.answered(corr))
            if not block:
                break  # (a re-sent request, after a FENCED reply, is taken next time)
        if lost is not None:
            raise lost

    def ack_replied(self, env: Envelope, ranges: list, before: list = ()) -> Flow:
        """``before``: acks that rode on Polls sent before this request; they were applied if this
        one was, and are sent again with it if it was fenced."""
        core = self.core
        if env.error is None:
            core.applied(env.msg.applied, [])
            return
        outcome = core.ack_refused(env.error, [*before, *ranges], self.clock())
        if outcome == ACK_REJOIN:
            yield from self.rejoin()  # raising, the acks stay held: they go after a later join
            yield from self._send_acks(core.take_acks(), [])
        elif outcome == ACK_FAILED:
            raise env.error
        else:
            assert outcome == ACK_STALE

    def lease_call(self, op: type, records: Iterable[ConsumedRecord], **fields: Any) -> Flow:
        """A nack, extend or reject of ``records``: records applied, over as many requests as the
        ranges need (the held acks go first: a nack must not overtake an ack of the same lease)."""
        yield from self.flush_acks(wait=True)
        settled = ChunkedSettle()
        for chunk in in_request_sized_chunks(group_by_lease(records)):
            try:
                env = yield from self.group_call(
                    lambda chunk=chunk: self.core.member_request(op, ranges=chunk, **fields))
            except StaleLease as err:  # its valid ranges were applied: the next chunks go all the same
                settled.refused(err)
            else:
                settled.replied(env.msg)
        return settled.outcome()

    def close(self, leave: bool) -> Flow:
        """Send the held acks (waiting until they are applied: a failure is the caller's to see),
        then leave the group, so its leases go to the others at once."""
        yield from self.flush_acks(wait=True)
        if leave and self.core.member_id:
            try:
                yield from self.call(None, self.core.member_request(m.Leave), timeout=2.0)
            except ZBrokerError:
                pass  # not leaving costs only a session timeout before a rebalance
