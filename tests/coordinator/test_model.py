"""Random interleavings of everything, checked against an independent model.

The machine plays clients, the commit writer and the shell around a real core.
It keeps its own per-offset model (small logs, so per-record sets are fine
here) of which lease holds which record until when, what is finished, how
often each record was delivered and what is on its way to the dead-letter
topic, and after every step compares the core's answers with it:

* stale acks are never applied: every ack/nack/extend/reject reply (applied
  count and the exact stale offsets) must match the model;
* a request made in a generation older than the last one observed is FENCED;
* no record is ever leased to two members at once, and in exclusive mode only
  the partition's owner receives leases; in-flight counts per partition and
  per member match the model's live leases;
* a dead letter is only emitted when justified (reject; nack or expiry at
  max_deliveries; a retry after a failure), never twice, and at once for a
  reject or a nack at max_deliveries;
* delivery attempts are counted exactly (restart counts as one earlier attempt);
* committed = first offset the core has not finished; it never passes an
  unfinished record and never goes backwards (except reset and restart, where
  it restarts from what was durable);
* every PersistOffsets is safe (below it all finished, holes finished, bounded)
  and never below what is already durable in the same reset epoch;
* ahead leases (`Poll.ahead`) start at the log end, only when nothing else can
  be leased, count in the member's in-flight records, turn into leases exactly
  as the log reaches them (early acks applied then) and end with their
  generation, a reset or a restart;
* finally, a draining consumer gets every record below the log end acked or
  dead-lettered.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from zbroker.actors.group_coordinator.core import DEAD_LETTER_RETRY_MS, GroupConfig, GroupCoordinatorCore
from zbroker.actors.group_coordinator.effects import DeadLetter, PersistOffsets, Reply, ReplyError
from zbroker.protocol import messages as m
from zbroker.protocol.errors import Fenced, StaleLease, Unavailable, UnknownMember

P = 2  # partitions of topic "t"
ACK_TIMEOUT = 1_000
MAX_DELIVERIES = 3
MAX_IN_FLIGHT = 6
MAX_HOLES = 2
SESSION = 5_000
OPS = {"ack": m.Ack, "nack": m.Nack, "extend": m.Extend, "reject": m.Reject}


class Client:
    def __init__(self) -> None:
        self.member_id: str | None = None
        self.generation = -1
        self.parked: int | None = None  # token of a waiting poll


def first_gap(finished: set[int]) -> int:
    o = 0
    while o in finished:
        o += 1
    return o


class CoordinatorMachine(RuleBasedStateMachine):
    MODE = "exclusive"

    def __init__(self) -> None:
        super().__init__()
        self.now = 10_000
        self.base = 1_000_000
        self.tokens = itertools.count(1)
        self.log_end = [0] * P
        self.config = GroupConfig(mode=self.MODE, ack_timeout_ms=ACK_TIMEOUT, max_deliveries=MAX_DELIVERIES,
                                  max_in_flight=MAX_IN_FLIGHT)
        self.clients = [Client() for _ in range(3)]
        self.token_owner: dict[int, tuple[Client, str]] = {}  # request token -> (client, member id used)
        self.deliveries_seen: list[tuple[int, int, int, int]] = []  # (p, lease, start, end), every incarnation
        # The model of the current core.
        self.active: dict[tuple[int, int], list] = {}  # (p, o) -> [lease_id, member, deadline]
        self.leases: dict[int, dict] = {}  # lease_id -> {member, p, acked, max_deadline}
        self.attempts: Counter = Counter()  # (p, o) -> deliveries so far
        self.core_fin = [set() for _ in range(P)]  # finished, as far as the current core knows
        # Finished at any time, per partition and reset epoch. A reset that never became
        # durable is undone by a restart, so the history of each epoch is kept.
        self.epoch = [0] * P
        self.fin_by_epoch = [{0: set()} for _ in range(P)]   # reset start + everything finished since
        self.done_by_epoch = [{0: set()} for _ in range(P)]  # only what consumers finished
        self.dead_lettering: dict[tuple[int, int], DeadLetter] = {}  # (p, o) -> emitted and not failed
        self.retry_at: dict[tuple[int, int], int] = {}  # failed dead letters: when they come back
        self.owners: dict[int, str] = {}
        # Ahead leases (Poll.ahead): p -> {lease, member, end, early acks, generation}.
        # Offsets from log_end[p] up to end are leased before they exist.
        self.ahead: dict[int, dict] = {}
        self.members: set[str] = set()
        self.last_committed = [0] * P
        self.group_exists = False
        # The commit writer: newest advance per key not yet flushed, and what is durable.
        self.writer_pending: dict[int, PersistOffsets] = {}
        self.durable: dict[int, PersistOffsets] = {}
        self.core = self._new_core(rows=[])

    # ==================================================================================
    # Plumbing: every core call goes through _call, which checks what came back.
    # ==================================================================================

    def _new_core(self, rows: list) -> GroupCoordinatorCore:
        core = GroupCoordinatorCore(lease_id_base=self.base, default_config=self.config,
                                    max_persisted_holes=MAX_HOLES)
        core.set_topic("t", P)
        for p in range(P):
            assert core.on_log_range("t", p, 0, self.log_end[p], self.now) == []
        probe = core.poll(0, m.Poll(group="g", member_id="x", generation=0), self.now)
        assert isinstance(probe[0].error, Unavailable)
        self.core = core
        self._absorb(core.load_offsets(rows, self.now))
        return core

    def _call(self, method: str, token, msg, client: Client | None = None):
        if client is not None:
            self.token_owner[token] = (client, getattr(msg, "member_id", ""))
        # Generations only grow, so a request made in another generation than the one
        # last observed must be fenced, whatever else happens in this call.
        must_fence = (self.group_exists and method not in ("join", "leave", "reset_group")
                      and msg.generation != self.group["generation"])
        effects = getattr(self.core, method)(token, msg, self.now)
        answer = self._absorb(effects, token, msg)
        if must_fence:
            assert isinstance(answer, Fenced), (method, msg, answer)
        return answer

    def _absorb(self, effects: list, token=None, msg=None):
        """Bring the model up to date with one core call, in the order the core acted."""
        expired = self._expire_model()
        self._observe_group()
        mine = [e for e in effects if isinstance(e, (Reply, ReplyError)) and e.token == token]
        assert len(mine) <= 1
        answer = None
        required_dead = set()
        if mine:
            answer = mine[0].msg if isinstance(mine[0], Reply) else mine[0].error
            self._note_membership_answer(token, answer)
            if msg is not None and (msg.op in OPS or (msg.op == "poll" and msg.acks)):
                required_dead = self._check_settle(msg, answer)
        allowed_dead = required_dead | {k for k in expired if self.attempts[k] >= MAX_DELIVERIES} | \
            {k for k, when in self.retry_at.items() if when <= self.now}
        emitted = set()
        for e in effects:
            if isinstance(e, Reply) and isinstance(e.msg, m.PollReply):
                self._record_deliveries(*self.token_owner.pop(e.token), e.msg)
            elif isinstance(e, ReplyError) and e.token in self.token_owner and e.token != token:
                client, _member = self.token_owner.pop(e.token)  # a waiting poll fenced by a rebalance
                assert isinstance(e.error, Fenced)
                client.parked = None
            elif isinstance(e, PersistOffsets):
                self._check_persist(e)
            elif isinstance(e, DeadLetter):
                key = (e.partition, e.offset)
                assert key in allowed_dead, f"unjustified dead letter {e}"
                assert key not in self.dead_lettering, f"dead letter emitted twice: {e}"
                assert e.attempts == self.attempts[key] and e.dlq_topic == "t.dlq"
                self.dead_lettering[key] = e  # the shell hands the effect back with its outcome
                self.retry_at.pop(key, None)
                emitted.add(key)
        assert required_dead <= emitted, f"missing dead letters {required_dead - emitted}"
        return answer

    def _as_client(self, c: int, make_msg, method: str):
        """Send a group request like the real clients do: join first if needed, and on
        FENCED re-sync (join with the same member id) and retry once."""
        client = self.clients[c]
        if client.member_id is None:
            self.join(c)
            if client.member_id is None:
                return None
        answer = self._call(method, next(self.tokens), make_msg(client), client)
        if isinstance(answer, Fenced) and client.member_id is not None:
            self.join(c)
            if client.member_id is not None:
                token = next(self.tokens)
                answer = self._call(method, token, make_msg(client), client)
        return answer

    def _expire_model(self) -> set:
        expired = {k for k, (_lease, _member, deadline) in self.active.items() if deadline <= self.now}
        for k in expired:
            del self.active[k]
        return expired

    def _observe_group(self) -> None:
        """Learn owners and members (the assignor is tested on its own); revoke what moved."""
        effects = self.core.describe_group("describe", m.DescribeGroup(group="g"), self.now)
        assert len(effects) == 1
        if isinstance(effects[0], ReplyError):
            return
        group = effects[0].msg.group
        self.group_exists = True
        owners = {p: o for _t, p, o in group["assignment"]}
        members = {x["member_id"] for x in group["members"]}
        for p in [p for p, a in self.ahead.items() if a["generation"] != group["generation"]]:
            del self.ahead[p]  # an ahead lease ends with its generation
        for key, (_lease, member, _deadline) in list(self.active.items()):
            entitled = owners.get(key[0]) == member if self.MODE == "exclusive" else member in members
            if not entitled:
                del self.active[key]
        self.owners, self.members, self.group = owners, members, group

    def _note_membership_answer(self, token, answer) -> None:
        if token not in self.token_owner:
            return
        client, _member = self.token_owner[token]
        if isinstance(answer, m.JoinReply):
            client.member_id, client.generation = answer.member_id, answer.generation
        elif isinstance(answer, UnknownMember) or (isinstance(answer, Fenced) and not answer.data["member_known"]):
            client.member_id = None
        if answer is not None and not isinstance(answer, m.PollReply):
            self.token_owner.pop(token, None)

    def _record_deliveries(self, client: Client, member: str, reply: m.PollReply) -> None:
        client.parked = None
        for t, p, lease_id, start, end, attempt, reason in reply.deliveries:
            assert self._may_lease(member, p), f"{member} may not lease partition {p}"
            assert lease_id not in self.leases
            if reason == "ahead":
                # Only when nothing else could be leased: it starts at the log end, holds none of
                # the records that exist, and is the partition's only one.
                assert self.MODE == "exclusive" and attempt == 1 and p not in self.ahead
                assert t == "t" and start == self.log_end[p] < end
                self.ahead[p] = {"lease": lease_id, "member": member, "end": end, "early": set(),
                                 "generation": self.group["generation"]}
                self.leases[lease_id] = {"member": member, "p": p, "acked": set(), "max_deadline": 0}
                self.deliveries_seen.append((p, lease_id, start, end))
                continue
            assert t == "t" and 0 <= start < end <= self.log_end[p]
            for o in range(start, end):
                key = (p, o)
                assert key not in self.active, f"offset {key} leased twice"
                assert o not in self.core_fin[p] and key not in self.dead_lettering
                before = self.attempts[key]
                assert attempt == before + 1, (key, attempt, before)
                assert (reason == "new") == (before == 0), (key, reason, before)
                self.attempts[key] = attempt
                self.active[key] = [lease_id, member, self.now + ACK_TIMEOUT]
            self.leases[lease_id] = {"member": member, "p": p, "acked": set(),
                                     "max_deadline": self.now + ACK_TIMEOUT}
            self.deliveries_seen.append((p, lease_id, start, end))

    def _may_lease(self, member: str, p: int) -> bool:
        return self.owners.get(p) == member if self.MODE == "exclusive" else member in self.members

    def _check_settle(self, msg, answer) -> set:
        """Predict an ack/nack/extend/reject (or the acks a poll carries) exactly; apply it to the model."""
        if isinstance(answer, (Fenced, UnknownMember)):
            return set()
        op = "ack" if msg.op == "poll" else msg.op
        applied, stale, dead = 0, Counter(), set()
        # The ranges of one request are merged per lease: an offset named twice is settled once.
        named: dict[tuple, set] = {}
        for _t, p, lease_id, start, end in (msg.acks if msg.op == "poll" else msg.ranges):
            named.setdefault((p, lease_id), set()).update(range(start, end))
        for (p, lease_id), offsets in named.items():
            info = self.leases.get(lease_id)
            for o in sorted(offsets):
                key = (p, o)
                held = self.active.get(key)
                mine = info is not None and info["member"] == msg.member_id and info["p"] == p
                if mine and held is not None and held[0] == lease_id:
                    applied += 1
                    self._settle_one(op, msg, key, lease_id, dead)
                elif mine and op == "ack" and o in info["acked"] and self.now < info["max_deadline"]:
                    applied += 1  # idempotent re-ack
                elif (mine and op == "ack" and (a := self.ahead.get(p)) is not None and a["lease"] == lease_id
                      and self.log_end[p] <= o < a["end"]):
                    applied += 1  # ahead of the log: kept until the record exists
                    a["early"].add(o)
                else:
                    stale[(p, lease_id, o)] += 1
        if isinstance(answer, m.PollReply):  # acks riding on a poll: stale ones do not fail it
            got = Counter((p, lease, o) for _t, p, lease, s, e in answer.stale for o in range(s, e))
            assert got == stale and answer.acked == applied, (answer, stale, applied)
        elif stale:
            assert isinstance(answer, StaleLease), (answer, stale)
            got = Counter((p, lease, o) for _t, p, lease, s, e in answer.data["stale"] for o in range(s, e))
            assert got == stale
            assert answer.data["applied"] == applied
        else:
            assert answer.applied == applied, (answer, applied)
        return dead

    def _settle_one(self, op: str, msg, key, lease_id, dead: set) -> None:
        p, o = key
        if op == "extend":
            deadline = self.now + (msg.extend_ms or ACK_TIMEOUT)
            self.active[key][2] = deadline
            info = self.leases[lease_id]
            info["max_deadline"] = max(info["max_deadline"], deadline)
            return
        del self.active[key]
        if op == "ack":
            self.leases[lease_id]["acked"].add(o)
            self.core_fin[p].add(o)
            self._finished_ever(p, o)
        elif op == "reject" or self.attempts[key] >= MAX_DELIVERIES:
            dead.add(key)

    def ever_fin(self, p: int) -> set[int]:
        return self.fin_by_epoch[p][self.epoch[p]]

    def _finished_ever(self, p: int, o: int) -> None:
        self.fin_by_epoch[p][self.epoch[p]].add(o)
        self.done_by_epoch[p][self.epoch[p]].add(o)

    def _check_persist(self, e: PersistOffsets) -> None:
        p = e.partition
        assert (e.group, e.topic) == ("g", "t")
        assert all(o in self.ever_fin(p) for o in range(e.committed)), "persisted past an unfinished record"
        assert all(o in self.ever_fin(p) for s, end in e.holes for o in range(s, end))
        assert len(e.holes) <= MAX_HOLES
        durable = self.durable.get(p)
        if durable is not None:
            assert (e.reset_epoch, e.committed) >= (durable.reset_epoch, durable.committed), \
                f"persist {e} below durable {durable}"
        self.writer_pending[p] = e

    # ==================================================================================
    # Invariants
    # ==================================================================================

    @invariant()
    def core_agrees_with_model(self) -> None:
        """Committed = first unfinished offset, never backwards; in-flight counts per
        partition and per member match the model's live leases; durable = the writer's."""
        if not self.group_exists:
            return
        self._observe_group()
        for part in self.group["partitions"]:
            p = part["partition"]
            committed = part["committed_pending"]
            assert committed == first_gap(self.core_fin[p]), (p, committed, sorted(self.core_fin[p]))
            assert committed >= self.last_committed[p], "committed went backwards"
            self.last_committed[p] = committed
            assert part["in_flight"] == sum(1 for (q, _o) in self.active if q == p)
            durable = self.durable.get(p)
            assert part["committed"] == (durable.committed if durable else None)
        for member in self.group["members"]:
            held = sum(1 for _lease, holder, _deadline in self.active.values() if holder == member["member_id"])
            held += sum(a["end"] - self.log_end[p] for p, a in self.ahead.items() if a["member"] == member["member_id"])
            assert member["in_flight"] == held, (member, held)
        for part in self.group["partitions"]:
            a = self.ahead.get(part["partition"])
            expected = None if a is None else {"member": a["member"], "start": self.log_end[part["partition"]],
                                               "end": a["end"]}
            assert part["ahead"] == expected, (part["ahead"], expected)

    # ==================================================================================
    # Rules
    # ==================================================================================

    @rule(p=st.integers(0, P - 1), n=st.integers(1, 8))
    def produce(self, p, n):
        # Due timers first (a session expiry may end an ahead lease), so that the log-range
        # call below changes only the log and the model can fill the ahead lease first.
        self._absorb(self.core.tick(self.now))
        old, self.log_end[p] = self.log_end[p], self.log_end[p] + n
        a = self.ahead.get(p)
        if a is not None:
            info = self.leases[a["lease"]]
            for o in range(old, min(self.log_end[p], a["end"])):
                self.attempts[(p, o)] = 1
                if o in a["early"]:  # acked before the coordinator knew it existed
                    info["acked"].add(o)
                    self.core_fin[p].add(o)
                    self._finished_ever(p, o)
                else:
                    self.active[(p, o)] = [a["lease"], a["member"], self.now + ACK_TIMEOUT]
            info["max_deadline"] = self.now + ACK_TIMEOUT
            if self.log_end[p] >= a["end"]:
                del self.ahead[p]
        self._absorb(self.core.on_log_range("t", p, 0, self.log_end[p], self.now))

    @rule(c=st.integers(0, 2))
    def join(self, c):
        client = self.clients[c]
        self._call("join", next(self.tokens), m.Join(group="g", topics=["t"], member_id=client.member_id or "",
                                                     session_timeout_ms=SESSION), client)

    @rule(c=st.integers(0, 2))
    def heartbeat(self, c):
        self._as_client(c, lambda cl: m.Heartbeat(group="g", member_id=cl.member_id, generation=cl.generation),
                        "heartbeat")

    @rule(c=st.integers(0, 2))
    def leave(self, c):
        client = self.clients[c]
        if client.member_id is not None:
            self._call("leave", next(self.tokens), m.Leave(group="g", member_id=client.member_id,
                                                           generation=client.generation), client)
            client.member_id = None

    @rule(c=st.integers(0, 2))
    def crash(self, c):
        """The client vanishes without leaving: only its session timeout removes it."""
        client = self.clients[c]
        if client.parked is not None:
            self.core.cancel_parked(client.parked)
            self.token_owner.pop(client.parked, None)
        self.clients[c] = Client()

    @rule(c=st.integers(0, 2), max_records=st.integers(1, 8), wait=st.sampled_from([0, 0, 500, 2_000]),
          ahead=st.sampled_from([0, 4, 4]))
    def poll(self, c, max_records, wait, ahead):
        client = self.clients[c]
        if client.parked is not None:
            return
        for _attempt in range(2):  # a fenced poll re-syncs and is retried once
            if client.member_id is None:
                self.join(c)
            if client.member_id is None:
                return
            token = next(self.tokens)
            answer = self._call("poll", token, m.Poll(group="g", member_id=client.member_id,
                                                      generation=client.generation, max_records=max_records,
                                                      max_wait_ms=wait, ahead=ahead), client)
            if answer is None:
                assert wait > 0
                client.parked = token
            if not isinstance(answer, Fenced):
                return

    @rule(c=st.integers(0, 2), op=st.sampled_from(["ack", "ack", "ack", "nack", "nack", "extend", "reject"]),
          picks=st.lists(st.tuples(st.integers(0, 50),
                                   st.sampled_from(["whole", "whole", "head", "tail", "middle", "overhang"]),
                                   st.sampled_from(["own"] * 4 + ["own_old"] * 2 + ["any", "bogus", "other_partition"])),
                         min_size=1, max_size=3),
          delay=st.sampled_from([0, 0, 300]), extend_ms=st.sampled_from([0, 200, 2_000]),
          reason=st.sampled_from(["", "oops"]), on_a_poll=st.booleans())
    def settle(self, c, op, picks, delay, extend_ms, reason, on_a_poll):
        """Ack, nack, extend or reject ranges: mostly of this client's own leases, sometimes
        parts of them, sometimes someone else's, an unknown lease id or the wrong partition.
        Acks go as an `ack` or ride on a poll (Poll.acks) that may lease more."""
        client = self.clients[c]
        if not self.deliveries_seen:
            return
        if op == "ack" and on_a_poll and client.parked is not None:
            on_a_poll = False  # one waiting poll per client in this model
        if client.member_id is None:
            self.join(c)
        own = [d for d in self.deliveries_seen if self.leases.get(d[1], {}).get("member") == client.member_id]
        live = {lease for lease, _member, _deadline in self.active.values()}
        own_live = [d for d in own if d[1] in live]
        # An earlier lease of this member over records it holds again under a newer one:
        # acking under the old id must not touch the new lease.
        own_superseded = [d for d in own if d[1] not in live and any(
            self.active.get((d[0], o), [d[1]])[0] != d[1] for o in range(d[2], d[3]))]
        ranges = []
        for index, shape, whose in picks:
            pool = {"own": own_live or own, "own_old": own_superseded or own}.get(whose) or self.deliveries_seen
            p, lease, start, end = pool[index % len(pool)]
            mid = (start + end) // 2
            start, end = {"whole": (start, end), "head": (start, max(start + 1, mid)),
                          "tail": (min(mid, end - 1), end),
                          "middle": (start + 1, end - 1) if end - start >= 3 else (start, end),
                          "overhang": (max(0, start - 1), end + 2)}[shape]
            if whose == "bogus":
                lease += 10 ** 8
            if whose == "other_partition":
                p = 1 - p
            ranges.append(["t", p, lease, start, end])
        fields = {"nack": {"delay_ms": delay, "reason": reason}, "extend": {"extend_ms": extend_ms},
                  "reject": {"reason": reason}}.get(op, {})
        if op == "ack" and on_a_poll:
            self._as_client(c, lambda cl: m.Poll(group="g", member_id=cl.member_id, generation=cl.generation,
                                                 max_records=3, acks=ranges), "poll")
            return
        self._as_client(c, lambda cl: OPS[op](group="g", member_id=cl.member_id, generation=cl.generation,
                                              ranges=ranges, **fields), op)

    @rule(c=st.integers(0, 2), n=st.integers(1, 3), past_the_end=st.sampled_from([0, 0, 2]))
    def ack_ahead(self, c, n, past_the_end):
        """A member acks records of its ahead lease that the coordinator has not heard of yet
        (its parked fetch beat the log-end report), sometimes past the end of the lease."""
        client = self.clients[c]
        mine = [(p, a) for p, a in sorted(self.ahead.items()) if a["member"] == client.member_id]
        if not mine:
            return
        p, a = mine[0]
        start = self.log_end[p]
        ranges = [["t", p, a["lease"], start, min(start + n, a["end"]) + past_the_end]]
        self._as_client(c, lambda cl: m.Ack(group="g", member_id=cl.member_id, generation=cl.generation,
                                            ranges=ranges), "ack")

    @rule(c=st.integers(0, 2), max_records=st.integers(1, 8),
          policy=st.sampled_from(["ack", "ack", "ack_half", "ack_tail", "ack_tail", "nack", "nack_later",
                                  "nack_then_ack_old_id", "reject_one", "extend", "keep"]))
    def consume(self, c, max_records, policy):
        """What a consumer does: poll, then settle what it got one way or another."""
        client = self.clients[c]
        if client.parked is not None:
            return
        answer = self._as_client(c, lambda cl: m.Poll(group="g", member_id=cl.member_id, generation=cl.generation,
                                                      max_records=max_records), "poll")
        if not isinstance(answer, m.PollReply) or not answer.deliveries or policy == "keep":
            return
        got = [["t", p, lease, s, e] for _t, p, lease, s, e, _a, _r in answer.deliveries]
        if policy == "nack_then_ack_old_id":
            # A buggy client: gives records back, gets them again under a new lease, then
            # acks with the old lease id. Those acks must be stale, the new lease untouched.
            self._as_client(c, lambda cl: m.Nack(group="g", member_id=cl.member_id, generation=cl.generation,
                                                 ranges=got), "nack")
            self._as_client(c, lambda cl: m.Poll(group="g", member_id=cl.member_id, generation=cl.generation,
                                                 max_records=max_records), "poll")
            policy = "ack"
        op, fields, ranges = {
            "ack": ("ack", {}, got),
            "ack_half": ("ack", {}, [[t, p, lease, s, max(s + 1, (s + e) // 2)] for t, p, lease, s, e in got]),
            "ack_tail": ("ack", {}, [[t, p, lease, min(e - 1, (s + e) // 2 + 1), e] for t, p, lease, s, e in got]),
            "nack": ("nack", {"reason": "later"}, got),
            "nack_later": ("nack", {"delay_ms": 300}, got),
            "reject_one": ("reject", {"reason": "poison"}, [got[0][:3] + [got[0][3], got[0][3] + 1]]),
            "extend": ("extend", {"extend_ms": 2_000}, got),
        }[policy]
        self._as_client(c, lambda cl: OPS[op](group="g", member_id=cl.member_id, generation=cl.generation,
                                              ranges=ranges, **fields), op)

    @rule(ms=st.sampled_from([1, 100, 400, 1_000, 1_000, 1_000, 6_000]))
    def advance(self, ms):
        # Live clients heartbeat on their own (a thread in the real clients), so only
        # crashed ones, or everyone across the rare long pause, miss their session.
        if ms < SESSION:
            for c, client in enumerate(self.clients):
                if client.member_id is not None:
                    self.heartbeat(c)
        self.now += ms
        self._absorb(self.core.tick(self.now))
        deadline = self.core.next_deadline()
        assert deadline is None or deadline > self.now

    @rule(i=st.integers(0, 20), done=st.booleans())
    def dead_letter_outcome(self, i, done):
        pending = sorted(k for k, v in self.dead_lettering.items() if v)
        if not pending:
            return
        p, o = pending[i % len(pending)]
        effect = self.dead_lettering[(p, o)]
        if done:
            del self.dead_lettering[(p, o)]
            self.core_fin[p].add(o)
            self._finished_ever(p, o)
            self._absorb(self.core.on_dead_letter_done(effect, self.now))
        else:
            del self.dead_lettering[(p, o)]
            self.retry_at[(p, o)] = self.now + DEAD_LETTER_RETRY_MS
            self._absorb(self.core.on_dead_letter_failed(effect, self.now))

    @rule()
    def flush_writer(self):
        """The writer makes its newest advances durable (monotonic guard) and says so."""
        reported = []
        for p, e in sorted(self.writer_pending.items()):
            old = self.durable.get(p)
            if old is None or (e.reset_epoch, e.committed) >= (old.reset_epoch, old.committed) \
                    or e.reset_epoch > old.reset_epoch:
                self.durable[p] = e
            d = self.durable[p]
            reported.append(("g", "t", p, d.committed, d.reset_epoch))
        self.writer_pending.clear()
        self._absorb(self.core.on_durable(reported, self.now))

    @rule(flush_first=st.booleans(), rare=st.integers(0, 3))
    def restart(self, flush_first, rare):
        """A new coordinator loads what is durable; the writer either flushed or lost its queue."""
        if rare:
            return
        if flush_first:
            self.flush_writer()
        self.writer_pending.clear()
        rows = [("g", "t", p, d.committed, d.holes, d.generation, d.reset_epoch) for p, d in self.durable.items()]
        self.base += 10 ** 9
        self.active.clear()
        self.ahead.clear()
        self.leases.clear()
        self.dead_lettering.clear()
        self.retry_at.clear()
        self.token_owner.clear()
        for client in self.clients:
            client.parked = None
        self.attempts = Counter()
        for p in range(P):
            d = self.durable.get(p)
            committed, holes = (d.committed, d.holes) if d else (0, [])
            loaded_epoch = d.reset_epoch if d else 0
            if loaded_epoch < self.epoch[p]:
                # The reset(s) after the loaded epoch were never durable: they are undone,
                # but what consumers finished meanwhile was really processed.
                later = [e for e in self.fin_by_epoch[p] if e > loaded_epoch]
                for e in later:
                    self.fin_by_epoch[p][loaded_epoch] |= self.done_by_epoch[p][e]
                    self.done_by_epoch[p][loaded_epoch] |= self.done_by_epoch[p].pop(e)
                    del self.fin_by_epoch[p][e]
                self.epoch[p] = loaded_epoch
            self.core_fin[p] = set(range(committed)) | {o for s, e in holes for o in range(s, e)}
            top = max([committed] + [e for _s, e in holes])
            for o in range(committed, top):
                if o not in self.core_fin[p]:
                    self.attempts[(p, o)] = 1  # delivered before, how often is unknown
            self.last_committed[p] = committed
        self.group_exists = False
        self._new_core(rows)

    @precondition(lambda self: self.group_exists)
    @rule(to=st.one_of(st.sampled_from(["earliest", "latest"]), st.integers(0, 30)), rare=st.integers(0, 4))
    def reset(self, to, rare):
        if rare:
            return  # resets forget all progress: keep them rare so runs get somewhere
        targets = {p: 0 if to == "earliest" else self.log_end[p] if to == "latest" else min(to, self.log_end[p])
                   for p in range(P)}
        # The model moves first: the reply's effects (persists) are checked against it.
        new_epoch = self.group["reset_epoch"] + 1
        self.active.clear()
        self.ahead.clear()
        self.leases.clear()  # every lease of the topic is revoked: even a repeated ack under one is stale
        for p, x in targets.items():
            self.core_fin[p] = set(range(x))
            self.epoch[p] = new_epoch
            self.fin_by_epoch[p][self.epoch[p]] = set(range(x))
            self.done_by_epoch[p][self.epoch[p]] = set()
            self.last_committed[p] = x
            for key in [k for k in self.attempts if k[0] == p]:
                del self.attempts[key]
            for table in (self.dead_lettering, self.retry_at):
                for key in [k for k in table if k[0] == p]:
                    del table[key]
        answer = self._call("reset_group", next(self.tokens), m.ResetGroup(group="g", topic="t", to=to))
        assert dict(answer.partitions) == targets and answer.reset_epoch == new_epoch

    # ==================================================================================
    # Drain: a consumer that keeps polling and acking finishes everything.
    # ==================================================================================

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # the run already failed; let that error through
        for c in range(len(self.clients)):
            self.crash(c)
        self.advance(SESSION + ACK_TIMEOUT)
        drainer = self.clients[0]
        progress, idle = None, 0
        for _ in range(200):
            if all(first_gap(self.core_fin[p]) >= self.log_end[p] for p in range(P)) and not self.dead_lettering:
                break
            now_progress = (tuple(first_gap(f) for f in self.core_fin), sum(map(len, self.core_fin)))
            idle = idle + 1 if now_progress == progress else 0
            progress = now_progress
            if idle > 15:
                break  # stuck: the assertions below say where
            if drainer.member_id is None or not self._poll_and_ack(drainer):
                self.join(0)
            for key in list(self.dead_lettering):
                self.dead_letter_outcome(0, True)
            self.advance(ACK_TIMEOUT)
            self.core_agrees_with_model()
        for p in range(P):
            assert set(range(self.log_end[p])) <= self.ever_fin(p), f"partition {p} not drained"
            assert first_gap(self.core_fin[p]) >= self.log_end[p]
        self.core_agrees_with_model()
        self.flush_writer()
        assert all(self.durable[p].committed == self.log_end[p] for p in range(P) if self.log_end[p])

    def _poll_and_ack(self, client: Client) -> bool:
        token = next(self.tokens)
        answer = self._call("poll", token, m.Poll(group="g", member_id=client.member_id,
                                                  generation=client.generation, max_records=100), client)
        if not isinstance(answer, m.PollReply):
            return False
        if answer.deliveries:
            ranges = [["t", p, lease, s, e] for _t, p, lease, s, e, _a, _r in answer.deliveries]
            reply = self._call("ack", next(self.tokens), m.Ack(group="g", member_id=client.member_id,
                                                               generation=client.generation, ranges=ranges),
                               client)
            assert isinstance(reply, m.AckReply)
        return True


class SharedCoordinatorMachine(CoordinatorMachine):
    MODE = "shared"


# `make test` runs the full 300; `make test-fast` fewer (ZBROKER_MODEL_EXAMPLES), for a quick loop.
SETTINGS = settings(max_examples=int(os.environ.get("ZBROKER_MODEL_EXAMPLES", "300")), stateful_step_count=100,
                    deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestExclusiveGroup = CoordinatorMachine.TestCase
TestExclusiveGroup.settings = SETTINGS
TestSharedGroup = SharedCoordinatorMachine.TestCase
TestSharedGroup.settings = SETTINGS
