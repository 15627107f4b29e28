"""Knobs of the fuzz runs, from the environment so a long run needs no code change.

``ZBROKER_FUZZ_FRAMES`` (default 100000): messages sent to each actor socket.
``ZBROKER_FUZZ_SEED`` (default fixed): seed of the mutators; a failure message
names the seed so the run can be repeated exactly.
"""

from __future__ import annotations

import os
import random

import pytest

DEFAULT_SEED = 20_261_129


@pytest.fixture
def fuzz_frames() -> int:
    return int(os.environ.get("ZBROKER_FUZZ_FRAMES", "100000"))


@pytest.fixture
def fuzz_seed() -> int:
    return int(os.environ.get("ZBROKER_FUZZ_SEED", str(DEFAULT_SEED)))


@pytest.fixture
def rng(fuzz_seed: int) -> random.Random:
    return random.Random(fuzz_seed)
