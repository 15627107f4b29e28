"""The replicated chaos run: three simulated hosts, a topic at R = 3 (M = 2), and a host nemesis.

Theory of operation
-------------------
The broker (`zbroker up`: coordinator, commit writer, one built-in partition
actor) runs on 127.0.0.1 and keeps its offsets in PostgreSQL. Three hosts
(tests/chaos/hosts.py) each run one `zbroker partition` actor on 127.0.0.2,
.3 and .4 with a data directory of its own, reached through a network link
(a `TcpProxy`) the test owns. The topic is created at R = 3, M = 2 and every
partition's replica set is then moved onto the three hosts, one leader each
(the built-in actor holds nothing). The producers and consumers of
`ChaosRun` run throughout: a produce at R = 3 is acknowledged only once the
high watermark covers it.

The nemesis does one fault at a time, heals it, and waits (bounded) until
every partition's ISR holds all three hosts again before the next, so that
no fault ever meets a second one that R = 3, M = 2 is not built to survive
(two lost disks at once lose what only they had). Its faults, drawn from the
seeded RNG:

* ``kill-host``: SIGKILL a host, restart it on the same disk 0.5–6 s later;
* ``kill-host-wipe``: SIGKILL a host, delete its data directory, restart it
  on an empty disk (it rebuilds from the leaders);
* ``wipe-restart``: stop a host cleanly (SIGTERM), delete its data, restart;
* ``cut-leader``: cut a leader's network link (reset or blackhole) for 1–8 s,
  past ``--replica-lag-ms`` at times: its followers cannot fetch, fewer
  than M keep up (the ISR itself stops at M), produce is refused until the
  link heals;
* ``pause-leader``: SIGSTOP a leader until the controller has elected a new
  leader for every partition it led (the registration lapses after 5 s),
  then SIGCONT it: it must acknowledge nothing more (its followers refuse
  its epoch).

After the nemesis, producers stop and consumers drain (as in `ChaosRun`);
the run then waits until every replica is in the ISR at the high watermark,
stops the hosts cleanly and reads every replica's log from its data
directory: record id and a digest of the stored batch bytes at each offset.
The checker (tests/chaos/checker.py) judges those with the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
from pathlib import Path
from typing import Any

from tests.chaos.checker import History, LeaderSample, ReplicaEntry
from tests.chaos.hosts import Host
from tests.chaos.nemesis import HEAL_TIMEOUT_S, OneFaultAtATime
from tests.chaos.workload import ChaosConfig, ChaosRun, record_id_of, save_history, HISTORY_FILE

BUILTIN_ACTORS = 1  # `zbroker up` needs one; it is moved out of every replica set
REPLACED_TIMEOUT_S = 45.0  # ... and on waiting for a paused leader's replacement
FAULTS = {"kill-host": 3, "kill-host-wipe": 2, "wipe-restart": 1, "cut-leader": 3, "pause-leader": 2}


@dataclasses.dataclass
class ReplicatedChaosConfig(ChaosConfig):
    partitions: int = 3
    hosts: int = 3
    replication_factor: int = 3
    min_insync: int = 2
    replica_lag_ms: int = 2000
    fsync: str = "interval:1000"
    host_down_s: tuple[float, float] = (0.5, 6.0)
    link_cut_s: tuple[float, float] = (1.0, 8.0)
    nemesis_gap_s: tuple[float, float] = (0.5, 3.0)
    drain_timeout_s: float = 120.0
    host_log_level: str = "warning"  # ZBROKER_CHAOS_HOST_LOG=info for the replication events


class ReplicatedChaosRun(OneFaultAtATime, ChaosRun):
    FAULTS = FAULTS
    NOT_HEALED = "the ISR did not fill up again"

    def __init__(self, config: ReplicatedChaosConfig, broker: Any, proxy: Any, pg_dsn: str, schema: str,
                 workdir: Path, *, actors: Any, log=print) -> None:
        super().__init__(config, broker, proxy, pg_dsn, schema, workdir, actors=actors, log=log)
        root = workdir / "hosts"
        root.mkdir(parents=True, exist_ok=True)
        self.hosts = [Host(i, broker.url, root, replica_lag_ms=config.replica_lag_ms, fsync=config.fsync,
                           log_level=config.host_log_level) for i in range(config.hosts)]
        self.machines = self.hosts
        self.leadership: list[LeaderSample] = []
        self.stats.update({f"fault {k}": 0 for k in FAULTS})
        self.stats.update(heal_waits=0, heal_timeouts=0, heal_s_max=0.0, pause_replaced=0,
                          pause_not_replaced=0, crashes=[])

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        try:
            super().close()
        finally:
            for host in self.hosts:
                host.close()

    def remember_actors(self) -> None:
        """(Called throughout the nemesis and the drain: a crashed host is revived here too.)"""
        self.revive_crashed()
        super().remember_actors()
        for host in self.hosts:
            if host.pid is not None:
                self.actors.remember(host.pid)

    def setup(self) -> None:
        from tests.support.waiting import wait_for
        from zbroker.client import Admin

        cfg = self.config
        for host in self.hosts:
            host.start()
        self.remember_actors()
        names = [h.name for h in self.hosts]
        with Admin(self.url) as admin:
            wait_for(lambda: self._registered(admin) >= set(names), HEAL_TIMEOUT_S, "every host to register")
            admin.create_topic(cfg.topic, partitions=cfg.partitions, replication_factor=cfg.replication_factor,
                               min_insync=cfg.min_insync)
            targets = {p: names[p % len(names):] + names[:p % len(names)] for p in range(cfg.partitions)}
            for p, target in targets.items():
                admin.reassign_partition(cfg.topic, p, target[:cfg.replication_factor])
            wait_for(lambda: all(row["replicas"] == targets[row["partition"]][:cfg.replication_factor]
                                 and sorted(row["isr"]) == sorted(row["replicas"])
                                 for row in admin.describe_topic(cfg.topic)["partitions"]),
                     HEAL_TIMEOUT_S, "the replica sets to move onto the hosts")
            admin.configure_group(cfg.group, ack_timeout_ms=cfg.ack_timeout_ms, max_deliveries=1000)

    @staticmethod
    def _registered(admin) -> set[str]:
        return {a["actor_id"] for a in admin.status()["actors"]
                if a.get("kind") == "partition-log" and a.get("healthy")}

    # -- what the controller says -----------------------------------------------------------

    def partitions(self, admin) -> list[dict] | None:
        from zbroker.protocol.errors import ZBrokerError
        try:
            rows = admin.describe_topic(self.config.topic)["partitions"]
        except ZBrokerError:
            return None
        t = time.monotonic_ns()
        with self._lock:
            self.leadership.extend(LeaderSample(t, r["partition"], r.get("leader"), r.get("leader_epoch", 0),
                                                tuple(r.get("isr", ())), r.get("high_watermark"))
                                   for r in rows)
        return rows

    def healed(self, admin) -> bool:
        self.revive_crashed()
        rows = self.partitions(admin)
        return rows is not None and all(r.get("leader") and sorted(r["isr"]) == sorted(r["replicas"])
                                        for r in rows)

    def leader_host(self, admin, rng: random.Random) -> Host | None:
        rows = self.partitions(admin) or []
        leaders = [r["leader"] for r in rows if r.get("leader")]
        if not leaders:
            return None
        name = rng.choice(leaders)
        return next((h for h in self.hosts if h.name == name), None)

    # -- nemesis ----------------------------------------------------------------------------

    def _fault(self, kind: str, admin, rng: random.Random) -> None:
        cfg = self.config
        if kind in ("kill-host", "kill-host-wipe", "wipe-restart"):
            host = rng.choice(self.hosts)
            if kind == "wipe-restart":
                host.stop()
                self.event("stop-host", host.name, "SIGTERM")
            else:
                pid = host.kill()
                self.event("kill-host", host.name, f"pid {pid}")
            if kind != "kill-host":
                host.wipe()
                self.event("wipe-disk", host.name)
            self._stop_nemesis.wait(rng.uniform(*cfg.host_down_s))
            host.start()
            self.event("start-host", host.name, "empty disk" if kind != "kill-host" else "same disk")
        elif kind == "cut-leader":
            host = self.leader_host(admin, rng)
            if host is None:
                return
            mode = rng.choice(("reset", "blackhole"))
            host.link.cut(mode)
            self.event("cut-link", host.name, mode)
            self._stop_nemesis.wait(rng.uniform(*cfg.link_cut_s))
            host.link.restore()
            self.event("heal-link", host.name)
        elif kind == "pause-leader":
            host = self.leader_host(admin, rng)
            if host is None or not host.running:
                return
            led = {r["partition"]: r["leader_epoch"] for r in self.partitions(admin) or []
                   if r.get("leader") == host.name}
            host.pause()
            self.event("pause-host", host.name, f"led {sorted(led)}")
            replaced = self._wait_replaced(admin, host.name, led)
            self.stats["pause_replaced" if replaced else "pause_not_replaced"] += 1
            self._stop_nemesis.wait(rng.uniform(0.0, 2.0))  # the zombie sleeps on past its replacement
            host.resume()
            self.event("resume-host", host.name, "replaced" if replaced else "NOT replaced")

    def _wait_replaced(self, admin, name: str, led: dict[int, int]) -> bool:
        deadline = time.monotonic() + REPLACED_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop_nemesis.is_set():
            rows = self.partitions(admin) or []
            if rows and all(r["leader"] != name and r["leader_epoch"] > led[r["partition"]]
                            for r in rows if r["partition"] in led):
                return True
            self._stop_nemesis.wait(0.2)
        return False

    # -- sampler: the controller's view too -------------------------------------------------

    def _sample_describe(self, admin):
        admin = super()._sample_describe(admin)
        self.partitions(admin)
        return admin

    # -- after the run ----------------------------------------------------------------------

    def settle(self) -> dict[int, dict]:
        """Wait (bounded) until every replica is in the ISR at the high watermark; the final rows."""
        from zbroker.client import Admin

        deadline = time.monotonic() + HEAL_TIMEOUT_S
        rows: list[dict] = []
        with Admin(self.url, request_timeout=2.0) as admin:
            while time.monotonic() < deadline:
                self.revive_crashed()
                rows = self.partitions(admin) or rows
                if rows and all(sorted(r["isr"]) == sorted(r["replicas"]) and
                                all(end == r["high_watermark"] for end in r["replica_log_ends"].values())
                                for r in rows):
                    self.stats["settled"] = True
                    break
                time.sleep(0.2)
            else:
                self.stats["settled"] = False
        return {r["partition"]: r for r in rows}

    def read_replica_logs(self) -> dict[str, dict[int, list[ReplicaEntry]]]:
        """Every host's log of every partition, from its data directory (the hosts are stopped)."""
        import logging

        import structlog

        saved = structlog.get_config()
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        try:  # (opening a log says so at info, once per partition and host)
            return {host.name: {p: read_replica_log(host.data / "logs" / self.config.topic / str(p),
                                                    self.config.topic, p)
                                for p in range(self.config.partitions)}
                    for host in self.hosts}
        finally:
            structlog.configure(**saved)

    def history(self) -> History:
        final = self.settle()
        history = super().history()  # also reads the logs through the broker, from the leaders
        for host in self.hosts:
            host.stop()
        history.replica_logs = self.read_replica_logs()
        # Every replica's high watermark, as far as the controller vouches for it: the leader's
        # for the ISR members (a follower's is at most the leader's), none for the others.
        history.replica_hw = {h.name: {p: (row["high_watermark"] if h.name in row["isr"] else 0)
                                       for p, row in final.items()} for h in self.hosts}
        history.min_insync = self.config.min_insync
        history.leadership = list(self.leadership)
        history.meta.update(self.stats)
        save_history(history, self.workdir / HISTORY_FILE)
        return history


def read_replica_log(directory: Path, topic: str, partition: int) -> list[ReplicaEntry]:
    """Record id and stored-batch digest at every offset of one replica's log (empty if it has none)."""
    from zbroker.protocol.batch import decode_fetched, iter_stored_batches
    from zbroker.storage.log.partition_log import LogConfig, PartitionLog

    entries: list[ReplicaEntry] = []
    if not directory.is_dir():
        return entries
    with PartitionLog.open(directory, LogConfig(), now_ms=int(time.time() * 1000)) as plog:
        assert plog.log_start == 0, f"{directory} lost its head: log start {plog.log_start}"
        offset = 0
        while offset < plog.log_end:
            blob = memoryview(plog.read(offset, 1 << 20))
            pos = 0
            for header, _payload in iter_stored_batches(blob):
                stored = blob[pos:pos + header.total_size]
                pos += header.total_size
                digest = hashlib.blake2b(stored, digest_size=8).hexdigest()
                entries += [ReplicaEntry(record_id_of(r.value), digest)
                            for r in decode_fetched(stored, topic, partition) if r.offset >= offset]
                offset = header.base_offset + header.record_count
    return entries
