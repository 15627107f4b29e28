-- Key quarantine (issue 28): the keys a group parked in a partition, kept with its
-- holes so that a coordinator restart does not deliver them again. JSON text, an
-- array of [key_hash, failures, reason]; NULL means none. SQLite has no
-- ADD COLUMN IF NOT EXISTS: the version table alone keeps this from running twice.
ALTER TABLE {schema}.consumer_group_offsets ADD COLUMN quarantine TEXT;
