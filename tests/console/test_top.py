"""`zbroker top` under a pseudo-terminal (pexpect): it draws, updates, and quits on q and Ctrl-C."""

from __future__ import annotations

import re
import sys

import pexpect
import pytest

from zbroker.client import Admin, Consumer, Producer

pytestmark = pytest.mark.processes


def _spawn(url: str) -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "zbroker", "top", "--broker", url], encoding="utf-8",
                         dimensions=(40, 160), timeout=30, env={"TERM": "xterm", "PATH": "/usr/bin:/bin",
                                                                "COLUMNS": "160", "LINES": "40"})


def _refresh(child: pexpect.spawn) -> int:
    child.expect(r"refresh (\d+)")
    return int(child.match.group(1))


def test_top_draws_updates_and_quits_on_q(broker):
    with Admin(broker.url) as admin:
        admin.create_topic("payments", partitions=2)
    producer = Producer(broker.url)
    for i in range(12):
        producer.send("payments", value=b"p%d" % i)
    producer.flush()
    producer.close()
    with Consumer(broker.url, group="ledger", topics=["payments"]) as consumer:
        held = []
        while len(held) < 12:
            held += consumer.poll(max_records=12, timeout=1.0)
        child = _spawn(broker.url)
        try:
            child.expect("zbroker top")
            child.expect("payments")
            child.expect("ledger")
            first = _refresh(child)
            # It updates: a later frame has a higher refresh count, and shows new figures.
            for rec in held:
                consumer.ack(rec)
            consumer.flush_acks()
            later = _refresh(child)
            while later <= first:
                later = _refresh(child)
            child.expect(re.compile(r"ledger\s.*OK"))
            child.send("q")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_top_quits_on_ctrl_c(broker):
    child = _spawn(broker.url)
    try:
        child.expect("zbroker top")
        _refresh(child)
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0 and child.signalstatus is None
