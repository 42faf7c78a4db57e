-- What the index stopped serving, by any process on the store (gc, the writer's dedup, repair,
-- quarantine), in order: servers that publish KV events read it to announce removals that
-- another process made. It keeps the last 100,000 entries; a reader that fell further behind
-- than that announces the whole store again.
CREATE TABLE deletion_log (
    seq  INTEGER PRIMARY KEY,
    hash BLOB NOT NULL,
    ns   BLOB NOT NULL
);

CREATE TRIGGER records_deletion_log AFTER DELETE ON records BEGIN
    INSERT INTO deletion_log (hash, ns) VALUES (old.hash, old.ns);
    DELETE FROM deletion_log WHERE seq <= last_insert_rowid() - 100000;
END;

CREATE TRIGGER records_quarantine_log AFTER UPDATE OF bad ON records
WHEN new.bad != 0 AND old.bad = 0 BEGIN
    INSERT INTO deletion_log (hash, ns) VALUES (new.hash, new.ns);
    DELETE FROM deletion_log WHERE seq <= last_insert_rowid() - 100000;
END;
