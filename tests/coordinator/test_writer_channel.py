"""The coordinator's channel to the commit writer, through the shell with its sends captured.

Advances must reach the writer in headers it can read (over 1 MiB it cannot even
match its TOO_LARGE reply to the request, so one huge advance stalled every group's
commits for good), and a row counts as durable only once the writer confirmed that
row, not an older one of the same key.
"""
import time

import pytest
import structlog

from zbroker.actors.group_coordinator import effects as fx
from zbroker.actors.group_coordinator.shell import ADVANCE_COALESCE_MS, ADVANCE_RESEND_MS, CoordinatorShell
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.storage.offsets import OffsetStoreError
from tests.support.metadata_writer import MetadataWriter, metadata_writers

pytestmark = pytest.mark.usefixtures(metadata_writers.__name__)


def _shell(tmp_path):
    shell = CoordinatorShell(None, None, tmp_path, structlog.get_logger())
    sent = []
    MetadataWriter(tmp_path / "offsets.sqlite3").attach(shell, lambda identity, msg, now, on_reply, frames=():
                                                        sent.append(msg))
    shell.offsets_loaded = True
    return shell, sent


def test_many_partitions_with_holes_fit_in_advances_the_writer_can_read(tmp_path):
    shell, sent = _shell(tmp_path)
    base = 1 << 20  # offsets past 65535: 5-byte msgpack ints
    # 120 partitions of a shared group, each with the coordinator's maximum of 1000 holes.
    for p in range(120):
        holes = [[base + 2 * i + 1, base + 2 * i + 2] for i in range(1000)]
        shell.apply([fx.PersistOffsets("billing", "orders", p, base, holes, 3, 0)], 0)
    shell.pump_writer(1000)
    advances = [msg for msg in sent if isinstance(msg, m.Advance)]
    assert advances
    for msg in advances:
        frames = codec.encode_request(msg, 7)
        # what the writer does with it (actors/commit_writer/shell.py _on_frames)
        _is_reply, env = codec.decode_any(frames)  # TOO_LARGE, with id=None, if over the limit
        assert isinstance(env.msg, m.Advance)


def test_the_resend_after_a_lost_reply_is_readable_too(tmp_path):
    shell, sent = _shell(tmp_path)
    base = 1 << 20
    for p in range(120):
        holes = [[base + 2 * i + 1, base + 2 * i + 2] for i in range(1000)]
        shell.apply([fx.PersistOffsets("billing", "orders", p, base, holes, 3, 0)], 0)
    shell.pump_writer(1000)
    shell.on_advance_reply(None, [])  # the request timed out: the writer answered id=None
    sent.clear()
    shell.pump_writer(1000 + ADVANCE_RESEND_MS + 100)
    sizes = [len(codec.encode_request(msg, 8)[0]) for msg in sent if isinstance(msg, m.Advance)]
    assert sizes and max(sizes) <= codec.MAX_HEADER_BYTES, sizes


def test_a_reset_of_a_10000_partition_topic_reaches_the_writer_in_readable_advances(tmp_path):
    """No holes needed: create_topic allows 10,000 partitions, names up to 255/200 chars,
    and one reset_group dirties every partition."""
    shell, sent = _shell(tmp_path)
    core = shell.core
    group, topic = "settlement-" + "x" * 60, "payments.eu-west." + "y" * 40
    core.set_topic(topic, 10_000)
    for p in range(10_000):
        core.on_log_range(topic, p, 0, 100, 0)
    shell.apply(core.load_offsets([], 0), 0)
    core.configure_group("c", m.ConfigureGroup(group=group), 1)
    effects = core.reset_group("r", m.ResetGroup(group=group, topic=topic, to="earliest"), 2)
    assert any(type(e).__name__ == "Reply" for e in effects), effects
    shell.apply([e for e in effects if isinstance(e, fx.PersistOffsets)], 2)
    sent.clear()
    shell.pump_writer(1000)
    advances = [msg for msg in sent if isinstance(msg, m.Advance)]
    assert sum(len(a.advances) for a in advances) == 10_000
    sizes = [len(codec.encode_request(a, 9)[0]) for a in advances]
    assert max(sizes) <= codec.MAX_HEADER_BYTES, f"{len(advances)} advance(s), sizes {sizes}"


