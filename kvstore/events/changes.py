"""What happened to records, as vLLM events: stored in RAM or on disk, dropped, deleted.

`Changes` keeps what has been announced (`blocks.Holdings`, one per medium) and turns each change
into the events that make a router's view match: `BlockStored` for blocks no announced record
held before, `BlockRemoved` for blocks no announced record holds any more. Records on disk are
read from their blobs for their token ids (checked against their keys); deletions come from the
index's deletion log, checked against the index first (a record stored again since is kept);
records another process stored come from its insertion log.

A record's tenant tag is `tenant_of(record)`: None (the shared namespace) until records carry one.
It goes into the id of each of its blocks, and, where a record of a tenant follows one of
another (or the shared namespace, or the root), into `extra_keys` of its first block.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Iterator

import numpy as np

from kvstore import records
from kvstore.errors import BlobError
from kvstore.events import wire
from kvstore.events.blocks import Holdings, block_id, block_ids
from kvstore.records import CHECKPOINT
from kvstore.storage.blobfile import open_blob
from kvstore.storage.index import Index, Row

log = logging.getLogger("kvstore")

MEDIUMS = (wire.MEDIUM_RAM, wire.MEDIUM_DISK)
#: Rows of the store announced, and checked against the index, at a time.
ANNOUNCE_STEP = 128


def tenant_of(record: Any) -> Any:
    """A record's tenant tag (None: the shared namespace)."""
    return getattr(record, "tenant", None)


