"""Helpers for tests that watch real processes come and go."""

from __future__ import annotations

import os
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
