"""bench.procstat: /proc/<pid>/stat parsing and CPU deltas, on text we write."""

from __future__ import annotations

import os

import pytest

from bench.procstat import CpuSample, cpu_delta, parse_stat, read_stat, us_per_record


def stat_line(pid: int, comm: str, utime: int, stime: int, start: int = 777, ppid: int = 1,
              cutime: int = 99, cstime: int = 98) -> str:
    # Fields 3.. of proc(5): state, ppid, pgrp, session, tty_nr, tpgid, flags, minflt, cminflt,
    # majflt, cmajflt, utime(14), stime(15), cutime, cstime, priority, nice, num_threads,
    # itrealvalue, starttime(22), vsize, ...
    rest = ["S", ppid, 10, 10, 0, -1, 4194560, 5, 0, 0, 0, utime, stime, cutime, cstime, 20, 0, 4, 0, start,
            123456, 789]
    return f"{pid} ({comm}) " + " ".join(str(x) for x in rest) + "\n"


@pytest.mark.parametrize("comm", ["redis-server", "beam.smp", "a b", "x) (y", ")", "((", "name with ) 1 2 3"])
def test_parse_stat_takes_comm_up_to_the_last_paren(comm):
    stat = parse_stat(stat_line(4242, comm, utime=150, stime=25, start=31337, ppid=7))
    assert (stat.pid, stat.comm, stat.ppid) == (4242, comm, 7)
    assert (stat.utime_ticks, stat.stime_ticks, stat.start_ticks) == (150, 25, 31337)
    assert stat.cpu_ticks == 175


def test_parse_stat_of_this_process_agrees_with_the_kernel():
    stat = read_stat(os.getpid())
    assert stat is not None and stat.pid == os.getpid() and stat.ppid == os.getppid()


def fake_proc(root, entries: dict[int, str], uptime_s: float | None = None) -> str:
    root.mkdir()
    if uptime_s is not None:
        (root / "uptime").write_text(f"{uptime_s:.2f} 1.00\n")
    for pid, text in entries.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(text)
    return str(root)


def test_cpu_delta_sums_processes_present_at_both_ends(tmp_path):
    before_root = fake_proc(tmp_path / "before", {
        1: stat_line(1, "a", 100, 50), 2: stat_line(2, "b", 10, 0), 3: stat_line(3, "gone", 5, 5)})
    after_root = fake_proc(tmp_path / "after", {
        1: stat_line(1, "a", 130, 70),         # +50 ticks
        2: stat_line(2, "b", 20, 10),          # +20 ticks
        4: stat_line(4, "new", 1000, 1000)})   # appeared: not counted
    before = CpuSample.take([1, 2, 3, 4], proc_root=before_root)
    after = CpuSample.take([1, 2, 3, 4], proc_root=after_root)
    delta = cpu_delta(before, after, ticks_per_s=100)
    assert delta.seconds == pytest.approx(0.70)
    assert delta.unmatched == 2  # pid 3 exited, pid 4 is new


def test_reaped_children_and_processes_started_during_the_phase_count(tmp_path):
    # uptime 10 s = 1,000 ticks at 100/s when the first sample is taken.
    before = CpuSample.take([1, 5], proc_root=fake_proc(tmp_path / "b", {
        1: stat_line(1, "redis-server", 100, 0, start=50, cutime=7, cstime=3),
        5: stat_line(5, "older", 10, 0, start=60)}, uptime_s=10.0))
    after = CpuSample.take([1, 5, 6, 7], proc_root=fake_proc(tmp_path / "a", {
        1: stat_line(1, "redis-server", 150, 0, start=50, cutime=37, cstime=13),  # +50 own, +40 reaped child
        5: stat_line(5, "older", 20, 0, start=60),                               # +10
        6: stat_line(6, "redis-rdb-bgsave", 30, 5, start=1_200, cutime=0, cstime=0),  # started after: all 35
        7: stat_line(7, "missed", 500, 0, start=900, cutime=0, cstime=0)}, uptime_s=15.0))  # before: unknown
    delta = cpu_delta(before, after, ticks_per_s=100)
    assert delta.seconds == pytest.approx((50 + 40 + 10 + 35) / 100)
    assert delta.unmatched == 1  # pid 7 was running before the first sample but not in it


