"""The coordinator's process shell where it decides alone: loading the stored offsets
page by page, and dead letters whose topic cannot be created. No sockets: the
shell's outgoing requests are captured."""

import structlog

from actors.group_coordinator.group_state import GroupConfig, default_dlq_topic
from actors.group_coordinator.shell import LOAD_PAGE_ROWS, CoordinatorShell
from protocol import codec
from protocol import messages as m
from protocol.errors import ErrorCode, TooLarge
from protocol.messages import validate_topic_name


def _shell(tmp_path):
    shell = CoordinatorShell(None, None, tmp_path, structlog.get_logger())
    sent = []
    shell.request = lambda identity, msg, now, on_reply, frames=(): sent.append(msg)
    shell.writer["last_seen_ms"] = 0
    return shell, sent


def _error(err):
    return codec.Envelope(op="load_offsets", corr_id=1, msg=None, error=err, frames=[])


def _rows(env_rows, more):
    return codec.Envelope(op="load_offsets", corr_id=1, msg=m.LoadOffsetsReply(rows=env_rows, more=more),
                          error=None, frames=[])


def test_a_page_too_large_for_a_reply_is_asked_again_in_fewer_rows(tmp_path):
    # Rows with many holes made a 2,000-row page larger than a reply may be; the coordinator
    # asked for the same page for ever and never finished loading (every group: UNAVAILABLE).
    shell, sent = _shell(tmp_path)
    shell.pump_writer(0)
    assert (sent[-1].after, sent[-1].limit) == (None, LOAD_PAGE_ROWS)
    row = ["g", "t", 0, 5, [[7, 8]], 1, 0]
    shell.on_offsets_loaded(_rows([row], more=True))
    assert (sent[-1].after, sent[-1].limit) == (["g", "t", 0], LOAD_PAGE_ROWS)
    shell.on_offsets_loaded(_error(TooLarge("load_offsets page too large")))
    assert (sent[-1].after, sent[-1].limit) == (["g", "t", 0], LOAD_PAGE_ROWS // 2)  # the same page, smaller
    shell.on_offsets_loaded(_error(TooLarge("load_offsets page too large")))
    assert sent[-1].limit == LOAD_PAGE_ROWS // 4
    shell.on_offsets_loaded(_rows([["g", "t", 1, 9, [], 1, 0]], more=False))
    assert shell.offsets_loaded and len(sent) == 4
    assert shell.core.statistics()["groups"] >= 1


def test_other_load_failures_start_the_load_again_later(tmp_path):
    shell, sent = _shell(tmp_path)
    shell.pump_writer(0)
    err = TooLarge("x")
    err.code = ErrorCode.UNAVAILABLE
    shell.on_offsets_loaded(_error(err))
    assert len(sent) == 1 and not shell.load_in_flight and not shell.offsets_loaded


def test_default_dead_letter_topics_are_valid_names_for_every_valid_topic():
    for topic in ["t", "a" * 196, "b" * 197, "x." * 99 + "y", "z" * 200]:
        validate_topic_name(topic)
        name = default_dlq_topic(topic)
        validate_topic_name(name)
        assert name.endswith(".dlq")
    assert default_dlq_topic("b" * 199 + "1") != default_dlq_topic("b" * 199 + "2")
    assert GroupConfig(dlq="mine").dlq_topic("t") == "mine"
