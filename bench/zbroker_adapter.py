"""zbroker through its own Python client.

Written against the API planned in issue #5 (below); the client and
supervisor now provide it, and a `--scale 0.05` smoke run went through every
workload. If `zbroker.client` or `zbroker.supervisor` cannot be imported,
`check()` raises Skipped("client not available: ...") and every zbroker row
of the report says so instead of the run crashing.

    from zbroker.client import Admin, Producer, Consumer
    from zbroker.supervisor import start_broker
    start_broker(data_dir, *, port=0, partition_actors=1, fsync="interval:1000", offsets_url=None)
        -> handle with .url, .pids(), .stop()

Each broker this adapter starts gets its own temporary data directory,
removed when the broker stops. Server CPU is summed over every process of
the broker: the `zbroker up` process tree plus every pid `handle.pids()`
lists (a list, or the supervisor's name -> pid map), minus this process.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import statistics
import tempfile
import time
import traceback
import uuid
from typing import Any, Callable

from bench.adapter import Adapter, Phase, ProduceSpec, Skipped
from bench.latency import LatencyRecorder, Pacer, PublisherProcess, paced_loop, stamp
from bench.procstat import CpuSample, cpu_delta, with_descendants

CHUNK = 1000
# Records per produce request: half the 1,000-record window, so two batches are in
# flight and the client encodes one while the partition actor writes the other.
log = logging.getLogger("bench")

# With 1,000-record batches the window holds one and every batch waits a round trip.
PRODUCE_BATCH = 500
# The consumers lease their next batch while they ack the current one (see
# zbroker.client.Consumer, poll_ahead), read the records ahead (the default) and,
# once caught up, hold an ahead lease so a new record needs no poll (lease_ahead).
CONSUMER_OPTIONS = {"poll_ahead": True, "lease_ahead": True}
FSYNC_INTERVAL = "interval:1000"
# The latency publisher lingers 1 ms, as a Kafka producer would (Kafka 4.0's
# default is 5 ms): at 5,000 records/s about five records share a request, so the path
# carries a fifth of the messages. The stamp is taken before `send`, so the
# linger is part of every measured latency. bench/PROFILE.md, "Sixth pass",
# has the linger 0 / 0.25 / 0.5 / 1 / 2 ms comparison; the harness also runs
# linger 0 beside it (the "zbroker, linger_ms=0" row).
LATENCY_LINGER_MS = 1.0
# Scale-out rows are measured this many times each, interleaved (see ZBroker.scale_out): with
# three, the median of a 0.1 s phase still moved by a fifth between full runs on one VM.
SCALE_OUT_ROUNDS = 5
# The C load generator (bench/loadgen/zbload.c) for the broker-capacity rows: the same
# window and batch as the Python rows, more records (bench.harness.CAPACITY_RECORDS_FACTOR).
LOADGEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "loadgen", "zbload")
# The partition-count table (issue #29): one topic of this many partitions on one
# partition actor, records spread round-robin, through the Python client.
PARTITION_COUNTS = (4, 64, 256, 1024)


def _client_api():
    """The planned client names, or Skipped if the client does not provide them yet."""
    try:
        from zbroker.client import Admin, Consumer, Producer
        from zbroker.supervisor import start_broker
    except ImportError as exc:
        raise Skipped(f"client not available: {exc}") from exc
    return Admin, Producer, Consumer, start_broker


class _Broker:
    """One zbroker on a temporary data directory; its log beside it, kept only if start-up fails."""

    def __init__(self, *, partition_actors: int = 1, fsync: str = FSYNC_INTERVAL) -> None:
        _, _, _, start_broker = _client_api()
        self.data_dir = tempfile.mkdtemp(prefix="zbench-")
        self.log_file = self.data_dir + ".log"
        options: dict[str, Any] = {"port": 0, "partition_actors": partition_actors, "fsync": fsync}
        if "log_file" in inspect.signature(start_broker).parameters:
            options["log_file"] = self.log_file
        try:
            self.handle = start_broker(self.data_dir, **options)
        except BaseException as exc:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            raise RuntimeError(f"{exc}; broker log: {self.log_file}: {_tail(self.log_file)}") from exc
        self.url = self.handle.url
        _default_scheduling(self.pids())

    def pids(self) -> list[int]:
        """Every process of this broker: the `zbroker up` process tree and every actor it lists."""
        listed = self.handle.pids()
        pids = list(listed.values()) if isinstance(listed, dict) else list(listed)
        root = getattr(getattr(self.handle, "process", None), "pid", None)
        if root is not None:
            pids.append(root)
        return with_descendants(pids, exclude=[os.getpid()])

    def create_topic(self, name: str, partitions: int = 1) -> str:
        Admin, _, _, _ = _client_api()
        admin = Admin(self.url)
        try:
            admin.create_topic(name, partitions=partitions)
            wait_until_open(admin, name, partitions)
        finally:
            admin.close()
        return name

    def stop(self) -> None:
        try:
            self.handle.stop()
        finally:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            if os.path.exists(self.log_file):
                os.remove(self.log_file)


def _default_scheduling(pids: list[int]) -> None:
    """Give the broker's processes the default policy if the harness runs clients otherwise.

    `--client-sched batch` is about the clients: the broker, started from the
    harness, would inherit it, and the peers' servers (started elsewhere) do not.
    Threads an actor starts later inherit from the thread reset here.
    """
    other = getattr(os, "SCHED_OTHER", None)
    if other is None or os.sched_getscheduler(0) == other:
        return
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setscheduler(int(tid), other, os.sched_param(0))
            except OSError:
                pass  # the thread ended meanwhile


def wait_until_open(admin: Any, topic: str, partitions: int, timeout_s: float = 120.0) -> None:
    """Wait until every partition of `topic` is open on its actor (each actor's own `status`).

    A partition actor opens a new topic's logs one by one, each fsynced with its
    directory: 1,024 of them took seconds on this machine's shared disk, and a
    phase started at once measured the opening (its produce requests answered
    NOT_OWNER and retried) rather than the produce path."""
    from zbroker.protocol import messages as m
    from zbroker.protocol.errors import RequestTimeout

    deadline = time.monotonic() + timeout_s
    conn = admin.conn
    while True:
        placed = conn.coordinator(m.Metadata(topics=[topic])).topics[0]["partitions"]
        endpoints = {p["endpoint"] for p in placed if p.get("endpoint")}
        opened = 0
        for endpoint in endpoints:
            try:  # an actor opening a thousand logs in one turn answers after it
                status = conn.call(endpoint, m.Status(), timeout=max(0.1, deadline - time.monotonic())).msg
            except RequestTimeout:
                break
            opened += sum(1 for row in status.actors[0]["partitions"] if row[0] == topic)
        if opened >= partitions:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{opened} of {partitions} partitions of {topic} open after {timeout_s} s")
        time.sleep(0.05)


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(none)"


def _produce(url: str, topic: str, count: int, payload: bytes, spec: ProduceSpec, phase: Phase,
             round_robin: int = 0) -> None:
    """`round_robin` = P sends record i to partition i % P (the partition-count table)."""
    _, Producer, _, _ = _client_api()
    if spec.batched:
        producer = Producer(url, linger_ms=2, batch_size=min(PRODUCE_BATCH, spec.window),
                            max_in_flight_records=spec.window)
    else:
        producer = Producer(url, linger_ms=0, batch_size=1, max_in_flight_records=spec.window)
    try:
        phase.begin()
        sent = 0
        send = producer.send
        while sent < count and not phase.expired:
            n = min(CHUNK, count - sent)
            if spec.bulk:
                producer.send_many(topic, [payload] * n)
            elif round_robin:
                for i in range(sent, sent + n):
                    send(topic, payload, partition=i % round_robin)
            else:  # one call per record, as an application sends and as the peers' rows do
                for _ in range(n):
                    send(topic, payload)
            sent += n
            phase.advance(n)  # sent; flush() below waits until every one is acknowledged
        producer.flush()
        phase.end()
    finally:
        producer.close()


def _consume(url: str, topic: str, group: str, count: int, phase: Phase,
             recorder: LatencyRecorder | None = None, on_joined: Callable[[], None] | None = None) -> None:
    """Poll and ack `count` records. `on_joined` runs after the first poll (the consumer is
    then a group member), so a publisher started there cannot race the join."""
    _, _, Consumer, _ = _client_api()
    consumer = Consumer(url, group=group, topics=[topic], max_in_flight=10 * CHUNK, **CONSUMER_OPTIONS)
    ack = consumer.ack  # one ack call per record, as an application would write the loop
    try:
        phase.begin()
        while phase.records < count and not phase.expired:
            records = consumer.poll(max_records=CHUNK, timeout=0.1 if recorder else 1.0)
            if on_joined is not None:
                on_joined()
                on_joined = None
            if recorder is not None:
                now = time.time_ns()
                for record in records:
                    recorder.record(record.value, now)
                    ack(record)
            else:
                for record in records:
                    ack(record)
            phase.advance(len(records))
        consumer.flush_acks()
        phase.end()
    finally:
        consumer.close()


class ZBroker(Adapter):
    name = "zbroker"
    scale_out_rounds = SCALE_OUT_ROUNDS  # the test of the adapter runs two: each is three broker trees

    def __init__(self) -> None:
        super().__init__()
        self.run_id = uuid.uuid4().hex[:8]
        self.main_topic = f"bench-{self.run_id}"
        self.broker: _Broker | None = None
        self._active: _Broker | None = None  # whose pids the running phase samples

    def check(self) -> None:
        _client_api()
        try:
            from importlib.metadata import version

            self.version = version("zbroker")
        except Exception:
            self.version = None
        window = f"linger_ms=2, batch_size={PRODUCE_BATCH:,}, max_in_flight_records=1,000"
        self.durability = {
            "produce": f"fsync {FSYNC_INTERVAL} (ack after write() to page cache); {window}; "
                       "Producer.send() per record",
            "produce_send_many": f"as produce, through the bulk call Producer.send_many (1,000 values per call)",
            "produce_1k": f"fsync {FSYNC_INTERVAL}; {window}",
            "produce_fsync_always": f"fsync always (group commit per loop turn); {window}",
            "produce_unbatched": f"fsync {FSYNC_INTERVAL}; linger_ms=0, batch_size=1, max_in_flight_records=1,000",
            "consume_ack": "Consumer max_in_flight=10,000, poll 1,000, poll_ahead, lease_ahead, ack per record "
                           "(batched on the wire)",
            "latency": f"fsync {FSYNC_INTERVAL}; publisher linger_ms={LATENCY_LINGER_MS:g} (and a linger_ms=0 row); "
                       "consumer poll(timeout=0.1), poll_ahead, lease_ahead, ack per record",
        }

    def setup(self) -> None:
        self.broker = self._active = _Broker()
        self.broker.create_topic(self.main_topic)

    def teardown(self) -> None:
        if self.broker is not None:
            self.broker.stop()
            self.broker = self._active = None

    def server_pids(self) -> list[int]:
        return self._active.pids() if self._active is not None else []

    def _with_broker(self, action: Callable[[_Broker], Any], **broker_options: Any) -> Any:
        """Run `action` on a broker of its own (other fsync or actor count); stop it after."""
        broker = _Broker(**broker_options)
        self._active = broker
        try:
            return action(broker)
        finally:
            self._active = self.broker
            broker.stop()

    def produce(self, spec: ProduceSpec, phase: Phase) -> None:
        payload = bytes(spec.size)
        if spec.fsync == "always":
            def run(broker: _Broker) -> None:
                topic = broker.create_topic(f"{self.main_topic}-{spec.workload}")
                _produce(broker.url, topic, spec.count, payload, spec, phase)

            self._with_broker(run, fsync="always")
            return
        topic = self.main_topic
        if spec.workload != "produce":
            topic = self.broker.create_topic(f"{self.main_topic}-{spec.workload}")
        _produce(self.broker.url, topic, spec.count, payload, spec, phase)

    def prefill(self, count: int, size: int) -> None:
        phase = Phase(system=self.name, workload="prefill", target=count, timeout_s=600, server_pids=list)
        _produce(self.broker.url, self.main_topic, count, bytes(size), ProduceSpec("prefill", count, size), phase)

    def consume_ack(self, count: int, phase: Phase) -> None:
        _consume(self.broker.url, self.main_topic, f"bench-{self.run_id}", count, phase)

    def latency(self, rate: float, seconds: float, size: int, phase: Phase,
                linger_ms: float = LATENCY_LINGER_MS) -> dict[str, Any]:
        # One topic per (rate, linger): latency runs at 5,000/s and at 50,000/s against one broker.
        topic = self.broker.create_topic(f"{self.main_topic}-latency-{rate:g}-{linger_ms:g}")
        recorder = LatencyRecorder()
        publisher = PublisherProcess(paced_publisher, {"url": self.broker.url, "topic": topic, "rate": rate,
                                                       "seconds": seconds, "size": size, "linger_ms": linger_ms})
        expected = Pacer(rate, seconds, 0.0).total
        _consume(self.broker.url, topic, f"bench-{self.run_id}-latency-{rate:g}", expected, phase, recorder,
                 on_joined=publisher.start)
        return {**recorder.summary(), "publisher": {**publisher.finish(), "linger_ms": linger_ms}}

    # -- zbroker-only workloads ---------------------------------------------

    def partition_counts(self, count: int, size: int, counts: list[int],
                         make_phase: Callable[[str, int], Phase]) -> dict[str, Any]:
        """Produce then consume+ack `count` records on one topic of P partitions, for each P.

        Each P gets a new broker with one partition actor, so the rows differ in the
        partition count alone; what grows with it is messages per record (every produce
        and fetch names one partition)."""
        rows: dict[str, Any] = {}
        for partitions in counts:
            def run(broker: _Broker, partitions: int = partitions) -> dict[str, Any]:
                topic = broker.create_topic(f"{self.main_topic}-p{partitions}", partitions=partitions)
                produce = make_phase(f"partitions[{partitions}] produce", count)
                _produce(broker.url, topic, count, bytes(size), ProduceSpec("partitions", count, size), produce,
                         round_robin=partitions)
                consume = make_phase(f"partitions[{partitions}] consume_ack", count)
                _consume(broker.url, topic, f"bench-{self.run_id}-p{partitions}", count, consume)
                return {"produce": produce.result(), "consume_ack": consume.result()}

            try:
                rows[str(partitions)] = self._with_broker(run)
            except Skipped:
                raise
            except Exception as exc:  # one broken row loses that row, not the table
                log.error("partition count %d failed:\n%s", partitions, traceback.format_exc())
                failed = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
                rows[str(partitions)] = {"produce": failed, "consume_ack": failed}
        return {"rows": rows, "records": count}

    def scale_out(self, count: int, size: int, actors: list[int], clients: int,
                  make_phase: Callable[[str, int], Phase]) -> dict[str, Any]:
        """Produce then consume `count` records over 4 partitions with 1, 2, 4 partition-log actors.

        `clients` producer processes (then as many consumers, one group)
        share the partitions, so the Python client is not the only limit.
        At these rates a phase lasts a tenth of a second and one run's figures
        move by a third on a shared machine, so the rows are run
        `scale_out_rounds` times, interleaved (1, 2, 4 actors, then again), each
        on a new broker; a row reports the median and the range.
        """
        runs: dict[str, list[dict[str, Any]]] = {str(n): [] for n in actors}
        for round_no in range(self.scale_out_rounds):
            for n in actors:
                def run(broker: _Broker) -> dict[str, Any]:
                    topic = broker.create_topic(f"{self.main_topic}-scale{n}-{round_no}", partitions=4)
                    actor_pids = {name: pid for name, pid in broker.handle.pids().items()
                                  if name.startswith("partition-")}
                    one = {}
                    for role in ("produce", "consume_ack"):
                        phase = make_phase(f"scale_out[{n} actors, round {round_no + 1}] {role}", count)
                        before, after = _run_client_processes(role, broker.url, topic, count, size, clients, phase,
                                                              group=f"bench-{self.run_id}-scale{n}-{round_no}",
                                                              sample_pids=list(actor_pids.values()))
                        one[role] = phase.result()
                        one[role]["per_actor"] = _per_actor_cpu(broker, topic, count, actor_pids, before, after)
                    return one

                try:
                    runs[str(n)].append(self._with_broker(run, partition_actors=n))
                except Skipped:
                    raise
                except Exception as exc:  # one broken round loses one round, not the rows
                    log.error("scale-out with %d actors, round %d failed:\n%s", n, round_no + 1,
                              traceback.format_exc())
                    failed = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
                    runs[str(n)].append({"produce": failed, "consume_ack": failed})
        rows = {n: {role: scale_out_summary([r[role] for r in row_runs]) for role in ("produce", "consume_ack")}
                for n, row_runs in runs.items()}
        return {"partitions": 4, "client_processes": clients, "rounds": self.scale_out_rounds, "actors": rows}

    def capacity(self, count: int, size: int, make_phase: Callable[[str, int], Phase]) -> dict[str, Any]:
        """Produce then consume+ack through the C load generator: what the broker does when
        the client is not the limit. Each phase also reports the load generator's own CPU
        per record, so the table shows it is cheaper than the broker it drives."""
        import json
        import subprocess

        built = subprocess.run(["make", "-s", "-C", os.path.dirname(LOADGEN)], capture_output=True, text=True)
        if built.returncode != 0 or not os.path.exists(LOADGEN):
            raise Skipped(f"the C load generator did not build (needs gcc, libzmq3-dev, libmsgpack-dev, "
                          f"pkg-config): {(built.stderr or built.stdout).strip()[-300:]}")

        def run(broker: _Broker) -> dict[str, Any]:
            topic = broker.create_topic(f"{self.main_topic}-capacity")
            out = {}
            commands = {
                "produce": [LOADGEN, "produce", broker.url, topic, str(count), str(size), "1000", str(PRODUCE_BATCH)],
                "consume_ack": [LOADGEN, "consume", broker.url, topic, f"bench-{self.run_id}-capacity",
                                str(count), "1000"],
            }
            for role, command in commands.items():
                phase = make_phase(f"capacity {role}", count)
                phase.begin()
                done = subprocess.run(command, capture_output=True, text=True, timeout=phase.timeout_s)
                phase.end()
                if done.returncode != 0:
                    out[role] = {"status": "failed", "reason": f"zbload: {done.stderr.strip()[-300:]}"}
                    continue
                report = json.loads(done.stdout)
                phase.records = report["records"]
                result = phase.result()
                # The load generator's own clock brackets only its traffic (not its start-up).
                result["seconds"] = report["seconds"]
                result["msgs_s"] = report["records"] / report["seconds"] if report["seconds"] else None
                result["loadgen_cpu_s"] = report["cpu_s"]
                result["loadgen_cpu_us_per_record"] = report["cpu_s"] * 1e6 / max(1, report["records"])
                result["requests"] = report["requests"]
                out[role] = result
            return out

        return {"records": count, "how": "bench/loadgen/zbload (C, libzmq + msgpack-c), window 1,000, "
                                         f"{PRODUCE_BATCH} records per produce request; consume: at most 1,000 leased "
                                         "and unacknowledged, two polls of 500 out, acks as ranges on the next "
                                         "poll (or alone while both polls are out)", **self._with_broker(run)}

    def key_shared(self, count: int, make_phase: Callable[[str, int], Phase]) -> dict[str, Any]:
        """key_shared against shared, 8 consumer processes, 1,000 keys (bench.key_shared)."""
        from bench import key_shared

        def run(broker: _Broker) -> dict[str, Any]:
            topic = broker.create_topic(f"{self.main_topic}-key-shared", partitions=2)
            key_shared.prefill(broker.url, topic, count)
            return key_shared.run(broker.url, topic, count, self.run_id, make_phase)

        return self._with_broker(run)

    def redelivery(self, leases: int, phase: Phase) -> dict[str, Any]:
        """A consumer dies holding `leases` records; time until another member has them all."""
        _, _, Consumer, _ = _client_api()
        topic = self.broker.create_topic(f"{self.main_topic}-redelivery")
        group = f"bench-{self.run_id}-redelivery"
        prefill = Phase(system=self.name, workload="prefill", target=leases, timeout_s=600, server_pids=list)
        _produce(self.broker.url, topic, leases, bytes(100), ProduceSpec("prefill", leases, 100), prefill)

        mp = multiprocessing.get_context("spawn")
        holding, held = mp.Event(), mp.Queue()
        victim = mp.Process(target=_lease_holder, args=(self.broker.url, topic, group, leases, holding, held),
                            name="bench-lease-holder", daemon=True)
        victim.start()
        try:
            if not holding.wait(120):
                raise RuntimeError("the first consumer never held all its leases")
            held_keys = set(map(tuple, held.get(timeout=10)))
            survivor = Consumer(self.broker.url, group=group, topics=[topic], max_in_flight=10 * leases)
            try:
                # Join before the kill. Anything delivered now is a lease handed out twice.
                early = survivor.poll(max_records=CHUNK, timeout=0.2)
                seen: set[tuple[int, int]] = {(r.partition, r.offset) for r in early}
                victim.kill()  # SIGKILL: no leave, no ack, no goodbye
                killed_at = time.monotonic()
                phase.begin()
                phase.advance(len(seen))
                for record in early:
                    survivor.ack(record)
                duplicates = 0
                while not held_keys <= seen and not phase.expired:
                    for record in survivor.poll(max_records=CHUNK, timeout=0.5):
                        key = (record.partition, record.offset)
                        if key in seen:
                            duplicates += 1
                        else:
                            seen.add(key)
                            phase.advance()
                        survivor.ack(record)
                redelivered_after_s = time.monotonic() - killed_at
                phase.end()
                survivor.flush_acks()
            finally:
                survivor.close()
        finally:
            if victim.is_alive():
                victim.kill()
            victim.join(5)
        return {"leases": leases, "held_by_victim": len(held_keys), "all_redelivered": held_keys <= seen,
                "delivered_while_victim_alive": len(early),
                "session_timeout_ms": getattr(survivor, "session_timeout_ms", None),
                "seconds_until_all_redelivered": redelivered_after_s, "duplicates_seen": duplicates}


def scale_out_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One scale-out row for one role from its repeated runs: the median and the
    range of the rate, of the broker's CPU per record and of the busiest actor's
    CPU per million records (each run's busiest actor), and the runs themselves."""
    def figures(pick: Callable[[dict[str, Any]], float | None]) -> list[float]:
        return sorted(v for v in map(pick, used) if v is not None)

    def busiest(run: dict[str, Any]) -> float | None:
        per_actor = [a.get("cpu_s_per_million_records") for a in (run.get("per_actor") or {}).values()]
        per_actor = [f for f in per_actor if f is not None]
        return max(per_actor) if per_actor else None

    used = [r for r in runs if r.get("status", "ok") in ("ok", "timed_out")]
    out: dict[str, Any] = {"runs": runs, "runs_used": len(used),
                           "status": "ok" if used else "failed",
                           # a timed-out run still measured a rate over what it did: kept, and said
                           "runs_not_ok": [{"status": r.get("status"), "reason": r.get("reason")}
                                           for r in runs if r.get("status", "ok") != "ok"]}
    for name, pick in (("msgs_s", lambda r: r.get("msgs_s")),
                       ("server_cpu_us_per_record", lambda r: r.get("server_cpu_us_per_record")),
                       ("busiest_actor_cpu_s_per_million_records", busiest)):
        values = figures(pick)
        out[name] = statistics.median(values) if values else None
        out[f"{name}_range"] = [values[0], values[-1]] if values else None
    return out


def _per_actor_cpu(broker: _Broker, topic: str, produced: int, actor_pids: dict[str, int], before: CpuSample,
                   after: CpuSample) -> dict[str, dict[str, Any]]:
    """Each partition actor's CPU over a phase, per million records of the partitions it owns.

    The scale-out goal is about this figure: if it stays flat from 1 to 4 actors,
    adding actors adds capacity instead of coordination cost. Records per actor
    are the log ends the coordinator reports (a second at most behind the actor).
    """
    Admin, _, _, _ = _client_api()
    admin = Admin(broker.url)
    try:
        deadline = time.monotonic() + 3.0
        while True:
            parts = admin.describe_topic(topic)["partitions"]
            if sum(p["log_end"] for p in parts) >= produced or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        admin.close()
    records: dict[str, int] = {}
    for p in parts:
        name = f"partition-{str(p['actor_id'])[1:]}" if p.get("actor_id") else None
        if name in actor_pids:
            records[name] = records.get(name, 0) + p["log_end"] - p["log_start"]
    out = {}
    for name, pid in sorted(actor_pids.items()):
        delta = cpu_delta(before.only(pid), after.only(pid))
        cpu_s = delta.seconds if delta.measured else None  # an actor replaced meanwhile: unknown, not 0
        n = records.get(name, 0)
        out[name] = {"records": n, "cpu_s": cpu_s,
                     "cpu_s_per_million_records": cpu_s / n * 1e6 if n and cpu_s is not None else None}
    return out


def _lease_holder(url: str, topic: str, group: str, leases: int, holding, held) -> None:
    """Child: poll until it holds `leases` records unacked, report them, then wait to be killed."""
    from zbroker.client import Consumer

    consumer = Consumer(url, group=group, topics=[topic], max_in_flight=10 * leases)
    keys = []
    deadline = time.monotonic() + 120
    while len(keys) < leases and time.monotonic() < deadline:
        keys.extend((r.partition, r.offset) for r in consumer.poll(max_records=CHUNK, timeout=1.0))
    held.put(keys)
    holding.set()
    signal.pause()  # the parent SIGKILLs this process


def _run_client_processes(role: str, url: str, topic: str, count: int, size: int, clients: int,
                          phase: Phase, group: str, sample_pids: list[int] = ()) -> tuple[CpuSample, CpuSample]:
    """Run the clients; returns the CPU of `sample_pids` at the phase's begin and end.

    The clock covers the work only. Each client connects, says it is ready on
    its own pipe and waits for `go`; the phase begins when all are ready, so
    neither a client's start-up nor the phase's own set-up (reading /proc) is
    timed, and no client starts before the clock. Each client reports on its
    pipe again when its work is done (a producer's records acknowledged, a
    consumer's acks applied); the phase ends at the last report, not when the
    processes have exited. At several million records/s a 200,000-record phase
    lasts tens of milliseconds, about as long as a Python process takes to exit.
    A client that exits early ends the wait at once, with its exit code.
    """
    mp = multiprocessing.get_context("spawn")
    done = mp.Value("q", 0)
    go = mp.Event()
    shares = [count // clients + (1 if i < count % clients else 0) for i in range(clients)]
    reports = [mp.Pipe(duplex=False) for _ in shares]
    procs = [
        mp.Process(target=_scale_client,
                   args=(role, url, topic, share, count, size, i, clients, group, done, go, reports[i][1]),
                   name=f"bench-scale-{role}-{i}", daemon=True)
        for i, share in enumerate(shares)
    ]
    for p in procs:
        p.start()
    for _reader, writer in reports:
        writer.close()  # the child holds its own copy; the parent's would keep a dead child's pipe open
    stopped: list[multiprocessing.Process] = []
    try:
        _wait_until_ready(role, {reader: proc for (reader, _w), proc in zip(reports, procs)})
        before = CpuSample.take(sample_pids)
        phase.begin()
        go.set()
        waiting = {reader: proc for (reader, _w), proc in zip(reports, procs)}
        while waiting and not phase.expired:
            # A report, or a child that exited without one (its pipe then reads EOF).
            for reader in multiprocessing.connection.wait(list(waiting), timeout=0.2):
                try:
                    reader.recv()
                except EOFError:
                    pass  # exited early: its exit code says why, below
                del waiting[reader]
            phase.advance(done.value - phase.records)
        phase.end()
        after = CpuSample.take(sample_pids)
        for proc in waiting.values():  # past the time bound: the phase is timed out with what it did
            proc.kill()
            stopped.append(proc)
        join_by = time.monotonic() + 10
        for p in procs:
            p.join(max(0.1, join_by - time.monotonic()))
        failed = [p.exitcode for p in procs if p.exitcode not in (0, None) and p not in stopped]
        if failed:
            raise RuntimeError(f"scale-out {role} client processes exited with {failed}")
        return before, after
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        for reader, _writer in reports:
            reader.close()


def _wait_until_ready(role: str, pending: dict, timeout_s: float = 60.0) -> None:
    """Wait for every client's first report; a client that exits first fails the round at once."""
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RuntimeError(f"{len(pending)} scale-out {role} client(s) not ready within {timeout_s:g} s")
        for reader in multiprocessing.connection.wait(list(pending), timeout=remaining):
            try:
                reader.recv()
            except EOFError:
                proc = pending[reader]
                proc.join(5)
                raise RuntimeError(f"a scale-out {role} client exited before it was ready "
                                   f"(exit code {proc.exitcode})") from None
            del pending[reader]


def _connect_to_partition_actors(conn: Any, topic: str) -> None:
    """Open and test the client's connection to every actor serving `topic`.

    A client connects to a partition actor on its first request there, which
    in a phase of tens of milliseconds is a measurable part of it, and one
    that grows with the number of actors. Done before the clock starts.
    """
    from zbroker.protocol import messages as m

    conn.refresh([topic])
    endpoints = {conn.endpoint(topic, p) for p in range(conn.metadata.partitions(topic))}
    for endpoint in sorted(endpoints):
        conn.call(endpoint, m.Hello(versions=[m.PROTOCOL_VERSION], client="bench"))


def _scale_client(role: str, url: str, topic: str, share: int, total: int, size: int, index: int,
                  clients: int, group: str, done, go, report) -> None:
    """Child: a producer for partitions index, index+clients, ... or a consumer in `group`.
    Sends "ready" on `report` once connected, waits for `go`, and sends again once its
    share of the work is done."""
    from zbroker.client import Consumer, Producer

    if role == "produce":
        producer = Producer(url, linger_ms=2, batch_size=PRODUCE_BATCH, max_in_flight_records=1000)
        partitions = [p for p in range(4) if p % clients == index] or [index % 4]
        payload = bytes(size)
        _connect_to_partition_actors(producer.conn, topic)
        report.send("ready")
        go.wait()
        sent = 0
        while sent < share:
            n = min(CHUNK, share - sent)
            producer.send_many(topic, [payload] * n, partition=partitions[(sent // CHUNK) % len(partitions)])
            sent += n
        producer.flush()
        with done.get_lock():
            done.value += sent
        report.send(sent)
        producer.close()
        return
    consumer = Consumer(url, group=group, topics=[topic], max_in_flight=10 * CHUNK, **CONSUMER_OPTIONS)
    ack = consumer.ack
    _connect_to_partition_actors(consumer.conn, topic)
    report.send("ready")
    go.wait()
    while done.value < total:  # the consumers share one group: stop when it has everything
        # A short wait: a consumer whose partitions are drained notices that the others
        # finished within 5 ms, not at the end of a 100 ms poll that the phase would time.
        records = consumer.poll(max_records=CHUNK, timeout=0.005)
        for record in records:
            ack(record)
        if records:
            with done.get_lock():
                done.value += len(records)
    consumer.flush_acks()
    report.send(True)
    consumer.close()


def paced_publisher(args: dict, ready, go, results) -> None:
    """Child process: send stamped records at `rate` per second for `seconds`."""
    try:
        _, Producer, _, _ = _client_api()
        producer = Producer(args["url"], linger_ms=args["linger_ms"], batch_size=CHUNK, max_in_flight_records=1000)
        ready.set()
        go.wait()
        pacer = Pacer(args["rate"], args["seconds"], time.monotonic())

        def publish(n: int) -> None:
            for _ in range(n):
                producer.send(args["topic"], stamp(args["size"], time.time_ns()))

        def send_lingered() -> float | None:
            # The synchronous producer has no thread of its own: a batch whose
            # linger ran out between two due records goes out here, on time.
            deadline = producer.linger_deadline()
            if deadline is not None and time.monotonic() >= deadline:
                producer.poll()
                deadline = producer.linger_deadline()
            return deadline

        paced_loop(pacer, publish, service=send_lingered)
        producer.flush()
        producer.close()
        results.put({"sent": pacer.sent, "max_lag_ms": pacer.max_lag_s * 1000})
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})
