"""The coordinator shell as controller of replicated partitions, without sockets: every
assign and reply carrying a decision goes out only once the decision is in the store, and
a restarted coordinator comes back with it."""

import pytest
import structlog

from zbroker.actors import runtime
from zbroker.actors.group_coordinator.shell import CoordinatorShell
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from tests.support.metadata_writer import MetadataWriter


@pytest.fixture
def writers(tmp_path):
    made = []
    yield made
    for w in made:
        w.close()


def _replicated(writer):
    meta = writer.stored()
    return [p.to_wire() for (t, _p), p in sorted(meta.partitions.items()) if meta.topics[t].replication_factor > 1]


def _shell(tmp_path, writers):
    shell = CoordinatorShell(None, None, tmp_path, structlog.get_logger())
    sent, replies = [], []
    writer = MetadataWriter(tmp_path / "offsets.sqlite3")
    writers.append(writer)

    def request(identity, msg, now, on_reply, frames=()):
        # What the store holds when the message leaves.
        sent.append((identity, msg, _replicated(writer)))

    shell.reply = lambda token, msg: replies.append((token, msg))
    writer.attach(shell, request)
    shell.reply_error = lambda token, err: replies.append((token, err))
    return shell, sent, replies


def _env(msg, corr=1):
    return codec.Envelope(op=msg.op, corr_id=corr, msg=msg, error=None, frames=[])


def _register(shell, actor, host, now=0):
    shell.on_request(f"partition:{actor}".encode(), _env(m.Register(
        actor_id=actor, endpoint=f"tcp://{host}:7410", storage_id=f"{host}:/d", pid=1, partitions=[])), now)


def test_assigns_and_replies_leave_only_with_the_decision_in_the_store(tmp_path, writers):
    shell, sent, replies = _shell(tmp_path, writers)
    for i, a in enumerate(("a", "b", "c")):
        _register(shell, a, f"127.0.0.{i + 2}")
    replies.clear()
    shell.on_request(b"client", _env(m.CreateTopic(topic="t", partitions=1, replication_factor=3)), 1)
    assigns = [(who, msg, stored) for who, msg, stored in sent if isinstance(msg, m.Assign)]
    assert {who for who, _msg, _s in assigns} == {b"partition:a", b"partition:b", b"partition:c"}
    for _who, msg, stored in assigns:
        assert stored == [["t", 0, ["a", "b", "c"], "a", 0, ["a", "b", "c"]]]
        [[topic, partition, state]] = msg.replicas
        assert (topic, state["leader"], state["leader_epoch"], state["min_insync"]) == ("t", "a", 0, 2)
        assert msg.coordinator_epoch == 1 and msg.assignment[0][:2] == ["t", 0]
    [(_token, reply)] = replies
    assert isinstance(reply, m.CreateTopicReply)

    # The leader shrinks the ISR: the reply is the recorded state, written first.
    replies.clear()
    shell.on_request(b"partition:a", _env(m.AlterIsr(topic="t", partition=0, leader_epoch=0, isr=["a", "b"])), 2)
    [(_token, reply)] = replies
    assert reply.isr == ["a", "b"]
    assert _replicated(writers[0])[0][5] == ["a", "b"]
    # A follower claiming leadership is refused with STALE_EPOCH; no token is left behind.
    replies.clear()
    shell.on_request(b"partition:b", _env(m.AlterIsr(topic="t", partition=0, leader_epoch=0, isr=["b"])), 3)
    assert replies[0][1].code.value == "STALE_EPOCH" and not shell.tokens

    # Restarted, the coordinator has the same replica state.
    again, _sent, _replies = _shell(tmp_path, writers)
    part = again.topics.metadata(["t"])[0]["partitions"][0]
    assert (part["actor_id"], part["isr"], part["leader_epoch"]) == ("a", ["a", "b"], 0)


def test_status_is_unhealthy_while_a_partition_is_below_min_insync(tmp_path, writers):
    shell, sent, replies = _shell(tmp_path, writers)
    for i, a in enumerate(("a", "b")):
        _register(shell, a, f"127.0.0.{i + 2}")
    shell.on_request(b"client", _env(m.CreateTopic(topic="t", partitions=1, replication_factor=2)), 1)
    shell.writer.update(healthy=True, last_seen_ms=runtime.now_ms())
    replies.clear()
    shell.on_request(b"client", _env(m.Status()), runtime.now_ms())
    assert replies[-1][1].healthy and replies[-1][1].under_replicated == []
    shell.on_request(b"partition:a", _env(m.AlterIsr(topic="t", partition=0, leader_epoch=0, isr=["a"])), 2)
    shell.on_request(b"client", _env(m.Status()), runtime.now_ms())
    status = replies[-1][1]
    assert not status.healthy
    [row] = status.under_replicated
    assert row["below_min_insync"] and row["isr"] == ["a"] and not row["offline"]
