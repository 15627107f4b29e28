"""Replica state machine of one replicated partition: the leader's and the follower's decisions.

Theory of operation
-------------------
The coordinator (the controller) decides who leads a partition, at which
leader epoch, and which replicas are in sync (the ISR); it tells each replica
through `assign`. This class is what one replica does with that, with its
log (storage/log PartitionLog, or any object with the same `log_end`,
`log_start`, `epochs`, `read`, `append_stored`, `truncate_to`, `reset_to`)
and the time passed in; it returns effects and touches no socket.

Leader
    Followers pull (`replica_fetch`); a fetch's ``fetch_offset`` is the
    follower's log end, counted only when the fetch does not diverge (the
    follower's last epoch ends, in the leader's log, at or after it). The
    high watermark (HW) is the smallest log end over the ISR, the leader's
    own end as the shell reports it (`on_local_end`: after its fsync under
    ``--fsync always``). A produce is appended only while the ISR holds at
    least ``min_insync`` replicas (else NOT_ENOUGH_REPLICAS, nothing
    appended); its reply is held (`hold`) and released (`Acknowledge`) once
    the HW covers its batch and the ISR still holds ``min_insync``: every
    released record is then on that many replicas. A follower that has not
    caught up with the log end for ``replica_lag_ms`` is proposed out of the
    ISR, one that has caught up with the HW (and reached this epoch) back in
    (`ProposeIsr`, answered by `on_isr_recorded`). A follower whose fetch
    waits at the log end (long-polled, FETCH_WAIT_MS = 500 ms) is caught up
    for as long as that fetch waits and nothing is appended past its end:
    its lag counts from the first append it does not have, or from the end
    of its wait if it does not fetch again, never from when it last fetched.
    So a ``replica_lag_ms`` below the long-poll does not make a caught-up
    follower flap out, and a stopped one still leaves an idle partition's
    ISR (one wait plus one lag period after its last fetch). A shrink takes effect
    only when the controller has recorded it, so until then the HW still
    waits for the laggard; an expansion counts the newcomer for the HW at
    once (KIP-497's "maximal ISR"): both err on the side of waiting.
ISR floor
    A shrink never proposes fewer than ``min_insync`` members: the laggards
    holding the most stay in to make up M, and the HW waits for them. The
    ISR is what the controller elects from, so it must always name M
    replicas holding everything below the HW. Proposing the leader alone
    lost 131 acknowledged records in the replicated chaos run (seed
    649481172): a 1.8 s network cut, then the leader's host lost with its
    disk; back empty as the only ISR member, it led again and its
    followers, which held every record, truncated to it. While fewer than M
    members keep up (`keeping_up`, reported in `state_row` for `zbroker
    status`), produce is refused with NOT_ENOUGH_REPLICAS and held batches
    fail, as they did when the ISR itself shrank. Nor does the HW move while
    the recorded ISR is below M (the controller removed a dead or restarted
    member): it would cover records on fewer than M replicas.
Follower
    Sends one fetch at a time (`next_fetch`); on the reply it either resets
    its log (it holds nothing the leader still has), truncates to where it
    parts from the leader (KIP-279: the smaller of the leader's and its own
    end of the diverging epoch), or appends the batches byte for byte and
    takes over the epochs that describe them. It adopts the leader's HW,
    capped at its own log end. The leader does not answer a fetch just to
    tell it a newer HW: the fetch that moved it waits at the log end like any
    other, so a follower's HW trails the leader's by one answer (as in
    Kafka). Nothing depends on it being current: consumers read from the
    leader, and a follower elected leader serves reads from the HW its
    assignment carries and publishes none until it computed one from the
    whole ISR (below).
Epochs
    An assignment, fetch or reply of an older leader epoch is refused
    (STALE_EPOCH). A leader that learns of a newer epoch (a fetch carrying
    one, a refused ISR proposal, a newer assignment) is deposed: it fails
    every held produce with NOT_LEADER and never acknowledges another record.
    A new leader writes its epoch into the epoch cache at its log end before
    it appends anything. A replica (re)started as the leader of an epoch its
    cache already holds refuses to lead it (it may have led it before the
    restart): the controller must elect with a new epoch after a restart.

High watermark across leader changes
    A leader's HW starts where its log starts (a restarted one) or where it
    last heard it as a follower, both possibly below the HW its predecessor
    published. Every ISR member holds everything below any HW published in
    an earlier epoch, so the first HW this leader computes from the whole
    ISR in its epoch is at or above those: until then `hw_established` is
    False and the owner publishes no HW (the coordinator keeps the last one),
    so the log end the coordinator and `topics describe` show never dips
    across a restart or a failover. (Kafka checkpoints the HW to a file for
    this; here no write per published HW is needed. One exception, said in
    docs/SEMANTICS.md: a leader that lost an unsynced tail in a host crash
    and is the only ISR member left can only publish what it still holds.)
    Consumers read here up to the HW, so a new leader whose own HW is old
    would hide acknowledged records until its followers have fetched in its
    epoch; and a follower's HW can be an answer old (see Follower). So the
    assignment carries the last HW a leader published, as the controller
    heard it, and a replica that starts to lead begins from it, capped at
    its own log end: a clean election picks an ISR member, which holds
    everything below any HW published before. It publishes nothing on that
    account: the first HW it publishes is still the one computed from its
    ISR.

Waiting fetches (leader)
    A follower's fetch at the log end waits (the owner holds it, as a
    `WaitingFetch`) until the leader has something for it. It asks for
    ``min_bytes`` and a ``linger_ms`` (Kafka's replica.fetch.min.bytes, with a
    wait of its own, short, beside the long poll): `answer_at` answers it at
    once when nothing more is expected soon, when ``min_bytes`` are there, or
    ``linger_ms`` after the first byte it lacks was appended, whichever comes
    first; always at the end of its long poll. "Expected" means: the bytes
    appended in the last APPEND_RATE_WINDOW_MS, coming at that rate for the
    linger, would bring what it lacks to ``min_bytes``. Under a stream of
    produce requests one answer then carries several batches (one fetch round
    per follower for them, not one each); a trickle of small produces is
    answered at once, so its acknowledgement waits no linger. The wait
    changes when an acknowledgement comes, never what is acknowledged.

The producer window survives a leader change without work here: followers
store the same batches, so their logs rebuilt the same producer state.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from typing import Any

from zbroker.protocol import messages as m
from zbroker.protocol.errors import CorruptBatch, NotEnoughReplicas, NotLeader, StaleEpoch, ZBrokerError
from zbroker.storage.log.epochs import NO_EPOCH

DEFAULT_REPLICA_LAG_MS = 10_000
FETCH_WAIT_MS = 500
FETCH_MAX_BYTES = 1 << 20
# What a follower asks a waiting fetch to gather before it is answered, and for how long at
# most after the first byte (see "Waiting fetches" above). 64 KiB: a few produce requests'
# batches (the benchmark's 500 records of 100 B are 53 KB). A leader honours a linger of up
# to APPEND_RATE_WINDOW_MS.
FETCH_MIN_BYTES = 64 << 10
FETCH_LINGER_MS = 2
# The appends of this last stretch of time tell whether more are coming soon.
APPEND_RATE_WINDOW_MS = 10
# After a failed fetch (leader unreachable, or it does not lead yet), try again this much later.
FETCH_RETRY_MS = 100
# An ISR proposal unanswered this long is sent again (the coordinator may have restarted).
ISR_RETRY_MS = 2000


@dataclasses.dataclass(frozen=True)
class ReplicaState:
    """One `assign` replicas entry's state (docs/PROTOCOL.md, assign)."""
    leader_epoch: int
    leader: str | None
    leader_endpoint: str | None
    replicas: tuple[str, ...]
    isr: tuple[str, ...]
    min_insync: int
    replica_endpoints: dict
    # The last high watermark a leader of this partition published, as the controller heard
    # it (None: not known). A replica that starts to lead begins from it, capped at its own
    # log end (see "High watermark across leader changes").
    high_watermark: int | None = None

    @classmethod
    def from_wire(cls, state: dict) -> "ReplicaState":
        return cls(state["leader_epoch"], state["leader"], state["leader_endpoint"], tuple(state["replicas"]),
                   tuple(state["isr"]), state["min_insync"], dict(state["replica_endpoints"]),
                   state.get("high_watermark"))  # optional, checked by messages.check_replicas


