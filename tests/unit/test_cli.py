"""The `zbroker` CLI in-process: its argument checks, and `consume` against a stand-in Consumer.

What needs a broker, a pipe or a signal (`produce` from stdin, Ctrl-C) is in
tests/integration/test_cli_and_clients.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import zbroker.client
from zbroker.protocol.errors import ErrorCode, ZBrokerError
from zbroker import cli


def run(monkeypatch, *argv: str) -> int:
    """`zbroker ARGV` in this process: its exit status. The CLI's logging setup is left out
    (it would point structlog at this test's captured stderr for the rest of the session)."""
    monkeypatch.setattr(cli, "_client_logging", lambda: None)
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    return exited.value.code


def fake_consumer(monkeypatch, *, refusals: tuple = (), records: int = 0, max_polls: int = 20) -> SimpleNamespace:
    """Put a stand-in for zbroker.client.Consumer: its constructor (which joins the group)
    raises each of `refusals` in turn, then it hands out `records` records and then none.
    More than `max_polls` polls fail the test, so that a loop which never stops does not hang it."""
    seen = SimpleNamespace(attempts=0, polls=0, acked=[])

    class Consumer:
        def __init__(self, url: str, *, group: str, topics: list[str]) -> None:
            seen.attempts += 1
            if seen.attempts <= len(refusals):
                raise refusals[seen.attempts - 1]
            self.pending = [SimpleNamespace(topic=topics[0], partition=0, offset=i, timestamp_ms=0, key=None,
                                            value=b"v%d" % i, headers=None) for i in range(records)]

        def __enter__(self) -> "Consumer":
            return self

        def __exit__(self, *exc) -> None:
            pass

        def poll(self, max_records: int, timeout: float) -> list:
            seen.polls += 1
            assert seen.polls <= max_polls, "it kept polling"
            out, self.pending = self.pending[:max_records], self.pending[max_records:]
            return out

        def ack(self, record) -> None:
            seen.acked.append(record.offset)

        def flush_acks(self) -> None:
            pass

    monkeypatch.setattr(zbroker.client, "Consumer", Consumer)
    return seen


def loading() -> ZBrokerError:
    return ZBrokerError("the group coordinator is still loading stored offsets", code=ErrorCode.UNAVAILABLE, op="join")


def test_consume_started_while_the_coordinator_restarts_waits_for_it(monkeypatch, capsys):
    # A reviewer started `zbroker consume` while the coordinator reloaded its offsets: it
    # printed `error: UNAVAILABLE` and exited 1 at once, although it retries that mid-run.
    seen = fake_consumer(monkeypatch, refusals=(loading(), loading()), records=2)
    assert run(monkeypatch, "consume", "t", "--group", "g", "--max", "2") == 0
    out = capsys.readouterr().out
    assert seen.attempts == 3 and seen.acked == [0, 1]
    assert "0@0 key=None value=v0" in out and "0@1 key=None value=v1" in out


def test_consume_still_fails_at_once_on_an_error_that_is_not_retriable(monkeypatch, capsys):
    refused = ZBrokerError("'group' must not be empty", code=ErrorCode.BAD_REQUEST, op="join")
    seen = fake_consumer(monkeypatch, refusals=(refused, refused))
    assert run(monkeypatch, "consume", "t", "--group", "g") == 1
    assert seen.attempts == 1 and "error: BAD_REQUEST: 'group' must not be empty" in capsys.readouterr().err


def test_consume_with_a_timeout_waits_for_the_coordinator_no_longer_than_that(monkeypatch, capsys):
    seen = fake_consumer(monkeypatch, refusals=(loading(),) * 50)
    assert run(monkeypatch, "consume", "t", "--group", "g", "--timeout", "0.2") == 1
    assert 1 <= seen.attempts < 50 and seen.polls == 0
    assert "error: UNAVAILABLE: the group coordinator is still loading stored offsets" in capsys.readouterr().err


def test_consume_timeout_0_stops_at_the_first_idle_poll(monkeypatch, capsys):
    # `--timeout 0` used to wait forever (0 read as "no timeout"), `--timeout -1` to stop at once.
    seen = fake_consumer(monkeypatch, records=3)
    assert run(monkeypatch, "consume", "t", "--group", "g", "--timeout", "0") == 0
    assert seen.acked == [0, 1, 2] and seen.polls == 2  # the records, then one poll that found nothing
    assert cli.build_parser().parse_args(["consume", "t", "--group", "g", "--timeout", "0"]).timeout == 0


@pytest.mark.parametrize("argv, said", [
    (["consume", "t", "--group", "g", "--timeout", "-1"], "must be 0 or more, not -1"),
    (["consume", "t", "--group", "g", "--timeout", "nan"], "must be a finite number, not nan"),
    (["produce", "t", "--linger-ms", "-5"], "must be 0 or more, not -5"),
    (["produce", "t", "--linger-ms", "inf"], "must be a finite number, not inf"),
    (["up", "--log-level", "chatty"], "invalid choice: 'chatty'"),
    (["partition", "--log-level", "chatty"], "invalid choice: 'chatty'"),
    (["up", "--partition-actors", "0"], "must be 1 or more, not 0"),
    (["groups", "configure", "g", "--max-in-flight", "0"], "must be from 1 to 18446744073709551615, not 0"),
    (["groups", "configure", "g", "--max-in-flight", str(1 << 64)], "must be from 1 to 18446744073709551615"),
    (["groups", "configure", "g", "--max-deliveries", str(1 << 64)], "must be from 1 to 18446744073709551615"),
    (["groups", "configure", "g", "--ack-timeout", "0"], "must be from 0.001 to 43200, not 0"),
    (["groups", "configure", "g", "--ack-timeout", "1e20"], "must be from 0.001 to 43200, not 1e20"),
    # argparse names the type function in its message: the names are words, not _non_negative
    (["fetch", "t", "--partition", "abc"], "invalid non-negative integer value: 'abc'"),
    (["produce", "t", "--count", "many"], "invalid positive integer value: 'many'"),
    (["produce", "t", "--linger-ms", "soon"], "invalid non-negative number value: 'soon'"),
])
def test_bad_values_are_refused_by_the_parser_in_plain_words(argv, said, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and said in err, err
    assert "invalid _" not in err


def test_values_at_the_edges_of_their_ranges_are_taken():
    parse = cli.build_parser().parse_args
    # The protocol takes max_in_flight and max_deliveries up to 2^64 - 1 (docs/PROTOCOL.md, configure_group).
    args = parse(["groups", "configure", "g", "--max-in-flight", "99999999999",
                  "--max-deliveries", str((1 << 64) - 1), "--ack-timeout", "43200"])
    assert (args.max_in_flight, args.max_deliveries, args.ack_timeout) == (99999999999, (1 << 64) - 1, 43200)
    assert parse(["produce", "t", "--linger-ms", "0"]).linger_ms == 0
    assert parse(["up", "--partition-actors", "1", "--log-level", "WARNING"]).log_level == "warning"
    assert parse(["partition", "--log-level", "debug"]).log_level == "debug"


def fake_admin(monkeypatch, **answers) -> SimpleNamespace:
    """A stand-in for zbroker.client.Admin answering each call named in `answers` (a value,
    or a list of values handed out in turn)."""
    calls = SimpleNamespace(log=[])

    class Admin:
        def __init__(self, *_a, **_k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_exc):
            return False

        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls.log.append((name, args, kwargs))
                answer = answers[name]
                return answer.pop(0) if isinstance(answer, list) else answer
            return call

    monkeypatch.setattr(zbroker.client, "Admin", Admin)
    return calls


def _status(under):
    return {"healthy": True, "under_replicated": under,
            "actors": [{"kind": "group-coordinator", "actor_id": "coordinator", "healthy": True}]}


def test_status_lists_under_replicated_partitions_and_is_unhealthy_below_min_insync(monkeypatch, capsys):
    row = {"topic": "t", "partition": 0, "leader": "a", "leader_epoch": 3, "replicas": ["a", "b", "c"],
           "isr": ["a", "b"], "min_insync": 2, "below_min_insync": False, "offline": False}
    fake_admin(monkeypatch, status=_status([row]))
    assert run(monkeypatch, "status") == 0  # degraded, still at min_insync
    out = capsys.readouterr().out
    assert "under-replicated" in out and "t/0" in out and "degraded" in out
    offline = {**row, "leader": None, "isr": ["c"], "below_min_insync": True, "offline": True}
    fake_admin(monkeypatch, status=_status([offline]))
    assert run(monkeypatch, "status") == 1
    out = capsys.readouterr().out
    assert "UNHEALTHY" in out and "OFFLINE" in out


def test_status_shows_the_cluster_its_leader_epoch_and_lease_age(monkeypatch, capsys):
    from zbroker.storage.offsets.cluster_view import cluster_view

    lease = {"holder": "n2", "endpoint": "tcp://127.0.0.2:7400", "epoch": 4, "lease_age_ms": 250,
             "held_for_ms": 61_000, "remaining_ms": 4750}
    history = [{"holder": "n2", "endpoint": "tcp://127.0.0.2:7400", "last_epoch": 4, "epochs_taken": 2,
                "last_taken_ms_ago": 61_000},
               {"holder": "n1", "endpoint": "tcp://127.0.0.1:7400", "last_epoch": 3, "epochs_taken": 2,
                "last_taken_ms_ago": 90_000}]
    fake_admin(monkeypatch, status={**_status([]), "cluster": cluster_view("postgresql", lease, history)})
    assert run(monkeypatch, "status") == 0
    out = capsys.readouterr().out
    assert "n2 (tcp://127.0.0.2:7400) leads at epoch 4; lease renewed 250 ms ago, held 61.0 s, expires in 4750 ms" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("n1 ", "n2 "))}
    assert rows["n2"][2] == "leader" and rows["n1"][2:4] == ["not", "leading"]
    fake_admin(monkeypatch, status={**_status([]), "cluster": cluster_view("sqlite", None, [], endpoint="tcp://h:7400")})
    assert run(monkeypatch, "status") == 0
    assert "cluster of one (sqlite): tcp://h:7400 leads" in capsys.readouterr().out


