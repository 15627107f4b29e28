"""The ceiling: the same payloads through raw pyzmq between two processes.

zbroker is actors exchanging msgpack over ZeroMQ, so the fastest any zbroker
workload could go from Python is one process pushing msgpack frames to
another over loopback TCP with nothing else done. Two modes:

- `batched`: one msgpack frame per 1,000 records (a list of payloads), the
  shape of a zbroker produce batch;
- `unbatched`: one msgpack frame per record.

A spawned child PUSHes; this process PULLs, unpacks every frame and counts
records. The clock runs from the moment the child is told to go until the
last record is unpacked here. The "server CPU" reported for the ceiling is
the receiving process's (there is no server).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

from bench.adapter import Phase

BATCH = 1000
MODES = {"batched": BATCH, "unbatched": 1}


def _pusher(endpoint: str, count: int, size: int, per_frame: int, ready, go) -> None:
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(endpoint)
    payload = os.urandom(size)
    ready.set()
    go.wait()
    try:
        sent = 0
        if per_frame == 1:
            # Small frames are copied: a zero-copy send costs a zmq.Frame object per message.
            frame = msgpack.packb(payload)
            send = sock.send
            for _ in range(count):
                send(frame)
        else:
            while sent < count:
                n = min(per_frame, count - sent)
                sock.send(msgpack.packb([payload] * n), copy=False)
                sent += n
    finally:
        sock.close()
        ctx.term()


def run_ceiling(mode: str, count: int, size: int, phase: Phase) -> dict[str, Any]:
    """Push `count` records of `size` bytes in `mode`; fills `phase`, returns extra facts."""
    import msgpack
    import zmq

    per_frame = MODES[mode]
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, 1000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    mp = multiprocessing.get_context("spawn")
    ready, go = mp.Event(), mp.Event()
    child = mp.Process(target=_pusher, args=(f"tcp://127.0.0.1:{port}", count, size, per_frame, ready, go),
                       name="bench-zmq-pusher", daemon=True)
    child.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("zmq pusher did not start")
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        unpackb = msgpack.unpackb
        recv = pull.recv
        noblock = int(zmq.NOBLOCK)
        # A batch is read in place; a single record is copied (cheaper than a zmq.Frame).
        copy = per_frame == 1
        received = reported = 0
        phase.begin()
        go.set()
        while received < count and not phase.expired:
            # Poll only when the queue is empty: a poll before every frame tripled the
            # cost of a one-record frame and made the ceiling look lower than it is.
            try:
                frame = recv(noblock, copy=copy)
            except zmq.Again:
                poller.poll(200)
                continue
            value = unpackb(frame if copy else frame.buffer)
            received += len(value) if per_frame > 1 else 1
            if received - reported >= BATCH or received >= count:
                phase.advance(received - reported)
                reported = received
        phase.advance(received - reported)
        phase.end()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)
        pull.close()
        ctx.term()
    return {"mode": mode, "records_per_frame": per_frame, "size": size}
