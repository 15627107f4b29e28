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


# -- latency: the transport's floor for a brokered path ----------------------

def _relay(out_endpoint: str, ports, ready, stop) -> None:
    """Child process: forward every frame from a PULL to a PUSH, doing nothing else.

    This is the broker's place in the path with none of a broker's work: no
    decoding, no log write, no leases. Whatever latency the path through it
    has is the floor for any broker that is a Python process between two
    others on this machine.
    """
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(out_endpoint)
    ports.put(pull.bind_to_random_port("tcp://127.0.0.1"))
    ready.set()
    noblock = int(zmq.NOBLOCK)
    try:
        while not stop.is_set():
            if not pull.poll(100):
                continue
            while True:
                try:
                    frame = pull.recv(noblock)
                except zmq.Again:
                    break
                push.send(frame)
    finally:
        pull.close()
        push.close()
        ctx.term()


def _paced_pusher(args: dict, ready, go, results) -> None:
    """Child process: the latency workload's publisher on a bare PUSH socket, one frame per record."""
    import time

    import msgpack
    import zmq

    from bench.latency import Pacer, paced_loop, stamp

    try:
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 5000)
        push.connect(args["endpoint"])
        ready.set()
        go.wait()
        pacer = Pacer(args["rate"], args["seconds"], time.monotonic())
        size, send, packb = args["size"], push.send, msgpack.packb

        def publish(n: int) -> None:
            for _ in range(n):
                send(packb(stamp(size, time.time_ns())))

        paced_loop(pacer, publish)
        push.close()
        ctx.term()
        results.put({"sent": pacer.sent, "max_lag_ms": pacer.max_lag_s * 1000, "linger_ms": 0.0})
    except Exception as exc:
        results.put({"error": f"{type(exc).__name__}: {exc}"})


def run_latency_ceiling(rate: float, seconds: float, size: int, phase: Phase,
                        relay_pids: list[int] | None = None) -> dict[str, Any]:
    """The latency workload through raw pyzmq: paced publisher -> relay -> receiver here.

    Same schedule, payload stamp and histogram as every system's latency row;
    three processes, as zbroker's path has (publisher, partition actor,
    consumer). The relay's pid is appended to `relay_pids` once it runs, so
    the phase's "server CPU" is the relay's.
    """
    import time

    import msgpack
    import zmq

    from bench.latency import LatencyRecorder, Pacer, PublisherProcess

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    mp = multiprocessing.get_context("spawn")
    relay_ready, stop, ports = mp.Event(), mp.Event(), mp.Queue()
    relay = mp.Process(target=_relay, args=(f"tcp://127.0.0.1:{port}", ports, relay_ready, stop),
                       name="bench-zmq-relay", daemon=True)
    relay.start()
    publisher = None
    try:
        if not relay_ready.wait(30):
            raise RuntimeError("zmq relay did not start")
        if relay_pids is not None:
            relay_pids.append(relay.pid)
        publisher = PublisherProcess(_paced_pusher, {"endpoint": f"tcp://127.0.0.1:{ports.get(timeout=10)}",
                                                     "rate": rate, "seconds": seconds, "size": size})
        recorder = LatencyRecorder()
        expected = Pacer(rate, seconds, 0.0).total
        unpackb, recv, noblock = msgpack.unpackb, pull.recv, int(zmq.NOBLOCK)
        phase.begin()
        publisher.start()
        while recorder.received < expected and not phase.expired:
            try:
                frame = recv(noblock)
            except zmq.Again:
                pull.poll(100)
                continue
            recorder.record(unpackb(frame), time.time_ns())
            phase.advance(1)
        phase.end()
        return {**recorder.summary(), "publisher": publisher.finish()}
    finally:
        stop.set()
        relay.join(5)
        if relay.is_alive():
            relay.kill()
            relay.join(5)
        if publisher is not None and publisher.process.is_alive():
            publisher.process.kill()
        pull.close()
        ctx.term()
