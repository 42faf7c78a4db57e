"""The writer's queue as a tier: records queued for the background writer are visible to a
fetch the moment `insert` returns."""

from __future__ import annotations

from kvstore.tiers.memory import RecordSource
from kvstore.write.writer import Writer


class PendingTier:
    name = "pending"
    in_process = True

    def __init__(self, writer: Writer):
        self.writer = writer

    def find(self, lookup, ids):
        return {r.hash: None for r in ids if self.writer.is_pending(r.hash)}

    def children(self, lookup, parent, rest):
        return [(h, t, None) for h, t, tenant in self.writer.pending_children(parent) if lookup.sees(tenant)]

    def open(self, h, ref):
        rec = self.writer.pending(h)
        if rec is None:  # written and dequeued since: the memory tier or the disk has it now
            raise KeyError(h)
        return RecordSource(rec)

    def damaged(self, h, error, ref=None):
        self.writer.quarantine(h, str(error))

    def touch(self, hashes):
        pass
