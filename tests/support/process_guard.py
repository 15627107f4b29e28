"""The `processes` marker cannot be forgotten: a test that starts a process without it fails.

`make test-fast` selects `-m "not processes and not postgres and not node"`, so
a test that spawns a process but lacks the marker would slip into the fast run
(and into any run that must not start processes). Two checks, both loaded by
tests/conftest.py:

* before its fixtures are set up, a test that uses one known to start a broker
  tree (``BROKER_FIXTURES``) without the marker fails, before anything starts;
* while a test runs (setup, call and teardown), ``subprocess.Popen`` and
  ``multiprocessing``'s ``Process.start`` fail for a test without the marker,
  which catches every other way of starting one (a helper, a CLI call, a pool).

A ``postgres`` test may spawn too: without a DSN, tests/support/pg.py starts a
throwaway cluster for the session, and `test-fast` deselects those tests anyway.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest

MARKER = "processes"
ALSO_ALLOWED = ("postgres",)
BROKER_FIXTURES = frozenset({"start", "broker"})

_current: pytest.Item | None = None
_originals: dict[str, object] = {}


class MissingProcessesMarker(Exception):
    pass


def _allowed(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in (MARKER, *ALSO_ALLOWED))


def _check(what: str) -> None:
    item = _current
    if item is not None and not _allowed(item):
        raise MissingProcessesMarker(
            f"{item.nodeid} starts a process ({what}) but is not marked `processes`: "
            f"add `pytestmark = pytest.mark.processes` (or mark the test) so that "
            f"`make test-fast` leaves it out")


def _guarded_execute_child(self, args, *rest, **kw):
    _check(f"subprocess {args!r}"[:200])
    return _originals["execute_child"](self, args, *rest, **kw)


def _guarded_process_start(self):
    _check(f"multiprocessing {self.name}")
    return _originals["process_start"](self)


def pytest_configure(config):
    if _originals:
        return
    _originals["execute_child"] = subprocess.Popen._execute_child
    _originals["process_start"] = multiprocessing.process.BaseProcess.start
    subprocess.Popen._execute_child = _guarded_execute_child
    multiprocessing.process.BaseProcess.start = _guarded_process_start


def pytest_unconfigure(config):
    if _originals:
        subprocess.Popen._execute_child = _originals.pop("execute_child")
        multiprocessing.process.BaseProcess.start = _originals.pop("process_start")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    used = BROKER_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if used and not _allowed(item):
        raise MissingProcessesMarker(
            f"{item.nodeid} uses the fixture(s) {', '.join(sorted(used))}, which start a broker, "
            f"but is not marked `processes`")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _current
    _current = item
    try:
        yield
    finally:
        _current = None
