-- Group configurations (configure_group) in the store (issue 26): a coordinator that
-- takes over on another node has them, as it has the topics. Written through the same
-- fenced write_metadata transaction; coordinator_epoch as in 0002.
CREATE TABLE IF NOT EXISTS {schema}.zbroker_group_configs (
    group_id          text        PRIMARY KEY,
    config            jsonb       NOT NULL,
    coordinator_epoch bigint      NOT NULL DEFAULT 0,
    updated_at        timestamptz NOT NULL DEFAULT now()
);
