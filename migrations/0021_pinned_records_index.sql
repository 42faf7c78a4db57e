-- The pinned records alone, by namespace: what `kvstore pins` lists and the pins file beside the
-- index is written from, read without a scan of the whole table (few records are pinned).
CREATE INDEX records_pinned ON records (ns) WHERE pinned != 0;