# -- effects -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Acknowledge:
    """Send the held produce reply of `token`: its batch is on min_insync replicas."""
    token: Any


@dataclasses.dataclass(frozen=True, slots=True)
class Refuse:
    """Fail the held produce of `token` with `error` (it must not be acknowledged)."""
    token: Any
    error: ZBrokerError


@dataclasses.dataclass(frozen=True, slots=True)
class ProposeIsr:
    """Send `alter_isr` to the coordinator."""
    request: m.AlterIsr


@dataclasses.dataclass(slots=True)
class WaitingFetch:
    """A follower's fetch held at the leader's log end; its owner keeps it and asks `answer_at`
    when to answer it (again after each append: an append can only make that sooner)."""
    token: Any
    msg: m.ReplicaFetch
    until_ms: int      # the end of its long poll: answered then, with or without records
    from_bytes: int    # the leader's `appended_bytes` when it began to wait
    due_ms: int        # what `answer_at` said last


@dataclasses.dataclass(slots=True)
class _Follower:
    log_end: int | None = None          # None until a non-diverging fetch in this epoch
    caught_up_ms: int = 0               # last time it had everything the leader had
    waiting_until_ms: int = 0           # its last fetch at the log end waits at most until then
    last_fetch_ms: int | None = None
    leader_end_at_last_fetch: int = 0


