"""CurveZMQ: strangers are refused and logged, allowed clients work, ACLs limit topics."""

from __future__ import annotations

import json

import pytest
import zmq
import zmq.auth

from actors.security import Acl, ClientKeys, KeyRing, Permissions, keygen
from protocol import codec
from protocol import messages as m
from protocol.errors import RequestTimeout, Unauthorized, Unavailable
from zbroker.client import Admin, Consumer, Producer

pytestmark = pytest.mark.processes


@pytest.fixture
def keys(tmp_path):
    directory = tmp_path / "keys"
    keygen(directory, clients=["app", "reader"])
    (directory / "acl.json").write_text(json.dumps({
        "app": {"produce": "*", "consume": "*", "admin": True},
        "reader": {"produce": [], "consume": ["public"]},
    }))
    return directory


def client(keys_dir, name: str) -> ClientKeys:
    return ClientKeys.load(keys_dir / "server.key", keys_dir / "clients" / f"{name}.key_secret")


def test_unauthenticated_and_wrong_key_clients_are_refused_while_an_allowed_client_works(start, keys, tmp_path):
    broker = start(curve_dir=keys)
    app = client(keys, "app")
    with Admin(broker.url, curve=app) as admin:
        admin.create_topic("secret", partitions=1)
        admin.create_topic("public", partitions=1)
    with Producer(broker.url, curve=app) as producer:
        producer.produce("secret", [b"classified"])
        producer.produce("public", [b"hello"])
    with Consumer(broker.url, group="g", topics=["secret"], curve=app) as consumer:
        [rec] = consumer.poll(timeout=2.0)
        assert rec.value == b"classified"
        consumer.ack(rec)

    # No keys at all: the handshake never completes, so no request gets through.
    with Admin(broker.url, request_timeout=1.0) as stranger:
        with pytest.raises((RequestTimeout, Unavailable)):
            stranger.status()
    # A well-formed key pair the broker has never heard of.
    rogue_dir = tmp_path / "rogue"
    rogue_dir.mkdir()
    _pub, secret_file = zmq.auth.create_certificates(str(rogue_dir), "rogue")
    rogue = ClientKeys.load(keys / "server.key", secret_file)
    with Admin(broker.url, request_timeout=1.0, curve=rogue) as intruder:
        with pytest.raises((RequestTimeout, Unavailable)):
            intruder.metadata()
    # The data plane refuses it too: a raw fetch straight at the partition actor.
    with Admin(broker.url, curve=app) as admin:
        endpoint = admin.metadata(["secret"])[0]["partitions"][0]["endpoint"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    rogue.apply(sock)
    sock.connect(endpoint)
    try:
        sock.send_multipart(codec.encode_request(m.Fetch(topic="secret", partition=0, offset=0), 1))
        assert sock.poll(1500) == 0  # never a byte of data
    finally:
        sock.close(linger=0)
        ctx.term()
    log = (tmp_path / "broker.log").read_text()
    assert "auth.refused" in log


def test_acl_limits_a_client_to_named_topics(start, keys):
    broker = start(curve_dir=keys)
    with Admin(broker.url, curve=client(keys, "app")) as admin:
        admin.create_topic("secret", partitions=1)
        admin.create_topic("public", partitions=1)
    with Producer(broker.url, curve=client(keys, "app")) as producer:
        producer.produce("public", [b"for everyone"])
    reader = client(keys, "reader")
    with Producer(broker.url, curve=reader, retries=0) as producer:
        producer.send("public", b"nope")
        with pytest.raises(Exception) as info:
            producer.flush()
        assert "UNAUTHORIZED" in repr(info.value) or "may not produce" in str(info.value)
    with Admin(broker.url, curve=reader) as admin:
        with pytest.raises(Unauthorized):
            admin.create_topic("mine", partitions=1)
    with pytest.raises(Unauthorized):
        Consumer(broker.url, group="r", topics=["secret"], curve=reader, heartbeat=False)
    with Consumer(broker.url, group="r", topics=["public"], curve=reader) as consumer:
        [rec] = consumer.poll(timeout=2.0)
        assert rec.value == b"for everyone"
        consumer.ack(rec)


def test_acl_decisions_are_pure():
    perms = {"K1": Permissions.from_dict({"produce": ["a"], "consume": "*"}), "K2": Permissions()}
    acl = Acl("BROKER", perms, {"K1": "one", "K2": "two"})
    acl.check("BROKER", "register", None)
    acl.check("K1", "produce", m.Produce(topic="a", partition=0))
    with pytest.raises(Unauthorized) as info:
        acl.check("K1", "produce", m.Produce(topic="b", partition=0))
    assert info.value.data == {"client": "one", "op": "produce", "action": "produce", "topic": "b"}
    with pytest.raises(Unauthorized):
        acl.check("K1", "create_topic", m.CreateTopic(topic="x"))
    acl.check("K2", "create_topic", m.CreateTopic(topic="x"))  # no acl entry: full client rights
    with pytest.raises(Unauthorized):
        acl.check("K2", "advance", m.Advance(advances=[]))  # internal ops: broker only
    with pytest.raises(Unauthorized):
        acl.check("NOBODY", "status", m.Status())
    with pytest.raises(ValueError):
        Permissions.from_dict({"produce": "a"})


def test_keygen_is_idempotent_and_keeps_secrets_private(tmp_path):
    first = keygen(tmp_path / "k", clients=["a"])
    assert set(first) == {"server", "a"}
    assert keygen(tmp_path / "k", clients=["a"]) == {}
    assert (tmp_path / "k" / "server.key_secret").stat().st_mode & 0o077 == 0
    ring = KeyRing(tmp_path / "k")
    assert ring.names[zmq.auth.load_certificate(str(tmp_path / "k" / "clients" / "a.key"))[0].decode()] == "a"


@pytest.mark.parametrize("only", ["ZBROKER_CURVE_SERVER_KEY", "ZBROKER_CURVE_KEY"])
def test_one_curve_variable_without_the_other_is_an_error_not_plaintext(monkeypatch, keys, only):
    # With one set the client fell back to plaintext, and a CURVE broker answered nothing:
    # UNAVAILABLE after the request timeout, with no hint of the missing variable.
    from zbroker.client import Connection
    from zbroker.client.aio import AsyncConnection

    monkeypatch.delenv("ZBROKER_CURVE_SERVER_KEY", raising=False)
    monkeypatch.delenv("ZBROKER_CURVE_KEY", raising=False)
    monkeypatch.setenv(only, str(keys / "server.key"))
    for make in (Connection, AsyncConnection):
        with pytest.raises(ValueError, match="set both"):
            make("tcp://127.0.0.1:1")
