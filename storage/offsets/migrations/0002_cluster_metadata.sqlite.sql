-- Cluster metadata (issues 25, 26): the same tables as on PostgreSQL, so that the
-- topics live in the store on both backends. SQLite is a cluster of one: its
-- lease is always its own node's at epoch 1 and is never stored; config, replicas
-- and isr are JSON text.
CREATE TABLE IF NOT EXISTS {schema}.zbroker_topics (
    name               TEXT    PRIMARY KEY,
    partitions         INTEGER NOT NULL CHECK (partitions >= 1),
    config             TEXT    NOT NULL DEFAULT '{}',
    replication_factor INTEGER NOT NULL DEFAULT 1 CHECK (replication_factor >= 1),
    min_insync         INTEGER NOT NULL DEFAULT 1 CHECK (min_insync >= 1),
    incarnation        INTEGER NOT NULL,
    coordinator_epoch  INTEGER NOT NULL DEFAULT 0,
    updated_at         INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS {schema}.zbroker_partition_states (
    topic             TEXT    NOT NULL,
    partition         INTEGER NOT NULL CHECK (partition >= 0),
    replicas          TEXT    NOT NULL,
    leader            TEXT,
    leader_epoch      INTEGER NOT NULL CHECK (leader_epoch >= 0),
    isr               TEXT    NOT NULL,
    coordinator_epoch INTEGER NOT NULL DEFAULT 0,
    updated_at        INTEGER NOT NULL,
    PRIMARY KEY (topic, partition)
) WITHOUT ROWID;
-- SQLite has no ADD COLUMN IF NOT EXISTS: this file runs once, under the BEGIN
-- IMMEDIATE of migrate() that also records its version, so it is never reapplied.
ALTER TABLE {schema}.consumer_group_offsets ADD COLUMN coordinator_epoch INTEGER NOT NULL DEFAULT 0;
