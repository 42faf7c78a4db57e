-- Checkpoint records (kind 2): whole recurrent-layer state at the end of a chunk or tail.
-- Count them in the totals like chunks and tails.

ALTER TABLE totals ADD COLUMN checkpoints INTEGER NOT NULL DEFAULT 0;

UPDATE totals SET checkpoints = (SELECT count(*) FROM records r WHERE r.ns = totals.ns AND r.kind = 2);

DROP TRIGGER records_insert;
DROP TRIGGER records_delete;

CREATE TRIGGER records_insert AFTER INSERT ON records BEGIN
    INSERT OR IGNORE INTO totals (ns) VALUES (new.ns);
    UPDATE totals SET chunks = chunks + (new.kind = 0), tails = tails + (new.kind = 1),
                      checkpoints = checkpoints + (new.kind = 2), bytes = bytes + new.size
    WHERE ns = new.ns;
END;

CREATE TRIGGER records_delete AFTER DELETE ON records BEGIN
    UPDATE totals SET chunks = chunks - (old.kind = 0), tails = tails - (old.kind = 1),
                      checkpoints = checkpoints - (old.kind = 2), bytes = bytes - old.size
    WHERE ns = old.ns;
END;
