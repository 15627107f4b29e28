"""PartitionLog.offset_for_time: the first batch appended at or after a time."""

from tests.log.support import make_payload, open_log


def test_the_first_batch_at_or_after_the_time_across_segments(tmp_path):
    with open_log(tmp_path, segment_bytes=300) as plog:
        for i in range(10):  # batches of 5 records appended at 100, 200, ... 1000
            plog.append(make_payload(i, 5), 5, append_time_ms=100 * (i + 1))
        assert len(plog._segments) > 1
        assert plog.offset_for_time(0) == 0
        assert plog.offset_for_time(100) == 0
        assert plog.offset_for_time(101) == 5
        assert plog.offset_for_time(650) == 30
        assert plog.offset_for_time(1000) == 45
        assert plog.offset_for_time(1001) == plog.log_end == 50
