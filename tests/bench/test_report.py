"""bench.report from a hand-made results dict: summary shape, ratios, markdown, chart, files."""

from __future__ import annotations

import json

import pytest

from bench import report


def phase(msgs_s: float, cpu_us: float = 10.0, status: str = "ok", **extra) -> dict:
    return {"status": status, "records": 1000, "target": 1000, "seconds": 1000 / msgs_s, "msgs_s": msgs_s,
            "server_cpu_us_per_record": cpu_us, **extra}


def latency(p99: float) -> dict:
    return phase(5000, received=5000, publisher={"sent": 5000, "max_lag_ms": 1.5},
                 latency_ms={"p50": p99 / 4, "p99": p99, "p99_9": p99 * 2, "max": p99 * 3, "mean": p99 / 3},
                 cdf=[[p99 / 4, 0.5], [p99, 0.99], [p99 * 3, 1.0]])


@pytest.fixture
def results() -> dict:
    return {
        "started_at": 1_790_000_000.0,
        "scale": 1.0,
        "counts": {"records": 200_000},
        "command": "python -m bench",
        "machine": {"nproc": 2, "cpu_count": 2, "cpu_model": "Test CPU", "memory_bytes": 8 * 2**30,
                    "kernel": "Linux 6.1 x86_64", "python": "CPython 3.11.7",
                    "libraries": {"pyzmq": "27.0"}, "loadavg_at_start": [0.5, 0.4, 0.3]},
        "systems": {
            "zbroker": {"status": "ok", "version": "0.1.0", "durability": {"produce": "fsync interval:1000"},
                        "phases": {
                            "produce": phase(100_000, cpu_us=8.0),
                            "consume_ack": phase(50_000),
                            "produce_unbatched": phase(9_000, status="timed_out",
                                                       reason="time bound 300 s reached"),
                            "latency": latency(2.0),
                            "redelivery": {"status": "ok", "held_by_victim": 10_000, "all_redelivered": True,
                                           "seconds_until_all_redelivered": 10.5, "duplicates_seen": 0},
                        }},
            "rabbitmq": {"status": "ok", "version": "3.10.8", "durability": {"produce": "quorum queue"},
                         "phases": {"produce": phase(40_000), "consume_ack": phase(25_000),
                                    "produce_unbatched": {"status": "skipped", "reason": "no batch publish"},
                                    "latency": latency(8.0)}},
            "nats": {"status": "skipped", "reason": "NATS not reachable"},
            "redis": {"status": "ok", "version": "7.0.15", "durability": {},
                      "phases": {"produce": {"status": "failed", "reason": "ConnectionError: reset",
                                             "records": 10, "msgs_s": 5.0}}},
        },
        "ceiling": {"batched_100": phase(1_000_000, cpu_us=1.0), "unbatched_100": phase(200_000)},
        "commits": {"status": "skipped", "reason": "bench.commit_absorption not present"},
    }


def test_summary_has_the_latest_json_shape(results):
    s = report.summarize(results)
    w = s["workloads"]
    assert w["produce"] == {"zbroker": 100_000, "rabbitmq": 40_000, "nats": None, "redis": None,
                            "pgqueuer": None, "procrastinate": None, "pgmq": None, "zmq_ceiling": 1_000_000}
    assert w["consume_ack"]["zbroker"] == 50_000 and w["consume_ack"]["zmq_ceiling"] == 1_000_000
    assert w["latency_p99_ms"] == {"zbroker": 2.0, "rabbitmq": 8.0, "nats": None, "redis": None,
                                   "pgqueuer": None, "procrastinate": None, "pgmq": None}
    assert w["server_cpu_us_per_record"]["produce"]["zbroker"] == 8.0
    assert w["server_cpu_us_per_record"]["produce"]["zmq_ceiling"] == 1.0
    assert s["machine"]["nproc"] == 2 and s["command"] == "python -m bench"


