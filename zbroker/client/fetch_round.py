"""The fetches of one poll's deliveries, without I/O: which requests, and how their replies fold.

Theory of operation
-------------------
A poll hands out the records of its deliveries, each a leased range
[start, end) of one partition. What the read-ahead already holds is served
first (the driver does that, since it may wait for a parked fetch); the rest
of each delivery is an *item* (index, delivery, offset to fetch from) that the
driver routes to its partition actor (`route`, or `unroutable` when the
metadata names no owner). `requests` then says what to send: the items of one
actor together in a `fetch_many` (issue #29: at 1,024 partitions a poll's
thousand records came one or two per partition, a fetch each), or a `fetch`
alone where the actor predates `fetch_many` or an item is a rest. The driver
reports each request `sent` (or `send_failed`), waits for the one
`next_awaited` names, and hands its reply (or the timeout) to `replied`,
which files the records under their delivery (`parts`, in offset order: a
delivery's records are consecutive offsets, which lets acks given in order
fold into one range) and returns the items still to fetch alone: the rest of
a lease that max_bytes cut short, or the parts of a `fetch_many` an old actor
refused. A partition that cannot be fetched costs only its own deliveries
(their leases expire and come back). The correlation id ranges of read-ahead
fetches given up on along the way collect in `given_up`, for the driver to
drop their replies. The decisions per reply are `ConsumerCore`'s (fetch sizes,
`single_fetch_only`, what a failure forgets); this module only orders them.

Where each delivery still lacks records is kept (`lacking`: advanced by what the
read-ahead served (`served`) and by each reply; None once it is all filed or its
partition failed), so a round cut short (an asyncio poll() cancelled) hands out
what it filed and leaves the rest to the next one (`unfinished`), and nothing
twice.
"""

from __future__ import annotations

from zbroker.client.consumer_core import ConsumerCore, plan_fetches
from zbroker.client.core import ConsumedRecord
from zbroker.protocol import messages as m
from zbroker.protocol.codec import Envelope
from zbroker.protocol.errors import ZBrokerError

Item = tuple  # (index of the delivery, the delivery, offset to fetch from)


class FetchRound:
    """One poll's lease fetches: routed items in, requests out, replies folded into `parts`."""

    def __init__(self, core: ConsumerCore, deliveries: list) -> None:
        self.core = core
        self.deliveries = deliveries
        self.parts: list[list[ConsumedRecord]] = [[] for _ in deliveries]
        self.lacking: list[int | None] = [d[3] if d[3] < d[4] else None for d in deliveries]
        self.given_up: list[tuple[int, int]] = []
        self._together: list[tuple[str, Item]] = []  # routed, to plan into fetch_many requests
        self._alone: list[tuple[str, Item]] = []  # routed, each to go as a fetch of its own
        self._many: dict[int, tuple[str, list[Item]]] = {}  # corr -> a fetch_many sent
        self._single: dict[int, Item] = {}  # corr -> a fetch sent, in the order sent

    def route(self, item: Item, endpoint: str, *, alone: bool = False) -> None:
        (self._alone if alone else self._together).append((endpoint, item))

    def served(self, i: int, pos: int) -> None:
        """The read-ahead served delivery ``i`` (into ``parts[i]``) up to ``pos``."""
        self.lacking[i] = pos if pos < self.deliveries[i][4] else None

    def unroutable(self, item: Item, err: ZBrokerError, now: float) -> None:
        """No owner is known for the item's partition (or the question failed): its delivery
        costs only itself (its lease expires and comes back)."""
        d = item[1]
        self.lacking[item[0]] = None
        self.given_up += self.core.fetch_failed((d[0], d[1]), err, now)

    def requests(self) -> list[tuple[str, m.Message, list[Item]]]:
        """What to send for the items routed since the last call: (endpoint, request, its items)."""
        out = []
        for endpoint, group in plan_fetches(self._together, self.core.single_fetch_only):
            if len(group) == 1:
                out.append((endpoint, self._fetch(group[0]), group))
            else:
                out.append((endpoint, self.core.lease_fetch_many(group), group))
        out += [(endpoint, self._fetch(item), [item]) for endpoint, item in self._alone]
        self._together, self._alone = [], []
        return out

    def _fetch(self, item: Item) -> m.Fetch:
        _i, d, start = item
        return self.core.lease_fetch(d, start)

    def sent(self, corr: int, request: tuple[str, m.Message, list[Item]]) -> None:
        endpoint, msg, items = request
        if isinstance(msg, m.FetchMany):
            self._many[corr] = (endpoint, items)
        else:
            self._single[corr] = items[0]

    def send_failed(self, request: tuple[str, m.Message, list[Item]], err: ZBrokerError, now: float) -> None:
        for item in request[2]:
            self.unroutable(item, err, now)

    def next_awaited(self) -> int | None:
        """The id of the reply to wait for next: the fetch_many requests first, then the
        fetches in the order sent (the rests they bring go out meanwhile)."""
        for waiting in (self._many, self._single):
            if waiting:
                return next(iter(waiting))
        return None

    def replied(self, corr: int, env: Envelope | None, err: ZBrokerError | None, now: float) -> list[Item]:
        """The reply to ``corr`` came (``env``), or did not in time (``err``): its records are
        filed in `parts`; returns the items to fetch alone now."""
        core, again = self.core, []
        if corr in self._many:
            endpoint, group = self._many.pop(corr)
            for i, d, start, frame, part_err in core.lease_fetch_many_replied(endpoint, group, env, err):
                if part_err is not None:
                    self.unroutable((i, d, start), part_err, now)
                elif frame is None:  # an actor without fetch_many: the usual fetch
                    again.append((i, d, start))
                else:
                    self._file(i, d, core.lease_part_fetched(d, start, frame, now, in_many=True), again)
            return again
        i, d, start = self._single.pop(corr)
        self._file(i, d, core.lease_fetch_replied(d, start, env, err, now), again)
        return again

    def _file(self, i: int, d: list, outcome: tuple[list, int | None, list], again: list) -> None:
        got, rest, given_up = outcome
        self.given_up += given_up
        self.parts[i].extend(got)
        self.lacking[i] = rest
        if rest is not None:  # max_bytes cut the range short: fetch the rest
            again.append((i, d, rest))

    def unfinished(self) -> list[list]:
        """The deliveries not all filed, each moved on (``d[3]``) to where it lacks records: for
        the next round, when this one was cut short."""
        left = []
        for d, at in zip(self.deliveries, self.lacking):
            if at is not None:
                d[3] = at
                left.append(d)
        return left

    def take_given_up(self) -> list[tuple[int, int]]:
        given_up, self.given_up = self.given_up, []
        return given_up
