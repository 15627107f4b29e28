"""The cluster as the store records it, for `zbroker status` (issue 26).

Theory of operation
-------------------
The nodes of a cluster decide leadership through one lease row
(``zbroker_coordinator_lease``, migration 0002) and record every epoch taken
in ``zbroker_coordinator_epochs``. Reading both tells who leads, at which
epoch, how long ago the lease was renewed and taken, and how long it still
runs, all measured by the database's clock (``now()``), the only clock the
lease obeys. Every node that ever led is in the epoch history; a node that
never led (a standby since it started) is not, so the view names what the
store knows and says so.

`cluster_view` is pure: rows in, the reported shape out. `read_cluster_view`
runs the two reads, read-only: it takes no lease and writes nothing. SQLite
is a cluster of one: the node the client talks to leads, with no lease.
"""

from __future__ import annotations

from typing import Any

from zbroker.storage.offsets.urls import check_schema, split_schema

LEASE_SQL = """
SELECT holder, endpoint, epoch,
       (extract(epoch FROM now() - renewed_at) * 1000)::int8 AS lease_age_ms,
       (extract(epoch FROM now() - taken_at) * 1000)::int8 AS held_for_ms,
       greatest(0, ceil(extract(epoch FROM expires_at - now()) * 1000))::int8 AS remaining_ms
FROM {s}.zbroker_coordinator_lease WHERE id = 1
"""
EPOCHS_SQL = """
SELECT holder, endpoint, max(epoch) AS last_epoch, count(*) AS epochs_taken,
       (extract(epoch FROM now() - max(taken_at)) * 1000)::int8 AS last_taken_ms_ago
FROM {s}.zbroker_coordinator_epochs GROUP BY holder, endpoint ORDER BY max(epoch) DESC
"""


def cluster_view(backend: str, lease: dict | None, epochs: list[dict], *, endpoint: str | None = None) -> dict:
    """The `cluster` shape `zbroker status` shows (and `--json` prints):

    ``{"backend", "leader": {node_id, endpoint, epoch, lease_age_ms, held_for_ms, remaining_ms,
    expired} | None, "nodes": [{node_id, endpoint, leading, last_epoch, epochs_taken,
    last_taken_ms_ago}], "source": "store"}``; `endpoint` names the node of a SQLite
    cluster of one (the one the client reached)."""
    if backend == "sqlite":
        node = {"node_id": "local", "endpoint": endpoint, "leading": True, "last_epoch": None,
                "epochs_taken": 0, "last_taken_ms_ago": None}
        return {"backend": "sqlite", "leader": {**node, "epoch": None, "lease_age_ms": None, "held_for_ms": None,
                                                "remaining_ms": None, "expired": False},
                "nodes": [node], "source": "store", "cluster_of_one": True}
    leader = None
    if lease is not None:
        leader = {"node_id": lease["holder"], "endpoint": lease["endpoint"], "epoch": lease["epoch"],
                  "lease_age_ms": lease["lease_age_ms"], "held_for_ms": lease["held_for_ms"],
                  "remaining_ms": lease["remaining_ms"], "expired": lease["remaining_ms"] <= 0}
    nodes: dict[tuple, dict] = {}
    for row in epochs:
        key = (row["holder"], row["endpoint"])
        if key not in nodes:  # rows come newest epoch first
            nodes[key] = {"node_id": row["holder"], "endpoint": row["endpoint"], "leading": False,
                          "last_epoch": row["last_epoch"], "epochs_taken": row["epochs_taken"],
                          "last_taken_ms_ago": row["last_taken_ms_ago"]}
    if leader is not None:
        key = (leader["node_id"], leader["endpoint"])
        nodes.setdefault(key, {"node_id": leader["node_id"], "endpoint": leader["endpoint"], "leading": False,
                               "last_epoch": leader["epoch"], "epochs_taken": 1, "last_taken_ms_ago": None})
        nodes[key]["leading"] = not leader["expired"]
    return {"backend": "postgresql", "leader": leader, "nodes": list(nodes.values()), "source": "store",
            "cluster_of_one": False}


async def read_cluster_view(url: str, *, endpoint: str | None = None, timeout: float = 5.0) -> dict:
    """`cluster_view` of the store at ``--offsets`` `url`, read-only."""
    if url.startswith("sqlite:"):
        return cluster_view("sqlite", None, [], endpoint=endpoint)
    if not url.startswith(("postgresql://", "postgres://")):
        raise ValueError(f"--offsets {url!r}: sqlite:///PATH or postgresql://...")
    import asyncpg

    dsn, schema = split_schema(url)
    qualifier = f'"{check_schema(schema) or "public"}"'
    conn = await asyncpg.connect(dsn, timeout=timeout, command_timeout=timeout,
                                 server_settings={"application_name": "zbroker-status"})
    try:
        try:
            lease = await conn.fetchrow(LEASE_SQL.format(s=qualifier))
            epochs = await conn.fetch(EPOCHS_SQL.format(s=qualifier))
        except asyncpg.UndefinedTableError:  # no node has run migration 0002 on this schema yet
            return cluster_view("postgresql", None, [])
    finally:
        await conn.close()
    return cluster_view("postgresql", dict(lease) if lease is not None else None, [dict(r) for r in epochs])
