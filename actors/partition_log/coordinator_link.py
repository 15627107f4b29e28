"""Which coordinator a partition actor registers with, and when it moves. Pure.

Theory of operation
-------------------
In a cluster (issue 26) every node runs a coordinator, one leads and the
others stand by. A partition actor is given one coordinator endpoint or
several (``--coordinator URL,URL``; a built-in actor of ``zbroker up`` has
its own node's). It registers with one of them at a time, once a second.

- A standby answers ``register`` with ``NOT_COORDINATOR`` and
  ``data.leader``: the actor moves to the leader's internal endpoint
  (``data.leader.internal_endpoint`` when the standby names it; otherwise
  the leader's client port + 1, where ``zbroker up`` binds its internal
  endpoint) and registers there after a backoff that doubles from 50 ms to
  2 s while the redirects go on. ``data.leader`` nil (no node holds the
  lease, mid-failover), or naming the endpoint it already talks to, moves
  it to the next endpoint of its list instead.
- Registrations unanswered for ``timeout_ms`` (the leader it followed was
  killed, or its host lost) move it to the next endpoint of the list; a
  leader it was sent to is not on the list, so it goes back to the list's
  first. Its own node's standby then names the new leader as soon as the
  lease row does.
- A leader that stopped answering is remembered with the epoch it was
  named at: standbys keep naming it until its lease runs out by the
  database's clock, and a redirect to it at that epoch or older moves the
  actor on through its list instead of back into a timeout. A newer epoch
  (it came back and leads again) is followed; an answer forgets it.
- With one endpoint and no redirect, nothing ever moves: a single-node
  broker behaves as before (ZeroMQ reconnects by itself).

Any answer other than ``NOT_COORDINATOR`` is an answer: the backoff resets.
`Move` effects say which endpoint to leave and which to dial; the shell
disconnects and connects its one DEALER. Time is passed in, in ms.
"""

from __future__ import annotations

import dataclasses
from typing import Any

BACKOFF_START_MS, BACKOFF_MAX_MS = 50, 2000
# Registrations go once a second and a live coordinator answers in well under a
# millisecond; 2.5 s unanswered (2 of them lost, and a loaded machine's slack) means
# the coordinator is gone. Moving too early costs one more redirect, nothing else.
REGISTRATION_TIMEOUT_MS = 2500


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """Leave `old`, dial `new`; `reason` is "not_coordinator" or "timeout" (for the log)."""
    old: str
    new: str
    reason: str
    leader: dict | None = None


def coordinator_endpoints(text: str) -> list[str]:
    """The endpoints of a ``--coordinator`` argument: one, or several separated by commas."""
    endpoints = list(dict.fromkeys(u.strip() for u in text.split(",") if u.strip()))
    if not endpoints:
        raise ValueError(f"no coordinator endpoint in {text!r} (one looks like tcp://HOST:PORT)")
    return endpoints


def internal_endpoint_of(leader: dict) -> str | None:
    """Where a partition actor dials the coordinator that `data.leader` names, or None."""
    internal = leader.get("internal_endpoint")
    if isinstance(internal, str) and internal:
        return internal
    endpoint = leader.get("endpoint")
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        return None
    return f"tcp://{host}:{int(port) + 1}"


class CoordinatorLink:
    def __init__(self, endpoints: str | list[str], *, timeout_ms: int = REGISTRATION_TIMEOUT_MS) -> None:
        self.endpoints = coordinator_endpoints(endpoints) if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise ValueError("a partition actor needs a coordinator endpoint")
        self.current = self.endpoints[0]
        self.timeout_ms = timeout_ms
        self.leader: dict | None = None  # the last data.leader a standby gave, for status and logs
        self._failures = 0
        self._unanswered_since_ms: int | None = None
        self._register_at_ms: int | None = None  # a registration sooner than the once-a-second one
        self._current_epoch: int | None = None  # the epoch `current` was named leader at, if it was
        self._unreachable: tuple[str, int | None] | None = None

    # -- what happened ---------------------------------------------------------------------

    def registration_sent(self, now_ms: int) -> None:
        self._register_at_ms = None
        if self._unanswered_since_ms is None:
            self._unanswered_since_ms = now_ms

    def answered(self) -> None:
        """The coordinator answered a registration (accepted, or refused for its own reasons)."""
        self._unanswered_since_ms = None
        self._failures = 0
        self._unreachable = None

    def not_coordinator(self, data: Any, now_ms: int) -> Move | None:
        """`current` stands by. Returns where to go, or None to ask `current` again (after the backoff)."""
        self._unanswered_since_ms = None
        self._failures += 1
        self._register_at_ms = now_ms + self.backoff_ms()
        leader = data.get("leader") if isinstance(data, dict) else None
        self.leader = leader if isinstance(leader, dict) else None
        target = internal_endpoint_of(self.leader) if self.leader is not None else None
        epoch = self.leader.get("epoch") if self.leader is not None else None
        epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
        if target is None or target == self.current or self._known_unreachable(target, epoch):
            return self._move_to(self._next(), "not_coordinator")
        move = self._move_to(target, "not_coordinator")
        self._current_epoch = epoch
        return move

    def tick(self, now_ms: int) -> Move | None:
        """Registrations unanswered too long: try the next endpoint."""
        if self._unanswered_since_ms is None or now_ms - self._unanswered_since_ms < self.timeout_ms:
            return None
        self._unanswered_since_ms = None
        self._failures += 1
        self._register_at_ms = now_ms + self.backoff_ms()
        self._unreachable = (self.current, self._current_epoch)
        return self._move_to(self._next(), "timeout")

    # -- what to do ------------------------------------------------------------------------

    def register_due(self, now_ms: int) -> bool:
        """A registration is due before the once-a-second one (after a move, or a redirect)."""
        return self._register_at_ms is not None and now_ms >= self._register_at_ms

    def next_deadline(self) -> int | None:
        deadlines = [d for d in (self._register_at_ms,
                                 None if self._unanswered_since_ms is None
                                 else self._unanswered_since_ms + self.timeout_ms) if d is not None]
        return min(deadlines) if deadlines else None

    def backoff_ms(self) -> int:
        return min(BACKOFF_MAX_MS, BACKOFF_START_MS * (2 ** max(0, self._failures - 1)))

    def _known_unreachable(self, endpoint: str, epoch: int | None) -> bool:
        if self._unreachable is None or self._unreachable[0] != endpoint:
            return False
        seen = self._unreachable[1]
        return seen is None or epoch is None or epoch <= seen

    def _next(self) -> str:
        if self.current in self.endpoints:
            target = self.endpoints[(self.endpoints.index(self.current) + 1) % len(self.endpoints)]
        else:
            target = self.endpoints[0]  # a leader we were sent to stopped answering: back to the list
        if len(self.endpoints) > 1 and self._unreachable is not None and target == self._unreachable[0]:
            target = self.endpoints[(self.endpoints.index(target) + 1) % len(self.endpoints)]  # past it
        return target

    def _move_to(self, target: str, reason: str) -> Move | None:
        if target == self.current:
            return None
        move = Move(old=self.current, new=target, reason=reason, leader=self.leader)
        self.current, self._current_epoch = target, None
        return move
