-- kvstore index, schema 1.
-- Hashes are 16-byte xxh3_128 digests stored as BLOBs.

CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

-- One row per bound model version: its namespace and how it was described.
CREATE TABLE models (
    ns          BLOB PRIMARY KEY,
    fingerprint BLOB NOT NULL,
    model_id    TEXT NOT NULL,
    layout      TEXT NOT NULL,
    chunk_size  INTEGER NOT NULL,
    created     REAL NOT NULL,
    last_used   REAL NOT NULL
);

-- Memo of per-file content digests, so a model fingerprint costs nothing on reopen.
CREATE TABLE file_digests (
    path     TEXT PRIMARY KEY,
    size     INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    digest   BLOB NOT NULL
);

-- Chunks (kind 0, exactly chunk_size tokens) and tails (kind 1, fewer) of stored sequences.
-- A record covers tokens [(depth - 1) * chunk_size, (depth - 1) * chunk_size + ntokens).
CREATE TABLE records (
    hash        BLOB PRIMARY KEY,
    ns          BLOB NOT NULL,
    parent      BLOB NOT NULL,
    depth       INTEGER NOT NULL,
    kind        INTEGER NOT NULL,
    ntokens     INTEGER NOT NULL,
    tokens      BLOB NOT NULL,
    size        INTEGER NOT NULL,
    checksum    INTEGER NOT NULL,
    created     REAL NOT NULL,
    last_access REAL NOT NULL,
    hits        INTEGER NOT NULL DEFAULT 0,
    pinned      INTEGER NOT NULL DEFAULT 0,
    bad         INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

CREATE INDEX records_parent ON records (parent);
CREATE INDEX records_last_access ON records (last_access);
CREATE INDEX records_ns ON records (ns);

-- Totals per namespace, kept by the same transaction that changes records.
CREATE TABLE totals (
    ns     BLOB PRIMARY KEY,
    chunks INTEGER NOT NULL DEFAULT 0,
    tails  INTEGER NOT NULL DEFAULT 0,
    bytes  INTEGER NOT NULL DEFAULT 0
);

CREATE TRIGGER records_insert AFTER INSERT ON records BEGIN
    INSERT OR IGNORE INTO totals (ns) VALUES (new.ns);
    UPDATE totals SET chunks = chunks + (new.kind = 0), tails = tails + (new.kind = 1),
                      bytes = bytes + new.size
    WHERE ns = new.ns;
END;

CREATE TRIGGER records_delete AFTER DELETE ON records BEGIN
    UPDATE totals SET chunks = chunks - (old.kind = 0), tails = tails - (old.kind = 1),
                      bytes = bytes - old.size
    WHERE ns = old.ns;
END;
