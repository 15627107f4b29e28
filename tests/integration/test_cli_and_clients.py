"""The CLI as a user runs it, the asyncio client, and scale-out with `zbroker partition`."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from zbroker.client import Admin, Producer, fetch
from zbroker.client.aio import AsyncAdmin, AsyncConsumer, AsyncProducer
from zbroker.client.sync import Connection
from tests.support.processes import default_signal_dispositions

pytestmark = pytest.mark.processes


def cli(broker_url: str, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "zbroker", *args], input=stdin, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "ZBROKER_URL": broker_url})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_cli_json_tells_bytes_that_are_not_utf8_from_text(broker):
    # A newcomer's point: b"\xca\xfe" printed as "cafe", the same as the text value "cafe".
    with Admin(broker.url) as admin:
        admin.create_topic("bytes", partitions=1)
    with Producer(broker.url) as producer:
        producer.produce("bytes", [b"\xca\xfe", b"cafe"], partition=0)
    lines = cli(broker.url, "fetch", "bytes", "--partition", "0", "--offset", "0", "--max", "2", "--json").stdout
    assert [json.loads(line)["value"] for line in lines.splitlines()] == [{"hex": "cafe"}, "cafe"]
    text = cli(broker.url, "fetch", "bytes", "--partition", "0", "--offset", "0", "--max", "2").stdout
    assert "value=<hex:cafe>" in text and "value=cafe" in text


def test_cli_topics_produce_fetch_consume_groups_and_status(broker):
    assert "created topic logs" in cli(broker.url, "topics", "create", "logs", "--partitions", "2").stdout
    assert cli(broker.url, "topics", "list", "--json").stdout.strip() == '["logs"]'
    cli(broker.url, "produce", "logs", "--partition", "0", stdin="alpha\nbeta\ngamma\n")
    summary = json.loads(cli(broker.url, "produce", "logs", "--count", "500", "--size", "64", "--json").stdout)
    assert summary["records"] == 500 and summary["records_per_s"] > 0

    lines = cli(broker.url, "fetch", "logs", "--partition", "0", "--offset", "0", "--max", "3", "--json").stdout
    first = [json.loads(line) for line in lines.splitlines()]
    assert [r["value"] for r in first] == ["alpha", "beta", "gamma"]
    assert [r["offset"] for r in first] == [0, 1, 2]

    described = json.loads(cli(broker.url, "topics", "describe", "logs", "--json").stdout)
    assert sum(p["log_end"] for p in described["partitions"]) == 503

    cli(broker.url, "groups", "configure", "readers", "--ack-timeout", "5", "--max-deliveries", "3")
    consumed = cli(broker.url, "consume", "logs", "--group", "readers", "--max", "503", "--json").stdout
    assert len(consumed.splitlines()) == 503
    deadline = time.monotonic() + 10
    while True:
        group = json.loads(cli(broker.url, "groups", "describe", "readers", "--json").stdout)
        if sum(p["lag"] for p in group["partitions"]) == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(p["lag"] for p in group["partitions"]) == 0
    assert group["ack_timeout_ms"] == 5000 or group.get("config", {}).get("ack_timeout_ms") == 5000
    assert "readers" in cli(broker.url, "groups", "list").stdout
    human = cli(broker.url, "groups", "describe", "readers").stdout
    assert "COMMITTED" in human and "LAG" in human

    reset = json.loads(cli(broker.url, "groups", "reset", "readers", "--topic", "logs", "--to", "earliest",
                           "--json").stdout)
    assert sorted(reset["partitions"]) == [[0, 0], [1, 0]]

    status = json.loads(cli(broker.url, "status", "--json").stdout)
    kinds = sorted(a["kind"] for a in status["actors"])
    assert kinds == ["commit-writer", "group-coordinator", "partition-log"] and status["healthy"]


def test_cli_errors_are_clear_and_exit_1(broker):
    proc = cli(broker.url, "topics", "describe", "nope", check=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: UNKNOWN_TOPIC:")
    proc = cli(broker.url, "topics", "create", "bad/name", check=False)
    assert proc.returncode == 1 and "BAD_REQUEST" in proc.stderr
    # The client library's own log line about the failed batch goes to stderr too:
    # stdout, which a pipeline reads, carries nothing but results.
    cli(broker.url, "topics", "create", "two", "--partitions", "2")
    proc = cli(broker.url, "produce", "two", "--partition", "7", stdin="hi\n", check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "produce.failed" in proc.stderr and "error: UNKNOWN_PARTITION" in proc.stderr


def _log_end(broker_url: str, topic: str) -> int:
    with Admin(broker_url) as admin:
        return sum(p["log_end"] for p in admin.describe_topic(topic)["partitions"])


def _wait_for_log_end(broker_url: str, topic: str, records: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (end := _log_end(broker_url, topic)) < records and time.monotonic() < deadline:
        time.sleep(0.05)
    return end


def _produce(broker_url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "zbroker", "produce", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "ZBROKER_URL": broker_url},
                            preexec_fn=default_signal_dispositions)


def test_cli_produce_sends_a_line_within_its_linger_not_when_the_next_comes(broker):
    # A reviewer piped `(echo a; sleep 6; echo b)`: "a" reached the log only with "b".
    cli(broker.url, "topics", "create", "live")
    proc = _produce(broker.url, "live")
    try:
        proc.stdin.write("a\n")
        proc.stdin.flush()
        assert _wait_for_log_end(broker.url, "live", 1) == 1  # stdin still open: no next line, no end
        _out, err = proc.communicate("b", timeout=30)  # a last line without its newline is a line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # closes the pipes too: a leaked one fails a later test
    assert proc.returncode == 0, err
    lines = cli(broker.url, "fetch", "live", "--partition", "0", "--json").stdout.splitlines()
    assert [json.loads(line)["value"] for line in lines] == ["a", "b"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_cli_produce_interrupted_sends_what_it_read_and_says_so(broker, sig):
    # A reviewer's Ctrl-C dropped the lines read and not sent yet, without a word.
    cli(broker.url, "topics", "create", "orders")
    # Batches of two that linger a minute: the third line is in the producer when the signal comes.
    proc = _produce(broker.url, "orders", "--batch-size", "2", "--linger-ms", "60000")
    try:
        proc.stdin.write("one\ntwo\nthree\nunfini")  # one write to the pipe: read in one piece
        proc.stdin.flush()
        assert _wait_for_log_end(broker.url, "orders", 2) == 2  # the first batch went: all of it was read
        proc.send_signal(sig)
        proc.wait(timeout=30)  # stdin still open: it stops for the signal, not at the end of input
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # closes the pipes too: a leaked one fails a later test
    assert proc.returncode == 128 + sig, err
    assert _log_end(broker.url, "orders") == 3  # "three" was sent; the unfinished line was not
    assert "3 record(s) acknowledged, 0 not sent" in err, err
    assert "the input after the last whole line read was not sent (6 bytes of it were read)" in err, err


def test_cli_produce_count_interrupted_says_what_was_acknowledged(broker):
    cli(broker.url, "topics", "create", "load")
    proc = _produce(broker.url, "load", "--count", "100000000", "--size", "1")
    try:
        assert _wait_for_log_end(broker.url, "load", 1) >= 1
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()  # closes the pipes too: a leaked one fails a later test
    assert proc.returncode == 130, err
    said = re.search(r"(\d+) record\(s\) acknowledged, 0 not sent", err)
    assert said, err
    assert int(said.group(1)) == _log_end(broker.url, "load") > 0


def test_cli_produce_takes_a_key_that_is_not_utf8(broker):
    # `--key $'\xff'` reaches Python as "\udcff": it failed with "'utf-8' codec can't encode".
    cli(broker.url, "topics", "create", "keyed")
    cli(broker.url, "produce", "keyed", "--key", "\udcff", stdin="x\n")
    record = json.loads(cli(broker.url, "fetch", "keyed", "--partition", "0", "--json").stdout)
    assert (record["key"], record["value"]) == ({"hex": "ff"}, "x")


def test_cli_consume_stopped_by_sigterm_acks_what_it_printed_and_leaves_the_group(broker):
    cli(broker.url, "topics", "create", "jobs")
    cli(broker.url, "produce", "jobs", stdin="".join(f"job-{i}\n" for i in range(5)))
    consume = subprocess.Popen([sys.executable, "-m", "zbroker", "consume", "jobs", "--group", "g"],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "ZBROKER_URL": broker.url},
                               preexec_fn=default_signal_dispositions)
    with consume.stdout:
        printed = [consume.stdout.readline() for _ in range(5)]
        assert all(line.startswith("0@") for line in printed)
        consume.send_signal(signal.SIGTERM)
        assert consume.wait(timeout=30) == 128 + signal.SIGTERM
    with Admin(broker.url) as admin:
        group = admin.describe_group("g")
        assert not group["members"], group  # left at once, not after the 10 s session timeout
        deadline = time.monotonic() + 20
        while [p["committed"] for p in group["partitions"]] != [5] and time.monotonic() < deadline:
            time.sleep(0.1)  # the commit writer makes it durable within a flush interval
            group = admin.describe_group("g")
    assert [p["committed"] for p in group["partitions"]] == [5], group  # what was printed was acked


def test_asyncio_twin_produces_and_consumes_with_acks(broker):
    async def main() -> list[bytes]:
        async with AsyncAdmin(broker.url) as admin:
            await admin.create_topic("aio", partitions=2)
        async with AsyncProducer(broker.url, linger_ms=1) as producer:
            handles = [await producer.send("aio", f"a{i}".encode(), key=f"k{i % 7}".encode()) for i in range(300)]
            await producer.flush()
        assert all(h.offset is not None for h in handles)
        got = []
        async with AsyncConsumer(broker.url, group="aio", topics=["aio"]) as consumer:
            # Connected to the partition actor at join, before the first fetch.
            assert len(consumer.conn.sockets) == 2  # the coordinator and the one partition actor
            deadline = time.monotonic() + 20
            while len(got) < 300 and time.monotonic() < deadline:
                for record in await consumer.poll(max_records=100, timeout=0.2):
                    got.append(record.value)
                    await consumer.ack(record)
            await consumer.flush_acks()
        async with AsyncAdmin(broker.url) as admin:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                parts = (await admin.describe_group("aio"))["partitions"]
                if sum(p["lag"] for p in parts) == 0:
                    break
                await asyncio.sleep(0.05)
            assert sum(p["lag"] for p in parts) == 0
        return got

    got = asyncio.run(main())
    assert sorted(got) == sorted(f"a{i}".encode() for i in range(300))


def test_zbroker_partition_scales_out_and_takes_over_partitions(broker, tmp_path):
    with Admin(broker.url) as admin:
        admin.create_topic("wide", partitions=4)
    with Producer(broker.url) as producer:
        producer.produce("wide", [f"before-{i}".encode() for i in range(400)])
    extra = subprocess.Popen(
        [sys.executable, "-m", "zbroker", "partition", "--broker", broker.url, "--data",
         str(broker.config.data_dir) + "/partitions", "--actor-id", "extra", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        owners: dict = {}
        while time.monotonic() < deadline:
            with Admin(broker.url) as admin:
                owners = {p["partition"]: p["actor_id"] for p in admin.describe_topic("wide")["partitions"]}
            if sorted(owners.values()) == ["extra", "extra", "p0", "p0"]:
                break
            time.sleep(0.1)
        assert sorted(owners.values()) == ["extra", "extra", "p0", "p0"]
        with Producer(broker.url) as producer:
            producer.produce("wide", [f"after-{i}".encode() for i in range(400)])
        conn = Connection(broker.url)
        try:
            conn.refresh()
            values = []
            for p in range(4):
                offset = 0
                while True:
                    records, _s, end = fetch(conn, "wide", p, offset)
                    values += [r.value for r in records]
                    if not records or records[-1].offset + 1 >= end:
                        break
                    offset = records[-1].offset + 1
            assert sorted(values) == sorted([f"before-{i}".encode() for i in range(400)] +
                                            [f"after-{i}".encode() for i in range(400)])
        finally:
            conn.close()
        # Stopped on purpose, it says so once its logs are closed: its partitions go back
        # to p0 at once, long before its registrations would lapse (5 s).
        extra.send_signal(signal.SIGTERM)
        assert extra.wait(20) == 0
        stopped_at = time.monotonic()
        while time.monotonic() < stopped_at + 20:
            with Admin(broker.url) as admin:
                owners = {p["partition"]: p["actor_id"] for p in admin.describe_topic("wide")["partitions"]}
            if sorted(owners.values()) == ["p0"] * 4:
                break
            time.sleep(0.05)
        assert sorted(owners.values()) == ["p0"] * 4
        assert time.monotonic() - stopped_at < 2.5, "moved only when the registrations lapsed (4-5 s)"
        with Producer(broker.url) as producer:
            producer.produce("wide", [b"after the stop"] * 40)
    finally:
        if extra.poll() is None:
            extra.send_signal(signal.SIGTERM)
            assert extra.wait(20) == 0


def test_a_second_actor_under_a_taken_actor_id_says_so_instead_of_idling(broker, tmp_path):
    # The coordinator's ROUTER refuses a second connection under an identity in use, so
    # this actor's registrations vanish: it used to sit idle without a word.
    log_path = tmp_path / "duplicate.log"
    with open(log_path, "w") as log_file:
        duplicate = subprocess.Popen(
            [sys.executable, "-m", "zbroker", "partition", "--broker", broker.url, "--data",
             str(tmp_path / "duplicate-data"), "--actor-id", "p0", "--log-level", "warning"],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while "coordinator.registration_unanswered" not in log_path.read_text() and time.monotonic() < deadline:
            assert duplicate.poll() is None, log_path.read_text()
            time.sleep(0.2)
        text = log_path.read_text()
        assert "coordinator.registration_unanswered" in text and "--actor-id" in text
        # The first p0 goes on serving and is still the one the coordinator knows.
        with Admin(broker.url) as admin:
            [actor] = [a for a in admin.status()["actors"] if a.get("actor_id") == "p0"]
            assert actor["pid"] == broker.pids()["partition-0"]
    finally:
        duplicate.send_signal(signal.SIGTERM)
        duplicate.wait(20)


def test_status_shows_an_actor_that_cannot_open_its_partitions(broker):
    # An actor short of file descriptors defers partitions and keeps serving the rest;
    # `zbroker status` called it healthy while their clients got NOT_OWNER.
    import resource

    pid = broker.pids()["partition-0"]
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{pid}/fd"))
    # Room for a few partitions (a lock and two segment files each), not for twenty.
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 10, old[1]))
    try:
        with Admin(broker.url) as admin:
            admin.create_topic("crowded", partitions=20)
            deadline = time.monotonic() + 15
            while True:
                (actor,) = [a for a in admin.status()["actors"] if a["kind"] == "partition-log"]
                if actor.get("not_open_count") or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert actor["alive"] is True and actor["healthy"] is False
        assert 0 < actor["not_open_count"] < 20
        assert all("file descriptors" in reason for _, _, reason in actor["not_open"])
        unhealthy = cli(broker.url, "status", check=False)
        assert unhealthy.returncode == 1  # a health check can use it
        text = unhealthy.stdout
        assert text.startswith("broker UNHEALTHY")
        assert f"{actor['actor_id']} has not opened {actor['not_open_count']} of its partitions" in text
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
    deadline = time.monotonic() + 15  # opening is retried every second
    with Admin(broker.url) as admin:
        while True:
            (actor,) = [a for a in admin.status()["actors"] if a["kind"] == "partition-log"]
            if actor["healthy"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert actor["healthy"] is True and actor["not_open_count"] == 0 and len(actor["partitions"]) == 20
    assert cli(broker.url, "status").stdout.startswith("broker healthy")
    with Producer(broker.url) as producer:
        for p in range(20):  # every one of them serves now
            producer.produce("crowded", [b"x"], partition=p)


def test_a_malformed_tell_on_the_internal_endpoint_gets_no_reply(broker):
    # PROTOCOL.md s.16: a tell is never answered, not even with an error. A reviewer's
    # malformed `report` and `writer_status` were answered BAD_REQUEST.
    import msgpack  # malformed frames are built by hand: the codec would refuse them
    import zmq

    from zbroker.protocol import codec
    from zbroker.protocol import messages as m
    from tests.fuzz.harness import actor_endpoint

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"partition:not-an-actor")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(actor_endpoint(broker.url))
    try:
        for header in [{"v": 1, "op": "report", "id": 1, "actor_id": 7},
                       {"v": 1, "op": "writer_status", "id": 2, "pid": "one"},
                       {"v": 1, "op": "report", "id": 3}]:
            sock.send_multipart([msgpack.packb(header)])
        sock.send_multipart(codec.encode_request(m.Hello(versions=[1]), 4))
        assert sock.poll(10_000)
        assert codec.decode_reply(sock.recv_multipart()).corr_id == 4  # the first and only reply
        assert not sock.poll(300)
    finally:
        sock.close()
        ctx.term()


def test_cli_consume_rides_out_a_coordinator_restart(broker):
    # A reviewer killed the coordinator under `zbroker consume`: the supervisor had it
    # back within 0.1 s, but the CLI died on the poll that was lost with it (TIMEOUT,
    # or UNAVAILABLE while offsets reloaded), although both are retriable.
    with Admin(broker.url) as admin:
        admin.create_topic("steady", partitions=1)
    with Producer(broker.url) as producer:
        producer.produce("steady", [b"a%d" % i for i in range(100)], partition=0)
    consumer = subprocess.Popen([sys.executable, "-m", "zbroker", "consume", "steady", "--group", "steady",
                                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "ZBROKER_URL": broker.url},
                                preexec_fn=default_signal_dispositions)
    wanted = {f"a{i}" for i in range(100)} | {f"b{i}" for i in range(100)}
    seen: set[str] = set()
    try:
        while len(seen) < 100:
            seen.add(json.loads(consumer.stdout.readline())["value"])
        broker.kill("coordinator")
        with Producer(broker.url) as producer:  # metadata from the coordinator once it is back
            producer.produce("steady", [b"b%d" % i for i in range(100)], partition=0)
        # Every record comes, some of the first hundred twice: their leases went with the coordinator.
        while seen != wanted and (line := consumer.stdout.readline()):
            seen.add(json.loads(line)["value"])
        consumer.send_signal(signal.SIGTERM)
        _out, err = consumer.communicate(timeout=30)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.communicate()
    assert seen == wanted, err[-3000:]
    assert consumer.returncode == 128 + signal.SIGTERM, err[-3000:]  # stopped, not failed
