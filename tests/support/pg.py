"""PostgreSQL for tests: a pytest fixture module (``from tests.support.pg import *``).

Which server
------------
1. ``ZBROKER_TEST_PG_DSN`` if set (it must answer: an explicit DSN that does
   not is a configuration error, never silently replaced);
2. else ``postgresql://postgres@127.0.0.1:5432/test`` if something answers there;
3. else a throwaway cluster started with ``initdb``/``pg_ctl`` (found on PATH or
   under /usr/lib/postgresql/*/bin) on a free loopback port, removed at the end
   of the session. ``ZBROKER_TEST_PG_THROWAWAY=1`` forces this path, to test it;
4. else the PostgreSQL tests are skipped with the reason, or FAIL when
   ``ZBROKER_REQUIRE_PG=1`` (CI), so a broken CI database cannot pass as green.

Isolation
---------
Runs share servers, so nothing is written outside a schema of our own:
``pg_schema`` is a fresh, empty schema ``zbt_<run>_<n>`` per test (dropped
after it), ``pg_schema_factory`` makes more when a test needs several, and
`with_schema` turns a DSN into an ``--offsets`` URL that uses the schema.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import glob
import itertools
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
RUN_ID = f"{os.getpid()}_{secrets.token_hex(3)}"
_schema_numbers = itertools.count(1)

__all__ = ["pg_dsn", "pg_schema", "pg_schema_factory", "with_schema", "dsn_via", "dsn_host_port",
           "pg_execute", "pg_fetch", "PgSession",
           "PgFrontendCounter", "ThrowawayCluster", "DEFAULT_DSN"]


# -- helpers usable from any test ------------------------------------------------------

def with_schema(dsn: str, schema: str) -> str:
    """An ``--offsets`` URL for `dsn` whose tables live in `schema`."""
    return f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"


def dsn_host_port(dsn: str) -> tuple[str, int]:
    parts = urlsplit(dsn)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def dsn_via(dsn: str, port: int, host: str = "127.0.0.1") -> str:
    """`dsn` pointed at another address (a `TcpProxy`), same user, database and options."""
    parts = urlsplit(dsn)
    userinfo, at, _hostport = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{host}:{port}"))


def _run_blocking(make_coro):
    """asyncio.run, also from inside a running loop (then on a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


def pg_execute(dsn: str, sql: str, *args) -> str:
    """Run one statement on a short-lived connection; blocking, callable from anywhere."""
    async def go() -> str:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return await conn.execute(sql, *args)
        finally:
            await conn.close()

    return _run_blocking(go)


def pg_fetch(dsn: str, sql: str, *args) -> list[asyncpg.Record]:
    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            return await conn.fetch(sql, *args)
        finally:
            await conn.close()

    return _run_blocking(go)


def redact(dsn: str) -> str:
    parts = urlsplit(dsn)
    if parts.password:
        return dsn.replace(f":{parts.password}@", ":***@")
    return dsn


def probe(dsn: str, timeout: float = 3.0) -> str | None:
    """None if `dsn` answers, else why not."""
    try:
        _select_one(dsn, timeout)
    except Exception as exc:  # any reason at all is a reason to look elsewhere
        return f"{type(exc).__name__}: {exc}"
    return None


def _select_one(dsn: str, timeout: float) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(dsn, timeout=timeout)
        try:
            await conn.fetchval("SELECT 1", timeout=timeout)
        finally:
            await conn.close()

    _run_blocking(go)


class PgSession:
    """A blocking PostgreSQL connection for test code: asyncpg on its own loop thread.

    For polling (pg_stat_activity, table snapshots) from synchronous tests
    without paying a connection per query. Close it.
    """

    def __init__(self, dsn: str, timeout: float = 10.0) -> None:
        self._timeout = timeout
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pg-session", daemon=True)
        self._thread.start()
        try:
            self._conn = self._call(asyncpg.connect(dsn, timeout=timeout))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro):
        with self._lock:  # one connection: one query at a time, whichever thread asks
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result(self._timeout)

    def fetch(self, sql: str, *args) -> list[asyncpg.Record]:
        return self._call(self._conn.fetch(sql, *args))

    def fetchval(self, sql: str, *args):
        return self._call(self._conn.fetchval(sql, *args))

    def execute(self, sql: str, *args) -> str:
        return self._call(self._conn.execute(sql, *args))

    def close(self) -> None:
        try:
            self._call(self._conn.close(timeout=self._timeout))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "PgSession":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class PgFrontendCounter:
    """Counts PostgreSQL frontend messages by type, fed by `TcpProxy(tap=...)`.

    ``counts["E"] + counts["Q"]`` is the number of statements executed
    (extended-protocol Execute, simple Query); ``counts["S"]`` the Syncs,
    i.e. round trips of the extended protocol. Needs an unencrypted
    connection (``sslmode=disable``).
    """

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._bufs: dict[int, bytearray] = {}
        self._started: set[int] = set()
        self._lock = threading.Lock()

    def __call__(self, conn_id: int, data: bytes) -> None:
        with self._lock:
            buf = self._bufs.setdefault(conn_id, bytearray())
            buf += data
            while True:
                if conn_id not in self._started:
                    # Untyped: SSLRequest, GSSENCRequest or the StartupMessage (protocol 3.0).
                    if len(buf) < 8 or len(buf) < int.from_bytes(buf[:4], "big"):
                        return
                    n = int.from_bytes(buf[:4], "big")
                    if int.from_bytes(buf[4:8], "big") == 196608:
                        self._started.add(conn_id)
                    del buf[:n]
                    continue
                if len(buf) < 5:
                    return
                n = int.from_bytes(buf[1:5], "big")
                if len(buf) < 1 + n:
                    return
                self.counts[chr(buf[0])] += 1
                del buf[:1 + n]

    @property
    def statements(self) -> int:
        return self.counts["E"] + self.counts["Q"]

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()