def test_newer_holes_survive_a_reply_for_an_older_advance_and_a_writer_restart(tmp_path):
    """The writer's reply names (committed, reset_epoch), not the holes: the reply to an
    older advance with the same offset must not confirm the newer row with more holes."""
    shell = CoordinatorShell(None, None, tmp_path, structlog.get_logger())
    sent = []
    shell.writer.update(pid=100, last_seen_ms=0)
    shell.offsets_loaded = True
    MetadataWriter(tmp_path / "offsets.sqlite3").attach(
        shell, lambda identity, msg, now, on_reply, frames=(): sent.append((msg, on_reply)))
    shell.apply([fx.PersistOffsets("g", "t", 0, 10, [], 1, 0)], 0)
    shell.pump_writer(100)
    (_r1, r1_reply), = sent
    shell.apply([fx.PersistOffsets("g", "t", 0, 10, [[12, 13]], 1, 0)], 120)  # record 12 acked
    shell.pump_writer(100 + ADVANCE_COALESCE_MS)
    assert len(sent) == 2, "the second advance carries the hole"
    # The writer flushed the first advance and answers it; then it is SIGKILLed before the second is durable.
    r1_reply(codec.Envelope("advance", 1, msg=m.AdvanceReply(durable=[["g", "t", 0, 10, 0]])))
    shell.on_writer_status(m.WriterStatus(pid=200, healthy=True, metrics={}), 400)  # a new writer
    sent.clear()
    shell.pump_writer(400 + ADVANCE_RESEND_MS + 100)
    resent = [row for msg, _ in sent for row in msg.advances]
    assert ["g", "t", 0, 10, [[12, 13]], 1, 0] in resent, resent
    # Its own reply confirms it.
    (_r2, r2_reply), = sent
    r2_reply(codec.Envelope("advance", 2, msg=m.AdvanceReply(durable=[["g", "t", 0, 10, 0]])))
    assert not shell.unconfirmed


class KeysetStore:
    """A store that counts the rows its pages read; one page can be made to go unanswered."""

    backend, schema = "fake", None

    def __init__(self, rows):
        self.rows = sorted(rows, key=lambda r: r.key)
        self.rows_read = 0

    async def load_page(self, after, limit):
        page = [r for r in self.rows if after is None or r.key > tuple(after)][:limit]
        self.rows_read += len(page)
        return page

    def statistics(self):
        return {}


def test_offsets_load_reads_each_row_once_and_goes_on_from_a_page_that_failed(tmp_path):
    import asyncio

    from zbroker.actors import runtime
    from zbroker.actors.commit_writer.core import WriterConfig
    from zbroker.actors.commit_writer.shell import CommitWriterShell
    from zbroker.storage.offsets import OffsetRow

    rows = [OffsetRow(f"g{i // 100:04d}", "orders", i % 100, 5, [], 1, 0) for i in range(20_000)]
    store = KeysetStore(rows)
    writer = CommitWriterShell("tcp://127.0.0.1:1", f"sqlite:///{tmp_path}/x.db", WriterConfig())
    writer.store, writer._store_ready = store, True
    shell = CoordinatorShell(None, None, tmp_path, structlog.get_logger())
    outbox = []
    MetadataWriter(tmp_path / "offsets.sqlite3").attach(
        shell, lambda identity, msg, now, on_reply, frames=(): outbox.append((msg, on_reply)))
    asked_after = []

    async def drive():
        shell.pump_writer(0)
        while outbox:
            msg, on_reply = outbox.pop(0)
            asked_after.append(msg.after)
            if len(asked_after) == 4:
                on_reply(None)  # this page's reply never came (the request timed out)
                shell.pump_writer(runtime.now_ms() + 10_000)  # past the retry pause (the shell's clock)
                continue
            sent = []
            writer._send = sent.append
            await writer._load(("load_offsets", 1, msg.after, msg.limit))
            _is_reply, env = codec.decode_any(sent[0])
            on_reply(env)

    asyncio.run(drive())
    assert shell.offsets_loaded
    assert asked_after[4] == asked_after[3] is not None, "the load went on from the page that failed"
    pages = len(asked_after) - 1
    assert store.rows_read <= len(rows) + pages, "every page re-read rows before it"


