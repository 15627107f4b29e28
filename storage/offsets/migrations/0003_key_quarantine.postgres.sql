-- Key quarantine (issue 28): the keys a group parked in a partition, kept with its
-- holes so that a coordinator restart does not deliver them again. A JSON array of
-- [key_hash, failures, reason]; NULL (every row written before, or with nothing
-- parked) means none. At most 1000 per row (the coordinator's bound).
ALTER TABLE {schema}.consumer_group_offsets ADD COLUMN IF NOT EXISTS quarantine jsonb;
