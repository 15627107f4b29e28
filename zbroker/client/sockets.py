"""The socket side the two drivers share: a client's DEALER, poll timeouts, CURVE keys from the environment.

Kept apart from `transport` (correlation and the bootstrap list), which does no I/O.
"""

from __future__ import annotations

import math
import os

import zmq

from zbroker.client.keys import ClientKeys
from zbroker.protocol.errors import ProtocolError


def client_dealer(ctx: zmq.Context, endpoint: str, request_timeout: float, curve: ClientKeys | None) -> zmq.Socket:
    """A client's DEALER to one actor (either driver passes its own context)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued towards a peer that is not connected
    sock.setsockopt(zmq.SNDTIMEO, int(request_timeout * 1000))
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    try:
        if curve is not None:
            curve.apply(sock)
        sock.connect(endpoint)
    except zmq.ZMQError as err:
        # An unclosed socket would make the context's term() wait for ever.
        sock.close(linger=0)
        raise ProtocolError(f"cannot connect to {endpoint!r}: {err} (a URL looks like tcp://HOST:PORT)",
                            endpoint=endpoint) from None
    return sock


def poll_timeout_ms(timeout_s: float) -> int:
    """A zmq poll timeout in whole milliseconds, rounded up.

    Rounded down, a wait of 0.7 ms became a poll(0) that returns at once, and
    every caller that loops until its deadline spun on the CPU for the rest of
    that millisecond: about half a millisecond of busy-waiting per wait.
    """
    return max(0, math.ceil(timeout_s * 1000))


def curve_from_env() -> ClientKeys | None:
    """CURVE keys from ZBROKER_CURVE_SERVER_KEY and ZBROKER_CURVE_KEY (file paths), if both are set.

    One without the other, or one set but empty, is a ValueError: the client would otherwise
    talk plaintext to a broker that expects CURVE, and see only UNAVAILABLE after its request
    timeout (or to whatever answers at the URL, in the clear)."""
    server, client = os.environ.get("ZBROKER_CURVE_SERVER_KEY"), os.environ.get("ZBROKER_CURVE_KEY")
    for name, value in (("ZBROKER_CURVE_SERVER_KEY", server), ("ZBROKER_CURVE_KEY", client)):
        if value is not None and not value.strip():
            # `ZBROKER_CURVE_KEY="$KEY"` with KEY unset: read as "no CURVE", the client sent
            # its records in plaintext to whatever answered. Only an absent variable means that.
            raise ValueError(f"{name} is set but empty: name the key file, or unset it for plaintext")
    if bool(server) != bool(client):
        given, missing = (("ZBROKER_CURVE_SERVER_KEY", "ZBROKER_CURVE_KEY") if server
                          else ("ZBROKER_CURVE_KEY", "ZBROKER_CURVE_SERVER_KEY"))
        raise ValueError(f"{given} is set but {missing} is not: set both (CurveZMQ) or neither (plaintext)")
    return ClientKeys.load(server, client) if server and client else None
