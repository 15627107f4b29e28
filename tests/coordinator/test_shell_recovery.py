"""The coordinator's process shell where it decides alone: loading the stored offsets
page by page, dead letters whose topic cannot be created, and the copy without value
of a record too large to dead-letter whole. No sockets: the
shell's outgoing requests are captured."""

import dataclasses

import pytest

import structlog

from zbroker.actors.group_coordinator.effects import DeadLetter
from zbroker.actors.group_coordinator.group_state import GroupConfig, default_dlq_topic
from zbroker.actors.group_coordinator.shell import LOAD_PAGE_ROWS, CoordinatorShell
from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.batch import Record
from zbroker.protocol.errors import ErrorCode, TooLarge
from zbroker.protocol.messages import validate_topic_name
from tests.support.metadata_writer import MetadataWriter, metadata_writers

pytestmark = pytest.mark.usefixtures(metadata_writers.__name__)


def _shell(tmp_path):
    shell = CoordinatorShell(None, None, tmp_path, structlog.get_logger())
    sent = []
    MetadataWriter(tmp_path / "offsets.sqlite3").attach(shell, lambda identity, msg, now, on_reply, frames=():
                                                        sent.append(msg))
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


def test_a_copy_without_value_keeps_the_key_and_headers_only_if_they_fit(tmp_path):
    # The copy a TOO_LARGE refusal leads to must fit the dead-letter partition's limit
    # (learnt from that refusal): the original headers go first, then the key.
    shell, _sent = _shell(tmp_path)
    effect = DeadLetter("g", "t", 0, 7, "t.dlq", 1, "reject:bad", 1, drop_value=True)
    rec = Record("t", 0, 7, 1, b"k" * 300, b"v" * 5000, {"big": b"h" * 300})

    def copy(limit):
        shell.dead_letter_limits["t.dlq"] = limit
        [(_ts, key, value, headers)] = codec.unpack_value(shell.dead_letter_payload(effect, rec))
        return key, value, headers

    key, value, headers = copy(5000)
    assert (key, value, headers["big"], headers["zb-dlq-value-dropped"]) == (rec.key, b"", b"h" * 300, b"5000")
    key, value, headers = copy(700)
    assert key == rec.key and "big" not in headers and headers["zb-dlq-headers-dropped"] == b"1"
    key, value, headers = copy(400)
    assert key is None and headers["zb-dlq-key-dropped"] == b"300" and headers["zb-dlq-source-offset"] == b"7"


def test_a_value_less_copy_takes_its_own_record_not_another_of_its_range(tmp_path):
    # A reviewer's sequence: offsets 0 and 1 rejected together share one dead-lettering
    # id. Offset 0's full copy is refused TOO_LARGE, and in the same core event offset
    # 1's value-less retry comes due before offset 0's value-less copy: with the refused
    # record kept under the id alone, offset 1's copy took record 0 and labelled it 1.
    import types

    shell, _sent = _shell(tmp_path)
    shell.topics = types.SimpleNamespace(topics={"t": None, "t.dlq": None}, partitions={
        ("t", 0): types.SimpleNamespace(owner="p0"), ("t.dlq", 0): types.SimpleNamespace(owner="p0")})
    requests = []
    shell.request = lambda identity, msg, now, on_reply, frames=(): requests.append((msg, on_reply, frames))
    first, second = (DeadLetter("g", "t", 0, o, "t.dlq", 1, "reject:bad", 5) for o in (0, 1))

    def the_core_answers(reason, error=None, refused=False):  # its order: the due retry first
        shell.start_dead_letter(dataclasses.replace(second, drop_value=True), 0)
        shell.start_dead_letter(dataclasses.replace(first, drop_value=True), 0)

    shell.append_dead_letter(first, Record("t", 0, 0, 1, b"key-0", b"v" * 100, None), the_core_answers)
    [(_produce, refuse, _frames)] = requests
    requests.clear()
    refuse(codec.Envelope(op="produce", corr_id=1, error=TooLarge("batch exceeds max_batch_bytes", limit=300)))
    # Copies into one DLQ go one at a time, in the core's order: offset 1's copy fetches its
    # own record, and offset 0's value-less copy waits behind it.
    [(fetch, fetched, _f)] = requests
    assert isinstance(fetch, m.Fetch) and fetch.offset == 1
    assert [(e.offset, e.drop_value) for e in shell.dead_letter_queues["t.dlq"]] == [(0, True)]
    fetched(None)  # no answer: both copies fail together, and the core retries them in order
    assert not shell.dead_letter_queues.get("t.dlq") and "t.dlq" not in shell.dead_letter_copying


def test_copies_into_one_dead_letter_topic_go_one_at_a_time_in_order(tmp_path):
    """A copy behind another waits for it: side by side, a first copy that had to be retried
    (its DLQ topic had no owner yet) landed after later ones, and a released key's records
    reached the DLQ out of order."""
    import types

    shell, _sent = _shell(tmp_path)
    shell.topics = types.SimpleNamespace(topics={"t": None, "t.dlq": None}, partitions={
        ("t", 0): types.SimpleNamespace(owner="p0"), ("t.dlq", 0): types.SimpleNamespace(owner=None)})
    requests = []
    shell.request = lambda identity, msg, now, on_reply, frames=(): requests.append((msg, on_reply, frames))
    failed = []
    shell.core.on_dead_letter_failed = lambda effect, now, error=None: failed.append(effect.offset) or []
    for offset in range(3):
        shell.start_dead_letter(DeadLetter("g", "t", 0, offset, "t.dlq", 1, "quarantine_release", 5), 0)
    [(fetch, fetched, _f)] = requests  # only the first copy is under way
    assert isinstance(fetch, m.Fetch) and fetch.offset == 0
    assert [e.offset for e in shell.dead_letter_queues["t.dlq"]] == [1, 2]
    fetched(None)  # the first fails: the ones behind it fail with it, in order, none appended
    assert failed == [0, 1, 2] and len(requests) == 1
    assert not shell.dead_letter_queues.get("t.dlq") and "t.dlq" not in shell.dead_letter_copying
