-- Each memoised file digest carries its tag (`kvstore.trust`): a MAC under a key the store's
-- writer holds (from the fleet secret with a remote tier, else the store's own key) over the
-- file's path, stamps and digest. A row without a tag that holds is hashed again, never used:
-- the rows from before this migration are, once. This migration's time is the store's trust
-- epoch: a blob whose record was created after it and that has no tag was not written so.
ALTER TABLE file_digests ADD COLUMN tag TEXT;
