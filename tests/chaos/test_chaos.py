"""The chaos run: at-least-once under SIGKILLs and database cuts, judged by the checker.

A broker with two partition actors keeps its offsets in PostgreSQL, reached
through a `TcpProxy` in a fresh schema. Producers and consumers run as
processes (tests/chaos/workload.py) while a nemesis SIGKILLs actors and
consumers and cuts the database connection for ``--chaos-duration`` seconds
(180 by default, in ``make test``; ``make chaos DURATION=1800`` for the long
run). Then producers stop, consumers drain, and the checker
(tests/chaos/checker.py) must find 0 lost records, 0 committed-offset
regressions and 0 commits past an unfinished record. Duplicates are
counted and attributed to the nemesis events.

Replay: the seed is printed and stored in the report; ``ZBROKER_CHAOS_SEED``
sets it. The report (JSON and table) is written to the test's tmp dir;
with ``ZBROKER_CHAOS_REPORT=docs/RELIABILITY.md`` it also becomes that file.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.chaos.checker import Report, check
from tests.chaos.conftest import open_chaos_broker
from tests.chaos.workload import ChaosConfig, ChaosRun
from tests.support.pg import pg_dsn, pg_fetch, pg_schema_factory  # noqa: F401

pytestmark = [pytest.mark.chaos, pytest.mark.postgres, pytest.mark.processes]

REPO = Path(__file__).resolve().parents[2]


def chaos_seed() -> int:
    given = os.environ.get("ZBROKER_CHAOS_SEED")
    return int(given) if given else random.SystemRandom().randrange(1 << 32)


@pytest.fixture
def chaos_broker(pg_dsn, pg_schema_factory, start):
    yield from open_chaos_broker(start, pg_dsn, pg_schema_factory(), partition_actors=2)


def test_no_acknowledged_record_is_lost_under_chaos(tmp_path, pg_dsn, chaos_broker, chaos_duration, capsys):
    config = ChaosConfig(duration_s=chaos_duration, seed=chaos_seed())
    history, report, replay, drain = run_and_check(ChaosRun, config, chaos_broker, pg_dsn, tmp_path, capsys,
                                                   "single", render_markdown)
    summary = report.summary()
    assert_every_run_holds(summary, history, replay, drain)
    assert summary["acked"] > 0 and len(history.events) > 0


def assert_every_run_holds(summary: dict, history, replay: str, drain: str) -> None:
    """What every chaos run (single, replicated, cluster) must show; each adds its own checks."""
    assert summary["lost"] == 0, f"{summary['lost']} acknowledged records lost {replay}{drain}"
    assert summary["regressions"] == 0, f"{summary['regressions']} committed-offset regressions {replay}"
    assert summary["committed_past_unfinished"] == 0, \
        f"{summary['committed_past_unfinished']} commits past an unfinished record {replay}"
    assert summary["committed_beyond_log_end"] == 0, f"commits beyond the log end {replay}"
    assert history.meta["drained"], f"nothing lost, but the drain did not finish {replay}{drain}"


def run_and_check(run_class, config, chaos_broker, pg_dsn: str, tmp_path: Path, capsys, section: str, render):
    """Run, check, keep the report (and with ZBROKER_CHAOS_REPORT, the page's `section`).

    Returns the history, the report, and the replay and drain notes for the assertions."""
    broker, proxy, schema, actors = chaos_broker
    print(f"\n{section} chaos seed {config.seed} (replay: ZBROKER_CHAOS_SEED={config.seed})", flush=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    with run_class(config, broker, proxy, pg_dsn, schema, tmp_path, actors=actors, log=_progress(capsys)) as run:
        history = run.run()
    history.meta.update(wall_s=round(time.monotonic() - started, 1), load_before=load_before,
                        load_after=os.getloadavg(), code=_code_version(), command=_command(),
                        machine=_machine(pg_dsn))
    report = check(history)

    (tmp_path / "chaos-report.json").write_text(report.to_json())
    table = report.to_table()
    (tmp_path / "chaos-report.txt").write_text(table + "\n")
    with capsys.disabled():
        print(f"\n{table}\n(seed {config.seed}; report in {tmp_path})")
    target = os.environ.get("ZBROKER_CHAOS_REPORT")
    if target:
        path = Path(target) if Path(target).is_absolute() else REPO / target
        update_page(path, section, render(report))
    replay = f"(seed {config.seed}, report {tmp_path / 'chaos-report.json'})"
    drain = "" if history.meta["drained"] else f"; the drain did not finish: {history.meta['drain_state']}"
    return history, report, replay, drain


def _progress(capsys):
    def log(line: str) -> None:
        with capsys.disabled():
            print(line, flush=True)
    return log


# -- docs/RELIABILITY.md -------------------------------------------------------------------

def _machine(pg_dsn: str) -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kb = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                          if line.startswith("MemTotal")))
        mem = f"{mem_kb / 1024 / 1024:.1f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        mem = "unknown RAM"
    try:
        pg = pg_fetch(pg_dsn, "SHOW server_version")[0][0]
    except Exception:
        pg = "unknown"
    return (f"{os.cpu_count()} CPUs ({cpu}), {mem}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, PostgreSQL {pg}")


def _code_version() -> str:
    """Which code ran: ZBROKER_CHAOS_CODE if given, else the commit and whether the tree was dirty.

    Read-only git only (``--no-optional-locks``: not even an index refresh).
    """
    given = os.environ.get("ZBROKER_CHAOS_CODE")
    if given:
        return given
    git = ["git", "--no-optional-locks", "-C", str(REPO)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"commit {head}" + (" with uncommitted changes in the working tree" if dirty else "")


def _command() -> str:
    env = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("ZBROKER_CHAOS_SEED", "ZBROKER_CHAOS_REPORT")
                   if os.environ.get(k))
    python = Path(sys.executable)
    if python.is_relative_to(REPO):
        python = python.relative_to(REPO)
    cmd = f"{python} -m pytest {' '.join(shlex.quote(a) for a in sys.argv[1:])}"
    return f"{env} {cmd}".strip()


def render_markdown(report: Report) -> str:
    """docs/RELIABILITY.md for a report (its meta says how the run was made)."""
    meta, s = report.meta, report.summary()
    table = report.to_table()
    by_kind: dict[str, int] = {}
    for ev in report.events:
        by_kind[ev.kind] = by_kind.get(ev.kind, 0) + 1
    kills: dict[str, int] = {}
    for ev in report.events:
        if ev.kind == "kill-actor":
            kills[ev.target] = kills.get(ev.target, 0) + 1
    kill_text = ", ".join(f"{n}× {t}" for t, n in sorted(kills.items())) or "none"
    cfg = meta["config"]
    return f"""# Reliability: the chaos run

Each chaos run with `ZBROKER_CHAOS_REPORT=docs/RELIABILITY.md` writes its own
section of this page: the single-host run (tests/chaos/test_chaos.py) this one,
the replicated run with host loss (tests/chaos/test_replicated_chaos.py) the
one below it, and the cluster run, three nodes on one PostgreSQL with the
leading node killed, paused and cut off (tests/chaos/test_cluster_chaos.py),
the last. `make test` runs the single-host test for 180 s and the other two
for 60 s each without touching the page; `make chaos DURATION=…
[CHAOS=single|replicated|cluster|both]` runs them for longer.

## Result: {s['verdict']}

| check | result | required |
|---|---:|---:|
| lost (acknowledged to a producer, never delivered) | {s['lost']} | 0 |
| committed-offset regressions | {s['regressions']} | 0 |
| commits past an unfinished record | {s['committed_past_unfinished']} | 0 |
| commits beyond the log end | {s['committed_beyond_log_end']} | 0 |
| duplicates (finishes after the first) | {s['duplicates']} | allowed |

## This run

- command (from the repository root): `{meta.get('command', '?')}`; `make chaos DURATION={meta['duration_s']:.0f}` runs the same test
- seed: `{meta['seed']}` (replay the nemesis schedule and the workload's choices with `ZBROKER_CHAOS_SEED={meta['seed']}`; the interleaving with the OS scheduler is not replayable)
- duration: {meta['duration_s']:.0f} s of nemesis; the whole test took {meta.get('wall_s', '?')} s, of which {meta.get('drain_s', '?')} s draining
- machine: {meta.get('machine', '?')}; shared with other engineers' test runs (load average {_load(meta.get('load_before'))} before, {_load(meta.get('load_after'))} after)
- workload: {cfg['producers']} producer processes (at most {cfg['records_per_s']:.0f} records/s each, rounds of 5–25 records, half of the rounds key-less and half to a partition picked per record), {cfg['consumers']} consumer processes in one group (session timeout {cfg['session_timeout_ms']} ms, ack timeout {cfg['ack_timeout_ms']} ms), a topic of {cfg['partitions']} partitions on 2 partition-log actors, offsets in PostgreSQL (a fresh schema) through a TCP proxy
- code: {meta.get('code', 'the working tree')}
- nemesis: {s['events']} events: {', '.join(f'{n} {k}' for k, n in sorted(by_kind.items()))}; actors killed: {kill_text}

## What the nemesis does

Every 0.5–3 s (seeded RNG) it does one of: SIGKILL an actor picked among
`coordinator`, `commit-writer`, `partition-0`, `partition-1`, or two of them
at once (the supervisor restarts them with its backoff, 0.1 s doubling to
5 s, so repeated kills keep an actor down longer); SIGKILL a consumer
process (a replacement starts 0–2 s later); or cut the commit writer's
PostgreSQL connection at the proxy for 0.5–8 s, either with resets (every
connection dropped, new ones refused) or as a blackhole (bytes swallowed,
the writer only notices through its timeouts). The machine's PostgreSQL
itself is never touched. After the nemesis phase, producers stop and the
consumers drain until every acknowledged record is finished and the committed
offset equals the log end of every partition, both in the
`consumer_group_offsets` table and in `describe_group`.

## How to read the table

- *records*: acknowledged = the producer got an offset back after `flush`;
  sends without an ack were in flight when something died (they may still be
  in the log, shown as "never acknowledged": at-least-once allows that, and
  they are consumed like the rest).
- *lost*: an acknowledged record that no consumer finished, or whose offset
  holds something else in the log read at the end.
- *regressions*: a durable committed offset (the table, or what
  `describe_group` reports durable) lower than an earlier sample of the same
  source, or a table read lower than what `describe_group` had already
  reported durable (`describe>pg`). Samples are taken every ~200 ms.
- *committed past unfinished*: a sample at time t with committed C although
  some offset below C (or inside a stored hole above C) had no consumer
  finish journaled at or before t. Consumers journal before they ack, and the
  in-memory committed offset is checked as well.
- *duplicates*: finishes of a record after its first. A record finished
  twice was handed out twice, so its earlier lease was lost between the two
  deliveries, and the duplicate is blamed on what happened in between: a
  coordinator kill if there was one (a restarted coordinator forgets every
  ack that was not durable yet), else a consumer kill or start. When the
  lease went in a rebalance (consumers journal every new generation they
  see), the blame goes to the coordinator kill or consumer kill/start that
  preceded the rebalance within 15 s (*via rebalance*); "(rebalance, no
  event)" had none; "(no event)" means nothing happened in between but a
  lease that expired. Killing a partition actor or the commit writer, or
  cutting the database, cannot make a consumer redo finished work (the acks
  stay in the coordinator's memory), so those rows show 0 by construction
  and are there for what was in flight when they happened.
- *in flight* sums, over the events of a kind, the records delivered but
  not yet durably committed at that moment (per the last table sample before
  the event, group-wide); *finished, not durable* is the part of those
  already finished: what a lost ack or a revoked lease can make a consumer
  do twice. A coordinator kill's duplicates should come close to its
  *finished, not durable*, never far above it.
- *deliveries of an offset already durably finished*: a record leased
  again although the table had already shown it below the committed offset
  or in a stored hole. Allowed, but no crash explains it; expected 0. A
  lease is dated by the consumer's poll() call that sent its Poll (a Poll
  sent ahead, or kept in flight past an empty poll(), was sent by an earlier
  call than the one that hands its records out, and records held back by
  max_records come out later still): dated by the handing-out call, as it
  was until 2026-12-05, a redelivery granted before the offset was finished
  counted here.

## The checker can fail

`tests/chaos/test_checker.py` feeds the same checker crafted histories, each
with one fault, and asserts that it is reported: a lost record (never
finished; acknowledged at an offset that holds another record, or beyond the
log end), a regressed offset (and a table below what `describe_group` had
called durable), a commit past an unfinished record (14 committed while 12
was never acked; a commit that runs ahead of the finish; the in-memory
offset), a stored hole over an unfinished record, and a commit beyond the log
end, next to clean histories that pass.

## Bugs this run found

- The consumer ignored NOT_OWNER on a fetch and never refreshed its cached
  metadata, so after partitions moved between partition-log actors it fetched
  from the old owner forever (a livelock: nothing lost, nothing delivered;
  the drain never finished). Fixed in the client; the regression test is
  `tests/chaos/test_found_bugs.py`.

## The report

```
{table}
```
"""


SECTIONS = ("single", "replicated", "cluster")  # their order on the page


def update_page(path: Path, name: str, text: str) -> None:
    """Write one run's section of docs/RELIABILITY.md, keeping the other run's.

    Sections sit between ``<!-- chaos:NAME -->`` and ``<!-- /chaos:NAME -->``; a page
    without markers is the single-host run's section as a whole."""
    old = path.read_text() if path.exists() else ""
    sections = {n: _section(old, n) for n in SECTIONS}
    if old and not any(sections.values()):
        sections["single"] = old.strip()
    sections[name] = text.strip()
    path.write_text("\n\n".join(f"<!-- chaos:{n} -->\n{sections[n]}\n<!-- /chaos:{n} -->"
                                 for n in SECTIONS if sections[n]) + "\n")


def _section(page: str, name: str) -> str:
    start, end = f"<!-- chaos:{name} -->", f"<!-- /chaos:{name} -->"
    if start not in page or end not in page:
        return ""
    return page.split(start, 1)[1].split(end, 1)[0].strip()


def _load(value) -> str:
    return "?" if not value else " / ".join(f"{x:.2f}" for x in value)


def test_the_reliability_page_renders_a_report():
    from tests.chaos.test_checker import clean_history

    history = clean_history()
    history.meta = {"seed": 42, "duration_s": 180.0, "wall_s": 200.0, "drain_s": 3.0, "code": "commit abc",
                    "command": "make chaos", "machine": "a laptop", "config": dataclasses.asdict(ChaosConfig())}
    page = render_markdown(check(history))
    assert "## Result: PASS" in page and "`ZBROKER_CHAOS_SEED=42`" in page
    assert "| lost (acknowledged to a producer, never delivered) | 0 | 0 |" in page
    assert "chaos check: PASS" in page  # the table itself


def test_each_run_rewrites_only_its_own_section_of_the_page(tmp_path):
    page = tmp_path / "RELIABILITY.md"
    page.write_text("# Reliability: the chaos run\n\nan older single-host report\n")
    update_page(page, "replicated", "## The replicated run\n\nfirst")
    assert "an older single-host report" in page.read_text() and "first" in page.read_text()
    update_page(page, "single", "# Reliability: the chaos run\n\na newer one")
    update_page(page, "replicated", "## The replicated run\n\nsecond")
    text = page.read_text()
    assert "a newer one" in text and "second" in text
    assert "older" not in text and "first" not in text
    assert text.index("a newer one") < text.index("second")
