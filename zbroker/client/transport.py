"""What the sync and the asyncio drivers share below the protocol decisions.

Theory of operation
-------------------
A client holds one DEALER per actor endpoint (`sockets.client_dealer`) and matches
replies to requests by correlation id (`Correlation`): ids are handed out in
order, a request answered more than once (a fetch with ``follow``) reserves
the ids of its later replies, a reply that arrives before anyone waits for it
is kept (`early`), and the replies of requests given up on (orphans: single
ids, and the id ranges a followed fetch reserved) are dropped when they come.
`Coordinators` is the bootstrap list: the comma-separated coordinator URLs a
client may talk to, and which one it talks to now (it follows a
NOT_COORDINATOR hint, or rotates to the next URL after a timeout).

`Correlation` and `Coordinators` do no I/O (this module imports no zmq): the
drivers read the clock and the sockets and tell them what happened.
"""

from __future__ import annotations

import bisect
from typing import Any

import structlog

from zbroker.protocol.errors import ErrorCode

log = structlog.get_logger("zbroker.client")
DEFAULT_URL = "tcp://127.0.0.1:7400"
MAX_ORPHANS = 4096
# Id ranges of read-ahead fetches given up on (a followed fetch reserved up to 65
# ids, most never used): kept apart from MAX_ORPHANS single ids, so that rebalances
# of many partitions do not overflow that set and leave their replies stranded.
MAX_ORPHAN_RANGES = 4096


class Correlation:
    """Correlation ids, replies that came before their waiter, and ids given up on."""

    __slots__ = ("_next", "early", "_orphans", "_firsts", "_lasts")

    def __init__(self) -> None:
        self._next = 1
        self.early: dict[int, Any] = {}  # corr id -> envelope, until its waiter takes it
        self._orphans: set[int] = set()
        self._firsts: list[int] = []  # sorted, disjoint [first, last] id ranges given up on
        self._lasts: list[int] = []

    def allocate(self, replies: int = 1) -> int:
        """The id of a new request; its later replies (``replies - 1`` of them) come under id + 1, ..."""
        corr = self._next
        self._next = corr + max(1, replies)
        return corr

    def keep(self, env: Any) -> None:
        """A reply nobody is waiting for yet: kept for its waiter (replies without an id are dropped)."""
        if isinstance(env.corr_id, int):
            self.early[env.corr_id] = env

    def file(self, env: Any) -> bool:
        """A reply that came with nobody waiting (the asyncio reader's way): dropped if it was
        given up on (a single id is then forgotten: it has its one reply), else kept. True if kept."""
        corr = env.corr_id
        if corr in self._orphans:
            self._orphans.discard(corr)
            return False
        if self.orphaned(corr):
            return False
        self.early[corr] = env
        return True

    def orphan(self, corr: int) -> None:
        """Give up on the reply to ``corr``: it is dropped if it comes."""
        self._orphans.add(corr)

    def orphan_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Give up on every reply under these [first, last] id ranges."""
        firsts, lasts = self._firsts, self._lasts
        for first, last in ranges:
            i = bisect.bisect(firsts, first)
            firsts.insert(i, first)
            lasts.insert(i, last)
        if len(firsts) > MAX_ORPHAN_RANGES:  # the oldest ids: their replies came long ago or never will
            del firsts[:len(firsts) - MAX_ORPHAN_RANGES], lasts[:len(lasts) - MAX_ORPHAN_RANGES]

    def orphaned(self, corr: int) -> bool:
        if corr in self._orphans:
            return True
        i = bisect.bisect(self._firsts, corr) - 1
        return i >= 0 and corr <= self._lasts[i]

    def has_orphans(self) -> bool:
        return bool(self._orphans or self._firsts)

    def drop_orphans(self) -> None:
        """Drop the kept replies of requests given up on."""
        if len(self._orphans) > MAX_ORPHANS:  # replies that never came (their actor died): stop waiting
            self._orphans.clear()
        early = self.early
        for corr in [c for c in early if self.orphaned(c)]:
            del early[corr]
            self._orphans.discard(corr)


def bootstrap_urls(url: str) -> list[str]:
    """The coordinator URLs of a client URL argument: one, or several separated by commas."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no coordinator URL in {url!r} (a URL looks like tcp://HOST:PORT)")
    return urls


