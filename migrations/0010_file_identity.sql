-- The fingerprint memo is keyed by each file's identity too: device, inode and ctime change when
-- a file is replaced or rewritten, even when its size and mtime were put back as they were.
-- Rows from before this migration have NULL there and never match: each file is hashed once more.
ALTER TABLE file_digests ADD COLUMN dev INTEGER;
ALTER TABLE file_digests ADD COLUMN inode INTEGER;
ALTER TABLE file_digests ADD COLUMN ctime_ns INTEGER;
