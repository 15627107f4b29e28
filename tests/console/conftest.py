"""A broker with its console actor on a free loopback port, and a way to read /metrics."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from zbroker.supervisor import free_port_block


class Console:
    def __init__(self, base: str, token: str | None = None) -> None:
        self.base = base
        self.token = token

    def get(self, path: str, timeout: float = 5.0) -> str:
        req = urllib.request.Request(self.base + path)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.read().decode()

    def samples(self) -> dict:
        """{(name, frozenset(labels)): value} of one scrape, parsed by prometheus_client."""
        out = {}
        for fam in text_string_to_metric_families(self.get("/metrics")):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until a scrape shows every actor (the console has sampled the broker)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                s = self.samples()
                kinds = {dict(k[1]).get("kind") for k in s if k[0] == "zbroker_actor_up" and s[k] == 1}
                if {"group-coordinator", "commit-writer", "partition-log", "console"} <= kinds:
                    return
                last = kinds
            except (urllib.error.URLError, ConnectionError, OSError) as err:
                last = err
            time.sleep(0.1)
        raise TimeoutError(f"the console at {self.base} did not show the broker: {last!r}")


def eventually(check, timeout: float = 30.0, what: str = "condition"):
    """Poll `check()` until it returns something truthy; its last value in the failure."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last and last is not None:
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what} not reached: {last!r}")


def labels(**kw) -> frozenset:
    return frozenset((k, str(v)) for k, v in kw.items())


@pytest.fixture
def console_broker(start):
    """(broker, Console) with the console on a free loopback port."""
    http_port = free_port_block(1)
    broker = start(http=f"127.0.0.1:{http_port}")
    console = Console(f"http://127.0.0.1:{http_port}")
    console.wait_ready()
    return broker, console
