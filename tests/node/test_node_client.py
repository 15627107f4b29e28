"""The Node.js client (written from docs/PROTOCOL.md alone) against a real broker.

`clients/node/e2e.js` creates a 2-partition topic, produces 500 keyed records with
headers, fetches them back, consumes them through a group with acks and waits
until `describe_group` shows every partition committed up to its log end. If it
passes, the document was enough to write a working client in another language.

Skips without Node.js unless ZBROKER_REQUIRE_NODE=1 (see conftest.py).
"""

from __future__ import annotations

import contextlib
import json

import pytest

pytestmark = [pytest.mark.node, pytest.mark.processes]

TOPIC = "node-e2e"


def _tail(path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no broker log)"


@contextlib.contextmanager
def _broker(tmp_path):
    """A real broker for one test; yields (handle, log_file), whose tail a failure quotes."""
    from zbroker.supervisor import start_broker

    log_file = tmp_path / "broker.log"
    handle = start_broker(tmp_path / "data", port=0, log_file=log_file)
    try:
        yield handle, log_file
    finally:
        handle.stop()


def _selfcheck(run_node, tmp_path, command: str, timeout: float, **json_options) -> dict:
    """Runs `selfcheck.js <command>` against a broker of its own; returns its JSON results."""
    with _broker(tmp_path) as (handle, log_file):
        proc = run_node("selfcheck.js", command, handle.url, timeout=timeout)
    assert proc.returncode == 0, f"{proc.stderr}\nbroker log (tail):\n{_tail(log_file)}"
    r = json.loads(proc.stdout, **json_options)
    assert "failure" not in r, r["failure"]
    return r


