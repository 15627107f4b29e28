"""The coordinator shell as one node of a cluster, without sockets: topic metadata in the
store (and a topics.msgpack from before migrated into it once), a standby answering
NOT_COORDINATOR with the leader's endpoint, a leader stepping down by itself when it cannot
renew, and a takeover that finds what the previous leader wrote."""

import pytest
import structlog

from zbroker.actors import runtime
from zbroker.actors.group_coordinator.shell import CoordinatorShell, MetaFiles
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from tests.support.metadata_writer import MetadataWriter, metadata_writers

pytestmark = pytest.mark.usefixtures(metadata_writers.__name__)


def _env(msg, corr=1):
    return codec.Envelope(op=msg.op, corr_id=corr, msg=msg, error=None, frames=[])


def _single(tmp_path, sent=None):
    shell = CoordinatorShell(None, None, tmp_path / "coordinator", structlog.get_logger())
    replies = []
    shell.reply = lambda token, msg: replies.append(msg)
    shell.reply_error = lambda token, err: replies.append(err)
    MetadataWriter(tmp_path / "offsets.sqlite3").attach(
        shell, lambda identity, msg, now, on_reply, frames=(): (sent if sent is not None else []).append(msg))
    return shell, replies


def _register(shell, actor, now=0):
    shell.on_request(f"partition:{actor}".encode(), _env(m.Register(
        actor_id=actor, endpoint=f"tcp://127.0.0.1:{7400 + len(actor)}", storage_id=f"h:/{actor}", pid=1,
        partitions=[])), now)


def test_a_topics_file_from_before_is_moved_into_the_store_once(tmp_path):
    legacy = MetaFiles(tmp_path / "coordinator")
    legacy.save(legacy.topics_path, {
        "topics": {"orders": {"partitions": 2, "config": {}},
                   "audit": {"partitions": 1, "config": {}, "replication_factor": 2, "min_insync": 2,
                             "incarnation": 77}},
        "placement": [["orders", 0, "p0", "h:/p0"], ["orders", 1, "p0", "h:/p0"]],
        "replicated": [["audit", 0, ["p0", "p1"], "p1", 3, ["p0", "p1"]]]})
    shell, _replies = _single(tmp_path)
    writer = MetadataWriter(tmp_path / "offsets.sqlite3")
    stored = writer.stored()
    assert sorted(stored.topics) == ["audit", "orders"] and stored.topics["audit"].incarnation == 77
    assert stored.partitions[("orders", 1)].leader == "p0"
    assert stored.partitions[("audit", 0)].leader_epoch == 3 and stored.partitions[("audit", 0)].leader == "p1"
    assert not legacy.topics_path.exists(), "migrated once: the file is never read again"
    assert legacy.topics_path.with_name("topics.msgpack.migrated").exists()

    # Started again, the coordinator reads the store; a topic created since is in it too.
    again, replies = _single(tmp_path)
    assert again.topics.metadata(["audit"])[0]["partitions"][0]["leader_epoch"] == 3
    _register(again, "p0")
    again.on_request(b"client", _env(m.CreateTopic(topic="fresh", partitions=1)), 1)
    assert isinstance(replies[-1], m.CreateTopicReply)
    assert writer.stored().partitions[("fresh", 0)].leader == "p0"
    third, _replies = _single(tmp_path)
    assert sorted(third.topics.topics) == ["audit", "fresh", "orders"]
    assert third.topics.partitions[("orders", 0)].owner == "p0"


def test_an_unreplicated_topic_is_acknowledged_once_it_is_in_the_store(tmp_path):
    shell, replies = _single(tmp_path)
    writer = MetadataWriter(tmp_path / "offsets.sqlite3")
    sent = []
    # The store is away: the write has no answer yet, and neither has the client.
    shell.request = lambda identity, msg, now, on_reply, frames=(): sent.append((msg, on_reply))
    shell.on_request(b"client", _env(m.CreateTopic(topic="t", partitions=1)), 1)
    assert replies == [] and writer.stored().topics == {}
    [(write, on_reply)] = [(msg, cb) for msg, cb in sent if isinstance(msg, m.WriteMetadata)]
    writer.attach(shell, lambda *a, **k: None)  # the store is back; the write goes again
    on_reply(None)  # the first attempt timed out
    shell.pump_metadata(runtime.now_ms() + 2000)
    assert isinstance(replies[-1], m.CreateTopicReply) and "t" in writer.stored().topics


class Wire:
    """Every frame the shell sends, decoded; it sends through runtime.send_reply."""

    def __init__(self, monkeypatch):
        self.frames = []
        monkeypatch.setattr(runtime, "send_reply",
                            lambda sock, identity, frames, what="reply": self.frames.append((identity, frames)))

    def take(self, op):
        for i, (identity, frames) in enumerate(self.frames):
            is_reply, env = codec.decode_any(frames)
            if env.op == op:
                del self.frames[i]
                return env
        raise AssertionError(f"nothing sent with op {op!r}: {[codec.decode_any(f)[1].op for _i, f in self.frames]}")

    def errors(self):
        out = []
        for _identity, frames in self.frames:
            is_reply, env = codec.decode_any(frames)
            if is_reply and env.error is not None:
                out.append(env.error)
        self.frames.clear()
        return out


def _node(tmp_path, name="a"):
    shell = CoordinatorShell(None, None, tmp_path / name, structlog.get_logger(), cluster=True, lease_ms=5000,
                             node_id=name)
    shell.endpoint = f"tcp://127.0.0.{2 if name == 'a' else 3}:7400"
    shell.writer.update(pid=10, last_seen_ms=0)
    return shell


