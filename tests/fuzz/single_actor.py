"""Single actor processes for tests that play the actor's peer (the coordinator or the writer).

`spawn_actor` starts ``module:function(*args)`` in a multiprocessing spawn child
with its stderr (the actor's JSON log) in a file, the way the supervisor starts
actors but without one: a test that kills or crashes the actor sees that
directly, and nothing restarts it behind the test's back.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Any

import zmq

from zbroker.protocol import codec
from zbroker.protocol.errors import ProtocolError


def _child(target: str, args: tuple, kwargs: dict, log_file: str) -> None:
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    module_name, func = target.rsplit(":", 1)
    getattr(__import__(module_name, fromlist=[func]), func)(*args, **kwargs)


def spawn_actor(target: str, *args: Any, log_file: str, **kwargs: Any) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(target=_child, args=(target, args, kwargs, log_file),
                                                        daemon=True)
    proc.start()
    return proc


def stop_actor(proc: multiprocessing.Process) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def bind_router(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A ROUTER on a free loopback port, as the actor under test's coordinator."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    return router, router.getsockopt_string(zmq.LAST_ENDPOINT)


def wait_for_request(sock: zmq.Socket, op: str, timeout: float = 30.0) -> tuple[list[bytes], codec.Envelope]:
    """The next request `op` on `sock` (a ROUTER gives [identity, ...] as the prefix)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sock.poll(100):
            continue
        frames = sock.recv_multipart()
        prefix = frames[:1] if sock.type == zmq.ROUTER else []
        try:
            is_reply, env = codec.decode_any(frames[len(prefix):])
        except ProtocolError:
            continue
        if not is_reply and env.op == op:
            return prefix, env
    raise TimeoutError(f"no {op!r} request within {timeout}s")  # a setup failure, never the bug under test
