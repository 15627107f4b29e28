"""A client's CurveZMQ keys: the broker's public key and the client's own pair.

The client needs these and nothing else of the broker's security module, so they
live here and the actors (which dial each other as CURVE clients) import them.
A key is checked when it is read: libzmq refused a malformed one only when it was
set on a socket.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """What a client needs: the broker's public key and its own key pair (z85 bytes)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key_file: str | Path, client_secret_file: str | Path) -> "ClientKeys":
        server_public, _ = zmq.auth.load_certificate(str(server_key_file))
        public, secret = zmq.auth.load_certificate(str(client_secret_file))
        if secret is None:
            raise ValueError(f"{client_secret_file} holds no secret key (use the .key_secret file)")
        check_key(server_public, "public-key", server_key_file)
        check_pair(public, secret, client_secret_file)
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def check_key(key: bytes | None, field: str, path: str | Path) -> bytes:
    """A z85 CURVE key (40 characters, 32 bytes), or a ValueError naming the file.

    Checked when the keys are read: libzmq refused a malformed one only when an actor
    set it on a socket (EINVAL, a crash loop naming no file), and a client key that is
    no key at all was admitted silently. The key itself is never quoted: it may be a secret.
    """
    try:
        ok = key is not None and len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: {field} is not a CurveZMQ key (40 z85 characters)")
    return key


def check_pair(public: bytes | None, secret: bytes | None, path: str | Path) -> None:
    """The secret and public key in a .key_secret file must be one pair: the actors dial
    each other with the public one, and a public key from another pair left them unable
    to complete a handshake with their own coordinator, the broker unhealthy without a word."""
    check_key(public, "public-key", path)
    check_key(secret, "secret-key", path)
    if zmq.curve_public(secret) != public:
        raise ValueError(f"{path}: public-key and secret-key are not one key pair")
