"""The cluster chaos run: three `zbroker up` nodes on one PostgreSQL schema, and a node nemesis.

Theory of operation
-------------------
Three nodes (issue 26), ``n2``, ``n3`` and ``n4``, each a whole `zbroker up`
(supervisor, coordinator, commit writer, one partition actor) bound to its own
loopback address (127.0.0.2, .3, .4) with its own ports and data directory.
Each reaches PostgreSQL through a link of its own (a `TcpProxy` the test
owns), into the one schema the test made: the lease row there decides which
node's coordinator leads, and every fenced write carries its epoch. The topic
is at R = 3, M = 2 (one replica on each node), so a node lost whole loses no
acknowledged record and the metadata writes (leaders, ISR) go on through the
faults. The producers and consumers of `ChaosRun` get the comma-separated
list of the three nodes' URLs and follow the leader on their own.

Before the workload starts, an audit trigger goes on every fenced table (in
the test's schema, never elsewhere): each insert or update records the
writer's epoch and, read in the same transaction, the lease row's epoch as
the write landed. With the rows as they stand after the run and the epoch
history, the checker proves by query that no write of an older epoch landed.

The nemesis does one fault at a time, heals it, and waits (bounded) until
every node is up, one leads, and every partition's ISR is full again, so no
fault meets a second that R = 3, M = 2 does not promise to survive:

* ``kill-leader``: SIGKILL every process of the leading node (supervisor and
  every actor: a lost host), restart it on its disk 0.5–6 s later;
* ``pause-leader``: SIGSTOP the leading node whole until another node holds
  the lease at a higher epoch (the lease, ``--coordinator-lease-ms``, runs
  out by the database's clock), then SIGCONT it: it must change nothing;
* ``cut-pg``: cut one node's link to PostgreSQL (reset or blackhole) for
  1–8 s, past the lease at times (half the time the leader's: it cannot
  renew, steps down, and a standby takes over);
* ``restart-node``: stop a node cleanly (SIGTERM), start it again.

The sampler also reads the lease row: each new epoch seen is a ``failover``
event, which the checker blames for the redeliveries that follow (a new
leader's leases start afresh). The machine's PostgreSQL is never cut: only
the links.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from tests.chaos.checker import EpochTaken, History, StoredWrite
from tests.chaos.hosts import host_address, last_words
from tests.chaos.nemesis import HEAL_TIMEOUT_S, OneFaultAtATime
from tests.chaos.workload import HISTORY_FILE, ChaosConfig, ChaosRun, save_history
from tests.support.pg import dsn_host_port, dsn_via, with_schema
from tests.support.tcp_proxy import TcpProxy
from zbroker.supervisor import free_port_block, start_broker

REPLACED_TIMEOUT_S = 60.0  # a bound on waiting for a paused leader's successor, never a timing claim
STOP_S = 30.0  # ... and on a SIGTERMed node's drain
LEASE_MS = 2000  # --coordinator-lease-ms: the least `zbroker up` takes (its default is 5000)
FAULTS = {"kill-leader": 3, "pause-leader": 2, "cut-pg": 3, "restart-node": 2}

# The fenced tables (migrations 0001, 0002, 0004) and the columns that name a row.
FENCED_TABLES = {"consumer_group_offsets": ("group_id", "topic", "partition"), "zbroker_topics": ("name",),
                 "zbroker_partition_states": ("topic", "partition"), "zbroker_group_configs": ("group_id",)}
AUDIT_TABLE = "chaos_write_audit"

# Every insert or update of a fenced row, with the lease row's epoch read as it lands: the
# writer holds the lease row FOR SHARE, so no takeover can commit in between.
AUDIT_SQL = """
CREATE TABLE {s}.{audit} (
    id                bigserial   PRIMARY KEY,
    tbl               text        NOT NULL,
    key               text        NOT NULL,
    coordinator_epoch bigint      NOT NULL,
    lease_epoch       bigint,
    written_at        timestamptz NOT NULL
);
CREATE FUNCTION {s}.chaos_audit_write() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    fields jsonb := to_jsonb(NEW);
    parts text[] := '{{}}';
    col text;
BEGIN
    FOREACH col IN ARRAY TG_ARGV LOOP
        parts := parts || (fields ->> col);
    END LOOP;
    INSERT INTO {s}.{audit} (tbl, key, coordinator_epoch, lease_epoch, written_at)
    VALUES (TG_TABLE_NAME, array_to_string(parts, '/'), NEW.coordinator_epoch,
            (SELECT epoch FROM {s}.zbroker_coordinator_lease WHERE id = 1), NEW.updated_at);
    RETURN NULL;
