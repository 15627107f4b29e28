"""The supervisor behind ``zbroker up``: starts the actors and keeps them running.

Each actor is a separate OS process started with multiprocessing's *spawn*
method (no state inherited by fork). The supervisor waits on the process
sentinels; when an actor dies it logs the exit code and restarts it after an
exponential backoff (100 ms doubling to 5 s, reset after 30 s of uptime).
On SIGINT, SIGTERM or SIGHUP (a terminal that hangs up) it stops the
console actor (HTTP, read only; absent with ``--http off``), then the
coordinator (no new work), then the commit writer (flushes pending
offsets), then the partition actors (fsync),
each with SIGTERM and a bounded wait before SIGKILL. That order is why each
actor runs in a process group of its own: a Ctrl-C in the terminal reaches
the supervisor alone, not every actor at once (the commit writer would exit
before the coordinator's last advances reached it). An actor whose
supervisor dies gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops;
and one data directory has one supervisor at a time (``<data>/run/supervisor.lock``).

An actor that dies within its first seconds, again and again, has a setting
it cannot start with (a port in use, a bad key): after a few such deaths the
supervisor stops the broker and exits 1 instead of restarting it for ever.

The current pid of every actor is written to ``<data>/run/actors.json`` so
that operators, tests and the benchmark can find (and kill) them.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import structlog

from zbroker.actors import runtime

BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0
STABLE_AFTER_S = 30.0
STOP_TIMEOUT_S = 10.0
# An actor that never stayed up this long, and died this many times, cannot start.
STARTED_AFTER_S = 2.0
START_ATTEMPTS = 5
BOUND_POLL_S = 0.02  # how often a starting actor looks whether its coordinator holds the ports


@dataclasses.dataclass
class BrokerConfig:
    data_dir: str = "./data"
    host: str = "127.0.0.1"  # the interface the broker binds; 0.0.0.0 (or *) for all of them
    # The name or address clients and partition actors on other hosts dial, when it is not
    # `host`. Required with a wildcard `host`: no peer can dial 0.0.0.0.
    advertise_host: str | None = None
    port: int = 7400
    partition_actors: int = 1
    fsync: str = "interval:1000"
    offsets_url: str | None = None  # default: sqlite:///<data_dir>/offsets.sqlite3
    log_level: str = "info"
    curve_dir: str | None = None  # CurveZMQ keys (actors/security.py); None = no encryption
    # The console actor's HTTP address (/metrics and the web console): "HOST:PORT", "off",
    # or None for the default, the coordinator's host at port + 80.
    http: str | None = None
    http_token: str | None = None  # a bearer token; required for a non-loopback bind
    rack: str | None = None  # the built-in partition actors' rack (replica placement)
    # Each built-in partition actor on its own data directory, so that replicas of one
    # partition can sit on several of them (they never share one). Off: all share
    # <data>/partitions and split its partitions, as before replication.
    actor_dirs: bool = False
    unclean_leader_election: bool = False
    replica_lag_ms: int = 10_000  # the built-in actors' --replica-lag-ms (ISR shrink)
    # With PostgreSQL offsets the node is one of a cluster, and leads only while it holds the
    # coordinator lease (taken and renewed with the database clock); it expires after this.
    coordinator_lease_ms: int = 5_000

    def http_address(self) -> tuple[str, int] | None:
        """Where the console listens, or None with `--http off`."""
        if self.http is not None and self.http.lower() == "off":
            return None
        if self.http is None:
            # The coordinator's host; loopback for a wildcard one, and for a non-loopback
            # one without a token (a broker that ran before the console existed keeps
            # starting: its metrics are not offered to the network unasked).
            host = self._local_host
            return (host if _loopback(host) or self.http_token else "127.0.0.1"), self.port + 80
        host, sep, port = self.http.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"--http {self.http!r}: HOST:PORT or off")
        return (host.strip("[]") or "127.0.0.1"), int(port)

    def http_error(self) -> str | None:
        try:
            address = self.http_address()
        except ValueError as err:
            return str(err)
        if address is not None and not _loopback(address[0]) and not self.http_token:
            return f"--http {address[0]}:{address[1]} is not a loopback address: give --http-token"
        return None

    def partition_dir(self, data: Path, i: int) -> Path:
        """p0 keeps <data>/partitions either way, so turning actor_dirs on moves nothing of it."""
        return data / "partitions" if i == 0 or not self.actor_dirs else data / f"partitions-p{i}"

    @property
    def coordinator_endpoint(self) -> str:
        """The broker's URL: what clients dial."""
        return f"tcp://{self.advertise_host or self._local_host}:{self.port}"

    @property
    def internal_endpoint(self) -> str:
        """Where the broker's own actors, on this machine, dial the coordinator (never given to clients)."""
        return f"tcp://{self._local_host}:{self.port + 1}"

    @property
    def _local_host(self) -> str:
        return "127.0.0.1" if self.host in runtime.WILDCARD_HOSTS else self.host

    def bind_endpoint(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"

    def wildcard_error(self) -> str | None:
        return None if self.advertise_host else runtime.wildcard_error(self.bind_endpoint(self.port))

    def clustered(self) -> bool:
        """PostgreSQL offsets: every node on that database (and schema) is one of a cluster."""
        return self.resolved_offsets_url().split(":", 1)[0].startswith("postgres")

    def resolved_offsets_url(self) -> str:
        if self.offsets_url:
            return self.offsets_url
        return f"sqlite:///{Path(self.data_dir).resolve() / 'offsets.sqlite3'}"

    def builtin_actor_id(self, index: int) -> str:
        """``p<i>`` on a broker of its own. On a node of a cluster (PostgreSQL offsets) every
        node's actors register with the one leading coordinator, whose ROUTER refuses a second
        connection under an id already connected: three nodes' ``p0`` left two of them
        unregistered. There the id names the node too, ``p<i>@HOST:PORT``."""
        if not self.resolved_offsets_url().split(":", 1)[0].startswith("postgres"):
            return f"p{index}"
        return f"p{index}@{self.advertise_host or self._local_host}:{self.port}"

    def partition_bind(self, index: int) -> str:
        return self.bind_endpoint(self.port + 2 + index)


@dataclasses.dataclass
class _Child:
    name: str
    target: str
    kwargs: dict
    process: Any = None
    started_at: float = 0.0
    running_since: Any = None  # a shared double the child sets once it has imported and may run
    failures: int = 0
    restart_at: float | None = None
    ever_started: bool = False  # stayed up STARTED_AFTER_S at least once
    start_failures: int = 0     # exits with an error before that


_PR_SET_PDEATHSIG = 1


def _stop_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the supervisor dies, even by SIGKILL (Linux)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the supervisor's own stop is all there is
        return
    if os.getppid() != parent_pid:  # it died before the line above: nobody would send it
        os.kill(os.getpid(), signal.SIGTERM)


def _spawn_target(target: str, kwargs: dict, parent_pid: int | None = None, wait_for: str | None = None,
                  running_since: Any = None) -> None:
    if parent_pid is not None:
        os.setpgrp()  # the terminal's Ctrl-C goes to the supervisor, which stops actors in order
        _stop_with_parent(parent_pid)
    module_name, func_name = target.rsplit(":", 1)
    module = __import__(module_name, fromlist=[func_name])
    if wait_for is not None:
        # Imported meanwhile, so the wait costs the start little. A file, not a
        # multiprocessing.Event: a process killed inside Event.wait() leaves the
        # Event's condition counting it, and the next set() blocks for ever.
        while not os.path.exists(wait_for):
            time.sleep(BOUND_POLL_S)
    if running_since is not None:
        # The start-up rule below counts an actor's time up from here, not from its spawn:
        # an interpreter that only imported (2.3 s on a loaded machine, more with the
        # console's dependencies) has not started, and must not make a failing actor
        # look like one that ran and may be restarted for ever. (CLOCK_MONOTONIC is
        # one clock for every process of the host.)
        running_since.value = time.monotonic()
    getattr(module, func_name)(**kwargs)


class Supervisor:
    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.ctx = multiprocessing.get_context("spawn")
        self.log = structlog.get_logger("zbroker.supervisor")
        self.stopping = False
        self.failed: str | None = None  # the actor that could not start, if one could not
        self._lock_fd: int | None = None
        data = Path(config.data_dir).resolve()
        self.pid_file = data / "run" / "actors.json"
        coordinator = config.internal_endpoint
        # Written by our coordinator once it has bound its ports. The other actors wait for
        # it: two brokers started at once on the same ports both passed the port check,
        # and one's commit writer dialled the other's coordinator, which loaded the wrong
        # offsets. Now the loser's coordinator cannot bind, and nothing of it dials out.
        self.coordinator_bound = str(data / "run" / "coordinator.bound")
        self.children: list[_Child] = [
            _Child("coordinator", "zbroker.actors.group_coordinator.shell:run",
                   {"endpoint": config.bind_endpoint(config.port),
                    "internal_endpoint": config.bind_endpoint(config.port + 1),
                    "data_dir": str(data / "coordinator"), "log_level": config.log_level,
                    "curve_dir": config.curve_dir, "bound_file": self.coordinator_bound,
                    "advertise_host": config.advertise_host,
                    "unclean_leader_election": config.unclean_leader_election,
                    "cluster": config.clustered(), "lease_ms": config.coordinator_lease_ms}),
            _Child("commit-writer", "zbroker.actors.commit_writer.shell:run",
                   {"coordinator_endpoint": coordinator, "offsets_url": config.resolved_offsets_url(),
                    "log_level": config.log_level, "curve_dir": config.curve_dir}),
        ]
        for i in range(config.partition_actors):
            self.children.append(_Child(
                f"partition-{i}", "zbroker.actors.partition_log.shell:run",
                {"actor_id": config.builtin_actor_id(i), "coordinator": coordinator, "data_dir": str(config.partition_dir(data, i)),
                 "bind": config.partition_bind(i), "advertise_host": config.advertise_host, "fsync": config.fsync,
                 "log_level": config.log_level, "curve_dir": config.curve_dir, "rack": config.rack,
                 "replica_lag_ms": config.replica_lag_ms}))

        address = config.http_address() if config.http_error() is None else None
        if address is not None:
            # After the others: it only reads, and it is the first to stop (order below).
            self.children.append(_Child(
                "console", "zbroker.console.shell:run",
                {"coordinator": coordinator, "host": address[0], "port": address[1], "token": config.http_token,
                 "log_level": config.log_level, "curve_dir": config.curve_dir}))

    def _start(self, child: _Child) -> None:
        wait_for = None if child.name == "coordinator" else self.coordinator_bound
        # A raw value (no lock): a child killed while holding a lock would leave it held.
        child.running_since = self.ctx.RawValue("d", 0.0)
        process = self.ctx.Process(target=_spawn_target, args=(child.target, child.kwargs, os.getpid(), wait_for,
                                                               child.running_since),
                                   name=f"zbroker-{child.name}", daemon=False)
        try:
            process.start()
        except OSError as err:
            # No process to start it in (EAGAIN, ENOMEM: the memory pressure that may have
            # killed this actor): that passes, so it is tried again with backoff, like a
            # death. Raised, it ended the supervision of every other actor.
            delay = min(BACKOFF_MAX_S, BACKOFF_START_S * (2 ** child.failures))
            child.failures += 1
            child.restart_at = time.monotonic() + delay
            self.log.error("actor.spawn_failed", actor=child.name, error=str(err), restart_in_s=delay)
            return
        child.process = process
        child.started_at = time.monotonic()
        child.restart_at = None
        self.log.info("actor.spawned", actor=child.name, pid=child.process.pid)
        self._write_pids()

    def _write_pids(self) -> None:
        pids = {c.name: c.process.pid for c in self.children if c.process is not None and c.process.is_alive()}
        pids["supervisor"] = os.getpid()
        tmp = self.pid_file.with_suffix(".tmp")
        try:
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(pids))
            os.replace(tmp, self.pid_file)
        except OSError as err:
            # A list for operators, not the broker's state: a full disk failing it must not
            # end the supervision of actors that keep running (it raised out of the loop).
            self.log.warning("pids_file.unwritten", path=str(self.pid_file), error=str(err))

    def _lock_data_dir(self) -> bool:
        """One supervisor per data directory: a second would run a second coordinator
        writing the same metadata files (the partition logs have locks of their own)."""
        path = self.pid_file.parent / "supervisor.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            self.log.error("broker.data_dir_in_use", data_dir=self.config.data_dir, supervisor_pid=holder)
            print(f"error: CONFIG: the data directory {self.config.data_dir} is in use by another broker "
                  f"(supervisor pid {holder or 'unknown'})", file=sys.stderr)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd  # held until this process exits
        return True

    def _settings_error(self) -> str | None:
        """A setting an actor could not start with, found before anything is created."""
        from zbroker.actors.partition_log.core import FsyncPolicy
        from zbroker.actors.security import KeyRing
        try:
            FsyncPolicy.parse(self.config.fsync)
        except ValueError as err:
            return str(err)
        wildcard = self.config.wildcard_error()
        if wildcard:
            return f"--host: {wildcard}"
        http = self.config.http_error()
        if http:
            return http
        if self.config.curve_dir is not None:  # "" too: refused, not taken as "no CURVE"
            try:
                KeyRing(self.config.curve_dir)
            except (OSError, ValueError) as err:
                return f"cannot load the CurveZMQ keys in {self.config.curve_dir}: {err}"
        from zbroker.protocol.errors import ZBrokerError
        from zbroker.storage.offsets.urls import open_offset_store
        try:
            open_offset_store(self.config.resolved_offsets_url())  # builds it; connects to nothing
        except ZBrokerError as err:
            return f"--offsets: {err.message}"
        return None

    def _offsets_file_error(self) -> str | None:
        """A SQLite offsets file the commit writer could not create or write. It would
        retry for ever (a database that is down comes back; a directory that is missing
        does not), and the broker would never become healthy."""
        url = self.config.resolved_offsets_url()
        if not url.startswith("sqlite:///") or url.endswith(":memory:"):
            return None
        path = Path(url[len("sqlite:///"):].split("?", 1)[0])
        if path.exists():
            return None if os.access(path, os.R_OK | os.W_OK) else f"--offsets: cannot write {path}"
        if not path.parent.is_dir():
            return f"--offsets: the directory {path.parent} does not exist"
        if not os.access(path.parent, os.W_OK | os.X_OK):
            return f"--offsets: cannot create {path}: the directory {path.parent} is not writable"
        return None

    def _offsets_database_error(self) -> str | None:
        """A PostgreSQL server that answers and refuses the offsets' database for good (it
        does not exist, the role or password is wrong). The commit writer would retry for
        ever and the broker never become healthy. A server that does not answer is left
        to those retries: it may be starting too."""
        from zbroker.storage.offsets.urls import open_offset_store

        url = self.config.resolved_offsets_url()
        if urlsplit(url).scheme.lower() not in ("postgresql", "postgres"):
            return None
        from zbroker.storage.offsets.postgres import refused_for_good

        reason = refused_for_good(open_offset_store(url, connect_timeout=3.0))
        return None if reason is None else f"--offsets: {reason}"

    def _ports_error(self) -> str | None:
        """A port the actors could not bind; checked once the data directory is ours, so a
        second broker on the same data hears that rather than about its ports."""
        ports = [self.config.port, self.config.port + 1] + [self.config.port + 2 + i
                                                           for i in range(self.config.partition_actors)]

        if not (0 < ports[0] and ports[-1] <= 65535):
            return f"the broker needs ports {ports[0]}-{ports[-1]}, outside 1-65535: choose another --port"
        for port in ports:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
                try:
                    probe.bind(("0.0.0.0" if self.config.host == "*" else self.config.host, port))
                except OSError as err:
                    if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL:
                        return f"cannot bind {self.config.host} ({err.strerror}): choose another --host"
                    return (f"cannot bind {self.config.host}:{port} ({err.strerror}); the broker uses ports "
                            f"{ports[0]}-{ports[-1]}: choose another --port")
        return self._console_port_error()

    def _console_port_error(self) -> str | None:
        address = self.config.http_address()
        if address is None:
            return None
        if not 0 < address[1] <= 65535:
            return f"the console's port {address[1]} is outside 1-65535: give --http HOST:PORT, or --http off"
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
            try:
                probe.bind(address)
            except OSError as err:
                return (f"the console cannot bind {address[0]}:{address[1]} ({err.strerror}): "
                        f"choose another --http, or --http off")
        return None

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        # The terminal's hang-up (an ssh session that drops, a closed window) reaches the
        # supervisor alone, the actors being in groups of their own. Its default action
        # killed the supervisor outright: the actors then all got SIGTERM at once from
        # the kernel, in no order, and the commit writer could miss the last advances.
        signal.signal(signal.SIGHUP, self._on_signal)
        problem = self._settings_error()
        if problem is None:
            from zbroker.storage.log.partition_log import make_directories_durably
            make_directories_durably(Path(self.config.data_dir), Path(self.config.data_dir))
            if not self._lock_data_dir():
                return 1
            problem = self._offsets_file_error() or self._offsets_database_error() or self._ports_error()
        if problem is not None:
            self.log.error("broker.bad_config", reason=problem)
            print(f"error: CONFIG: {problem}", file=sys.stderr)
            return 1
        Path(self.coordinator_bound).unlink(missing_ok=True)  # a run before this one's (we hold the lock)
        self.log.info("broker.starting", url=self.config.coordinator_endpoint, data_dir=self.config.data_dir,
                      partition_actors=self.config.partition_actors, fsync=self.config.fsync,
                      offsets=_redact(self.config.resolved_offsets_url()))
        try:
            for child in self.children:
                self._start(child)
            while not self.stopping and self.failed is None:
                self._watch_once()
        finally:
            # Whatever ends supervision, the actors stop in order here. An exception
            # that skipped this left them running unsupervised while the supervisor,
            # on its way out, waited for ever in multiprocessing's join of its children.
            self._stop_all()
        if self.failed is not None:
            print(f"error: CONFIG: the {self.failed} actor cannot start (it died {START_ATTEMPTS} times within "
                  f"{STARTED_AFTER_S:g} s of starting; its errors are above)", file=sys.stderr)
            return 1
        self.log.info("broker.stopped")
        return 0

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    def _watch_once(self) -> None:
        now = time.monotonic()
        sentinels = [c.process.sentinel for c in self.children if c.process is not None and c.restart_at is None]
        due = [c.restart_at for c in self.children if c.restart_at is not None]
        timeout = 1.0 if not due else max(0.0, min(min(due) - now, 1.0))
        try:
            multiprocessing.connection.wait(sentinels, timeout=timeout)
        except InterruptedError:
            return
        if self.stopping:
            return
        now = time.monotonic()
        for child in self.children:
            if child.restart_at is None and child.process is not None and not child.process.is_alive():
                code = child.process.exitcode
                uptime = now - child.started_at
                if uptime > STABLE_AFTER_S:
                    child.failures = 0
                running = child.running_since.value if child.running_since is not None else 0.0
                ran_for = now - running if running else 0.0  # 0: it never got past its imports
                child.ever_started = child.ever_started or ran_for >= STARTED_AFTER_S
                delay = min(BACKOFF_MAX_S, BACKOFF_START_S * (2 ** child.failures))
                child.failures += 1
                child.restart_at = now + delay
                child.process.close()
                child.process = None
                self.log.warning("actor.died", actor=child.name, exit_code=code, uptime_s=round(uptime, 3),
                                 restart_in_s=delay, failures=child.failures)
                self._write_pids()
                if not child.ever_started and code is not None and code > 0:  # it failed; nobody killed it
                    child.start_failures += 1
                    if child.start_failures >= START_ATTEMPTS:
                        self.log.error("actor.cannot_start", actor=child.name, exit_code=code,
                                       failures=child.start_failures)
                        self.failed = child.name
                        return
            elif child.restart_at is not None and now >= child.restart_at:
                self._start(child)

    def _stop_all(self) -> None:
        order = ["console", "coordinator", "commit-writer"]
        groups = [[c for c in self.children if c.name == name] for name in order]
        groups.append([c for c in self.children if c.name not in order])
        for group in groups:
            live = [c for c in group if c.process is not None and c.process.is_alive()]
            for child in live:
                child.process.terminate()
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for child in live:
                child.process.join(max(0.0, deadline - time.monotonic()))
                if child.process.is_alive():
                    self.log.error("actor.stop_timeout", actor=child.name, pid=child.process.pid)
                    child.process.kill()
                    child.process.join(2)
                self.log.info("actor.exited", actor=child.name, exit_code=child.process.exitcode)
        self._write_pids()