def _answer_lease(shell, wire, now, *, holder, held, epoch, endpoint="tcp://127.0.0.3:7400"):
    shell.tick(now)
    ask = wire.take("coordinator_lease")
    shell.on_internal_message(b"writer", codec.encode_reply(m.CoordinatorLeaseReply(
        holder=holder, holder_endpoint=endpoint, epoch=epoch, held=held, remaining_ms=5000), ask.corr_id), now)


def test_a_standby_redirects_every_client_request_to_the_leader(tmp_path, monkeypatch):
    wire = Wire(monkeypatch)
    shell = _node(tmp_path)
    now = runtime.now_ms()
    # Before any lease answer a request waits: the first answer says who leads.
    shell.on_request(b"client", _env(m.ListTopics()), now)
    assert wire.errors() == []
    _answer_lease(shell, wire, now, holder="b", held=False, epoch=4)
    [parked_answer] = wire.errors()
    for msg in (m.ListTopics(), m.Join(group="g", topics=["t"]), m.Hello(versions=[1]), m.Status()):
        shell.on_request(b"client", _env(msg), now)
    errors = [parked_answer, *wire.errors()]
    assert len(errors) == 5
    for err in errors:
        assert err.code.value == "NOT_COORDINATOR" and err.retriable
        assert err.data["leader"] == {"endpoint": "tcp://127.0.0.3:7400", "node_id": "b", "epoch": 4}
    # A partition actor registering here is told the same; its reports are ignored.
    _register(shell, "p0", now)
    [err] = wire.errors()
    assert err.code.value == "NOT_COORDINATOR"


def test_a_leader_that_cannot_renew_stops_by_itself_and_a_new_term_reloads_the_store(tmp_path, monkeypatch):
    wire = Wire(monkeypatch)
    shell = _node(tmp_path)
    now = runtime.now_ms()
    _answer_lease(shell, wire, now, holder="a", held=True, epoch=7, endpoint=shell.endpoint)
    assert shell.epoch == 7
    load = wire.take("load_metadata")
    shell.on_internal_message(b"writer", codec.encode_reply(m.LoadMetadataReply(
        topics=[["t", 1, {}, 1, 1, 5]], partitions=[["t", 0, ["p0"], "p0", 0, ["p0"]]]), load.corr_id), now)
    shell.on_request(b"client", _env(m.ListTopics()), now)
    [(_identity, frames)] = [f for f in wire.frames if codec.decode_any(f[1])[1].op == "list_topics"]
    assert codec.decode_any(frames)[1].msg.topics == ["t"]
    wire.frames.clear()
    # No renewal answered (the store is cut off): past lease_ms - margin from the ask, the
    # node stands by before anything else, even with no tick in between (a SIGSTOP).
    later = now + 4_600
    shell.on_request(b"client", _env(m.ListTopics()), later)
    assert shell.epoch is None
    [err] = [e for e in wire.errors() if e.code.value == "NOT_COORDINATOR"]
    # It takes the lease again at a new epoch: a new term, loaded from the store again.
    _answer_lease(shell, wire, later + 2500, holder="a", held=True, epoch=9, endpoint=shell.endpoint)
    assert shell.epoch == 9 and not shell.ready
    wire.take("load_metadata")


def test_group_configs_are_in_the_store_and_a_groups_file_from_before_moves_there_once(tmp_path):
    legacy = MetaFiles(tmp_path / "coordinator")
    legacy.save(legacy.groups_path, {"old": {"max_deliveries": 3}})
    shell, replies = _single(tmp_path)
    assert shell.group_configs == {"old": {"max_deliveries": 3}}
    shell.on_offsets_loaded(codec.Envelope(op="load_offsets", corr_id=1, msg=m.LoadOffsetsReply(rows=[], more=False),
                                           error=None, frames=[]))
    writer = MetadataWriter(tmp_path / "offsets.sqlite3")
    assert writer.stored().group_configs["old"] == {"max_deliveries": 3}
    assert not legacy.groups_path.exists() and legacy.groups_path.with_name("groups.msgpack.migrated").exists()
    shell.on_request(b"client", _env(m.ConfigureGroup(group="billing", max_deliveries=4)), 1)
    assert isinstance(replies[-1], m.ConfigureGroupReply)
    assert writer.stored().group_configs["billing"]["max_deliveries"] == 4
    # A coordinator starting from the store alone (another node, say) has both.
    again, _replies = _single(tmp_path)
    assert set(again.group_configs) == {"old", "billing"}
    assert again.group_configs["billing"]["max_deliveries"] == 4


def test_a_leader_that_retakes_the_very_next_epoch_goes_on_with_what_it_holds(tmp_path, monkeypatch):
    # A database outage longer than the lease, nobody else to take over: the node stands by,
    # then takes epoch 8 after its own 7. Nobody led in between, so nothing is reloaded.
    wire = Wire(monkeypatch)
    shell = _node(tmp_path)
    now = runtime.now_ms()
    _answer_lease(shell, wire, now, holder="a", held=True, epoch=7, endpoint=shell.endpoint)
    load = wire.take("load_metadata")
    shell.on_internal_message(b"writer", codec.encode_reply(m.LoadMetadataReply(
        topics=[["t", 1, {}, 1, 1, 5]], partitions=[["t", 0, ["p0"], "p0", 0, ["p0"]]]), load.corr_id), now)
    registry = shell.topics
    later = now + 4_600
    shell.on_request(b"client", _env(m.ListTopics()), later)
    assert shell.epoch is None
    wire.frames.clear()
    _answer_lease(shell, wire, later + 2500, holder="a", held=True, epoch=8, endpoint=shell.endpoint)
    assert shell.epoch == 8 and shell.ready and shell.topics is registry
    assert registry.coordinator_epoch == 8
    with pytest.raises(AssertionError):
        wire.take("load_metadata")
