"""Simulated hosts for the replicated chaos run: one partition actor, one disk, one network link each.

Host ``h2`` is a `zbroker partition` process bound to 127.0.0.2 with its own
data directory. Everyone reaches it through its network link: a `TcpProxy`
listening on 127.0.0.12 at the same port, which the actor advertises
(``--advertise-host 127.0.0.12``), so followers fetching from it, producers
and consumers all dial the link, and cutting the link cuts the host off the
data plane. Its own connection to the coordinator does not go through the
link: a cut leader still heartbeats, so the controller keeps it as leader and
fewer than min-insync of its ISR keep up (produce is refused until the link heals).
A host that loses the coordinator too is what SIGSTOP shows.

A host's actor is started by the test, not by a supervisor: the nemesis
SIGKILLs it, deletes its data directory, SIGSTOPs and SIGCONTs it, and starts
it again (on the same port, so its advertised endpoint stays the same).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.tcp_proxy import TcpProxy
from zbroker.supervisor import _bindable, free_port_block

STOP_S = 20.0  # a bound on a SIGTERMed actor's drain, never a timing claim


def host_address(index: int) -> str:
    """127.0.0.2, 127.0.0.3, ...: the simulated hosts' own addresses."""
    return f"127.0.0.{index + 2}"


def link_address(index: int) -> str:
    """127.0.0.12, 127.0.0.13, ...: where each host's network link (its proxy) listens."""
    return f"127.0.0.{index + 12}"


def free_port_on(*addresses: str) -> int:
    for _ in range(200):
        port = free_port_block(1, host=addresses[0])
        if all(_bindable(a, port) for a in addresses[1:]):
            return port
    raise RuntimeError(f"no port free on all of {addresses}")


def last_words(log_file: Path, lines: int = 3) -> str:
    """The tail of a process's log, on one line: what it said before it exited."""
    try:
        tail = log_file.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return " | ".join(line[:300] for line in tail)


class Host:
    def __init__(self, index: int, broker_url: str, root: Path, *, replica_lag_ms: int, fsync: str,
                 log_level: str = "warning") -> None:
        self.index = index
        self.name = f"h{index + 2}"
        self.address = host_address(index)
        self.link_address = link_address(index)
        self.port = free_port_on(self.address, self.link_address)
        self.broker_url = broker_url
        root.mkdir(parents=True, exist_ok=True)
        self.data = root / self.name
        self.log_file = root / f"{self.name}.log"
        self.replica_lag_ms = replica_lag_ms
        self.fsync = fsync
        self.log_level = log_level
        self.process: subprocess.Popen | None = None
        self.paused = False
        self.down_on_purpose = False  # killed or stopped by the test, as opposed to crashed
        self.link = TcpProxy((self.address, self.port), listen=(self.link_address, self.port)).start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.link_address}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.running else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> int:
        assert not self.running, f"{self.name} is running already"
        cmd = [sys.executable, "-m", "zbroker", "partition", "--broker", self.broker_url, "--data", str(self.data),
               "--bind", f"tcp://{self.address}:{self.port}", "--advertise-host", self.link_address,
               "--actor-id", self.name, "--rack", f"rack-{self.name}", "--fsync", self.fsync,
               "--replica-lag-ms", str(self.replica_lag_ms), "--log-level", self.log_level]
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        self.paused = False
        self.down_on_purpose = False
        return self.process.pid

    @property
    def crashed(self) -> bool:
        """It exited on its own: not a fault the nemesis made, a bug the run found."""
        return self.process is not None and not self.running and not self.down_on_purpose

    def last_words(self, lines: int = 3) -> str:
        return last_words(self.log_file, lines)

    def kill(self) -> int | None:
        """SIGKILL the host's process (a lost host); its disk stays as the page cache left it."""
        if not self.running:
            return None
        pid = self.process.pid
        self.down_on_purpose = True
        os.kill(pid, signal.SIGKILL)
        self.process.wait(STOP_S)
        self.paused = False
        return pid

    def stop(self) -> None:
        """SIGTERM: the actor drains and deregisters (SIGKILL if it does not within STOP_S)."""
        if not self.running:
            return
        if self.paused:
            self.resume()
        self.down_on_purpose = True
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()

    def wipe(self) -> None:
        """The disk is lost: only ever while the process is gone."""
        assert not self.running, f"{self.name} must be down before its disk goes"
        shutil.rmtree(self.data, ignore_errors=True)

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.running:
            os.kill(self.process.pid, signal.SIGCONT)
        self.paused = False

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.link.close()