@pytest.mark.parametrize("acks", ["ack", "on-poll"])
def test_node_client_end_to_end(run_node, tmp_path, acks):
    """With acks "on-poll" every delivery is acked by the next poll (Poll.acks), not by `ack`."""
    with _broker(tmp_path) as (handle, log_file):
        proc = run_node("e2e.js", handle.url, TOPIC, *(["--acks-on-poll"] if acks == "on-poll" else []), timeout=180)
    assert proc.returncode == 0, (
        f"e2e.js exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}\n"
        f"broker log (tail):\n{_tail(log_file)}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["produced"] == summary["fetched"] == summary["consumed"] == 500, summary
    # A fresh topic: every partition's committed offset is its log end, 500 records in all.
    assert set(summary["committed"]) == {"0", "1"}, summary
    assert sum(summary["committed"].values()) == 500, summary
    if acks == "on-poll":
        assert summary["acked_on_polls"] >= 500, summary  # every record, some twice if redelivered
    else:
        assert summary["acked_on_polls"] == 0, summary


def test_protocol_document_claims_hold_on_a_real_broker(run_node, tmp_path):
    """Specific statements of docs/PROTOCOL.md, checked through the Node client (selfcheck.js live)."""
    r = _selfcheck(run_node, tmp_path, "live", timeout=120,
                   object_hook=lambda d: int(d["$bigint"]) if set(d) == {"$bigint"} else d)

    def error(name: str) -> dict:
        assert "error" in r[name], f"{name}: expected an error, got {r[name]}"
        return r[name]["error"]

    def ok(name: str):
        assert "ok" in r[name], f"{name}: {r[name]}"
        return r[name]["ok"]

    # s.5, 8.1: hello, version negotiation and limits.
    assert ok("hello")["actor"] == "group-coordinator" and ok("hello")["version"] == 1
    assert set(ok("hello")["limits"]) == {"max_header_bytes"}
    assert error("helloV2")["code"] == "UNSUPPORTED_VERSION" and error("helloV2")["data"] == {"supported": [1]}
    assert r["partitionHello"]["ok"]["actor"].startswith("partition-log:")
    assert set(r["partitionHello"]["ok"]["limits"]) == {"max_batch_bytes", "max_fetch_bytes", "max_header_bytes"}
    # s.8.2: topics.
    assert ok("create")["created"] is True
    assert error("createAgain")["code"] == "TOPIC_EXISTS" and error("createAgain")["data"]["partitions"] == 1
    assert error("badName")["code"] == "BAD_REQUEST"
    assert error("metadataUnknown")["code"] == "UNKNOWN_TOPIC"
    assert set(ok("metadata")["config"]) == {"segment_bytes", "index_interval_bytes", "retention_bytes",
                                             "retention_ms", "producer_window_segments"}
    # s.13: the idempotence table.
    assert (ok("seq0")["duplicate"], ok("seq0again")["duplicate"]) == (False, True)
    assert ok("seq0again")["base_offset"] == ok("seq0")["base_offset"]
    assert ok("seq5gap")["duplicate"] is False and ok("seq3gap")["duplicate"] is False
    assert ok("seq3again")["duplicate"] is True and ok("seq3again")["base_offset"] == ok("seq3gap")["base_offset"]
    bad = error("belowOldest")  # sequence -1 with a producer id: out of range
    assert bad["code"] == "BAD_REQUEST" and bad["data"]["field"] == "sequence"
    # s.7, 8.3: error data.
    assert error("noPayload")["code"] == "BAD_REQUEST"
    assert error("notOwned")["code"] == "NOT_OWNER" and error("notOwned")["retriable"] is True
    assert {"log_start", "log_end"} <= set(error("beyondEnd")["data"])
    assert error("badType")["code"] == "BAD_REQUEST" and error("badType")["data"]["field"] == "offset"
    assert error("unknownOpAtCoordinator")["code"] == "UNKNOWN_OP"
    # s.4: replies out of order on one DEALER.
    assert r["outOfOrder"] == {"order": ["immediate", "waiting"], "values": ["wake"]}
    # s.4: the ids a followed fetch's later replies take are reserved by the client.
    assert r["followReserved"]["more"] is True
    assert r["followReserved"]["nextOp"] == "produce"
    assert r["followReserved"]["nextOffset"] == r["followReserved"]["followFrom"]
    # s.8.4, 14: leases, STALE_LEASE data, redelivery, FENCED re-sync.
    assert ok("configure") == {"mode": "shared", "ack_timeout_ms": 300, "max_deliveries": 5,
                               "max_in_flight": 1000, "dlq": None, "start": "earliest",
                               "quarantine_after": 0, "max_keys": 10_000}  # key_shared's, defaults
    first = r["firstPoll"]
    assert first and first[0]["leaseId"] > 2**53 and first[0]["reason"] == "new"
    stale = error("lateAck")
    assert stale["code"] == "STALE_LEASE" and stale["data"]["applied"] == 0
    assert stale["data"]["stale"] == [[d["topic"], d["partition"], d["leaseId"], d["start"], d["end"]] for d in first]
    assert [(d["reason"], d["attempt"]) for d in r["redelivery"]] == [("timeout", 2)]
    assert ok("ackInTime")["applied"] == sum(d["end"] - d["start"] for d in r["redelivery"])
    assert r["fence"]["stats"]["fenced"] >= 1 and r["fence"]["generationAfter"] > r["fence"]["generationBefore"]
    assert ok("heartbeat")["generation"] == r["fence"]["generationAfter"]
    group = ok("describeGroup")
    assert {"group", "config", "generation", "reset_epoch", "members", "assignment", "partitions"} <= set(group)
    assert {"topic", "partition", "log_start", "log_end", "committed", "committed_pending", "lag"} <= set(
        group["partitions"][0])
    assert ok("listGroups") == [{"group": "live-g", "mode": "shared", "members": 2,
                                 "generation": r["fence"]["generationAfter"]}]
    assert error("describeUnknownGroup")["code"] == "UNKNOWN_GROUP"
    # s.8.2: every field the document lists, replication's included.
    assert {"partition", "log_start", "log_end", "bytes", "bytes_appended", "actor_id", "endpoint", "leader",
            "leader_epoch", "replicas", "isr", "high_watermark", "replica_log_ends", "min_insync"} == set(
        ok("describeTopic")["partitions"][0])
    assert {"kind", "actor_id"} <= set(ok("status")["actors"][0])
    # s.8.5: the admin operations, refused while members are live, then applied.
    assert error("deleteGroupLive")["code"] == "GROUP_NOT_EMPTY" and error("deleteGroupLive")["retriable"] is False
    in_use = error("deleteTopicLive")
    assert in_use["code"] == "TOPIC_IN_USE" and in_use["data"] == {"topic": "live", "groups": ["live-g"]}
    assert ok("alterGrow")["partitions"] == 2 and ok("alterGrow")["config"]["retention_ms"] == 3_600_000
    shrink = error("alterShrink")
    assert shrink["code"] == "INVALID_PARTITIONS" and shrink["data"]["got"] == 1
    assert ok("resetToTime")["partitions"] == [[0, 0]]
    assert ok("deleteGroup")["group"] == "live-g" and error("deleteGroupAgain")["code"] == "UNKNOWN_GROUP"
    deleted = ok("deleteTopic")
    assert {k: deleted[k] for k in ("topic", "partitions", "groups", "pending")} == {
        "topic": "live", "partitions": 2, "groups": [], "pending": []}
    assert error("deleteTopicAgain")["code"] == "UNKNOWN_TOPIC"
    assert "live" not in ok("listTopicsAfterDelete")


def test_header_named_proto_crosses_languages_on_a_real_broker(run_node, tmp_path):
    """A record header named "__proto__" (the broker accepts it) is an ordinary header to the
    Node client: fetched and consumed when Python wrote it, produced from an object or a Map."""
    from zbroker.client import Admin, Connection, Producer, fetch

    with _broker(tmp_path) as (handle, log_file):
        with Admin(handle.url) as admin:
            admin.create_topic("proto", 1)
        with Producer(handle.url) as producer:
            producer.send("proto", b"python", headers={"__proto__": b"py", "a": b"1"}, partition=0)
            producer.flush()
        proc = run_node("selfcheck.js", "proto-headers", handle.url, input={"topic": "proto"}, timeout=60)
        conn = Connection(handle.url)
        try:
            written_by_node, _start, _end = fetch(conn, "proto", 0, 1)
        finally:
            conn.close()
    assert proc.returncode == 0, f"{proc.stderr}\nbroker log (tail):\n{_tail(log_file)}"
    r = json.loads(proc.stdout)
    assert "failure" not in r, r["failure"]
    assert r["fetched"] == r["consumed"] == [{"__proto__": "py", "a": "1"}]
    assert (r["ack"]["applied"], r["ack"]["stale"]) == (1, [])
    assert r["produced"] == [1, 2]
    assert [(rec.value, rec.headers) for rec in written_by_node] == [
        (b"object", {"__proto__": b"node", "a": b"1"}), (b"map", {"__proto__": b"map"})]


def test_stale_ranges_a_stale_lease_does_not_list_are_still_reported(run_node, tmp_path):
    """s.6, s.7: a STALE_LEASE (and a poll's `stale`) lists at most 1000 ranges and counts the
    rest in `stale_omitted`. The Node client must pass that count on: 1500 stale ranges are
    not 1000 stale ranges."""
    r = _selfcheck(run_node, tmp_path, "stale-omitted", timeout=60)
    for result in (r["ack"], r["pollAcks"]):
        assert result["applied"] == 0
        assert len(result["stale"]) == 1000
        assert result.get("staleOmitted") == 500, result.keys()
    assert r["stats"]["staleRanges"] == 3000


def test_node_client_sends_many_partitions_of_one_actor_in_one_request(run_node, tmp_path):
    """produceKeyed over 8 partitions of one actor: one produce_many; the poll's deliveries:
    fetch_many. Every record arrives once (s.8.3, "Many partitions in one request")."""
    r = _selfcheck(run_node, tmp_path, "multi-partition", timeout=120)
    assert r["partitions"] == 8 and r["produced"] == 400, r
    assert r["consumed"] == 400 and r["duplicates"] == 0, r
    assert "multi_partition" in r["features"], r
    assert r["counters"]["produce_many_requests"] == 1 and r["counters"]["produce_requests"] == 8, r
    assert r["counters"]["fetch_many_requests"] >= 1, r
