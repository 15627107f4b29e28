"""Partition-log shell side of replication: the sockets to leaders and the coordinator.

Theory of operation
-------------------
A follower's core asks for `replica_fetch` requests (`SendToLeader`); this
keeps one DEALER per leader endpoint, sends each request with a fresh
correlation id and hands the reply (or, after `max_wait_ms` plus a grace
period without one, a failure) back to the core with the partition it was
for. A reply that arrives after its request was given up is dropped: the
core has sent a newer fetch meanwhile. `alter_isr` requests go on the
actor's coordinator DEALER; their replies come back through the shell's
coordinator handler (`alter_isr_reply`). Nothing here decides anything.
"""

from __future__ import annotations

import itertools
from typing import Any

import zmq

from zbroker.actors import runtime
from zbroker.actors.partition_log.core import PartitionActorCore, SendToCoordinator, SendToLeader
from zbroker.client.wire import recv_frames
from zbroker.protocol import codec
from zbroker.protocol.errors import ProtocolError

# A replica_fetch unanswered this long past its max_wait_ms is given up (the leader died).
FETCH_GRACE_MS = 2000


class ReplicationLinks:
    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, log: Any, apply_keys: Any = None) -> None:
        self._ctx = ctx
        self._poller = poller
        self._log = log
        self._apply_keys = apply_keys  # CurveZMQ client keys for a leader's ROUTER, when on
        self._leaders: dict[str, zmq.Socket] = {}
        self._ids = itertools.count(1)
        self._fetches: dict[int, tuple[tuple[str, int], int]] = {}  # corr id -> (partition, give-up time)
        self._isr: dict[int, tuple[str, int]] = {}

    def send(self, effect: SendToLeader | SendToCoordinator, coordinator: zmq.Socket, now_ms: int) -> None:
        corr = next(self._ids)
        if isinstance(effect, SendToCoordinator):
            self._isr[corr] = (effect.msg.topic, effect.msg.partition)
            runtime.send_reply(coordinator, None, codec.encode_request(effect.msg, corr), what="alter_isr")
            return
        sock = self._leaders.get(effect.endpoint)
        if sock is None:
            sock = self._leaders[effect.endpoint] = runtime.make_socket(self._ctx, zmq.DEALER)
            if self._apply_keys is not None:
                self._apply_keys(sock)
            sock.connect(effect.endpoint)
            self._poller.register(sock, zmq.POLLIN)
        self._fetches[corr] = ((effect.msg.topic, effect.msg.partition),
                               now_ms + effect.msg.max_wait_ms + FETCH_GRACE_MS)
        runtime.send_reply(sock, None, codec.encode_request(effect.msg, corr), what="replica_fetch")

    def sockets(self) -> list[zmq.Socket]:
        return list(self._leaders.values())

    def on_ready(self, ready: dict, core: PartitionActorCore, now_ms: int) -> list:
        effects: list = []
        for sock in self._leaders.values():
            if sock not in ready:
                continue
            while True:
                frames = recv_frames(sock)
                if frames is None:
                    break
                try:
                    env = codec.decode_reply(frames)
                except ProtocolError as err:
                    self._log.warning("replica_fetch.bad_reply", reason=err.message)
                    continue
                pending = self._fetches.pop(env.corr_id, None)
                if pending is None:
                    continue  # given up on already
                effects += core.on_replica_fetch_reply(pending[0], env.msg, env.frames, env.error, now_ms)
        return effects

    def expire(self, core: PartitionActorCore, now_ms: int) -> list:
        effects: list = []
        for corr, (key, give_up_ms) in list(self._fetches.items()):
            if give_up_ms <= now_ms:
                del self._fetches[corr]
                effects += core.on_replica_fetch_reply(key, None, [], None, now_ms)
        return effects

    def alter_isr_reply(self, env: codec.Envelope, core: PartitionActorCore, now_ms: int) -> list:
        key = self._isr.pop(env.corr_id, None)
        if key is None:
            return []
        return core.on_alter_isr_reply(key, env.msg, env.error, now_ms)

    def close(self) -> None:
        for sock in self._leaders.values():
            sock.close(linger=0)
        self._leaders.clear()
