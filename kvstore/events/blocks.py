"""Records as routers see them: blocks of `block_size` tokens, with ids, and what is announced.

A chunk of C tokens is announced as its C / B blocks of B tokens; a tail as its full blocks (the
rest of it, under B tokens, is not announced). A block's id is the key a record ending where the
block ends would have: `xxh3_128(parent record's key || every token of the record up to the
block's end)` (so a block ending a chunk has the chunk's own key), mixed with the record's tenant
tag when it has one, and as vLLM sends them: the digest's last 8 bytes as a big-endian integer.
So an id follows from the tokens before the block (through the parent's key) and its own, never
from the record that holds it: a tail's blocks and the chunk that later covers the same tokens
have the same ids, and a router sees no churn when one replaces the other.

`Holdings` is what has been announced, per medium: each record's block ids, and how many held
records hold each block, so that a block is announced stored when its first holder comes and
removed when its last one goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvstore import keys

TENANT_SALT = b"\x00kvstore-tenant\x00"


def tenant_bytes(tenant: Any) -> bytes | None:
    """A tenant tag as bytes (None: the shared namespace)."""
    if tenant is None:
        return None
    return tenant if isinstance(tenant, bytes) else str(tenant).encode()


def block_id(key: bytes, tenant: Any = None) -> int:
    """The id routers get for the block that ends where the record with key `key` ends."""
    tag = tenant_bytes(tenant)
    digest = key if tag is None else xxhash.xxh3_128_digest(key + TENANT_SALT + tag)
    return int.from_bytes(digest[-8:], "big")


def block_ids(parent: bytes, tokens: np.ndarray, block_size: int, tenant: Any = None) -> list[int]:
    """The ids of the full blocks of a record under `parent` that holds `tokens`."""
    raw = keys.token_bytes(tokens)
    step = block_size * 4
    h = xxhash.xxh3_128(parent)
    out = []
    for start in range(0, (len(raw) // step) * step, step):
        h.update(raw[start : start + step])
        out.append(block_id(h.digest(), tenant))
    return out


@dataclass
class Announced:
    """A record announced in one medium: its block ids and its tenant tag."""

    ids: tuple[int, ...]
    tenant: Any = None


@dataclass
class Holdings:
    """What one medium holds, as announced: records and how many of them hold each block."""

    records: dict[bytes, Announced] = field(default_factory=dict)
    holders: dict[int, int] = field(default_factory=dict)

    def add(self, h: bytes, ids: list[int], tenant: Any = None) -> list[bool]:
        """Record `h` now holds `ids`: for each id, whether it is newly held. Nothing if `h` was
        held already."""
        if h in self.records:
            return [False] * len(ids)
        self.records[h] = Announced(tuple(ids), tenant)
        fresh = []
        for i in ids:
            n = self.holders.get(i, 0)
            self.holders[i] = n + 1
            fresh.append(n == 0)
        return fresh

    def drop(self, h: bytes) -> list[int]:
        """Record `h` is gone: the ids no record holds any more."""
        rec = self.records.pop(h, None)
        if rec is None:
            return []
        gone = []
        for i in rec.ids:
            n = self.holders.get(i, 0) - 1
            if n > 0:
                self.holders[i] = n
            else:
                self.holders.pop(i, None)
                gone.append(i)
        return gone

    def clear(self) -> None:
        self.records.clear()
        self.holders.clear()
