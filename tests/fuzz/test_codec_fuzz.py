"""In-process fuzzing of the decoders: any input is a value or a ProtocolError/CorruptBatch.

Two fuzzers: Hypothesis (always; structured mutations of valid frames, byte
mutations, stored batches with correct CRCs around junk), and atheris,
coverage-guided, on the same targets in a subprocess when it is installed
(``pip install atheris``; it is not a declared test dependency, so `make test`
skips it where it is missing).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbroker.protocol import codec
from zbroker.protocol import messages as m
from zbroker.protocol.errors import NotOwner, ProtocolError
from tests.fuzz import codec_targets as tgt
from tests.fuzz import frames as fz
from tests.fuzz.frames import CoordinatorContext, FrameMutator

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = int(os.environ.get("ZBROKER_FUZZ_EXAMPLES", "400"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ALL_TEMPLATES = (fz.coordinator_templates(CoordinatorContext(topic="t", group="g", member_id="m-1", generation=3,
                                                             leases=[["t", 0, (1 << 60) + 9, 5, 9]]))
                 + fz.coordinator_reply_templates(lambda: 7) + fz.partition_templates("t", 10)
                 + fz.writer_templates())
REPLY_TEMPLATES = [fz.Template(msgpack.unpackb(frames[0], raw=False)) for frames in [
    codec.encode_reply(m.HelloReply(version=1, server="zbroker", actor="x", limits={}), 5),
    codec.encode_reply(m.PollReply(generation=1, deliveries=[["t", 0, 1 << 60, 0, 3, 1, "new"]],
                                   ack_timeout_ms=1), 5),
    codec.encode_reply(m.AdvanceReply(durable=[["g", "t", 0, 1, 0]]), 5),
    codec.encode_reply(m.ProduceReply(base_offset=1, count=1), 5),
    codec.encode_reply(m.FetchReply(log_start=0, log_end=1), 5),
    codec.encode_reply(m.LoadOffsetsReply(rows=[]), 5),
    codec.encode_error("fetch", 3, NotOwner("not here", topic="t", partition=0)),
    codec.encode_error(None, None, ProtocolError("unreadable")),
]]


@FUZZ
@given(fz.fuzz_messages(ALL_TEMPLATES))
def test_any_request_frames_decode_or_raise_protocol_error(frames):
    tgt.check_request(frames)
    tgt.check_any(frames)


@FUZZ
@given(fz.fuzz_messages(REPLY_TEMPLATES))
def test_any_reply_frames_decode_or_raise_protocol_error(frames):
    tgt.check_reply(frames)
    tgt.check_any(frames)


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=7))
def test_raw_bytes_never_escape_the_decoders(frames):
    if frames:
        tgt.check_request(frames)
        tgt.check_reply(frames)
    else:
        with pytest.raises(ProtocolError):
            codec.decode_request(frames)


record = st.tuples(st.integers(-(1 << 63), (1 << 64) - 1), st.one_of(st.none(), st.binary(max_size=8)),
                   st.binary(max_size=16),
                   st.one_of(st.none(), st.dictionaries(st.text(max_size=4), st.binary(max_size=4), max_size=2)))
records = st.lists(st.one_of(record.map(list), fz.scalar, st.lists(fz.scalar, max_size=5),
                             st.dictionaries(st.text(max_size=3), fz.scalar, max_size=5)), min_size=1, max_size=6)


@st.composite
def stored_blobs(draw):
    """Back-to-back stored batches, CRC-correct around valid or junk payloads, then maybe mutated."""
    batches = []
    base = draw(st.integers(0, 1 << 40))
    for _ in range(draw(st.integers(1, 3))):
        recs = draw(records)
        payload = draw(st.one_of(st.just(fz.pack(recs)), st.binary(max_size=60),
                                 st.builds(lambda p, i, b: p[:i] + b + p[i:], st.just(fz.pack(recs)),
                                           st.integers(0, 40), st.sampled_from(fz.HUGE_DECLARATIONS))))
        count = draw(st.one_of(st.just(len(recs)), st.integers(0, (1 << 32) - 1)))
        batches.append(tgt.stored(payload, base=base, count=count))
        base += max(1, count)
    blob = b"".join(batches)
    edit = draw(st.sampled_from(["none", "truncate", "flip", "flip+recrc", "length", "tail"]))
    at = draw(st.integers(0, max(0, len(blob) - 1)))
    if edit == "truncate":
        blob = blob[:at]
    elif edit in ("flip", "flip+recrc") and blob:
        blob = blob[:at] + bytes([blob[at] ^ draw(st.integers(1, 255))]) + blob[at + 1:]
        if edit == "flip+recrc":
            blob = tgt.recrc(blob)
    elif edit == "length":
        blob = tgt.recrc(blob[:8] + draw(st.sampled_from([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00",
                                                          b"\x00\x00\x00\x01"])) + blob[12:])
    elif edit == "tail":
        blob += draw(st.binary(max_size=50))
    return blob


@FUZZ
@given(stored_blobs(), st.booleans())
def test_any_fetched_blob_decodes_or_raises_corrupt_batch(blob, verify_crc):
    tgt.check_stored(blob, verify_crc)


@FUZZ
@given(st.one_of(records.map(fz.pack), st.binary(max_size=80),
                 st.builds(lambda p, b: b + p, records.map(fz.pack), st.sampled_from(fz.HUGE_DECLARATIONS))))
def test_any_batch_payload_is_counted_or_raises_corrupt_batch(payload):
    tgt.check_payload(payload)


def test_100k_mutated_frames_through_every_decoder():
    """The live fuzzers' generator, in-process: 100,000 messages through each decoder."""
    rng = random.Random(7)
    mutator = FrameMutator(rng, ALL_TEMPLATES + REPLY_TEMPLATES, huge_header_every=10_000)
    for _ in range(100_000):
        frames = mutator.next()
        tgt.check_request(frames)
        tgt.check_reply(frames)
        for frame in frames[1:2]:
            tgt.check_payload(frame)
            tgt.check_stored(frame, verify_crc=False)


@pytest.mark.processes
def test_atheris_coverage_guided_fuzz_of_the_decoders(tmp_path):
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, tpl in enumerate(ALL_TEMPLATES + REPLY_TEMPLATES):
        (corpus / f"frame-{i}").write_bytes(b"\x00" + fz.pack(tpl.header))
    (corpus / "stored").write_bytes(b"\x03" + tgt.stored(fz.small_batch(2), count=2))
    runs = os.environ.get("ZBROKER_ATHERIS_RUNS", "100000")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.atheris_codec", f"-runs={runs}", "-max_total_time=20",
         "-max_len=4096", f"-artifact_prefix={tmp_path}/", "-print_final_stats=1", str(corpus)],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    tail = proc.stderr[-4000:]
    assert proc.returncode == 0, tail
    print(next((line for line in proc.stderr.splitlines() if "stat::number_of_executed_units" in line), tail))
