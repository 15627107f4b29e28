"""The console's pure decisions: status words, rates, /proc parsing, shown bytes, metric families."""

from hypothesis import given, strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from zbroker.console import model, views
from zbroker.console.metrics import registry_for
from zbroker.console.model import OK, STALL, STOP, WARN, History, ProcStat, Snapshot, judge_partition


def test_caught_up_is_ok_whatever_came_before():
    assert judge_partition([(0, 5), (0, 5), (5, 0)], live_members=0).word == OK


def test_stuck_offset_with_members_is_stall_and_without_is_stop():
    samples = [(3, 7)] * 5
    stall = judge_partition(samples, live_members=2)
    stop = judge_partition(samples, live_members=0)
    assert (stall.word, stop.word) == (STALL, STOP)
    assert "stayed at 3" in stall.why and "no live member" in stop.why


def test_moving_but_falling_behind_is_warn():
    assert judge_partition([(0, 10), (2, 12), (4, 15), (6, 19)], live_members=1).word == WARN
    # moving and not growing every step: OK
    assert judge_partition([(0, 10), (2, 12), (4, 11), (6, 19)], live_members=1).word == OK


def test_window_limits_the_samples_judged():
    old_progress = [(0, 9), (1, 8)] + [(1, 8)] * 10
    assert judge_partition(old_progress, live_members=1, window=10).word == STALL
    assert judge_partition(old_progress, live_members=1, window=12).word == OK


def test_too_few_samples_say_so():
    j = judge_partition([(0, 4)], live_members=1)
    assert j.word == OK and "too few samples" in j.why
    assert judge_partition([(0, 4)], live_members=0).word == STOP
    assert judge_partition([], live_members=0).why == "no committed offset yet"


def test_group_word_is_its_worst_partition():
    def snap(t, committed):
        parts = [{"topic": "t", "partition": 0, "committed": 5, "lag": 0},
                 {"topic": "t", "partition": 1, "committed": committed, "lag": 4}]
        return Snapshot(t, {}, {}, {"g": {"members": [{"member_id": "m"}], "partitions": parts}})
    h = History()
    for i in range(5):
        h.add(snap(i, 1))
    word, per = model.judge_group(h, "g")
    assert word.word == STALL and word.why.startswith("t/1:") and per[("t", 0)].word == OK


@given(st.integers(0, 10**12), st.integers(0, 10**12), st.floats(0, 1e6), st.floats(0.001, 1e3))
def test_rate_is_never_negative(before, after, t0, dt):
    assert model.rate(before, after, t0, t0 + dt) >= 0


def test_rate_counts_a_reset_from_zero():
    assert model.rate(100, 30, 0.0, 1.0) == 30.0
    assert model.rate(100, 130, 0.0, 2.0) == 15.0
    assert model.rate(1, 2, 5.0, 5.0) == 0.0


def test_proc_parsing():
    stat = "1234 (zbroker (x) y) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 1 0 100 0 0"
    assert model.parse_proc_stat(stat, 100) == 3.0
    assert model.parse_status_rss("Name: x\nVmRSS:\t  2048 kB\n") == 2 * 1024 * 1024
    limits = ("Limit                     Soft Limit           Hard Limit           Units\n"
              "Max open files            1024                 4096                 files\n")
    assert model.parse_limits_nofile(limits) == 1024
    assert model.parse_limits_nofile(limits.replace("1024 ", "unlimited ")) is None


def test_bytes_are_text_only_when_printable_utf8():
    assert views.show_bytes(b"hello")["kind"] == "text"
    assert views.show_bytes("zürich".encode())["kind"] == "text"
    assert views.show_bytes(b"\x00\x01ab") == {"kind": "hex", "text": "00 01 61 62", "size": 4, "cut": False}
    assert views.show_bytes(b"\xff\xfe")["kind"] == "hex"
    assert views.show_bytes(None)["kind"] == "null"
    shown = views.show_bytes(b"x" * 10, limit=4)
    assert shown["cut"] and shown["size"] == 10 and shown["text"] == "xxxx"


def test_provenance_headers_are_set_apart():
    own, prov = views.split_headers({"a": b"1", "zb-dlq-source-topic": b"t", "zb-dlq-attempts": b"5"})
    assert [n for n, _ in own] == ["a"] and [n for n, _ in prov] == ["zb-dlq-attempts", "zb-dlq-source-topic"]


def test_token_check():
    assert views.token_ok(None, None, None)
    assert views.token_ok("s3cret", "Bearer s3cret", None)
    assert views.token_ok("s3cret", None, "s3cret")
    assert not views.token_ok("s3cret", None, None)
    assert not views.token_ok("s3cret", "Bearer nope", None)
    assert not views.token_ok("s3cret", "Basic s3cret", None)


