"""Peer adapters: the same workloads through each system's usual Python client.

Every peer runs on this machine and is reached on loopback only.
"""

from __future__ import annotations

from typing import Callable

from bench.adapter import Adapter


def _rabbitmq() -> Adapter:
    from bench.peers.rabbitmq import RabbitMQ

    return RabbitMQ()


def _nats() -> Adapter:
    from bench.peers.nats_js import NatsJetStream

    return NatsJetStream()


def _redis() -> Adapter:
    from bench.peers.redis_streams import RedisStreams

    return RedisStreams()


def _pgqueuer() -> Adapter:
    from bench.peers.pg_queues import PgQueuer

    return PgQueuer()


def _procrastinate() -> Adapter:
    from bench.peers.pg_queues import Procrastinate

    return Procrastinate()


def _pgmq() -> Adapter:
    from bench.peers.pg_queues import Pgmq

    return Pgmq()


# Imported lazily: a missing client library makes only that peer "skipped".
PEERS: dict[str, Callable[[], Adapter]] = {
    "rabbitmq": _rabbitmq,
    "nats": _nats,
    "redis": _redis,
    "pgqueuer": _pgqueuer,
    "procrastinate": _procrastinate,
    "pgmq": _pgmq,
}
