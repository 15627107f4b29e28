"""What the numbers were measured on: machine, kernel, Python, library versions."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

LIBRARIES = ("zbroker", "pyzmq", "msgpack", "pika", "nats-py", "redis", "hdrhistogram", "psutil", "tqdm",
             "matplotlib")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def cpu_model(cpuinfo: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model", "Hardware"):
            return value.strip()
    return None


def mem_total_bytes(meminfo: str) -> int | None:
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            return int(parts[1]) * 1024
    return None


def describe() -> dict[str, Any]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    uname = platform.uname()
    return {
        "nproc": usable,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(_read("/proc/cpuinfo")) or uname.processor or None,
        "memory_bytes": mem_total_bytes(_read("/proc/meminfo")),
        "kernel": f"{uname.system} {uname.release} {uname.machine}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "libraries": versions,
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "client_sched": client_sched(),
    }


def client_sched() -> str | None:
    """The scheduling policy the benchmark's client processes run under (they inherit ours)."""
    if not hasattr(os, "sched_getscheduler"):
        return None
    policy = os.sched_getscheduler(0)
    return {getattr(os, "SCHED_OTHER", 0): "SCHED_OTHER",
            getattr(os, "SCHED_BATCH", 3): "SCHED_BATCH"}.get(policy, str(policy))
