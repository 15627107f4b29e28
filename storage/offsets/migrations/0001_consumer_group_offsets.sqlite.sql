-- Consumer group offsets: one row per (group, topic, partition).
-- Same columns as the PostgreSQL table; holes is JSON text, updated_at is
-- milliseconds since the epoch (SQLite has no timestamp type).
CREATE TABLE IF NOT EXISTS {schema}.consumer_group_offsets (
    group_id         TEXT    NOT NULL,
    topic            TEXT    NOT NULL,
    partition        INTEGER NOT NULL CHECK (partition >= 0),
    committed_offset INTEGER NOT NULL CHECK (committed_offset >= 0),
    holes            TEXT    NOT NULL DEFAULT '[]',
    generation       INTEGER NOT NULL DEFAULT 0,
    reset_epoch      INTEGER NOT NULL DEFAULT 0 CHECK (reset_epoch >= 0),
    updated_at       INTEGER NOT NULL,
    PRIMARY KEY (group_id, topic, partition)
) WITHOUT ROWID;