def test_ratios_come_from_the_same_run_and_never_divide_by_missing(results):
    w = report.summarize(results)["workloads"]
    assert w["zbroker_over_peer"]["produce"] == {"rabbitmq": 2.5, "nats": None, "redis": None,
                                                 "pgqueuer": None, "procrastinate": None, "pgmq": None}
    assert w["zbroker_over_peer"]["consume_ack"]["rabbitmq"] == 2.0
    assert w["zbroker_over_peer"]["latency_p99"]["rabbitmq"] == 0.25
    assert w["zbroker_fraction_of_ceiling"]["produce"] == pytest.approx(0.1)
    # A timed-out phase keeps its (flagged) rate but is compared with nothing.
    assert w["produce_unbatched"]["zbroker"] == 9_000
    assert w["zbroker_fraction_of_ceiling"]["produce_unbatched"] is None
    assert w["zbroker_fraction_of_ceiling"]["produce_1k"] is None  # no 1 KiB ceiling in this run


@pytest.mark.parametrize("a, b, expected", [(10, 4, 2.5), (None, 4, None), (10, None, None), (10, 0, None),
                                            (0, 5, 0.0)])
def test_ratio(a, b, expected):
    assert report.ratio(a, b) == expected


def test_status_says_why_a_number_is_missing(results):
    status = report.summarize(results)["status"]
    assert status["nats"]["produce"] == "skipped: NATS not reachable"
    assert status["rabbitmq"]["produce_unbatched"] == "skipped: no batch publish"
    assert status["redis"]["produce"] == "failed: ConnectionError: reset"
    assert status["zbroker"]["produce_unbatched"].startswith("timed_out")
    assert status["redis"]["latency"] == "not run"


def test_markdown_marks_missing_cells_with_footnoted_reasons(results):
    md = report.render_markdown(report.summarize(results), chart="latest.png")
    produce_row = next(line for line in md.splitlines() if line.startswith("| produce 100 B, fsync interval"))
    assert "| 100,000 | 40,000 | skipped [" in produce_row and "| 10.0% |" in produce_row
    assert "NATS not reachable" in md and "ConnectionError: reset" in md
    assert "9,000 (timed out [" in md           # a partial figure stays, flagged
    assert "| latency p99 | 0.25× |" in md
    assert "another member had all of them after 10.50 s" in md
    assert "bench.commit_absorption not present" in md
    assert "![throughput and latency](latest.png)" in md


def test_the_no_linger_latency_row_appears_only_when_it_ran_and_stays_out_of_the_system_maps(results):
    md = report.render_markdown(report.summarize(results), chart="latest.png")
    assert "linger_ms=0)" not in md
    zb = results["systems"]["zbroker"]["phases"]
    zb["latency"]["publisher"]["linger_ms"] = 1.0
    zb["latency_linger_0"] = latency(40.0)
    zb["latency_linger_0"]["publisher"]["linger_ms"] = 0.0
    s = report.summarize(results)
    w = s["workloads"]
    assert w["latency_p99_ms"] == {"zbroker": 2.0, "rabbitmq": 8.0, "nats": None, "redis": None,
                                   "pgqueuer": None, "procrastinate": None, "pgmq": None}
    assert w["latency_variants_ms"]["zbroker_linger_0"]["p99"] == 40.0
    assert w["zbroker_over_peer"]["latency_p99"]["rabbitmq"] == 0.25  # the main row's ratio
    assert list(s["latency_cdf"]) == ["zbroker", "rabbitmq"] and list(s["latency_variants_cdf"]) == [
        "zbroker_linger_0"]
    md = report.render_markdown(s, chart="latest.png")
    titles = [line.split(" | ")[0] for line in md.splitlines() if "linger_ms=" in line and line.startswith("| ")]
    assert titles == ["| zbroker (publisher linger_ms=1)", "| zbroker (publisher linger_ms=0)"]
    row = next(line for line in md.splitlines() if line.startswith("| zbroker (publisher linger_ms=0) |"))
    assert "| 40.00 |" in row