# -- a private cluster -------------------------------------------------------------------

def find_pg_bindir() -> str | None:
    for candidate in [os.path.dirname(shutil.which("pg_ctl") or "")] + sorted(
            glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True):
        if candidate and all(os.access(os.path.join(candidate, b), os.X_OK) for b in ("initdb", "pg_ctl")):
            return candidate
    return None


def _version_key(path: str) -> float:
    try:
        return float(path.split("/")[-2])
    except ValueError:
        return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThrowawayCluster:
    """initdb + pg_ctl on a loopback port; for when no server is given. Never touches another cluster.

    PostgreSQL refuses to run as root, so as root the cluster runs as the
    ``postgres`` system user (via runuser) in a directory it owns.
    """

    def __init__(self, bindir: str) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.base = tempfile.mkdtemp(prefix="zbroker-pg-")
        self.datadir = os.path.join(self.base, "data")
        self._prefix: list[str] = []
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam("postgres")  # KeyError: no way to run PostgreSQL here
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
            self._prefix = ["runuser", "-u", "postgres", "--"]

    def _run(self, *args: str, timeout: float = 60) -> None:
        subprocess.run([*self._prefix, *args], check=True, capture_output=True, timeout=timeout)

    def start(self) -> str:
        self._run(os.path.join(self.bindir, "initdb"), "-D", self.datadir, "-U", "postgres", "-A", "trust",
                  "-E", "UTF8", "--locale=C", "--no-sync")
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.base} "
                "-c fsync=off -c full_page_writes=off -c max_connections=50")
        self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.datadir, "-l",
                  os.path.join(self.base, "server.log"), "-o", opts, "-w", "-t", "30", "start")
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        try:
            self._run(os.path.join(self.bindir, "pg_ctl"), "-D", self.datadir, "-m", "immediate", "stop")
        except (subprocess.SubprocessError, OSError):
            pass
        shutil.rmtree(self.base, ignore_errors=True)


# -- fixtures ----------------------------------------------------------------------------

def _unavailable(reason: str) -> None:
    if os.environ.get("ZBROKER_REQUIRE_PG") == "1":
        pytest.fail(f"ZBROKER_REQUIRE_PG=1 and PostgreSQL is not available: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL not available: {reason}")


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """A DSN of a PostgreSQL server the tests may create schemas in (see module doc)."""
    explicit = os.environ.get("ZBROKER_TEST_PG_DSN")
    forced = os.environ.get("ZBROKER_TEST_PG_THROWAWAY") == "1"
    if explicit and not forced:
        why = probe(explicit)
        if why:
            _unavailable(f"ZBROKER_TEST_PG_DSN={redact(explicit)} does not answer ({why})")
        yield explicit
        return
    default_why = "skipped (ZBROKER_TEST_PG_THROWAWAY=1)" if forced else probe(DEFAULT_DSN)
    if default_why is None:
        yield DEFAULT_DSN
        return
    bindir = find_pg_bindir()
    if bindir is None:
        _unavailable(f"ZBROKER_TEST_PG_DSN is unset, {DEFAULT_DSN} does not answer ({default_why}), "
                     "and no initdb/pg_ctl to start a throwaway cluster")
    try:
        cluster = ThrowawayCluster(bindir)
    except (KeyError, OSError) as exc:
        _unavailable(f"cannot prepare a throwaway cluster: {type(exc).__name__}: {exc}")
    try:
        dsn = cluster.start()
    except (subprocess.SubprocessError, OSError) as exc:
        cluster.stop()
        detail = getattr(exc, "stderr", b"") or b""
        _unavailable(f"throwaway cluster failed to start: {exc} {detail.decode(errors='replace')[-500:]}")
    try:
        yield dsn
    finally:
        cluster.stop()


@pytest.fixture
def pg_schema_factory(pg_dsn: str) -> Iterator:
    """Call it to get a new empty schema (``zbt_<run>_<n>``); all are dropped after the test."""
    made: list[str] = []

    def make() -> str:
        name = f"zbt_{RUN_ID}_{next(_schema_numbers)}"
        pg_execute(pg_dsn, f'CREATE SCHEMA "{name}"')
        made.append(name)
        return name

    yield make
    for name in made:
        pg_execute(pg_dsn, f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
def pg_schema(pg_schema_factory) -> str:
    """A fresh, empty schema for this test, dropped afterwards."""
    return pg_schema_factory()