def test_reset_target():
    assert views.parse_reset_target(" earliest ") == "earliest"
    assert views.parse_reset_target("42") == 42
    for bad in ("-1", "soon", ""):
        try:
            views.parse_reset_target(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def _snapshot() -> Snapshot:
    status = {"actors": [
        {"kind": "group-coordinator", "actor_id": "coordinator", "pid": 10, "healthy": True,
         "statistics": {"rebalances": 3, "range_entries": 7}},
        {"kind": "commit-writer", "actor_id": "writer", "pid": 11, "healthy": True,
         "metrics": {"pending_keys": 2, "flush_errors": 0, "flush_ms_sum": 30.0,
                     "flush_ms_buckets": [[1, 1], [10, 2], [None, 1]]}},
        {"kind": "partition-log", "actor_id": "p0", "pid": 12, "healthy": False, "alive": False}]}
    topics = {"t": {"partitions": [{"partition": 0, "log_start": 0, "log_end": 10, "bytes": 100},
                                   {"partition": 1, "log_start": 2, "log_end": 5, "bytes": 50}]}}
    groups = {"g": {"members": [], "partitions": [
        {"topic": "t", "partition": 0, "committed": 4, "lag": 6, "in_flight": 2, "oldest_unfinished_age_ms": 1500,
         "blocker": {"offset": 4, "since_ms": 250}, "redeliveries_by_reason": {"nack": 3, "timeout": 1},
         "dead_letters_by_reason": {"rejected": 1}},
        {"topic": "t", "partition": 1, "committed": 5, "lag": 0, "in_flight": 0, "oldest_unfinished_age_ms": None,
         "blocker": None, "redeliveries_by_reason": {"nack": 2}, "dead_letters_by_reason": {}}]}}
    return Snapshot(100.0, status, topics, groups, {10: ProcStat(10, 4096, 1.5, 9, 1024)})


def _samples(snap, history=None) -> dict:
    text = generate_latest(registry_for(lambda: (snap, history))).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metric_families_from_a_snapshot():
    snap, history = _snapshot(), History()
    history.add(snap)
    got = _samples(snap, history)
    lab = lambda **kw: tuple(sorted(kw.items()))  # noqa: E731
    assert got[("zbroker_group_lag", lab(group="g", topic="t", partition="0"))] == 6
    assert got[("zbroker_group_lag_seconds", lab(group="g", topic="t", partition="0"))] == 1.5
    assert got[("zbroker_group_lag_seconds", lab(group="g", topic="t", partition="1"))] == 0
    assert got[("zbroker_group_oldest_unfinished_seconds", lab(group="g", topic="t", partition="0"))] == 0.25
    assert got[("zbroker_group_committed_offset", lab(group="g", topic="t", partition="0"))] == 4
    assert got[("zbroker_redelivered_total", lab(group="g", reason="nack"))] == 5
    assert got[("zbroker_dead_lettered_total", lab(group="g", reason="rejected"))] == 1
    assert got[("zbroker_records_produced_total", lab(topic="t"))] == 15
    assert got[("zbroker_partition_log_start_offset", lab(topic="t", partition="1"))] == 2
    assert got[("zbroker_commit_flush_seconds_bucket", lab(le="0.01"))] == 3  # cumulative
    assert got[("zbroker_commit_flush_seconds_bucket", lab(le="+Inf"))] == 4
    assert got[("zbroker_commit_flush_seconds_count", ())] == 4
    assert got[("zbroker_commit_pending_keys", ())] == 2
    assert got[("zbroker_actor_up", lab(kind="partition-log", actor_id="p0"))] == 0
    assert got[("zbroker_actor_open_fds", lab(kind="group-coordinator", actor_id="coordinator"))] == 9
    assert got[("zbroker_actor_max_fds", lab(kind="group-coordinator", actor_id="coordinator"))] == 1024
    assert got[("zbroker_group_status", lab(group="g"))] == 3  # lag, no member: STOP


def test_no_snapshot_no_families():
    assert _samples(None) == {}


def test_replication_figures_appear_when_reported():
    snap = _snapshot()
    snap.topics["t"]["partitions"][0].update(replicas=["a", "b"], isr=["a"], leader_epoch=4)
    got = _samples(snap)
    assert got[("zbroker_partition_under_replicated", (("partition", "0"), ("topic", "t")))] == 1
    assert got[("zbroker_partition_leader_epoch", (("partition", "0"), ("topic", "t")))] == 4
    assert ("zbroker_partition_isr_size", (("partition", "0"), ("topic", "t"))) in got
    assert not any(k[0] == "zbroker_partition_isr_size" for k in _samples(_snapshot()))


def test_rows_and_series():
    h = History()
    s1 = _snapshot()
    s2 = Snapshot(102.0, s1.status, {"t": {"partitions": [{"partition": 0, "log_end": 20}, {"partition": 1, "log_end": 5}]}},
                  s1.groups)
    h.add(s1)
    h.add(s2)
    assert h.series() == {"t": [102.0], "produced": [5.0], "committed": [0.0]}
    (row,) = model.group_rows(h)
    assert row["lag"] == 6 and row["in_flight"] == 2 and row["blocker"]["partition"] == 0 and row["status"] == STOP
    (trow,) = model.topic_rows(h)
    assert trow["records"] == 25 and trow["rate"] == 5.0


def test_the_redrive_action_offers_the_dead_letter_topics_that_exist():
    from zbroker.console.views import dead_letter_topics
    group = {"dlq": None, "partitions": [{"topic": "orders"}], "members": [{"topics": ["orders", "clicks"]}]}
    assert dead_letter_topics(group, {"orders": {}, "orders.dlq": {}}) == ["orders.dlq"]  # clicks.dlq: none yet
    assert dead_letter_topics({**group, "dlq": "all.dead"}, {"orders.dlq": {}, "all.dead": {}}) == ["all.dead"]
    assert dead_letter_topics({"partitions": [], "members": []}, {"x.dlq": {}}) == []