class Replica:
    def __init__(self, topic: str, partition: int, actor_id: str, log: Any, state: ReplicaState, now_ms: int,
                 *, replica_lag_ms: int = DEFAULT_REPLICA_LAG_MS, fetch_wait_ms: int = FETCH_WAIT_MS,
                 fetch_max_bytes: int = FETCH_MAX_BYTES, fetch_min_bytes: int = FETCH_MIN_BYTES,
                 fetch_linger_ms: int = FETCH_LINGER_MS) -> None:
        self.topic = topic
        self.partition = partition
        self.actor_id = actor_id
        self.log = log
        self.replica_lag_ms = replica_lag_ms
        self.fetch_wait_ms = fetch_wait_ms
        self.fetch_max_bytes = fetch_max_bytes
        self.fetch_min_bytes = fetch_min_bytes
        self.fetch_linger_ms = fetch_linger_ms
        # Payload bytes appended by this replica as leader, ever; and of the appends of the
        # last APPEND_RATE_WINDOW_MS, (time, appended_bytes after it), oldest first, with the
        # count before the oldest of them (see "Waiting fetches").
        self.appended_bytes = 0
        self._recent_appends: collections.deque[tuple[int, int]] = collections.deque()
        self._bytes_before_recent = 0
        self.state = state
        self.high_watermark = log.log_start
        self.deposed = False          # a newer epoch exists that this replica's state does not describe
        self._local_end = log.log_end
        self._followers: dict[str, _Follower] = {}
        self._held: list[tuple[int, int, Any]] = []   # heap of (end_offset, seq, token)
        self._seq = itertools.count()
        self._proposed: tuple[str, ...] | None = None
        self._proposed_at_ms = 0
        # ISR members the last tick found lagging (leader); always a subset of the ISR, so
        # `keeping_up` is a subtraction.
        self._lagging: set[str] = set()
        self._fetch_in_flight = False
        self._next_fetch_ms = 0
        self._fetched_from: int | None = None  # the log end the latest fetch was sent from
        self._epoch_start = 0
        self._end_seen = log.log_end  # the leader's log end when the followers' catch-up was last noted
        self.reported_hw = -1  # the HW the owner last published (reports, waiting consumers)
        self.hw_established = False  # computed from the whole ISR in this epoch (see the top)
        if state.leader == actor_id and log.epochs.latest_epoch >= state.leader_epoch:
            # This replica may have led this very epoch before it restarted, and lost the
            # unsynced tail its followers already copied: leading it again would write other
            # records at those offsets under the same epoch, which truncation cannot tell
            # apart. It waits for the controller to elect it at a new epoch.
            self.deposed = True
        self._start(now_ms)

    # -- role --------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.state.leader == self.actor_id and not self.deposed

    @property
    def leader_epoch(self) -> int:
        return self.state.leader_epoch

    @property
    def isr(self) -> tuple[str, ...]:
        return self.state.isr

    def _start(self, now_ms: int) -> None:
        self._followers = {}
        self._proposed = None
        self._lagging = set()
        self._fetch_in_flight = False
        self._next_fetch_ms = 0
        self.hw_established = False
        if self.state.leader == self.actor_id:
            # Before anything of this epoch is appended, the cache says where it begins.
            self.log.epochs.assign(self.state.leader_epoch, self.log.log_end)
            self._epoch_start = self.log.log_end
            self._local_end = self.log.log_end
            self._end_seen = self.log.log_end
            if self.state.high_watermark is not None:
                # Published by a leader before: below it every ISR member (this one too) holds
                # what that leader held, so reads here need not wait for this epoch's first HW.
                self.high_watermark = max(self.high_watermark, min(self.state.high_watermark, self.log.log_end))
            for replica in self.state.replicas:
                if replica != self.actor_id:
                    # A follower gets a full lag period from the moment this replica leads.
                    self._followers[replica] = _Follower(caught_up_ms=now_ms)

    def assign(self, state: ReplicaState, now_ms: int) -> list:
        """A new assignment of this partition. Raises StaleEpoch for an older epoch."""
        if state.leader_epoch < self.state.leader_epoch:
            raise StaleEpoch("assignment of an older leader epoch", topic=self.topic, partition=self.partition,
                             epoch=self.state.leader_epoch, got=state.leader_epoch)
        effects: list = []
        if self.deposed and state.leader_epoch == self.state.leader_epoch:
            self.state = state  # still older than the epoch we have heard of: stay deposed
            self._lagging &= set(state.isr)
            return effects
        if state.leader_epoch == self.state.leader_epoch and state.leader == self.state.leader:
            # Same leadership, perhaps another ISR (the controller recorded a change).
            return self._adopt_isr(state, now_ms)
        if self.state.leader == self.actor_id:
            effects += self._fail_held(self._not_leader(state))
        self.state = state
        self.deposed = False
        self._start(now_ms)
        return self._advance(effects)

    def not_leader_error(self) -> NotLeader:
        """NOT_LEADER with data.leader, for a produce or fetch sent to this replica."""
        return self._not_leader()

    def drop_held(self) -> list:
        """The tokens of every held produce, now forgotten (the partition leaves this actor)."""
        held, self._held = self._held, []
        return [token for _end, _seq, token in sorted(held)]

    def _not_leader(self, state: ReplicaState | None = None) -> NotLeader:
        state = state or self.state
        leader = None
        if state.leader is not None and state.leader != self.actor_id and not self.deposed:
            leader = {"endpoint": state.leader_endpoint, "actor_id": state.leader,
                      "leader_epoch": state.leader_epoch}
        return NotLeader("this replica does not lead the partition", topic=self.topic, partition=self.partition,
                         leader=leader)

    def depose(self, newer_epoch: int) -> list:
        """A newer leader epoch exists: never acknowledge another record."""
        if newer_epoch <= self.state.leader_epoch or self.deposed:
            return []
        was_leader = self.state.leader == self.actor_id
        self.deposed = True
        return self._fail_held(self._not_leader()) if was_leader else []

    def _fail_held(self, error: ZBrokerError) -> list:
        held, self._held = self._held, []
        return [Refuse(token, error) for _end, _seq, token in sorted(held)]

    # -- leader: produce ---------------------------------------------------------------------

    def check_produce(self) -> ZBrokerError | None:
        """Why a produce must not be appended now, or None."""
        if not self.is_leader:
            return self._not_leader()
        if len(self.state.isr) < self.state.min_insync:
            return NotEnoughReplicas("fewer replicas in sync than min_insync", topic=self.topic,
                                     partition=self.partition, isr=list(self.state.isr),
                                     min_insync=self.state.min_insync)
        if self.short_of_insync:
            return self._not_keeping_up("fewer in-sync replicas than min_insync are keeping up")
        return None

    def hold(self, token: Any, end_offset: int, now_ms: int) -> list:
        """Hold the reply of a produce whose batch ends at `end_offset` (or of a duplicate of one),
        called as soon as the batch is appended."""
        self._note_caught_up(now_ms)
        heapq.heappush(self._held, (end_offset, next(self._seq), token))
        return self._advance([])

    def on_local_end(self, log_end: int, now_ms: int) -> list:
        """The leader's own log end as far as acknowledgement may count it (after its fsync
        under --fsync always, at once otherwise)."""
        self._note_caught_up(now_ms)
        self._local_end = log_end
        return self._advance([])

    def appended(self, nbytes: int, now_ms: int) -> None:
        """The leader appended a batch of `nbytes` (for its followers' waiting fetches)."""
        self.appended_bytes += nbytes
        self._recent_appends.append((now_ms, self.appended_bytes))
        self._forget_appends_before(now_ms - APPEND_RATE_WINDOW_MS)

    def _forget_appends_before(self, since_ms: int) -> None:
        recent = self._recent_appends
        while recent and recent[0][0] <= since_ms:
            self._bytes_before_recent = recent.popleft()[1]

    def _advance(self, effects: list) -> list:
        if not self.is_leader or len(self.state.isr) < self.state.min_insync:
            # Below min_insync the HW stays: what it would cover is on too few replicas for
            # consumers to see (and commit past), and the ISR's absentees may lead next.
            return effects
        counted = set(self.state.isr) | set(self._proposed or ())
        ends = [self._local_end]
        for replica in counted:
            if replica == self.actor_id:
                continue
            follower = self._followers.get(replica)
            if follower is None or follower.log_end is None:
                return effects  # an ISR member not heard from in this epoch: the HW waits for it
            ends.append(follower.log_end)
        self.high_watermark = max(self.high_watermark, min(ends))
        self.hw_established = True
        if len(self.state.isr) >= self.state.min_insync:
            while self._held and self._held[0][0] <= self.high_watermark:
                effects.append(Acknowledge(heapq.heappop(self._held)[2]))
        return effects

    # -- leader: replica_fetch ---------------------------------------------------------------

    def on_replica_fetch(self, msg: m.ReplicaFetch, now_ms: int) -> tuple[m.ReplicaFetchReply, bytes, list]:
        """Answer a follower's fetch: (reply, stored batches, effects). Raises STALE_EPOCH for
        an older epoch, NOT_LEADER when this replica does not lead (or the follower knows a
        newer epoch, which deposes it)."""
        if msg.leader_epoch > self.state.leader_epoch:
            effects = self.depose(msg.leader_epoch)
            raise _with_effects(self._not_leader(), effects)
        if not self.is_leader:
            raise self._not_leader()
        if msg.leader_epoch < self.state.leader_epoch:
            raise StaleEpoch("replica_fetch of an older leader epoch", topic=self.topic, partition=self.partition,
                             epoch=self.state.leader_epoch, got=msg.leader_epoch)
        log = self.log
        log_start, log_end = log.log_start, log.log_end
        reply = m.ReplicaFetchReply(self.topic, self.partition, self.state.leader_epoch, self.high_watermark,
                                    log_start, log_end)
        follower = self._followers.setdefault(msg.replica_id, _Follower(caught_up_ms=now_ms))
        if msg.fetch_offset < log_start:
            return reply, b"", []  # the follower resets to log_start
        diverging = self._diverging(msg, log_end)
        if diverging is not None:
            reply.diverging = diverging
            return reply, b"", []
        effects = self._note_follower(msg.replica_id, follower, msg.fetch_offset, log_end, now_ms,
                                      msg.max_wait_ms)
        reply.high_watermark = self.high_watermark
        data = b""
        if msg.fetch_offset < log_end:
            data = log.read(msg.fetch_offset, max(1, msg.max_bytes))
            reply.epochs = log.epochs.entries_from(msg.fetch_offset)
        return reply, data, effects

    def wait_at_end(self, token: Any, msg: m.ReplicaFetch, now_ms: int) -> WaitingFetch:
        """A fetch `on_replica_fetch` found at the log end, to be held for up to its max_wait_ms."""
        until = now_ms + msg.max_wait_ms
        return WaitingFetch(token, msg, until, self.appended_bytes, until)

    def answer_at(self, waiting: WaitingFetch, now_ms: int) -> int:
        """When to answer a held fetch: at or before `now_ms` means now (see "Waiting fetches")."""
        if now_ms >= waiting.until_ms:
            return now_ms
        lacking = self.appended_bytes - waiting.from_bytes
        if lacking <= 0:
            return waiting.until_ms
        linger = min(waiting.msg.linger_ms, APPEND_RATE_WINDOW_MS)
        if lacking >= waiting.msg.min_bytes or linger <= 0:
            return now_ms
        self._forget_appends_before(now_ms - APPEND_RATE_WINDOW_MS)
        if waiting.from_bytes < self._bytes_before_recent:
            return now_ms  # its first byte came longer ago than any linger
        first_ms = next(ms for ms, total in self._recent_appends if total > waiting.from_bytes)
        recent = self.appended_bytes - self._bytes_before_recent
        if lacking + recent * linger // APPEND_RATE_WINDOW_MS < waiting.msg.min_bytes:
            return now_ms  # at the recent rate, min_bytes would not come within the linger
        return min(first_ms + linger, waiting.until_ms)

    def _diverging(self, msg: m.ReplicaFetch, log_end: int) -> dict | None:
        if msg.last_fetched_epoch == NO_EPOCH:
            # The follower holds no record (an empty log, perhaps started at our log start
            # after a lost disk): nothing to part from.
            return None
        epoch, end = self.log.epochs.end_offset_for(msg.last_fetched_epoch, log_end)
        if epoch == NO_EPOCH:
            # Every epoch here is newer than the follower's last one: it holds nothing we can
            # vouch for above where our first epoch begins.
            first = self.log.epochs.entries_from(0)
            return {"epoch": NO_EPOCH, "end_offset": first[0][1] if first else self.log.log_start}
        if epoch != msg.last_fetched_epoch or end < msg.fetch_offset:
            return {"epoch": epoch, "end_offset": end}
        return None

    def _note_caught_up(self, now_ms: int) -> None:
        """Followers that hold everything the leader held when this was last called were caught
        up until now (the appends since, if any, happened now: `hold` follows each at once), or
        until their fetch stopped waiting, if that was earlier and they have not fetched since."""
        if not self.is_leader:
            return
        for follower in self._followers.values():
            if follower.log_end is not None and follower.log_end >= self._end_seen:
                follower.caught_up_ms = max(follower.caught_up_ms, min(now_ms, follower.waiting_until_ms))
        self._end_seen = self.log.log_end

    def _note_follower(self, replica: str, follower: _Follower, fetch_offset: int, log_end: int,
                       now_ms: int, max_wait_ms: int) -> list:
        self._note_caught_up(now_ms)
        follower.log_end = fetch_offset
        if fetch_offset >= log_end:
            follower.caught_up_ms = now_ms
            follower.waiting_until_ms = now_ms + max(0, max_wait_ms)  # the owner parks it that long
        elif follower.last_fetch_ms is not None and fetch_offset >= follower.leader_end_at_last_fetch:
            # It has everything we had when it last fetched: caught up as of that fetch (Kafka's rule).
            follower.caught_up_ms = max(follower.caught_up_ms, follower.last_fetch_ms)
        follower.last_fetch_ms = now_ms
        follower.leader_end_at_last_fetch = log_end
        if replica in self._lagging and not self._lags(replica, now_ms):
            self._lagging.discard(replica)
        effects: list = []
        if (replica not in self.state.isr and replica in self.state.replicas and self._proposed is None
                and fetch_offset >= self.high_watermark and fetch_offset >= self._epoch_start):
            effects.append(self._propose((*self.state.isr, replica), now_ms))
        return self._advance(effects)

    # -- leader: ISR ---------------------------------------------------------------------------

    def _propose(self, isr: tuple[str, ...], now_ms: int) -> ProposeIsr:
        self._proposed = isr
        self._proposed_at_ms = now_ms
        return ProposeIsr(m.AlterIsr(self.topic, self.partition, self.state.leader_epoch, list(isr)))

    def tick(self, now_ms: int) -> list:
        """Periodic leader work: noting which ISR members lag, ISR shrink proposals, and
        resending an unanswered one."""
        if not self.is_leader:
            return []
        self._note_caught_up(now_ms)
        self._lagging = {r for r in self.state.isr if self._lags(r, now_ms)}
        effects = self._note_keeping_up()
        if self._proposed is not None:
            if now_ms - self._proposed_at_ms >= ISR_RETRY_MS:
                effects.append(self._propose(self._proposed, now_ms))
            return effects
        if self._lagging:
            shrunk = self._shrunk_isr()
            if shrunk != self.state.isr:
                effects.append(self._propose(shrunk, now_ms))
        return effects

    def _lags(self, replica: str, now_ms: int) -> bool:
        follower = self._followers.get(replica)
        return (replica != self.actor_id and follower is not None
                and now_ms - follower.caught_up_ms > self.replica_lag_ms)

    def _shrunk_isr(self) -> tuple[str, ...]:
        """The ISR without its laggards, but never below min_insync (see "ISR floor"): the
        laggards that hold the most stay in."""
        isr, lagging = self.state.isr, self._lagging
        keep = {r for r in isr if r not in lagging}
        missing = self.state.min_insync - len(keep)
        if missing > 0:
            def held(r: str) -> int:
                end = self._followers[r].log_end
                return -1 if end is None else end
            laggards = sorted((r for r in isr if r in lagging), key=held, reverse=True)  # stable: replica order
            keep.update(laggards[:missing])
        return tuple(r for r in isr if r in keep)

    @property
    def keeping_up(self) -> int:
        """How many ISR members (this leader included) are keeping up with the log end."""
        return len(self.state.isr) - len(self._lagging)

    @property
    def short_of_insync(self) -> bool:
        return self.keeping_up < self.state.min_insync

    def _note_keeping_up(self) -> list:
        """Fewer than min_insync keeping up: produce is refused, and the held batches fail
        (retriable), since they cannot reach min_insync copies before a laggard catches up.
        (Any held then were appended before: check_produce admits none meanwhile.)"""
        if not (self.short_of_insync and self._held):
            return []
        return self._fail_held(self._not_keeping_up(
            "fewer in-sync replicas than min_insync are keeping up; the batch was not replicated"))

    def _not_keeping_up(self, message: str) -> NotEnoughReplicas:
        return NotEnoughReplicas(message, topic=self.topic, partition=self.partition, isr=list(self.state.isr),
                                 lagging=sorted(self._lagging), min_insync=self.state.min_insync)

    def on_isr_recorded(self, reply: m.AlterIsrReply, now_ms: int) -> list:
        """The controller recorded an ISR (perhaps not the one proposed): adopt it."""
        if reply.leader_epoch > self.state.leader_epoch:
            return self.depose(reply.leader_epoch)
        if reply.leader_epoch < self.state.leader_epoch:
            return []
        self._proposed = None
        return self._adopt_isr(dataclasses.replace(self.state, isr=tuple(reply.isr)), now_ms)

    def _adopt_isr(self, state: ReplicaState, now_ms: int) -> list:
        """Same leadership, the ISR (or replica set) the controller recorded."""
        self.state = state
        self._lagging &= set(state.isr)
        if self._proposed is not None and set(self._proposed) == set(state.isr):
            self._proposed = None
        if self.is_leader:
            for replica in state.replicas:
                if replica != self.actor_id and replica not in self._followers:
                    self._followers[replica] = _Follower(caught_up_ms=now_ms)
            if len(state.isr) < state.min_insync and self._held:
                # Held batches cannot reach min_insync copies until the ISR grows again; the
                # producer retries (and finds its batch by sequence) instead of hanging.
                return self._fail_held(NotEnoughReplicas(
                    "the ISR shrank below min_insync before the batch was replicated", topic=self.topic,
                    partition=self.partition, isr=list(state.isr), min_insync=state.min_insync))
        return self._advance([])

    def on_isr_refused(self, error: ZBrokerError, now_ms: int) -> list:
        """alter_isr refused: STALE_EPOCH means another leader exists (deposed)."""
        self._proposed = None
        if isinstance(error, StaleEpoch):
            got = error.data.get("epoch")
            return self.depose(got if isinstance(got, int) else self.state.leader_epoch + 1)
        return []

    def deadline_ms(self) -> int | None:
        """When `tick` or `next_fetch` next has something to do."""
        if self.is_leader:
            if self._proposed is not None:
                return self._proposed_at_ms + ISR_RETRY_MS
            # A follower at the log end falls behind only at the next append (which reaches
            # `hold` and ends a loop turn, after which the shell asks for this deadline again),
            # or when its wait ends without another fetch.
            end = self.log.log_end
            times = [(max(f.caught_up_ms, f.waiting_until_ms) if f.log_end is not None and f.log_end >= end
                      else f.caught_up_ms) + self.replica_lag_ms + 1
                     for r in self.state.isr if (f := self._followers.get(r)) is not None and r not in self._lagging]
            return min(times, default=None)
        if self.state.leader is not None and not self._fetch_in_flight:
            return self._next_fetch_ms
        return None

    # -- follower ----------------------------------------------------------------------------

    def next_fetch(self, now_ms: int) -> tuple[str, m.ReplicaFetch] | None:
        """(leader endpoint, request) to send now, or None (leading, no leader, one in flight, backing off)."""
        state = self.state
        if (state.leader is None or state.leader == self.actor_id or self._fetch_in_flight
                or now_ms < self._next_fetch_ms or not state.leader_endpoint):
            return None
        self._fetch_in_flight = True
        log_end = self._fetched_from = self.log.log_end
        last_epoch = self.log.epochs.epoch_at(log_end - 1) if log_end > self.log.log_start else NO_EPOCH
        return state.leader_endpoint, m.ReplicaFetch(self.topic, self.partition, self.actor_id, state.leader_epoch,
                                                     log_end, last_epoch, self.fetch_max_bytes, self.fetch_wait_ms,
                                                     self.fetch_min_bytes, self.fetch_linger_ms)

    def on_fetch_reply(self, reply: m.ReplicaFetchReply, data: bytes, now_ms: int) -> None:
        """Apply the leader's answer to the log: reset, truncate or append."""
        self._fetch_in_flight = False
        if reply.leader_epoch != self.state.leader_epoch or self.is_leader:
            return  # an answer from before the last assignment
        log = self.log
        if self._fetched_from is not None and log.log_end != self._fetched_from:
            # The answer to an earlier fetch from another log end: two were out from one offset
            # in this epoch (the chaos run saw it; tests/chaos/test_found_bugs.py), and one is
            # applied already. Appending this one would raise out of the actor's loop.
            return
        if reply.diverging is not None:
            self._truncate(reply)
        elif reply.log_start > log.log_end:
            log.reset_to(reply.log_start)
            self.high_watermark = reply.log_start
        elif data:
            fetch_offset = log.log_end
            try:
                new_end = log.append_stored(data)
            except CorruptBatch:
                # An answer to an earlier fetch from a lower offset, still out when a newer one was
                # sent (or a damaged frame): append_stored checks every batch before it writes any,
                # so nothing changed. The next fetch asks again from the log end.
                return
            for epoch, start in reply.epochs:
                if start <= new_end and epoch > log.epochs.latest_epoch:
                    log.epochs.assign(epoch, max(start, fetch_offset))
        self.high_watermark = min(max(self.high_watermark, reply.high_watermark), log.log_end)

    def _truncate(self, reply: m.ReplicaFetchReply) -> None:
        log = self.log
        diverging = reply.diverging
        target = diverging["end_offset"]
        if diverging["epoch"] != NO_EPOCH:
            mine, my_end = log.epochs.end_offset_for(diverging["epoch"], log.log_end)
            target = min(target, my_end if mine != NO_EPOCH else log.log_start)
        if target < log.log_start or target >= log.log_end:
            # Below what we hold, or nothing to cut although the leader says we part: the
            # only answer that makes progress is to start again from the leader's log.
            log.reset_to(reply.log_start)
        else:
            log.truncate_to(target)
        self.high_watermark = min(self.high_watermark, log.log_end)

    def on_fetch_failed(self, error: ZBrokerError | None, now_ms: int) -> list:
        """The fetch was refused or lost. A leader of a newer epoch than ours: wait for the
        assignment that says so; try again a little later either way."""
        self._fetch_in_flight = False
        self._next_fetch_ms = now_ms + FETCH_RETRY_MS
        return []

    # -- introspection -------------------------------------------------------------------------

    def state_row(self) -> list:
        """`replica_states` item: [topic, partition, leader_epoch, log_end, high_watermark,
        keeping_up] (keeping_up: a leader's count of ISR members keeping up, else None)."""
        return [self.topic, self.partition, self.state.leader_epoch, self.log.log_end, self.high_watermark,
                self.keeping_up if self.is_leader else None]

    def follower_log_ends(self) -> dict[str, int | None]:
        return {replica: follower.log_end for replica, follower in self._followers.items()}

    def held_count(self) -> int:
        return len(self._held)


def _with_effects(error: ZBrokerError, effects: list) -> ZBrokerError:
    """The refusal, carrying the effects the refused request caused (a deposed leader's
    failed produce replies) in ``error.effects``."""
    error.effects = effects
    return error
