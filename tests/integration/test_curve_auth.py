"""CurveZMQ: strangers are refused and logged, allowed clients work, ACLs limit topics."""

from __future__ import annotations

import json
import os

import pytest
import zmq
import zmq.auth

from zbroker.actors.security import Acl, ClientKeys, KeyRing, Permissions, keygen
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import RequestTimeout, Unauthorized, Unavailable
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


def test_acks_riding_on_a_poll_need_consume_on_their_topics_like_an_ack(start, keys):
    # `ack` checked the topics of its ranges, but the same acks riding on a `poll`
    # (Poll.acks) were not checked at all. describe_group names every member and its
    # generation, so "reader" (consume: ["public"] only) could poll as another client's
    # member of a group on "secret" and ack its records: the group's consumers never saw them.
    from zbroker.client import Connection

    broker = start(curve_dir=keys)
    app = client(keys, "app")
    with Admin(broker.url, curve=app) as admin:
        admin.create_topic("secret", partitions=1)
    with Producer(broker.url, curve=app) as producer:
        producer.produce("secret", [b"one", b"two", b"three"])
    with Consumer(broker.url, group="billing", topics=["secret"], curve=app, heartbeat=False) as victim:
        with Admin(broker.url, curve=client(keys, "reader")) as spy:
            group = spy.describe_group("billing")
        [member] = group["members"]
        conn = Connection(broker.url, curve=client(keys, "reader"))
        try:
            poll = m.Poll(group="billing", member_id=member["member_id"], generation=group["generation"],
                          max_records=10, max_wait_ms=1000)
            deliveries = conn.coordinator(poll).deliveries
            assert deliveries, "the poll leased nothing to ack"
            acks = [[t, p, lease, start_, end] for t, p, lease, start_, end, *_ in deliveries]
            with pytest.raises(Unauthorized):  # the plain ack is refused...
                conn.coordinator(m.Ack(group="billing", member_id=member["member_id"],
                                       generation=group["generation"], ranges=acks))
            with pytest.raises(Unauthorized):  # ...and so must the same acks on a poll be
                conn.coordinator(m.Poll(group="billing", member_id=member["member_id"],
                                        generation=group["generation"], acks=acks))
        finally:
            conn.close()
        with Admin(broker.url, curve=app) as admin:
            [partition] = admin.describe_group("billing")["partitions"]
        assert partition["committed_pending"] in (None, 0)


@pytest.mark.parametrize("command", ["up", "partition"])
def test_an_empty_curve_directory_is_refused_not_taken_as_plaintext(tmp_path, command):
    # `--curve "$KEYS"` with KEYS unset passes an empty path, and every actor read
    # `if curve_dir:` as "no CURVE": the broker served everyone in plaintext, with no
    # word of it, to an operator who asked for encryption and authentication.
    import signal
    import subprocess
    import sys

    from zbroker.supervisor import free_port_block

    port = free_port_block(4)
    args = (["--data", str(tmp_path / "data"), "--port", str(port), "--http", "off"] if command == "up" else
            ["--data", str(tmp_path / "parts"), "--broker", f"tcp://127.0.0.1:{port}"])
    proc = subprocess.Popen([sys.executable, "-m", "zbroker", command, *args, "--curve", ""],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        if command == "up":  # still running: show what it serves, and to whom
            with Admin(f"tcp://127.0.0.1:{port}", request_timeout=2.0) as stranger:
                served = stranger.status()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.communicate(timeout=30)
            pytest.fail(f"an empty --curve started a plaintext broker that answers anyone: {served}")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        pytest.fail("an empty --curve started a partition actor without CURVE")
    assert proc.returncode == 1 and "error: CONFIG:" in err and "CurveZMQ" in err, err
    assert not (tmp_path / "data").exists() and not (tmp_path / "parts").exists()


def test_curve_variables_set_but_empty_are_an_error_not_plaintext(monkeypatch):
    # `ZBROKER_CURVE_KEY="$KEY"` with KEY unset: both variables set, both empty, and the
    # client talked plaintext to whatever answered at the URL, records and all, believing
    # itself on CurveZMQ. Only a variable that is absent means "no CURVE".
    from zbroker.client import Connection
    from zbroker.client.aio import AsyncConnection

    monkeypatch.setenv("ZBROKER_CURVE_SERVER_KEY", "")
    monkeypatch.setenv("ZBROKER_CURVE_KEY", "")
    for make in (Connection, AsyncConnection):
        with pytest.raises(ValueError, match="empty"):
            make("tcp://127.0.0.1:1")


def _swap_key_line(path, field: str, value: bytes) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(f'    {field} = "{value.decode()}"' if line.strip().startswith(field) else line
                              for line in lines) + "\n")


