"""``zbroker``: run the broker, manage topics and groups, produce, fetch and consume.

Every command that talks to a broker takes ``--broker URL`` (default
``$ZBROKER_URL`` or tcp://127.0.0.1:7400). ``--json`` prints machine-readable
output: a record's key, value and headers as text when they are UTF-8, else as
``{"hex": "..."}``. Errors print ``error: CODE: message`` on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import socket
import sys
import time
from typing import Any, Callable

import zmq

from zbroker.protocol.errors import RequestTimeout, ZBrokerError
from zbroker.protocol.messages import MAX_LEASE_MS

DEFAULT_URL = os.environ.get("ZBROKER_URL", "tcp://127.0.0.1:7400")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # what actors.runtime.configure_logging knows
# How long an interrupted `produce` waits for the acknowledgements of what it read.
INTERRUPTED_FLUSH_S = 5.0
REASSIGN_POLL_S = 0.5  # how often `topics reassign` looks at the move


def _b(value: bytes | None) -> str | dict | None:
    """Bytes for --json: the text if they are UTF-8, else {"hex": "..."}. A bare hex
    string would read the same as a text value that happens to look like hex."""
    if value is None:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        return {"hex": value.hex()}


def _shown(value: bytes | None) -> str | None:
    """Bytes for a person: the text if they are UTF-8, else <hex:...>."""
    b = _b(value)
    return f"<hex:{b['hex']}>" if isinstance(b, dict) else b


def _record_json(rec: Any) -> dict:
    out = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset, "timestamp_ms": rec.timestamp_ms,
           "key": _b(rec.key), "value": _b(rec.value),
           "headers": {k: _b(v) for k, v in (rec.headers or {}).items()}}
    if hasattr(rec, "attempt"):
        out["attempt"] = rec.attempt
        out["reason"] = rec.reason
    return out


def _print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in columns}
    print("  ".join(c.upper().ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))


# -- commands -------------------------------------------------------------------------------------

def cmd_up(args: argparse.Namespace) -> int:
    from zbroker.supervisor import BrokerConfig, serve
    return serve(BrokerConfig(data_dir=args.data, host=args.host, advertise_host=args.advertise_host, port=args.port,
                              partition_actors=args.partition_actors, fsync=args.fsync,
                              offsets_url=args.offsets, log_level=args.log_level, curve_dir=args.curve,
                              rack=args.rack, actor_dirs=args.actor_dirs,
                              unclean_leader_election=args.unclean_leader_election,
                              replica_lag_ms=args.replica_lag_ms,
                              coordinator_lease_ms=args.coordinator_lease_ms,
                              http=args.http, http_token=args.http_token or os.environ.get("ZBROKER_HTTP_TOKEN")))


def cmd_top(args: argparse.Namespace) -> int:
    from zbroker.console.top import run_top
    return run_top(args.broker, interval_s=args.interval, iterations=args.iterations)


def cmd_partition(args: argparse.Namespace) -> int:
    from zbroker.actors.partition_log.core import FsyncPolicy
    from zbroker.actors.partition_log.shell import run
    from zbroker.actors.runtime import wildcard_error
    from zbroker.actors.security import KeyRing
    FsyncPolicy.parse(args.fsync)
    if not args.advertise_host and wildcard_error(args.bind):
        raise ValueError(f"--bind: {wildcard_error(args.bind)}")
    actor_id = args.actor_id or f"{socket.gethostname()}-{os.getpid()}"
    curve = KeyRing(args.curve).internal_client() if args.curve is not None else None  # "" is refused
    internal = ",".join(_internal_endpoints(args.broker, curve))
    run(actor_id, internal, args.data, bind=args.bind, advertise_host=args.advertise_host, fsync=args.fsync,
        log_level=args.log_level, curve_dir=args.curve, replica_lag_ms=args.replica_lag_ms, rack=args.rack)
    return 0


def _internal_endpoints(urls: str, curve: Any) -> list[str]:
    """The coordinators' internal endpoints for client URLs (one, or a cluster's several).

    A broker URL is a client endpoint; hello says where its actors dial. A node that
    does not answer now (down, or mid-failover) is taken to bind it at its client port
    + 1, as `zbroker up` does; the actor rotates through the list when its coordinator
    stops answering, and follows a standby's NOT_COORDINATOR to the leader."""
    from zbroker.actors.partition_log.coordinator_link import internal_endpoint_of
    from zbroker.client import Admin
    from zbroker.client.transport import bootstrap_urls
    endpoints: list[str] = []
    for url in bootstrap_urls(urls):
        try:
            with Admin(url, curve=curve, request_timeout=2.0) as admin:
                internal = admin.hello().get("internal_endpoint")
        except ZBrokerError as err:
            internal = internal_endpoint_of({"endpoint": url}) if len(bootstrap_urls(urls)) > 1 else None
            if internal is None:
                raise
            print(f"warning: {url} did not answer hello ({err.code.value}); taking {internal} as its "
                  f"internal endpoint", file=sys.stderr)
        if not internal:
            raise SystemExit(f"error: the broker at {url} did not name its internal endpoint")
        endpoints.append(internal)
    return list(dict.fromkeys(endpoints))