class Changes:
    """Announced state and the events that keep a router's view equal to it."""

    def __init__(self, index: Index | None, root, block_size: int):
        self.index, self.root, self.block_size = index, root, block_size
        self.held = {m: Holdings() for m in MEDIUMS}
        self.unreadable = 0  # records on disk whose token ids could not be read (not announced)

    # -- stored -----------------------------------------------------------------------------

    def stored(self, record: Any, tokens: np.ndarray, medium: str) -> list[dict]:
        """Record `record` (with these token ids) is now held in `medium`."""
        B = self.block_size
        if record.kind == CHECKPOINT or len(tokens) < B:
            return []
        tenant = tenant_of(record)
        ids = block_ids(record.parent, tokens, B, tenant)
        first_parent, tenant_starts = self._parent(record, tenant)
        fresh = self.held[medium].add(record.hash, ids, tenant)
        events, i = [], 0
        while i < len(ids):
            if not fresh[i]:
                i += 1
                continue
            j = i
            while j < len(ids) and fresh[j]:
                j += 1
            extra = None  # (`wire.stored`: no extra keys on any block)
            if tenant is not None and i == 0 and tenant_starts:
                extra = [[str(tenant) if not isinstance(tenant, bytes) else tenant.hex()]] + [None] * (j - 1)
            events.append(wire.stored(ids[i:j], ids[i - 1] if i else first_parent,
                                      np.asarray(tokens[i * B : j * B]).tolist(), B, medium, extra))
            i = j
        return events

    def _parent(self, record: Any, tenant: Any) -> tuple[int | None, bool]:
        """The id of the block before the record's first (None under the root), and whether the
        record's tenant starts with it (its parent is the root, or of another tenant)."""
        if record.parent == record.ns:
            return None, True
        for holdings in self.held.values():
            known = holdings.records.get(record.parent)
            if known is not None and known.ids:
                return known.ids[-1], known.tenant != tenant
        # Not announced (yet): its last block's id is made with its own tenant's tag, which a
        # tenant's first record (under a shared parent) does not share.
        row = self.index.rows_of([record.parent]).get(record.parent) if self.index is not None else None
        parent_tenant = row.tenant if row is not None else tenant
        return block_id(record.parent, parent_tenant), parent_tenant != tenant

    def stored_rows(self, rows: Iterable[Row]) -> list[dict]:
        """Rows just committed to the index: their records are on disk now."""
        events = []
        for row in rows:
            if row.kind == CHECKPOINT or row.hash in self.held[wire.MEDIUM_DISK].records:
                continue
            tokens = self._tokens_of(row)
            if tokens is not None:
                events += self.stored(row, tokens, wire.MEDIUM_DISK)
        return events

    def _tokens_of(self, row: Row) -> np.ndarray | None:
        """A stored record's token ids, from its blob, if they are the record's (else None)."""
        if row.ntokens < self.block_size or self.root is None:
            return None
        try:
            with open_blob(self.root, row.hash, size=row.size, checksum=row.checksum) as blob:
                tokens = blob.tokens()
                records.check(row, blob.metadata, tokens)  # the record's own (a tenant's key hashes its link)
        except (BlobError, OSError):  # gone (gc) or damaged: nothing to announce
            self.unreadable += 1
            return None
        return tokens

    # -- dropped ----------------------------------------------------------------------------

    def dropped(self, hashes: Iterable[bytes], medium: str) -> list[dict]:
        """These records are no longer held in `medium`."""
        gone: list[int] = []
        for h in hashes:
            gone += self.held[medium].drop(h)
        return [wire.removed(gone, medium)] if gone else []

    def inserted(self, entries: list[tuple[int, bytes, bytes]], namespaces: set[bytes]) -> list[dict]:
        """Entries of the index's insertion log: the records of them in `namespaces` that are
        not announced on disk (another process stored them) and still served are, parents first."""
        announced = self.held[wire.MEDIUM_DISK].records
        hashes = list(dict.fromkeys(h for _, h, ns in entries if ns in namespaces and h not in announced))
        if not hashes or self.index is None:
            return []
        rows = sorted(self.index.rows_of(hashes).values(), key=lambda r: (r.depth or 0, r.kind))
        return self.stored_rows(rows)

    def deleted(self, entries: list[tuple[int, bytes, bytes]], queued: Iterable[bytes] = ()) -> list[dict]:
        """Entries of the index's deletion log: the records of them that were announced and are
        still not served by the index are removed, from disk, and from RAM too unless they are
        `queued` for the writer (stored again). The memory tier may still hold a copy another
        process deleted from the index, but it serves none: it drops them on its next fetch
        (`model.backing.DeletedElsewhere`), so a router must not send their prompts here for RAM."""
        queued = set(queued)
        disk, ram = self.held[wire.MEDIUM_DISK].records, self.held[wire.MEDIUM_RAM].records
        hashes = list(dict.fromkeys(h for _, h, _ in entries if h in disk or (h in ram and h not in queued)))
        if not hashes or self.index is None:
            return []
        back = self.index.present(hashes)  # stored again since (or healed): still there
        gone = [h for h in hashes if h not in back]
        return (self.dropped([h for h in gone if h in disk], wire.MEDIUM_DISK)
                + self.dropped([h for h in gone if h not in queued], wire.MEDIUM_RAM))

    def clear(self) -> None:
        for holdings in self.held.values():
            holdings.clear()

    # -- the whole store, at start ------------------------------------------------------------

    def announce(self, ns: bytes) -> Iterator[list[dict]]:
        """The records of namespace `ns` on disk, parents first, as events: one list per step of
        `ANNOUNCE_STEP` rows (each step checked against the index again, so what gc deleted
        meanwhile is left out)."""
        if self.index is None:
            return
        rows = [r for r in self.index.rows(ns) if r.kind != CHECKPOINT and not r.bad
                and r.ntokens >= self.block_size]
        for start in range(0, len(rows), ANNOUNCE_STEP):
            step = rows[start : start + ANNOUNCE_STEP]
            present = self.index.present([r.hash for r in step])
            yield self.stored_rows([r for r in step if r.hash in present])

    def blocks(self) -> dict[str, int]:
        """Blocks announced as held, per medium."""
        return {m: len(h.holders) for m, h in self.held.items()}
