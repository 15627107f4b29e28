"""Chaos-run plumbing: a time budget that follows ``--chaos-duration``.

The suite-wide limits (``timeout = 480``, ``faulthandler_timeout = 540``)
suit ordinary tests; the chaos run lasts its duration plus the drain, so it
gets its own pytest-timeout budget here, and a faulthandler dump armed for
that budget instead of the suite's 540 s when it is longer.
"""

from __future__ import annotations

import faulthandler

import pytest

# Seconds around the nemesis phase: broker start, the drain (bounded by
# ChaosConfig.drain_timeout_s), reading the logs, the checker, teardown.
OVERHEAD_S = 150.0


def chaos_budget(config) -> float:
    return config.getoption("--chaos-duration") + OVERHEAD_S


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("chaos") and "chaos_duration" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(chaos_budget(config)))


@pytest.fixture
def chaos_duration(request) -> float:
    budget = chaos_budget(request.config)
    suite_dump = float(request.config.getini("faulthandler_timeout") or 0)
    if suite_dump and budget > suite_dump:
        # pytest armed a traceback dump at faulthandler_timeout; a long run is not a hang.
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        fd = request.config.stash.get(fault_handler_stderr_fd_key, None)
        if fd is not None:
            faulthandler.dump_traceback_later(budget + 30, file=fd)
    return float(request.config.getoption("--chaos-duration"))
