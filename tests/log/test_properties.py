"""Property: any mix of appends, reopens (clean or with a torn tail), retention and reads
serves exactly the appended records, in order, with no offset reused."""

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from zbroker.protocol.batch import iter_stored_batches
from tests.log.support import make_payload, open_log, read_all, read_records, record_value

appends = st.tuples(st.just("append"), st.integers(1, 20), st.integers(0, 300))
reads = st.tuples(st.just("read"), st.floats(0, 1), st.integers(1, 5000))
reopens = st.tuples(st.just("reopen"), st.binary(max_size=120))  # bytes of a torn write left at the tail
retention = st.tuples(st.just("retain"))
operations = st.lists(st.one_of(appends, appends, reads, reads, reopens, retention), max_size=40)
configs = st.fixed_dictionaries({
    "segment_bytes": st.sampled_from([300, 1000, 5000]),
    "index_interval_bytes": st.sampled_from([1, 64, 512]),
    "retention_bytes": st.sampled_from([-1, 2000]),
})


def check_read(plog, values, offset, max_bytes):
    blob = plog.read(offset, max_bytes)
    headers = [header for header, _ in iter_stored_batches(blob)]
    assert headers[0].base_offset <= offset < headers[0].next_offset
    assert len(blob) <= max_bytes or len(headers) == 1
    got = read_records(plog, offset, max_bytes)
    assert [r.offset for r in got] == list(range(offset, offset + len(got)))
    assert [r.value for r in got] == values[offset:offset + len(got)]


@settings(max_examples=150, deadline=None)
@given(config=configs, ops=operations)
def test_the_log_serves_exactly_what_was_appended(config, ops):
    values: list[bytes] = []
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        plog = open_log(directory, **config)
        log_start = 0
        try:
            for tag, op in enumerate(ops):
                if op[0] == "append":
                    _, count, size = op
                    assert plog.append(make_payload(tag, count, size), count, append_time_ms=tag) == len(values)
                    values.extend(record_value(tag, i, size) for i in range(count))
                elif op[0] == "read" and plog.log_end > plog.log_start:
                    _, where, max_bytes = op
                    offset = plog.log_start + int(where * (plog.log_end - 1 - plog.log_start))
                    check_read(plog, values, offset, max_bytes)
                elif op[0] == "reopen":
                    plog.close()
                    with open(max(directory.glob("*.log")), "ab") as tail:
                        tail.write(op[1])
                    plog = open_log(directory, **config)
                    assert plog.recovery.truncated_bytes == len(op[1])
                elif op[0] == "retain":
                    plog.enforce_retention(now_ms=0)
                assert plog.log_end == len(values)
                assert log_start <= plog.log_start <= plog.log_end
                log_start = plog.log_start
            assert [r.value for r in read_all(plog, max_bytes=700)] == values[log_start:]
        finally:
            plog.close()