def cmd_keygen(args: argparse.Namespace) -> int:
    from zbroker.actors.security import keygen
    written = keygen(args.dir, clients=args.client)
    for name, path in written.items():
        print(f"{name}: {path}")
    if not written:
        print("nothing new: every key already exists")
    print(f"broker: zbroker up --curve {args.dir}")
    print(f"client: ZBROKER_CURVE_SERVER_KEY={args.dir}/server.key "
          f"ZBROKER_CURVE_KEY={args.dir}/clients/<name>.key_secret zbroker status")
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from zbroker.client import Admin
    with Admin(args.broker) as admin:
        if args.topics_cmd == "create":
            config = {k: v for k, v in (("segment_bytes", args.segment_bytes), ("retention_bytes", args.retention_bytes),
                                        ("retention_ms", args.retention_ms)) if v is not None}
            result = admin.create_topic(args.name, partitions=args.partitions, config=config or None,
                                        replication_factor=args.replication_factor, min_insync=args.min_insync)
            replicated = f", replication factor {args.replication_factor}" if args.replication_factor > 1 else ""
            print(json.dumps(result) if args.json
                  else f"created topic {args.name} with {args.partitions} partition(s){replicated}")
        elif args.topics_cmd == "list":
            topics = admin.list_topics()
            print(json.dumps(topics) if args.json else "\n".join(topics))
        elif args.topics_cmd == "describe":
            result = admin.describe_topic(args.name)
            if args.json:
                print(json.dumps(result))
            else:
                print(f"topic {result['topic']}  config {json.dumps(result['config'])}")
                _print_table([_replica_row(p) for p in result["partitions"]],
                             ["partition", "leader", "leader_epoch", "replicas", "isr", "log_start",
                              "high_watermark", "bytes", "replica_log_ends", "endpoint"])
        elif args.topics_cmd == "reassign":
            return _reassign(admin, args)
        else:
            return _topics_admin(args, admin)
    return 0


def cmd_dlq(args: argparse.Namespace) -> int:
    from zbroker.client.redrive import redrive_dead_letters
    result = redrive_dead_letters(args.broker, args.topic, group=args.group, max_records=args.max)
    if args.json:
        print(json.dumps(result))
        return 0
    where = ", ".join(f"{n} to {t}" for t, n in sorted(result["by_topic"].items()))
    print(f"redrove {result['redriven']} dead letter(s) from {args.topic}" + (f" ({where})" if where else "")
          + ("" if result["redriven"] else ": nothing to redrive"))
    for row in result["skipped"]:
        print(f"left {args.topic}/{row['partition']}@{row['offset']} in place: {row['reason']}", file=sys.stderr)
    return 0


def _replica_row(p: dict) -> dict:
    """A describe_topic partition as a table row; each replica's log end with its lag behind
    the high watermark (an older coordinator sends none of the replica fields)."""
    high = p.get("high_watermark", p["log_end"])
    ends = p.get("replica_log_ends") or {}
    lag = ",".join(f"{a}:{end}(lag {max(0, high - end)})" for a, end in ends.items())
    return {"partition": p["partition"], "leader": p.get("leader", p.get("actor_id")) or "NONE",
            "leader_epoch": p.get("leader_epoch", 0), "replicas": ",".join(p.get("replicas") or []),
            "isr": ",".join(p.get("isr") or []), "log_start": p["log_start"], "high_watermark": high,
            "bytes": p["bytes"], "replica_log_ends": lag, "endpoint": p.get("endpoint") or ""}


def _reassign(admin: Any, args: argparse.Namespace) -> int:
    """Start the move; unless --no-wait, follow it until the replica set is the target."""
    replicas = [r for r in args.replicas.split(",") if r]
    result = admin.reassign_partition(args.name, args.partition, replicas)
    give_up = time.monotonic() + args.timeout
    while not result["done"] and not args.no_wait:
        if time.monotonic() > give_up:
            print(f"error: {args.name}/{args.partition} still moving after {args.timeout:g} s "
                  f"(replicas {','.join(result['replicas'])}): the move goes on; see topics describe",
                  file=sys.stderr)
            return 1
        time.sleep(REASSIGN_POLL_S)
        part = admin.describe_topic(args.name)["partitions"][args.partition]
        result = {**result, "replicas": part["replicas"], "isr": part["isr"],
                  "done": part["replicas"] == replicas}
    if args.json:
        print(json.dumps(result))
    else:
        state = "moved" if result["done"] else "moving"
        print(f"{args.name}/{args.partition} {state}: replicas {','.join(result['replicas'])}")
    return 0


def _topics_admin(args: argparse.Namespace, admin: Any) -> int:
    """`topics alter` (and the other admin operations on topics)."""
    if args.topics_cmd == "alter":
        changes = {k: v for k, v in (("partitions", args.partitions), ("retention_ms", args.retention_ms),
                                     ("retention_bytes", args.retention_bytes)) if v is not None}
        if not changes:
            raise ValueError("topics alter: give --partitions, --retention-ms or --retention-bytes")
        result = admin.alter_topic(args.name, **changes)
        print(json.dumps(result) if args.json else
              f"topic {args.name}: {result['partitions']} partition(s), config {json.dumps(result['config'])}")
    elif args.topics_cmd == "delete":
        result = admin.delete_topic(args.name)
        if args.json:
            print(json.dumps(result))
        else:
            groups = f"; offsets of group(s) {', '.join(result['groups'])} removed" if result["groups"] else ""
            print(f"deleted topic {args.name} ({result['partitions']} partition(s)){groups}")
            if result["pending"]:
                print(f"files of {len(result['pending'])} partition(s) wait for their actor to come back "
                      f"({', '.join(sorted({a for _p, a in result['pending']}))}); the name is free once they are "
                      f"gone", file=sys.stderr)
    return 0


