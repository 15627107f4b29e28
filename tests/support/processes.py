"""Helpers for tests that watch real processes come and go."""

from __future__ import annotations

import os
import signal
import time
from typing import Iterable


def all_gone(pids: Iterable[int], timeout: float = 15.0) -> bool:
    """True once none of `pids` exists any more (polled until `timeout`)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def default_signal_dispositions() -> None:
    """``preexec_fn`` for a child the test will signal: SIGINT and SIGTERM back to SIG_DFL.

    A child inherits ignored signals, and a shell ignores SIGINT in a background
    job (`make test &`); the CLI rightly keeps an ignored SIGINT ignored, so a test
    that sends one must not depend on how the suite itself was started."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
