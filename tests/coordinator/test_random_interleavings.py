"""Random interleavings of the group coordinator's core, aimed at what test_model.py leaves out.

test_model.py drives one topic whose log starts at 0, with a fixed configuration.
Here the sequences also take in retention moving the log start (past the committed
offset, leases, ready and dead-lettering records), two topics and members
subscribed to different sets of them, a partition added while running, switches
between exclusive and shared mode, changes of max_in_flight and ack_timeout_ms,
resets, ahead leases, acks riding on polls, a commit writer that confirms late,
and coordinator restarts that lose what the writer had not made durable, with
holes truncated (max_persisted_holes=3).

The oracle is deliberately coarse: per (group, topic, partition) the offsets
known finished (an ack reply counted them, or a dead letter confirmed and not
ignored), the floor of the last reset and the log start. After every step:

* each PersistOffsets covers only such offsets (committed offset and holes), and
  never goes backwards within a reset epoch;
* every outstanding offset is in exactly one region, none below the committed
  offset, and none both finished and outstanding;
* exclusive leases are held by the partition's owner only, and each member's
  in_flight equals its leased records plus its unfilled ahead offsets.

At the end one consumer drains everything: a wedged partition fails the run.
Written by a reviewer (2026-12-01) on the hunt that found the dead-lettering id
bug (test_leases); a mutant that lets the commit skip a one-record gap fails
every case.
"""
from __future__ import annotations

import itertools
import random

import pytest

from zbroker.actors.group_coordinator.core import GroupConfig, GroupCoordinatorCore
from zbroker.actors.group_coordinator.effects import DeadLetter, Log, PersistOffsets, Reply, ReplyError
from zbroker.protocol import messages as m
from zbroker.protocol.errors import ZBrokerError

G = "g"


