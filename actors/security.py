"""CurveZMQ authentication and per-topic authorization.

Theory of operation
-------------------
With ``--curve DIR`` every socket an actor binds is a CURVE server and every
socket it dials is a CURVE client. The directory holds::

    DIR/server.key, DIR/server.key_secret     the broker's key pair (all actors share it)
    DIR/clients/<name>.key                     public keys of allowed clients
    DIR/clients/<name>.key_secret              handed to that client, not needed by the broker
    DIR/acl.json                               optional: {"<name>": {"produce": [...], "consume": [...], "admin": bool}}

Authentication happens in libzmq's handshake, through a ZAP handler thread
(pyzmq's `ThreadAuthenticator`) that asks `KeyRing.allowed`: a client whose
key is not in ``clients/`` never completes the handshake, so it never sends
a request nor sees a byte of data, and the refusal is logged. libzmq then
stamps each message with the client's z85 public key as its ``User-Id``.

Authorization is a pure decision (`Acl.check`) made per request from that
user id: produce needs ``produce`` on the topic, fetch/join/acks need
``consume``, creating topics and configuring or resetting groups needs
``admin``, internal ops need the broker's own key. A client without an
``acl.json`` entry may do everything a client can. A refusal is an
UNAUTHORIZED error reply.

Whatever could widen that is refused when the keys are read, so the broker does not
start: an empty DIR (never "no CURVE"), a key that is not one, a server.key_secret that
group or others may read, a DIR, clients/, .key or acl.json they may write, and an
acl.json entry that names no client key or says ``admin`` with anything but a bool.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from zbroker.client.keys import ClientKeys, check_key, check_pair  # noqa: F401 (re-exported)
from zbroker.protocol.errors import Unauthorized

ZAP_DOMAIN = "zbroker"
INTERNAL_ZAP_DOMAIN = "zbroker-internal"  # the coordinator's actor endpoint: the broker's own key only
INTERNAL_OPS = {"register", "deregister", "report", "assign", "writer_status", "advance", "load_offsets",
                "alter_isr", "delete_partitions",
                "replica_fetch"}  # replica_fetch reads any topic and can depose a leader
ADMIN_OPS = {"create_topic", "configure_group", "reset_group", "reassign_partition",
             "alter_topic", "delete_group", "offset_for_time"}
MEMBER_OPS = {"heartbeat", "leave", "poll", "ack", "nack", "extend", "reject"}


@dataclasses.dataclass(frozen=True)
class Permissions:
    """``None`` means every topic."""

    produce: frozenset[str] | None = None
    consume: frozenset[str] | None = None
    admin: bool = True

    @classmethod
    def from_dict(cls, d: dict) -> "Permissions":
        def topics(key: str) -> frozenset[str] | None:
            value = d.get(key, [])
            if value == "*" or value == ["*"]:
                return None
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise ValueError(f"acl {key!r} must be a list of topic names or '*'")
            return frozenset(value)
        if not isinstance(d, dict):
            raise ValueError('an acl entry must be an object: {"produce": [...], "consume": [...], "admin": bool}')
        admin = d.get("admin", False)
        if not isinstance(admin, bool):  # bool("false") is True: the entry would grant what it denies
            raise ValueError(f"acl 'admin' must be true or false, not {admin!r}")
        return cls(produce=topics("produce"), consume=topics("consume"), admin=admin)

    def may(self, action: str, topic: str) -> bool:
        allowed = self.produce if action == "produce" else self.consume
        return allowed is None or topic in allowed


def check_private(directory: Path) -> None:
    """Refuse keys that other local users could read or replace (as sshd's StrictModes does).

    Whoever reads server.key_secret can pose as the broker's own actors (register and
    take partitions, answer as the commit writer); whoever can write the key directory,
    clients/, a client's .key or acl.json can admit a key of their own, with admin rights.
    """
    secret = directory / "server.key_secret"
    mode = secret.stat().st_mode
    if mode & 0o077:
        raise ValueError(f"{secret}: group or others may read or write it (mode {mode & 0o777:o}): chmod 600 it")
    for path in (directory, directory / "clients", directory / "acl.json",
                 *sorted((directory / "clients").glob("*.key"))):
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            continue  # no clients/ or no acl.json: nothing to replace it with that is not refused
        if mode & 0o022:
            raise ValueError(f"{path}: group or others may write it (mode {mode & 0o777:o}), so others can "
                             f"admit keys of their own: chmod go-w it")


class KeyRing:
    """The broker's keys, the allowed clients and their permissions, read from DIR."""

    def __init__(self, directory: str | Path) -> None:
        if not str(directory).strip():
            # `--curve "$KEYS"` with KEYS unset: taken as "no CURVE", the broker served
            # everyone in plaintext; taken as Path(""), it read keys from the working directory.
            raise ValueError("the CurveZMQ key directory is an empty path (is the variable that names it unset?)")
        self.directory = Path(directory)
        self.public, self.secret = zmq.auth.load_certificate(str(self.directory / "server.key_secret"))
        if self.secret is None:
            raise ValueError(f"{self.directory / 'server.key_secret'} holds no secret key")
        check_pair(self.public, self.secret, self.directory / "server.key_secret")
        check_private(self.directory)
        self.names: dict[str, str] = {}  # z85 public key -> client name
        for key_file in sorted((self.directory / "clients").glob("*.key")):
            public, _ = zmq.auth.load_certificate(str(key_file))
            self.names[check_key(public, "public-key", key_file).decode()] = key_file.stem
        acl_file = self.directory / "acl.json"
        raw = json.loads(acl_file.read_text()) if acl_file.exists() else {}
        if not isinstance(raw, dict):
            raise ValueError(f"{acl_file} must be an object: {{\"<client name>\": {{...}}, ...}}")
        unknown = sorted(set(raw) - set(self.names.values()))
        if unknown:
            # A misspelt name matches no key, and the client it meant keeps every right.
            raise ValueError(f"{acl_file} names {unknown}, with no key in clients/ (a typo would leave "
                             f"that client with every right): fix or remove the entry")
        try:
            self.permissions = {name: Permissions.from_dict(p) for name, p in raw.items()}
        except ValueError as err:
            raise ValueError(f"{acl_file}: {err}") from None

    def allowed(self, public_z85: bytes) -> bool:
        key = public_z85.decode()
        return key == self.public.decode() or key in self.names

    def acl(self) -> "Acl":
        by_key = {key: self.permissions.get(name, Permissions()) for key, name in self.names.items()}
        return Acl(self.public.decode(), by_key, self.names)

    def internal_client(self) -> ClientKeys:
        """Actors dial each other with the broker's own key pair."""
        return ClientKeys(self.public, self.public, self.secret)

    def make_server(self, sock: zmq.Socket, *, internal: bool = False) -> None:
        sock.zap_domain = (INTERNAL_ZAP_DOMAIN if internal else ZAP_DOMAIN).encode()
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


