-- What this store's disk was written, by the hour (unix time // 3600, so UTC days are hour // 24):
-- the write budget counts a rolling day of it in every process that opens the store, `kvstore
-- stats` shows it by day, and its sums over every row are the lifetime totals (rows only exist for
-- hours something happened: a few thousand a year). `bytes` and `records` are the writer's
-- blobs, `downloaded` the remote tier's objects written through to disk; `not_admitted` and
-- `over_budget` are records (and their bytes) the admission policy or the budget kept in RAM.
CREATE TABLE write_log (
    hour               INTEGER PRIMARY KEY,
    bytes              INTEGER NOT NULL DEFAULT 0,
    records            INTEGER NOT NULL DEFAULT 0,
    downloaded         INTEGER NOT NULL DEFAULT 0,
    not_admitted       INTEGER NOT NULL DEFAULT 0,
    not_admitted_bytes INTEGER NOT NULL DEFAULT 0,
    over_budget        INTEGER NOT NULL DEFAULT 0,
    over_budget_bytes  INTEGER NOT NULL DEFAULT 0
);

-- Record keys a fetch or an insert has seen, for `admit="reused"`: a key seen again (by a fetch,
-- in any process) is `reused`, and its record is then written to disk. Bounded in age and count
-- by the writer, oldest first.
CREATE TABLE seen_prefixes (
    hash   BLOB PRIMARY KEY,
    seen   REAL NOT NULL,
    reused INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX seen_prefixes_by_time ON seen_prefixes (seen);