END $$;
"""
AUDIT_TRIGGER_SQL = """
CREATE TRIGGER chaos_audit AFTER INSERT OR UPDATE ON {s}.{table}
FOR EACH ROW EXECUTE FUNCTION {s}.chaos_audit_write({columns})
"""
MICROS = "(extract(epoch FROM {col}) * 1000000)::int8"


@dataclasses.dataclass
class ClusterChaosConfig(ChaosConfig):
    partitions: int = 4
    replication_factor: int = 3
    min_insync: int = 2
    records_per_s: float = 40.0  # per producer: modest, the machine is shared
    node_down_s: tuple[float, float] = (0.5, 6.0)
    pg_cut_s: tuple[float, float] = (1.0, 8.0)
    nemesis_gap_s: tuple[float, float] = (0.5, 3.0)
    drain_timeout_s: float = 120.0


class Node:
    """One `zbroker up` on its own address, data directory and link to PostgreSQL."""

    def __init__(self, index: int, root: Path, pg_dsn: str, schema: str, *, lease_ms: int, log_level: str) -> None:
        self.name = f"n{index + 2}"
        self.address = host_address(index)
        self.port = free_port_block(3, host=self.address)  # coordinator, its internal port, one partition actor
        self.data = root / self.name
        self.log_file = root / f"{self.name}.log"
        self.lease_ms = lease_ms
        self.log_level = log_level
        self.link = TcpProxy(dsn_host_port(pg_dsn)).start()  # to PostgreSQL
        self.offsets_url = with_schema(dsn_via(pg_dsn, self.link.port), schema)
        self.handle = None
        self.paused = False
        self.down_on_purpose = False  # killed or stopped by the nemesis, as opposed to crashed

    @property
    def url(self) -> str:
        return f"tcp://{self.address}:{self.port}"

    @property
    def process(self):
        return self.handle.process if self.handle is not None else None

    @property
    def running(self) -> bool:
        return self.handle is not None and self.handle.process.poll() is None

    @property
    def crashed(self) -> bool:
        """`zbroker up` exited on its own: not a fault the nemesis made, a bug the run found."""
        return self.handle is not None and not self.running and not self.down_on_purpose

    def start(self) -> int:
        assert not self.running, f"{self.name} is running already"
        # Left by a killed node; the coordinator writes it again once bound.
        (self.data / "run" / "coordinator.bound").unlink(missing_ok=True)
        self.handle = start_broker(self.data, port=self.port, host=self.address, advertise_host=self.address,
                                   offsets_url=self.offsets_url, wait=False, log_level=self.log_level,
                                   log_file=self.log_file, extra_args=("--coordinator-lease-ms", str(self.lease_ms)))
        self.paused = False
        self.down_on_purpose = False
        return self.handle.process.pid

    def bound(self) -> bool:
        return self.running and (self.data / "run" / "coordinator.bound").exists()

    def pids(self) -> dict[str, int]:
        return self.handle.pids() if self.running else {}

    def processes(self) -> list[int]:
        """Every process of the node, its supervisor first. `zbroker up` starts a session of its
        own (start_new_session); its actors stay in that session, though each leads a process
        group of its own (for the terminal's Ctrl-C), so killpg would reach the supervisor alone."""
        import psutil

        supervisor = self.handle.process.pid
        members = []
        for pid in psutil.pids():
            with contextlib.suppress(OSError):
                if pid != supervisor and os.getsid(pid) == supervisor:
                    members.append(pid)
        return [supervisor] + sorted(members)

    def _signal_all(self, sig: int) -> None:
        """The node whole. The supervisor first, so that it restarts no actor in between; for
        SIGCONT last, so that it finds its actors running again."""
        pids = self.processes()
        for pid in reversed(pids) if sig == signal.SIGCONT else pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill(self) -> int:
        pid = self.handle.process.pid
        self.down_on_purpose = True
        self._signal_all(signal.SIGKILL)
        self.handle.process.wait(STOP_S)
        self.paused = False
        return pid

    def pause(self) -> None:
        self._signal_all(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.running:
            self._signal_all(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        """SIGTERM (the node drains); whatever outlives it, SIGKILL."""
        if self.handle is None:
            return
        if self.paused:
            self.resume()
        self.down_on_purpose = True
        self.handle.stop(STOP_S)
        self._signal_all(signal.SIGKILL)

    def last_words(self, lines: int = 3) -> str:
        return last_words(self.log_file, lines)

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.link.close()


class Cluster:
    """The nodes as `ChaosRun` sees a broker: one URL (the list), their pids."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.url = ",".join(n.url for n in nodes)

    def pids(self) -> dict[str, int]:
        return {f"{n.name}/{actor}": pid for n in self.nodes for actor, pid in n.pids().items()}


class PgLinks:
    """The nodes' links to PostgreSQL as `ChaosRun.close` sees its one proxy: restored on close."""

    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes

    @property
    def mode(self) -> str:
        cut = [n.link.mode for n in self.nodes if n.link.mode != "forward"]
        return cut[0] if cut else "forward"

    def restore(self) -> None:
        for n in self.nodes:
            n.link.restore()


class ClusterChaosRun(OneFaultAtATime, ChaosRun):
    FAULTS = FAULTS
    NOT_HEALED = "the cluster did not heal (every node up, one leading, every ISR full)"

    def __init__(self, config: ClusterChaosConfig, cluster: Cluster, links: PgLinks, pg_dsn: str, schema: str,
                 workdir: Path, *, actors: Any, log=print) -> None:
        super().__init__(config, cluster, links, pg_dsn, schema, workdir, actors=actors, log=log)
        self.nodes = self.machines = cluster.nodes
        self.qualifier = f'"{schema}"'
        self.last_epoch = 0
        self.stats.update({f"fault {k}": 0 for k in FAULTS})
        self.stats.update(heal_waits=0, heal_timeouts=0, heal_s_max=0.0, pause_replaced=0, pause_not_replaced=0,
                          faults_skipped=0, failovers=0, crashes=[])

    # -- the store, read directly (never through a node's link) ------------------------------

    def lease(self) -> dict | None:
        """The lease row, if a node holds it unexpired by the database's clock."""
        import asyncpg

        from tests.support.pg import pg_fetch

        try:
            rows = pg_fetch(self.pg_dsn, f"SELECT holder, endpoint, epoch FROM {self.qualifier}"
                                         ".zbroker_coordinator_lease WHERE id = 1 AND expires_at > now()")
        except (asyncpg.UndefinedTableError, OSError, asyncpg.PostgresError):
            return None
        return dict(rows[0]) if rows else None

    def leader(self) -> Node | None:
        return self.holder(self.lease())

    def holder(self, lease: dict | None) -> Node | None:
        return next((n for n in self.nodes if lease and n.url == lease["endpoint"]), None)

    # -- lifecycle --------------------------------------------------------------------------

    def remember_actors(self) -> None:
        self.revive_crashed()
        super().remember_actors()

    def setup(self) -> None:
        from tests.support.waiting import wait_for
        from zbroker.client import Admin

        cfg = self.config
        for node in self.nodes:
            node.start()
        wait_for(self.leader, HEAL_TIMEOUT_S, "a node to take the coordinator lease")
        install_write_audit(self.pg_dsn, self.schema)  # the leader migrated the tables before it took the lease
        wait_for(lambda: all(n.bound() for n in self.nodes), HEAL_TIMEOUT_S, "every node to bind")
        self.remember_actors()
        with Admin(self.url, request_timeout=2.0) as admin:
            wait_for(lambda: len(self._registered(admin)) >= len(self.nodes), HEAL_TIMEOUT_S,
                     "every node's partition actor to register")
            admin.create_topic(cfg.topic, partitions=cfg.partitions, replication_factor=cfg.replication_factor,
                               min_insync=cfg.min_insync)
            admin.configure_group(cfg.group, ack_timeout_ms=cfg.ack_timeout_ms, max_deliveries=1000)
            wait_for(lambda: self._isr_full(admin), HEAL_TIMEOUT_S, "every partition's ISR to fill")

    @staticmethod
    def _registered(admin) -> set[str]:
        from zbroker.protocol.errors import ZBrokerError

        try:
            actors = admin.status()["actors"]
        except ZBrokerError:
            return set()
        return {a["actor_id"] for a in actors if a.get("kind") == "partition-log" and a.get("healthy")}

    def _isr_full(self, admin) -> bool:
        from zbroker.protocol.errors import ZBrokerError

        try:
            rows = admin.describe_topic(self.config.topic)["partitions"]
        except ZBrokerError:
            return False
        return all(r.get("leader") and len(r["isr"]) == self.config.replication_factor for r in rows)

    # -- nemesis ----------------------------------------------------------------------------

    def healed(self, admin) -> bool:
        self.revive_crashed()
        return all(n.bound() for n in self.nodes) and self.leader() is not None and self._isr_full(admin)

    def _fault(self, kind: str, admin, rng: random.Random) -> None:
        cfg = self.config
        lease = self.lease()
        leader = self.holder(lease)
        if kind in ("kill-leader", "pause-leader") and leader is None:
            self.stats["faults_skipped"] += 1  # no node leads just now: nothing to do it to
        elif kind == "kill-leader":
            pid = leader.kill()
            self.event("kill-node", leader.name, f"pid {pid}, the leader")
            self._stop_nemesis.wait(rng.uniform(*cfg.node_down_s))
            leader.start()
            self.event("start-node", leader.name)
        elif kind == "pause-leader":
            epoch = lease["epoch"]
            leader.pause()
            self.event("pause-node", leader.name, f"the leader at epoch {epoch}")
            replaced = self._wait_replaced(leader, epoch)
            self.stats["pause_replaced" if replaced else "pause_not_replaced"] += 1
            self._stop_nemesis.wait(rng.uniform(0.0, 2.0))  # the zombie sleeps on past its successor
            leader.resume()
            self.event("resume-node", leader.name, "replaced" if replaced else "NOT replaced")
        elif kind == "cut-pg":
            node = leader if leader is not None and rng.random() < 0.5 else rng.choice(self.nodes)
            mode = rng.choice(("reset", "blackhole"))
            node.link.cut(mode)
            self.event("pg-cut", node.name, mode + (", the leader" if node is leader else ""))
            self._stop_nemesis.wait(rng.uniform(*cfg.pg_cut_s))
            node.link.restore()
            self.event("pg-restore", node.name)
        elif kind == "restart-node":
            node = rng.choice(self.nodes)
            node.stop()
            self.event("stop-node", node.name, "SIGTERM" + (", the leader" if node is leader else ""))
            self._stop_nemesis.wait(rng.uniform(0.5, 3.0))
            node.start()
            self.event("start-node", node.name)

    def _wait_replaced(self, paused: Node, epoch: int) -> bool:
        deadline = time.monotonic() + REPLACED_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop_nemesis.is_set():
            lease = self.lease()
            if lease and lease["epoch"] > epoch and lease["endpoint"] != paused.url:
                return True
            self._stop_nemesis.wait(0.2)
        return False

    # -- sampler: the lease too -------------------------------------------------------------

    def _sample_pg(self, pg):
        pg = super()._sample_pg(pg)
        if pg is None:
            return pg
        try:
            rows = pg.fetch(f"SELECT holder, epoch FROM {self.qualifier}.zbroker_coordinator_lease WHERE id = 1")
        except Exception:
            return pg
        if rows and rows[0][1] > self.last_epoch:
            if self.last_epoch:
                self.stats["failovers"] += 1
                self.event("failover", rows[0][0], f"epoch {rows[0][1]}")
            self.last_epoch = rows[0][1]
        return pg

    # -- after the run ----------------------------------------------------------------------

    def history(self) -> History:
        history = super().history()
        history.epochs, history.stored_writes = read_store(self.pg_dsn, self.schema)
        history.meta.update(self.stats, lease_ms=LEASE_MS)
        save_history(history, self.workdir / HISTORY_FILE)
        return history


def install_write_audit(pg_dsn: str, schema: str) -> None:
    """The audit trigger on every fenced table of `schema` (migrated already)."""
    from tests.support.pg import pg_execute

    s = f'"{schema}"'
    pg_execute(pg_dsn, AUDIT_SQL.format(s=s, audit=AUDIT_TABLE))
    for table, columns in FENCED_TABLES.items():
        pg_execute(pg_dsn, AUDIT_TRIGGER_SQL.format(s=s, table=table, columns=", ".join(f"'{c}'" for c in columns)))


def read_store(pg_dsn: str, schema: str) -> tuple[list[EpochTaken], list[StoredWrite]]:
    """The epoch history, every audited write, and every fenced row as it stands."""
    from tests.support.pg import pg_fetch

    s = f'"{schema}"'
    epochs = [EpochTaken(*r) for r in pg_fetch(
        pg_dsn, f"SELECT epoch, holder, {MICROS.format(col='taken_at')} FROM {s}.zbroker_coordinator_epochs "
        "ORDER BY epoch")]
    writes = [StoredWrite(*r) for r in pg_fetch(
        pg_dsn, f"SELECT tbl, key, coordinator_epoch, {MICROS.format(col='written_at')}, lease_epoch "
        f"FROM {s}.{AUDIT_TABLE} ORDER BY id")]
    for table, columns in FENCED_TABLES.items():
        key = " || '/' || ".join(f"{c}::text" for c in columns)
        writes += [StoredWrite(table, *r) for r in pg_fetch(
            pg_dsn, f"SELECT {key}, coordinator_epoch, {MICROS.format(col='updated_at')} FROM {s}.{table}")]
    return epochs, writes


def open_cluster(pg_dsn: str, schema: str, root: Path, *, nodes: int = 3, log_level: str = "warning"):
    """The nodes, not started yet (the run starts them), as a fixture's generator: (cluster, links).

    Teardown: every node stopped, then its link closed; the schema is the caller's to drop after."""
    root.mkdir(parents=True, exist_ok=True)
    made: list[Node] = []
    try:
        for i in range(nodes):
            made.append(Node(i, root, pg_dsn, schema, lease_ms=LEASE_MS, log_level=log_level))
        yield Cluster(made), PgLinks(made)
    finally:
        for node in made:
            node.close()
