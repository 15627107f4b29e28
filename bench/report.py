"""From a run's results to the files people read: JSON, PNG chart, markdown, RESULTS.md.

Everything here is a function of the results dict the harness returns, so
the report can be re-rendered (or tested) from a stored JSON file without
running anything. `summarize` makes the short form kept in
`bench/results/latest.json`; the markdown and the chart are drawn from that
summary only.

A missing number is never blank: its cell says "skipped" or "failed" and a
footnote gives the reason the harness recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import time
from pathlib import Path
from typing import Any

SYSTEMS = ("zbroker", "rabbitmq", "nats", "redis", "pgqueuer", "procrastinate", "pgmq")
PEERS = SYSTEMS[1:]
# zbroker's latency workload also runs with a publisher that does not linger;
# that run is a variant row beside the systems, kept out of the per-system maps
# (`latency_p99_ms`, `latency_ms`, `latency_cdf`) that scripts read.
LATENCY_VARIANTS = {"zbroker_linger_0": ("zbroker", "latency_linger_0")}
LATENCY_HIGH = "latency_50k"  # bench.harness.LATENCY_HIGH: the latency workload at the high rate
THROUGHPUT_ROWS = ("produce", "produce_1k", "produce_fsync_always", "produce_unbatched", "consume_ack")
ROW_TITLES = {
    "produce": "produce 100 B, fsync interval",
    "produce_1k": "produce 1 KiB",
    "produce_fsync_always": "produce 100 B, fsync always",
    "produce_unbatched": "produce 100 B, one record per request",
    "consume_ack": "consume + ack per record",
}
# Which ceiling shape bounds each row (see bench/zmq_ceiling.py).
CEILING_FOR_ROW = {
    "produce": "batched_100",
    "produce_1k": "batched_1024",
    "produce_fsync_always": "batched_100",
    "produce_unbatched": "unbatched_100",
    "consume_ack": "batched_100",
}
COLORS = {"zbroker": "tab:blue", "rabbitmq": "tab:orange", "nats": "tab:green", "redis": "tab:red",
          "pgqueuer": "tab:purple", "procrastinate": "tab:brown", "pgmq": "tab:pink", "zmq_ceiling": "tab:gray"}
TEMPLATE = Path(__file__).resolve().parent / "RESULTS.md.tmpl"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _status_text(entry: dict[str, Any] | None) -> str:
    """"ok", or "skipped: why" / "failed: why" / "timed_out: why" / "not run"."""
    if entry is None:
        return "not run"
    status = entry.get("status", "ok")
    if status == "ok":
        return "ok"
    return f"{status}: {entry.get('reason', 'no reason recorded')}"


def _phase(results: dict[str, Any], system: str, workload: str) -> tuple[dict[str, Any] | None, str]:
    """The phase entry and its status text; a skipped/failed system explains every row."""
    sys_entry = results.get("systems", {}).get(system)
    if sys_entry is None:
        return None, "not run"
    phase = sys_entry.get("phases", {}).get(workload)
    if phase is None and sys_entry.get("status") != "ok":
        return None, _status_text(sys_entry)
    return phase, _status_text(phase)


def _usable(phase: dict[str, Any] | None) -> bool:
    # A timed-out phase still measured a real rate over what it did; it is kept and flagged.
    return phase is not None and phase.get("status") in ("ok", "timed_out")


def _latency_entry(phase: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list | None]:
    """A latency phase's row (percentiles, counts, the publisher's lag and linger) and CDF."""
    if not (_usable(phase) and phase.get("latency_ms")):
        return None, None
    publisher = phase.get("publisher") or {}
    row = {**phase["latency_ms"], "received": phase.get("received"), "sent": publisher.get("sent"),
           "publisher_max_lag_ms": publisher.get("max_lag_ms")}
    if "linger_ms" in publisher:
        row["publisher_linger_ms"] = publisher["linger_ms"]
    return row, phase.get("cdf")


def _latency_status(phase: dict[str, Any] | None, text: str) -> str:
    """A latency phase is ok only when the consumer got every record the publisher sent.

    The phase itself counts records received against the schedule; a publisher
    that failed, or records that never arrived, would otherwise leave
    percentiles that look as good as a complete run's.
    """
    if text != "ok" or phase is None:
        return text
    publisher = phase.get("publisher") or {}
    if publisher.get("error"):
        return f"failed: the publisher failed: {publisher['error']}"
    sent, received = publisher.get("sent"), phase.get("received") or 0
    if sent is not None and received < sent:
        return f"timed_out: {received:,} of the {sent:,} records sent arrived"
    return "ok"


def latency_title(series: str, row: dict[str, Any] | None) -> str:
    """`zbroker`, or `zbroker (publisher linger_ms=1)` when the run says how its publisher lingered."""
    if series == "zmq_ceiling":
        return "raw pyzmq: publisher -> bare relay -> receiver"
    system = LATENCY_VARIANTS.get(series, (series,))[0]
    linger = (row or {}).get("publisher_linger_ms")
    return system if linger is None else f"{system} (publisher linger_ms={linger:g})"


def summarize(results: dict[str, Any], machine: dict[str, Any] | None = None,
              command: str | None = None) -> dict[str, Any]:
    """The short form: `latest.json`'s shape (issue #5)."""
    workloads: dict[str, Any] = {}
    status: dict[str, dict[str, str]] = {s: {} for s in SYSTEMS}
    cpu: dict[str, dict[str, float | None]] = {}
    ceiling = results.get("ceiling", {})
    for row in THROUGHPUT_ROWS:
        rates: dict[str, float | None] = {}
        cpu[row] = {}
        for system in SYSTEMS:
            phase, text = _phase(results, system, row)
            status[system][row] = text
            rates[system] = phase.get("msgs_s") if _usable(phase) else None
            cpu[row][system] = phase.get("server_cpu_us_per_record") if _usable(phase) else None
        ceiling_phase = ceiling.get(CEILING_FOR_ROW[row])
        status.setdefault("zmq_ceiling", {})[row] = _status_text(ceiling_phase) if ceiling_phase else "not run"
        rates["zmq_ceiling"] = ceiling_phase.get("msgs_s") if _usable(ceiling_phase) else None
        cpu[row]["zmq_ceiling"] = (ceiling_phase.get("server_cpu_us_per_record")
                                   if _usable(ceiling_phase) else None)
        workloads[row] = rates

    latency_ms: dict[str, Any] = {}
    latency_cdf: dict[str, Any] = {}
    for system in SYSTEMS:
        phase, text = _phase(results, system, "latency")
        status[system]["latency"] = _latency_status(phase, text)
        latency_ms[system], cdf = _latency_entry(phase)
        if cdf is not None:
            latency_cdf[system] = cdf
    variants_ms: dict[str, Any] = {}
    variants_cdf: dict[str, Any] = {}
    for variant, (system, workload) in LATENCY_VARIANTS.items():
        phase, text = _phase(results, system, workload)
        if phase is None:
            continue  # a variant row only appears when it ran
        status[system][workload] = _latency_status(phase, text)
        variants_ms[variant], cdf = _latency_entry(phase)
        if cdf is not None:
            variants_cdf[variant] = cdf
    ceiling_latency = ceiling.get("latency")
    if ceiling_latency is not None:
        # The same schedule through a bare relay: the transport's floor, beside the systems.
        status.setdefault("zmq_ceiling", {})["latency"] = _latency_status(ceiling_latency,
                                                                          _status_text(ceiling_latency))
        latency_ms["zmq_ceiling"], cdf = _latency_entry(ceiling_latency)
        if cdf is not None:
            latency_cdf["zmq_ceiling"] = cdf
    workloads["latency_p99_ms"] = {s: (v or {}).get("p99") for s, v in latency_ms.items()}
    workloads["latency_ms"] = latency_ms
    # The same schedule at the high rate, for every system and the bare relay.
    high_ms: dict[str, Any] = {}
    for system in (*SYSTEMS, "zmq_ceiling"):
        if system == "zmq_ceiling":
            phase = ceiling.get(LATENCY_HIGH)
            text = _status_text(phase) if phase else "not run"
        else:
            phase, text = _phase(results, system, LATENCY_HIGH)
        status.setdefault(system, {})[LATENCY_HIGH] = _latency_status(phase, text)
        high_ms[system], _cdf = _latency_entry(phase)
        if phase and phase.get("rate"):
            workloads["latency_high_rate"] = phase["rate"]
    workloads["latency_50k_ms"] = high_ms
    workloads["latency_variants_ms"] = variants_ms
    workloads["server_cpu_us_per_record"] = cpu

    def complete_ratio(row: str, other: str) -> float | None:
        """zbroker over `other` on `row`, only when both phases finished: a timed-out
        phase's rate stays in its own (flagged) cell but is compared with nothing."""
        if status["zbroker"].get(row) != "ok" or status[other].get(row) != "ok":
            return None
        return ratio(workloads[row]["zbroker"], workloads[row][other])

    zb_ratio: dict[str, dict[str, float | None]] = {}
    for row in THROUGHPUT_ROWS:
        zb_ratio[row] = {peer: complete_ratio(row, peer) for peer in PEERS}
    # Only complete latency runs are compared: a p99 over the records that did arrive
    # says nothing about the ones that did not.
    complete_p99 = {s: p99 for s, p99 in workloads["latency_p99_ms"].items() if status[s].get("latency") == "ok"}
    zb_ratio["latency_p99"] = {peer: ratio(complete_p99.get("zbroker"), complete_p99.get(peer)) for peer in PEERS}
    high_p99 = {s: v["p99"] for s, v in high_ms.items() if v and status[s].get(LATENCY_HIGH) == "ok"}
    zb_ratio["latency_50k_p99"] = {peer: ratio(high_p99.get("zbroker"), high_p99.get(peer)) for peer in PEERS}
    workloads["zbroker_over_peer"] = zb_ratio
    workloads["zbroker_fraction_of_ceiling"] = {row: complete_ratio(row, "zmq_ceiling") for row in THROUGHPUT_ROWS}
    # Latency the other way round: how many times the bare relay's p99 zbroker's is.
    workloads["zbroker_latency_p99_over_ceiling"] = ratio(complete_p99.get("zbroker"),
                                                          complete_p99.get("zmq_ceiling"))

    zb = results.get("systems", {}).get("zbroker")
    bulk = (zb or {}).get("phases", {}).get("produce_send_many")
    workloads["produce_send_many"] = ({"status": _status_text(bulk), "msgs_s": bulk.get("msgs_s"),
                                      "server_cpu_us_per_record": bulk.get("server_cpu_us_per_record")}
                                     if bulk else {"status": "not run"})
    for name in ("capacity", "scale_out", "partitions", "redelivery", "key_shared"):
        if zb is None:
            workloads[name] = {"status": "not run"}
        elif zb.get("status") != "ok":
            workloads[name] = {"status": zb.get("status"), "reason": zb.get("reason")}
        else:
            workloads[name] = zb.get("phases", {}).get(name) or {"status": "not run"}
    if workloads["scale_out"].get("status") == "ok":
        workloads["scale_out_actor_cpu_s_per_million_records"] = {
            role: scale_out_actor_cpu(workloads["scale_out"], role) for role in ("produce", "consume_ack")}
    commits = results.get("commits")
    workloads["commits"] = commits if commits is not None else {"status": "not run"}
    memory = results.get("memory")
    workloads["memory"] = memory if memory is not None else {"status": "not run"}
    failover = results.get("coordinator_failover")
    workloads["coordinator_failover"] = failover if failover is not None else {"status": "not run"}
    overhead = results.get("console_overhead")
    workloads["console_overhead"] = overhead if overhead is not None else {"status": "not run"}
    replication = results.get("replication")
    workloads["replication"] = replication if replication is not None else {"status": "not run"}

    return {
        "workloads": workloads,
        "status": status,
        "latency_cdf": latency_cdf,
        "latency_variants_cdf": variants_cdf,
        "durability": {s: e.get("durability", {}) for s, e in results.get("systems", {}).items()},
        "versions": {s: e.get("version") for s, e in results.get("systems", {}).items()},
        "ceiling_note": "zmq_ceiling: raw pyzmq PUSH/PULL between two processes, same payloads; "
                        "its CPU figure is the receiving process's",
        "scale": results.get("scale"),
        "counts": results.get("counts"),
        "started_at": _iso(results.get("started_at")),
        "machine": machine if machine is not None else results.get("machine", {}),
        "command": command if command is not None else results.get("command", ""),
    }


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


