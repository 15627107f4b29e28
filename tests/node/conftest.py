"""Fixtures for the Node.js client tests: find `node` and the installed npm packages.

Without Node.js (or without `npm install` in clients/node) these tests skip with
the reason, unless ZBROKER_REQUIRE_NODE=1, which turns the skip into a failure
(CI must never silently skip them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NODE_DIR = REPO / "clients" / "node"
MIN_NODE = (20, 15)  # zlib.crc32


def _unavailable(reason: str) -> None:
    if os.environ.get("ZBROKER_REQUIRE_NODE") == "1":
        pytest.fail(f"ZBROKER_REQUIRE_NODE=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def node() -> str:
    """Path of a usable `node` binary with the client's npm packages installed."""
    path = shutil.which("node")
    if path is None:
        _unavailable("node is not installed (Node.js >= 20.15 is needed)")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    version = tuple(int(x) for x in out.stdout.strip().lstrip("v").split(".")[:2])
    if version < MIN_NODE:
        _unavailable(f"node {out.stdout.strip()} is too old (>= {MIN_NODE[0]}.{MIN_NODE[1]} needed)")
    for package in ("zeromq", "@msgpack/msgpack"):
        if not (NODE_DIR / "node_modules" / package / "package.json").exists():
            _unavailable(f"npm package {package} is missing: run `make node` "
                         "(or `npm install` in clients/node)")
    return path


@pytest.fixture(scope="session")
def run_node(node):
    """run_node(script, *args, input=obj, timeout=s) -> CompletedProcess, in clients/node."""

    def run(script: str, *args: str, input: object | None = None, timeout: float = 60,
            env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([node, script, *args], cwd=NODE_DIR, capture_output=True, text=True,
                              input="" if input is None else json.dumps(input), timeout=timeout,
                              env={**os.environ, **(env or {})})

    return run
