"""The stored prompts `verify --exact` checks: read from the index and the blobs, never written.

A stored prompt is the chain of records from the root of a model's namespace to a leaf (a tail,
or a chunk nothing hangs from): the token ids of its records, in order, with where each record
ends and the canaries their headers keep (`kvstore.canary`). Every blob read is checked whole
(its size, checksums and header, `storage.blobfile.read_checked`); a damaged one ends the prompt
there, and so does a quarantined one (a restore stops before it). No mlx here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.canary import Canary
from kvstore.errors import BlobError
from kvstore.records import CHECKPOINT
from kvstore.storage import blobfile
from kvstore.storage.index import Index, Row
from kvstore.upkeep.anchors import Anchors
from kvstore.upkeep.verify import checked_record


@dataclass
class StoredPrompt:
    """One chain of records, root first: its token ids, the end of each record, each record's
    hash, and the canaries the records keep (their `at` positions are in these tokens)."""

    leaf: bytes
    tokens: np.ndarray
    ends: list[int]
    hashes: list[bytes] = field(default_factory=list)  # of the records that end at `ends`
    canaries: list[Canary] = field(default_factory=list)
    damaged: str = ""  # what ended the chain early (a record that did not read), if anything


def leaves(index: Index, ns: bytes, tenant: str | None = None, root: Path | None = None) -> list[Row]:
    """The records of namespace `ns` that end a chain: tails, and chunks with no chunk or tail
    under them (checkpoints hang from records). A chain with a quarantined record is one too, not
    its prefix before that record: `read_prompt` ends it there and says why. The shared prompts'
    (`tenant` None: what no shared record hangs from), or one tenant's (its tag). With the blob
    tree `root`, an end whose tokens start a sibling's is left out (`_within_a_sibling`)."""
    rows = [r for r in index.rows() if r.ns == ns and r.kind != CHECKPOINT and r.tenant in (None, tenant)]
    parents = {r.parent for r in rows if r.tenant == tenant}
    ends = [r for r in rows if r.tenant == tenant and r.hash not in parents]
    if root is not None:
        ends = _within_a_sibling(ends, root)
    return sorted(ends, key=lambda r: r.hash)


def _within_a_sibling(ends: list[Row], root: Path) -> list[Row]:
    """`ends` without those whose tokens start another end's under the same parent: the point
    where a prompt asked again resumes, stored beside it for a model that restores only at a
    checkpoint or a whole window (`ModelCache.resume_records`), or a prompt one token shorter
    than one stored after it. Each is part of that prompt, not a stored prompt of its own."""
    groups: dict[bytes, list[Row]] = {}
    for r in ends:
        groups.setdefault(r.parent, []).append(r)
    inside: set[bytes] = set()
    for group in (g for g in groups.values() if len(g) > 1):
        tokens = {}
        for r in group:
            try:  # (a blob that does not read is left to `read_prompt`, which says so)
                with blobfile.open_blob(root, r.hash, size=r.size, checksum=r.checksum) as blob:
                    tokens[r.hash] = np.asarray(blob.tokens())
            except BlobError:
                pass
        by_length: dict[int, dict[bytes, bytes]] = {}
        for h, t in tokens.items():
            by_length.setdefault(len(t), {})[t.tobytes()] = h
        for t in tokens.values():
            for n, starts in by_length.items():
                if n < len(t) and (h := starts.get(t[:n].tobytes())) is not None:
                    inside.add(h)
    return [r for r in ends if r.hash not in inside]


def sample(rows: list[Row], n: int | None, seed: int = 0) -> list[Row]:
    """`n` of `rows` (all when None or more), the same ones every time for the same store."""
    if n is None or n >= len(rows):
        return list(rows)
    return sorted(random.Random(seed).sample(rows, n), key=lambda r: r.hash)


def read_prompt(index: Index, root: Path, leaf: Row, chunk_size: int,
                anchors: Anchors | None = None) -> StoredPrompt:
    """The chain from the namespace's root to `leaf`, read and checked: each record whole, and
    (`anchors`: the disk tier's) its trust tag, which the restore checks too."""
    chain = [leaf]
    while chain[-1].parent != leaf.ns:
        parent = index.get(chain[-1].parent)
        if parent is None or len(chain) > 1 << 20:
            return StoredPrompt(leaf.hash, np.zeros(0, np.int32), [], damaged="its chain has a missing record")
        chain.append(parent)
    chain.reverse()
    tokens, ends, hashes, canaries = [], [], [], []
    for row in chain:
        if row.bad:  # (quarantined: a restore never uses it, so what follows it is not put to the test)
            return StoredPrompt(leaf.hash, _joined(tokens), ends, hashes, canaries,
                                damaged=f"record {row.hash.hex()} is quarantined (a restore never uses it; "
                                        "`kvstore verify --repair` drops it, storing the prompt again heals it)")
        try:
            _, _, stored = checked_record(root, row, chunk_size,  # (what `DiskTier` refuses to restore)
                                          trust=anchors.trust if anchors is not None else None,
                                          epoch=anchors.epoch if anchors is not None else 0.0)
            kept = stored.extensions.get("canary")
        except (BlobError, OSError) as e:
            return StoredPrompt(leaf.hash, _joined(tokens), ends, hashes, canaries,
                                damaged=f"record {row.hash.hex()} does not read: {e}")
        tokens.append(np.array(stored.tokens, dtype=np.int32))
        ends.append((ends[-1] if ends else 0) + len(stored.tokens))
        hashes.append(row.hash)
        if isinstance(kept, Canary):
            canaries.append(kept)
    return StoredPrompt(leaf.hash, _joined(tokens), ends, hashes, canaries)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)
