"""Replication under CurveZMQ: followers dial their leaders with the broker's own key, so a
broker started with --curve replicates (before, their plaintext DEALERs never completed the
handshake, no follower caught up, and every acks=all produce waited for ever); a client key
may not send replica_fetch, which reads any topic and can depose a leader."""

from __future__ import annotations

import json

import pytest

from tests.support.waiting import wait_for
from zbroker.actors.security import ClientKeys, KeyRing, keygen
from zbroker.client import Admin, Producer, Connection
from zbroker.protocol import messages as m
from zbroker.protocol.errors import Unauthorized

pytestmark = pytest.mark.processes


@pytest.fixture
def keys(tmp_path):
    directory = tmp_path / "keys"
    keygen(directory, clients=["app"])
    (directory / "acl.json").write_text(json.dumps({"app": {"produce": "*", "consume": "*", "admin": True}}))
    return directory


def test_a_curve_broker_replicates_and_refuses_replica_fetch_from_a_client_key(start, keys):
    app = ClientKeys.load(keys / "server.key", keys / "clients" / "app.key_secret")
    broker = start(curve_dir=keys, partition_actors=3, extra_args=("--actor-dirs",))
    with Admin(broker.url, curve=app) as admin:
        admin.create_topic("sealed", partitions=1, replication_factor=3)
        with Producer(broker.url, curve=app, linger_ms=1) as producer:
            handles = [producer.send("sealed", b"r%d" % i, partition=0) for i in range(50)]
            producer.flush(timeout=60)  # acks=all: acknowledged only once a follower holds each batch
        assert all(h.error is None for h in handles)

        def replicated():
            p = admin.describe_topic("sealed")["partitions"][0]
            ends = p["replica_log_ends"]
            return p if len(p["isr"]) == 3 and all(ends.get(r) == 50 for r in p["replicas"]) else None
        p = wait_for(replicated, 60, "every replica to hold the 50 records")
    conn = Connection(broker.url, curve=app)
    try:
        with pytest.raises(Unauthorized):
            conn.call(p["endpoint"], m.ReplicaFetch("sealed", 0, "intruder", p["leader_epoch"] + 1, 0, -1))
    finally:
        conn.close()


def test_replica_fetch_is_an_internal_op_in_the_acl(keys):
    ring = KeyRing(str(keys))
    acl = ring.acl()
    app_key = ClientKeys.load(keys / "server.key", keys / "clients" / "app.key_secret").public.decode()
    with pytest.raises(Unauthorized):
        acl.check(app_key, "replica_fetch", m.ReplicaFetch("t", 0, "x", 0, 0, -1))
    acl.check(ring.public.decode(), "replica_fetch", m.ReplicaFetch("t", 0, "x", 0, 0, -1))
