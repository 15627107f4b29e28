"""A partition actor on "another host": what a broker bound to every interface tells its peers.

Only loopback addresses may be used here, so the other host is 127.0.0.2 (all of
127/8 is this machine's loopback) with a data directory of its own, which makes it
another storage to the coordinator, as another machine's disk would be. Everything a
client dials comes from the broker (the URL, `metadata`'s endpoints, `hello`'s
internal endpoint), so an address that names the wrong host shows up as records that
cannot be produced or consumed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from zbroker.actors import runtime
from zbroker.client import Admin, Consumer, Producer
from zbroker.supervisor import start_broker

pytestmark = pytest.mark.processes

OTHER_HOST = "127.0.0.2"


def _zbroker(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zbroker", *args], capture_output=True, text=True, timeout=60, **kw)


def test_a_wildcard_bind_advertises_the_hosts_peers_dial_and_serves_another_hosts_actor(tmp_path):
    handle = start_broker(tmp_path / "near", host="0.0.0.0", advertise_host="127.0.0.1",
                          log_file=tmp_path / "broker.log")
    far_log = open(tmp_path / "far.log", "w")
    far = subprocess.Popen(
        [sys.executable, "-m", "zbroker", "partition", "--broker", handle.url, "--data", str(tmp_path / "far"),
         "--bind", "tcp://0.0.0.0:0", "--advertise-host", OTHER_HOST, "--actor-id", "far", "--log-level", "warning"],
        stdout=far_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert handle.url.startswith("tcp://127.0.0.1:")
        with Admin(handle.url) as admin:
            assert admin.hello()["internal_endpoint"] == f"tcp://127.0.0.1:{handle.config.port + 1}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                actors = {a["actor_id"]: a for a in admin.status()["actors"] if a.get("kind") == "partition-log"}
                if "far" in actors and actors["far"]["healthy"]:
                    break
                time.sleep(0.1)
            assert {"p0", "far"} <= set(actors), (tmp_path / "far.log").read_text()
            # Neither names 0.0.0.0, which every peer would take for itself.
            assert actors["p0"]["endpoint"] == f"tcp://127.0.0.1:{handle.config.port + 2}"
            assert runtime.endpoint_host(actors["far"]["endpoint"]) == OTHER_HOST
            admin.create_topic("spread", partitions=4)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                parts = admin.describe_topic("spread")["partitions"]
                if all(p.get("endpoint") for p in parts):
                    break
                time.sleep(0.1)
            hosts = sorted(runtime.endpoint_host(p["endpoint"]) for p in parts)
        assert hosts == ["127.0.0.1", "127.0.0.1", OTHER_HOST, OTHER_HOST], parts

        values = [f"r{i}".encode() for i in range(400)]
        with Producer(handle.url) as producer:
            for i, value in enumerate(values):
                producer.send("spread", value, partition=i % 4)
            producer.flush()
        got = []
        with Consumer(handle.url, group="g", topics=["spread"]) as consumer:
            deadline = time.monotonic() + 60
            while len(got) < len(values) and time.monotonic() < deadline:
                records = consumer.poll(timeout=0.5)
                got += [r.value for r in records]
                consumer.ack_many(records)
            consumer.flush_acks()
        assert sorted(got) == sorted(values)
    finally:
        far.send_signal(signal.SIGTERM)
        far.wait(20)
        far_log.close()
        handle.stop()


def test_a_wildcard_bind_without_an_advertised_host_is_refused_before_anything_starts(tmp_path):
    port = str(_free_port())
    up = _zbroker("up", "--data", str(tmp_path / "data"), "--host", "0.0.0.0", "--port", port)
    assert up.returncode == 1
    assert "error: CONFIG: --host: tcp://0.0.0.0:" in up.stderr and "--advertise-host" in up.stderr
    assert not (tmp_path / "data" / "partitions").exists()
    # Checked before the broker is asked anything: there is none at this URL.
    part = _zbroker("partition", "--broker", f"tcp://127.0.0.1:{port}", "--data", str(tmp_path / "p"),
                    "--bind", "tcp://*:0")
    assert part.returncode == 1
    assert "error: CONFIG: --bind: tcp://*:0 listens on every interface" in part.stderr, part.stderr


def _free_port() -> int:
    from zbroker.supervisor import free_port_block
    return free_port_block(2)


def test_advertised_endpoints():
    assert runtime.advertised_endpoint("tcp://127.0.0.1:7402", None) == "tcp://127.0.0.1:7402"
    assert runtime.advertised_endpoint("tcp://0.0.0.0:7402", "broker-1.example") == "tcp://broker-1.example:7402"
    assert runtime.advertised_endpoint("tcp://10.0.0.5:7402", "10.0.0.6") == "tcp://10.0.0.6:7402"
    assert runtime.advertised_endpoint("tcp://0.0.0.0:7402", "fe80::1") == "tcp://[fe80::1]:7402"
    with pytest.raises(ValueError, match="listens on every interface"):
        runtime.advertised_endpoint("tcp://0.0.0.0:7402", None)
    assert runtime.wildcard_error("tcp://127.0.0.2:1") is None
