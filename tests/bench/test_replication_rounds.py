"""The replication benchmark's throughput rows: rounds alternated, medians shown, the ratio's range kept."""

from __future__ import annotations

from bench.replication import _medians
from bench.report import _Footnotes, _render_replication


def round_of(r1_produce: float, r3_produce: float, r1_consume: float, r3_consume: float) -> dict:
    return {"R=1": {"produce": {"msgs_s": r1_produce}, "consume_ack": {"msgs_s": r1_consume}},
            "R=3 M=2": {"produce": {"msgs_s": r3_produce}, "consume_ack": {"msgs_s": r3_consume}}}


def test_each_row_is_the_median_round_and_the_ratio_the_median_of_the_rounds_ratios():
    rounds = [round_of(1000, 400, 800, 500), round_of(1200, 700, 400, 800), round_of(900, 450, 700, 600)]
    rows, ratios, ranges = _medians(rounds)
    assert rows["R=1"]["produce"]["msgs_s"] == 1000 and rows["R=3 M=2"]["produce"]["msgs_s"] == 450
    assert ratios == {"produce": 0.5, "consume_ack": 0.857}  # 0.4, 0.583, 0.5 / 0.625, 2.0, 0.857
    assert ranges == {"produce": [0.4, 0.583], "consume_ack": [0.625, 2.0]}


def test_a_round_without_a_figure_leaves_no_ratio_rather_than_a_median_of_the_others():
    rounds = [round_of(1000, 400, 800, 500), round_of(1000, 0, 800, 500), round_of(1000, 600, 800, 500)]
    _rows, ratios, ranges = _medians(rounds)
    assert ratios["produce"] is None and ranges["produce"] == [0.4, 0.6]


def test_the_table_shows_the_ratio_with_its_range_and_how_many_rounds():
    rows, ratios, ranges = _medians([round_of(1000, 500, 800, 400)] * 3)
    latency = {"rate": 2000, "latency_ms": {"p50": 1.0, "p99": 2.0}}
    entry = {"status": "ok", "how": "bench.replication.run(scale=0.5)",
             "result": {"records": 50_000, "record_bytes": 100, "layout": "one host", "rows": rows,
                        "r3_over_r1": ratios, "r3_over_r1_range": ranges, "rounds": 3,
                        "latency": {"R=1": latency, "R=3 M=2": latency},
                        "failover": {"kills": 20, "p50_s": 5.0, "max_s": 5.5}}}
    text = _render_replication(entry, _Footnotes())
    assert "3 rounds" in text and "| produce rec/s | 1,000 | 500 | 0.5 (0.5-0.5) |" in text
