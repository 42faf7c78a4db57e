"""Where records are read from: tiers, each a small object with the same five methods, asked in order.

- `find(lookup, ids)`: which of these records it holds -> {hash: ref} (a ref is whatever the tier
  needs to open the record again: its index row, its object key...);
- `children(lookup, parent, rest)`: the (hash, tokens, ref) of the records it holds under
  `parent` that may share tokens with `rest`, the tokens that follow it;
- `open(h, ref)`: a `Source` of that record, or BlobError if what it holds is damaged (KeyError
  if it holds it no more);
- `damaged(h, error, ref)`: told when a record it gave could not be used (the disk quarantines it);
- `touch(hashes)`: these records were used (LRU order, last-access times).

`Tiers` asks them in order: memory, pending writes, local disk, remote. A record is opened from
the first tier that holds it. A `Lookup` is one fetch as the tiers see it: its prompt, and the
time it started (a slow tier keeps to a deadline from there). A tier that is `in_process` holds
only records this process made from a model's own caches: they need no checking.

What `open` gives is a `restore.source.Source`: what the restore reads a record from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from kvstore.errors import BlobError
from kvstore.records import RecordId
from kvstore.restore.source import Source


@dataclass
class Lookup:
    """One fetch: the namespace, the prompt and its chunk hashes, and when the fetch started."""

    ns: bytes
    tokens: np.ndarray
    chunk_size: int
    chain: list[bytes] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    notes: set[str] = field(default_factory=set)  # what tiers noted of this fetch (to count once)
    #: (kind, ntokens) -> the most bytes such a record of this model can be (None: unbounded)
    object_bytes: Callable[[int, int], int] | None = None


class Tier(Protocol):
    name: str
    in_process: bool

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId]) -> dict[bytes, Any]: ...

    def children(self, lookup: Lookup | None, parent: bytes, rest: np.ndarray) -> list[tuple[bytes, np.ndarray, Any]]: ...

    def open(self, h: bytes, ref: Any) -> Source: ...

    def damaged(self, h: bytes, error: BlobError, ref: Any = None) -> None: ...

    def touch(self, hashes: list[bytes]) -> None: ...


Where = dict[bytes, tuple[Tier, Any]]  # record -> the tier that holds it, and the tier's ref


class Tiers:
    """The tiers of a store in lookup order."""

    def __init__(self, tiers: Sequence[Tier]):
        self.all = list(tiers)

    def __iter__(self):
        return iter(self.all)

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId], *, after: Tier | None = None,
             local: bool = False) -> Where:
        """Where each of `ids` can be read from: the first tier (in order; with `after`, of those
        after it; with `local`, of those on this machine) that holds it."""
        out: Where = {}
        tiers = self.all[self.all.index(after) + 1 :] if after is not None else self.all
        for tier in tiers:
            if local and getattr(tier, "shared", False):
                continue
            rest = [r for r in ids if r.hash not in out]
            if not rest:
                break
            for h, ref in tier.find(lookup, rest).items():
                out[h] = (tier, ref)
        return out

    def holds(self, ids: Sequence[RecordId]) -> set[bytes]:
        """Which of `ids` some tier on this machine holds (nothing remote is asked). A tier may
        answer this with a cheaper `holds(hashes)` of its own."""
        out: set[bytes] = set()
        for tier in self.all:
            if getattr(tier, "shared", False):
                continue
            rest = [r for r in ids if r.hash not in out]
            if not rest:
                break
            cheap = getattr(tier, "holds", None)
            out |= cheap([r.hash for r in rest]) if cheap is not None else set(tier.find(None, rest))
        return out

    def touch(self, hashes: list[bytes]) -> None:
        for tier in self.all:
            tier.touch(hashes)
