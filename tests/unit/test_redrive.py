"""What a dead letter becomes when it goes back (zbroker.client.redrive), without a broker."""

import pytest

from zbroker.client.redrive import NotRedrivable, provenance, redriven_copy

LETTER = {"zb-dlq-source-topic": b"jobs", "zb-dlq-source-partition": b"1", "zb-dlq-source-offset": b"7",
          "zb-dlq-attempts": b"5", "zb-dlq-reason": b"timeout", "zb-dlq-group": b"g", "trace": b"x"}


def test_provenance_is_kept_and_each_redrive_counted():
    assert provenance(LETTER) == ("jobs", 1, 7)
    key, value, headers = redriven_copy(b"k", b"v", LETTER)
    assert (key, value) == (b"k", b"v")
    assert headers == {**LETTER, "zb-dlq-redrives": b"1"}
    assert redriven_copy(b"k", b"v", headers)[2]["zb-dlq-redrives"] == b"2"
    assert LETTER.get("zb-dlq-redrives") is None  # the letter's own headers are not changed


def test_a_dropped_value_comes_from_the_original_or_the_letter_stays():
    dropped = {**LETTER, "zb-dlq-value-dropped": b"900", "zb-dlq-headers-dropped": b"1"}
    with pytest.raises(NotRedrivable):
        redriven_copy(b"k", b"", dropped)
    key, value, headers = redriven_copy(None, b"", dropped, original=(b"k", b"v" * 900, {"trace": b"y"}))
    assert (key, value) == (b"k", b"v" * 900)
    assert headers["trace"] == b"y" and "zb-dlq-value-dropped" not in headers
    assert headers["zb-dlq-source-offset"] == b"7" and headers["zb-dlq-redrives"] == b"1"


def test_a_record_without_provenance_is_not_a_dead_letter():
    for headers in (None, {"trace": b"x"}, {**LETTER, "zb-dlq-source-partition": b"one"}):
        with pytest.raises(NotRedrivable):
            provenance(headers)