def test_a_failed_latency_run_and_its_variant_both_say_why(results):
    zb = results["systems"]["zbroker"]["phases"]
    zb["latency"] = {"status": "failed", "reason": "RuntimeError: publisher exited early"}
    zb["latency_linger_0"] = {"status": "failed", "reason": "RuntimeError: no broker"}
    md = report.render_markdown(report.summarize(results), chart="latest.png")
    assert "publisher exited early" in md and "no broker" in md


def test_a_latency_run_that_lost_records_or_its_publisher_is_flagged_and_not_compared(results):
    zb = results["systems"]["zbroker"]["phases"]
    zb["latency"]["received"] = 4990  # of 5,000 sent
    short = report.summarize(results)
    assert short["status"]["zbroker"]["latency"] == "timed_out: 4,990 of the 5,000 records sent arrived"
    assert short["workloads"]["zbroker_over_peer"]["latency_p99"]["rabbitmq"] is None
    md = report.render_markdown(short, chart="latest.png")
    assert "| zbroker (timed out [5]) |" in md and "[5] 4,990 of the 5,000 records sent arrived" in md

    zb["latency"]["received"] = 5000
    zb["latency"]["publisher"]["error"] = "ConnectionError: reset"
    short = report.summarize(results)
    assert short["status"]["zbroker"]["latency"] == "failed: the publisher failed: ConnectionError: reset"
    assert short["workloads"]["zbroker_over_peer"]["latency_p99"]["rabbitmq"] is None


def test_scale_out_rows_report_the_median_and_range_of_their_runs(results):
    from bench.zbroker_adapter import scale_out_summary

    def run(msgs_s: float, *actor_cpu: float) -> dict:
        return {**phase(msgs_s), "per_actor": {f"partition-{i}": {"records": 1, "cpu_s": c,
                                                                  "cpu_s_per_million_records": c}
                                               for i, c in enumerate(actor_cpu)}}

    one = {role: scale_out_summary([run(900, 0.5), run(1000, 0.4), run(1200, 0.6)])
           for role in ("produce", "consume_ack")}
    two = {role: scale_out_summary([run(1500, 0.4, 0.7), run(1100, 0.5, 0.3), run(2000, 0.45, 0.5)])
           for role in ("produce", "consume_ack")}
    assert one["produce"]["msgs_s"] == 1000 and one["produce"]["msgs_s_range"] == [900, 1200]
    # Each run's busiest actor (0.7, 0.5, 0.5), then their median.
    assert two["produce"]["busiest_actor_cpu_s_per_million_records"] == 0.5
    assert two["produce"]["busiest_actor_cpu_s_per_million_records_range"] == [0.5, 0.7]
    results["systems"]["zbroker"]["phases"]["scale_out"] = {
        "status": "ok", "partitions": 4, "client_processes": 2, "rounds": 3, "actors": {"1": one, "2": two}}
    s = report.summarize(results)
    assert s["workloads"]["scale_out_actor_cpu_s_per_million_records"]["produce"] == {"1": 0.5, "2": 0.5}
    md = report.render_markdown(s, chart="latest.png")
    assert "ran 3 times, interleaved" in md
    row = next(line for line in md.splitlines() if line.startswith("| 2 | "))
    assert "| 1,500 [1,100–2,000] |" in row and "0.50 (+0%) [0.50–0.70]" in row
    assert "Runs not ok" not in md


def test_a_failed_scale_out_run_is_left_out_of_the_medians_and_said():
    from bench.zbroker_adapter import scale_out_summary

    failed = {"status": "failed", "reason": "RuntimeError: broker did not start"}
    late = {**phase(500), "status": "timed_out", "reason": "time bound 300 s reached", "per_actor": {}}
    row = scale_out_summary([{**phase(1000), "per_actor": {}}, failed, late])
    assert row["runs_used"] == 2 and row["msgs_s"] == 750 and row["msgs_s_range"] == [500, 1000]
    assert [r["status"] for r in row["runs_not_ok"]] == ["failed", "timed_out"]
    assert scale_out_summary([failed])["status"] == "failed"
    entry = {"status": "ok", "client_processes": 2, "rounds": 3, "actors": {"1": {"produce": row}}}
    md = report._render_scale_out(entry, report._Footnotes())
    assert "broker did not start" in md and "time bound 300 s reached" in md


