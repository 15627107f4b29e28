"""The chaos workload: producers, consumers, a nemesis and a sampler around a real broker.

Theory of operation
-------------------
Everything that can crash runs in its own process; everything that watches
runs in the test process.

* Producer processes (multiprocessing spawn) send records whose value starts
  with a unique id (``<id>|padding``) to explicit partitions, flush, and then
  journal ``A id partition offset time`` for every record whose offset came
  back, ``X id partition time`` for every one that did not.
* Consumer processes poll as members of one group, journal every new
  generation they see (``J time member generation``) and what a poll handed
  them (``R time polled-at p:start-end,...``), and for each record journal
  ``F id partition offset time`` before they ack it. Each batch is finished
  in two randomly shuffled halves with an ack flush in between (sometimes
  with a pause of up to 0.8 s), so acks arrive out of order and the
  coordinator keeps, and stores, holes above the committed offset.
* The nemesis thread, at random moments drawn from the seeded RNG, SIGKILLs
  an actor by name, or two at once (the supervisor restarts them), SIGKILLs a consumer (and
  starts a replacement), or cuts the PostgreSQL connection of the commit
  writer at the `TcpProxy` (reset or blackhole) and restores it later.
* The sampler thread reads the ``consumer_group_offsets`` table directly (not
  through the proxy) and ``describe_group`` every ~200 ms.

Journals are plain appends to an fd without fsync: a SIGKILL does not lose
what the page cache holds, and the machine does not crash in this test. All
times are ``time.monotonic_ns()``, one clock for all processes on Linux.

The seed makes the nemesis schedule, the workload's choices and the
processes' RNGs replayable (``ZBROKER_CHAOS_SEED``); the interleaving with
the operating system's scheduling is, of course, not.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from tests.chaos.checker import (CommitSample, ConsumerFinish, Delivery, EpochTaken, History, LeaderSample,
                                 NemesisEvent, ProducerAck, ReplicaEntry, StoredWrite, check)

HISTORY_FILE = "chaos-history.json.gz"
ID_SPACE = 1_000_000_000  # record id = producer index * ID_SPACE + sequence
ACTORS = ("coordinator", "commit-writer", "partition-0", "partition-1")


@dataclasses.dataclass
class ChaosConfig:
    duration_s: float = 180.0
    seed: int = 0
    topic: str = "chaos"
    group: str = "chaos-workers"
    partitions: int = 4
    producers: int = 2
    consumers: int = 3
    records_per_s: float = 60.0  # per producer
    session_timeout_ms: int = 4000
    ack_timeout_ms: int = 10_000
    nemesis_gap_s: tuple[float, float] = (0.5, 3.0)  # pause between two nemesis actions
    pg_cut_s: tuple[float, float] = (0.5, 8.0)
    sample_every_s: float = 0.2
    drain_timeout_s: float = 75.0


# ============================================================================================
# Journals
# ============================================================================================

class Journal:
    """Append-only lines on a raw fd: one write() per call, no user-space buffer to lose."""

    def __init__(self, path: str | Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, lines: list[str]) -> None:
        if lines:
            os.write(self.fd, "".join(lines).encode())

    def close(self) -> None:
        os.close(self.fd)


class JournalReader:
    """Reads a journal incrementally; a line is taken only once its newline is there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.stem
        self._pos = 0
        self._partial = b""
        self.acks: list[ProducerAck] = []
        self.failures = 0
        self.finishes: list[ConsumerFinish] = []
        self.deliveries: list[Delivery] = []
        self.rebalances: list[NemesisEvent] = []

    def poll(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                data = f.read()
        except FileNotFoundError:
            return
        self._pos += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            self._parse(line.decode())

    def _parse(self, line: str) -> None:
        kind, _, rest = line.partition(" ")
        f = rest.split(" ")
        if kind == "F":
            self.finishes.append(ConsumerFinish(int(f[0]), int(f[1]), int(f[2]), int(f[3]), self.name))
        elif kind == "A":
            self.acks.append(ProducerAck(int(f[0]), int(f[1]), int(f[2]), int(f[3])))
        elif kind == "X":
            self.failures += 1
        elif kind == "J":
            self.rebalances.append(NemesisEvent(int(f[0]), "rebalance", self.name, f"{f[1]} generation {f[2]}"))
        elif kind == "R":
            t, polled = int(f[0]), int(f[1])
            for item in f[2].split(","):
                p, _, span = item.partition(":")
                start, _, end = span.partition("-")
                for o in range(int(start), int(end)):
                    self.deliveries.append(Delivery(self.name, int(p), o, t, polled))


def record_value(record_id: int, rng: random.Random) -> bytes:
    return b"%d|" % record_id + b"x" * rng.randrange(0, 64)


def record_id_of(value: bytes) -> int | None:
    head, sep, _ = value.partition(b"|")
    return int(head) if sep and head.isdigit() else None


class LeaseClock:
    """The earliest time each record a consumer holds can have been leased to it.

    A poll() can hand out records of a lease granted before it was called: the reply
    to a Poll sent ahead at the end of an earlier poll() (poll-ahead, lease-ahead), or
    kept in flight past a poll() that returned empty, and records of a lease held back
    by an earlier poll()'s max_records; and an ahead lease (lease-ahead) is granted
    before the records it covers exist. Dated by the poll() that handed them out, a
    redelivery granted before the offset was durably finished looked like one granted
    after it (the checker's "deliveries of an offset already durably finished").
    Each Poll is dated by the start of the poll() call that sent it (it was in flight
    after that call and not before), and each lease by the Poll it came with: an
    ahead lease when the consumer files it, before any of its records arrive."""

    def __init__(self) -> None:
        self._in_flight: Any = None  # the Poll in flight after the last call (the flow's object)
        self._in_flight_sent_ns = 0  # the start of the poll() call that sent it
        self._granted_after_ns = 0  # for leases first seen in the last call
        self._lease_ns: dict[tuple[int, int], int] = {}  # (partition, lease id) -> leased after

    def polled(self, started_ns: int, in_flight_before: Any, in_flight_after: Any,
               ahead_leases: dict | None = None) -> None:
        """A poll() call that started at ``started_ns`` ended; the flow's Poll in flight before and
        after, and the ahead leases the consumer holds now (`ConsumerCore.ahead_leases`)."""
        carried = in_flight_before is not None and in_flight_before is self._in_flight
        self._granted_after_ns = min(started_ns, self._in_flight_sent_ns) if carried else started_ns
        for (_topic, partition), held in (ahead_leases or {}).items():
            for lease_id, _position, _end in held:
                self._lease_ns.setdefault((partition, lease_id), self._granted_after_ns)
        if in_flight_after is None:
            self._in_flight = None
        elif in_flight_after is not in_flight_before or not carried:
            self._in_flight, self._in_flight_sent_ns = in_flight_after, started_ns

    def group(self, records: list) -> dict[int, list]:
        """The records of the last call, by the earliest time their lease can have been granted."""
        groups: dict[int, list] = {}
        for r in records:
            leased_after = self._lease_ns.setdefault((r.partition, r.lease_id), self._granted_after_ns)
            groups.setdefault(leased_after, []).append(r)
        return groups


def _ranges(records: list) -> str:
    """'p:start-end,...' for a poll's records (offsets folded into runs)."""
    runs: list[list[int]] = []
    for p, o in sorted((r.partition, r.offset) for r in records):
        if runs and runs[-1][0] == p and runs[-1][2] == o:
            runs[-1][2] = o + 1
        else:
            runs.append([p, o, o + 1])
    return ",".join(f"{p}:{s}-{e}" for p, s, e in runs)


# ============================================================================================
# Process mains (multiprocessing spawn targets)
# ============================================================================================

def _quiet_logging() -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


def producer_main(url: str, topic: str, partitions: int, index: int, journal_path: str, stop: Any,
                  seed: int, records_per_s: float) -> None:
    """Send uniquely numbered records until `stop`; journal what was acknowledged
    (a record's partition is the one its handle names)."""
    from zbroker.client import Producer

    _quiet_logging()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng = random.Random(seed)
    journal = Journal(journal_path)
    seq = 0
    producer = None
    next_at = time.monotonic()
    while not stop.is_set():
        if producer is None:
            try:
                producer = Producer(url, linger_ms=2, request_timeout=2.0, retries=40)
            except Exception:  # the coordinator may be down: try again
                time.sleep(0.2)
                continue
        sent: list[tuple[int, int, Any]] = []
        broken = False
        # Half the rounds send key-less records (the producer's fast path: the sticky
        # partition's open batch), half to a partition picked per record.
        keyless = rng.random() < 0.5
        try:
            for _ in range(rng.randint(5, 25)):
                seq += 1
                rid = index * ID_SPACE + seq
                p = -1 if keyless else rng.randrange(partitions)
                sent.append((rid, p, None))
                handle = producer.send(topic, record_value(rid, rng), partition=None if keyless else p)
                sent[-1] = (rid, handle.partition if keyless else p, handle)
            producer.flush(timeout=30)
        except Exception:  # out of retries, or zmq trouble: a fresh producer (and producer id) next
            broken = True
        t = time.monotonic_ns()
        lines = []
        for rid, p, handle in sent:
            if handle is not None and handle.offset is not None and handle.partition == p:
                lines.append(f"A {rid} {p} {handle.offset} {t}\n")
            else:
                lines.append(f"X {rid} {p} {t}\n")
        journal.write(lines)
        if broken:
            try:
                producer.conn.close()
            except Exception:
                pass
            producer = None
        next_at += len(sent) / records_per_s
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.monotonic()
    if producer is not None:
        try:
            producer.conn.close()
        except Exception:
            pass
    journal.close()


def consumer_main(url: str, topic: str, group: str, journal_path: str, stop: Any, seed: int,
                  session_timeout_ms: int) -> None:
    """Poll, journal, ack until `stop` (or SIGKILL)."""
    from zbroker.client import Consumer

    _quiet_logging()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng = random.Random(seed)
    journal = Journal(journal_path)
    consumer = None
    failures = 0
    membership: tuple = ()
    leases = LeaseClock()
    while not stop.is_set():
        try:
            if consumer is None:
                # Half of the consumers hold ahead leases once caught up (Consumer(lease_ahead=True)).
                consumer = Consumer(url, group=group, topics=[topic], session_timeout_ms=session_timeout_ms,
                                    request_timeout=2.0, ack_interval_ms=5, lease_ahead=rng.random() < 0.5)
                leases = LeaseClock()
            polled = time.monotonic_ns()
            in_flight_before = consumer.flow.poll_in_flight
            try:
                records = consumer.poll(max_records=rng.choice((10, 50, 100)), timeout=0.5)
            finally:
                leases.polled(polled, in_flight_before, consumer.flow.poll_in_flight, consumer.core.ahead_leases)
            failures = 0
            if (consumer.member_id, consumer.generation) != membership:
                membership = (consumer.member_id, consumer.generation)
                journal.write([f"J {time.monotonic_ns()} {membership[0]} {membership[1]}\n"])
            if not records:
                continue
            now = time.monotonic_ns()
            journal.write([f"R {now} {leased_after} {_ranges(part)}\n"
                           for leased_after, part in leases.group(records).items()])
            rng.shuffle(records)
            cut = rng.randrange(len(records) + 1)
            for i, part in enumerate((records[:cut], records[cut:])):
                if not part:
                    continue
                if i == 1 and rng.random() < 0.15:
                    time.sleep(rng.uniform(0.1, 0.8))  # a slow record: the acks above it become holes
                elif rng.random() < 0.2:
                    time.sleep(rng.uniform(0, 0.05))  # "processing"
                lines, finished = [], []
                t = time.monotonic_ns()
                for r in part:
                    rid = record_id_of(r.value)
                    if rid is not None:
                        lines.append(f"F {rid} {r.partition} {r.offset} {t}\n")
                    finished.append(r)
                journal.write(lines)  # finished, journaled ... and only then acked
                for r in finished:
                    consumer.ack(r)
                consumer.flush_acks(wait=False)
        except Exception:  # coordinator restarting, fenced, timed out: carry on (5 in a row: a new member)
            failures += 1
            if consumer is not None and failures >= 5:
                try:
                    consumer.close(leave=False)
                except Exception:
                    consumer.conn.close()
                consumer = None
                failures = 0
            time.sleep(rng.uniform(0.05, 0.3))
    if consumer is not None:
        try:
            consumer.close()
        except Exception:
            pass
    journal.close()


# ============================================================================================
# The run, seen from the test process
# ============================================================================================

class Reaper:
    """Remembers every process we started or learned about, to kill leftovers by pid + start time."""

    def __init__(self) -> None:
        self._known: dict[int, float] = {}
        self._lock = threading.Lock()

    def remember(self, pid: int) -> None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return
        with self._lock:
            self._known[pid] = created

    def kill_all(self) -> list[int]:
        killed = []
        with self._lock:
            known = dict(self._known)
        for pid, created in known.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    killed.append(pid)
            except psutil.Error:
                pass
        return killed


@dataclasses.dataclass
class Worker:
    name: str
    kind: str  # "producer" | "consumer"
    process: Any
    journal: Path


class ChaosRun:
    """One chaos run against a started broker. Use as a context manager: exit kills everything it started."""

    def __init__(self, config: ChaosConfig, broker: Any, proxy: Any, pg_dsn: str, schema: str, workdir: Path,
                 *, actors: Reaper, log=print) -> None:
        self.config = config
        self.broker = broker
        self.url = broker.url
        self.proxy = proxy
        self.pg_dsn = pg_dsn
        self.schema = schema
        self.workdir = workdir
        self.journals = workdir / "journals"
        self.journals.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.rng = random.Random(config.seed)
        self.ctx = multiprocessing.get_context("spawn")
        self.reaper = Reaper()  # our producers and consumers
        self.actors = actors  # the broker's processes: killed (if still there) after the broker stopped
        self.workers: list[Worker] = []
        self.producer_stop = self.ctx.Event()
        self.consumer_stop = self.ctx.Event()
        self.events: list[NemesisEvent] = []
        self.samples: list[CommitSample] = []
        self._lock = threading.Lock()
        self._stop_nemesis = threading.Event()
        self._stop_sampler = threading.Event()
        self._threads: list[threading.Thread] = []
        self._consumer_seq = 0
        self.readers: dict[str, JournalReader] = {}
        self.origin_ns = time.monotonic_ns()
        self.stats: dict[str, Any] = {"nemesis_actions": 0, "kill_skipped": 0, "drain_s": None,
                                      "drained": False}

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> "ChaosRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._stop_nemesis.set()
        self._stop_sampler.set()
        for t in self._threads:
            t.join(timeout=15)
        self.producer_stop.set()
        self.consumer_stop.set()
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
            w.process.join(5)
        self.reaper.kill_all()
        if self.proxy.mode != "forward":
            self.proxy.restore()

    def event(self, kind: str, target: str, detail: str = "") -> None:
        ev = NemesisEvent(time.monotonic_ns(), kind, target, detail)
        with self._lock:
            self.events.append(ev)

    # -- workers ----------------------------------------------------------------------------

    def start_producer(self, index: int) -> Worker:
        name = f"producer-{index}"
        journal = self.journals / f"{name}.journal"
        proc = self.ctx.Process(target=producer_main, name=name, daemon=True,
                                args=(self.url, self.config.topic, self.config.partitions, index, str(journal),
                                      self.producer_stop, self.rng.randrange(1 << 32),
                                      self.config.records_per_s))
        proc.start()
        self.reaper.remember(proc.pid)
        w = Worker(name, "producer", proc, journal)
        self.workers.append(w)
        return w

    def start_consumer(self) -> Worker:
        self._consumer_seq += 1
        name = f"consumer-{self._consumer_seq}"
        journal = self.journals / f"{name}.journal"
        proc = self.ctx.Process(target=consumer_main, name=name, daemon=True,
                                args=(self.url, self.config.topic, self.config.group, str(journal),
                                      self.consumer_stop, self.rng.randrange(1 << 32),
                                      self.config.session_timeout_ms))
        proc.start()
        self.reaper.remember(proc.pid)
        w = Worker(name, "consumer", proc, journal)
        self.workers.append(w)
        self.event("start-consumer", name)
        return w

    def live(self, kind: str) -> list[Worker]:
        return [w for w in self.workers if w.kind == kind and w.process.is_alive()]

    def remember_actors(self) -> None:
        for pid in self.broker.pids().values():
            self.actors.remember(pid)

    # -- setup ------------------------------------------------------------------------------

    def setup(self) -> None:
        from zbroker.client import Admin

        self.remember_actors()
        with Admin(self.url) as admin:
            admin.create_topic(self.config.topic, partitions=self.config.partitions)
            admin.configure_group(self.config.group, ack_timeout_ms=self.config.ack_timeout_ms,
                                  max_deliveries=1000)

    # -- nemesis ----------------------------------------------------------------------------

    def _nemesis(self) -> None:
        cfg = self.config
        rng = random.Random(self.rng.randrange(1 << 32))
        end = time.monotonic() + cfg.duration_s
        restore_at: float | None = None
        pending_starts: list[float] = []
        next_action = time.monotonic() + rng.uniform(*cfg.nemesis_gap_s)
        choices = ["kill-actor"] * 4 + ["kill-two-actors"] + ["kill-consumer"] * 2 + ["pg-cut"] * 2
        while not self._stop_nemesis.is_set():
            now = time.monotonic()
            if now >= end:
                break
            if restore_at is not None and now >= restore_at:
                self.proxy.restore()
                self.event("pg-restore", "postgresql")
                restore_at = None
            for due in [d for d in pending_starts if d <= now]:
                pending_starts.remove(due)
                self.start_consumer()
            if now >= next_action:
                action = rng.choice(choices)
                self.stats["nemesis_actions"] += 1
                if action in ("kill-actor", "kill-two-actors"):
                    targets = rng.sample(ACTORS, 1 if action == "kill-actor" else 2)
                    for target in targets:
                        try:
                            pid = self.broker.kill(target)
                        except (KeyError, ProcessLookupError):
                            self.stats["kill_skipped"] += 1  # down already, waiting for its restart
                        else:
                            self.event("kill-actor", target, f"pid {pid}" + (" (with another)" if
                                                                               len(targets) > 1 else ""))
                elif action == "kill-consumer":
                    live = self.live("consumer")
                    if live:
                        victim = rng.choice(live)
                        os.kill(victim.process.pid, signal.SIGKILL)
                        victim.process.join(5)
                        self.event("kill-consumer", victim.name, f"pid {victim.process.pid}")
                        pending_starts.append(now + rng.uniform(0.0, 2.0))
                elif action == "pg-cut" and restore_at is None:
                    mode = rng.choice(("reset", "blackhole"))
                    self.proxy.cut(mode)
                    self.event("pg-cut", "postgresql", mode)
                    restore_at = now + rng.uniform(*cfg.pg_cut_s)
                next_action = now + rng.uniform(*cfg.nemesis_gap_s)
            self.remember_actors()
            waits = [next_action, end] + pending_starts + ([restore_at] if restore_at else [])
            self._stop_nemesis.wait(max(0.0, min(waits) - time.monotonic()))
        # The storm is over: heal what it left behind.
        if self.proxy.mode != "forward":
            self.proxy.restore()
            self.event("pg-restore", "postgresql")
        for _ in pending_starts:
            self.start_consumer()

    # -- sampler ----------------------------------------------------------------------------

    def _sampler(self) -> None:
        from tests.support.pg import PgSession
        from zbroker.client import Admin

        cfg = self.config
        pg: PgSession | None = None
        admin = Admin(self.url, request_timeout=1.0)
        try:
            while not self._stop_sampler.is_set():
                started = time.monotonic()
                pg = self._sample_pg(pg)
                admin = self._sample_describe(admin)
                self._stop_sampler.wait(max(0.0, cfg.sample_every_s - (time.monotonic() - started)))
        finally:
            admin.close()
            if pg is not None:
                try:
                    pg.close()
                except Exception:
                    pass

    def sample_once(self) -> None:
        """One synchronous round of both samples (after the drain)."""
        from zbroker.client import Admin

        pg = self._sample_pg(None)
        if pg is not None:
            pg.close()
        self._sample_describe(Admin(self.url, request_timeout=2.0)).close()

    def _sample_pg(self, pg):
        """Read the offsets table directly (not through the proxy); returns the session to reuse."""
        from tests.support.pg import PgSession

        try:
            if pg is None:
                pg = PgSession(self.pg_dsn, timeout=5.0)
            rows = pg.fetch(f'SELECT group_id, topic, partition, committed_offset, holes::text '
                            f'FROM "{self.schema}".consumer_group_offsets')
        except Exception as exc:
            if pg is not None and "does not exist" not in str(exc):
                try:
                    pg.close()
                except Exception:
                    pass
                pg = None
            return pg
        t = time.monotonic_ns()
        new = [CommitSample(t, "pg", r[0], r[1], r[2], r[3], tuple(tuple(h) for h in json.loads(r[4])))
               for r in rows]
        with self._lock:
            self.samples.extend(new)
        return pg

    def _sample_describe(self, admin):
        from zbroker.protocol.errors import ZBrokerError
        from zbroker.client import Admin

        try:
            group = admin.describe_group(self.config.group)
        except ZBrokerError:
            return admin
        except Exception:  # a broken socket: start a fresh client
            admin.close()
            return Admin(self.url, request_timeout=1.0)
        t = time.monotonic_ns()
        new = []
        for p in group["partitions"]:
            if p["topic"] != self.config.topic:
                continue
            new.append(CommitSample(t, "describe", group["group"], p["topic"], p["partition"], p["committed"]))
            new.append(CommitSample(t, "describe_pending", group["group"], p["topic"], p["partition"],
                                    p["committed_pending"]))
        with self._lock:
            self.samples.extend(new)
        return admin

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> History:
        cfg = self.config
        self.setup()
        self.log(f"chaos: seed {cfg.seed}, {cfg.duration_s:.0f} s of nemesis, broker {self.url}, "
                 f"workdir {self.workdir}")
        for i in range(cfg.consumers):
            self.start_consumer()
        for i in range(cfg.producers):
            self.start_producer(i + 1)
        sampler = threading.Thread(target=self._sampler, name="chaos-sampler", daemon=True)
        nemesis = threading.Thread(target=self._nemesis, name="chaos-nemesis", daemon=True)
        self._threads = [sampler, nemesis]
        sampler.start()
        nemesis.start()
        nemesis.join()
        self.log(f"chaos: nemesis done after {self.stats['nemesis_actions']} actions; draining")
        self.drain()
        self.sample_once()
        self._stop_sampler.set()
        sampler.join(15)
        self.stop_consumers()
        return self.history()

    def stop_producers(self) -> None:
        self.producer_stop.set()
        for w in self.workers:
            if w.kind == "producer":
                w.process.join(40)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(5)

    def stop_consumers(self) -> None:
        self.consumer_stop.set()
        for w in self.workers:
            if w.kind == "consumer":
                w.process.join(10)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(5)

    def read_journals(self) -> None:
        for w in self.workers:
            reader = self.readers.get(w.name)
            if reader is None:
                reader = self.readers[w.name] = JournalReader(w.journal)
            reader.poll()

    def drain(self) -> None:
        """Stop producing, keep consuming until every acked record is finished and committed == log end."""
        from zbroker.protocol.errors import ZBrokerError
        from zbroker.client import Admin

        cfg = self.config
        started = time.monotonic()
        self.stop_producers()
        while len(self.live("consumer")) < cfg.consumers:
            self.start_consumer()
        deadline = started + cfg.drain_timeout_s
        admin = Admin(self.url, request_timeout=2.0)
        last_state = None
        try:
            while time.monotonic() < deadline:
                self.remember_actors()
                if len(self.live("consumer")) < cfg.consumers:  # one that died on its own, too
                    self.start_consumer()
                self.read_journals()
                acked = {a.record_id for r in self.readers.values() for a in r.acks}
                finished = {f.record_id for r in self.readers.values() for f in r.finishes}
                unfinished = len(acked - finished)
                try:
                    group = admin.describe_group(cfg.group)
                    topic = admin.describe_topic(cfg.topic)
                except ZBrokerError as err:
                    last_state = f"describe failed: {err}"
                    time.sleep(0.5)
                    continue
                ends = {p["partition"]: p["log_end"] for p in topic["partitions"]}
                committed = {p["partition"]: p["committed"] for p in group["partitions"]
                             if p["topic"] == cfg.topic}
                with self._lock:
                    pg_latest = {s.partition: s.committed for s in self.samples
                                 if s.source == "pg" and s.topic == cfg.topic and s.group == cfg.group}
                last_state = (f"{unfinished} acked records unfinished; log ends {ends}; "
                              f"committed (describe) {committed}; committed (pg) {pg_latest}")
                if unfinished == 0 and all(committed.get(p) == e and pg_latest.get(p) == e
                                           for p, e in ends.items()):
                    self.stats["drained"] = True
                    break
                time.sleep(0.5)
        finally:
            admin.close()
        self.stats["drain_s"] = round(time.monotonic() - started, 1)
        self.stats["drain_state"] = last_state
        self.log(f"chaos: drain {'complete' if self.stats['drained'] else 'INCOMPLETE'} after "
                 f"{self.stats['drain_s']} s: {last_state}")

    def read_logs(self) -> dict[int, list[int | None]]:
        from zbroker.client import fetch
        from zbroker.client.sync import Connection

        logs: dict[int, list[int | None]] = {}
        conn = Connection(self.url, request_timeout=5.0)
        try:
            for p in range(self.config.partitions):
                ids: list[int | None] = []
                end = None
                while end is None or len(ids) < end:
                    records, start, log_end = fetch(conn, self.config.topic, p, len(ids), max_bytes=1 << 20)
                    assert start == 0, f"partition {p} lost its head: log start {start}"
                    end = log_end if end is None else end
                    if not records:
                        break
                    for r in records:
                        assert r.offset == len(ids), f"partition {p}: offset {r.offset} where {len(ids)} was due"
                        ids.append(record_id_of(r.value))
                logs[p] = ids
        finally:
            conn.close()
        return logs

    def history(self) -> History:
        self.read_journals()
        logs = self.read_logs()
        acks, finishes, deliveries, failures = [], [], [], 0
        events = list(self.events)
        for r in self.readers.values():
            events += r.rebalances
            acks += r.acks
            finishes += r.finishes
            deliveries += r.deliveries
            failures += r.failures
        history = History(topic=self.config.topic, group=self.config.group, log=logs, acks=acks,
                          finishes=finishes, samples=list(self.samples), events=events, deliveries=deliveries,
                          produce_failures=failures,
                          meta={"seed": self.config.seed, "duration_s": self.config.duration_s,
                                "origin_ns": self.origin_ns, "config": dataclasses.asdict(self.config),
                                **self.stats})
        save_history(history, self.workdir / HISTORY_FILE)
        return history


# ============================================================================================
# Keeping a history, to check it again later: python -m tests.chaos.workload <dir or file>
# ============================================================================================

_ITEMS = {"acks": ProducerAck, "finishes": ConsumerFinish, "samples": CommitSample, "events": NemesisEvent,
          "deliveries": Delivery, "leadership": LeaderSample, "epochs": EpochTaken, "stored_writes": StoredWrite}


def save_history(history: History, path: Path) -> None:
    data = {"topic": history.topic, "group": history.group, "produce_failures": history.produce_failures,
            "meta": history.meta, "log": {str(p): ids for p, ids in history.log.items()},
            "min_insync": history.min_insync,
            "replica_hw": {r: {str(p): hw for p, hw in hws.items()} for r, hws in history.replica_hw.items()},
            "replica_logs": {r: {str(p): [[e.record_id, e.batch_digest] for e in entries]
                                 for p, entries in logs.items()} for r, logs in history.replica_logs.items()}}
    for name, cls in _ITEMS.items():
        data[name] = [dataclasses.astuple(x) for x in getattr(history, name)]
    with gzip.open(path, "wt") as f:
        json.dump(data, f, separators=(",", ":"))


def load_history(path: Path) -> History:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    items = {}
    for name, cls in _ITEMS.items():
        if cls is CommitSample:
            items[name] = [cls(*x[:-1], tuple(tuple(h) for h in x[-1])) for x in data[name]]
        elif cls is LeaderSample:
            items[name] = [cls(*x[:4], tuple(x[4]), x[5]) for x in data.get(name, [])]
        else:
            items[name] = [cls(*x) for x in data.get(name, [])]  # (older files lack the cluster's)
    return History(topic=data["topic"], group=data["group"], produce_failures=data["produce_failures"],
                   meta=data["meta"], log={int(p): ids for p, ids in data["log"].items()},
                   min_insync=data.get("min_insync", 0),
                   replica_hw={r: {int(p): hw for p, hw in hws.items()} for r, hws in data.get("replica_hw", {}).items()},
                   replica_logs={r: {int(p): [ReplicaEntry(*e) for e in entries] for p, entries in logs.items()}
                                 for r, logs in data.get("replica_logs", {}).items()},
                   **items)


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    report = check(load_history(target / HISTORY_FILE if target.is_dir() else target))
    print(report.to_table())
    sys.exit(0 if report.ok else 1)
