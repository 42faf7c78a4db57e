-- The strongest role that reached each record (mlx-lm's cache types: 0 assistant, 1 user,
-- 2 system): an insert of a stronger type raises it, never lowers it. When the budget evicts, the
-- weakest class goes first, LRU inside each. Rows written before this get 0, the class of every
-- insert that names no type: the store evicts them exactly as it did, by LRU alone.
ALTER TABLE records ADD COLUMN role INTEGER NOT NULL DEFAULT 0;
