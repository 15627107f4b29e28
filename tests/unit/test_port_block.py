"""`free_port_block` keeps out of the kernel's ephemeral range (a CI flake: the local end
of an outgoing connection took base+1 between the check and the coordinator's bind)."""

import socket

import pytest

from zbroker import supervisor


def test_port_blocks_are_free_and_outside_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(supervisor, "ephemeral_port_range", lambda: (20_000, 60_000))
    for _ in range(50):
        base = supervisor.free_port_block(6)
        block = range(base, base + 6)
        assert all(p < 20_000 or p > 60_000 for p in block) and block[0] >= 10_000 and block[-1] <= 65_535
        console = base + 80  # `zbroker up`'s default --http: in range, and in the same span
        assert console <= 65_535 and (console < 20_000) == (base < 20_000)


def test_the_top_span_leaves_room_for_the_console(monkeypatch):
    monkeypatch.setattr(supervisor, "ephemeral_port_range", lambda: (11_000, 65_400))
    monkeypatch.setattr(supervisor.random, "randrange", lambda lo, hi: hi - 1)  # the highest base allowed
    monkeypatch.setattr(supervisor.random, "choice", lambda spans: spans[-1])
    assert supervisor.free_port_block(3) + 80 <= 65_535


def test_a_block_with_a_listener_in_it_is_never_chosen(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # Every candidate block covers the listener's port: none may be returned.
        monkeypatch.setattr(supervisor.random, "choice", lambda spans: (taken - 1, taken + 1))
        monkeypatch.setattr(supervisor.random, "randrange", lambda lo, hi: lo)
        with pytest.raises(RuntimeError, match="no free port block"):
            supervisor.free_port_block(4)


def test_the_ephemeral_range_is_read_from_the_kernel():
    low, high = supervisor.ephemeral_port_range()
    assert 1024 <= low < high <= 65_535
