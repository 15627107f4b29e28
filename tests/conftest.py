"""Fixtures shared by every test directory.

`broker` starts a real ``zbroker up`` process tree on free loopback ports and a
temporary data directory, waits until every actor reports healthy (readiness
is signalled by the coordinator's status, never guessed with a sleep), and
stops it afterwards. When a test fails, the tail of the broker's log is
printed with the failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.pg import *  # noqa: F401,F403  (pg_dsn, pg_schema: one session fixture for every directory)
from zbroker.supervisor import BrokerHandle, start_broker

# A test that starts a process must carry the `processes` marker (make test-fast leaves those out).
pytest_plugins = ["tests.support.process_guard"]


def pytest_addoption(parser):
    parser.addoption("--chaos-duration", type=float, default=None,
                     help="seconds of nemesis activity in the chaos runs (make chaos DURATION=...); "
                          "by default 180 for the single-host run, 60 for the replicated one")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _dump_log_on_failure(request, log_file: Path) -> None:
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed and log_file.exists():
        lines = log_file.read_text(errors="replace").splitlines()[-80:]
        print(f"\n--- last {len(lines)} lines of {log_file} ---")
        print("\n".join(lines))


@pytest.fixture
def start(tmp_path, request):
    """Factory: start(**options) -> BrokerHandle; all are stopped at teardown."""
    handles: list[BrokerHandle] = []
    log_file = tmp_path / "broker.log"

    def _start(data_dir: Path | None = None, **options) -> BrokerHandle:
        options.setdefault("log_level", "info")
        handle = start_broker(data_dir or tmp_path / "data", log_file=log_file, **options)
        handles.append(handle)
        return handle

    yield _start
    for handle in handles:
        handle.stop()
    _dump_log_on_failure(request, log_file)


@pytest.fixture
def broker(start) -> BrokerHandle:
    return start()
