"""The guard in tests/support/process_guard.py fails a test that starts a process unmarked.

Shown on crafted test files run by an inner pytest: each way of starting a
process without the `processes` marker fails, and the same tests with the
marker (or starting nothing) pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]

CONFTEST = '''
import pytest

pytest_plugins = ["tests.support.process_guard"]


@pytest.fixture
def broker():
    return "a broker would start here"
'''

TESTS = '''
import multiprocessing
import subprocess
import sys

import pytest


def _child():
    pass


def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_multiprocessing():
    p = multiprocessing.get_context("spawn").Process(target=_child)
    p.start()
    p.join()


def test_unmarked_broker_fixture(broker):
    pass


@pytest.fixture
def spawning_fixture():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_spawn_in_a_fixture(spawning_fixture):
    pass


@pytest.mark.processes
def test_marked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.processes
def test_marked_broker_fixture(broker):
    pass


def test_pure():
    assert 1 + 1 == 2
'''


def test_an_unmarked_test_that_starts_a_process_fails_and_a_marked_one_passes(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_crafted.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    processes: starts processes\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    outcomes = {}
    for line in proc.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            outcomes[rest.split("::")[1].split(" ")[0]] = word
    assert outcomes == {
        "test_unmarked_subprocess": "FAILED",
        "test_unmarked_multiprocessing": "FAILED",
        "test_unmarked_broker_fixture": "ERROR",
        "test_unmarked_spawn_in_a_fixture": "ERROR",
        "test_marked_subprocess": "PASSED",
        "test_marked_broker_fixture": "PASSED",
        "test_pure": "PASSED",
    }, proc.stdout
    assert proc.stdout.count("is not marked `processes`") >= 4, proc.stdout