class Coordinators:
    """The bootstrap list and the coordinator a client talks to now.

    A single URL behaves as before. With several, a NOT_COORDINATOR answer that
    names the leader (``data.leader.endpoint``) moves the client there, and one
    that names none, or a timeout, moves it to the next URL of the list; the
    caller retries after `backoff` seconds, so a failover is a pause, not an error.

    A leader that stopped answering (timeout, or no connection) is remembered with
    the epoch it was named at: standbys keep naming it until its lease runs out by
    the database's clock, and following them back to it cost a request timeout each
    time (5 s; the failover benchmark's worst kill took 10.5 s that way). A redirect
    to it at that epoch or older moves the client on through the list instead; one
    at a newer epoch (it came back and leads again) is followed. Any answer forgets it.
    A leader the client was sent to is left on a timeout even with one URL: it goes
    back to the list.
    """

    BACKOFF_START_S, BACKOFF_MAX_S = 0.05, 2.0

    def __init__(self, url: str) -> None:
        self.urls = bootstrap_urls(url)
        self.current = self.urls[0]
        self._failures = 0
        self._current_epoch: int | None = None  # the epoch `current` was named leader at, if it was
        self._unreachable: tuple[str, int | None] | None = None

    @property
    def several(self) -> bool:
        return len(self.urls) > 1

    def redirected(self, error: Any) -> bool:
        """After ``error`` from the current coordinator: True if the request should go again
        (to `current`, after `backoff()`), False if the error is the caller's to handle."""
        code = getattr(error, "code", None)
        if code is ErrorCode.NOT_COORDINATOR:
            leader = (getattr(error, "data", None) or {}).get("leader")
            endpoint = leader.get("endpoint") if isinstance(leader, dict) else None
            epoch = leader.get("epoch") if isinstance(leader, dict) else None
            epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
            if isinstance(endpoint, str) and endpoint and endpoint != self.current \
                    and not self._known_unreachable(endpoint, epoch):
                self.current, self._current_epoch = endpoint, epoch
            else:
                self._rotate()
            self._failures += 1
            return True
        if (self.several or self.current not in self.urls) and (code is ErrorCode.TIMEOUT or (
                # No connection to it (the send gave up: a killed node refuses connections,
                # and the socket queues nothing towards a peer not connected): as a timeout.
                # Without this a client sent to a dead leader retried it for ever.
                code is ErrorCode.UNAVAILABLE and (getattr(error, "data", None) or {}).get("endpoint") == self.current)):
            self._unreachable = (self.current, self._current_epoch)
            self._rotate()
            self._failures += 1
            return True
        return False

    def _known_unreachable(self, endpoint: str, epoch: int | None) -> bool:
        if self._unreachable is None or self._unreachable[0] != endpoint:
            return False
        seen = self._unreachable[1]
        return seen is None or epoch is None or epoch <= seen

    def _rotate(self) -> None:
        self._current_epoch = None
        if self.current in self.urls:
            self.current = self.urls[(self.urls.index(self.current) + 1) % len(self.urls)]
        else:  # a leader we were sent to stopped answering: back to the list
            self.current = self.urls[0]
        if self.several and self._unreachable is not None and self.current == self._unreachable[0]:
            # Round the list past the one that stopped answering (the second 5 s of a failover
            # was the rotation coming back to the killed node); an answer puts it back.
            self.current = self.urls[(self.urls.index(self.current) + 1) % len(self.urls)]

    def retry_in(self, error: Any, attempt: int) -> float | None:
        """After ``error`` answered the ``attempt``-th try (from 0) of a coordinator request:
        seconds to wait before sending it again to `current`, or None: the caller raises."""
        if attempt >= self.attempts() - 1 or not self.redirected(error):
            return None
        log.info("coordinator.redirected", code=error.code.value, to=self.current)
        return self.backoff()

    def backoff(self) -> float:
        """Seconds to wait before the next attempt: doubling with each failure in a row, capped."""
        return min(self.BACKOFF_MAX_S, self.BACKOFF_START_S * (2 ** max(0, self._failures - 1)))

    def answered(self) -> None:
        self._failures = 0
        self._unreachable = None

    def attempts(self) -> int:
        """How many redirects a call follows before giving up: every URL a few times over."""
        return 4 * len(self.urls) + 4
