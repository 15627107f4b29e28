"""A reset is answered only once it is durable: answered means it survives a coordinator crash."""

from __future__ import annotations

import signal

import pytest

from zbroker.protocol.errors import ErrorCode, ZBrokerError
from tests.integration.test_consumer_groups import drain, produce_values, wait_committed
from tests.support.pg import dsn_host_port, dsn_via, with_schema
from tests.support.tcp_proxy import TcpProxy
from zbroker.client import Admin, Consumer
from zbroker.supervisor import wait_ready

pytestmark = [pytest.mark.processes, pytest.mark.postgres]


@pytest.fixture
def broker_behind_proxy(pg_dsn, pg_schema_factory, start):
    schema = pg_schema_factory()
    proxy = TcpProxy(dsn_host_port(pg_dsn)).start()
    broker = None
    try:
        broker = start(offsets_url=with_schema(dsn_via(pg_dsn, proxy.port), schema))
        yield broker, proxy
    finally:
        proxy.restore()  # the writer flushes what it holds while it stops
        if broker is not None:
            broker.stop()
        proxy.close()


def test_a_reset_the_database_never_stored_is_not_acknowledged(broker_behind_proxy):
    broker, proxy = broker_behind_proxy
    with Admin(broker.url) as admin:
        admin.create_topic("ledger", partitions=2)
    produce_values(broker.url, "ledger", [b"%d" % i for i in range(200)])
    with Consumer(broker.url, group="auditors", topics=["ledger"]) as consumer:
        drain(consumer, 200)
    with Admin(broker.url) as admin:
        ends = {("ledger", p["partition"]): p["log_end"] for p in admin.describe_topic("ledger")["partitions"]}
        wait_committed(admin, "auditors", ends)

        proxy.cut()
        with pytest.raises(ZBrokerError) as refused:
            admin.reset_group("auditors", "ledger", "earliest")
        assert refused.value.code is ErrorCode.UNAVAILABLE
        assert refused.value.data["reset_epoch"] == 1

        proxy.restore()
        answered = admin.reset_group("auditors", "ledger", "earliest")
        # Cut off longer than its coordinator lease, the node stood by for a moment (issue 26):
        # a reset it held then was answered NOT_COORDINATOR and sent again by the client, and
        # each one applied bumps the epoch. Which epoch is not the point; that it is durable is.
        assert answered["reset_epoch"] >= 2
        assert sorted(answered["partitions"]) == [[0, 0], [1, 0]]

    # Answered means durable: a crash right after the answer keeps the reset.
    broker.kill("coordinator", signal.SIGKILL)
    wait_ready(broker.url)
    with Admin(broker.url) as admin:
        committed = {p["partition"]: p["committed"] for p in admin.describe_group("auditors")["partitions"]}
    assert committed == {0: 0, 1: 0}
