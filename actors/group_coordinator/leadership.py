"""Coordinator leadership: who leads the cluster, and when this node must stop acting. Pure.

Theory of operation
-------------------
The nodes of a cluster share one lease row in PostgreSQL (issue 26). Its
epoch grows by one every time a node takes the lease after it expired, and
every write that lands in the store is conditional on the writer's epoch
still being the row's (the *fencing token*, `storage.offsets.metadata`). The
database's clock alone decides expiry: the store's
``acquire_or_renew_lease`` compares with ``now()`` on the server.

This core decides, for one node, when to ask for the lease (every
``renew_interval_ms``, leader or not: a standby's ask is a takeover attempt)
and whether the node may act as leader *now*. Fencing makes a deposed leader's
writes harmless; stepping down on time keeps it from answering clients as
leader meanwhile. The rule that makes "at most one node acts as leader at
any database time" hold:

    acting  iff  the last answer said "held" for epoch E
            and  now < local_deadline
    local_deadline = (local time the request was SENT)
                     + min(lease_ms, remaining_ms) - safety_margin_ms

The server runs the statement after the request was sent, so the lease it
grants ends, on its clock, at least ``lease_ms`` after the send. Counting
from the send, never from the answer's arrival, means a slow database or
network shortens the local belief and can never lengthen it. The margin
covers a local clock that runs slower than the server's (up to
``safety_margin_ms / lease_ms``, 10 % by default). A node paused by SIGSTOP
finds, when it runs again, that its deadline passed: `acting` is judged
against the time given, so it stops before doing anything, even before the
next tick.

Stepping down is a decision of this core alone: no answer is needed (a
leader cut off from the database stops by itself). An answer whose request
is not the one in flight (it outlived its timeout) is ignored; that only
ever makes the belief shorter. Epochs never go backwards: an answer with an
epoch below one this node has seen (a database restored from an older
state) is not acted upon, and the node lets that lease run out so that the
next take moves the epoch past it.

Effects: `RenewLease` (ask the commit writer, and report with
`on_lease_answer` / `on_lease_failed`), `BecomeLeader`, `StepDown`,
`LeaderKnown` (who leads, for NOT_COORDINATOR's ``data.leader``).
Time is always passed in, in milliseconds of a monotonic clock.
"""

from __future__ import annotations

import dataclasses
import math

from zbroker.protocol.errors import ZBrokerError
from zbroker.storage.offsets.metadata import LeaseState


@dataclasses.dataclass(frozen=True, slots=True)
class LeadershipConfig:
    lease_ms: int = 5000
    renew_interval_ms: int = 1000
    safety_margin_ms: int = 500
    # An ask unanswered this long is given up (it may still run on the server, later:
    # harmless, because its answer is then ignored).
    request_timeout_ms: int = 2000

    def __post_init__(self) -> None:
        if not (0 < self.renew_interval_ms and 0 <= self.safety_margin_ms
                and self.renew_interval_ms + self.safety_margin_ms < self.lease_ms
                and 0 < self.request_timeout_ms):
            raise ZBrokerError("coordinator lease settings must satisfy renew_interval_ms + safety_margin_ms "
                               "< lease_ms", lease_ms=self.lease_ms, renew_interval_ms=self.renew_interval_ms,
                               safety_margin_ms=self.safety_margin_ms)


# -- effects ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class RenewLease:
    """Ask the store (through the commit writer) to take or renew the lease; report back."""
    request_id: int
    node_id: str
    endpoint: str
    lease_ms: int


@dataclasses.dataclass(frozen=True, slots=True)
class BecomeLeader:
    """Start acting at `epoch`: load metadata and offsets, serve clients, fence every write with it."""
    epoch: int


@dataclasses.dataclass(frozen=True, slots=True)
class StepDown:
    """Stop acting at `epoch` now: answer clients NOT_COORDINATOR, drop in-memory leases."""
    epoch: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class LeaderKnown:
    """The lease row names this holder (None: no one has taken it yet)."""
    node_id: str | None
    endpoint: str | None
    epoch: int


Effect = RenewLease | BecomeLeader | StepDown | LeaderKnown