def test_results_md_is_the_template_filled_in(results):
    s = report.summarize(results)
    text = report.render_results_md(s, "results/latest.png",
                                    template="$date|$command|$scale|$servers\n$machine\n$tables")
    first = text.splitlines()[0]
    assert first == "2026-09-21T14:13:20Z|python -m bench|1.0|zbroker 0.1.0, rabbitmq 3.10.8, redis 7.0.15"
    assert "- CPU: Test CPU" in text and "- memory: 8.0 GiB" in text
    assert "](results/latest.png)" in text
    # The shipped template has every placeholder render_results_md fills.
    assert "Do not edit by hand" in report.render_results_md(s, "results/latest.png")


# matplotlib runs `fc-list` the first time it looks for fonts on a machine (CI's fresh one).
@pytest.mark.processes
def test_write_run_writes_json_png_markdown_and_latest_copies(results, tmp_path):
    paths = report.write_run(results, tmp_path / "out", results_md=tmp_path / "RESULTS.md")
    for key in ("json", "png", "md", "latest_json", "latest_png", "latest_md", "results_md"):
        assert paths[key].exists(), key
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    latest = json.loads(paths["latest_json"].read_text())
    assert latest["workloads"]["produce"]["zbroker"] == 100_000
    full = json.loads(paths["json"].read_text())
    assert full["systems"]["nats"]["reason"] == "NATS not reachable" and "summary" in full
    assert "](out/latest.png)" in paths["results_md"].read_text()


def test_the_latency_ceiling_is_a_row_beside_the_systems_and_never_a_peer(results):
    results["ceiling"]["latency"] = latency(0.5)
    s = report.summarize(results)
    w = s["workloads"]
    assert w["latency_p99_ms"]["zmq_ceiling"] == 0.5
    assert set(w["zbroker_over_peer"]["latency_p99"]) == set(report.PEERS)  # the floor is no peer to beat
    assert w["zbroker_latency_p99_over_ceiling"] == 4.0  # zbroker's 2.0 ms over the relay's 0.5
    assert "zmq_ceiling" in s["latency_cdf"]
    md = report.render_markdown(s, chart="latest.png")
    row = next(line for line in md.splitlines() if line.startswith("| raw pyzmq: publisher -> bare relay"))
    assert "| 0.50 |" in row
    assert "zbroker's p99 is 4.00× the relay's." in md


def test_a_latency_ceiling_that_lost_records_is_flagged_and_not_compared(results):
    results["ceiling"]["latency"] = latency(0.5)
    results["ceiling"]["latency"]["received"] = 4000  # of 5,000 sent
    s = report.summarize(results)
    assert s["status"]["zmq_ceiling"]["latency"].startswith("timed_out: 4,000 of the 5,000")
    assert s["workloads"]["zbroker_latency_p99_over_ceiling"] is None
    assert "No ratio: a row is missing or incomplete." in report.render_markdown(s, chart="latest.png")


def test_no_latency_ceiling_row_when_the_run_had_none(results):
    s = report.summarize(results)
    assert "zmq_ceiling" not in s["workloads"]["latency_p99_ms"]
    assert "bare relay" not in report.render_markdown(s, chart="latest.png")


