"""Where records are read from: tiers, each a small object with the same five methods, asked in order.

- `find(lookup, ids)`: which of these records it holds -> {hash: ref} (a ref is whatever the tier
  needs to open the record again: its index row, its object key...);
- `children(lookup, parent, rest)`: the (hash, tokens, ref) of the records it holds under
  `parent` that may share tokens with `rest`, the tokens that follow it;
- `open(h, ref)`: a `Source` of that record, or BlobError if what it holds is damaged (KeyError
  if it holds it no more);
- `damaged(h, error, ref)`: told when a record it gave could not be used (the disk quarantines it);
- `touch(hashes)`: these records were used (LRU order, last-access times).

The lookup (`model.lookup.Tiers`) asks them in order: memory, pending writes, local disk,
remote. A record is opened from the first tier that holds it. A `Lookup` is one fetch as the tiers see it: its prompt, and the
time it started (a slow tier keeps to a deadline from there). A tier that is `in_process` holds
only records this process made from a model's own caches: they need no checking.

What `open` gives is a `restore.source.Source`: what the restore reads a record from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from kvstore.errors import BlobError
from kvstore.records import RecordId, SizeBound
from kvstore.restore.source import Source
from kvstore.tenants import Tenant, sees


@dataclass
class Lookup:
    """One fetch: the namespace, the prompt and its chunk hashes, and when the fetch started.

    With a `tenant`, `chain` is the shared chunks found (the first `shared`), then the tenant's
    (`owner`: the tenant under the key they were found with, see `tenants.Tenant.previous`);
    a tier shows such a lookup shared records and the tenant's own, never another tenant's
    (`sees`)."""

    ns: bytes
    tokens: np.ndarray
    chunk_size: int
    chain: list[bytes] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    notes: set[str] = field(default_factory=set)  # what tiers noted of this fetch (to count once)
    #: (kind, ntokens) -> the most bytes such a record of this model can be (None: unbounded)
    object_bytes: "SizeBound | None" = None
    tenant: Tenant | None = None
    shared: int = 0
    owner: Tenant | None = None
    #: when the remote tier stops waiting for this fetch (`tiers.remote`: set by its policy)
    remote_until: float | None = None
    #: children of the chain's end the tiers of this machine hold: hash -> tokens it shares
    local_children: dict[bytes, int] = field(default_factory=dict)

    def depth_of(self, h: bytes) -> int:
        """The depth of a chunk of this lookup's chain (0 for its namespace)."""
        return 0 if h == self.ns else self.chain.index(h) + 1

    def start_of(self, r: RecordId) -> int:
        """Where record `r` of this lookup's chain starts in its prompt."""
        start = getattr(r, "start", None)
        return start if start is not None else (r.depth - 1) * self.chunk_size

    def tokens_of(self, r: RecordId) -> np.ndarray:
        """The tokens of record `r` of this lookup's chain."""
        return self.tokens[self.start_of(r) : self.start_of(r) + r.ntokens]

    def sees(self, tag: str | None) -> bool:
        """Whether a record of tenant `tag` (None: shared) may serve this lookup."""
        return sees(self.tenant, tag)

    def tags(self) -> list[str | None]:
        """The tenants whose records may serve this lookup (None: shared)."""
        return [None] + ([t.tag for t in self.tenant.variants()] if self.tenant is not None else [])

    def owner_of(self, tag: str | None) -> Tenant | None:
        """The tenant (under the key it was made with) whose tag is `tag`; None for shared."""
        if tag is None or self.tenant is None:
            return None
        return next((t for t in self.tenant.variants() if t.tag == tag), None)


class Tier(Protocol):
    name: str
    in_process: bool

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId]) -> dict[bytes, Any]: ...

    def children(self, lookup: Lookup | None, parent: bytes, rest: np.ndarray) -> list[tuple[bytes, np.ndarray, Any]]: ...

    def open(self, h: bytes, ref: Any) -> Source: ...

    def damaged(self, h: bytes, error: BlobError, ref: Any = None) -> None: ...

    def touch(self, hashes: list[bytes]) -> None: ...


Where = dict[bytes, tuple[Tier, Any]]  # record -> the tier that holds it, and the tier's ref
