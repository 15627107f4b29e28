"""`zbroker up` when its own surroundings fail: a log reader that goes away, a terminal that
hangs up, a pids file it cannot write, a process it cannot spawn, a fault of its own. Each
time the actors must still be stopped in order, and no process outlive the supervisor."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zbroker.client import Admin
from tests.support.processes import all_gone
from zbroker.supervisor import free_port_block, wait_ready

pytestmark = pytest.mark.processes


def _pids(data: Path) -> dict:
    return json.loads((data / "run" / "actors.json").read_text())


def _reap(process: subprocess.Popen, pids: dict) -> None:
    """Whatever a failed test left running: the supervisor, then every actor it had."""
    if process.poll() is None:
        process.kill()
        process.wait(10)
    for name, pid in pids.items():
        if name != "supervisor":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _new_partition_actor(url: str, old_pid: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    with Admin(url, request_timeout=1.0) as admin:
        while time.monotonic() < deadline:
            for actor in admin.status()["actors"]:
                if actor["kind"] == "partition-log" and actor["pid"] not in (None, old_pid) \
                        and actor.get("alive", actor["healthy"]):
                    return actor["pid"]
            time.sleep(0.1)
    raise AssertionError(f"no partition actor replaced pid {old_pid} within {timeout}s")


def test_a_stop_with_nobody_left_reading_the_log_still_stops_every_actor(tmp_path):
    # `zbroker up 2>&1 | tee broker.log`, then Ctrl-C: tee is in the supervisor's group
    # and dies at once, so every log line after that met a broken pipe. The commit
    # writer's signal handler logs before it sets its stop event: it raised there and the
    # writer never stopped, not even on the kernel's SIGTERM once its supervisor was
    # gone; the supervisor's stop raised at its first line and it then waited for ever,
    # in multiprocessing's exit, for that writer.
    data, port = tmp_path / "data", free_port_block(3)
    up = subprocess.Popen([sys.executable, "-m", "zbroker", "up", "--http", "off", "--data", str(data), "--port", str(port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    pids: dict = {}
    try:
        wait_ready(f"tcp://127.0.0.1:{port}")
        pids = _pids(data)
        up.stderr.close()  # the reader is gone
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
        assert all_gone([pid for name, pid in pids.items() if name != "supervisor"]), "an actor outlived zbroker up"
    finally:
        _reap(up, pids)


def test_a_terminal_hang_up_stops_the_actors_in_order(start, tmp_path):
    # An ssh session that drops sends SIGHUP to the foreground group: the supervisor
    # alone, the actors having groups of their own. Its default action killed the
    # supervisor, and the kernel then sent every actor SIGTERM at once, in no order.
    broker = start()
    actors = broker.actor_pids()
    os.kill(broker.process.pid, signal.SIGHUP)
    assert broker.process.wait(30) == 0
    assert all_gone(actors)
    exited = [json.loads(line)["actor"] for line in (tmp_path / "broker.log").read_text().splitlines()
              if line.startswith("{") and json.loads(line).get("event") == "actor.exited"]
    assert exited == ["coordinator", "commit-writer", "partition-0"]


def test_a_pids_file_that_cannot_be_written_does_not_end_supervision(start):
    # A full disk fails the pids file's write, which the supervisor makes at every
    # restart: it raised out of the supervision loop ("error: CONFIG: ..."), and the
    # supervisor then hung in its exit, the dead actor never restarted, SIGTERM unheard.
    broker = start()
    run = Path(broker.config.data_dir).resolve() / "run"
    (run / "actors.tmp").mkdir()  # in the way of the write, as a full disk would be
    old = broker.kill("partition-0")
    _new_partition_actor(broker.url, old)
    assert broker.process.poll() is None
    actors = [pid for pid in broker.actor_pids() if pid != old]
    assert broker.stop() == 0
    assert all_gone(actors)


def _serve_with(tmp_path: Path, script: str) -> tuple[subprocess.Popen, Path, str]:
    """Runs `script` (which calls `serve` on argv's data directory and port) as the broker;
    returns the process, its data directory and URL."""
    data, port = tmp_path / "data", free_port_block(3)
    with open(tmp_path / "broker.log", "w") as log:
        up = subprocess.Popen([sys.executable, "-c", script, str(data), str(port)],
                              stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    return up, data, f"tcp://127.0.0.1:{port}"


_SPAWN_FAILS_ONCE = """
import errno, sys
from multiprocessing.context import SpawnProcess
from zbroker.supervisor import BrokerConfig, serve
real, starts = SpawnProcess.start, []
def start(self):
    starts.append(self.name)
    if self.name == "zbroker-partition-0" and starts.count(self.name) == 2:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")  # fork() at the process limit
    return real(self)
SpawnProcess.start = start
sys.exit(serve(BrokerConfig(data_dir=sys.argv[1], port=int(sys.argv[2]), http="off")))
"""


def test_a_restart_that_cannot_spawn_is_tried_again(tmp_path):
    # The memory pressure that killed an actor can fail the fork that restarts it. The
    # OSError ended supervision: the other actors ran on unsupervised, the dead one was
    # never restarted, and the supervisor hung in its exit.
    up, data, url = _serve_with(tmp_path, _SPAWN_FAILS_ONCE)
    pids: dict = {}
    try:
        wait_ready(url, process=up)  # an exit before it is ready fails at once
        pids = _pids(data)
        os.kill(pids["partition-0"], signal.SIGKILL)
        _new_partition_actor(url, pids["partition-0"])
        pids = _pids(data)
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        assert all_gone([pid for name, pid in pids.items() if name != "supervisor"])
    finally:
        _reap(up, pids)


_FAULT_ON_SIGNAL = """
import signal, sys
from zbroker.supervisor import BrokerConfig, serve
def fault(signum, frame):
    raise RuntimeError("a fault of the supervisor's own")
signal.signal(signal.SIGUSR1, fault)
sys.exit(serve(BrokerConfig(data_dir=sys.argv[1], port=int(sys.argv[2]), http="off")))
"""


def test_a_fault_in_the_supervisor_still_stops_the_actors(tmp_path):
    # Anything raised out of the supervision loop skipped the stop: the actors ran on,
    # and the supervisor waited for them for ever in multiprocessing's exit join.
    up, data, url = _serve_with(tmp_path, _FAULT_ON_SIGNAL)
    pids: dict = {}
    try:
        wait_ready(url, process=up)  # an exit before it is ready fails at once
        pids = _pids(data)
        up.send_signal(signal.SIGUSR1)
        assert up.wait(30) != 0
        assert all_gone([pid for name, pid in pids.items() if name != "supervisor"])
    finally:
        _reap(up, pids)