class _Signals:
    """Within this block SIGINT and SIGTERM set ``signum`` rather than raise inside the
    client library, and wake a ``select`` that waits on ``fd``; a second one raises
    KeyboardInterrupt, for a user who will not wait."""

    def __enter__(self) -> "_Signals":
        self.signum: int | None = None
        self.fd, self._wakeup = os.pipe()
        for fd in (self.fd, self._wakeup):
            os.set_blocking(fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wakeup, warn_on_full_buffer=False)
        # One that is ignored (SIGINT in a script's background job, nohup) stays ignored.
        self._old = {sig: signal.signal(sig, self._caught) for sig in (signal.SIGINT, signal.SIGTERM)
                     if signal.getsignal(sig) is not signal.SIG_IGN}
        return self

    def _caught(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self.fd)
        os.close(self._wakeup)


class _Interrupted(Exception):
    """Leaves the producer's block without its flush (which could wait for good)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def cmd_produce(args: argparse.Namespace) -> int:
    from zbroker.client import Producer
    key = os.fsencode(args.key) if args.key is not None else None  # `--key $'\xff'` is the byte 0xff
    started = time.perf_counter()
    try:
        with Producer(args.broker, linger_ms=args.linger_ms, batch_size=args.batch_size) as producer, \
                _Signals() as signals:
            producer.stop_waiting = lambda: signals.signum is not None
            if args.count is not None:
                count, unfinished = _produce_synthetic(producer, args, key, signals), b""
            else:
                count, unfinished = _produce_lines(producer, args, key, signals)
            while signals.signum is None:  # flush(), in slices so that a signal is heard
                try:
                    producer.flush(timeout=0.1)
                    break
                except RequestTimeout:  # not all acknowledged yet (a batch that failed is a ProduceError)
                    pass
            if signals.signum is not None:
                _report_interrupted(producer, count, unfinished, signals.signum)
                raise _Interrupted(signals.signum)
            stats = dict(producer.stats)
    except _Interrupted as stop:
        return 128 + stop.signum
    elapsed = time.perf_counter() - started
    summary = {"topic": args.topic, "records": count, "seconds": round(elapsed, 4),
               "records_per_s": round(count / elapsed, 1) if elapsed > 0 else None,
               "batches": stats["batches"], "retries": stats["retries"], "duplicates": stats["duplicates"]}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"produced {count} record(s) to {args.topic} in {elapsed:.3f}s "
              f"({summary['records_per_s']} records/s, {stats['batches']} batches)")
    return 0


def _produce_synthetic(producer: Any, args: argparse.Namespace, key: bytes | None, signals: _Signals) -> int:
    """Send ``--count`` records of ``--size`` bytes, or fewer if a signal comes: how many were sent."""
    value = b"x" * args.size
    sent = 0
    if key is None and args.partition is None:
        while sent < args.count and signals.signum is None:
            n = min(args.count - sent, args.batch_size)
            producer.send_many(args.topic, [value] * n)
            sent += n
    else:
        while sent < args.count and signals.signum is None:
            producer.send(args.topic, value, key=key, partition=args.partition)
            sent += 1
    return sent


def _produce_lines(producer: Any, args: argparse.Namespace, key: bytes | None,
                   signals: _Signals) -> tuple[int, bytes]:
    """Send each line of stdin as it comes, until its end or a signal: (lines sent, the
    unfinished line a signal cut off). Reading never waits past the producer's linger
    deadline, so a line is sent within ``--linger-ms`` even when no other line follows."""
    stdin = sys.stdin.buffer.fileno()
    sent = 0
    partial: list[bytes] = []  # the start of a line whose newline has not come yet
    while signals.signum is None:
        deadline = producer.linger_deadline()
        if deadline is not None:
            timeout: float | None = max(0.0, deadline - time.monotonic())
        else:  # with batches in flight, poll takes in their replies and resends what failed
            timeout = 0.05 if producer.in_flight_records else None
        ready, _, _ = select.select([stdin, signals.fd], [], [], timeout)
        if signals.signum is not None:
            break  # what is on stdin now, its end too, is not read
        if signals.fd in ready:  # another signal with a handler of its own: empty the pipe, or it stays readable
            os.read(signals.fd, 4096)
        if stdin in ready:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:  # the end of input: a last line without its newline is a line too
                if partial:
                    producer.send(args.topic, b"".join(partial), key=key, partition=args.partition)
                    sent += 1
                    partial = []
                break
            *lines, rest = chunk.split(b"\n")
            if lines:
                lines[0] = b"".join(partial) + lines[0]
                partial = []
                for line in lines:
                    producer.send(args.topic, line, key=key, partition=args.partition)
                sent += len(lines)
            if rest:
                partial.append(rest)
        producer.poll()
    return sent, b"".join(partial)


def _report_interrupted(producer: Any, sent: int, unfinished: bytes, signum: int) -> None:
    """Flush what was sent to the producer, for a few seconds, and say on stderr what came of it."""
    failed = ""
    try:
        producer.flush(timeout=INTERRUPTED_FLUSH_S)
    except RequestTimeout:
        pass
    except ZBrokerError as err:  # a batch failed for good; the client library logged why
        failed = f" ({err.message})"
    except KeyboardInterrupt:  # a second Ctrl-C: say what is known now
        pass
    acked = producer.stats["records"]
    unanswered = producer.in_flight_records
    said = (f"zbroker produce: stopped by {signal.Signals(signum).name}: {acked} record(s) acknowledged, "
            f"{sent - acked - unanswered} not sent{failed}")
    if unanswered:
        said += f", {unanswered} sent without an answer (they may be stored)"
    if unfinished:
        # A signal stops the reading: what follows the last whole line read (this part of a
        # line, and the input not read yet) is not sent.
        said += f"; the input after the last whole line read was not sent ({len(unfinished)} bytes of it were read)"
    print(said, file=sys.stderr)


def cmd_fetch(args: argparse.Namespace) -> int:
    from zbroker.client import Connection, fetch
    conn = Connection(args.broker)
    try:
        offset = args.offset
        printed = 0
        while args.max is None or printed < args.max:
            records, _start, end = fetch(conn, args.topic, args.partition, offset, max_wait_ms=0)
            if not records:
                break
            for rec in records:
                if args.max is not None and printed >= args.max:
                    break
                print(json.dumps(_record_json(rec)) if args.json else
                      f"{rec.partition}@{rec.offset} key={_shown(rec.key)} value={_shown(rec.value)}")
                printed += 1
                offset = rec.offset + 1
            if offset >= end:
                break
    finally:
        conn.close()
    return 0


def cmd_consume(args: argparse.Namespace) -> int:
    # SIGTERM (a service manager, `timeout`) stops it after the record in hand: the
    # acks of what was printed go, and the member leaves the group instead of holding
    # its partitions until its session times out.
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))
    try:
        return _consume(args, terminated)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _join(args: argparse.Namespace, backoff: Any, terminated: list[int], give_up_at: float | None) -> Any:
    """The Consumer, which joins the group when made. A coordinator restarting (UNAVAILABLE
    while it loads the stored offsets, a TIMEOUT) is waited out as in the consume loop,
    until SIGTERM (None) or Ctrl-C, or ``give_up_at`` (``--timeout``), when the error is raised."""
    from zbroker.client import Consumer
    while not terminated:
        try:
            consumer = Consumer(args.broker, group=args.group, topics=[args.topic])
        except ZBrokerError as err:
            if err.retriable and give_up_at is not None and time.monotonic() + backoff.delay > give_up_at:
                raise
            backoff.wait_or_raise(err, "join", group=args.group)
        else:
            backoff.reset()
            return consumer
    return None


def _consume(args: argparse.Namespace, terminated: list[int]) -> int:
    from zbroker.client.sync import RetryBackoff
    consumed = 0
    idle_deadline = time.monotonic() + args.timeout if args.timeout is not None else None
    backoff = RetryBackoff()
    consumer = _join(args, backoff, terminated, idle_deadline)
    if consumer is None:
        return 128 + signal.SIGTERM
    if args.timeout is not None:
        idle_deadline = time.monotonic() + args.timeout
    with consumer:
        while (args.max is None or consumed < args.max) and not terminated:
            want = 500 if args.max is None else min(500, args.max - consumed)
            try:
                records = consumer.poll(max_records=want, timeout=0.5)
            except ZBrokerError as err:  # the coordinator restarting: wait for it, as a service would
                backoff.wait_or_raise(err, "poll", group=args.group)
                records = []
            else:
                backoff.reset()
            if not records:
                if idle_deadline is not None and time.monotonic() >= idle_deadline:
                    break
                continue
            if args.timeout is not None:
                idle_deadline = time.monotonic() + args.timeout
            for rec in records:
                print(json.dumps(_record_json(rec)) if args.json else
                      f"{rec.partition}@{rec.offset} key={_shown(rec.key)} value={_shown(rec.value)}", flush=True)
                try:
                    consumer.ack(rec)  # acked once printed
                except ZBrokerError as err:  # held, and sent again with the next request
                    backoff.log_or_raise(err, "ack", group=args.group)
                consumed += 1
                if terminated:
                    break  # the rest of this poll's records are redelivered
        for _attempt in range(5):  # the last acks: a coordinator restarting gets a few seconds
            try:
                consumer.flush_acks()
                break
            except ZBrokerError as err:
                backoff.wait_or_raise(err, "flush_acks", group=args.group)
    return 128 + signal.SIGTERM if terminated else 0


def cmd_groups(args: argparse.Namespace) -> int:
    from zbroker.client import Admin
    with Admin(args.broker) as admin:
        if args.groups_cmd == "list":
            groups = admin.list_groups()
            if args.json:
                print(json.dumps(groups))
            else:
                _print_table(groups, ["group", "mode", "members", "generation"])
        elif args.groups_cmd == "configure":
            fields = {"mode": args.mode, "ack_timeout_ms": None if args.ack_timeout is None else int(args.ack_timeout * 1000),
                      "max_deliveries": args.max_deliveries, "max_in_flight": args.max_in_flight, "dlq": args.dlq,
                      "start": args.start, "quarantine_after": args.quarantine_after, "max_keys": args.max_keys}
            config = admin.configure_group(args.group, **{k: v for k, v in fields.items() if v is not None})
            print(json.dumps(config) if args.json else f"group {args.group}: {json.dumps(config)}")
        elif args.groups_cmd == "describe":
            group = admin.describe_group(args.group)
            if args.json:
                print(json.dumps(group))
            else:
                _print_group(group)
        elif args.groups_cmd == "quarantine":
            keys = admin.list_quarantine(args.group)
            if args.json:
                print(json.dumps(keys))
            elif not keys:
                print(f"group {args.group}: no quarantined keys")
            else:
                _print_table(keys, ["topic", "partition", "key_hash", "first_offset", "held", "age_ms", "failures",
                                    "reason"])
        elif args.groups_cmd == "release":
            released = admin.release_key(args.group, key=args.key, key_hash=args.key_hash, topic=args.topic,
                                         to_dlq=args.to_dlq)
            if args.json:
                print(json.dumps(released))
            elif not released:
                print(f"group {args.group}: that key is not quarantined")
            else:
                where = "to the dead-letter topic" if args.to_dlq else "to flow again"
                for row in released:
                    print(f"released {row['topic']}/{row['partition']} key_hash {row['key_hash']} {where}"
                          + (f" ({row['records']} records)" if args.to_dlq else ""))
        elif args.groups_cmd == "reset":
            if args.to_datetime is not None:
                result = admin.reset_group_to_time(args.group, args.topic, args.to_datetime)
            else:
                result = admin.reset_group(args.group, args.topic, args.to)  # checked by _reset_target
            print(json.dumps(result) if args.json else
                  f"reset {args.group} on {args.topic} (epoch {result['reset_epoch']}): {result['partitions']}")
        elif args.groups_cmd == "delete":
            result = admin.delete_group(args.group)
            print(json.dumps(result) if args.json else
                  f"deleted group {args.group} (offsets of {len(result['partitions'])} partition(s) removed)")
    return 0


def _print_group(group: dict) -> None:
    members = group.get("members", [])
    print(f"group {group.get('group')}  mode {group.get('mode')}  generation {group.get('generation')}  "
          f"members {len(members)}")
    for member in members:
        print(f"  member {member}")
    rows = []
    for p in group.get("partitions", []):
        blocker = p.get("blocker") or {}
        rows.append({**p, "blocker": f"{blocker.get('offset')} {blocker.get('state')} {blocker.get('member') or ''}"
                     .strip() if blocker else ""})
    _print_table(rows, ["topic", "partition", "committed", "log_end", "lag", "in_flight",
                        "oldest_unfinished_age_ms", "redeliveries", "dead_letters", "blocker"])


def cmd_status(args: argparse.Namespace) -> int:
    """Exit status 0 when the broker is healthy, 1 when not: usable as a health check."""
    from zbroker.client import Admin
    offsets = args.offsets or os.environ.get("ZBROKER_OFFSETS")
    try:
        with Admin(args.broker) as admin:
            status = admin.status()
            reached = admin.conn.url if offsets else None  # the node a SQLite cluster of one is
    except ZBrokerError:
        if offsets:  # no node answers (mid-failover, say): what the store says is still worth showing
            _print_cluster(_read_cluster(offsets, None), as_json=args.json)
        raise
    cluster = status.get("cluster")  # a coordinator that reports its cluster itself
    if cluster is None and offsets:
        cluster = _read_cluster(offsets, reached)
    if cluster is not None:
        status["cluster"] = cluster
    # Unhealthy too when some partition cannot be served: its actor is dead and still
    # owns it, or alive and unable to open it. A dead actor that owns nothing (stopped
    # on purpose) is listed until it is forgotten, but harms no one.
    unserved = [a for a in status["actors"] if a["kind"] == "partition-log"
                and (a.get("not_open_count") or (not a.get("alive", a.get("healthy")) and a.get("partitions")))]
    under = status.get("under_replicated") or []
    healthy = bool(status["healthy"]) and not unserved and not any(u["below_min_insync"] for u in under)
    if args.json:
        print(json.dumps(status))
        return 0 if healthy else 1
    rows = [{"kind": a["kind"], "actor_id": a.get("actor_id"), "pid": a.get("pid"), "endpoint": a.get("endpoint") or "",
             "healthy": a.get("healthy"), "partitions": len(a.get("partitions", []) or []),
             "not_open": a.get("not_open_count", "")} for a in status["actors"]]
    print(f"broker {'healthy' if healthy else 'UNHEALTHY'}")
    if cluster is not None:
        _print_cluster(cluster)
    _print_table(rows, ["kind", "actor_id", "pid", "endpoint", "healthy", "partitions", "not_open"])
    for a in status["actors"]:
        listed = a.get("not_open") or []
        if not a.get("not_open_count"):
            continue
        print(f"\n{a.get('actor_id')} has not opened {a['not_open_count']} of its partitions "
              f"(their clients get NOT_OWNER until it does):")
        for topic, partition, reason in listed:
            print(f"  {topic}/{partition}: {reason}")
        if a["not_open_count"] > len(listed):
            print(f"  ... and {a['not_open_count'] - len(listed)} more")
    if under:
        print("\nunder-replicated partitions (below min_insync: produce refused; no leader: unavailable):")
        _print_table([{"partition": f"{u['topic']}/{u['partition']}", "leader": u["leader"] or "NONE",
                       "isr": ",".join(u["isr"]), "replicas": ",".join(u["replicas"]), "min_insync": u["min_insync"],
                       "state": "OFFLINE" if u["offline"] else "BELOW MIN" if u["below_min_insync"] else "degraded"}
                      for u in under], ["partition", "leader", "isr", "replicas", "min_insync", "state"])
    return 0 if healthy else 1


def _read_cluster(offsets: str, reached: str | None) -> dict:
    import asyncio

    from zbroker.storage.offsets.cluster_view import read_cluster_view
    return asyncio.run(read_cluster_view(offsets, endpoint=reached))


def _ms(value: int | None) -> str:
    return "" if value is None else f"{value / 1000:.1f} s" if value >= 10_000 else f"{value} ms"


def _print_cluster(cluster: dict, as_json: bool = False) -> None:
    """Who leads, at which epoch, the lease's age (by the database's clock), and every node known."""
    if as_json:
        print(json.dumps({"cluster": cluster}))
        return
    leader = cluster.get("leader")
    if cluster.get("cluster_of_one"):
        print(f"cluster of one ({cluster.get('backend')}): {(leader or {}).get('endpoint') or 'this node'} leads")
        return
    if leader is None:
        print("cluster: no node has taken the coordinator lease yet")
    else:
        state = "EXPIRED (a standby takes over at its next ask)" if leader["expired"] \
            else f"expires in {_ms(leader['remaining_ms'])}"
        print(f"cluster: {leader['node_id']} ({leader['endpoint']}) leads at epoch {leader['epoch']}; "
              f"lease renewed {_ms(leader['lease_age_ms'])} ago, held {_ms(leader['held_for_ms'])}, {state}")
    nodes = cluster.get("nodes") or []
    if nodes:
        _print_table([{"node": n["node_id"], "endpoint": n["endpoint"] or "", "role": "leader" if n["leading"]
                       else "not leading", "last_epoch": n["last_epoch"] if n["last_epoch"] is not None else "",
                       "epochs_taken": n["epochs_taken"], "last_led": _ms(n["last_taken_ms_ago"]) + " ago"
                       if n["last_taken_ms_ago"] is not None else ""} for n in nodes],
                     ["node", "endpoint", "role", "last_epoch", "epochs_taken", "last_led"])
    if cluster.get("source") == "store":
        print("(nodes that led at least once, from the store's epoch history; a node that never led is not listed)")
    print()


# -- parser ---------------------------------------------------------------------------------------

def _number(convert: Callable[[str], Any], name: str, low: float, high: float | None = None) -> Callable:
    """An argparse type: ``convert(text)``, finite, from ``low`` (to ``high``). argparse
    names the function in what it says of text that does not convert, so it is named
    in words: "invalid non-negative integer value: 'abc'"."""
    def parse(text: str) -> Any:
        value = convert(text)
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {low} or more, not {text}" if high is None else
                                             f"must be from {low} to {high}, not {text}")
        return value
    parse.__name__ = name
    return parse


_positive = _number(int, "positive integer", 1)
_non_negative = _number(int, "non-negative integer", 0)
_non_negative_number = _number(float, "non-negative number", 0)
# max_in_flight and max_deliveries: >= 1, up to 2^64 - 1 (docs/PROTOCOL.md, configure_group)
_group_limit = _number(int, "positive integer", 1, (1 << 64) - 1)
_lease_seconds = _number(float, "number of seconds", 0.001, MAX_LEASE_MS // 1000)  # ack_timeout_ms: >= 1, <= 12 h


def _reset_target(text: str) -> str | int:
    if text in ("earliest", "latest"):
        return text
    try:
        return _non_negative(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be earliest, latest or an offset, not {text!r}") from None


def _datetime_ms(text: str) -> int:
    """An ISO 8601 time as wall-clock milliseconds; one without a zone is UTC."""
    import datetime
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an ISO 8601 time such as 2026-12-01T21:00:00Z, "
                                         f"not {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    ms = int(when.timestamp() * 1000)
    if ms < 0:
        raise argparse.ArgumentTypeError(f"must not be before 1970, not {text!r}")
    return ms


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zbroker", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # Every command that talks to a broker takes these, before or after its subcommand.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--broker", default=DEFAULT_URL, help="coordinator URL, or several separated by commas (env ZBROKER_URL)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    # The copies after a sub-subcommand (`topics list --json`) set nothing when absent, so
    # that they do not overwrite what was given before it (`topics --json list`).
    inner = argparse.ArgumentParser(add_help=False)
    inner.add_argument("--broker", default=argparse.SUPPRESS, help="coordinator URL, or several separated by commas (env ZBROKER_URL)")
    inner.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")

    def client_cmd(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, parents=[common])

    up = sub.add_parser("up", help="run a single-node broker in the foreground")
    up.add_argument("--data", default="./data", help="data directory (default ./data)")
    up.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 for all, "
                    "with --advertise-host)")
    up.add_argument("--advertise-host", default=None, metavar="HOST",
                    help="name or address clients and other hosts dial (default: --host)")
    up.add_argument("--port", type=_positive, default=7400, help="coordinator port; partition actors use the next ones")
    up.add_argument("--partition-actors", type=_positive, default=1)
    up.add_argument("--fsync", default="interval:1000", help="always | never | interval:MS (default interval:1000)")
    up.add_argument("--offsets", default=None, help="sqlite:///path (default <data>/offsets.sqlite3) or postgresql://…")
    up.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info")
    up.add_argument("--curve", default=None, metavar="DIR", help="CurveZMQ keys (see `zbroker keygen`); off by default")
    up.add_argument("--http", default=None, metavar="HOST:PORT",
                    help="the console actor's /metrics and web console (default: the --host at --port + 80, "
                         "loopback for a wildcard host); off to run none")
    up.add_argument("--http-token", default=None, metavar="TOKEN",
                    help="bearer token the console asks for (env ZBROKER_HTTP_TOKEN); needed off loopback")
    up.add_argument("--rack", default=None, metavar="NAME", help="rack of the built-in partition actors")
    up.add_argument("--actor-dirs", action="store_true",
                    help="each built-in partition actor on its own data directory (<data>/partitions for p0, "
                         "<data>/partitions-p<i> for the others), so replicas can sit on several; replicas on "
                         "one host do not survive that host's loss")
    up.add_argument("--unclean-leader-election", action="store_true",
                    help="let a replica outside the ISR lead when the whole ISR is gone: available again, "
                         "but LOSING acknowledged records")
    up.add_argument("--replica-lag-ms", type=_positive, default=10_000, metavar="MS",
                    help="a follower of a built-in actor this long behind its leader is proposed out of the ISR")
    # Renewed every 1,000 ms and given up 500 ms early (leadership.py): shorter than 2,000
    # would leave no renewal inside a lease.
    up.add_argument("--coordinator-lease-ms", type=_number(int, "integer", 2_000, 600_000), default=5_000, metavar="MS",
                    help="with --offsets postgresql://...: the leading node's coordinator lease, renewed every "
                         "second by the database clock; a standby takes over this long after the leader is lost")
    up.set_defaults(func=cmd_up)

    part = sub.add_parser("partition", help="start an extra partition-log actor that joins a broker")
    part.add_argument("--coordinator", "--broker", dest="broker", default=DEFAULT_URL, metavar="URL[,URL...]",
                      help="the broker's URL, or a cluster's node URLs separated by commas: the actor "
                           "registers with the leading node and follows it when it changes")
    part.add_argument("--data", default="./data/partitions", help="partition data directory")
    part.add_argument("--bind", default="tcp://127.0.0.1:0", help="data-plane endpoint (port 0 = any free port)")
    part.add_argument("--advertise-host", default=None, metavar="HOST",
                      help="name or address clients dial for this actor (default: the host of --bind)")
    part.add_argument("--actor-id", default=None)
    part.add_argument("--fsync", default="interval:1000")
    part.add_argument("--replica-lag-ms", type=int, default=10_000, metavar="MS",
                      help="a follower this long behind the leader's log end is proposed out of the ISR")
    part.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info")
    part.add_argument("--curve", default=None, metavar="DIR", help="the broker's CurveZMQ key directory")
    part.add_argument("--rack", default=None, metavar="NAME",
                      help="failure domain of this actor: replicas of a partition are spread over racks first")
    part.set_defaults(func=cmd_partition)

    keys = sub.add_parser("keygen", help="create CurveZMQ keys: the broker's pair and one pair per client")
    keys.add_argument("dir")
    keys.add_argument("--client", action="append", default=[], help="client name (repeat for more)")
    keys.set_defaults(func=cmd_keygen)

    topics = client_cmd("topics", "create, list and describe topics")
    tsub = topics.add_subparsers(dest="topics_cmd", required=True)
    create = tsub.add_parser("create", parents=[inner])
    create.add_argument("name")
    create.add_argument("--partitions", type=_positive, default=1)
    create.add_argument("--segment-bytes", type=int)
    create.add_argument("--retention-bytes", type=int)
    create.add_argument("--retention-ms", type=int)
    create.add_argument("--replication-factor", type=_positive, default=1,
                        help="replicas per partition, on actors with distinct data directories (default 1)")
    create.add_argument("--min-insync", type=_positive, default=None,
                        help="replicas that must hold a record before it is acknowledged (default min(2, R))")
    tsub.add_parser("list", parents=[inner])
    describe = tsub.add_parser("describe", parents=[inner])
    describe.add_argument("name")
    reassign = tsub.add_parser("reassign", parents=[inner], help="move a replicated partition's replicas online")
    reassign.add_argument("name")
    reassign.add_argument("--partition", type=_non_negative, required=True)
    reassign.add_argument("--replicas", required=True, help="actor ids, comma-separated, preferred leader first")
    reassign.add_argument("--no-wait", action="store_true", help="start the move and return")
    reassign.add_argument("--timeout", type=_non_negative_number, default=300.0,
                          help="seconds to follow the move (default 300)")
    alter = tsub.add_parser("alter", parents=[inner], help="grow partitions, change retention")
    alter.add_argument("name")
    alter.add_argument("--partitions", type=_positive, help="new partition count (grow only)")
    alter.add_argument("--retention-ms", type=int, help="-1 = unlimited")
    alter.add_argument("--retention-bytes", type=int, help="per partition; -1 = unlimited")
    tdelete = tsub.add_parser("delete", parents=[inner],
                              help="delete a topic no live consumer reads: its logs and its groups' offsets")
    tdelete.add_argument("name")
    topics.set_defaults(func=cmd_topics)

    produce = client_cmd("produce", "produce lines from stdin, or synthetic records")
    produce.add_argument("topic")
    produce.add_argument("--count", type=_positive, help="produce N synthetic records instead of reading stdin")
    produce.add_argument("--size", type=_non_negative, default=100, help="bytes per synthetic record")
    produce.add_argument("--key", default=None)
    produce.add_argument("--partition", type=_non_negative, default=None)
    produce.add_argument("--linger-ms", type=_non_negative_number, default=5.0,
                         help="the longest a record waits for its batch to fill (default 5)")
    produce.add_argument("--batch-size", type=_positive, default=1000)
    produce.set_defaults(func=cmd_produce)

    fetch = client_cmd("fetch", "read records of one partition from an offset")
    fetch.add_argument("topic")
    fetch.add_argument("--partition", type=_non_negative, required=True)
    fetch.add_argument("--offset", type=_non_negative, default=0)
    fetch.add_argument("--max", type=_positive, default=None)
    fetch.set_defaults(func=cmd_fetch)

    consume = client_cmd("consume", "consume as a group member, acking each record once printed")
    consume.add_argument("topic")
    consume.add_argument("--group", required=True)
    consume.add_argument("--max", type=_positive, default=None)
    consume.add_argument("--timeout", type=_non_negative_number, default=None,
                         help="stop after this many idle seconds (0: at the first poll that finds nothing)")
    consume.set_defaults(func=cmd_consume)

    groups = client_cmd("groups", "list, configure, describe and reset consumer groups")
    gsub = groups.add_subparsers(dest="groups_cmd", required=True)
    gsub.add_parser("list", parents=[inner])
    conf = gsub.add_parser("configure", parents=[inner])
    conf.add_argument("group")
    conf.add_argument("--mode", choices=["exclusive", "shared", "key_shared"])
    conf.add_argument("--ack-timeout", type=_lease_seconds, help="seconds (at most 43200, 12 hours)")
    conf.add_argument("--max-deliveries", type=_group_limit)
    conf.add_argument("--max-in-flight", type=_group_limit)
    conf.add_argument("--dlq")
    conf.add_argument("--start", choices=["earliest", "latest"])
    conf.add_argument("--quarantine-after", type=_non_negative,
                      help="key_shared, exclusive: park a key after N failures in a row of one record (0: never)")
    conf.add_argument("--max-keys", type=_group_limit, help="key_shared: keys in flight or held back per partition")
    quarantine = gsub.add_parser("quarantine", parents=[inner], help="list a group's quarantined keys (key_shared, exclusive)")
    quarantine.add_argument("group")
    release = gsub.add_parser("release", parents=[inner], help="release a quarantined key")
    release.add_argument("group")
    named = release.add_mutually_exclusive_group(required=True)
    named.add_argument("--key", help="the key, as text (UTF-8)")
    named.add_argument("--key-hash", type=_non_negative, help="the key's hash, as `groups quarantine` lists it")
    release.add_argument("--topic", help="only this topic (default: every topic of the group)")
    release.add_argument("--to-dlq", action="store_true",
                         help="send the key's held records to the dead-letter topic instead of delivering them")
    gdesc = gsub.add_parser("describe", parents=[inner])
    gdesc.add_argument("group")
    reset = gsub.add_parser("reset", parents=[inner])
    reset.add_argument("group")
    reset.add_argument("--topic", required=True)
    target = reset.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", type=_reset_target, help="earliest | latest | OFFSET")
    target.add_argument("--to-datetime", type=_datetime_ms, metavar="ISO8601",
                        help="the first record appended at or after this time (UTC unless it says)")
    gdelete = gsub.add_parser("delete", parents=[inner], help="delete a group without live members, and its offsets")
    gdelete.add_argument("group")
    groups.set_defaults(func=cmd_groups)

    dlq = client_cmd("dlq", "dead-letter topics")
    dsub = dlq.add_subparsers(dest="dlq_cmd", required=True)
    redrive = dsub.add_parser("redrive", parents=[inner],
                              help="move a dead-letter topic's records back to their source topics")
    redrive.add_argument("topic", help="the dead-letter topic, e.g. orders.dlq")
    redrive.add_argument("--group", default="zb-redrive",
                         help="the consumer group that reads it and remembers what went back (default zb-redrive)")
    redrive.add_argument("--max", type=_positive, default=None, help="redrive at most N records")
    dlq.set_defaults(func=cmd_dlq)

    status = client_cmd("status", "list the actors with their pids, endpoints, partitions and health; "
                                  "exit status 1 when the broker is unhealthy")
    status.add_argument("--offsets", default=None, metavar="URL",
                        help="the nodes' --offsets store (env ZBROKER_OFFSETS): show the cluster's nodes, "
                             "its leader, epoch and lease age from it, read-only")
    status.set_defaults(func=cmd_status)

    top = client_cmd("top", "a live view of topics and groups (rates, lag, in flight, blockers); q or Ctrl-C quits")
    top.add_argument("--interval", type=_non_negative_number, default=1.0, help="seconds between refreshes")
    top.add_argument("--iterations", type=_positive, default=None, help=argparse.SUPPRESS)
    top.set_defaults(func=cmd_top)
    return parser


def _client_logging() -> None:
    """The client library's log lines (a failed batch, a fetch retried) go to stderr, where
    the `error:` line goes: stdout carries only records and results, so it can be piped.
    ZBROKER_LOG_LEVEL (default warning) sets how much is shown."""
    from zbroker.actors.runtime import configure_logging  # the actors' processes configure their own
    configure_logging(os.environ.get("ZBROKER_LOG_LEVEL", "warning"))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command not in ("up", "partition"):
        _client_logging()
    try:
        code = args.func(args)
    except ZBrokerError as err:
        print(f"error: {err.code.value}: {err.message}" + (f" {json.dumps(err.data, default=str)}" if err.data else ""),
              file=sys.stderr)
        code = 1
    except BrokenPipeError:
        code = 0
    except (OSError, ValueError) as err:  # a key file that is missing or not a key, say
        print(f"error: CONFIG: {err}", file=sys.stderr)
        code = 1
    except zmq.ZMQError as err:  # `zbroker partition --bind` to an address in use, say
        print(f"error: CONFIG: {err}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


__all__ = ["main", "build_parser"]
