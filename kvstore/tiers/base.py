"""Where records are read from: tiers, each a small object with the same four methods.

- `find(hashes)`: which of these records it holds -> {hash: ref} (a ref is whatever the tier
  needs to open the record again: its index row, its in-memory record...);
- `children(parent, first_token)`: the (hash, tokens, ref) of the records it holds under `parent`;
- `open(h, ref)`: a `Source` of that record, or BlobError if what it holds is damaged;
- `damaged(h, error, ref)`: told when a record it gave could not be used (the disk quarantines it);
- `touch(hashes)`: these records were used (LRU order, last-access times).

A `Source` is one opened record: its token count, its tensors' entries (name -> dtype tag and
shape, `tokens` left out), `read_copies(copies, targets)` that copies token ranges of its tensors
into memory the restore owns (checking what it reads), and `array(name)` for a whole tensor; one
held in RAM says `in_ram` (the restore may then gather its tensors with others'). The restore
(`restore.py`) asks the tiers in order (memory, pending writes, local disk; a remote tier is one
more) and never knows which one it is talking to.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import mlx.core as mx
import numpy as np

from kvstore import keys
from kvstore.errors import BlobError
from kvstore.restore.arrays import host_array, tag_of
from kvstore.storage import blobfile, blobtree
from kvstore.storage.blobformat import Entry
from kvstore.storage.index import Index, Row
from kvstore.tiers.memory import MemoryTier, Record
from kvstore.write.writer import Writer

log = logging.getLogger("kvstore")


class Source(Protocol):
    hash: bytes
    ns: bytes
    parent: bytes
    depth: int
    kind: int
    ntokens: int
    tokens: np.ndarray
    entries: dict[str, Entry]

    def read_copies(self, copies: Sequence, targets: dict[str, blobfile.Target]) -> None:
        """Each copy `(name, lo, hi, dst)`: tokens [lo, hi) of tensor `name` to tokens
        [dst, dst + hi - lo) of `targets[name].array`. BlobError if what it read is damaged."""

    def array(self, name: str) -> np.ndarray:
        """A whole tensor, checked (bfloat16 as its uint16 bits)."""

    def cold(self) -> bool:
        """Whether reading it will wait for a disk (then the restore reads more records at once)."""

    def close(self) -> None: ...


class Tier(Protocol):
    name: str

    def find(self, hashes: Sequence[bytes]) -> dict[bytes, Any]: ...

    def children(self, parent: bytes, first_token: int) -> list[tuple[bytes, np.ndarray, Any]]: ...

    def open(self, h: bytes, ref: Any) -> Source: ...

    def damaged(self, h: bytes, error: BlobError, ref: Any = None) -> None: ...

    def touch(self, hashes: list[bytes]) -> None: ...


class RecordSource:
    """A record held in RAM (memory tier or the writer's queue): copies, nothing to check."""

    in_ram = True  # the restore gathers small pieces of such records (restore._gather)

    def __init__(self, rec: Record):
        self.hash, self.ntokens, self.record = rec.hash, len(rec.tokens), rec
        self.ns, self.parent, self.depth, self.kind, self.tokens = rec.ns, rec.parent, rec.depth, rec.kind, rec.tokens
        # What a record's arrays look like to the restore is worked out once and kept on it (its
        # arrays never change): a fetch of a long prompt opens hundreds of records.
        known = rec.__dict__.get("_kvstore_read")
        if known is None or known[0] is not rec.arrays:
            entries = blobfile.shared_entries(
                {name: Entry("BF16" if name in rec.views or a.dtype == mx.bfloat16 else tag_of(a.dtype),
                             tuple(a.shape)) for name, a in rec.arrays.items()})
            known = rec.__dict__["_kvstore_read"] = (rec.arrays, entries, {})
        self.entries, self._host = known[1], known[2]

    def _np(self, name: str) -> np.ndarray:
        host = self._host.get(name)
        if host is None:
            host = self._host[name] = host_array(self.record.arrays[name])
        return host

    def read_copies(self, copies, targets):
        for c in copies:
            np.copyto(targets[c.name].array[:, :, c.dst : c.dst + c.hi - c.lo], self._np(c.name)[:, :, c.lo : c.hi],
                      casting="no")

    def array(self, name: str) -> np.ndarray:
        return self._np(name)

    def cold(self) -> bool:
        return False

    def close(self) -> None:
        pass


def record_tokens(blob: blobfile.BlobFile, row: Row) -> np.ndarray:
    """The token ids of a record, read from its blob and proven by its address: the record's
    hash is the xxh3 of its parent and these ids (BlobError if they are not)."""
    if "tokens" not in blob.entries or blob.entries["tokens"].tag != "I32":
        raise BlobError(f"{blob.path}: no int32 token ids")
    tokens = blob.array("tokens").astype("<i4", copy=False)
    if len(tokens) != row.ntokens or not keys.is_address(row.hash, row.parent, row.kind, tokens):
        raise BlobError(f"{blob.path}: its token ids are not those of record {row.hash.hex()}")
    return tokens


class BlobSource:
    """A record read from a blob file, checked against its index row as it is opened."""

    def __init__(self, blob: blobfile.BlobFile, row: Row):
        self.hash, self.ntokens, self.blob = row.hash, row.ntokens, blob
        self.ns, self.parent, self.depth, self.kind = row.ns, row.parent, row.depth, row.kind
        meta = blob.metadata
        for key, want in (("ns", row.ns.hex()), ("parent", row.parent.hex()),
                          ("depth", str(row.depth)), ("kind", str(row.kind))):
            if meta.get(key) != want:
                raise BlobError(f"record {row.hash.hex()}: its header says {key} {meta.get(key)!r}, "
                                f"the index {want!r}")
        self.tokens = record_tokens(blob, row)
        self.entries = blob.layout.deltas  # shared by every record of this layout: never changed

    def read_copies(self, copies, targets):
        self.blob.read_copies(copies, targets)

    def array(self, name: str) -> np.ndarray:
        return self.blob.array(name)

    def cold(self) -> bool:
        return not self.blob.cached()

    def close(self) -> None:
        self.blob.close()


class MemoryTierView:
    """The memory tier (an LRU of records in RAM) as a tier."""

    name = "memory"

    def __init__(self, memory: MemoryTier):
        self.memory = memory

    def find(self, hashes):
        return {h: None for h in hashes if h in self.memory}

    def children(self, parent, first_token):
        return [(r.hash, r.tokens, r) for r in self.memory.children(parent)]

    def open(self, h, ref):
        rec = self.memory.get(h)
        if rec is None:
            raise KeyError(h)
        return RecordSource(rec)

    def damaged(self, h, error, ref=None):
        self.memory.discard([h])

    def touch(self, hashes):
        self.memory.touch(reversed(hashes))


class PendingTier:
    """Records queued for the background writer: visible the moment `insert` returns."""

    name = "pending"

    def __init__(self, writer: Writer):
        self.writer = writer

    def find(self, hashes):
        return {h: None for h in hashes if self.writer.is_pending(h)}

    def children(self, parent, first_token):
        return [(h, t, None) for h, t in self.writer.pending_children(parent)]

    def open(self, h, ref):
        rec = self.writer.pending(h)
        if rec is None:  # written and dequeued since: the memory tier or the disk has it now
            raise KeyError(h)
        return RecordSource(rec)

    def damaged(self, h, error, ref=None):
        pass

    def touch(self, hashes):
        pass


class DiskTier:
    """Blob files and their index rows. A damaged record is quarantined: a miss from then on."""

    name = "disk"

    def __init__(self, index: Index, root: Path, writer: Writer, counters: dict):
        self.index, self.root, self.writer, self.counters = index, root, writer, counters

    def find(self, hashes):
        return self.index.rows_of(list(hashes)) if hashes else {}

    def children(self, parent, first_token):
        """The records under `parent`, with their token ids read from their blobs (a record
        whose blob cannot give them is damaged: quarantined, left out)."""
        found = []
        for row in self.index.children(parent, first_token):
            try:
                with blobfile.open_blob(self.root, row.hash, size=row.size, checksum=row.checksum) as blob:
                    found.append((row.hash, record_tokens(blob, row), row))
            except BlobError as e:
                self.damaged(row.hash, e, row)
        return found

    def open(self, h, ref):
        row = ref if ref is not None else self.index.get(h)
        if row is None or row.bad:
            raise KeyError(h)
        blob = blobfile.open_blob(self.root, h, size=row.size, checksum=row.checksum)
        try:
            return BlobSource(blob, row)
        except BaseException:
            blob.close()
            raise

    def prefetch(self, hashes: Iterable[bytes]) -> None:
        blobfile.prefetch(self.root, list(hashes))

    def damaged(self, h, error, ref=None):
        """Mark a record whose blob failed to read as bad: a miss from it on, counted."""
        try:
            if self.index.get(h) is None:  # evicted (by gc, maybe in another process) under the read
                log.debug("kvstore: record %s was evicted while it was read", h.hex())
                return
        except Exception:
            pass
        if self._replaced(h, ref):  # completed by a writer under the read: the new blob is good
            return
        log.warning("kvstore: quarantined a damaged record: %s", error)
        self.counters["quarantined"] += 1
        try:
            if self.index.mark_bad(h):
                self.index.bump_counter("count.quarantined")
        except Exception:  # the index may be busy or read-only; the miss is what matters
            pass

    def _replaced(self, h: bytes, ref: Row | None) -> bool:
        """Whether the record's row changed since `ref` was read, looked at under the shared tree
        lock: a writer that completes a record (`Writer._refill`) replaces its blob and row
        together under the exclusive lock, and a read between the two is no damage."""
        try:
            with blobtree.tree_lock(self.root, exclusive=False):
                row = self.index.get(h)
        except Exception:
            return False
        return ref is not None and row is not None and (row.size, row.checksum) != (ref.size, ref.checksum)

    def touch(self, hashes):
        self.writer.touch(list(hashes))


def find(tiers: Sequence[Tier], hashes: Sequence[bytes]) -> dict[bytes, tuple[Tier, Any]]:
    """Where each of `hashes` can be read from: the first tier (in order) that holds it."""
    out: dict[bytes, tuple[Tier, Any]] = {}
    for tier in tiers:
        rest = [h for h in hashes if h not in out]
        if not rest:
            break
        for h, ref in tier.find(rest).items():
            out[h] = (tier, ref)
    return out
