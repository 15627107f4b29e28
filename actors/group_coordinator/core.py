"""Consumer groups, leases and commits: the group coordinator's pure core.

Theory of operation
-------------------
A *group* is a set of *members* consuming some topics. The coordinator never
touches record bytes: it hands out *leases* on offset ranges ("member m may
process offsets [s, e) of topic/partition until its deadline"), and members
fetch the records from the partition actors and then ack, nack, extend or
reject those ranges. From the acks it computes each partition's *committed
offset*, the first offset not yet finished, and asks the commit writer to
persist it.

Every entry point takes the time (`now_ms`, monotonic milliseconds) and
returns a list of effects (`effects.py`): replies, offsets to persist,
records to dead-letter, group configs to store, log events. Nothing here
does I/O or reads a clock, so every behaviour can be driven by hand in
tests.

Per (group, topic, partition) the state is a `PartitionState`: offset
*ranges* that are finished (acked or dead-lettered above the committed
offset: the "holes"), leased, ready for redelivery, delayed by a nack, or on
their way to the dead-letter topic; above `next_new` lies what was never
delivered. Cost therefore follows the number of ranges, never the number of
records. `GroupCoordinatorCore` decides who may lease what:

* Membership. Join, leave, session expiry and subscription changes start a
  new *generation*. Requests carry the generation they were made in; any
  other one is FENCED, so a member acting on an old assignment cannot touch
  records it no longer owns. Joining again with the same member id and topics
  re-syncs (current generation, no rebalance).
* Assignment. `exclusive` groups give each partition one owner (`assignor`,
  sticky and balanced); when a partition changes owner its leases are revoked
  and the records become ready again ("rebalance"). `shared` groups let every
  subscribed member lease from every partition. In both modes a record is
  leased to at most one member at a time.
* Leases. A poll leases redeliveries first, then new records up to the
  partition's known log end, spread round-robin over the member's partitions,
  within the in-flight limits. A poll of an exclusive group's member that
  finds nothing may instead be answered with *ahead* leases (`Poll.ahead`):
  the partition's next offsets, leased before they exist. Records become
  leased under that id, their ack timers starting, as the log reaches them;
  acks that beat the log-end report are kept and applied then. An ahead
  lease ends when all its offsets exist or with its generation, and while it
  lasts nothing else leases that partition's new records, so the member can
  hand out what its parked fetch brings without a poll round trip.
  Each delivery gets its own lease id; the
  `LeaseRecord` registry remembers where a lease lives and what was acked
  under it, so a repeated ack is idempotent and anything else not leased under
  that id is STALE (reported, never applied). A poll that finds nothing may
  wait ("parked") until records, capacity or its deadline arrive. A poll may
  carry acks (`Poll.acks`): they are applied first, exactly like an `ack`,
  so the capacity they free counts for this poll, and its reply reports them.
* Time. One heap holds every deadline (lease expiry, member sessions, nack
  delays, parked polls, dead-letter retries); each call first runs the timers
  that are due, so a lease past its deadline is expired no matter how late the
  shell ticks. Stale heap entries are skipped when popped.
* Commit. The committed offset advances only over the contiguous finished
  prefix. Every change of it (or of the holes above it) yields at most one
  `PersistOffsets` per partition per call. The writer's answer (`on_durable`)
  is kept separately: describe shows both.
* Restart. A new core answers UNAVAILABLE until `load_offsets`; offsets
  between the committed offset and the highest stored hole are redelivered
  with reason "restart", everything above is fresh. Lease ids continue from
  `lease_id_base`, which the shell must make larger than any id an earlier
  incarnation issued, so old lease ids can never match new leases.

Every call runs in one frame (`_event`): due timers first, then the call's
own work, then `_end`, which answers parked polls of the groups the call may
have helped ("woken") and emits one PersistOffsets per partition whose
progress changed ("dirty").

Where things live: `partition_state.py` moves ranges between the regions of
one partition; `group_state.py` holds the records of groups, members and
leases and builds the describe/list reports; `assignor.py` computes exclusive
ownership; `ranges.py` is the range arithmetic. docs/SEMANTICS.md states the
resulting guarantees.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Callable

from zbroker.actors.group_coordinator.assignor import assign
from zbroker.actors.group_coordinator.effects import (DeadLetter, FetchKeyHashes, Log, PersistGroupConfig,
                                                     PersistOffsets, Reply, ReplyError)
from zbroker.actors.group_coordinator.group_state import Group, GroupConfig, Key, LeaseRecord, Member, ParkedPoll
from zbroker.actors.group_coordinator.key_order import KeyOrder, parked_from_rows, parked_rows
from zbroker.actors.group_coordinator.key_quarantine import ExclusiveQuarantine
from zbroker.actors.group_coordinator.partition_state import (AHEAD, TIMEOUT, DeadLettering, Lease, LogRange, PartitionState,
                                                      Piece)
from zbroker.actors.group_coordinator.ranges import RangeSet
from zbroker.protocol import messages as m
from zbroker.protocol.batch import key_hash
from zbroker.protocol.errors import (ErrorCode, Fenced, GroupNotEmpty, ProtocolError, StaleLease, Unavailable,
                             UnknownGroup, UnknownMember, UnknownTopic, ZBrokerError)

__all__ = ["DEAD_LETTER_RETRY_MS", "GroupConfig", "GroupCoordinatorCore", "TOMBSTONE_GENERATION"]

DEAD_LETTER_RETRY_MS = 1000
# `now` is the monotonic clock in whole milliseconds, read after the request arrived:
# the true time is up to 1 ms past it, and the client sent the request before. A nack's
# delay is set this much further, so that no redelivery comes before `delay_ms` after
# the client sent the nack (PROTOCOL.md s.14, "Timers"); without it they came up to a
# millisecond early. Leases are the other way round: ending one late is the safe side,
# so they keep the grain as a stated tolerance instead.
CLOCK_GRAIN_MS = 1
# A poll's budget is shared over partitions in shares of at least this many records. Spread
# like water down to one record each, a poll of 1,000 over 1,024 partitions was 1,000
# one-record leases, each with its fetch part, ack range and timer: consume+ack cost
# 82.9 µs of server CPU per record there against 1.0 at 4 partitions (bench.zbroker_adapter
# partition_counts, one run).
MIN_SHARE = 32
# A member waits on at most this many polls; one more answers its oldest (empty).
MAX_PARKED_PER_MEMBER = 16
# The timer heap is compacted when it holds this many entries beyond the live ones.
TIMER_SLACK = 512
# At most this many stale ranges are listed in a reply. The ranges of one request are
# merged per lease first, but a lease fragmented by nacks still yields a stale piece per
# gap; listed in full, a 40 KB ack could ask for a reply of many megabytes (more than a
# client may read) and as much memory here. The rest are counted (`stale_omitted`).
STALE_REPORT_LIMIT = 1000
# A poll reply must fit the 1 MiB header a client reads (PROTOCOL.md s.6): ranges made
# ready one by one (every other record acked, the rest expired) can be many thousands.
# Deliveries are counted at their largest (a 200-byte topic and reason, 64 bytes of
# numbers and framing) against half of it; the rest wait for the next poll.
POLL_REPLY_BUDGET_BYTES = 512 * 1024
DELIVERY_FIXED_BYTES = 64
# nack and reject reasons are kept, and sent with each redelivery, at most this long.
MAX_REASON_BYTES = 200

# A failed key-hash fetch (key_shared) is tried again after this long.
KEY_FETCH_RETRY_MS = 200

# The generation of a stored row that says "these offsets were deleted" (delete_group,
# delete_topic). The commit writer only ever overwrites rows (newest reset epoch wins), so a
# deletion is a row written at a reset epoch above every earlier one; loading skips it.
TOMBSTONE_GENERATION = -1

# Timer kinds; heap entries are (when_ms, seq, kind, payload).
_LEASE, _SESSION, _DELAYED, _PARKED, _DEAD_LETTER_RETRY, _KEYS = range(6)


class GroupCoordinatorCore:
    def __init__(self, *, lease_id_base: int, default_config: GroupConfig = GroupConfig(),
                 max_persisted_holes: int = 1000) -> None:
        self._lease_id_base = lease_id_base
        self._next_lease_id = lease_id_base
        self._next_dead_lettering_id = 0  # see DeadLettering.id
        self._member_seq = 0
        self._default_config = default_config
        self._max_holes = max_persisted_holes
        self._loaded = False
        self._topics: dict[str, int] = {}
        self._logs: dict[Key, LogRange] = {}
        self._groups: dict[str, Group] = {}
        self._groups_on: dict[Key, list[Group]] = {}  # groups with state for a partition
        self._keyed: dict[tuple[str, Key], PartitionState] = {}  # states of key_shared groups
        self._leases: dict[int, LeaseRecord] = {}
        self._parked: dict[Any, ParkedPoll] = {}
        self._timers: list[tuple] = []
        # The heap size past which it is compacted: twice what survived the last compaction.
        # Measured against the live entries alone, many members' session timers (or many
        # delayed nacks) kept the heap above the bar, and every push compacted it.
        self._compact_above = TIMER_SLACK
        self._timer_seq = 0
        self._grown_topics: set[str] = set()  # set_topic grew them; rebalanced at the next call
        # group -> the reset epoch its next incarnation starts at: above its tombstones' (delete_group).
        self._epoch_floor: dict[str, int] = {}
        # Per-call scratch, emptied by _end().
        self._dirty: dict[tuple[str, Key], PartitionState] = {}
        self._wake: set[str] = set()
        self._metrics = {"polls": 0, "holes_truncated": 0, "dead_letters_emitted": 0, "dead_letters_value_dropped": 0,
                         "records_expired": 0, "rebalances": 0, "keys_quarantined": 0, "keys_released": 0,
                         "key_hash_fetches": 0}

    # ==================================================================================
    # Topology and store
    # ==================================================================================

    def set_topic(self, topic: str, partitions: int) -> None:
        """A topic exists with `partitions` partitions (counts only ever grow).

        Groups subscribed to a topic that grew are rebalanced at the next call that
        carries a time; `next_deadline()` reports 0 until then so the shell ticks.
        """
        if partitions > self._topics.get(topic, 0):
            self._topics[topic] = partitions
            self._grown_topics.add(topic)

    def consumers_of(self, topic: str) -> dict[str, int]:
        """group -> how many of its live members subscribe to `topic` (delete_topic refuses then)."""
        out = {}
        for group in self._groups.values():
            count = sum(topic in member.topics for member in group.members.values())
            if count:
                out[group.name] = count
        return out

    def groups_on_topic(self, topic: str) -> list[str]:
        """Groups with progress on some partition of `topic`."""
        return [g.name for g in self._groups.values() if any(k[0] == topic for k in g.partitions)]

    def forget_topic(self, topic: str, now_ms: int) -> list:
        """`topic` is gone (delete_topic), or is new under a name that may have had offsets
        (create_topic): every group's state on it goes, with a tombstone row per partition,
        so a topic created under the name later starts from its `start` rule, never from the
        old offsets. Groups with members subscribed to it must have been refused before."""
        self._topics.pop(topic, None)
        self._grown_topics.discard(topic)
        for key in [k for k in self._logs if k[0] == topic]:
            del self._logs[key]

        def forget(out: list) -> None:
            for group in list(self._groups.values()):
                keys = [k for k in group.partitions if k[0] == topic]
                if not keys:
                    continue
                gone = set(self._forget_offsets(group, keys, out))
                self._drop_timers(lambda kind, payload, g=group.name: kind in (_DELAYED, _DEAD_LETTER_RETRY)
                                  and payload[0] == g and payload[1] in gone)
                out.append(Log("topic_offsets_removed", {"group": group.name, "topic": topic,
                                                         "partitions": len(keys),
                                                         "reset_epoch": group.reset_epoch}))
        return self._event(now_ms, forget)

    def on_log_range(self, topic: str, partition: int, log_start: int, log_end: int, now_ms: int) -> list:
        """A partition actor reported its log range: may resolve start positions, apply
        retention and answer waiting polls."""
        key = (topic, partition)
        log = self._logs.setdefault(key, LogRange())
        grew = log_end > log.end
        log.update(log_start, log_end, now_ms)
        return self._event(now_ms, lambda out: self._log_moved(key, grew, now_ms, out))

    def load_offsets(self, rows: list, now_ms: int, reason: str = "restart") -> list:
        """Stored progress, (group, topic, partition, committed, holes, generation, reset_epoch)
        rows, with the parked keys as an eighth element where there are any; afterwards the
        core serves requests. `reason`: what redeliveries say, "restart", or
        "coordinator_failover" when this node took over from another (issue 26)."""
        for group_name, topic, partition, committed, holes, generation, reset_epoch, *quarantine in rows:
            if generation == TOMBSTONE_GENERATION:  # deleted offsets: only their epoch is kept
                self._raise_epoch_floor(group_name, reset_epoch)
                continue
            group = self._group(group_name)
            group.generation = max(group.generation, generation)
            group.reset_epoch = max(group.reset_epoch, reset_epoch)
            state = self._add_state(group, (topic, partition), fresh=True)
            state.load(committed, holes, now_ms, reason)
            if quarantine and quarantine[0] and state.keys is not None:  # else the group no longer quarantines
                state.keys.parked.update(parked_from_rows(quarantine[0], now_ms))
            state.durable_committed, state.durable_epoch = committed, reset_epoch
        for group in self._groups.values():
            # A group that lost some partitions' offsets (delete_topic) goes on above their
            # tombstones' epoch, or the writer would refuse its new rows for them as older.
            group.reset_epoch = max(group.reset_epoch, self._epoch_floor.get(group.name, 0))
        self._loaded = True
        self._grown_topics.clear()  # no group has members yet: nothing to rebalance

        def resolve(out: list) -> None:
            out.append(Log("offsets_loaded", {"groups": len(self._groups), "partitions": len(rows)}))
            for group in self._groups.values():
                for state in group.partitions.values():
                    self._resolve_start(group, state, now_ms, out)
        return self._event(now_ms, resolve)

    def on_durable(self, durable: list, now_ms: int) -> list:
        """The writer reports (group, topic, partition, committed, reset_epoch) rows on disk."""
        for group_name, topic, partition, committed, reset_epoch in durable:
            group = self._groups.get(group_name)
            state = group.partitions.get((topic, partition)) if group else None
            # A later reset epoch wins even with a lower offset; within an epoch, only up.
            if state is not None and (state.durable_committed is None or
                                      (reset_epoch, committed) > (state.durable_epoch, state.durable_committed)):
                state.durable_committed, state.durable_epoch = committed, reset_epoch
        return self._event(now_ms)

    def durable_reset_epoch(self, group: str, topic: str, partition: int) -> int | None:
        """The reset epoch of the newest offset the writer reported on disk (None: none yet)."""
        state = self._groups[group].partitions.get((topic, partition)) if group in self._groups else None
        if state is None or state.durable_committed is None:
            return None
        return state.durable_epoch

    def restore_group_config(self, group: str, config: GroupConfig) -> None:
        found = self._group(group)
        found.config = config
        for state in found.partitions.values():
            self._sync_keys(found, state)

    def on_key_hashes(self, effect: FetchKeyHashes, first: int | None, hashes: list[int] | None,
                      now_ms: int) -> list:
        """The answer to `effect`: the key hashes of offsets [first, first + len(hashes)),
        or None for a failed fetch (tried again in KEY_FETCH_RETRY_MS)."""
        def learn(out: list) -> None:
            state = self._keyed.get((effect.group, (effect.topic, effect.partition)))
            if state is None or state.keys is None:
                return
            column = state.keys.column
            column.fetching = False
            if hashes is None or first is None or column.end != effect.start:
                column.retry_at_ms = now_ms + KEY_FETCH_RETRY_MS
                self._push(column.retry_at_ms, _KEYS, None)
                return
            if hashes:
                column.add(first, hashes)
                self._wake.add(effect.group)
            else:  # nothing there (yet): the next log-end report asks again
                column.retry_at_ms = now_ms + KEY_FETCH_RETRY_MS
                self._push(column.retry_at_ms, _KEYS, None)
        return self._event(now_ms, learn)

    # ==================================================================================
    # Requests. Each returns exactly one Reply/ReplyError for `token`, except a parked
    # poll, which is answered by a later call.
    # ==================================================================================

    def join(self, token, msg: m.Join, now_ms: int) -> list:
        return self._serve(self._join, token, msg, now_ms)

    def heartbeat(self, token, msg: m.Heartbeat, now_ms: int) -> list:
        return self._serve(self._heartbeat, token, msg, now_ms)

    def leave(self, token, msg: m.Leave, now_ms: int) -> list:
        return self._serve(self._leave, token, msg, now_ms)

    def poll(self, token, msg: m.Poll, now_ms: int) -> list:
        self._metrics["polls"] += 1
        return self._serve(self._poll, token, msg, now_ms)

    def ack(self, token, msg: m.Ack, now_ms: int) -> list:
        return self._serve(self._settle, token, msg, now_ms)

    def nack(self, token, msg: m.Nack, now_ms: int) -> list:
        return self._serve(self._settle, token, msg, now_ms)

    def extend(self, token, msg: m.Extend, now_ms: int) -> list:
        return self._serve(self._settle, token, msg, now_ms)

    def reject(self, token, msg: m.Reject, now_ms: int) -> list:
        return self._serve(self._settle, token, msg, now_ms)

    def list_groups(self, token, msg: m.ListGroups, now_ms: int) -> list:
        return self._serve(self._list_groups, token, msg, now_ms)

    def describe_group(self, token, msg: m.DescribeGroup, now_ms: int) -> list:
        return self._serve(self._describe_group, token, msg, now_ms)

    def configure_group(self, token, msg: m.ConfigureGroup, now_ms: int) -> list:
        return self._serve(self._configure_group, token, msg, now_ms)

    def reset_group(self, token, msg: m.ResetGroup, now_ms: int, targets: dict[int, int] | None = None) -> list:
        """`targets`: partition -> offset, for a reset by time (`to_time_ms`), which the shell
        resolved with the partition actors; each is clamped to the log range like `to`."""
        if msg.to_time_ms is not None and targets is None:
            return [ReplyError(token, ProtocolError("a reset by time needs the partitions' offsets",
                                                    op="reset_group", field="to_time_ms"))]
        return self._serve(lambda out, tok, mm, now: self._reset_group(out, tok, mm, now, targets), token, msg,
                           now_ms)

    def delete_group(self, token, msg: m.DeleteGroup, now_ms: int) -> list:
        return self._serve(self._delete_group, token, msg, now_ms)

    def list_quarantine(self, token, msg: m.ListQuarantine, now_ms: int) -> list:
        return self._serve(self._list_quarantine, token, msg, now_ms)

    def release_key(self, token, msg: m.ReleaseKey, now_ms: int) -> list:
        return self._serve(self._release_key, token, msg, now_ms)

    # -- dead-letter confirmations, timers, introspection -------------------------------

    def on_dead_letter_done(self, effect: DeadLetter, now_ms: int) -> list:
        """The record of `effect` is in the dead-letter topic (or gone through retention)."""
        return self._confirm_dead_letter(effect, now_ms, done=True)

    def on_dead_letter_failed(self, effect: DeadLetter, now_ms: int, error: ZBrokerError | None = None) -> list:
        """The copy of `effect` failed: `error` is the dead-letter topic's refusal of it
        (None: no answer, or the copy failed before the append).

        A full copy refused TOO_LARGE (the record fits max_batch_bytes, but not with
        the zb-dlq-* headers) is made again at once without the value: a DeadLetter
        with `drop_value`. Anything else is tried again in DEAD_LETTER_RETRY_MS, a
        non-retriable error too (an operator may fix it); the shell logs that one as
        an error every time.
        """
        return self._confirm_dead_letter(effect, now_ms, done=False, error=error)

    def cancel_parked(self, token) -> None:
        parked = self._parked.get(token)
        if parked is not None:
            self._unpark(self._groups[parked.group], parked)

    def tick(self, now_ms: int) -> list:
        return self._event(now_ms)

    def next_deadline(self) -> int | None:
        """When `tick` has work next (monotonic ms; a past value means "now")."""
        if self._grown_topics and self._loaded:
            return 0
        return self._timers[0][0] if self._timers else None

    def statistics(self) -> dict:
        states = [s for g in self._groups.values() for s in g.partitions.values()]
        ranges: dict[str, int] = {}
        for state in states:
            for name, n in state.range_entries().items():
                ranges[name] = ranges.get(name, 0) + n
        return {
            "groups": len(self._groups),
            "members": sum(len(g.members) for g in self._groups.values()),
            "partition_states": len(states),
            **{f"{name}_ranges": n for name, n in ranges.items()},
            "range_entries": sum(ranges.values()),
            "lease_records": len(self._leases),
            "lease_acked_ranges": sum(r.acked.len_ranges() for r in self._leases.values()),
            "timers": len(self._timers),
            "parked_polls": len(self._parked),
            "records_in_flight": sum(s.leased.count() for s in states),
            "keys_pending": sum(len(s.keys.pending) for s in self._keyed.values()),
            "records_held": sum(s.keys.held.count() for s in self._keyed.values()),
            "keys_parked": sum(len(s.keys.parked) for s in self._keyed.values()),
            "key_limit_pauses": sum(s.keys.paused_count for s in self._keyed.values()),
            **self._metrics,
        }

    # ==================================================================================
    # Call framing
    # ==================================================================================

    def _serve(self, handler: Callable, token, msg, now_ms: int) -> list:
        if not self._loaded:
            return [ReplyError(token, Unavailable("the group coordinator is still loading stored offsets",
                                                  op=getattr(msg, "op", None)))]
        return self._event(now_ms, lambda out: handler(out, token, msg, now_ms))

    def _event(self, now_ms: int, body: Callable[[list], None] | None = None) -> list:
        """The frame of every call that carries a time.

        First what time and topology changes make due (so a lease past its deadline is
        expired however late the shell ticks), then `body`, then `_end`.
        """
        out: list = []
        if not self._loaded:
            return out
        if self._grown_topics:
            grown, self._grown_topics = self._grown_topics, set()
            for group in list(self._groups.values()):
                if any(t in grown for mem in group.members.values() for t in mem.topics):
                    self._rebalance(group, now_ms, out, "partitions_added", None, membership_changed=False)
        self._run_timers(now_ms, out)
        if body is not None:
            body(out)
        self._end(out, now_ms)
        return out

    def _end(self, out: list, now: int) -> None:
        """Answer parked polls that can now be served, then persist changed progress."""
        while self._wake:
            group = self._groups[self._wake.pop()]
            for parked in list(group.parked):
                member = group.members[parked.member_id]
                deliveries = self._lease_records(group, member, parked.max_records, now)
                if deliveries:
                    self._unpark(group, parked)
                    member.last_seen_ms = now
                    out.append(Reply(parked.token, self._poll_reply(group, deliveries, parked.acked,
                                                                    parked.stale, parked.stale_omitted)))
        if self._keyed:
            self._want_key_hashes(out, now)
        for (group_name, key), state in self._dirty.items():
            group = self._groups[group_name]
            holes, truncated = state.holes(self._max_holes)
            if truncated:
                self._metrics["holes_truncated"] += 1
                if not state.holes_truncated:
                    out.append(Log("holes_truncated", {"group": group_name, "topic": key[0], "partition": key[1],
                                                       "holes": state.finished.len_ranges(),
                                                       "persisted": self._max_holes}))
            state.holes_truncated = truncated
            out.append(PersistOffsets(group_name, key[0], key[1], state.committed, holes,
                                      group.generation, group.reset_epoch,
                                      [] if state.keys is None else parked_rows(state.keys.parked)))
        self._dirty.clear()

    def _want_key_hashes(self, out: list, now: int) -> None:
        """Ask for the key hashes each key_shared state needs next (one fetch at a time each)."""
        for (group_name, key), state in self._keyed.items():
            log = self._logs.get(key)
            if log is None or state.keys.column.retry_at_ms > now:
                continue
            start = state.keys.hashes_wanted(state, log.end)
            if start is not None:
                state.keys.column.fetching = True
                self._metrics["key_hash_fetches"] += 1
                out.append(FetchKeyHashes(group_name, key[0], key[1], start))

    def _sync_keys(self, group: Group, state: PartitionState) -> None:
        """Give a key_shared group's state its key order, an exclusive group's with quarantine
        its key quarantine, or take it away (mode or quarantine changed)."""
        handle = (group.name, state.key)
        config = group.config
        kind = (KeyOrder if config.mode == "key_shared" else
                ExclusiveQuarantine if config.mode == "exclusive" and config.quarantine_after else None)
        if kind is not None:
            if type(state.keys) is not kind:
                if state.keys is not None:
                    state.keys.drop(state)
                state.keys = kind(config.max_keys)
            state.keys.max_keys = config.max_keys
            self._keyed[handle] = state
        elif state.keys is not None:
            state.keys.drop(state)
            state.keys = None
            self._keyed.pop(handle, None)

    def _key_events(self, group: Group, state: PartitionState, out: list) -> None:
        if state.keys is not None and state.keys.events:
            for event, fields in state.keys.events:
                if event == "key_quarantined":
                    self._metrics["keys_quarantined"] += 1
                    self._dirty[(group.name, state.key)] = state  # the quarantine is persisted with the holes
                out.append(Log(event, {"group": group.name, "topic": state.topic, "partition": state.partition,
                                       **fields}))
            state.keys.events.clear()

    # ==================================================================================
    # Membership
    # ==================================================================================

    def _join(self, out: list, token, msg: m.Join, now: int) -> None:
        topics = tuple(sorted(set(msg.topics)))
        unknown = [t for t in topics if t not in self._topics]
        if unknown:
            out.append(ReplyError(token, UnknownTopic(f"unknown topic {unknown[0]!r}", topic=unknown[0],
                                                      topics=unknown, group=msg.group)))
            return
        group = self._group(msg.group)
        member = group.members.get(msg.member_id) if msg.member_id else None
        if member is not None:
            if msg.session_timeout_ms < member.session_timeout_ms:
                # The timer armed for the longer timeout would come too late.
                self._push(now + msg.session_timeout_ms, _SESSION, (group.name, member))
            member.session_timeout_ms, member.last_seen_ms = msg.session_timeout_ms, now
        if member is not None and member.topics == topics:
            pass  # re-sync: how a fenced member learns the current generation, without a rebalance
        elif member is not None:
            member.topics = topics
            self._rebalance(group, now, out, "subscription_changed", member.member_id)
        else:
            member = Member(msg.member_id or self._new_member_id(group), topics, msg.session_timeout_ms, now)
            group.members[member.member_id] = member
            self._push(now + member.session_timeout_ms, _SESSION, (group.name, member))
            self._rebalance(group, now, out, "member_joined", member.member_id)
        out.append(Reply(token, m.JoinReply(member_id=member.member_id, generation=group.generation,
                                            mode=group.config.mode, assignment=[list(k) for k in member.assignment],
                                            ack_timeout_ms=group.config.ack_timeout_ms)))

    def _heartbeat(self, out: list, token, msg: m.Heartbeat, now: int) -> None:
        found = self._check_member(out, token, msg, now)
        if found:
            group, member = found
            out.append(Reply(token, m.HeartbeatReply(generation=group.generation,
                                                     assignment=[list(k) for k in member.assignment])))

    def _leave(self, out: list, token, msg: m.Leave, now: int) -> None:
        # Accepted in any generation and for unknown members: leaving cannot harm anyone.
        group = self._groups.get(msg.group)
        member = group.members.pop(msg.member_id, None) if group else None
        if member is not None:
            self._rebalance(group, now, out, "member_left", member.member_id)
        out.append(Reply(token, m.LeaveReply()))

    def _expire_member(self, group: Group, member: Member, now: int, out: list) -> None:
        if member.parked:  # a member waiting on us is alive; its session restarts when answered
            self._push(now + member.session_timeout_ms, _SESSION, (group.name, member))
            return
        expiry = member.last_seen_ms + member.session_timeout_ms
        if expiry > now:
            self._push(expiry, _SESSION, (group.name, member))
            return
        del group.members[member.member_id]
        out.append(Log("member_expired", {"group": group.name, "member_id": member.member_id,
                                          "silent_ms": now - member.last_seen_ms}))
        self._rebalance(group, now, out, "member_expired", member.member_id)

    def _check_member(self, out: list, token, msg, now: int) -> tuple[Group, Member] | None:
        """Fence old generations, reject unknown members; a passing request is a heartbeat."""
        group = self._groups.get(msg.group)
        member = group.members.get(msg.member_id) if group else None
        if group is not None and msg.generation != group.generation:
            out.append(ReplyError(token, Fenced(
                f"generation {msg.generation} of group {msg.group!r} is over; the current one is "
                f"{group.generation}", group=msg.group, generation=group.generation,
                member_id=msg.member_id, member_known=member is not None)))
            return None
        if member is None:
            out.append(ReplyError(token, UnknownMember(
                f"member {msg.member_id!r} is not in group {msg.group!r}; join again",
                group=msg.group, member_id=msg.member_id)))
            return None
        member.last_seen_ms = now
        return group, member

    def _rebalance(self, group: Group, now: int, out: list, cause: str, member_id: str | None,
                   membership_changed: bool = True) -> None:
        """Recompute who may lease what; revoke leases that lost their right.

        A new generation starts when membership changed or an owner changed.
        """
        exclusive = group.config.mode == "exclusive"
        subscribed = {t for mem in group.members.values() for t in mem.topics}
        for topic in subscribed:
            for p in range(self._topics.get(topic, 0)):
                self._add_state(group, (topic, p), now=now, out=out)
        owners = {}
        if exclusive:
            owners = assign(group.owners, {mid: mem.topics for mid, mem in group.members.items()},
                            {t: self._topics[t] for t in subscribed if t in self._topics})
        moved = [k for k in set(group.owners) | set(owners) if group.owners.get(k) != owners.get(k)]
        group.owners = owners
        for mem in group.members.values():
            mem.assignment = (sorted(k for k, o in owners.items() if o == mem.member_id) if exclusive else
                              [(t, p) for t in mem.topics for p in range(self._topics.get(t, 0))])
        revoked = 0
        for key, state in group.partitions.items():
            if state.leased:
                for start, end, lease in state.revoke(self._entitled(group, key), now):
                    revoked += end - start
                    self._uncount(group, lease, end - start)
        if revoked:
            self._wake.add(group.name)
        if not (membership_changed or moved):
            return
        group.generation += 1
        self._metrics["rebalances"] += 1
        for state in group.partitions.values():
            self._end_ahead(group, state, now)  # an ahead lease lives within one generation
        self._fence_parked(group, out, now)
        self._wake.add(group.name)
        out.append(Log("rebalance", {"group": group.name, "generation": group.generation, "cause": cause,
                                     "member_id": member_id, "members": len(group.members),
                                     "moved_partitions": len(moved), "revoked_records": revoked}))

    def _entitled(self, group: Group, key: Key) -> Callable[[Lease], bool]:
        if group.config.mode == "exclusive":
            owner = group.owners.get(key)
            return lambda lease: lease.member_id == owner

        def subscribed(lease: Lease) -> bool:
            mem = group.members.get(lease.member_id)
            return mem is not None and key[0] in mem.topics
        return subscribed

    # ==================================================================================
    # Leasing
    # ==================================================================================

    def _poll(self, out: list, token, msg: m.Poll, now: int) -> None:
        found = self._check_member(out, token, msg, now)
        if not found:
            return
        group, member = found
        # Acks first: what they finish frees capacity this poll may lease at once.
        acked, stale, omitted = (self._settle_ranges("ack", msg, group, member, msg.acks, now, out)
                                 if msg.acks else (0, [], 0))
        deliveries = self._lease_records(group, member, msg.max_records, now)
        # Not with quarantine: an ahead lease would hand out records no one checked for a parked key.
        if not deliveries and msg.ahead and group.config.mode == "exclusive" and not group.config.quarantine_after:
            deliveries = self._lease_ahead(group, member, min(msg.ahead, msg.max_records))
        if deliveries or msg.max_wait_ms == 0:
            out.append(Reply(token, self._poll_reply(group, deliveries, acked, stale, omitted)))
            return
        if member.parked >= MAX_PARKED_PER_MEMBER:
            # A client that keeps polling without waiting for answers must not be able
            # to grow this list without bound: its oldest wait ends, empty.
            oldest = next(p for p in group.parked if p.member_id == member.member_id)
            self._unpark(group, oldest)
            out.append(Reply(oldest.token, self._poll_reply(group, [], oldest.acked, oldest.stale,
                                                            oldest.stale_omitted)))
        parked = ParkedPoll(token, group.name, member.member_id, msg.max_records, now + msg.max_wait_ms,
                            acked, stale, omitted)
        group.parked.append(parked)
        self._parked[token] = parked
        member.parked += 1
        self._push(parked.deadline_ms, _PARKED, parked)

    def _lease_records(self, group: Group, member: Member, max_records: int, now: int) -> list:
        """Lease up to `max_records` across the member's partitions, fairly.

        The budget is spread like water over the partitions that have records, in
        shares of at least MIN_SHARE records, so one busy partition cannot starve the
        others and many partitions do not cut a poll into one-record leases. The
        starting partition rotates: by one when every partition with records got a
        share (so remainders do not always favour the same one), else to the one
        after the last partition served, so the next poll serves the next ones. Each
        partition is then taken from once, giving one lease per partition and reason.
        """
        budget = min(max_records, group.config.max_in_flight - member.in_flight)
        keys = member.assignment
        if budget <= 0 or not keys:
            return []
        first = member.cursor % len(keys)
        order = keys[first:] + keys[:first]
        room = {}
        for key in order:
            state, log = group.partitions.get(key), self._logs.get(key)
            if state is not None and state.committed is not None:
                n = min(state.available(log.end if log else 0), group.config.max_in_flight - state.leased.count())
                if n > 0:
                    room[key] = n
        share = dict.fromkeys(room, 0)
        hungry = list(room)
        while budget > 0 and hungry:
            portion = max(MIN_SHARE, budget // len(hungry))
            still = []
            for key in hungry:
                give = min(portion, room[key] - share[key], budget)
                share[key] += give
                budget -= give
                if share[key] < room[key]:
                    still.append(key)
            hungry = still
        if all(share.values()):
            member.cursor = first + 1
        else:  # the next poll starts after the last partition served
            member.cursor = first + 1 + max(i for i, key in enumerate(order) if share.get(key))
        deliveries: list = []
        room_bytes = POLL_REPLY_BUDGET_BYTES
        for key, n in share.items():
            if n:
                room_bytes = self._lease_from(group, member, key, n, now, deliveries, room_bytes)
        return deliveries

    def _lease_from(self, group: Group, member: Member, key: Key, limit: int, now: int,
                    deliveries: list, room_bytes: int) -> int:
        """Lease up to `limit` records of one partition in as many deliveries as
        `room_bytes` of the reply allow; returns the room left."""
        state, log = group.partitions[key], self._logs.get(key)
        delivery_bytes = _delivery_bytes(key[0])
        max_pieces = room_bytes // delivery_bytes
        if max_pieces <= 0:
            return room_bytes
        for start, end, lease in state.take(member.member_id, limit, log.end if log else 0, now,
                                            self._new_lease_id, group.config.ack_timeout_ms, max_pieces):
            record = self._leases.get(lease.lease_id)
            if record is None:
                self._leases[lease.lease_id] = LeaseRecord(lease.lease_id, group.name, key, member.member_id,
                                                           start, end, lease.deadline_ms)
                self._push(lease.deadline_ms, _LEASE, lease.lease_id)
            else:  # key_shared: one lease id for the scattered pieces of one take
                record.start, record.end = min(record.start, start), max(record.end, end)
            deliveries.append([key[0], key[1], lease.lease_id, start, end, lease.attempt, lease.reason])
            member.in_flight += end - start
            room_bytes -= delivery_bytes
        return room_bytes

    def _lease_ahead(self, group: Group, member: Member, count: int) -> list:
        """Ahead leases over the member's partitions that have nothing to lease now."""
        budget = min(count, group.config.max_in_flight - member.in_flight)
        keys = []
        for key in member.assignment:
            state, log = group.partitions.get(key), self._logs.get(key)
            if (state is not None and log is not None and state.committed is not None and state.ahead is None
                    and state.available(log.end) == 0):
                keys.append(key)
        deliveries: list = []
        room_bytes = POLL_REPLY_BUDGET_BYTES
        for i, key in enumerate(keys):
            state = group.partitions[key]
            n = min(budget // (len(keys) - i), group.config.max_in_flight - state.leased.count())
            if n <= 0 or room_bytes < _delivery_bytes(key[0]):
                continue
            room_bytes -= _delivery_bytes(key[0])
            lease_id = self._new_lease_id()
            start, end = state.lease_ahead(member.member_id, lease_id, n)
            # No timer yet: each record's deadline starts when it exists (_fill_ahead).
            self._leases[lease_id] = LeaseRecord(lease_id, group.name, key, member.member_id, start, end, 0)
            member.in_flight += n
            budget -= n
            deliveries.append([key[0], key[1], lease_id, start, end, 1, AHEAD])
        return deliveries

    def _fill_ahead(self, group: Group, state: PartitionState, now: int) -> None:
        """The log grew into an ahead lease: those records are leased now, their timers start."""
        lease_id = state.ahead.lease_id
        piece, early = state.fill_ahead(self._logs[state.key].end, now, group.config.ack_timeout_ms)
        if piece is None:
            return
        record = self._leases[lease_id]
        record.deadline_ms = max(record.deadline_ms, piece[2].deadline_ms)
        self._push(piece[2].deadline_ms, _LEASE, lease_id)
        if early:  # acks that arrived before the coordinator knew the records existed
            pieces = [p for s, e in early for p in state.leased_under(lease_id, s, e)]
            state.ack(pieces)
            for start, end, _ in pieces:
                record.acked.add(start, end)
            member = group.members.get(record.member_id)
            if member is not None:
                member.in_flight -= sum(e - s for s, e, _ in pieces)
            self._dirty[(group.name, state.key)] = state
            self._wake.add(group.name)

    def _end_ahead(self, group: Group, state: PartitionState, now: int) -> None:
        if state.ahead is None:
            return
        lease_id = state.ahead.lease_id
        member = group.members.get(state.ahead.member_id)
        unfilled = state.drop_ahead()
        if member is not None:
            member.in_flight -= unfilled
        record = self._leases.get(lease_id)
        if record is not None and record.deadline_ms <= now and not state.leased_under(lease_id, record.start,
                                                                                        record.end):
            del self._leases[lease_id]  # nothing of it ever existed (or all of it is over): no timer will

    def _poll_reply(self, group: Group, deliveries: list, acked: int = 0, stale: list | None = None,
                    stale_omitted: int = 0) -> m.PollReply:
        return m.PollReply(generation=group.generation, deliveries=deliveries,
                           ack_timeout_ms=group.config.ack_timeout_ms, acked=acked, stale=stale or [],
                           stale_omitted=stale_omitted)

    def _unpark(self, group: Group, parked: ParkedPoll) -> None:
        del self._parked[parked.token]
        group.parked.remove(parked)
        member = group.members.get(parked.member_id)
        if member is not None:
            member.parked -= 1

    def _fence_parked(self, group: Group, out: list, now: int) -> None:
        for parked in list(group.parked):
            self._unpark(group, parked)
            member = group.members.get(parked.member_id)
            if member is not None:  # alive while it waited: its session restarts with the answer
                member.last_seen_ms = now
            # Its acks were applied when it arrived: say so, so that the member does not send them again.
            out.append(ReplyError(parked.token, Fenced(
                f"group {group.name!r} moved to generation {group.generation} while the poll waited",
                group=group.name, generation=group.generation, member_id=parked.member_id,
                member_known=parked.member_id in group.members, acked=parked.acked, stale=parked.stale,
                **({"stale_omitted": parked.stale_omitted} if parked.stale_omitted else {}))))

    # ==================================================================================
    # Settling leases: ack, nack, extend, reject
    # ==================================================================================

    def _settle(self, out: list, token, msg, now: int) -> None:
        found = self._check_member(out, token, msg, now)
        if not found:
            return
        group, member = found
        applied, stale, omitted = self._settle_ranges(msg.op, msg, group, member, msg.ranges, now, out)
        deadline_in_ms = (msg.extend_ms or group.config.ack_timeout_ms) if msg.op == "extend" else None
        if stale:
            data = {"deadline_in_ms": deadline_in_ms} if deadline_in_ms is not None else {}
            if omitted:
                data["stale_omitted"] = omitted
            out.append(ReplyError(token, StaleLease(
                f"{len(stale) + omitted} range(s) are not leased under the given lease id; nothing was applied "
                f"to them", group=group.name, member_id=member.member_id, stale=stale, applied=applied, **data)))
        elif msg.op == "ack":
            out.append(Reply(token, m.AckReply(applied=applied)))
        elif msg.op == "nack":
            out.append(Reply(token, m.NackReply(applied=applied)))
        elif msg.op == "extend":
            out.append(Reply(token, m.ExtendReply(applied=applied, deadline_in_ms=deadline_in_ms)))
        else:
            out.append(Reply(token, m.RejectReply(applied=applied)))

    def _settle_ranges(self, op: str, msg, group: Group, member: Member, ranges: list, now: int,
                       out: list) -> tuple[int, list]:
        """Apply `op` ("ack", "nack", "extend", "reject") to `ranges` of this member's leases.

        Returns (offsets applied, stale ranges, stale ranges not listed): the parts not
        leased to this member under the given lease id, never applied. The request's
        ranges are merged per lease first, so each offset is settled once however often
        the request names it, and the work is bounded by the leases, not the request.
        """
        merged: dict[tuple, RangeSet] = {}
        for topic, partition, lease_id, start, end in ranges:
            spans = merged.get((topic, partition, lease_id))
            if spans is None:
                spans = merged[(topic, partition, lease_id)] = RangeSet()
            spans.add(start, end)
        applied, stale, omitted = 0, [], 0

        def note_stale(topic: str, partition: int, lease_id: int, start: int, end: int) -> None:
            nonlocal omitted
            if len(stale) < STALE_REPORT_LIMIT:
                stale.append([topic, partition, lease_id, start, end])
            else:
                omitted += 1

        for (topic, partition, lease_id), spans in merged.items():
            key = (topic, partition)
            record = self._leases.get(lease_id)
            state = group.partitions.get(key)
            if (record is None or state is None or record.group != group.name or record.key != key
                    or record.member_id != member.member_id):
                for start, end in spans:
                    note_stale(topic, partition, lease_id, start, end)
                continue
            for start, end in spans:
                pieces = state.leased_under(lease_id, start, end)
                valid = RangeSet([(s, e) for s, e, _ in pieces])
                if op == "ack":  # acking again what this lease already acked is harmless
                    for s, e in record.acked.intersection(start, end):
                        valid.add(s, e)
                    early = state.ack_early(lease_id, start, end)  # ahead of the log end we know
                    if early is not None:
                        valid.add(*early)
                for s, e in valid.gaps(start, end):
                    note_stale(topic, partition, lease_id, s, e)
                applied += valid.count()
                if pieces:
                    self._apply(op, msg, group, member, state, record, pieces, now, out)
        return applied, stale, omitted

    def _apply(self, op: str, msg, group: Group, member: Member, state: PartitionState, record: LeaseRecord,
               pieces: list[Piece], now: int, out: list) -> None:
        if op == "extend":
            # Like a visibility timeout: the new deadline is now + extend_ms, as asked.
            deadline = now + (msg.extend_ms or group.config.ack_timeout_ms)
            state.extend(pieces, deadline)
            record.deadline_ms = max(record.deadline_ms, deadline)
            self._push(deadline, _LEASE, record.lease_id)
            return
        member.in_flight -= sum(e - s for s, e, _ in pieces)
        self._wake.add(group.name)  # capacity freed, maybe records ready
        if op == "ack":
            state.ack(pieces)
            for start, end, _ in pieces:
                record.acked.add(start, end)
            self._dirty[(group.name, state.key)] = state
        elif op == "nack":
            ready_at = now + msg.delay_ms + CLOCK_GRAIN_MS if msg.delay_ms else now
            doomed = state.requeue(pieces, _reason("nack", msg.reason), ready_at, now,
                                   group.config.max_deliveries, group.config.quarantine_after)
            if ready_at > now:
                self._push(ready_at, _DELAYED, (group.name, state.key))
            self._dead_letter(group, state, doomed, out)
            self._key_events(group, state, out)
        else:
            self._dead_letter(group, state, state.reject(pieces, _reason("reject", msg.reason), now), out)

    # ==================================================================================
    # Timers
    # ==================================================================================

    def _push(self, when_ms: int, kind: int, payload) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (when_ms, self._timer_seq, kind, payload))
        if len(self._timers) > self._compact_above:
            self._compact_timers()

    def _compact_timers(self) -> None:
        """Drop heap entries that can no longer do anything.

        Stale entries are normally skipped when popped, but a lease extended again
        and again, or parked polls answered early, would leave them to pile up until
        their times come. A lease entry is live while some piece of the lease still
        has exactly that deadline, or while it is the lease's own deadline: that
        entry is what forgets the lease record once every record under it is
        finished; a parked-poll entry while that poll waits; a session entry while
        its member is in the group.
        """
        live_deadlines: dict[int, set[int]] = {}
        for lease_id, record in self._leases.items():
            state = self._groups[record.group].partitions[record.key]
            live_deadlines[lease_id] = {p[2].deadline_ms for p in
                                        state.leased_under(lease_id, record.start, record.end)}

        def live(entry: tuple) -> bool:
            when, _seq, kind, payload = entry
            if kind == _LEASE:
                record = self._leases.get(payload)
                return record is not None and (when == record.deadline_ms or when in live_deadlines[payload])
            if kind == _PARKED:
                return self._parked.get(payload.token) is payload
            if kind == _SESSION:  # a member that left or expired needs no session timer
                group_name, member = payload
                group = self._groups.get(group_name)
                return group is not None and group.members.get(member.member_id) is member
            return True
        self._timers = [e for e in self._timers if live(e)]
        heapq.heapify(self._timers)
        self._compact_above = 2 * len(self._timers) + TIMER_SLACK

    def _run_timers(self, now: int, out: list) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, kind, payload = heapq.heappop(self._timers)
            if kind == _LEASE:
                self._expire_lease(payload, now, out)
            elif kind == _SESSION:
                group_name, member = payload
                group = self._groups[group_name]
                if group.members.get(member.member_id) is member:
                    self._expire_member(group, member, now, out)
            elif kind == _DELAYED:
                group_name, key = payload
                if self._groups[group_name].partitions[key].release_delayed(now):
                    self._wake.add(group_name)
            elif kind == _PARKED:
                if self._parked.get(payload.token) is payload:
                    group = self._groups[payload.group]
                    self._unpark(group, payload)
                    group.members[payload.member_id].last_seen_ms = now
                    out.append(Reply(payload.token, self._poll_reply(group, [], payload.acked, payload.stale,
                                                                     payload.stale_omitted)))
            elif kind == _KEYS:
                pass  # a key-hash fetch may be retried: _end asks for it
            else:  # _DEAD_LETTER_RETRY
                group_name, key, offset = payload
                group = self._groups[group_name]
                state = group.partitions[key]
                info = state.dead_letter_retry(offset)
                if info is not None:
                    out.append(self._dead_letter_effect(group, state, offset, info))

    def _expire_lease(self, lease_id: int, now: int, out: list) -> None:
        record = self._leases.get(lease_id)
        if record is None:
            return
        group = self._groups[record.group]
        state = group.partitions[record.key]
        expired = state.expire(lease_id, record.start, record.end, now)
        if expired:
            count = sum(e - s for s, e, _ in expired)
            self._metrics["records_expired"] += count
            self._uncount(group, expired[0][2], count)
            self._dead_letter(group, state, state.requeue(expired, TIMEOUT, now, now, group.config.max_deliveries,
                                                          group.config.quarantine_after), out)
            self._key_events(group, state, out)
            self._wake.add(group.name)
        if (now >= record.deadline_ms and not state.leased_under(lease_id, record.start, record.end)
                and (state.ahead is None or state.ahead.lease_id != lease_id)):
            del self._leases[lease_id]  # nothing can be leased under it any more

    # ==================================================================================
    # Dead letters
    # ==================================================================================

    def _dead_letter(self, group: Group, state: PartitionState, doomed: list, out: list) -> None:
        for start, end, info in doomed:
            out.append(Log("dead_letter", {"group": group.name, "topic": state.topic, "partition": state.partition,
                                           "start": start, "end": end, "attempts": info.attempts,
                                           "reason": info.last_reason,
                                           "dlq_topic": group.config.dlq_topic(state.topic)}))
            for offset in range(start, end):
                out.append(self._dead_letter_effect(group, state, offset, info))

    def _dead_letter_effect(self, group: Group, state: PartitionState, offset: int,
                            info: DeadLettering) -> DeadLetter:
        self._metrics["dead_letters_emitted"] += 1
        return DeadLetter(group.name, state.topic, state.partition, offset, group.config.dlq_topic(state.topic),
                          info.attempts, info.last_reason, info.id, info.drop_value)

    def _confirm_dead_letter(self, effect: DeadLetter, now: int, *, done: bool,
                             error: ZBrokerError | None = None) -> list:
        group_name, key, offset = effect.group, (effect.topic, effect.partition), effect.offset

        def confirm(out: list) -> None:
            group = self._groups.get(group_name)
            state = group.partitions.get(key) if group else None
            fields = {"group": group_name, "topic": key[0], "partition": key[1], "offset": offset}
            if state is None or state.dead_lettering_of(offset, effect.dead_lettering_id) is None:
                # E.g. the group was reset meanwhile: the record is no longer ours to finish,
                # or it is being dead-lettered again and this copy belongs to the earlier time.
                out.append(Log("dead_letter_confirmation_ignored", {**fields, "done": done}))
            elif done:
                state.dead_letter_done(offset)
                self._dirty[(group_name, key)] = state
            elif error is not None and error.code is ErrorCode.TOO_LARGE and not effect.drop_value:
                # Retrying the same copy can never pass, and a record the broker accepted
                # must be able to leave: the copy goes without its value, which stays
                # readable at the source offset while retention keeps it.
                info = state.dead_letter_drop_value(offset)
                self._metrics["dead_letters_value_dropped"] += 1
                out.append(Log("dead_letter_value_dropped", {**fields, "reason": error.message}))
                out.append(self._dead_letter_effect(group, state, offset, info))
            elif state.dead_letter_failed(offset):
                self._push(now + DEAD_LETTER_RETRY_MS, _DEAD_LETTER_RETRY, (group_name, key, offset))
                out.append(Log("dead_letter_failed", {
                    **fields, "retry_in_ms": DEAD_LETTER_RETRY_MS,
                    "error": None if error is None else error.code.value,
                    "retriable": error is None or error.retriable}))
        return self._event(now, confirm)

    # ==================================================================================
    # Admin: list, describe, configure, reset
    # ==================================================================================

    def _list_groups(self, out: list, token, msg, now: int) -> None:
        groups = [g.summary() for g in sorted(self._groups.values(), key=lambda g: g.name)]
        out.append(Reply(token, m.ListGroupsReply(groups=groups)))

    def _describe_group(self, out: list, token, msg: m.DescribeGroup, now: int) -> None:
        group = self._groups.get(msg.group)
        if group is None:
            out.append(ReplyError(token, UnknownGroup(f"unknown group {msg.group!r}", group=msg.group)))
        else:
            out.append(Reply(token, m.DescribeGroupReply(group=group.report(self._logs, now))))

    def _configure_group(self, out: list, token, msg: m.ConfigureGroup, now: int) -> None:
        changes = {f.name: getattr(msg, f.name) for f in dataclasses.fields(GroupConfig)
                   if getattr(msg, f.name) is not None}
        if changes.get("dlq") == "":
            changes["dlq"] = None  # "" restores the default "<topic>.dlq"
        existing = self._groups.get(msg.group)
        try:
            config = dataclasses.replace(self._default_config if existing is None else existing.config, **changes)
        except ValueError as exc:  # refused before the group exists: a typo creates nothing
            out.append(ReplyError(token, ProtocolError(str(exc), op="configure_group", group=msg.group)))
            return
        group = self._group(msg.group)
        old, group.config = group.config, config
        for state in group.partitions.values():
            self._sync_keys(group, state)
        if config.mode != old.mode:
            self._rebalance(group, now, out, "mode_changed", None, membership_changed=False)
        self._wake.add(group.name)  # limits may have grown
        out.append(PersistGroupConfig(group.name, config.to_dict()))
        out.append(Log("group_configured", {"group": group.name, **changes}))
        out.append(Reply(token, m.ConfigureGroupReply(config=config.to_dict())))

    def _known_group(self, out: list, token, name: str) -> Group | None:
        group = self._groups.get(name)
        if group is None:
            out.append(ReplyError(token, UnknownGroup(f"unknown group {name!r}", group=name)))
        return group

    def _list_quarantine(self, out: list, token, msg: m.ListQuarantine, now: int) -> None:
        group = self._known_group(out, token, msg.group)
        if group is None:
            return
        keys = [{"topic": state.topic, "partition": state.partition, **row}
                for k, state in sorted(group.partitions.items()) if state.keys is not None
                for row in state.keys.quarantine_report(now)]
        out.append(Reply(token, m.ListQuarantineReply(keys=keys)))

    def _release_key(self, out: list, token, msg: m.ReleaseKey, now: int) -> None:
        group = self._known_group(out, token, msg.group)
        if group is None:
            return
        if msg.key_hash is not None:
            h = msg.key_hash
        else:
            h = key_hash(msg.key.encode() if isinstance(msg.key, str) else msg.key)
        released = []
        for k, state in sorted(group.partitions.items()):
            if state.keys is None or (msg.topic is not None and state.topic != msg.topic):
                continue
            doomed = state.release_key(h, msg.to_dlq, now)
            if doomed is None:
                continue
            records = sum(end - start for start, end, _ in doomed)
            self._dead_letter(group, state, doomed, out)
            self._dirty[(group.name, state.key)] = state
            self._metrics["keys_released"] += 1
            released.append({"topic": state.topic, "partition": state.partition, "key_hash": h, "records": records})
            out.append(Log("key_released", {"group": group.name, "topic": state.topic, "partition": state.partition,
                                            "key_hash": h, "to_dlq": msg.to_dlq, "records": records}))
        self._wake.add(group.name)
        out.append(Reply(token, m.ReleaseKeyReply(released=released)))

    def _reset_group(self, out: list, token, msg: m.ResetGroup, now: int,
                     targets: dict[int, int] | None = None) -> None:
        group = self._known_group(out, token, msg.group)
        if group is None:
            return
        if msg.topic not in self._topics:
            out.append(ReplyError(token, UnknownTopic(f"unknown topic {msg.topic!r}", topic=msg.topic)))
            return
        keys = [(msg.topic, p) for p in range(self._topics[msg.topic])]
        missing = [k for k in keys if k not in self._logs]
        if missing:
            out.append(ReplyError(token, Unavailable(
                f"the log range of {msg.topic}/{missing[0][1]} is not known yet", topic=msg.topic,
                partition=missing[0][1])))
            return
        group.reset_epoch += 1
        result = []
        for key in keys:
            log = self._logs[key]
            to = msg.to if targets is None else targets.get(key[1], log.end)
            target = {"earliest": log.start, "latest": log.end}.get(to) if isinstance(to, str) else \
                min(max(to, log.start), log.end)
            state = self._add_state(group, key)
            self._end_ahead(group, state, now)
            for start, end, lease in state.reset_to(target):
                self._uncount(group, lease, end - start)
            self._dirty[(group.name, key)] = state
            result.append([key[1], target])
        # Every lease of the topic is revoked: acks under them are stale now, also the repeat
        # of one applied before the reset (its records are unfinished again).
        reset_keys = set(keys)
        for lease_id in [i for i, r in self._leases.items() if r.group == group.name and r.key in reset_keys]:
            del self._leases[lease_id]
        self._wake.add(group.name)
        out.append(Log("group_reset", {"group": group.name, "topic": msg.topic, "to": msg.to,
                                       "to_time_ms": msg.to_time_ms,
                                       "reset_epoch": group.reset_epoch, "partitions": result}))
        out.append(Reply(token, m.ResetGroupReply(partitions=result, reset_epoch=group.reset_epoch)))

    # ==================================================================================
    # Admin: delete (PROTOCOL.md s.8.5)
    # ==================================================================================

    def _delete_group(self, out: list, token, msg: m.DeleteGroup, now: int) -> None:
        group = self._groups.get(msg.group)
        if group is None:
            out.append(ReplyError(token, UnknownGroup(f"unknown group {msg.group!r}", group=msg.group)))
            return
        if group.members:
            # Its members hold leases and would recreate it at their next request: the
            # operator stops them first (Kafka's GROUP_NOT_EMPTY rule).
            out.append(ReplyError(token, GroupNotEmpty(
                f"group {msg.group!r} has {len(group.members)} live member(s); stop them first",
                group=msg.group, members=len(group.members))))
            return
        removed = self._forget_offsets(group, list(group.partitions), out)
        del self._groups[group.name]
        self._drop_timers(lambda kind, payload: _timer_group(kind, payload) == group.name)
        out.append(PersistGroupConfig(group.name, None))
        out.append(Log("group_deleted", {"group": group.name, "partitions": len(removed),
                                         "reset_epoch": group.reset_epoch}))
        out.append(Reply(token, m.DeleteGroupReply(group=group.name, partitions=[list(k) for k in removed])))

    def _forget_offsets(self, group: Group, keys: list[Key], out: list) -> list[Key]:
        """Drop `group`'s state for `keys` and write a tombstone row for each (one new
        reset epoch for all), so neither a restart nor a later incarnation of the group
        or topic sees those offsets again. Their leases end; unfinished records are not
        dead-lettered (the operator asked for the progress to go)."""
        group.reset_epoch += 1
        self._raise_epoch_floor(group.name, group.reset_epoch)
        gone = set(keys)
        for key in keys:
            group.partitions.pop(key, None)
            group.owners.pop(key, None)
            on = self._groups_on.get(key, [])
            if group in on:
                on.remove(group)
            if not on:
                self._groups_on.pop(key, None)
            self._keyed.pop((group.name, key), None)
            self._dirty.pop((group.name, key), None)
            out.append(PersistOffsets(group.name, key[0], key[1], 0, [], TOMBSTONE_GENERATION, group.reset_epoch))
        for lease_id in [i for i, r in self._leases.items() if r.group == group.name and r.key in gone]:
            del self._leases[lease_id]
        return sorted(gone)

    def _raise_epoch_floor(self, group: str, reset_epoch: int) -> None:
        self._epoch_floor[group] = max(self._epoch_floor.get(group, 0), reset_epoch)

    def _drop_timers(self, doomed: Callable[[int, Any], bool]) -> None:
        """Remove the heap entries `doomed(kind, payload)` names (their group or state is gone)."""
        self._timers = [e for e in self._timers if not doomed(e[2], e[3])]
        heapq.heapify(self._timers)

    # ==================================================================================
    # Helpers
    # ==================================================================================

    def _group(self, name: str) -> Group:
        group = self._groups.get(name)
        if group is None:
            group = self._groups[name] = Group(name, self._default_config)
            group.reset_epoch = self._epoch_floor.get(name, 0)
        return group

    def _add_state(self, group: Group, key: Key, *, fresh: bool = False, now: int | None = None,
                   out: list | None = None) -> PartitionState:
        """The group's state for `key`, created if needed (and its start resolved if `now` given)."""
        state = group.partitions.get(key)
        if state is None or fresh:
            if state is None:
                self._groups_on.setdefault(key, []).append(group)
            state = group.partitions[key] = PartitionState(*key, self._new_dead_lettering_id)
            self._keyed.pop((group.name, key), None)
            self._sync_keys(group, state)
        if now is not None:
            self._resolve_start(group, state, now, out)
        return state

    def _log_moved(self, key: Key, grew: bool, now: int, out: list) -> None:
        groups = self._groups_on.get(key, [])
        for group in groups:
            state = group.partitions[key]
            if grew and state.ahead is not None:
                self._fill_ahead(group, state, now)
            unresolved = state.committed is None
            self._resolve_start(group, state, now, out)
            if grew or unresolved:
                self._wake.add(group.name)  # new records may answer waiting polls
        committed = [g.partitions[key].committed for g in groups if g.partitions[key].committed is not None]
        if committed:  # first-seen times below every group's commit are no longer needed
            self._logs[key].forget_below(min(committed))

    def _resolve_start(self, group: Group, state: PartitionState, now: int, out: list) -> None:
        """Apply the `start` rule where there is no offset, or the offset fell below the log start."""
        log = self._logs.get(state.key)
        if log is None or (state.committed is not None and state.committed >= log.start):
            return
        offset = log.start if group.config.start == "earliest" else log.end
        fields = {"group": group.name, "topic": state.topic, "partition": state.partition,
                  "start": group.config.start, "offset": offset}
        if state.committed is None:
            state.start_at(offset)
            out.append(Log("start_position", fields))
        else:
            out.append(Log("committed_below_log_start", {**fields, "committed": state.committed,
                                                         "log_start": log.start}))
            self._end_ahead(group, state, now)
            for start, end, lease in state.skip_to(offset):
                self._uncount(group, lease, end - start)
        self._dirty[(group.name, state.key)] = state

    def _uncount(self, group: Group, lease: Lease, records: int) -> None:
        member = group.members.get(lease.member_id)
        if member is not None:
            member.in_flight -= records

    def _new_lease_id(self) -> int:
        self._next_lease_id += 1
        return self._next_lease_id

    def _new_dead_lettering_id(self) -> int:
        self._next_dead_lettering_id += 1
        return self._next_dead_lettering_id

    def _new_member_id(self, group: Group) -> str:
        # A client may join under an id it chose, and it could be one of this form.
        while True:
            self._member_seq += 1
            member_id = f"m-{self._lease_id_base}-{self._member_seq}"
            if member_id not in group.members:
                return member_id


def _timer_group(kind: int, payload: Any) -> str | None:
    """The group a timer entry belongs to (None: a lease timer, found through its record)."""
    if kind == _PARKED:
        return payload.group
    if kind in (_SESSION, _DELAYED, _DEAD_LETTER_RETRY):
        return payload[0]
    return None


def _delivery_bytes(topic: str) -> int:
    """The most one delivery of `topic` can take in a poll reply."""
    return DELIVERY_FIXED_BYTES + len(topic.encode()) + MAX_REASON_BYTES


def _reason(kind: str, text: str) -> str:
    """The reason "nack" or "nack:<text>" (or "reject..."), cut to MAX_REASON_BYTES (whole characters)."""
    if not text:
        return kind
    return f"{kind}:{text}".encode()[:MAX_REASON_BYTES].decode(errors="ignore")
