"""Chaos-run plumbing: time budgets that follow ``--chaos-duration``, and the broker under test.

The suite-wide limits (``timeout = 480``, ``faulthandler_timeout = 540``)
suit ordinary tests; a chaos run lasts its duration plus the drain, so it
gets its own pytest-timeout budget here, and a faulthandler dump armed for
that budget instead of the suite's 540 s when it is longer.

Without ``--chaos-duration`` (as in ``make test``) the single-host run lasts
180 s, the replicated and the cluster ones 60 s; ``make chaos DURATION=1800``
gives all the same.
"""

from __future__ import annotations

import faulthandler

import pytest

from tests.chaos.workload import Reaper
from tests.support.pg import dsn_host_port, dsn_via, with_schema
from tests.support.tcp_proxy import TcpProxy

# Seconds around the nemesis phase: broker start, the drain (bounded by
# ChaosConfig.drain_timeout_s), reading the logs, the checker, teardown.
OVERHEAD_S = 150.0
# The replicated run also waits for the replica sets to move, and at the end for
# every replica to catch up, and reads every host's logs.
REPLICATED_OVERHEAD_S = 300.0
# The cluster run also waits for a paused leader's successor and for the cluster to heal.
CLUSTER_OVERHEAD_S = 300.0
DEFAULT_DURATION_S = {"chaos_duration": 180.0, "replicated_chaos_duration": 60.0, "cluster_chaos_duration": 60.0}
OVERHEAD_BY_FIXTURE = {"replicated_chaos_duration": REPLICATED_OVERHEAD_S, "cluster_chaos_duration": CLUSTER_OVERHEAD_S}


def duration_for(config, fixture: str) -> float:
    given = config.getoption("--chaos-duration")
    return float(given) if given is not None else DEFAULT_DURATION_S[fixture]


def chaos_budget(config, fixture: str = "chaos_duration") -> float:
    overhead = OVERHEAD_BY_FIXTURE.get(fixture, OVERHEAD_S)
    return duration_for(config, fixture) + overhead


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not item.get_closest_marker("chaos"):
            continue
        for fixture in DEFAULT_DURATION_S:
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.timeout(chaos_budget(config, fixture)))


def _arm_dump(request, fixture: str) -> float:
    budget = chaos_budget(request.config, fixture)
    suite_dump = float(request.config.getini("faulthandler_timeout") or 0)
    if suite_dump and budget > suite_dump:
        # pytest armed a traceback dump at faulthandler_timeout; a long run is not a hang.
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        fd = request.config.stash.get(fault_handler_stderr_fd_key, None)
        if fd is not None:
            faulthandler.dump_traceback_later(budget + 30, file=fd)
    return duration_for(request.config, fixture)


@pytest.fixture
def chaos_duration(request) -> float:
    return _arm_dump(request, "chaos_duration")


@pytest.fixture
def replicated_chaos_duration(request) -> float:
    return _arm_dump(request, "replicated_chaos_duration")


@pytest.fixture
def cluster_chaos_duration(request) -> float:
    return _arm_dump(request, "cluster_chaos_duration")


def open_chaos_broker(start, pg_dsn: str, schema: str, partition_actors: int):
    """A broker whose commit writer reaches PostgreSQL through a cuttable proxy, in a fresh schema.

    A generator for a fixture: teardown order is the broker first (so no writer can
    re-create the schema), then the proxy; pg_schema_factory drops the schema after that.
    """
    proxy = TcpProxy(dsn_host_port(pg_dsn)).start()
    actors = Reaper()
    broker = None
    try:
        broker = start(partition_actors=partition_actors, offsets_url=with_schema(dsn_via(pg_dsn, proxy.port), schema))
        yield broker, proxy, schema, actors
    finally:
        if broker is not None:
            for pid in broker.pids().values():
                actors.remember(pid)
            proxy.restore()  # let the writer flush what it holds while it stops
            broker.stop()
            actors.kill_all()  # whatever outlived its supervisor
        proxy.close()
