-- Cluster metadata (issues 25, 26): topics, partition replica states and the
-- coordinator lease, so that a coordinator on another host can take over.
-- coordinator_epoch on every written row is the epoch of the writer that wrote
-- it (0: written without one, by a single-node broker), so a checker can prove by
-- a query that nothing was written by an epoch after its successor took over.
CREATE TABLE IF NOT EXISTS {schema}.zbroker_topics (
    name               text        PRIMARY KEY,
    partitions         integer     NOT NULL CHECK (partitions >= 1),
    config             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    replication_factor integer     NOT NULL DEFAULT 1 CHECK (replication_factor >= 1),
    min_insync         integer     NOT NULL DEFAULT 1 CHECK (min_insync >= 1),
    incarnation        bigint      NOT NULL,
    coordinator_epoch  bigint      NOT NULL DEFAULT 0,
    updated_at         timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {schema}.zbroker_partition_states (
    topic             text        NOT NULL,
    partition         integer     NOT NULL CHECK (partition >= 0),
    replicas          jsonb       NOT NULL,
    leader            text,
    leader_epoch      bigint      NOT NULL CHECK (leader_epoch >= 0),
    isr               jsonb       NOT NULL,
    coordinator_epoch bigint      NOT NULL DEFAULT 0,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, partition)
);
-- One row: who leads, until when (by this server's clock), and the fencing epoch.
CREATE TABLE IF NOT EXISTS {schema}.zbroker_coordinator_lease (
    id         integer     PRIMARY KEY CHECK (id = 1),
    holder     text        NOT NULL,
    endpoint   text        NOT NULL,
    epoch      bigint      NOT NULL CHECK (epoch >= 1),
    taken_at   timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);
-- Every epoch ever taken, by whom and when: the history a checker reads.
CREATE TABLE IF NOT EXISTS {schema}.zbroker_coordinator_epochs (
    epoch    bigint      PRIMARY KEY,
    holder   text        NOT NULL,
    endpoint text        NOT NULL,
    taken_at timestamptz NOT NULL
);
ALTER TABLE {schema}.consumer_group_offsets ADD COLUMN IF NOT EXISTS coordinator_epoch bigint NOT NULL DEFAULT 0;