def test_a_child_reaped_during_the_phase_counts_only_what_it_used_in_it(tmp_path):
    # The AOF rewrite child was alive at the first sample (counted, perhaps in full, by the
    # phase before); its parent reaps it during this one, and its cutime grows by the
    # child's whole life: 80 ticks before the sample, 20 after.
    before = CpuSample.take([1, 6], proc_root=fake_proc(tmp_path / "b", {
        1: stat_line(1, "redis-server", 100, 0, start=50, cutime=0, cstime=0),
        6: stat_line(6, "redis-rdb-bgsave", 70, 10, start=1_200, ppid=1, cutime=0, cstime=0)}, uptime_s=15.0))
    after = CpuSample.take([1, 6], proc_root=fake_proc(tmp_path / "a", {
        1: stat_line(1, "redis-server", 130, 0, start=50, cutime=90, cstime=10)}, uptime_s=20.0))
    delta = cpu_delta(before, after, ticks_per_s=100)
    assert delta.seconds == pytest.approx((30 + 20) / 100)
    assert delta.unmatched == 1  # the child, gone from the second sample


def test_a_recycled_pid_is_not_taken_for_the_same_process(tmp_path):
    before = CpuSample.take([9], proc_root=fake_proc(tmp_path / "b", {9: stat_line(9, "x", 500, 0, start=1)}))
    after = CpuSample.take([9], proc_root=fake_proc(tmp_path / "a", {9: stat_line(9, "x", 3, 0, start=2)}))
    delta = cpu_delta(before, after, ticks_per_s=100)
    assert delta.seconds == 0 and delta.unmatched == 2


def test_missing_process_reads_as_none(tmp_path):
    assert read_stat(123, proc_root=str(tmp_path)) is None


@pytest.mark.parametrize("cpu_s, records, expected", [(0.5, 100_000, 5.0), (0.0, 10, 0.0), (None, 10, None),
                                                      (1.0, 0, None)])
def test_us_per_record(cpu_s, records, expected):
    assert us_per_record(cpu_s, records) == expected


@pytest.mark.processes
def test_the_precise_clock_of_another_process_agrees_with_its_ticks():
    # A child that burns CPU for a while: the nanosecond clock and /proc's ticks
    # must tell the same story (within a couple of 10 ms ticks), and the sample
    # must prefer the nanosecond figure.
    import subprocess
    import sys
    import time

    from bench.procstat import process_cpu_clock

    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(60)"])
    try:
        before = CpuSample.take([child.pid])
        deadline = time.monotonic() + 30
        while (process_cpu_clock(child.pid) or 0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        after = CpuSample.take([child.pid])
        precise = cpu_delta(before, after).seconds
        by_ticks = cpu_delta(CpuSample(before.ticks), CpuSample(after.ticks)).seconds
        assert before.precise and after.precise
        assert precise == pytest.approx(by_ticks, abs=0.05)
        assert precise != by_ticks or precise == 0  # nanoseconds, not whole ticks
    finally:
        child.kill()
        child.wait()


def test_a_delta_says_how_many_processes_it_measured(tmp_path):
    # Nothing in common and nothing new (a pid list that found no server, or an actor
    # that was replaced): the delta's 0 seconds measured nothing, and says so.
    before = CpuSample.take([9], proc_root=fake_proc(tmp_path / "b", {9: stat_line(9, "x", 500, 0, start=1)}))
    after = CpuSample.take([9], proc_root=fake_proc(tmp_path / "a", {9: stat_line(9, "x", 3, 0, start=2)}))
    assert cpu_delta(before, after, ticks_per_s=100).measured == 0
    assert cpu_delta(CpuSample({}), CpuSample({}), ticks_per_s=100).measured == 0
    same = CpuSample.take([9], proc_root=str(tmp_path / "b"))
    assert cpu_delta(same, same, ticks_per_s=100).measured == 1


def test_a_phase_that_found_no_server_process_reports_no_cpu_figure_not_zero():
    """A peer whose server is not visible here (another PID namespace, another name):
    its CPU per record is unknown, not 0.0 µs, which would read as the cheapest broker."""
    from bench.adapter import Phase

    for pids in ([], [2**22 + 12345]):  # no process found; a pid that does not exist
        phase = Phase(system="redis", workload="produce", target=10, timeout_s=5, server_pids=lambda p=pids: p)
        phase.begin()
        phase.advance(10)
        phase.end()
        result = phase.result()
        assert result["status"] == "ok"
        assert result["server_cpu_s"] is None and result["server_cpu_us_per_record"] is None, result
