"""The memory tier: an LRU of decoded records, bounded by bytes, in front of the disk."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import mlx.core as mx
import numpy as np


@dataclass
class Record:
    """One chunk or tail with its arrays, as the memory tier and fetch see it.

    `arrays` holds what was stored (mlx arrays; a record still queued for the writer holds numpy
    views of the caller's arrays); a name in `views` is kept as raw bits (bfloat16 as uint16) and
    is that dtype when restored.
    """

    hash: bytes
    ns: bytes
    parent: bytes
    depth: int
    kind: int
    tokens: np.ndarray
    arrays: dict[str, mx.array | np.ndarray]
    views: dict[str, mx.Dtype] = field(default_factory=dict)
    nbytes: int = 0

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(a.nbytes for a in self.arrays.values()) + self.tokens.nbytes

    def depth_start(self, chunk_size: int) -> int:
        """The position of this record's first token."""
        return (self.depth - 1) * chunk_size


class MemoryTier:
    """A thread-safe LRU of `Record`s. `capacity=0` keeps nothing."""

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self._records: OrderedDict[bytes, Record] = OrderedDict()
        self._children: dict[bytes, set[bytes]] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0

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

    def kinds(self) -> dict[int, int]:
        """How many records of each kind (chunk, tail, checkpoint) are held."""
        with self._lock:
            counts: dict[int, int] = {}
            for rec in self._records.values():
                counts[rec.kind] = counts.get(rec.kind, 0) + 1
            return counts

    def children(self, parent: bytes) -> list[Record]:
        with self._lock:
            return [self._records[h] for h in self._children.get(parent, ())]

    def put(self, records: Iterable[Record]) -> None:
        """Add records. Give a chain deepest-first, so its ancestors end up most recent and a
        full tier drops leaves before the prefixes they hang from."""
        if self.capacity == 0:
            return
        with self._lock:
            for rec in records:
                if rec.nbytes > self.capacity:
                    continue
                old = self._records.pop(rec.hash, None)
                if old is not None:
                    self.nbytes -= old.nbytes
                self._records[rec.hash] = rec
                self._children.setdefault(rec.parent, set()).add(rec.hash)
                self.nbytes += rec.nbytes
            self._shrink(self.capacity)

    def touch(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            for h in hashes:
                if h in self._records:
                    self._records.move_to_end(h)

    def discard(self, hashes: Iterable[bytes]) -> None:
        with self._lock:
            for h in hashes:
                self._drop(h)

    def trim_to(self, nbytes: int) -> None:
        with self._lock:
            self._shrink(max(0, nbytes))

    def clear(self) -> None:
        self.trim_to(0)

    def _shrink(self, limit: int) -> None:
        while self.nbytes > limit and self._records:
            self._drop(next(iter(self._records)))

    def _drop(self, h: bytes) -> None:
        rec = self._records.pop(h, None)
        if rec is None:
            return
        self.nbytes -= rec.nbytes
        siblings = self._children.get(rec.parent)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[rec.parent]