class Acl:
    """Pure: may the client with this user id (z85 public key) make this request?"""

    def __init__(self, broker_key: str, permissions: dict[str, Permissions], names: dict[str, str]) -> None:
        self.broker_key = broker_key
        self.permissions = permissions
        self.names = names

    def check(self, user_id: str | None, op: str, msg: Any) -> None:
        if user_id == self.broker_key:
            return  # another actor of this broker
        perms = self.permissions.get(user_id or "")
        who = self.names.get(user_id or "", "unknown")
        if perms is None:
            raise Unauthorized("client key is not allowed", client=who, op=op)
        if op in INTERNAL_OPS:
            raise Unauthorized(f"{op!r} is reserved for the broker's own actors", client=who, op=op)
        if op in ADMIN_OPS and not perms.admin:
            raise Unauthorized(f"{op!r} needs admin rights", client=who, op=op)
        for action, topic in _topics_touched(op, msg):
            if not perms.may(action, topic):
                raise Unauthorized(f"client may not {action} topic {topic!r}", client=who, op=op,
                                   action=action, topic=topic)


def _topics_touched(op: str, msg: Any) -> list[tuple[str, str]]:
    if op == "produce":
        return [("produce", msg.topic)]
    if op == "fetch":
        return [("consume", msg.topic)]
    if op in ("produce_many", "fetch_many"):
        return [("produce" if op == "produce_many" else "consume", t) for t in {part[0] for part in msg.parts}]
    if op == "join":
        return [("consume", t) for t in msg.topics]
    if op in MEMBER_OPS and hasattr(msg, "ranges"):
        return [("consume", t) for t in {r[0] for r in msg.ranges}]
    if op == "poll":
        # Acks riding on a poll settle leases like an `ack`: the same check. Member ids
        # are not bound to keys (describe_group names them), so without it a client could
        # poll as another client's member and ack records of a topic it may not consume.
        return [("consume", t) for t in {r[0] for r in msg.acks}]
    return []


def start_authenticator(ctx: zmq.Context, keys: KeyRing, log: Any) -> ThreadAuthenticator:
    """Start the ZAP handler; must run before any CURVE server socket binds."""

    class Provider:
        def __init__(self, internal: bool) -> None:
            self.internal = internal

        def callback(self, domain: str, key: bytes) -> bool:
            ok = key == keys.public if self.internal else keys.allowed(key)
            if not ok:
                log.warning("auth.refused", client_key=key.decode(errors="replace"), domain=domain)
            return ok

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=Provider(internal=False))
    auth.configure_curve_callback(domain=INTERNAL_ZAP_DOMAIN, credentials_provider=Provider(internal=True))
    return auth


def user_id(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


def keygen(directory: str | Path, *, clients: list[str] = ()) -> dict[str, Path]:
    """Create DIR with a broker key pair (if missing) and a key pair per client name."""
    root = Path(directory)
    (root / "clients").mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if not (root / "server.key_secret").exists():
        _public, secret = _create_pair(root, "server")
        written["server"] = Path(secret)
    for name in clients:
        if (root / "clients" / f"{name}.key_secret").exists():
            continue
        _public, secret = _create_pair(root / "clients", name)
        written[name] = Path(secret)
    for path in list(root.glob("*.key_secret")) + list((root / "clients").glob("*.key_secret")):
        path.chmod(0o600)
    return written


def _create_pair(directory: Path, name: str) -> tuple[str, str]:
    """pyzmq writes the .key_secret with the process umask (0644 under the usual 022):
    readable by every local user until the chmod after it, or for good if keygen was
    interrupted. It rewrites a file that exists, keeping its mode, so the file is created
    first, empty and 0600; O_EXCL also refuses a symlink planted where it goes."""
    fd = os.open(directory / f"{name}.key_secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    return zmq.auth.create_certificates(str(directory), name)
