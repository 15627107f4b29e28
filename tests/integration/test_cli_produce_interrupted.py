"""`zbroker produce` stopped by a signal while its in-flight window is full: a partition that
hangs must not hold the command past its flush time (each batch would wait out its retries)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from tests.support.processes import default_signal_dispositions

pytestmark = pytest.mark.processes


class HungPartition:
    """A coordinator that answers metadata, and a partition (the same socket) that takes
    produce requests and never answers them: an actor that hangs."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.produces = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(20):
                continue
            identity, *frames = self.router.recv_multipart()
            env = codec.decode_request(frames)
            if env.op == "produce":
                self.produces += 1
                continue
            if env.op == "produce_many":  # batches of several partitions of this actor, in one request
                self.produces += len(env.msg.parts)
                continue
            reply = m.MetadataReply(topics=[{"name": t, "partitions": [{"partition": 0, "endpoint": self.url}]}
                                            for t in (env.msg.topics or ["t"])])
            self.router.send_multipart([identity, *codec.encode_reply(reply, env.corr_id)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.router.close(linger=0)
        self.ctx.term()


def test_produce_stops_within_its_flush_time_when_signalled_with_a_full_window(tmp_path):
    lines = tmp_path / "lines"
    lines.write_text("".join(f"line-{i}\n" for i in range(30_000)))
    hung = HungPartition()
    with lines.open("rb") as stdin:
        proc = subprocess.Popen([sys.executable, "-m", "zbroker", "produce", "t"], stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "ZBROKER_URL": hung.url},
                                preexec_fn=default_signal_dispositions)
    try:
        deadline = time.monotonic() + 20
        while hung.produces < 10 and time.monotonic() < deadline:  # 10 batches of 1000: the window is full
            time.sleep(0.05)
        assert hung.produces >= 10
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        try:
            proc.wait(timeout=15)  # INTERRUPTED_FLUSH_S is 5 s
        except subprocess.TimeoutExpired:
            raise AssertionError("still running 15 s after Ctrl-C") from None
        _out, err = proc.communicate()
        assert proc.returncode == 130, err
        assert "stopped by SIGINT" in err, err
        assert time.monotonic() - started < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        hung.close()