def test_a_flush_a_probe_and_a_load_starting_together_prepare_the_store_once(tmp_path):
    import asyncio

    from zbroker.actors.commit_writer.core import WriterConfig
    from zbroker.actors.commit_writer.shell import CommitWriterShell

    writer = CommitWriterShell("tcp://127.0.0.1:1", f"sqlite:///{tmp_path}/x.db", WriterConfig())
    calls = []

    class SlowStore:
        backend, schema = "fake", None

        async def connect(self):
            calls.append("connect")
            await asyncio.sleep(0.01)  # the other tasks arrive meanwhile

        async def migrate(self):
            calls.append("migrate")
            return []

    writer.store = SlowStore()

    async def three_at_once():
        await asyncio.gather(*(writer._ensure_store() for _ in range(3)))

    asyncio.run(three_at_once())
    assert calls == ["connect", "migrate"] and writer._store_ready


def test_a_late_reply_to_the_previous_coordinator_is_not_taken_for_the_new_ones(tmp_path, monkeypatch):
    """The writer keeps requests waiting across a coordinator restart (load_offsets behind
    pending values, advances behind an outage) and answers them to whoever holds the
    connection then. The new coordinator must not match such a reply to a request of its
    own: a page of rows after some key taken for its first page loads a partial table, and
    the partitions missing from it start over (from the log end for a "latest" group)."""
    from zbroker.actors import runtime

    wire = []
    monkeypatch.setattr(runtime, "send_reply", lambda sock, identity, frames, what="reply": wire.append(frames))

    def load_request():
        _is_reply, env = codec.decode_any(wire.pop())
        assert isinstance(env.msg, m.LoadOffsets)
        return env

    def metadata_loaded(shell):  # an empty store's metadata, answered over the wire
        shell.pump_metadata(0)
        _is_reply, env = codec.decode_any(wire.pop())
        assert isinstance(env.msg, m.LoadMetadata)
        shell.on_internal_message(b"writer", codec.encode_reply(m.LoadMetadataReply(topics=[], partitions=[]),
                                                                env.corr_id), 0)

    def page(env, rows, more):
        return codec.encode_reply(m.LoadOffsetsReply(rows=rows, more=more), env.corr_id)

    row = lambda g: [g, "t", 0, 5, [], 1, 0]  # noqa: E731
    old = CoordinatorShell(None, None, tmp_path / "old", structlog.get_logger())
    old.writer["last_seen_ms"] = 0
    metadata_loaded(old)
    first = load_request()
    old.on_internal_message(b"writer", page(first, [row("a")], more=True), 0)
    second = load_request()
    assert second.msg.after == ["a", "t", 0]
    # The old coordinator is killed while the writer reads that second page.
    time.sleep(0.002)  # a restart takes far longer than the millisecond its ids are based on

    new = CoordinatorShell(None, None, tmp_path / "new", structlog.get_logger())
    new.writer["last_seen_ms"] = 0
    metadata_loaded(new)
    retry = load_request()  # the database was still down: UNAVAILABLE, asked again a second later
    new.on_internal_message(b"writer", codec.encode_error("load_offsets", retry.corr_id,
                                                          OffsetStoreError("down")), 0)
    new.pump_writer(runtime.now_ms() + 10_000)
    mine = load_request()
    assert mine.msg.after is None
    # The writer now answers the old coordinator's second page, on the new connection.
    new.on_internal_message(b"writer", page(second, [row("b")], more=False), 0)
    assert not new.offsets_loaded, "a page the new coordinator never asked for was taken as its first"
    new.on_internal_message(b"writer", page(mine, [row("a"), row("b")], more=False), 0)
    assert new.offsets_loaded
    assert {g for g in new.core._groups} == {"a", "b"}
