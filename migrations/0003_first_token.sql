-- The first token of each chunk and tail, so that a lookup reads only the children of a chunk
-- that can share tokens with the prompt (a popular system prompt may have thousands of tails).
-- Rows from before this migration keep NULL and are always read.

ALTER TABLE records ADD COLUMN first_token INTEGER;

-- (parent, first_token) serves every lookup by parent too.
CREATE INDEX records_parent_first ON records (parent, first_token);
DROP INDEX records_parent;