def test_describe_shows_each_replicas_lag_behind_the_high_watermark(monkeypatch, capsys):
    part = {"partition": 0, "log_start": 0, "log_end": 10, "bytes": 5, "actor_id": "a", "endpoint": "tcp://x:1",
            "leader": "a", "leader_epoch": 2, "replicas": ["a", "b"], "isr": ["a"], "high_watermark": 10,
            "replica_log_ends": {"a": 12, "b": 7}}
    fake_admin(monkeypatch, describe_topic={"topic": "t", "config": {}, "partitions": [part]})
    assert run(monkeypatch, "topics", "describe", "t") == 0
    out = capsys.readouterr().out
    assert "a:12(lag 0)" in out and "b:7(lag 3)" in out and "a,b" in out


def test_reassign_follows_the_move_until_the_replica_set_is_the_target(monkeypatch, capsys):
    monkeypatch.setattr(cli, "REASSIGN_POLL_S", 0)
    moving = {"topic": "t", "partition": 0, "replicas": ["c", "a", "b"], "target": ["c", "a"], "done": False}
    described = [{"partitions": [{"replicas": r, "isr": r}]} for r in (["c", "a", "b"], ["c", "a"])]
    calls = fake_admin(monkeypatch, reassign_partition=moving, describe_topic=described)
    assert run(monkeypatch, "topics", "reassign", "t", "--partition", "0", "--replicas", "c,a") == 0
    assert calls.log[0] == ("reassign_partition", ("t", 0, ["c", "a"]), {})
    assert "moved: replicas c,a" in capsys.readouterr().out