# -- markdown -----------------------------------------------------------------


class _Footnotes:
    def __init__(self) -> None:
        self.reasons: list[str] = []

    def mark(self, text: str) -> str:
        """"skipped: why" -> "skipped [1]"; the reason goes to the footnotes once."""
        kind, _, reason = text.partition(": ")
        if reason not in self.reasons:
            self.reasons.append(reason)
        return f"{kind.replace('_', ' ')} [{self.reasons.index(reason) + 1}]"

    def render(self) -> str:
        return "\n".join(f"[{i}] {reason}  " for i, reason in enumerate(self.reasons, 1))


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def _cell(value: float | None, status_text: str, notes: _Footnotes, digits: int = 0) -> str:
    if status_text == "ok":
        return _num(value, digits)
    if status_text == "not run":
        return status_text
    marked = notes.mark(status_text)
    # A timed-out phase keeps the rate it measured over what it did, flagged.
    return f"{_num(value, digits)} ({marked})" if value is not None else marked


def _status_cell(entry: dict[str, Any], notes: _Footnotes) -> str:
    status = entry.get("status", "not run")
    if status in ("ok", "not run") or not entry.get("reason"):
        return status
    return notes.mark(f"{status}: {entry['reason']}")


def render_markdown(summary: dict[str, Any], chart: str | None = None) -> str:
    w = summary["workloads"]
    status = summary["status"]
    notes = _Footnotes()
    out: list[str] = []

    out.append("### Throughput (records/s; higher is better)\n")
    out.append(f"| workload | {' | '.join(SYSTEMS)} | zmq ceiling | zbroker / ceiling |")
    out.append("|---|" + "---:|" * (len(SYSTEMS) + 2))
    for row in THROUGHPUT_ROWS:
        cells = [_cell(w[row].get(s), status[s].get(row, "not run"), notes) for s in SYSTEMS]
        ceiling = _cell(w[row].get("zmq_ceiling"), status.get("zmq_ceiling", {}).get(row, "not run"), notes)
        fraction = w["zbroker_fraction_of_ceiling"].get(row)
        out.append(f"| {ROW_TITLES[row]} | {' | '.join(cells)} | {ceiling} | "
                   f"{'–' if fraction is None else f'{fraction:.1%}'} |")

    out.append("\n### zbroker / peer, same run (throughput: >1 means zbroker is faster; "
               "latency p99: <1 means zbroker is faster)\n")
    out.append(f"| workload | {' | '.join('vs ' + p for p in PEERS)} |")
    out.append("|---|" + "---:|" * len(PEERS))
    for row, values in w["zbroker_over_peer"].items():
        title = ROW_TITLES.get(row, {"latency_p99": "latency p99",
                                     "latency_50k_p99": "latency p99 at the high rate"}.get(row, row))
        out.append(f"| {title} | " + " | ".join(
            "–" if values.get(p) is None else f"{values[p]:.2f}×" for p in PEERS) + " |")

    out.append("\n### Publish-to-receive latency (ms), paced publisher in another process\n")
    out.append("| system | p50 | p99 | p99.9 | max | received / sent | publisher max lag |")
    out.append("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for system in SYSTEMS:
        rows.append((system, w["latency_ms"].get(system), status[system].get("latency", "not run")))
        rows += [(variant, w.get("latency_variants_ms", {}).get(variant),
                  status[system].get(LATENCY_VARIANTS[variant][1], "not run"))
                 for variant in w.get("latency_variants_ms", {}) if LATENCY_VARIANTS.get(variant, ("",))[0] == system]
    if "zmq_ceiling" in w["latency_ms"]:
        rows.append(("zmq_ceiling", w["latency_ms"]["zmq_ceiling"],
                     status.get("zmq_ceiling", {}).get("latency", "not run")))
    for series, lat, text in rows:
        title = latency_title(series, lat)
        if lat is not None and text != "ok":
            title += f" ({notes.mark(text)})"
        if lat is None:
            out.append(f"| {title} | {_cell(None, text, notes)} | | | | | |")
            continue
        out.append(f"| {title} | {_num(lat['p50'], 2)} | {_num(lat['p99'], 2)} | {_num(lat['p99_9'], 2)} | "
                   f"{_num(lat['max'], 2)} | {_num(lat.get('received'))} / {_num(lat.get('sent'))} | "
                   f"{_num(lat.get('publisher_max_lag_ms'), 1)} ms |")
    over_ceiling = w.get("zbroker_latency_p99_over_ceiling")
    if "zmq_ceiling" in w["latency_ms"]:
        out.append("\nThe raw-pyzmq row runs the same schedule and payloads through three processes, as "
                   "zbroker's path has (publisher, partition actor, consumer), with a relay that forwards "
                   "each frame and does nothing else: no broker can be a Python process between two "
                   "others here and do better. "
                   + ("zbroker's p99 is " + f"{over_ceiling:.2f}× the relay's." if over_ceiling is not None
                      else "No ratio: a row is missing or incomplete."))

    high = w.get("latency_50k_ms") or {}
    rate = w.get("latency_high_rate")  # present only when some system ran the high rate
    if rate:
        out.append(f"\n### Publish-to-receive latency (ms) at {rate:,} records/s\n")
        out.append("| system | p50 | p99 | p99.9 | max | received / sent | publisher max lag |")
        out.append("|---|---:|---:|---:|---:|---:|---:|")
        for series, lat in high.items():
            text = status.get(series, {}).get(LATENCY_HIGH, "not run")
            if series == "zmq_ceiling" and lat is None and text == "not run":
                continue
            title = latency_title(series, lat)
            if lat is None:
                out.append(f"| {title} | {_cell(None, text, notes)} | | | | | |")
                continue
            if text != "ok":
                title += f" ({notes.mark(text)})"
            out.append(f"| {title} | {_num(lat['p50'], 2)} | {_num(lat['p99'], 2)} | {_num(lat['p99_9'], 2)} | "
                       f"{_num(lat['max'], 2)} | {_num(lat.get('received'))} / {_num(lat.get('sent'))} | "
                       f"{_num(lat.get('publisher_max_lag_ms'), 1)} ms |")

    out.append("\n### Server CPU per record (µs of utime+stime; all server processes)\n")
    out.append(f"| workload | {' | '.join(SYSTEMS)} | zmq ceiling (receiver) |")
    out.append("|---|" + "---:|" * (len(SYSTEMS) + 1))
    for row in THROUGHPUT_ROWS:
        values = w["server_cpu_us_per_record"][row]
        cells = [_cell(values.get(s), status[s].get(row, "not run"), notes, 1) for s in SYSTEMS]
        ceiling = _cell(values.get("zmq_ceiling"), status.get("zmq_ceiling", {}).get(row, "not run"), notes, 1)
        out.append(f"| {ROW_TITLES[row]} | {' | '.join(cells)} | {ceiling} |")

    out.append("\n### zbroker only\n")
    out.append(_render_bulk_produce(w.get("produce_send_many", {}), w["produce"].get("zbroker"), notes))
    out.append(_render_capacity(w.get("capacity", {}), w, notes))
    out.append(_render_scale_out(w.get("scale_out", {}), notes))
    out.append(_render_partition_counts(w.get("partitions", {}), notes))
    out.append(_render_redelivery(w.get("redelivery", {}), notes))
    out.append(_render_key_shared(w.get("key_shared", {}), notes))
    out.append(_render_commits(w.get("commits", {}), notes))
    out.append(_render_replication(w.get("replication", {}), notes))
    out.append(_render_memory(w.get("memory", {}), notes))
    out.append(_render_coordinator_failover(w.get("coordinator_failover", {}), notes))
    out.append(_render_console_overhead(w.get("console_overhead", {}), notes))

    out.append("\n### Durability settings\n")
    out.append("| system | version | workload | settings |")
    out.append("|---|---|---|---|")
    for system, settings in summary.get("durability", {}).items():
        version = summary.get("versions", {}).get(system) or "–"
        if not settings:
            out.append(f"| {system} | {version} | – | {_cell(None, _system_status(summary, system), notes)} |")
        for workload, text in settings.items():
            out.append(f"| {system} | {version} | {workload} | {text} |")
    out.append(f"\n{summary.get('ceiling_note', '')}")

    if chart:
        out.append(f"\n![throughput and latency]({chart})")
    if notes.reasons:
        out.append("\n" + notes.render())
    return "\n".join(out) + "\n"


def _system_status(summary: dict[str, Any], system: str) -> str:
    texts = [t for t in summary["status"].get(system, {}).values() if t != "ok"]
    return texts[0] if texts else "ok"


def scale_out_actor_cpu(entry: dict[str, Any], role: str) -> dict[str, float | None]:
    """The largest partition actor's CPU seconds per million records, per actor count."""
    out: dict[str, float | None] = {}
    for actors, row in (entry.get("actors") or {}).items():
        if "busiest_actor_cpu_s_per_million_records" in (row.get(role) or {}):  # repeated runs: their median
            out[actors] = row[role]["busiest_actor_cpu_s_per_million_records"]
            continue
        figures = [a.get("cpu_s_per_million_records") for a in ((row.get(role) or {}).get("per_actor") or {}).values()]
        figures = [f for f in figures if f is not None]
        out[actors] = max(figures) if figures else None
    return out


def _span(row: dict[str, Any], name: str, digits: int) -> str:
    """ " [low–high]" of a repeated figure; nothing for a single run."""
    low_high = row.get(f"{name}_range")
    if not low_high:
        return ""
    return f" [{_num(low_high[0], digits)}–{_num(low_high[1], digits)}]"


def _render_scale_out(entry: dict[str, Any], notes: _Footnotes) -> str:
    if entry.get("status") != "ok" or "actors" not in entry:
        return f"Scale-out (4 partitions over 1, 2, 4 partition-log actors): {_status_cell(entry, notes)}\n"
    cpu = {role: scale_out_actor_cpu(entry, role) for role in ("produce", "consume_ack")}
    base = {role: cpu[role].get("1") for role in cpu}

    def vs_one(role: str, actors: str) -> str:
        value, one = cpu[role].get(actors), base[role]
        return "–" if value is None or not one else f"{value / one - 1:+.0%}"

    rounds = entry.get("rounds")
    how = (f" Each row ran {rounds} times, interleaved with the others, each time on a new broker: "
           "the median, and [the lowest, the highest]." if rounds else "")
    lines = [f"Scale-out: 4 partitions, {entry.get('client_processes')} producer then consumer processes "
             "(the producers use the bulk call `send_many`, to load the actors more than one Python client "
             "calling `send()` per record can). Partition-actor CPU is the busiest actor's CPU seconds per million records it stored or "
             f"served (the goal: within 15 % of one actor's, so throughput grows with cores).{how}\n",
             "| partition actors | produce rec/s | consume + ack rec/s | server CPU µs/rec (produce) | "
             "actor CPU s / M records, produce (vs 1) | actor CPU s / M records, consume (vs 1) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for actors, row in entry["actors"].items():
        produce, consume = row.get("produce", {}), row.get("consume_ack", {})
        lines.append(f"| {actors} | {_num(produce.get('msgs_s'))}{_span(produce, 'msgs_s', 0)} | "
                     f"{_num(consume.get('msgs_s'))}{_span(consume, 'msgs_s', 0)} | "
                     f"{_num(produce.get('server_cpu_us_per_record'), 1)} | "
                     f"{_num(cpu['produce'].get(actors), 2)} ({vs_one('produce', actors)})"
                     f"{_span(produce, 'busiest_actor_cpu_s_per_million_records', 2)} | "
                     f"{_num(cpu['consume_ack'].get(actors), 2)} ({vs_one('consume_ack', actors)})"
                     f"{_span(consume, 'busiest_actor_cpu_s_per_million_records', 2)} |")
    left_out = [f"{actors} actors, {role}: {bad.get('status')} ({bad.get('reason')})"
                for actors, row in entry["actors"].items() for role in ("produce", "consume_ack")
                for bad in (row.get(role) or {}).get("runs_not_ok", [])]
    if left_out:
        lines.append("\nRuns not ok (a timed-out run's rate is kept, a failed run's is not): "
                     + "; ".join(left_out) + ".")
    return "\n".join(lines) + "\n"


def _render_bulk_produce(entry: dict[str, Any], per_record: float | None, notes: _Footnotes) -> str:
    if entry.get("msgs_s") is None:
        return f"\nBulk produce (Producer.send_many): {_status_cell(entry, notes)}\n"
    flag = "" if entry.get("status") == "ok" else f" ({_status_cell(entry, notes)})"
    versus = "" if not per_record else f", {entry['msgs_s'] / per_record:.1f}× the produce row's send() per record"
    return (f"\nBulk produce: the produce workload through `Producer.send_many` (1,000 values per call, "
            f"same batching and window): {_num(entry['msgs_s'])} records/s{versus}, server CPU "
            f"{_num(entry.get('server_cpu_us_per_record'), 1)} µs/record{flag}. The rows compared with the peers "
            f"call `send()` once per record, as their clients are called once per record.\n")


def _render_capacity(entry: dict[str, Any], w: dict[str, Any], notes: _Footnotes) -> str:
    title = "Broker capacity, driven by a load generator in C (the Python client out of the way)"
    if entry.get("status") != "ok":
        return f"\n{title}: {_status_cell(entry, notes)}\n"
    lines = [f"\n{title}: {entry.get('how')}, {_num(entry.get('records'))} records. The load generator's CPU "
             "per record is its own (getrusage), the server's is every broker process's.\n",
             "| workload | records/s | server CPU µs/rec | load generator CPU µs/rec | "
             "Python client rec/s (same run) | capacity / Python client |",
             "|---|---:|---:|---:|---:|---:|"]
    for role, title_row, python_row in (("produce", "produce 100 B", "produce"),
                                        ("consume_ack", "consume + ack", "consume_ack")):
        phase = entry.get(role) or {}
        text = _status_text(phase)
        rate = phase.get("msgs_s") if _usable(phase) else None
        python = (w.get(python_row) or {}).get("zbroker")
        versus = ratio(rate, python) if text == "ok" else None
        lines.append(f"| {title_row} | {_cell(rate, text, notes)} | "
                     f"{_num(phase.get('server_cpu_us_per_record'), 2)} | "
                     f"{_num(phase.get('loadgen_cpu_us_per_record'), 2)} | {_num(python)} | "
                     f"{'–' if versus is None else f'{versus:.2f}×'} |")
    return "\n".join(lines) + "\n"


def _render_partition_counts(entry: dict[str, Any], notes: _Footnotes) -> str:
    title = "Partition count (one topic on one partition actor, records round-robin, Python client, window 1,000)"
    if entry.get("status") != "ok" or "rows" not in entry:
        return f"\n{title}: {_status_cell(entry, notes)}\n"
    rows = entry["rows"]
    smallest = rows.get(min(rows, key=int)) if rows else None
    lines = [f"\n{title}, {_num(entry.get('records'))} records per row. The last columns are each row over "
             f"the {min(rows, key=int)}-partition row of the same run (goal at 1,024: at least half).\n",
             "| partitions | produce rec/s | consume + ack rec/s | produce vs fewest | consume + ack vs fewest |",
             "|---:|---:|---:|---:|---:|"]
    for partitions in sorted(rows, key=int):
        row = rows[partitions]
        cells = []
        for role in ("produce", "consume_ack"):
            phase = row.get(role) or {}
            cells.append(_cell(phase.get("msgs_s") if _usable(phase) else None, _status_text(phase), notes))
        fractions = []
        for role in ("produce", "consume_ack"):
            base = (smallest or {}).get(role) or {}
            here = row.get(role) or {}
            both = _status_text(base) == "ok" and _status_text(here) == "ok"
            value = ratio(here.get("msgs_s"), base.get("msgs_s")) if both else None
            fractions.append("–" if value is None else f"{value:.0%}")
        lines.append(f"| {int(partitions):,} | {cells[0]} | {cells[1]} | {fractions[0]} | {fractions[1]} |")
    return "\n".join(lines) + "\n"


def _render_redelivery(entry: dict[str, Any], notes: _Footnotes) -> str:
    if "seconds_until_all_redelivered" not in entry:
        return f"\nRedelivery after a consumer dies holding leases: {_status_cell(entry, notes)}\n"
    flag = "" if entry.get("status") == "ok" else f" ({_status_cell(entry, notes)})"
    return (f"\nRedelivery: a consumer killed (SIGKILL) holding {_num(entry.get('held_by_victim'))} leases; "
            f"another member had all of them after {_num(entry.get('seconds_until_all_redelivered'), 2)} s "
            f"(all redelivered: {entry.get('all_redelivered')}), duplicates seen: "
            f"{_num(entry.get('duplicates_seen'))}, delivered to it while the first was alive: "
            f"{_num(entry.get('delivered_while_victim_alive'))}; consumer session timeout "
            f"{_num(entry.get('session_timeout_ms'))} ms{flag}\n")


def _render_key_shared(entry: dict[str, Any], notes: _Footnotes) -> str:
    if "modes" not in entry:
        return f"\nkey_shared against shared (8 consumers, 1,000 keys): {_status_cell(entry, notes)}\n"
    lines = [f"\nkey_shared against shared: {_num(entry.get('records'))} records, {entry.get('keys')} keys, "
             f"{entry.get('partitions')} partitions, {entry.get('consumers')} consumer processes, median of "
             f"{entry.get('rounds')} rounds each (bench.key_shared):\n",
             "| records per poll | mode | records/s | handler-to-ack p50 / p99 ms | server CPU µs/record | "
             "key_shared / shared (goal >= 70 %) |", "|---:|---|---:|---:|---:|---|"]
    by_poll = entry.get("by_poll") or {str(entry.get("poll_records")): entry}
    for poll, block in by_poll.items():
        ratio = block.get("key_shared_over_shared")
        verdict = "n/a" if ratio is None else f"{ratio:.0%} ({'met' if block.get('goal_met') else 'not met'})"
        for mode, row in block["modes"].items():
            lines.append(f"| {poll} | {mode} | {_num(row.get('msgs_s'))} | {row.get('handler_to_ack_ms_p50')} / "
                         f"{row.get('handler_to_ack_ms_p99')} | {_num(row.get('server_cpu_us_per_record'), 1)} | "
                         f"{verdict if mode == 'key_shared' else ''} |")
    return "\n".join(lines) + "\n"


def _render_commits(entry: dict[str, Any], notes: _Footnotes) -> str:
    if entry.get("status") != "ok":
        return f"\nCommit absorption (bench.commit_absorption): {_status_cell(entry, notes)}\n"
    r = entry.get("result")
    if not isinstance(r, dict) or "advances_per_s" not in r:
        return f"\nCommit absorption ({entry.get('how')}): `{json.dumps(r, sort_keys=True)[:500]}`\n"
    return "\n".join([
        f"\nCommit absorption ({entry.get('how')}), PostgreSQL offsets:\n",
        "| advances absorbed /s | statements /s (writer) | statements /s (PostgreSQL) | advances per row | "
        "flush p50 / p99 ms | goal (>= 100,000/s at <= 100 statements/s) |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {r['advances_per_s']:,} | {r['statements_per_s']} | {r.get('pg_statements_per_s', 'n/a')} | "
        f"{r.get('advances_per_row', 'n/a')} | {r.get('flush_latency_ms_p50')} / {r.get('flush_latency_ms_p99')} | "
        f"{'met' if r.get('goal_met') else 'not met'} |",
        f"\nStatements counted by: {r.get('statement_source', 'the writer')}.\n"])


def _render_console_overhead(entry: dict[str, Any], notes: _Footnotes) -> str:
    if entry.get("status") != "ok" or not isinstance(entry.get("result"), dict):
        return f"\nConsole overhead (bench.console_overhead): {_status_cell(entry, notes)}\n"
    r = entry["result"]
    lines = [f"\nConsole overhead ({entry.get('how')}): records/s, median of {r['rounds']} alternating rounds "
             f"of about {r['records_per_round']:,} records each (produce lasting at least "
             f"{r.get('min_produce_s', 0):g} s); the console scraped once a second "
             f"({r['scrapes']} scrapes, {r['scrape_failures']} failed).\n",
             "| workload | --http off | console on, scraped | ratio |", "|---|---:|---:|---:|"]
    for figure, label in (("produce_rps", "produce"), ("consume_ack_rps", "consume+ack")):
        f = r[figure]
        lines.append(f"| {label} | {f['http_off']:,} | {f['console_scraped']:,} | {f['ratio']:.3f} |")
    lines.append(f"\nGoal (within 5 %): {'met' if r.get('goal_met') else 'not met'}.\n")
    return "\n".join(lines)


def _render_replication(entry: dict[str, Any], notes: _Footnotes) -> str:
    if entry.get("status") != "ok" or not isinstance(entry.get("result"), dict):
        return f"\nReplication (bench.replication): {_status_cell(entry, notes)}\n"
    r = entry["result"]

    def rate(row: str, role: str) -> str:
        value = r["rows"][row][role].get("msgs_s")
        return f"{value:,.0f}" if value else "n/a"
    def ratio(role: str) -> str:
        spread = (r.get("r3_over_r1_range") or {}).get(role)
        return f"{r['r3_over_r1'].get(role)}" + (f" ({spread[0]}-{spread[1]})" if spread else "")
    lat1, lat3 = (r["latency"][row].get("latency_ms", {}) for row in ("R=1", "R=3 M=2"))
    fo = r["failover"]
    rounds = r.get("rounds", 1)
    return "\n".join([
        f"\nReplication ({entry.get('how')}): {r['records']:,} records of {r['record_bytes']} B, {r['layout']}. "
        f"Throughput: {rounds} rounds, each R = 1 then R = 3 on fresh topics; a row is the round of median "
        f"rec/s, the ratio the median of the rounds' ratios (their range in brackets).\n",
        "| | R = 1 | R = 3, M = 2 | R = 3 / R = 1 (goal: produce >= 0.5) |", "|---|---:|---:|---:|",
        f"| produce rec/s | {rate('R=1', 'produce')} | {rate('R=3 M=2', 'produce')} | {ratio('produce')} |",
        f"| consume + ack rec/s | {rate('R=1', 'consume_ack')} | {rate('R=3 M=2', 'consume_ack')} | "
        f"{ratio('consume_ack')} |",
        f"| publish to receive p50 / p99 ms ({r['latency']['R=1'].get('rate')} rec/s) | "
        f"{lat1.get('p50')} / {lat1.get('p99')} | {lat3.get('p50')} / {lat3.get('p99')} | |",
        f"\nLeader failover (SIGKILL to the first acknowledged produce), over "
        f"{fo['kills']} kills: p50 {fo['p50_s']} s, max {fo['max_s']} s (goal: max < 6 s).\n"])


def _render_memory(entry: dict[str, Any], notes: _Footnotes) -> str:
    if entry.get("status") != "ok" or not isinstance(entry.get("result"), dict):
        return f"\nMemory (bench.memory): {_status_cell(entry, notes)}\n"
    stored, flight = entry["result"]["stored"], entry["result"]["in_flight"]
    lines = [f"\nMemory ({entry.get('how')}): actor RSS in KiB.\n",
             f"| actor | {stored['records_first']:,} records stored | {stored['records_all']:,} stored | growth |",
             "|---|---:|---:|---:|"]
    for actor, before in stored["rss_kib_at_first"].items():
        after = stored["rss_kib_at_all"][actor]
        lines.append(f"| {actor} | {before:,} | {after:,} | {stored['growth'][actor]:+.1%} |")
    samples = ", ".join(f"{int(k):,} in flight: {v:,} KiB" for k, v in flight["coordinator_rss_kib"].items())
    lines.append(f"\nCoordinator with leased, unacknowledged records ({flight['lease_ranges']} lease ranges): "
                 f"{samples}; growth from 10 % to all: {flight['growth_from_10pct']:+.1%}. One ack frame "
                 f"finished all {flight['applied']:,} in {flight['one_ack_frame_s'] * 1000:.1f} ms "
                 f"(committed offset then {flight['committed_after_ack']:,}).\n")
    return "\n".join(lines)


def _render_coordinator_failover(entry: dict[str, Any], notes: _Footnotes) -> str:
    r = entry.get("result")
    if entry.get("status") != "ok" or not isinstance(r, dict) or not r.get("kills"):
        return f"\nCoordinator failover (bench.coordinator_failover): {_status_cell(entry, notes)}\n"
    return "\n".join([
        f"\nCoordinator failover ({entry.get('how')}): three nodes on 127.0.0.1-3, one PostgreSQL; the "
        "leading node SIGKILLed whole, then restarted; leader SIGKILL to the first poll answered by the new "
        f"leader (client request timeout {r.get('client_request_timeout_s')} s, lease {r.get('lease_ms')} ms).\n",
        f"| kills | p50 s | max s | goal (max < {r['goal_max_s']:g} s) |",
        "|---:|---:|---:|---|",
        f"| {r['kills']} | {r['p50_s']} | {r['max_s']} | {'met' if r.get('goal_met') else 'not met'} |\n"])


# -- chart --------------------------------------------------------------------


def render_chart(summary: dict[str, Any], path: str | os.PathLike) -> None:
    """Throughput bars per workload and system (log scale), and the latency CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = summary["workloads"]
    series = [*SYSTEMS, "zmq_ceiling"]
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(series)
    plotted = False
    for i, system in enumerate(series):
        xs, ys = [], []
        for j, row in enumerate(THROUGHPUT_ROWS):
            value = w[row].get(system)
            if value:
                xs.append(j + (i - (len(series) - 1) / 2) * width)
                ys.append(value)
        label = system.replace("_", " ") + ("" if ys else " (no data)")
        bars.bar(xs, ys, width, label=label, color=COLORS[system])
        plotted = plotted or bool(ys)
    bars.set_xticks(range(len(THROUGHPUT_ROWS)))
    bars.set_xticklabels([ROW_TITLES[r].replace(", ", "\n") for r in THROUGHPUT_ROWS], fontsize=8)
    if plotted:  # a run of only zbroker-only workloads has no throughput bars
        bars.set_yscale("log")
    bars.set_ylabel("records/s (log scale)")
    bars.set_title("Throughput (missing bar = skipped; see table)")
    bars.legend(fontsize=8)
    bars.grid(axis="y", which="both", alpha=0.3)

    plotted = False
    lines = [(s, p, "-") for s, p in summary.get("latency_cdf", {}).items()]
    lines += [(s, p, ":") for s, p in summary.get("latency_variants_cdf", {}).items()]
    latency_rows = {**summary["workloads"].get("latency_ms", {}),
                    **summary["workloads"].get("latency_variants_ms", {})}
    for series, points, style in lines:
        if points:
            cdf.plot([p[0] for p in points], [p[1] for p in points], drawstyle="steps-post",
                     label=latency_title(series, latency_rows.get(series)),
                     color=COLORS.get(LATENCY_VARIANTS.get(series, (series,))[0]), linestyle=style)
            plotted = True
    cdf.set_xscale("log")
    cdf.set_xlabel("publish-to-receive latency (ms, log scale)")
    cdf.set_ylabel("fraction of records")
    cdf.set_ylim(0, 1.01)
    cdf.set_title("Latency CDF")
    cdf.grid(alpha=0.3, which="both")
    if plotted:
        cdf.legend(fontsize=8)
    fig.suptitle(f"zbroker bench, scale {summary.get('scale')}, {summary.get('started_at')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- RESULTS.md ---------------------------------------------------------------


def render_machine(machine: dict[str, Any]) -> str:
    memory = machine.get("memory_bytes")
    libs = ", ".join(f"{k} {v}" for k, v in (machine.get("libraries") or {}).items() if v)
    load = machine.get("loadavg_at_start")
    return "\n".join([
        f"- nproc: {machine.get('nproc')} (cpu_count {machine.get('cpu_count')})",
        f"- memory: {memory / 2**30:.1f} GiB" if memory else "- memory: unknown",
        f"- CPU: {machine.get('cpu_model') or 'unknown'}",
        f"- kernel: {machine.get('kernel')}",
        f"- Python: {machine.get('python')}",
        f"- libraries: {libs}",
        f"- load average at start: {', '.join(f'{x:.2f}' for x in load)}" if load else "- load average: unknown",
        f"- benchmark client processes (every system's) scheduled {machine.get('client_sched') or 'unknown'}"
        + (" (`--client-sched batch`; the brokers' own processes keep the default, see bench/PROFILE.md)"
           if machine.get("client_sched") == "SCHED_BATCH" else ""),
    ])


def render_results_md(summary: dict[str, Any], chart_path: str, template: str | None = None) -> str:
    if template is None:
        template = TEMPLATE.read_text(encoding="utf-8")
    versions = ", ".join(f"{s} {v}" for s, v in summary.get("versions", {}).items() if v)
    return string.Template(template).substitute(
        date=summary.get("started_at") or "unknown",
        command=summary.get("command", ""),
        scale=summary.get("scale"),
        counts=json.dumps(summary.get("counts"), sort_keys=True),
        machine=render_machine(summary.get("machine", {})),
        servers=versions or "none reachable",
        tables=render_markdown(summary, chart=chart_path),
    )


# -- files --------------------------------------------------------------------


def write_run(results: dict[str, Any], out_dir: str | os.PathLike,
              results_md: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write <stamp>.json/.png/.md and latest.* in `out_dir`; RESULTS.md if asked."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(results.get("started_at", time.time())))
    summary = summarize(results)
    paths = {
        "json": out / f"{stamp}.json",
        "png": out / f"{stamp}.png",
        "md": out / f"{stamp}.md",
        "latest_json": out / "latest.json",
        "latest_png": out / "latest.png",
        "latest_md": out / "latest.md",
    }
    paths["json"].write_text(json.dumps({**results, "summary": summary}, indent=1, sort_keys=True) + "\n",
                             encoding="utf-8")
    render_chart(summary, paths["png"])
    header = f"Run {summary['started_at']}: `{summary['command']}`\n\n"
    paths["md"].write_text(header + render_markdown(summary, chart=paths["png"].name), encoding="utf-8")
    paths["latest_json"].write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    shutil.copyfile(paths["png"], paths["latest_png"])
    paths["latest_md"].write_text(header + render_markdown(summary, chart="latest.png"), encoding="utf-8")
    if results_md is not None:
        target = Path(results_md)
        chart = os.path.relpath(paths["latest_png"], target.parent)
        target.write_text(render_results_md(summary, chart), encoding="utf-8")
        paths["results_md"] = target
    return paths
