"""The transactional inbox's I/O-free part: names, statements, when and what to prune."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zbroker.client.inbox import InboxPlan, inbox_sql, quote_table


def test_table_names_are_quoted_identifiers_and_anything_else_is_refused():
    assert quote_table("inbox") == '"inbox"'
    assert quote_table("app.inbox") == '"app"."inbox"'
    for bad in ["", "a.b.c", 'x"; DROP TABLE y; --', "1abc", "a b", "a" * 64]:
        with pytest.raises(ValueError, match="inbox table"):
            quote_table(bad)
    with pytest.raises(ValueError):
        InboxPlan("g", table="no good")


def test_the_claim_inserts_the_record_identity_and_returns_a_row_only_if_new():
    sql = inbox_sql("app.inbox", lambda i: f"${i}")
    assert sql.claim == ('INSERT INTO "app"."inbox" (group_id, topic, partition, "offset") VALUES ($1, $2, $3, $4) '
                         "ON CONFLICT DO NOTHING RETURNING 1")
    assert "%s" in inbox_sql("inbox", lambda i: "%s").prune
    assert 'PRIMARY KEY (group_id, topic, partition, "offset")' in sql.create
    record = SimpleNamespace(topic="t", partition=3, offset=17)
    assert InboxPlan("g").claim_params(record) == ("g", "t", 3, 17)


def test_pruning_comes_every_n_records_and_only_where_the_durable_offset_moved():
    plan = InboxPlan("g", prune_every=3)
    assert [plan.record_done() for _ in range(6)] == [False, False, True, False, False, True]
    report = {"partitions": [{"topic": "t", "partition": 0, "committed": 10},
                             {"topic": "t", "partition": 1, "committed": None},  # nothing durable yet
                             {"topic": "t", "partition": 2, "committed": 0}]}
    prunes = plan.prunes(report)
    assert prunes == [("g", "t", 0, 10)]
    plan.pruned(prunes[0])
    assert plan.prunes(report) == []  # nothing moved since
    report["partitions"][0]["committed"] = 12
    assert plan.prunes(report) == [("g", "t", 0, 12)]
