-- The digest of each file of a bound model version, beside its stamps: a file whose stamps
-- changed (copied away and back, touched) is hashed again by `gc --stale` and compared with it,
-- so identical bytes at a new inode are not stale. Rows from before take the digest from the
-- memo when it still holds the file as it was recorded; the others stay NULL (cannot be
-- re-checked: a change makes them stale, as before).
ALTER TABLE model_files ADD COLUMN digest BLOB;
UPDATE model_files SET digest = (
    SELECT f.digest FROM file_digests f
    WHERE f.path = model_files.path AND f.size = model_files.size
      AND f.mtime_ns = model_files.mtime_ns AND f.inode = model_files.ino
      AND f.ctime_ns = model_files.ctime_ns);
