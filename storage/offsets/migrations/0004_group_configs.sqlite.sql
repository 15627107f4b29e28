-- Group configurations (configure_group) in the store (issue 26), as on PostgreSQL;
-- config is JSON text.
CREATE TABLE IF NOT EXISTS {schema}.zbroker_group_configs (
    group_id          TEXT    PRIMARY KEY,
    config            TEXT    NOT NULL,
    coordinator_epoch INTEGER NOT NULL DEFAULT 0,
    updated_at        INTEGER NOT NULL
) WITHOUT ROWID;