def test_a_ceiling_that_timed_out_or_failed_says_so_in_its_cells(results):
    """The ceiling's cells are numbers like the systems': a partial one is flagged, a missing
    one gives its reason, in the throughput table and in the CPU table."""
    results["ceiling"]["batched_100"] = phase(400_000, cpu_us=1.0, status="timed_out",
                                              reason="time bound 300 s reached")
    results["ceiling"]["unbatched_100"] = {"status": "failed", "reason": "RuntimeError: zmq pusher did not start"}
    md = report.render_markdown(report.summarize(results), chart="latest.png")
    table = md.split("### zbroker / peer")[0]
    rows = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| produce 100 B")}
    throughput = rows["| produce 100 B, fsync interval"]
    assert "| 400,000 (timed out [" in throughput, throughput
    unbatched = rows["| produce 100 B, one record per request"]
    ceiling_column = 1 + len(report.SYSTEMS)  # after the title and one cell per system
    assert "failed [" in unbatched.split(" | ")[ceiling_column], unbatched
    assert "zmq pusher did not start" in md
    cpu_row = [line for line in md.split("### Server CPU per record")[1].splitlines()
               if line.startswith("| produce 100 B, fsync interval")][0]
    assert "1.0 (timed out [" in cpu_row.split(" | ")[-1], cpu_row


def test_the_high_rate_latency_table_and_its_ratio_come_from_the_same_run(results):
    results["systems"]["zbroker"]["phases"]["latency_50k"] = {**latency(3.0), "rate": 50_000}
    results["systems"]["rabbitmq"]["phases"]["latency_50k"] = {**latency(12.0), "rate": 50_000}
    results["ceiling"]["latency_50k"] = {**latency(1.5), "rate": 50_000}
    s = report.summarize(results)
    w = s["workloads"]
    assert w["latency_high_rate"] == 50_000
    assert w["latency_50k_ms"]["zbroker"]["p99"] == 3.0 and w["latency_50k_ms"]["zmq_ceiling"]["p99"] == 1.5
    assert w["zbroker_over_peer"]["latency_50k_p99"]["rabbitmq"] == 0.25
    assert w["zbroker_over_peer"]["latency_50k_p99"]["nats"] is None  # not run: compared with nothing
    md = report.render_markdown(s, chart="latest.png")
    table = md.split("at 50,000 records/s")[1].split("###")[0]
    assert "| zbroker | 0.75 | 3.00 |" in table and "| rabbitmq | 3.00 | 12.00 |" in table
    assert "bare relay" in table


def test_no_high_rate_table_when_no_system_ran_it(results):
    assert "records/s\n" not in report.render_markdown(report.summarize(results), chart="latest.png")


def test_the_partition_count_table_compares_each_row_with_the_fewest_partitions(results):
    results["systems"]["zbroker"]["phases"]["partitions"] = {"status": "ok", "records": 1000, "rows": {
        "4": {"produce": phase(800_000), "consume_ack": phase(600_000)},
        "1024": {"produce": phase(400_000), "consume_ack": phase(30_000, status="timed_out", reason="300 s")},
    }}
    md = report.render_markdown(report.summarize(results), chart="latest.png")
    table = md.split("Partition count")[1].split("###")[0]
    assert "| 4 | 800,000 | 600,000 | 100% | 100% |" in table
    # A timed-out row keeps its rate, flagged, and is compared with nothing.
    row = [line for line in table.splitlines() if line.startswith("| 1,024 |")][0]
    assert row.startswith("| 1,024 | 400,000 | 30,000 (timed out [") and row.endswith("| 50% | – |"), row


def test_the_capacity_rows_show_both_cpu_figures_and_the_python_client_beside_them(results):
    results["systems"]["zbroker"]["phases"]["capacity"] = {
        "status": "ok", "records": 1000, "how": "zbload",
        "produce": phase(2_000_000, cpu_us=0.4, loadgen_cpu_us_per_record=0.1),
        "consume_ack": phase(1_000_000, cpu_us=0.8, status="failed", reason="zbload: no reply"),
    }
    md = report.render_markdown(report.summarize(results), chart="latest.png")
    table = md.split("Broker capacity")[1].split("###")[0]
    assert "| produce 100 B | 2,000,000 | 0.40 | 0.10 | 100,000 | 20.00× |" in table
    assert "| consume + ack | failed [" in table and table.count("×") == 1
