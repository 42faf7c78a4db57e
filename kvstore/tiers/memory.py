"""The memory tier: an LRU of decoded records, bounded by bytes, in front of the disk.

`MemoryTier` is the LRU; `MemoryTierView` is it as a tier of the lookup, and `RecordSource` a
record held in RAM (here or in the writer's queue) as the restore reads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable

import mlx.core as mx
import numpy as np

from kvstore.records import RecordId
from kvstore.restore.arrays import host_array, tag_of
from kvstore.storage.blobfile import shared_entries
from kvstore.storage.blobformat import Entry


@dataclass(slots=True)
class Record(RecordId):
    """A record with its arrays, as the memory tier and fetch see it.

    `arrays` holds what was stored (mlx arrays; a record still queued for the writer holds numpy
    views of the caller's arrays); a name in `views` is kept as raw bits (bfloat16 as uint16) and
    is that dtype when restored.
    """

    tokens: np.ndarray
    arrays: dict[str, mx.array | np.ndarray]
    views: dict[str, mx.Dtype] = field(default_factory=dict)
    nbytes: int = 0
    # How its arrays look to the restore, worked out once (`RecordSource`); never compared.
    read_view: tuple | None = field(default=None, repr=False, compare=False)
    # Header extension fields its blob gets when it is written from RAM (a canary).
    extensions: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(a.nbytes for a in self.arrays.values()) + self.tokens.nbytes


def held(rid: RecordId, tokens: np.ndarray, arrays: dict, views: dict | None = None, nbytes: int = 0,
         extensions: dict[str, str] | None = None) -> Record:
    """Record `rid` with these token ids and arrays, in RAM."""
    return Record(rid.hash, rid.ns, rid.parent, rid.depth, rid.kind, rid.ntokens, rid.first_token,
                  tokens, arrays, views or {}, nbytes, extensions=dict(extensions or {}), **rid.owner())


class MemoryTier:
    """A thread-safe LRU of `Record`s. `capacity=0` keeps nothing.

    `on_change` listeners are told, under the tier's lock (so in the order it happened), the
    records it took in and the ones it let go: they must only note it. Subscribed once, where
    the store is built."""

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self._records: OrderedDict[bytes, Record] = OrderedDict()
        self._children: dict[bytes, set[bytes]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0
        self.on_change: list[Callable[[list[Record], list[Record]], None]] = []

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, h: bytes) -> bool:
        return h in self._records

    def keeps(self, nbytes: int) -> bool:
        """Whether a record of `nbytes` would be kept at all (so a copy of it is worth making)."""
        return 0 < nbytes <= self.capacity

    def get(self, h: bytes) -> Record | None:
        with self._lock:
            rec = self._records.get(h)
            if rec is not None:
                self._records.move_to_end(h)
                self.hits += 1
            return rec

    def peek(self, h: bytes) -> Record | None:
        """The record `h`, if held, without counting a hit or moving it in the LRU order."""
        with self._lock:
            return self._records.get(h)

    def kinds(self) -> dict[int, int]:
        """How many records of each kind (chunk, tail, checkpoint) are held."""
        with self._lock:
            counts: dict[int, int] = {}
            for rec in self._records.values():
                counts[rec.kind] = counts.get(rec.kind, 0) + 1
            return counts

    def tenants(self) -> list[dict]:
        """One dict per tenant whose records are held: its `tenant` tag, `records` and `bytes`
        (what `LocalStore.tenants` says of a store on disk, for a store in RAM)."""
        totals: dict[str, list[int]] = {}
        with self._lock:
            for rec in self._records.values():
                if rec.tenant is not None:
                    held = totals.setdefault(rec.tenant, [0, 0])
                    held[0], held[1] = held[0] + 1, held[1] + rec.nbytes
        return [{"tenant": tag, "records": n, "bytes": size} for tag, (n, size) in totals.items()]

    def children(self, parent: bytes) -> list[Record]:
        with self._lock:
            return [self._records[h] for h in self._children.get(parent, ())]

    def put(self, records: Iterable[Record]) -> None:
        """Add records. Give a chain deepest-first, so its ancestors end up most recent and a
        full tier drops leaves before the prefixes they hang from."""
        if self.capacity == 0:
            return
        with self._lock:
            added = []
            for rec in records:
                if rec.nbytes > self.capacity:
                    continue
                if getattr(rec.tokens, "base", None) is not None:  # a view keeps its whole prompt's ids
                    rec.tokens = rec.tokens.copy()  # alive, past what `nbytes` counts: its own ids only
                old = self._records.pop(rec.hash, None)
                if old is not None:
                    self.nbytes -= old.nbytes
                else:
                    added.append(rec)
                self._records[rec.hash] = rec
                self._children.setdefault(rec.parent, set()).add(rec.hash)
                self.nbytes += rec.nbytes
            dropped = self._shrink(self.capacity)
            self._tell([r for r in added if r.hash in self._records], dropped)

    def touch(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._records:
                    self._records.move_to_end(h)

    def discard(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            # gc hands over every record it evicted (half a million): look up only what is held.
            dropped = [self._drop(h) for h in (self._records.keys() & set(hashes) if self._records else ())]
            self._tell([], dropped)

    def trim_to(self, nbytes: int) -> None:
        with self._lock:
            self._tell([], self._shrink(max(0, nbytes)))

    def clear(self) -> None:
        self.trim_to(0)

    def gc(self, max_bytes: int, *, dry_run: bool = False) -> dict:
        """`Store.gc` of a store in RAM: its least recently used records down to `max_bytes`
        (with `dry_run`, what that would evict, evicting nothing), said as a disk gc says it."""
        with self._lock:
            before, going, freed = self.nbytes, [], 0
            for rec in self._records.values():  # least recently used first
                if before - freed <= max(0, max_bytes):
                    break
                going.append(rec)
                freed += rec.nbytes
            if not dry_run:
                self._tell([], [self._drop(r.hash) for r in going])
        return {"evicted": len(going), "freed_bytes": freed, "bytes_before": before, "bytes": before - freed,
                "dry_run": dry_run, "hashes": [r.hash for r in going]}

    def _shrink(self, limit: int) -> list[Record]:
        dropped = []
        while self.nbytes > limit and self._records:
            dropped.append(self._drop(next(iter(self._records))))
        return dropped

    def _drop(self, h: bytes) -> Record | None:
        rec = self._records.pop(h, None)
        if rec is None:
            return None
        self.nbytes -= rec.nbytes
        siblings = self._children.get(rec.parent)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[rec.parent]
        return rec

    def _tell(self, added: list[Record], dropped: list[Record | None]) -> None:
        """Tell the listeners (under the lock) what came in and what went."""
        dropped = [r for r in dropped if r is not None]
        if self.on_change and (added or dropped):
            for listener in self.on_change:
                listener(added, dropped)


class RecordSource:
    """A record held in RAM (memory tier or the writer's queue): copies, nothing to check."""

    in_ram = True  # the restore gathers small pieces of such records (restore._gather)

    def __init__(self, rec: Record):
        self.id, self.tokens, self.record = rec, rec.tokens, rec
        # What a record's arrays look like to the restore is worked out once and kept on it (its
        # arrays never change): a fetch of a long prompt opens hundreds of records.
        known = rec.read_view
        if known is None or known[0] is not rec.arrays:
            entries = shared_entries(
                {name: Entry("BF16" if name in rec.views or a.dtype == mx.bfloat16 else tag_of(a.dtype),
                             tuple(a.shape)) for name, a in rec.arrays.items()})
            known = rec.read_view = (rec.arrays, entries, {})
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


class MemoryTierView:
    """The memory tier (an LRU of records in RAM) as a tier."""

    name = "memory"
    in_process = True

    def __init__(self, memory: MemoryTier):
        self.memory = memory

    def find(self, lookup, ids):
        return {r.hash: None for r in ids if r.hash in self.memory}

    def children(self, lookup, parent, rest):
        return [(r.hash, r.tokens, r) for r in self.memory.children(parent) if lookup.sees(r.tenant)]

    def open(self, h, ref):
        rec = self.memory.get(h)
        if rec is None:
            raise KeyError(h)
        return RecordSource(rec)

    def damaged(self, h, error, ref=None):
        self.memory.discard([h])

    def touch(self, hashes):
        self.memory.touch(reversed(hashes))
