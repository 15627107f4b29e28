"""The chaos checker on crafted histories: it passes clean ones and names every violation.

A checker that cannot fail proves nothing, so each check is shown failing
on a history that contains exactly that fault (a lost record, a regressed
offset, a commit past an unfinished record, a hole over an unfinished record,
a commit beyond the log end; for a replicated run, a record acknowledged on
fewer than M replicas, replicas disagreeing below the high watermark, a
leader epoch going back; for a cluster run, a write by a coordinator epoch
that was not the current one, and a lost record and a regression across a
coordinator failover) and passing on the same history without it.
"""

from __future__ import annotations

import json

import pytest

from tests.chaos.checker import (CommitSample, ConsumerFinish, Delivery, EpochTaken, History, LeaderSample,
                                 NemesisEvent, ProducerAck, ReplicaEntry, StoredWrite, check)
from tests.chaos.workload import load_history, save_history

S = 1_000_000_000  # one second in ns
TOPIC, GROUP = "chaos", "workers"

pytestmark = pytest.mark.chaos


def rid(partition: int, offset: int) -> int:
    return 1000 * partition + offset


def clean_history(records: int = 16, partitions: int = 2) -> History:
    """Every record acked at t=offset s, delivered at +0.1 s, finished at +0.2 s; committed sampled at +0.5 s."""
    h = History(topic=TOPIC, group=GROUP, log={p: [rid(p, o) for o in range(records)] for p in range(partitions)})
    for p in range(partitions):
        for o in range(records):
            t = o * S
            h.acks.append(ProducerAck(rid(p, o), p, o, t))
            h.deliveries.append(Delivery("c1", p, o, t + S // 10))
            h.finishes.append(ConsumerFinish(rid(p, o), p, o, t + S // 5, "c1"))
            for source in ("pg", "describe"):
                h.samples.append(CommitSample(t + S // 2, source, GROUP, TOPIC, p, o + 1))
    return h


def sample(t_s: float, committed: int, *, partition: int = 0, source: str = "pg",
           holes: tuple = ()) -> CommitSample:
    return CommitSample(int(t_s * S), source, GROUP, TOPIC, partition, committed, tuple(holes))


def test_a_clean_history_passes_and_renders():
    report = check(clean_history())
    assert report.ok
    summary = report.summary()
    assert summary["verdict"] == "PASS"
    assert (summary["lost"], summary["regressions"], summary["committed_past_unfinished"]) == (0, 0, 0)
    assert summary["acked"] == 32 and summary["finished_records"] == 32 and summary["duplicates"] == 0
    assert [p["final_committed_pg"] for p in report.partitions] == [16, 16]
    parsed = json.loads(report.to_json())
    assert parsed["summary"]["verdict"] == "PASS"
    table = report.to_table()
    assert "chaos check: PASS" in table and "lost 0" in table


def test_committed_14_while_12_was_never_acked_is_reported():
    """Offsets 0..15 exist; the consumer never finished (so never acked) 12; a sample says 14."""
    h = clean_history(partitions=1)
    h.finishes = [f for f in h.finishes if f.offset != 12]
    h.samples = [s for s in h.samples if s.committed <= 12]  # the broker rightly stops at 12 ...
    h.samples.append(sample(20, 14))  # ... except this one sample
    report = check(h)
    assert not report.ok
    [v] = report.committed_past_unfinished
    assert (v.source, v.partition, v.committed, v.offset, v.record_id) == ("pg", 0, 14, 12, rid(0, 12))
    assert v.finished_ns is None and v.where == "below committed" and v.offending == 1
    assert report.summary()["committed_past_unfinished"] == 1
    assert "committed 14" in report.to_table() and "offset 12" in report.to_table()
    # 12 was acked by its producer and never finished: that is also a lost record.
    assert [(x.record_id, x.reason) for x in report.lost] == [(rid(0, 12), "never finished by a consumer")]


def test_a_commit_that_runs_ahead_of_the_finish_is_reported():
    """12 is finished, but only after the sample that already claims 14: the order matters, not the set."""
    h = clean_history(partitions=1)
    h.samples = [s for s in h.samples if s.committed <= 12]
    h.samples.append(sample(12.1, 14, source="describe"))  # 12 finishes at 12.2 s, 13 at 13.2 s
    h.samples.append(sample(20, 16, source="describe"))
    report = check(h)
    [v] = report.committed_past_unfinished
    assert (v.source, v.committed, v.offset, v.offending) == ("describe", 14, 12, 2)
    assert v.finished_ns == 12 * S + S // 5
    assert not report.lost and not report.regressions


def test_the_in_memory_committed_offset_is_checked_too():
    h = clean_history(partitions=1)
    h.samples.append(sample(3.0, 9, source="describe_pending"))
    report = check(h)
    assert [(v.source, v.offset) for v in report.committed_past_unfinished] == [("describe_pending", 3)]
    assert not report.regressions  # the in-memory value is not durable: no regression check on it


def test_a_stored_hole_over_an_unfinished_record_is_reported():
    """A restarted coordinator skips the stored holes, so a hole must only hold finished records."""
    h = clean_history(partitions=1)
    h.finishes = [f for f in h.finishes if f.offset != 9]
    h.samples = [s for s in h.samples if s.committed <= 5]
    h.samples.append(sample(20, 5, holes=[(6, 8), (8, 10)]))
    report = check(h)
    [v] = report.committed_past_unfinished
    assert (v.committed, v.offset, v.where, v.finished_ns) == (5, 9, "in hole [8, 10)", None)
    # The same holes without the gap at 9 are fine.
    h.finishes.append(ConsumerFinish(rid(0, 9), 0, 9, 9 * S, "c2"))
    assert check(h).committed_past_unfinished == []


def test_a_lost_record_is_reported():
    h = clean_history()
    h.finishes = [f for f in h.finishes if f.record_id != rid(1, 7)]
    h.samples = [s for s in h.samples if not (s.partition == 1 and s.committed > 7)]
    report = check(h)
    assert [(v.record_id, v.partition, v.offset, v.reason) for v in report.lost] == [
        (rid(1, 7), 1, 7, "never finished by a consumer")]
    assert not report.committed_past_unfinished and not report.regressions
    assert report.summary()["verdict"] == "FAIL"
    assert "LOST (1" in report.to_table()


def test_an_acked_record_missing_from_the_log_is_lost_even_if_something_was_finished_there():
    """The log was truncated and 15 re-used by another record: the ack at 15 is a lie."""
    h = clean_history(partitions=1)
    h.log[0][15] = 999_999
    h.finishes = [f if f.offset != 15 else ConsumerFinish(999_999, 0, 15, f.time_ns, "c1") for f in h.finishes]
    h.acks.append(ProducerAck(555_555, 0, 16, 17 * S))  # beyond the log end
    report = check(h)
    assert [(v.record_id, v.reason) for v in report.lost] == [
        (rid(0, 15), "acknowledged offset holds record 999999"),
        (555_555, "acknowledged offset is beyond the log end")]


def test_a_regressed_offset_is_reported_per_source():
    h = clean_history(partitions=1)
    h.samples.append(sample(16.0, 16))
    h.samples.append(sample(16.5, 11))  # pg goes back
    h.samples.append(sample(17.0, 16))
    report = check(h)
    v, claim = report.regressions
    assert (v.source, v.partition, v.before, v.committed) == ("pg", 0, 16, 11)
    assert v.before_ns == 16 * S and v.at_ns == int(16.5 * S)
    # describe had reported 16 durable at 15.5 s: the table going back under it is a regression too.
    assert (claim.source, claim.before, claim.committed) == ("describe>pg", 16, 11)
    assert not report.committed_past_unfinished and not report.lost
    assert "REGRESSIONS (2" in report.to_table()
    # Across sources there is no order: describe lagging behind pg is not a regression.
    h2 = clean_history(partitions=1)
    h2.samples.append(sample(30, 16, source="pg"))
    h2.samples.append(sample(31, 12, source="describe_pending"))
    assert check(h2).regressions == []


def test_a_commit_beyond_the_log_end_is_reported():
    h = clean_history(partitions=1)
    h.samples.append(sample(40, 17, source="describe"))
    report = check(h)
    assert [(v.source, v.committed, v.log_end) for v in report.committed_beyond_log_end] == [("describe", 17, 16)]
    assert not report.ok


def test_records_that_were_never_acked_may_be_committed_once_finished():
    """A produce whose reply was lost: the record is in the log and consumed, nobody was told its offset."""
    h = clean_history(partitions=1)
    h.acks = [a for a in h.acks if a.offset != 4]
    h.produce_failures = 1
    report = check(h)
    assert report.ok
    assert report.counts["unacked_in_log"] == 1 and report.counts["produce_failures"] == 1


def test_duplicates_are_counted_and_attributed_to_the_event_before_them():
    h = clean_history(partitions=1)
    # Consumer c1 finished 10 and 11 at 10.2 s / 11.2 s, then was killed at 11.3 s before its acks
    # were durable (pg still said 10): c2 finishes both again.
    h.samples = [s for s in h.samples if s.time_ns < 10 * S or s.committed <= 10 or s.time_ns > 12 * S]
    h.events.append(NemesisEvent(int(11.3 * S), "kill-consumer", "c1"))
    h.events.append(NemesisEvent(int(11.4 * S), "start-consumer", "c2"))  # not between: c2 re-finishes at 11.35
    for o in (10, 11):
        h.deliveries.append(Delivery("c2", 0, o, int(11.32 * S)))
        h.finishes.append(ConsumerFinish(rid(0, o), 0, o, int(11.35 * S), "c2"))
    # 3 delivered and finished twice with no event in between (a lease that expired): allowed.
    h.deliveries.append(Delivery("c1", 0, 3, int(3.25 * S)))
    h.finishes.append(ConsumerFinish(rid(0, 3), 0, 3, int(3.3 * S), "c1"))
    report = check(h)
    assert report.ok
    assert report.counts["duplicates"] == 3 and report.counts["duplicate_records"] == 3
    assert report.counts["redelivered_offsets"] == 3 and report.counts["stored_twice"] == 0
    assert report.duplicates_by_cause == {"kill-consumer": 2, "none": 1}
    kill = next(e for e in report.events if e.kind == "kill-consumer")
    assert kill.duplicates == 2
    assert kill.in_flight == 2 and kill.finished_not_durable == 2  # 10 and 11: c1's, finished, not durable
    table = report.to_table()
    assert "kill-consumer" in table and "(no event)" in table


def test_a_record_stored_twice_counts_as_a_duplicate_of_another_offset():
    h = clean_history(partitions=1, records=4)
    h.log[0].append(rid(0, 2))  # a producer retry that was stored again at offset 4
    h.finishes.append(ConsumerFinish(rid(0, 2), 0, 4, 5 * S, "c1"))
    h.samples.append(sample(6, 5))
    report = check(h)
    assert report.ok
    assert report.counts["stored_twice"] == 1 and report.counts["redelivered_offsets"] == 0


def test_samples_of_other_groups_and_topics_are_ignored():
    h = clean_history(partitions=1)
    h.samples.append(CommitSample(1, "pg", "other-group", TOPIC, 0, 16))
    h.samples.append(CommitSample(1, "pg", GROUP, "other-topic", 0, 16))
    assert check(h).ok


def test_a_duplicate_after_a_rebalance_is_traced_to_the_event_that_caused_the_rebalance():
    """c1 got 5 at 5.1 s; c2's process started at 5.0 s, joined (new generation) at 5.15 s, took
    the partition over and finished 5 again: c1's ack was stale. The blame goes to the start."""
    h = clean_history(partitions=1, records=40)
    h.events.append(NemesisEvent(int(5.0 * S), "start-consumer", "c2"))
    h.events.append(NemesisEvent(int(5.15 * S), "rebalance", "c2", "m-2 generation 2"))
    h.finishes.append(ConsumerFinish(rid(0, 5), 0, 5, int(5.3 * S), "c2"))
    # A rebalance that no nemesis event explains (nothing within the window before it).
    h.events.append(NemesisEvent(int(30.0 * S), "rebalance", "c1", "m-1 generation 3"))
    h.deliveries.append(Delivery("c1", 0, 29, int(30.2 * S)))
    h.finishes.append(ConsumerFinish(rid(0, 29), 0, 29, int(30.5 * S), "c1"))
    report = check(h)
    assert report.ok
    assert report.duplicates_by_cause == {"rebalance": 1, "start-consumer": 1}
    [start] = [e for e in report.events if e.kind == "start-consumer"]
    assert (start.duplicates, start.via_rebalance) == (1, 1)
    assert report.counts["rebalances_seen"] == 2
    assert all(e.kind != "rebalance" for e in report.events)  # consumers' observations, not nemesis events
    assert "(rebalance, no event)" in report.to_table()


def test_a_killed_coordinator_is_blamed_and_a_later_partition_actor_kill_is_not():
    """Killing a partition actor, the writer or the database connection cannot make the coordinator
    forget an ack: the duplicate goes to the coordinator kill even though the other events are later."""
    h = clean_history(partitions=1)
    h.events.append(NemesisEvent(int(7.25 * S), "kill-actor", "coordinator", "pid 42"))
    h.events.append(NemesisEvent(int(7.5 * S), "kill-actor", "partition-0", "pid 43"))
    h.events.append(NemesisEvent(int(7.6 * S), "kill-actor", "commit-writer", "pid 44"))
    h.events.append(NemesisEvent(int(7.7 * S), "pg-cut", "postgresql", "reset"))
    h.deliveries.append(Delivery("c1", 0, 7, int(8.9 * S)))
    h.finishes.append(ConsumerFinish(rid(0, 7), 0, 7, int(9.0 * S), "c1"))
    # Only a partition actor kill in between: not a cause, so the duplicate stays unexplained.
    h.events.append(NemesisEvent(int(11.5 * S), "kill-actor", "partition-0", "pid 45"))
    h.deliveries.append(Delivery("c1", 0, 11, int(11.9 * S)))
    h.finishes.append(ConsumerFinish(rid(0, 11), 0, 11, int(12.0 * S), "c1"))
    report = check(h)
    assert report.duplicates_by_cause == {"kill-actor coordinator": 1, "none": 1}
    assert [e.duplicates for e in report.events] == [1, 0, 0, 0, 0]
    assert all(e.in_flight is not None for e in report.events)
    assert "kill-actor coordinator" in report.to_table()


def test_a_delivery_of_a_durably_finished_offset_is_counted_apart():
    """Allowed (a duplicate), but no crash explains forgetting durable progress: it is counted separately."""
    h = clean_history(partitions=1)
    h.deliveries.append(Delivery("c2", 0, 4, 20 * S))  # committed 5 was in the table at 4.5 s
    h.finishes.append(ConsumerFinish(rid(0, 4), 0, 4, 20 * S + 1, "c2"))
    h.samples.append(sample(21, 16, holes=[(18, 20)]))
    h.deliveries.append(Delivery("c2", 0, 15, int(15.3 * S)))  # committed 16 only at 15.5: not durable yet
    # Asked at 4.4 s, before 5 was durable, and got the (stale) lease late: not counted.
    h.deliveries.append(Delivery("c3", 0, 4, 21 * S, polled_ns=int(4.4 * S)))
    report = check(h)
    assert report.ok
    assert [(d.partition, d.offset, d.durable_since_ns) for d in report.redelivered_after_durable] == [
        (0, 4, int(4.5 * S))]
    assert report.counts["redelivered_after_durable"] == 1


def test_a_history_survives_a_round_trip_through_its_file(tmp_path):
    h = clean_history()
    h.samples.append(sample(20, 16, holes=[(18, 20)]))
    h.events.append(NemesisEvent(7, "pg-cut", "postgresql", "reset"))
    h.meta = {"seed": 7}
    save_history(h, tmp_path / "h.json.gz")
    again = load_history(tmp_path / "h.json.gz")
    assert again == h
    assert check(again).to_dict() == check(h).to_dict()


def test_the_lease_that_was_lost_is_the_earlier_one_even_if_its_holder_finishes_last():
    """c4 got 3 first; a rebalance gave it to c1, which finished first; c4 finished its stale copy
    after. The loss happened between the two deliveries, not between the two finishes."""
    h = History(topic=TOPIC, group=GROUP, log={0: [rid(0, o) for o in range(5)]})
    h.acks = [ProducerAck(rid(0, 3), 0, 3, 0)]
    h.events = [NemesisEvent(int(8.8 * S), "start-consumer", "c4"),
                NemesisEvent(int(9.039 * S), "rebalance", "c1", "m-3 generation 6")]
    h.deliveries = [Delivery("c4", 0, 3, int(9.006 * S)), Delivery("c1", 0, 3, int(9.0395 * S))]
    h.finishes = [ConsumerFinish(rid(0, 3), 0, 3, int(9.04 * S), "c1"),
                  ConsumerFinish(rid(0, 3), 0, 3, int(9.05 * S), "c4")]
    report = check(h)
    assert report.ok
    assert report.duplicates_by_cause == {"start-consumer": 1}


def test_a_durable_claim_that_the_table_does_not_hold_is_a_regression():
    """describe said 16 was durable at 16.6 s; the table read at 17 s says 15: the writer lied."""
    h = clean_history(partitions=1)
    h.samples = [x for x in h.samples if x.committed < 16]
    h.samples.append(sample(16.6, 16, source="describe"))
    h.samples.append(sample(17.0, 15))  # pg: no lower than its own earlier samples (15 at 14.5 s) ...
    report = check(h)
    assert [(v.source, v.before, v.committed) for v in report.regressions] == [("describe>pg", 16, 15)]
    # ... and the table running ahead of describe is normal: the writer replies after it wrote.
    h2 = clean_history(partitions=1)
    h2.samples.append(sample(16.6, 16))
    h2.samples.append(sample(17.0, 15, source="describe"))
    assert [(v.source, v.before, v.committed) for v in check(h2).regressions] == [("describe", 16, 15)]
    h3 = clean_history(partitions=1)
    h3.samples = [x for x in h3.samples if x.source == "pg"] + [sample(14.0, 12, source="describe")]
    assert check(h3).regressions == []


def test_an_event_between_asking_and_receiving_explains_a_duplicate():
    """c2 asked at 5.0 s and was leased 5, but its reply arrived only at 7 s (its fetch hung on a dead
    partition actor); meanwhile a rebalance after a consumer kill gave 5 to c1, which finished it."""
    h = clean_history(partitions=1)
    h.events += [NemesisEvent(int(5.02 * S), "kill-consumer", "c9"),
                 NemesisEvent(int(5.05 * S), "rebalance", "c1", "m-1 generation 4")]
    h.deliveries = [d for d in h.deliveries if d.offset != 5]
    h.deliveries += [Delivery("c2", 0, 5, 7 * S, polled_ns=5 * S), Delivery("c1", 0, 5, int(5.1 * S))]
    h.finishes = [f for f in h.finishes if f.offset != 5]
    h.finishes += [ConsumerFinish(rid(0, 5), 0, 5, int(5.2 * S), "c1"),
                   ConsumerFinish(rid(0, 5), 0, 5, int(7.1 * S), "c2")]
    report = check(h)
    assert report.ok
    assert report.duplicates_by_cause == {"kill-consumer": 1}


# -- the replicated run's checks ------------------------------------------------------------

REPLICAS = ("h2", "h3", "h4")


def replicated_history(records: int = 16) -> History:
    """The clean history on three replicas: every replica holds every record (one batch of 4 per
    4 offsets, the same bytes everywhere), all vouched for up to the end; epochs rise once."""
    h = clean_history(records=records)
    h.min_insync = 2
    for replica in REPLICAS:
        h.replica_logs[replica] = {p: [ReplicaEntry(rid(p, o), f"batch-{p}-{o // 4}") for o in range(records)]
                                   for p in h.log}
        h.replica_hw[replica] = {p: records for p in h.log}
    for p in h.log:
        h.leadership += [LeaderSample(1 * S, p, "h2", 0, REPLICAS, 4), LeaderSample(9 * S, p, "h3", 1, REPLICAS, 12)]
    return h


def test_a_clean_replicated_history_passes_and_renders():
    report = check(replicated_history())
    assert report.ok, report.to_table()
    s = report.summary()
    assert (s["under_replicated"], s["divergences"], s["epoch_regressions"]) == (0, 0, 0)
    assert s["replicas"] == 3 and s["replica_records"] == 3 * 2 * 16 and s["leader_changes"] == 2
    assert "under-replicated acks 0   divergences 0" in report.to_table()
    # A single-host history reports none of these, not zeros it never checked.
    assert "under_replicated" not in check(clean_history()).summary()


def test_a_record_acknowledged_while_only_its_leader_had_it_is_reported():
    """Record 0@5 is on h2 alone: h3 and h4 end before it (they never had it). Acknowledged, it
    was acknowledged on one replica; with M = 2 that must never happen."""
    h = replicated_history()
    h.leadership = [x for x in h.leadership if x.high_watermark <= 4]  # the ISR vouched for 0..3 only
    for replica in ("h3", "h4"):
        h.replica_logs[replica][0] = h.replica_logs[replica][0][:5]
        h.replica_hw[replica][0] = 5
    h.replica_hw["h2"][0] = 5
    report = check(h)
    assert not report.ok and not report.lost  # the leader's log still has every record
    assert [(v.partition, v.offset, v.copies, v.holders) for v in report.under_replicated][0] == \
        (0, 5, 1, ("h2",))
    assert len(report.under_replicated) == 11  # 0@5 .. 0@15
    assert "on 1 replica(s) byte for byte (h2)" in report.to_table()
    assert not report.divergences  # below the high watermark (5) they all agree
    # With M = 1 one copy is enough.
    h.min_insync = 1
    assert check(h).under_replicated == []


def test_copies_that_differ_in_their_bytes_do_not_count_as_two():
    """h2 and h3 both hold record 1@7, but in batches with different bytes (h3's was rewritten):
    only one byte-for-byte copy each, fewer than M."""
    h = replicated_history()
    h.leadership = [x for x in h.leadership if x.high_watermark <= 4]  # the ISR vouched for 0..3 only
    h.replica_logs["h4"][1] = h.replica_logs["h4"][1][:7]
    h.replica_hw = {r: {0: 16, 1: 7} for r in REPLICAS}
    h.replica_logs["h3"][1][7] = ReplicaEntry(rid(1, 7), "batch-rewritten")
    report = check(h)
    assert [(v.partition, v.offset, v.copies) for v in report.under_replicated] == [(1, 7, 1)]
    assert not report.divergences  # offset 7 is above the vouched high watermark (7)


def test_replicas_disagreeing_below_the_high_watermark_are_reported_and_above_it_are_not():
    h = replicated_history()
    h.leadership = [x for x in h.leadership if x.high_watermark <= 4]  # the ISR vouched for 0..3 only
    h.replica_logs["h4"][0][9] = ReplicaEntry(rid(0, 9), "batch-other")  # 9 < 16: both vouched for it
    report = check(h)
    assert [(v.partition, v.replica, v.other, v.offset, v.below) for v in report.divergences] == [
        (0, "h2", "h4", 9, 16), (0, "h3", "h4", 9, 16)]
    assert "h2 and h4 differ at offset 9, below the high watermark 16" in report.to_table()
    assert not report.under_replicated  # h2 and h3 still hold it byte for byte
    # A divergent tail above the smaller high watermark is what truncation removes: allowed.
    h.replica_hw["h4"][0] = 9
    assert check(h).divergences == []


def test_a_replica_shorter_than_its_high_watermark_is_reported():
    h = replicated_history()
    h.replica_logs["h3"][1] = h.replica_logs["h3"][1][:10]  # vouched for 16, holds 10
    report = check(h)
    assert [(v.partition, v.replica, v.other, v.offset, v.below) for v in report.divergences] == [(1, "h3", "", 10, 16)]
    assert "h3 ends at 10, below its high watermark 16" in report.to_table()


def test_a_leader_epoch_that_goes_back_is_reported():
    h = replicated_history()
    h.leadership.append(LeaderSample(12 * S, 1, "h2", 0, REPLICAS, 12))
    report = check(h)
    assert [(v.partition, v.before, v.epoch) for v in report.epoch_regressions] == [(1, 1, 0)]
    assert "leader epoch 1 at" in report.to_table()


def test_a_replicated_history_survives_a_round_trip_through_its_file(tmp_path):
    h = replicated_history()
    h.replica_logs["h4"][0][9] = ReplicaEntry(rid(0, 9), "batch-other")
    save_history(h, tmp_path / "h.json.gz")
    again = load_history(tmp_path / "h.json.gz")
    assert again.replica_logs == h.replica_logs and again.replica_hw == h.replica_hw
    assert again.leadership == h.leadership and again.min_insync == 2
    assert check(again).summary() == check(h).summary()


def test_a_replica_out_of_the_final_isr_is_judged_by_the_high_watermark_it_had_in_the_isr():
    """h4 left the ISR before the end (the final high watermark vouches nothing for it), but a
    sample at 9 s showed it in the ISR at high watermark 12: its log may not differ below 12,
    nor end before it. A divergent tail above 12 is allowed."""
    h = replicated_history()
    h.replica_hw["h4"] = {0: 0, 1: 0}
    h.replica_logs["h4"][0][13] = ReplicaEntry(rid(0, 13), "batch-zombie")
    assert check(h).divergences == []  # 13 >= 12
    h.replica_logs["h4"][0][10] = ReplicaEntry(rid(0, 10), "batch-other")
    assert [(v.replica, v.other, v.offset, v.below) for v in check(h).divergences] == [
        ("h2", "h4", 10, 12), ("h3", "h4", 10, 12)]
    h.replica_logs["h4"][0][10] = h.replica_logs["h2"][0][10]
    h.replica_logs["h4"][1] = h.replica_logs["h4"][1][:11]  # truncated below what it held in the ISR
    assert [(v.partition, v.replica, v.offset, v.below) for v in check(h).divergences] == [(1, "h4", 11, 12)]
    # Its disk lost after that sample: what it held then counts for nothing.
    h.events.append(NemesisEvent(10 * S, "wipe-disk", "h4"))
    assert check(h).divergences == []


# -- a cluster run: the writers' epochs, as the store shows them ---------------------------

US = 1_000_000  # one second in microseconds (the database's clock)
OFFSETS = "consumer_group_offsets"


def cluster_history(records: int = 16) -> History:
    """The clean history on a cluster: node a led (epoch 1) from 100 s, b took over (epoch 2) at 108 s
    by the database's clock; each flush of the offsets was written by the epoch then current, as
    the audit trigger saw it land, and the final rows carry epoch 2."""
    h = clean_history(records=records)
    h.epochs = [EpochTaken(1, "a", 100 * US), EpochTaken(2, "b", 108 * US)]
    for p in h.log:
        for o in range(records):
            epoch = 1 if o < 8 else 2
            h.stored_writes.append(StoredWrite(OFFSETS, f"{GROUP}/{TOPIC}/{p}", epoch, (100 + o) * US + 500, epoch))
        h.stored_writes.append(StoredWrite(OFFSETS, f"{GROUP}/{TOPIC}/{p}", 2, (100 + records - 1) * US + 500))
    h.stored_writes.append(StoredWrite("zbroker_topics", TOPIC, 1, 100 * US + 200))
    h.events.append(NemesisEvent(8 * S, "failover", "b", "epoch 2"))
    return h


def test_a_clean_cluster_history_passes_and_renders():
    report = check(cluster_history())
    assert report.ok, report.to_table()
    s = report.summary()
    assert (s["lost"], s["regressions"], s["stale_writes"]) == (0, 0, 0)
    assert (s["epochs_taken"], s["stored_writes"], s["audited_writes"]) == (2, 35, 32)
    assert "stale-epoch writes 0" in report.to_table()
    # A history of one broker reports no such count, rather than a zero it never checked.
    assert "stale_writes" not in check(clean_history()).summary()


def test_a_write_by_the_former_leader_after_the_takeover_is_reported():
    """A paused former leader (epoch 1) woke at 110 s and its flush landed: the audit trigger saw the
    lease row at epoch 2 as it did."""
    h = cluster_history()
    h.stored_writes.append(StoredWrite(OFFSETS, f"{GROUP}/{TOPIC}/1", 1, 110 * US, 2))
    report = check(h)
    assert not report.ok
    assert [(v.table, v.key, v.coordinator_epoch, v.current_epoch, v.evidence) for v in report.stale_writes] == [
        (OFFSETS, f"{GROUP}/{TOPIC}/1", 1, 2, "lease row")]
    assert report.summary()["stale_writes"] == 1
    assert "written by epoch 1" in report.to_table() and "epoch 2 was current (lease row)" in report.to_table()


def test_a_stored_row_older_than_the_epoch_in_force_at_its_time_is_reported():
    """No trigger saw it (a final row): its epoch 1 at 109 s is judged by the history, where epoch 2
    was taken at 108 s. An unfenced write (epoch 0) is one too, and so is an epoch not yet taken."""
    h = cluster_history()
    h.stored_writes += [StoredWrite("zbroker_partition_states", f"{TOPIC}/0", 1, 109 * US),
                        StoredWrite("zbroker_group_configs", GROUP, 0, 101 * US),
                        StoredWrite("zbroker_topics", TOPIC, 2, 107 * US)]
    report = check(h)
    assert sorted((v.table, v.coordinator_epoch, v.current_epoch, v.evidence) for v in report.stale_writes) == [
        ("zbroker_group_configs", 0, 1, "epoch history"), ("zbroker_partition_states", 1, 2, "epoch history"),
        ("zbroker_topics", 2, 1, "epoch history")]
    # Written just before the takeover, the same row is a write of its time.
    h.stored_writes[-3] = StoredWrite("zbroker_partition_states", f"{TOPIC}/0", 1, 108 * US - 1)
    assert len(check(h).stale_writes) == 2


def test_a_record_lost_across_a_failover_is_reported():
    """The new leader (epoch 2) started from offsets that skipped 0@9: nobody ever finished it."""
    h = cluster_history()
    h.finishes = [f for f in h.finishes if (f.partition, f.offset) != (0, 9)]
    h.samples = [x for x in h.samples if x.partition != 0 or x.committed <= 9]
    report = check(h)
    assert [(v.record_id, v.reason) for v in report.lost] == [(rid(0, 9), "never finished by a consumer")]
    assert not report.stale_writes and not report.ok


def test_a_committed_offset_that_goes_back_across_a_failover_is_reported():
    """The new leader loaded an older row than its predecessor had made durable: 12, then 9."""
    h = cluster_history()
    h.samples.append(sample(13, 9, partition=1))
    report = check(h)
    assert [(v.source, v.partition, v.before, v.committed) for v in report.regressions] == [
        ("pg", 1, 13, 9), ("describe>pg", 1, 13, 9)]  # below what describe_group had called durable, too
    assert not report.ok


def test_a_cluster_history_survives_a_round_trip_through_its_file(tmp_path):
    h = cluster_history()
    save_history(h, tmp_path / "h.json.gz")
    again = load_history(tmp_path / "h.json.gz")
    assert again.epochs == h.epochs and again.stored_writes == h.stored_writes
    assert check(again).summary() == check(h).summary()
