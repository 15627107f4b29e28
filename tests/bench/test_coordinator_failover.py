"""The pieces of bench.coordinator_failover: the timing, the node command lines, the leader
read from the lease view, killing a node's whole process group, and the schema the run makes
and drops (PostgreSQL)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from bench import coordinator_failover as cf
from bench import harness
from tests.support.pg import PgSession


def test_percentiles_and_the_goal():
    assert cf.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert cf.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0 and cf.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    times = [5.5, 6.0, 9.9, 5.8]
    assert cf.summarize(times) == {"kills": 4, "p50_s": 5.8, "max_s": 9.9, "min_s": 5.5, "goal_max_s": 10.0,
                                   "goal_met": True}
    assert not cf.summarize([*times, 10.0])["goal_met"]
    assert cf.summarize([])["goal_met"] is False


def test_the_timer_counts_from_the_kill_to_the_first_poll_answered_elsewhere():
    timer = cf.FailoverTimer()
    assert timer.poll_answered("tcp://127.0.0.1:1", 1.0) is None  # before any kill
    timer.killed("tcp://127.0.0.1:1", at=10.0)
    assert timer.poll_answered("tcp://127.0.0.1:1", 10.01) is None  # the killed node's last answer
    timer.poll_failed()
    timer.poll_failed()
    assert timer.poll_answered("tcp://127.0.0.2:1", 16.5) == 6.5
    assert timer.poll_answered("tcp://127.0.0.2:1", 17.0) is None  # measured once per kill
    timer.killed("tcp://127.0.0.2:1", at=20.0)
    assert timer.poll_answered("tcp://127.0.0.3:1", 19.0) is None  # a clock before the kill: not this round
    assert timer.poll_answered("tcp://127.0.0.3:1", 27.25) == 7.25
    assert timer.times_s == [6.5, 7.25] and timer.failed_polls == 2


def test_each_node_binds_its_own_address_with_its_own_data_and_the_shared_store(tmp_path):
    cmd = cf.node_command("py", 1, 7400, tmp_path, "postgresql://h/db?schema=s")
    assert cmd[:4] == ["py", "-m", "zbroker", "up"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags == {"--host": "127.0.0.2", "--advertise-host": "127.0.0.2", "--port": "7400",
                     "--data": str(tmp_path / "node2"), "--offsets": "postgresql://h/db?schema=s",
                     "--http": "off", "--log-level": "warning"}
    assert cf.schema_url("postgresql://h/db?schema=old&sslmode=disable", "new") == \
        "postgresql://h/db?sslmode=disable&schema=new"


def test_the_leader_is_the_node_of_an_unexpired_lease():
    lease = {"endpoint": "tcp://127.0.0.3:7400", "expired": False}
    assert cf.leader_index({"leader": lease}, 7400) == 2
    assert cf.leader_index({"leader": {**lease, "expired": True}}, 7400) is None
    assert cf.leader_index({"leader": None}, 7400) is None
    assert cf.leader_index({"leader": {**lease, "endpoint": "tcp://elsewhere:7400"}}, 7400) is None


def test_the_harness_runs_it_as_a_module_of_its_own():
    assert harness.expand_workloads(["coordinator_failover"]) == ("coordinator_failover",)
    assert harness.STANDALONE["coordinator_failover"] == "bench.coordinator_failover"


@pytest.mark.processes
def test_a_kill_takes_the_whole_process_group(tmp_path, monkeypatch):
    # A node is a supervisor and its actors: a lost host loses all of them, not the supervisor alone.
    child_pid = tmp_path / "child.pid"
    script = (f"import os, subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              f"open({str(child_pid)!r}, 'w').write(str(p.pid))\n"
              f"time.sleep(600)\n")
    monkeypatch.setattr(cf, "node_command", lambda *a: [sys.executable, "-c", script])
    nodes = cf.Nodes(7400, tmp_path, "unused", tmp_path)
    nodes.start(0)
    deadline = time.monotonic() + 60
    while not child_pid.exists() or not child_pid.read_text():
        assert time.monotonic() < deadline, "the fake node never started its child"
        time.sleep(0.05)
    pid = int(child_pid.read_text())
    nodes.kill(0)
    while True:  # the orphaned child is reaped by init once killed; until then it is a zombie at most
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().split()[2]
        except (ProcessLookupError, FileNotFoundError):
            break
        if state == "Z":
            break
        assert time.monotonic() < deadline, f"the node's child {pid} outlived the kill (state {state})"
        time.sleep(0.05)
    assert nodes.procs[0] is None
    nodes.stop_all()  # nothing left: no error


@pytest.mark.postgres
def test_the_runs_schema_is_made_and_dropped(pg_dsn):
    with cf.bench_schema(pg_dsn) as url:
        schema = url.rsplit("schema=", 1)[1]
        with PgSession(pg_dsn) as s:
            assert s.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema) == 1
    with PgSession(pg_dsn) as s:
        assert s.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema) == 0
    with pytest.raises(RuntimeError, match="boom"):  # dropped when the run fails too
        with cf.bench_schema(pg_dsn) as url:
            schema = url.rsplit("schema=", 1)[1]
            raise RuntimeError("boom")
    with PgSession(pg_dsn) as s:
        assert s.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema) == 0
