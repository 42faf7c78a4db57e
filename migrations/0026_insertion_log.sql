-- What the index started serving, by any process on the store (a server's writer, `kvstore warm`,
-- a download from the bucket), in order: servers that publish KV events read it to announce the
-- records another process stored, as they read the deletion log (0023) for what it removed. It
-- keeps the last 100,000 entries; a reader that fell further behind announces the whole store again.
CREATE TABLE insertion_log (
    seq  INTEGER PRIMARY KEY,
    hash BLOB NOT NULL,
    ns   BLOB NOT NULL
);

CREATE TRIGGER records_insertion_log AFTER INSERT ON records BEGIN
    INSERT INTO insertion_log (hash, ns) VALUES (new.hash, new.ns);
    DELETE FROM insertion_log WHERE seq <= last_insert_rowid() - 100000;
END;