@pytest.mark.parametrize("damage", ["short_secret", "other_pair_public", "bad_client_key"])
def test_a_malformed_key_is_refused_before_anything_starts_and_no_secret_is_quoted(tmp_path, keys, damage):
    # Only a file without a key line was refused up front. A secret one character short
    # passed, and every actor then died on `curve_secretkey` (EINVAL) until the supervisor
    # gave up, with five tracebacks and no file named; a public-key line from another pair
    # gave a broker whose own actors could never complete a handshake with their coordinator,
    # unhealthy for ever without a word.
    import signal
    import subprocess
    import sys

    from zbroker.supervisor import free_port_block

    server = keys / "server.key_secret"
    _public, secret = zmq.auth.load_certificate(str(server))
    if damage == "short_secret":
        _swap_key_line(server, "secret-key", secret[:-1])
    elif damage == "other_pair_public":
        _swap_key_line(server, "public-key", zmq.curve_keypair()[0])
    else:
        _swap_key_line(keys / "clients" / "app.key", "public-key", b"not-a-key")
    proc = subprocess.Popen([sys.executable, "-m", "zbroker", "up", "--data", str(tmp_path / "data"), "--http", "off",
                             "--port", str(free_port_block(4)), "--curve", str(keys)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: an actor stuck on its handshake too
        proc.communicate(timeout=30)
        pytest.fail("a broker with a malformed key ran on instead of refusing to start")
    assert proc.returncode == 1
    assert "error: CONFIG: cannot load the CurveZMQ keys" in err, err[-2000:]
    assert secret[:-1].decode() not in err + out
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_keygen_never_leaves_a_secret_key_readable_by_others_not_even_for_a_moment(tmp_path, monkeypatch):
    # pyzmq writes a .key_secret with the process umask (0644 under the usual 022) and
    # keygen narrowed it to 0600 only after every pair was written: until then, or for
    # good if keygen was interrupted (Ctrl-C while making many client keys), any local
    # user could copy the broker's secret key and pose as one of its actors.
    import zbroker.actors.security as security

    real = zmq.auth.create_certificates
    seen = {}

    def observed(directory, name, metadata=None):
        public_file, secret_file = real(directory, name, metadata)
        seen[name] = os.stat(secret_file).st_mode & 0o777
        return public_file, secret_file

    monkeypatch.setattr(security.zmq.auth, "create_certificates", observed)
    old = os.umask(0o022)
    try:
        keygen(tmp_path / "k", clients=["a", "b"])
    finally:
        os.umask(old)
    assert seen == {"server": 0o600, "a": 0o600, "b": 0o600}


@pytest.mark.parametrize("loose", ["server.key_secret", "clients", "acl.json", "."])
def test_keys_others_could_read_or_replace_are_refused(keys, loose):
    # The broker read whatever it found: a server.key_secret other users can read lets any
    # of them pose as the broker's own actors (register and take partitions, answer as the
    # commit writer); a key directory, clients/ or acl.json they can write lets them admit
    # a key of their own, with admin rights. sshd refuses such files too (StrictModes).
    path = keys / loose
    path.chmod({"server.key_secret": 0o644, "acl.json": 0o666}.get(loose, 0o777))
    with pytest.raises(ValueError, match=r"group or others may|others can"):
        KeyRing(keys)
    path.chmod(0o600 if loose == "server.key_secret" else 0o644 if path.is_file() else 0o755)
    KeyRing(keys)  # put right, it loads


@pytest.mark.parametrize("acl, expected", [
    # bool("false") is True: the entry meant to take admin rights away granted them.
    ({"reader": {"consume": ["public"], "admin": "false"}}, "'admin' must be true or false"),
    # A misspelt name matched no key, so "reader" kept the rights of a client without an entry: all.
    ({"readr": {"consume": ["public"], "admin": False}}, "no key in clients/"),
    ({"reader": ["public"]}, "must be an object"),
])
def test_an_acl_entry_that_would_grant_more_than_it_says_is_refused(keys, acl, expected):
    (keys / "acl.json").write_text(json.dumps(acl))
    with pytest.raises(ValueError, match=expected):
        KeyRing(keys)