def _loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}" if ":" in creds else url
    return url


def serve(config: BrokerConfig) -> int:
    runtime.configure_logging(config.log_level, actor="supervisor")
    return Supervisor(config).run()


# -- for tests, benchmarks and scripts ------------------------------------------------------------

def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local end of outgoing connections (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A base port such that base .. base+count-1 were free a moment ago.

    Picked at random outside the kernel's ephemeral range: a port in it can become
    the local end of any outgoing connection (a client's, PostgreSQL's) between
    this check and the broker's bind, which the coordinator then fails with
    EADDRINUSE. Outside it, only another listener can take the port. The console's
    default port, base + 80, stays in the same span: a base above 65,455 made every
    `zbroker up` without `--http` a CONFIG error (a test drew 65505).
    """
    low, high = ephemeral_port_range()
    reach = max(count, 81)
    spans = [(lo, hi - reach) for lo, hi in ((10_000, low), (high + 1, 65_536)) if hi - reach > lo]
    for _ in range(500):
        lo, hi = random.choice(spans)
        base = random.randrange(lo, hi)
        if all(_bindable(host, port) for port in range(base, base + count)):
            return base
    raise RuntimeError("no free port block found")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class BrokerHandle:
    """A broker running as a child process tree (``zbroker up``), for tests and benches."""

    def __init__(self, process: subprocess.Popen, config: BrokerConfig) -> None:
        self.process = process
        self.config = config
        self.url = config.coordinator_endpoint

    def pids(self) -> dict[str, int]:
        path = Path(self.config.data_dir).resolve() / "run" / "actors.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def actor_pids(self) -> list[int]:
        return [pid for name, pid in self.pids().items() if name != "supervisor"]

    def kill(self, actor: str, sig: int = signal.SIGKILL) -> int:
        pid = self.pids()[actor]
        os.kill(pid, sig)
        return pid

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                actors = self.actor_pids()
                self.process.kill()  # the actors get SIGTERM from the kernel (PR_SET_PDEATHSIG)...
                self.process.wait(5)
                for pid in actors:  # ...and SIGKILL here if that is not enough
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        return self.process.returncode

    def __enter__(self) -> "BrokerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_broker(data_dir: str | Path, *, port: int = 0, partition_actors: int = 1,
                 fsync: str = "interval:1000", offsets_url: str | None = None, log_level: str = "warning",
                 wait: bool = True, log_file: str | Path | None = None, timeout: float = 30.0,
                 curve_dir: str | Path | None = None, host: str = "127.0.0.1",
                 advertise_host: str | None = None, http: str | None = "off",
                 http_token: str | None = None, extra_args: tuple[str, ...] = ()) -> BrokerHandle:
    """Start ``zbroker up`` as a subprocess; with ``port=0`` pick free ports.

    ``http`` is `--http`: "off" by default here (most tests need no console), None
    for `zbroker up`'s default (port + 80), or "HOST:PORT". ``extra_args`` go to
    ``zbroker up`` as they are (``--actor-dirs``, ``--rack NAME``, ...)."""
    if port == 0 and wait:
        # A block found free can be taken by another listener before the broker binds it
        # (a parallel test's broker or console): it then exits at once with CONFIG. Three
        # blocks before giving up (a full make test met this once, and waited 30 s for it).
        for attempt in range(3):
            try:
                return start_broker(data_dir, port=free_port_block(partition_actors + 2, host="0.0.0.0"
                                                                   if host == "*" else host),
                                    partition_actors=partition_actors, fsync=fsync, offsets_url=offsets_url,
                                    log_level=log_level, wait=wait, log_file=log_file, timeout=timeout,
                                    curve_dir=curve_dir, host=host, advertise_host=advertise_host, http=http,
                                    http_token=http_token, extra_args=extra_args)
            except BrokerExited:
                if attempt == 2:
                    raise
    if port == 0:
        port = free_port_block(partition_actors + 2, host="0.0.0.0" if host == "*" else host)
    config = BrokerConfig(data_dir=str(data_dir), host=host, advertise_host=advertise_host, port=port,
                          partition_actors=partition_actors, fsync=fsync, offsets_url=offsets_url,
                          log_level=log_level, curve_dir=str(curve_dir) if curve_dir else None,
                          http=http, http_token=http_token)
    cmd = [sys.executable, "-m", "zbroker", "up", "--data", str(data_dir), "--host", host, "--port", str(port),
           "--partition-actors", str(partition_actors), "--fsync", fsync, "--log-level", log_level]
    if advertise_host:
        cmd += ["--advertise-host", advertise_host]
    if offsets_url:
        cmd += ["--offsets", offsets_url]
    if curve_dir:
        cmd += ["--curve", str(curve_dir)]
    if http is not None:
        cmd += ["--http", http]
    if http_token:
        cmd += ["--http-token", http_token]
    cmd += list(extra_args)
    stderr = open(log_file, "ab") if log_file else subprocess.DEVNULL
    try:
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    finally:
        if log_file:
            stderr.close()
    handle = BrokerHandle(process, config)
    if wait:
        try:
            wait_ready(handle.url, partition_actors=partition_actors, timeout=timeout, curve_dir=curve_dir,
                       process=process)
        except BaseException:
            handle.stop()
            raise
    return handle


class BrokerExited(RuntimeError):
    """The broker process ended while it was awaited (its log says why)."""


def wait_ready(url: str, *, partition_actors: int = 1, timeout: float = 30.0,
               curve_dir: str | Path | None = None, process: subprocess.Popen | None = None) -> dict:
    """Block until the coordinator answers status with every actor healthy and offsets loaded."""
    from zbroker.actors.security import KeyRing
    from zbroker.protocol.errors import ZBrokerError
    from zbroker.client import Admin

    deadline = time.monotonic() + timeout
    last: Any = None
    curve = KeyRing(curve_dir).internal_client() if curve_dir else None
    with Admin(url, request_timeout=1.0, curve=curve) as admin:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise BrokerExited(f"broker at {url} exited with {process.returncode} before it was ready")
            try:
                status = admin.status()
                last = status
                actors = status["actors"]
                coord = next(a for a in actors if a["kind"] == "group-coordinator")
                parts = [a for a in actors if a["kind"] == "partition-log" and a.get("alive", a["healthy"])]
                if status["healthy"] and coord.get("offsets_loaded") and len(parts) >= partition_actors:
                    return status
            except ZBrokerError as err:
                last = err
            time.sleep(0.05)
    raise TimeoutError(f"broker at {url} not ready after {timeout}s: {last!r}")
