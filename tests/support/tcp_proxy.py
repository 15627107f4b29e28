"""A loopback TCP proxy that a test can cut: the network failure we can cause on demand.

``TcpProxy((host, port))`` listens on ``127.0.0.1:<random>`` (or on ``listen=(address,
port)``: a simulated host's network link, see tests/chaos/hosts.py) and forwards each
connection to the target with two plain threads (one per direction), so it
works the same whether the client is this process, a child process or an
event loop. Cutting never touches the server behind it.

- ``cut()`` ("reset"): drop every live connection and refuse new ones (they are
  accepted and closed at once), like a database that went away.
- ``cut("blackhole")``: keep connections open but forward nothing, like a
  database or network that hangs; clients only notice through their timeouts.
- ``restore()``: forward again. Connections that lived through a blackhole are
  dropped, since bytes were lost mid-stream.

``tap(conn_id, data)`` sees every client-to-server chunk, for tests that count
protocol messages on the wire (see `tests.support.pg.PgFrontendCounter`).
"""

from __future__ import annotations

import itertools
import socket
import threading
from typing import Callable

Tap = Callable[[int, bytes], None]


class _Conn:
    def __init__(self, conn_id: int, client: socket.socket, upstream: socket.socket | None) -> None:
        self.id = conn_id
        self.client = client
        self.upstream = upstream
        self.blackholed = upstream is None
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for s in (self.client, self.upstream):
            if s is None:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump blocked in recv()
            except OSError:
                pass
            s.close()


class TcpProxy:
    def __init__(self, target: tuple[str, int], *, tap: Tap | None = None,
                 listen: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.target = target
        self.listen = listen
        self.tap = tap
        self._mode = "forward"
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._stopping = threading.Event()
        self._accepted = 0

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> "TcpProxy":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(self.listen)
        listener.listen(64)
        listener.settimeout(0.05)  # lets the accept loop notice close() promptly
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name="tcp-proxy-accept", daemon=True)
        self._acceptor.start()
        return self

    def close(self) -> None:
        self._stopping.set()
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        self._drop_all()

    def __enter__(self) -> "TcpProxy":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- control ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._listener is not None, "start() first"
        return self._listener.getsockname()[1]

    @property
    def address(self) -> tuple[str, int]:
        return (self.listen[0], self.port)

    @property
    def mode(self) -> str:
        return self._mode

    def cut(self, mode: str = "reset") -> None:
        if mode not in ("reset", "blackhole"):
            raise ValueError(f"unknown cut mode {mode!r}")
        with self._lock:
            self._mode = mode
            conns = list(self._conns.values())
            for c in conns:
                c.blackholed = True
        if mode == "reset":
            self._drop_all()

    def restore(self) -> None:
        with self._lock:
            self._mode = "forward"
        dead = [c for c in list(self._conns.values()) if c.blackholed]
        for c in dead:
            self._drop(c)

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return {"accepted": self._accepted, "active": len(self._conns)}

    # -- plumbing --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _addr = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            client.settimeout(None)
            with self._lock:
                mode = self._mode
                self._accepted += 1
            if mode == "reset":
                _reset(client)
                continue
            upstream = None
            if mode == "forward":
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                    upstream.settimeout(None)
                except OSError:
                    _reset(client)
                    continue
            conn = _Conn(next(self._ids), client, upstream)
            with self._lock:
                self._conns[conn.id] = conn
            self._pump_thread(conn, client, upstream, upward=True)
            if upstream is not None:
                self._pump_thread(conn, upstream, client, upward=False)

    def _pump_thread(self, conn: _Conn, src: socket.socket, dst: socket.socket | None, upward: bool) -> None:
        t = threading.Thread(target=self._pump, args=(conn, src, dst, upward),
                             name=f"tcp-proxy-{conn.id}-{'up' if upward else 'down'}", daemon=True)
        t.start()  # before it is listed: a cut that joins the listed threads must not meet an unstarted one
        with self._lock:
            conn.threads.append(t)

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket | None, upward: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if conn.blackholed or dst is None:
                    continue  # swallowed: the peer waits forever, as on a hung network
                if upward and self.tap is not None:
                    self.tap(conn.id, data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if not conn.blackholed or self._stopping.is_set():
                self._drop(conn, join=False)

    def _drop(self, conn: _Conn, join: bool = True) -> None:
        with self._lock:
            self._conns.pop(conn.id, None)
        conn.close()
        if join:
            with self._lock:
                threads = list(conn.threads)
            for t in threads:
                if t is not threading.current_thread():
                    t.join(timeout=5)

    def _drop_all(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            self._drop(c)


def _reset(sock: socket.socket) -> None:
    """Close with RST, the way a vanished server looks to a client."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    sock.close()