class Leadership:
    def __init__(self, node_id: str, endpoint: str, config: LeadershipConfig | None = None) -> None:
        self.node_id = node_id
        self.endpoint = endpoint
        self.config = config or LeadershipConfig()
        self.epoch: int | None = None  # the epoch this node leads at; None: standing by
        self.deadline_ms: float | None = None  # local: stop acting at this time
        self.highest_epoch_seen = 0
        self.leader: LeaderKnown | None = None
        self._next_id = 0
        self._inflight: tuple[int, float] | None = None  # (request id, local send time)
        self._next_ask_ms: float | None = None  # None: ask at the first tick
        # After an answer below the highest epoch seen: stay out until that lease has run out.
        self._wait_until_ms = -math.inf  # monotonic clocks may start anywhere, even below zero

    # -- queries ---------------------------------------------------------------------------

    def acting(self, now_ms: float) -> bool:
        """May this node act as leader at `now_ms`? The shell asks before every leader action."""
        return self.epoch is not None and self.deadline_ms is not None and now_ms < self.deadline_ms

    def next_deadline(self) -> float:
        """When on_tick has something to do."""
        due = [max(self._next_ask_ms if self._next_ask_ms is not None else -math.inf, self._wait_until_ms)]
        if self._inflight is not None:
            due = [self._inflight[1] + self.config.request_timeout_ms]
        if self.epoch is not None and self.deadline_ms is not None:
            due.append(self.deadline_ms)
        return min(due)

    # -- inputs ----------------------------------------------------------------------------

    def on_tick(self, now_ms: float) -> list[Effect]:
        effects = self._step_down_if_due(now_ms)
        if self._inflight is not None and now_ms >= self._inflight[1] + self.config.request_timeout_ms:
            self._inflight = None  # given up; its answer, if one comes, is ignored
        if self._inflight is None and (self._next_ask_ms is None or now_ms >= self._next_ask_ms) \
                and now_ms >= self._wait_until_ms:
            self._next_id += 1
            self._inflight = (self._next_id, now_ms)
            self._next_ask_ms = now_ms + self.config.renew_interval_ms
            effects.append(RenewLease(self._next_id, self.node_id, self.endpoint, self.config.lease_ms))
        return effects

    def on_lease_answer(self, request_id: int, lease: LeaseState, now_ms: float) -> list[Effect]:
        if self._inflight is None or self._inflight[0] != request_id:
            return []
        _id, sent_ms = self._inflight
        self._inflight = None
        effects: list[Effect] = []
        if lease.epoch < self.highest_epoch_seen:
            # The store went back in time (restored, or failed over to a replica that lost the
            # latest commits). Acting at an epoch already used could let two leaders share it.
            effects += self._step_down("the store answered an epoch older than one already seen")
            self._wait_until_ms = sent_ms + max(lease.remaining_ms, 0)
            return effects
        self.highest_epoch_seen = lease.epoch
        known = LeaderKnown(lease.holder, lease.holder_endpoint, lease.epoch)
        if known != self.leader:
            self.leader = known
            effects.append(known)
        if not lease.held:
            return effects + self._step_down(f"the lease is held by {lease.holder} at epoch {lease.epoch}")
        deadline = sent_ms + min(self.config.lease_ms, lease.remaining_ms) - self.config.safety_margin_ms
        if self.epoch is not None and self.epoch != lease.epoch:
            # Our lease ran out and we took it again: a new term, everything reloads.
            effects += self._step_down(f"retook the lease at a new epoch {lease.epoch}")
        if now_ms >= deadline:
            # Granted, but the answer came too late to be of use: this grant may already be
            # over on the server. Not acting; the next ask renews it if it still stands.
            return effects + self._step_down("the lease answer arrived after the lease could have ended")
        self.deadline_ms = deadline
        if self.epoch is None:
            self.epoch = lease.epoch
            effects.append(BecomeLeader(lease.epoch))
        return effects

    def on_lease_failed(self, request_id: int, now_ms: float) -> list[Effect]:
        """The ask failed (store error, timeout): nothing is known; the deadline stands."""
        if self._inflight is not None and self._inflight[0] == request_id:
            self._inflight = None
        return self._step_down_if_due(now_ms)

    # -- internals -------------------------------------------------------------------------

    def _step_down_if_due(self, now_ms: float) -> list[Effect]:
        if self.epoch is not None and (self.deadline_ms is None or now_ms >= self.deadline_ms):
            return self._step_down("could not renew the lease before it might end")
        return []

    def _step_down(self, reason: str) -> list[Effect]:
        if self.epoch is None:
            return []
        epoch, self.epoch, self.deadline_ms = self.epoch, None, None
        return [StepDown(epoch, reason)]
