-- Memo of per-file SHA-256 digests (the model and tokenizer files a KV pack names), as
-- file_digests keeps the xxh3 digests of fingerprints: by path and stamps, each row with its
-- trust tag (`kvstore.trust`), so an export or import hashes a model's files once, not every time.
CREATE TABLE file_sha256 (
    path     TEXT PRIMARY KEY,
    size     INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    dev      INTEGER NOT NULL,
    inode    INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    digest   BLOB NOT NULL,
    tag      TEXT
);
