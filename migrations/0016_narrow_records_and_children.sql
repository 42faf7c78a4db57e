-- The records table loses its token ids (each blob holds its own, in its "tokens" tensor, and the
-- record's hash is the xxh3 of its parent and those ids), so a row is about 100 bytes instead of
-- 1.1 KiB: gc's scan of the whole table and its deletes touch a tenth of the pages.
-- Who hangs under whom moves to a table of its own, `children`, keyed (parent, first token id,
-- hash; -1 for a checkpoint, which has no tokens, or a row from before 0003): gc deletes
-- rows from `records` in hash order and their edges from `children` in parent order, each a
-- sweep over neighbouring pages instead of random pages of the whole file (bench/index_scale.py).
-- An edge whose record is gone is ignored by every reader (they join `records`).

CREATE TABLE records_v16 (
    hash        BLOB PRIMARY KEY,
    ns          BLOB NOT NULL,
    parent      BLOB NOT NULL,
    depth       INTEGER NOT NULL,
    kind        INTEGER NOT NULL,
    ntokens     INTEGER NOT NULL,
    first_token INTEGER,
    size        INTEGER NOT NULL,
    checksum    INTEGER NOT NULL,
    created     REAL NOT NULL,
    last_access REAL NOT NULL,
    hits        INTEGER NOT NULL DEFAULT 0,
    pinned      INTEGER NOT NULL DEFAULT 0,
    bad         INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

INSERT INTO records_v16 (hash, ns, parent, depth, kind, ntokens, first_token, size, checksum,
                         created, last_access, hits, pinned, bad)
SELECT hash, ns, parent, depth, kind, ntokens, first_token, size, checksum, created, last_access,
       hits, pinned, bad FROM records ORDER BY hash;

CREATE TABLE children (
    parent      BLOB NOT NULL,
    first_token INTEGER NOT NULL,
    hash        BLOB NOT NULL,
    PRIMARY KEY (parent, first_token, hash)
) WITHOUT ROWID;

INSERT INTO children (parent, first_token, hash)
SELECT parent, coalesce(first_token, -1), hash FROM records ORDER BY 1, 2, 3;

DROP TABLE records;

ALTER TABLE records_v16 RENAME TO records;

CREATE INDEX records_ns ON records (ns);

CREATE TRIGGER records_insert AFTER INSERT ON records BEGIN
    INSERT OR IGNORE INTO totals (ns) VALUES (new.ns);
    UPDATE totals SET chunks = chunks + (new.kind = 0), tails = tails + (new.kind = 1),
                      checkpoints = checkpoints + (new.kind = 2), bytes = bytes + new.size
    WHERE ns = new.ns;
    INSERT OR IGNORE INTO children (parent, first_token, hash)
    VALUES (new.parent, coalesce(new.first_token, -1), new.hash);
END;

CREATE TRIGGER records_delete AFTER DELETE ON records BEGIN
    UPDATE totals SET chunks = chunks - (old.kind = 0), tails = tails - (old.kind = 1),
                      checkpoints = checkpoints - (old.kind = 2), bytes = bytes - old.size
    WHERE ns = old.ns;
END;
