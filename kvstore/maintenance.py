"""Keeping a store within bounds (`collect`, behind `Store.gc`) and whole (`verify`).

Eviction is leaves first, least recently used first, so no remaining record loses its parent;
pinned records (and their ancestors, which are pinned with them) stay. Rows go in one
transaction, files only after it has committed.
"""

from __future__ import annotations

import heapq
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import blobs, faults
from .errors import BlobError
from .index import Index

_DELETE_BATCH = 500


def collect(index: Index, root: Path, *, max_bytes: int | None = None, max_age: float | None = None,
            dry_run: bool = False) -> dict:
    """Evict until the store holds at most `max_bytes` and nothing unused for `max_age` seconds."""
    started = time.perf_counter()
    total = index.totals()["bytes"]
    cutoff = time.time() - max_age if max_age is not None else None
    plan = _plan(index, total, max_bytes, cutoff)
    freed, evicted, hashes = 0, 0, []
    if dry_run:
        freed, evicted, hashes = sum(s for _, s in plan), len(plan), [h for h, _ in plan]
    else:
        for start in range(0, len(plan), _DELETE_BATCH):
            batch = [h for h, _ in plan[start : start + _DELETE_BATCH]]
            # Exclusive of writers: none can find a row here and then lose its file to us.
            with blobs.tree_lock(root, exclusive=True):
                deleted = index.delete_leaves(batch)
                if deleted:
                    faults.hit("gc_deleted")
                for row in deleted:  # after the commit: a crash before here leaves orphan files only
                    blobs.remove(root, row.hash)
            freed += sum(r.size for r in deleted)
            evicted += len(deleted)
            hashes += [r.hash for r in deleted]
    return {
        "evicted": evicted,
        "freed_bytes": freed,
        "bytes_before": total,
        "bytes": total - freed,
        "dry_run": dry_run,
        "seconds": time.perf_counter() - started,
        "hashes": hashes,
    }


def _plan(index: Index, total: int, max_bytes: int | None, cutoff: float | None) -> list[tuple[bytes, int]]:
    """Which records to evict, in order (every record before its parent)."""
    if (max_bytes is None or total <= max_bytes) and cutoff is None:
        return []
    rows = index.eviction_graph()
    children: dict[bytes, int] = {}
    info: dict[bytes, tuple[bytes, int, float, int]] = {}
    for h, parent, size, last, pinned in rows:
        info[h] = (parent, size, last, pinned)
        children[parent] = children.get(parent, 0) + 1
    heap = [(last, h) for h, (_, _, last, pinned) in info.items() if not pinned and h not in children]
    heapq.heapify(heap)
    plan: list[tuple[bytes, int]] = []
    while heap:
        last, h = heap[0]
        over = max_bytes is not None and total > max_bytes
        old = cutoff is not None and last < cutoff
        if not (over or old):
            break
        heapq.heappop(heap)
        parent, size, _, _ = info[h]
        plan.append((h, size))
        total -= size
        children[parent] -= 1
        if children[parent] == 0 and parent in info and not info[parent][3]:
            heapq.heappush(heap, (info[parent][2], parent))
    return plan


@dataclass(frozen=True)
class Problem:
    """One thing `verify` found wrong."""

    kind: str  # missing_blob, corrupt_blob, quarantined, orphan_row, orphan_file, temp_file, foreign_file
    path: str
    detail: str
    hash: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.path}: {self.detail}"

    def to_dict(self) -> dict:
        return asdict(self)


def verify(index: Index, root: Path, *, repair: bool = False) -> list[Problem]:
    """Check every row against its blob, the chain, and every file against the rows.

    The reading needs no lock. What looks wrong is looked at again holding the tree lock
    exclusively (no writer between its blob and its row, no gc between its row and its file), so
    work in flight in other processes is neither reported nor repaired away.
    """
    rows = list(index.rows())  # one snapshot: no read transaction stays open below
    known = {row.hash: row.parent for row in rows}
    suspects = []
    for row in rows:
        try:
            if not row.bad:
                blobs.read(root, row.hash, size=row.size, checksum=row.checksum)
                continue
        except BlobError:
            pass
        suspects.append(row)
    strays = [path for path in blobs.walk(root) if blobs.hash_of(path) not in known]
    with blobs.tree_lock(root, exclusive=True):
        problems: list[Problem] = []
        for row in suspects:
            problem = _confirm(index, root, row)
            if problem is not None:
                problems.append(problem)
        bad = {bytes.fromhex(p.hash) for p in problems}
        # Rows whose chain is broken (parent gone or bad) can never be reached: orphans.
        orphans = _unreachable(index, known, bad)
        for h in orphans:
            problems.append(Problem("orphan_row", str(blobs.blob_path(root, h)),
                                    "its parent record is missing or damaged", h.hex()))
        for path in strays:
            problem = _stray(index, path)
            if problem is not None:
                problems.append(problem)
        if repair and problems:
            _repair(index, root, problems, bad | orphans)
    return problems


def _confirm(index: Index, root: Path, row) -> Problem | None:
    """The problem of a row whose blob did not read, if it still has one now."""
    now = index.get(row.hash)
    path = blobs.blob_path(root, row.hash)
    if now is None:
        return None  # evicted since
    if now.bad:
        return Problem("quarantined", str(path), "record was quarantined after a failed read", row.hash.hex())
    try:
        blobs.read(root, now.hash, size=now.size, checksum=now.checksum)
        return None  # written again since
    except BlobError as e:
        kind = "missing_blob" if not os.path.lexists(path) else "corrupt_blob"
        return Problem(kind, str(path), str(e).split(": ", 1)[-1], row.hash.hex())


def _stray(index: Index, path: Path) -> Problem | None:
    """The problem of a file no row pointed to, if it still has one now."""
    if not os.path.lexists(path):
        return None  # renamed into place or deleted since
    h = blobs.hash_of(path)
    if path.name.startswith(blobs.TMP_PREFIX):
        if blobs.stale_temp(path, min_age_s=3600):
            return Problem("temp_file", str(path), "left by a writer that stopped")
        return None
    if h is not None:
        return None if index.get(h) is not None else Problem("orphan_file", str(path), "no index row points to it")
    return Problem("foreign_file", str(path), "not a kvstore blob")


def _unreachable(index: Index, known: dict[bytes, bytes], bad: set[bytes]) -> set[bytes]:
    """Good rows that no chain of good rows reaches from a namespace root."""
    namespaces = index.namespaces()
    ok: dict[bytes, bool] = {}

    def reachable(h: bytes) -> bool:
        trail = []
        while h not in ok:
            if h in bad:
                ok[h] = False
                break
            parent = known.get(h)
            if parent is None:
                ok[h] = h in namespaces
                break
            trail.append(h)
            h = parent
        result = ok[h]
        for t in trail:
            ok[t] = result
        return result

    return {h for h in known if h not in bad and not reachable(known[h])}


def _repair(index: Index, root: Path, problems: list[Problem], drop: set[bytes]) -> None:
    if drop:
        rows = index.delete(sorted(drop))
        for row in rows:
            blobs.remove(root, row.hash)
    for p in problems:
        if p.kind in ("orphan_file", "temp_file", "foreign_file"):
            try:
                os.unlink(p.path)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                pass
