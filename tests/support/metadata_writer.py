"""The commit writer's metadata ops for a socketless coordinator shell, on a real SQLite store.

Shell tests replace `CoordinatorShell.request` to capture what the shell sends; this
answers ``load_metadata`` and ``write_metadata`` at once from a SQLite offset store
(the one the commit writer would use), and passes every other request on. A shell
built again on the same store path finds what the first one wrote, as after a restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

import pytest
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.storage.offsets.metadata import MetadataChanges
from zbroker.storage.offsets.sqlite import SQLiteOffsetStore


_open: list["MetadataWriter"] = []


@pytest.fixture(autouse=False)
def metadata_writers():
    """Import into a test module (and name it `autouse` there) to close every writer a test made."""
    yield _open
    while _open:
        _open.pop().close()


class MetadataWriter:
    def __init__(self, path: Path) -> None:
        _open.append(self)
        self.loop = asyncio.new_event_loop()
        self.store = SQLiteOffsetStore(str(path))
        self.loop.run_until_complete(self.store.connect())
        self.loop.run_until_complete(self.store.migrate())
        self.writes: list[MetadataChanges] = []

    def close(self) -> None:
        if self.loop.is_closed():
            return
        if self in _open:
            _open.remove(self)
        self.loop.run_until_complete(self.store.close())
        self.loop.close()

    def attach(self, shell, passthrough: Callable) -> None:
        """Serve the shell's metadata ops from the store; `passthrough` gets every other request."""
        def request(identity, msg, now, on_reply, frames=()):
            if isinstance(msg, m.LoadMetadata):
                meta = self.loop.run_until_complete(self.store.load_metadata())
                reply: m.Message = m.LoadMetadataReply(topics=[t.to_wire() for t in meta.topics.values()],
                                                       partitions=[p.to_wire() for p in meta.partitions.values()],
                                                       group_configs=[[g, c] for g, c in meta.group_configs.items()])
            elif isinstance(msg, m.WriteMetadata):
                changes = MetadataChanges.from_wire(msg.create_topics, msg.update_topics, msg.delete_topics,
                                                    msg.partitions, msg.group_configs)
                applied = self.loop.run_until_complete(self.store.write_metadata(changes, msg.coordinator_epoch))
                if applied:
                    self.writes.append(changes)
                reply = m.WriteMetadataReply(applied=applied)
            else:
                passthrough(identity, msg, now, on_reply, frames)
                return
            on_reply(codec.Envelope(op=msg.op, corr_id=0, msg=reply, error=None, frames=[]))

        shell.request = request
        if shell.writer["last_seen_ms"] is None:
            shell.writer["last_seen_ms"] = 0
        shell.pump_metadata(0)

    def stored(self):
        return self.loop.run_until_complete(self.store.load_metadata())
