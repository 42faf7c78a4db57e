-- Of `bytes` (and `records`), what explicit writes wrote: warmed, prefilled and pinned prompts and
-- durable inserts. They count in the write budget's rolling day like every write, so they use up
-- the automatic writes' allowance, but the budget never refuses them; `stats` shows them apart.
ALTER TABLE write_log ADD COLUMN explicit INTEGER NOT NULL DEFAULT 0;
