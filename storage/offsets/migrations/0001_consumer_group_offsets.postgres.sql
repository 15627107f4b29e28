-- Consumer group offsets: one row per (group, topic, partition).
-- committed_offset is the next offset to deliver; holes are the acked ranges
-- [start, end) above it, as a JSON array of pairs. reset_epoch only grows and
-- lets an explicit `groups reset` move committed_offset down (see base.py).
-- fillfactor leaves room on each page so that the constant upserts stay HOT
-- updates (no index churn): the key never changes, only the values do.
CREATE TABLE IF NOT EXISTS {schema}.consumer_group_offsets (
    group_id         text        NOT NULL,
    topic            text        NOT NULL,
    partition        integer     NOT NULL CHECK (partition >= 0),
    committed_offset bigint      NOT NULL CHECK (committed_offset >= 0),
    holes            jsonb       NOT NULL DEFAULT '[]'::jsonb,
    generation       bigint      NOT NULL DEFAULT 0,
    reset_epoch      bigint      NOT NULL DEFAULT 0 CHECK (reset_epoch >= 0),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (group_id, topic, partition)
) WITH (fillfactor = 70);
