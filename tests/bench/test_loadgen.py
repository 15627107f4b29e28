"""bench/loadgen/zbload.c against a real broker: it produces, consumes and acks what it says.

The capacity rows trust its counts, so the broker's own view is checked: the log
holds what the load generator says it produced, and the group's committed offset
reaches what it says it acked.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from bench.zbroker_adapter import LOADGEN
from zbroker.client import Admin

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def zbload() -> str:
    built = subprocess.run(["make", "-s", "-C", str(LOADGEN).rsplit("/", 1)[0]], capture_output=True, text=True)
    assert built.returncode == 0, f"zbload did not build (make loadgen installs what it needs): {built.stderr}"
    return LOADGEN


def _run(*args: str) -> dict:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_zbload_produces_and_consumes_what_the_broker_then_holds_and_commits(zbload, broker):
    with Admin(broker.url) as admin:
        admin.create_topic("cap", partitions=3)
        produced = _run(zbload, "produce", broker.url, "cap", "5000", "100", "1000", "250")
        assert produced["records"] == 5000 and produced["requests"] >= 20 and produced["cpu_s"] >= 0
        # describe_topic shows log ends as last reported by the partition actor (PROTOCOL.md:
        # a report follows an append within REPORT_PACE_MS, and may trail the produce reply).
        deadline = time.monotonic() + 10
        while True:
            ends = {p["partition"]: p["log_end"] for p in admin.describe_topic("cap")["partitions"]}
            if sum(ends.values()) >= 5000 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert sum(ends.values()) == 5000 and all(ends.values())  # round-robin over all three
        consumed = _run(zbload, "consume", broker.url, "cap", "g", "5000", "1000")
        assert consumed["records"] == 5000  # acknowledged, as the coordinator counted them
        assert admin.describe_group("g")["max_in_flight"] == 1000  # the window bounds what is unacked
        deadline = time.monotonic() + 30
        while True:
            committed = {p["partition"]: p["committed"] for p in admin.describe_group("g")["partitions"]}
            if committed == ends or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert committed == ends


def test_zbload_fails_loudly_on_an_unknown_topic(zbload, broker):
    done = subprocess.run([zbload, "produce", broker.url, "missing", "10", "100", "10", "10"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "missing" in done.stderr