class Interleaving:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.now = 10_000
        self.tokens = itertools.count(1)
        self.topics = {"a": 2, "b": 1}
        self.logs = {("a", 0): [0, 0], ("a", 1): [0, 0], ("b", 0): [0, 0]}
        self.fin: dict = {}     # key -> set of finished offsets (current epoch)
        self.floor: dict = {}   # key -> offsets below are allowed (reset target)
        self.last_persist: dict = {}  # key -> (epoch, committed)
        self.durable: dict = {}  # key -> row
        self.writer_pending: dict = {}
        self.dl_pending: list = []
        self.members: dict = {}  # cid -> [member_id, generation, topics]
        self.held: dict = {}     # cid -> list of [t, p, lease, s, e]
        self.base = 1_000_000
        self.trace: list = []
        self.to_check: list = []
        self.reset_dirty = False
        self.core = self._new_core([])

    def _new_core(self, rows):
        core = GroupCoordinatorCore(lease_id_base=self.base, default_config=GroupConfig(
            ack_timeout_ms=1000, max_deliveries=3, max_in_flight=8), max_persisted_holes=3)
        for t, n in self.topics.items():
            core.set_topic(t, n)
        self.core = core
        self.last_persist = {k: (r[6], r[3]) for k, r in self.durable.items()}
        for (t, p), (s, e) in self.logs.items():
            if p < self.topics[t]:
                self._absorb(core.on_log_range(t, p, s, e, self.now))
        self._absorb(core.load_offsets(rows, self.now))
        self.check_persists()
        return core

    def allowed(self, key, o):
        t, p = key[1], key[2]
        return o < self.floor.get(key, 0) or o in self.fin.get(key, set()) or o < self.logs[(t, p)][0]

    def _absorb(self, effects, token=None):
        ans = None
        for e in effects:
            if isinstance(e, PersistOffsets):
                self.to_check.append(e)
            elif isinstance(e, DeadLetter):
                self.dl_pending.append(e)
            elif isinstance(e, (Reply, ReplyError)) and e.token == token:
                ans = e.msg if isinstance(e, Reply) else e.error
        self.check_counts()
        return ans

    def check_persists(self):
        todo, self.to_check = self.to_check, []
        for e in todo:
            key = (e.group, e.topic, e.partition)
            for o in range(0, e.committed):
                assert self.allowed(key, o), (f"commit {e.committed} passes unfinished {o}", e)
            for s, t in e.holes:
                for o in range(s, t):
                    assert self.allowed(key, o), (f"hole {o} not finished", e)
            prev = self.last_persist.get(key)
            if prev is not None:
                assert (e.reset_epoch, e.committed) >= prev, ("backwards", prev, e)
            self.last_persist[key] = (e.reset_epoch, e.committed)
            self.writer_pending[key] = [e.group, e.topic, e.partition, e.committed, e.holes, e.generation,
                                        e.reset_epoch]

    def check_counts(self):
        core = self.core
        g = core._groups.get(G)
        if g is None:
            return
        per = {mid: 0 for mid in g.members}
        for st in g.partitions.values():
            for s, e, lease in st.leased:
                if lease.member_id in per:
                    per[lease.member_id] += e - s
                if g.config.mode == "exclusive":
                    assert g.owners.get(st.key) == lease.member_id, ("lease held by non-owner", st.key, lease)
            if st.ahead is not None and st.ahead.member_id in per:
                per[st.ahead.member_id] += st.ahead.end - st.next_new
            # disjointness of regions
            seen = set()
            for region in (st.leased, st.ready, st.delayed, st.dead_lettering):
                for s, e, _ in region:
                    for o in range(s, e):
                        assert o not in seen, ("offset in two regions", st.key, o)
                        assert o >= st.committed, ("region below committed", st.key, o, st.committed)
                        seen.add(o)
            for s, e in st.finished:
                for o in range(s, e):
                    assert o not in seen, ("finished and outstanding", st.key, o)
        for mid, mem in g.members.items():
            assert mem.in_flight == per[mid], ("in_flight drift", mid, mem.in_flight, per[mid])

    def call(self, method, msg):
        token = next(self.tokens)
        self.trace.append((self.now, method, msg))
        ans = self._absorb(getattr(self.core, method)(token, msg, self.now), token)
        return ans

    # -- operations ----------------------------------------------------------------
    def op_produce(self):
        k = self.r.choice(list(self.logs))
        if self.logs[k][1] > 80:
            return
        self.logs[k][1] += self.r.randint(1, 6)
        self.trace.append((self.now, "log", k, tuple(self.logs[k])))
        self._absorb(self.core.on_log_range(k[0], k[1], *self.logs[k], self.now))

    def op_retention(self):
        k = self.r.choice(list(self.logs))
        s, e = self.logs[k]
        if e > s:
            self.logs[k][0] = self.r.randint(s, e)
            self.trace.append((self.now, "log", k, tuple(self.logs[k])))
            self._absorb(self.core.on_log_range(k[0], k[1], *self.logs[k], self.now))

    def op_join(self):
        c = self.r.randint(0, 2)
        topics = self.r.choice([["a"], ["b"], ["a", "b"]])
        mid = self.members[c][0] if c in self.members and self.r.random() < 0.7 else ""
        ans = self.call("join", m.Join(group=G, topics=topics, member_id=mid, session_timeout_ms=5000))
        if isinstance(ans, m.JoinReply):
            self.members[c] = [ans.member_id, ans.generation, topics]

    def op_leave(self):
        if self.members:
            c = self.r.choice(list(self.members))
            mid, gen, _ = self.members.pop(c)
            self.call("leave", m.Leave(group=G, member_id=mid, generation=gen))

    def op_poll(self):
        if not self.members:
            return
        c = self.r.choice(list(self.members))
        mid, gen, _ = self.members[c]
        acks = []
        if self.r.random() < 0.3 and self.held.get(c):
            acks = self._pick(c)
        ans = self.call("poll", m.Poll(group=G, member_id=mid, generation=gen, max_records=self.r.randint(1, 8),
                                       ahead=self.r.choice([0, 0, 3]), acks=acks))
        if isinstance(ans, m.PollReply):
            self._ack_result(acks, ans.stale)
            for t, p, lease, s, e, _a, _r in ans.deliveries:
                self.held.setdefault(c, []).append([t, p, lease, s, e])
        elif isinstance(ans, ZBrokerError) and ans.code.name == "FENCED":
            self.members[c][1] = ans.data.get("generation", gen)

    def _pick(self, c):
        held = self.held.get(c, [])
        out = []
        for t, p, lease, s, e in self.r.sample(held, min(len(held), self.r.randint(1, 3))):
            a = self.r.randint(s, e - 1) if e > s else s
            b = self.r.randint(a + 1, e) if e > a else e
            out.append([t, p, lease, a, b])
        return out

    def _ack_result(self, ranges, stale):
        stale_set = set()
        for t, p, lease, s, e in stale or []:
            for o in range(s, e):
                stale_set.add((t, p, lease, o))
        for t, p, lease, s, e in ranges:
            for o in range(s, e):
                if (t, p, lease, o) not in stale_set:
                    self.fin.setdefault((G, t, p), set()).add(o)

    def op_settle(self):
        if not self.members:
            return
        c = self.r.choice(list(self.members))
        if not self.held.get(c):
            return
        mid, gen, _ = self.members[c]
        op = self.r.choice(["ack", "ack", "ack", "nack", "extend", "reject"])
        ranges = self._pick(c)
        cls = {"ack": m.Ack, "nack": m.Nack, "extend": m.Extend, "reject": m.Reject}[op]
        extra = {}
        if op == "nack":
            extra["delay_ms"] = self.r.choice([0, 0, 300])
        if op == "extend":
            extra["extend_ms"] = self.r.choice([0, 100, 3000])
        ans = self.call(op, cls(group=G, member_id=mid, generation=gen, ranges=ranges, **extra))
        if op == "ack":
            if isinstance(ans, m.AckReply):
                self._ack_result(ranges, [])
            elif isinstance(ans, ZBrokerError) and ans.code.name == "STALE_LEASE":
                assert not ans.data.get("stale_omitted")
                self._ack_result(ranges, ans.data["stale"])
        if isinstance(ans, ZBrokerError) and ans.code.name == "FENCED":
            self.members[c][1] = ans.data.get("generation", gen)

    def op_resync(self):
        if self.members:
            c = self.r.choice(list(self.members))
            mid, gen, topics = self.members[c]
            ans = self.call("join", m.Join(group=G, topics=topics, member_id=mid, session_timeout_ms=5000))
            self.members[c] = [ans.member_id, ans.generation, topics]

    def op_time(self):
        self.now += self.r.choice([1, 100, 500, 1000, 1000, 6000])
        self.trace.append((self.now, "tick"))
        self._absorb(self.core.tick(self.now))

    def op_dl(self):
        if self.dl_pending:
            i = self.r.randrange(len(self.dl_pending))
            e = self.dl_pending.pop(i)
            g, t, p, o = e.group, e.topic, e.partition, e.offset
            done = self.r.random() < 0.8
            self.trace.append((self.now, "dl", t, p, o, done))
            eff = (self.core.on_dead_letter_done if done else self.core.on_dead_letter_failed)(e, self.now)
            ignored = any(isinstance(e, Log) and e.event == "dead_letter_confirmation_ignored" for e in eff)
            if done and not ignored:
                self.fin.setdefault((g, t, p), set()).add(o)
            self._absorb(eff)

    def op_configure(self):
        choice = self.r.choice(["mode", "inflight", "timeout"])
        if choice == "mode":
            msg = m.ConfigureGroup(group=G, mode=self.r.choice(["exclusive", "shared"]))
        elif choice == "inflight":
            msg = m.ConfigureGroup(group=G, max_in_flight=self.r.choice([2, 8, 20]))
        else:
            msg = m.ConfigureGroup(group=G, ack_timeout_ms=self.r.choice([500, 1000, 5000]))
        self.call("configure_group", msg)

    def op_reset(self):
        t = self.r.choice(["a", "b"])
        to = self.r.choice(["earliest", "latest", self.r.randint(0, 40)])
        ans = self.call("reset_group", m.ResetGroup(group=G, topic=t, to=to))
        if isinstance(ans, m.ResetGroupReply):
            self.reset_dirty = True
            for p, target in ans.partitions:
                self.fin[(G, t, p)] = set()
                self.floor[(G, t, p)] = target

    def op_flush(self):
        for key, row in list(self.writer_pending.items()):
            if self.r.random() < 0.7:
                old = self.durable.get(key)
                if old is None or (row[6], row[3]) >= (old[6], old[3]):
                    self.durable[key] = row
                del self.writer_pending[key]
                self._absorb(self.core.on_durable([[row[0], row[1], row[2], row[3], row[6]]], self.now))

    def op_restart(self):
        self.base += 1_000_000
        for key, row in (self.writer_pending.items() if self.reset_dirty or self.r.random() < 0.3 else []):
            old = self.durable.get(key)
            if old is None or (row[6], row[3]) >= (old[6], old[3]):
                self.durable[key] = row
        self.writer_pending.clear()
        self.reset_dirty = False
        self.trace.append((self.now, "restart"))
        rows = [tuple(r) for r in self.durable.values()]
        self.members.clear()
        self.held.clear()
        self.dl_pending.clear()
        self._new_core(rows)

    def op_grow(self):
        if self.topics["b"] < 3:
            self.topics["b"] += 1
            self.logs[("b", self.topics["b"] - 1)] = [0, self.r.randint(0, 5)]
            self.core.set_topic("b", self.topics["b"])
            k = ("b", self.topics["b"] - 1)
            self.trace.append((self.now, "grow", k))
            self._absorb(self.core.on_log_range(k[0], k[1], *self.logs[k], self.now))

    def run(self, steps):
        ops = [(self.op_produce, 6), (self.op_retention, 1), (self.op_join, 2), (self.op_leave, 1),
               (self.op_poll, 8), (self.op_settle, 8), (self.op_resync, 2), (self.op_time, 4), (self.op_dl, 2),
               (self.op_configure, 1), (self.op_reset, 1), (self.op_flush, 2), (self.op_restart, 1),
               (self.op_grow, 1)]
        fns = [f for f, w in ops for _ in range(w)]
        for _ in range(steps):
            self.r.choice(fns)()
            self.check_persists()
        self.drain()

    def drain(self):
        for c in list(self.members):
            mid, gen, _ = self.members.pop(c)
            self.call("leave", m.Leave(group=G, member_id=mid, generation=gen))
        self.call("configure_group", m.ConfigureGroup(group=G, max_in_flight=1000))
        ans = self.call("join", m.Join(group=G, topics=["a", "b"], session_timeout_ms=60_000))
        mid, gen = ans.member_id, ans.generation
        for _ in range(400):
            self.now += 1000
            self._absorb(self.core.tick(self.now))
            while self.dl_pending:
                e = self.dl_pending.pop()
                g, t, p, o = e.group, e.topic, e.partition, e.offset
                eff = self.core.on_dead_letter_done(e, self.now)
                ignored = any(isinstance(e, Log) and e.event == "dead_letter_confirmation_ignored" for e in eff)
                if not ignored:
                    self.fin.setdefault((g, t, p), set()).add(o)
                self._absorb(eff)
            self.check_persists()
            ans = self.call("poll", m.Poll(group=G, member_id=mid, generation=gen, max_records=1000))
            if isinstance(ans, ZBrokerError) and ans.code.name == "FENCED":
                gen = ans.data["generation"]
                continue
            if isinstance(ans, ZBrokerError):
                raise AssertionError(("drain poll failed", ans))
            if ans.deliveries:
                ranges = [[t, p, l, s, e] for t, p, l, s, e, _a, _r in ans.deliveries]
                a2 = self.call("ack", m.Ack(group=G, member_id=mid, generation=gen, ranges=ranges))
                if isinstance(a2, m.AckReply):
                    self._ack_result(ranges, [])
                self.check_persists()
            g = self.core._groups[G]
            if all(st.committed is not None and st.committed >= self.logs[k][1] for k, st in g.partitions.items()
                   if k in self.logs):
                return
        g = self.core._groups[G]
        raise AssertionError(("wedged", {k: (st.committed, self.logs[k], st.range_entries())
                                         for k, st in g.partitions.items()}))


SEEDS_PER_CASE = 50
STEPS = 400


@pytest.mark.parametrize("first_seed", range(0, 300, SEEDS_PER_CASE))
def test_random_interleavings_keep_every_commit_promise(first_seed):
    for seed in range(first_seed, first_seed + SEEDS_PER_CASE):
        run = Interleaving(seed)
        try:
            run.run(STEPS)
        except AssertionError as exc:
            steps = "\n".join(map(repr, run.trace[-20:]))
            raise AssertionError(f"seed {seed}: {exc}\nlast steps:\n{steps}") from exc
