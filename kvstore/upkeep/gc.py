"""Keeping a store within bounds: `collect`, behind `LocalStore.gc` (and so `kvstore gc`).

Which records gc evicts is the leaf-by-leaf LRU rule (`evict` computes it for the whole store at
once, with retention by role); pinned records and their ancestors stay, except that `stale`
unpins the records of stale model versions first (no lookup can use them again). Their rows go in hash
order (neighbours in the table), in short transactions, each file right after the one that
dropped its row, and with them the edges out of the rows they drop (neighbours in the `children`
table too, whose key starts with the parent); then the few edges left, into records whose parent
stays, by key in the table's own order (see `evict` for why a parent may go first); last, the
records another process stored below what went while gc ran, which nothing reaches any more.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from pathlib import Path
from typing import Collection, Iterator

from kvstore import faults
from kvstore.errors import UnknownTenantError
from kvstore.storage import blobtree
from kvstore.storage.index import Index
from kvstore.upkeep import evict

# Rows per gc transaction: adapted to keep each one near _TX_TARGET_S (other processes' inserts
# wait for it), within these bounds.
_BATCH_START, _BATCH_MAX = 500, 20000
_TX_TARGET_S = 0.04
# gc checkpoints the WAL itself, holding no lock (none inside its commits, where writers would
# wait for it), this often: each checkpoint costs two fsyncs, and gc's transactions write about
# 800 pages in that time at 1M rows (1,600 in 0.5 s), so another process's commit does not find
# more than SQLite's 1,000-page autocheckpoint backlog (it would checkpoint it inside its own
# commit: inserts waited over 1 s).
_CHECKPOINT_EVERY_S = 0.25
_CACHE_MIN_KIB, _CACHE_MAX_KIB = 64 << 10, 1 << 20
# After each transaction gc waits this long, so that a writer waiting for the blob-tree lock
# (or in SQLite's busy handler) gets its turn before the next one.
_YIELD_S = 0.002
# Threads that unlink a transaction's files (sorted, in runs that share folders).
_UNLINK_THREADS, _UNLINKS_PER_TASK = 4, 256
# Records stored this long before gc read the clock count as stored while it ran (`lost_since`
# looks up the parent of each of them, so not more: a store warmed just before has many).
_CLOCK_SLACK_S = 1.0
# The last logged deletion (`Index.deletions_since`) whose file a gc made sure is gone.
_UNLINKED_TO = "gc.unlinked_to"


def collect(index: Index, root: Path, *, max_bytes: int | None = None, max_age: float | None = None,
            stale: bool = False, stale_namespaces: set[bytes] = frozenset(), dry_run: bool = False,
            tenant_max_bytes: int | None = None, drop_tenants: Collection[str] = ()) -> dict:
    """Evict every record of the tenants `drop_tenants` (tags), pinned ones too, then until every
    owner's tenants hold at most `tenant_max_bytes` together (`Index.tenant_owners`: a salted
    tenant shares its owner's quota), the store at most `max_bytes`,
    nothing unused for `max_age` seconds and, with `stale`, nothing of the model versions in
    `stale_namespaces` (which a budget evicts first, too). See `evict` for the order; rows go in
    transactions of a bounded number of rows, each record's file right after the commit that
    dropped its row."""
    started = time.perf_counter()
    since = time.time() - _CLOCK_SLACK_S  # records stored from here on may hang from a victim
    total = index.totals()["bytes"]
    cutoff = time.time() - max_age if max_age is not None else None
    p, planned_from = evict.Victims.empty(), 0  # (and the bytes of the records gc read to plan from)
    # `stale`: the pins of stale versions go first (no lookup can use them again), so that the
    # deletes, which keep whatever is pinned, take those records too.
    unpinned = (0, 0)
    if stale and stale_namespaces and not dry_run:
        unpinned = index.unpin_namespaces(stale_namespaces)
    totals = index.tenant_totals() if drop_tenants else {}
    unknown = [t for t in drop_tenants if t not in totals]
    if unknown:  # (a mistyped tag deletes nothing, and neither do the others given with it)
        raise UnknownTenantError(f"no record of tenant {', '.join(unknown)} in this store: nothing deleted")
    dropping = {t: totals[t] for t in drop_tenants}  # (records, bytes) of each before
    if drop_tenants and not dry_run:  # (a dry run plans them unpinned: `choose_victims`)
        index.unpin_tenants(drop_tenants)
    # Quarantined records are never served: any gc drops them (and what hangs below them).
    over = index.tenants_over(tenant_max_bytes) if tenant_max_bytes is not None else []
    if ((max_bytes is not None and total > max_bytes) or cutoff is not None or (stale and stale_namespaces)
            or over or any(n for n, _ in dropping.values()) or index.quarantined()[0]):
        graph = evict.Graph.from_index(index.eviction_graph(sorted(stale_namespaces), tenants=bool(over or dropping)))
        planned_from = int(graph.sizes.sum())
        p = evict.choose_victims(graph, max_bytes=max_bytes, cutoff=cutoff, stale=stale,
                                 tenant_max_bytes=tenant_max_bytes if over else None, drop_tenants=set(dropping),
                                 owners=index.tenant_owners() if over else None)
        if dry_run and stale:
            held = graph.pinned & graph.stale
            unpinned = (int(held.sum()), int(graph.sizes[held].sum()))
    planned = time.perf_counter() - started
    freed, hashes, longest, leftovers = 0, [], 0.0, 0
    if dry_run:
        freed, hashes = int(p.sizes.sum()) if len(p) else 0, list(p.hashes)
    else:
        freed, hashes, longest, leftovers = _delete(index, root, p, since)
    # Read again, not `total - freed`: other processes may have stored or deleted records while gc ran.
    after = total - freed if dry_run else index.totals()["bytes"]
    return {
        "evicted": len(hashes),
        "freed_bytes": freed,
        "bytes_before": total,
        "bytes": after,
        "dry_run": dry_run,
        "seconds": time.perf_counter() - started,
        "plan_seconds": planned,
        "longest_transaction_seconds": longest,
        "stale_pins": {"records": unpinned[0], "bytes": unpinned[1]},  # unpinned, then evicted
        "tenants_over": len(over),  # owners whose tenants held more than `tenant_max_bytes` together
        "tenants_dropped": {t: {"records": n, "bytes": b} for t, (n, b) in dropping.items()},  # what each held before
        "kept_bytes": _kept_bytes(total, planned_from, freed),
        "leftover_files": leftovers,  # files an earlier gc stopped before unlinking: unlinked now
        "hashes": hashes,
    }


def _delete(index: Index, root: Path, p: evict.Victims, since: float) -> tuple[int, list[bytes], float, int]:
    """Delete the victims `p`: (bytes freed, hashes deleted, the longest transaction's seconds,
    files a gc stopped before left and this one unlinked first)."""
    freed, hashes, longest = 0, [], 0.0
    if not len(p) and index.deletions_end() <= index.marks(_UNLINKED_TO).get(_UNLINKED_TO, 0):
        return freed, hashes, longest, 0  # (a budget's check that finds nothing to do reads no more)
    order = evict.in_key_order(p)
    edges: list[tuple[bytes, int, bytes]] = []
    # A page cache as big as the index (up to 1 GiB) while gc runs; files unlinked on threads
    # (the syscall releases the GIL, and unlinks in different folders run side by side).
    # The gc lock, shared: a `verify` waits for this gc to end (its second sweep below included).
    with blobtree.gc_lock(root, exclusive=False), \
            index.bulk(cache_kib=min(_CACHE_MAX_KIB, max(_CACHE_MIN_KIB, index.file_bytes() // 1024))), \
            index.victims(order, p.top_hashes), ThreadPoolExecutor(_UNLINK_THREADS, thread_name_prefix="kvstore-gc") as pool:
        leftovers = _unlink_leftovers(index, root, pool)
        # Sweep 1, in hash order: the rows and the edges out of them, and each record's file
        # right after its commit.
        for took, deleted in _batches(index, order, lambda part: _evict(index, root, part[0], part[-1], pool)):
            longest = max(longest, took)
            freed += sum(row[1] for row in deleted)
            hashes += [row[0] for row in deleted]
            edges += [(parent, first, h) for h, _, parent, first in deleted]
        # Sweep 2, in the order of the `children` table: the edges into the rows deleted whose
        # parent was not (at half of 1M rows, 577 of 500,094: gc mostly takes whole branches).
        gone = set(hashes)
        edges = [e for e in edges if e[0] not in gone]
        edges.sort(key=itemgetter(0))  # by parent: the table's pages in order (what follows is one page)
        for took, _ in _batches(index, edges, lambda part: _forget_edges(index, root, part)):
            longest = max(longest, took)
        # Records another process stored under a victim below a top while gc ran: their parent
        # is gone, so nothing reaches them (`Index.evict`). They go too, files and all.
        if hashes:
            lost = index.lost_since(since)
            if lost:
                t = time.perf_counter()
                deleted = _drop_lost(index, root, lost, pool)
                longest = max(longest, time.perf_counter() - t)
                freed += sum(row[1] for row in deleted)
                hashes += [row[0] for row in deleted]
    index.raise_mark(_UNLINKED_TO, index.deletions_end())
    return freed, hashes, longest, leftovers


def _unlink_leftovers(index: Index, root: Path, pool: ThreadPoolExecutor) -> int:
    """Unlink the files of records deleted since the last gc made sure of it whose rows are still
    gone, and drop the edges into them: what a gc stopped between a commit and its unlinks left,
    which no row counts. The deletion log says which (its last 100,000 entries). Returns how many
    files were there. (`_delete` marks the log's end done once its own deletions' files are gone.)"""
    done, end = index.marks(_UNLINKED_TO).get(_UNLINKED_TO, 0), index.deletions_end()
    logged: list[bytes] = []
    while done < end:
        part = index.deletions_since(done, limit=50_000)
        if not part:
            break
        logged += [h for _, h, _ in part]
        done = part[-1][0]
    found, gone = 0, []
    if logged:
        with blobtree.tree_lock(root, exclusive=True):  # no writer is between its file and its row
            stored = index.rows_of(logged)
            gone = sorted({h for h in logged if h not in stored})
            found = sum(os.path.lexists(blobtree.blob_path(root, h)) for h in gone)
            if found:
                _remove_files(root, [(h,) for h in gone], pool)
        if gone:  # and the edges into them that its second sweep did not reach (one scan of the table)
            index.forget_lost_edges()
    return found


def _kept_bytes(total: int, read: int, freed: int) -> dict[str, int]:
    """What a gc left, when it did not reach a budget: `records`, the bytes of the records it
    read and kept (pinned ones and their ancestors, or ones pinned or given a child since), and
    `unread`, the rest of what the totals count, which no record it could read holds (damaged
    rows: verify reports them, and its repair counts again)."""
    kept = max(0, read - freed)
    return {"records": kept, "unread": max(0, total - freed - kept)}


def _evict(index: Index, root: Path, lo: bytes, hi: bytes, pool: ThreadPoolExecutor) -> list[tuple]:
    # Exclusive of writers: none can find a row here and then lose its file to us.
    with blobtree.tree_lock(root, exclusive=True):
        deleted = index.evict(lo, hi)
        if deleted:
            faults.hit("gc_deleted")
        _remove_files(root, deleted, pool)  # after the commit: a crash before here leaves orphan files only
    return deleted


def _remove_files(root: Path, deleted: list[tuple], pool: ThreadPoolExecutor) -> None:
    """The files of the rows just deleted, on the pool's threads."""
    gone = [row[0] for row in deleted]  # in hash order, as the delete went: neighbours share folders
    step = max(_UNLINKS_PER_TASK, -(-len(gone) // _UNLINK_THREADS))
    list(pool.map(lambda i: blobtree.remove_all(root, gone[i : i + step]), range(0, len(gone), step)))


def _drop_lost(index: Index, root: Path, lost: list[bytes], pool: ThreadPoolExecutor) -> list[tuple]:
    with blobtree.tree_lock(root, exclusive=True):  # as `_evict`: files after the commit
        deleted = index.drop_lost(lost)
        _remove_files(root, deleted, pool)
    return deleted


def _forget_edges(index: Index, root: Path, edges: list[tuple[bytes, int, bytes]]) -> int:
    # Under the lock too: a writer then waits on it, and is woken the moment this commits,
    # instead of polling SQLite's lock with sleeps of up to 100 ms.
    with blobtree.tree_lock(root, exclusive=True):
        return index.forget_edges(edges)


def _batches(index: Index, items: list, step, start: int = _BATCH_START) -> Iterator[tuple[float, object]]:
    """Run `step` over `items` in consecutive batches, one transaction each, sized to take about
    `_TX_TARGET_S` (another process's insert waits that long at most); checkpoint every
    `_CHECKPOINT_EVERY_S` and at the end, holding no lock; pause for a writer to get its turn
    after each. Yields (seconds, result)."""
    done, batch, checkpointed = 0, start, time.perf_counter()
    while done < len(items):
        t = time.perf_counter()
        result = step(items[done : done + batch])
        took = time.perf_counter() - t  # waiting for the locks, the transaction, the files
        done += batch
        yield took, result
        # (growing by at most a quarter a batch: a batch that went fast once, between two pages
        # read from disk, grew the next one past the target, which another process then waited for)
        batch = max(1, min(_BATCH_MAX, int(batch * min(1.25, _TX_TARGET_S / max(took, 1e-4)))))
        if done >= len(items) or time.perf_counter() - checkpointed > _CHECKPOINT_EVERY_S:
            index.checkpoint()
            checkpointed = time.perf_counter()
        if done < len(items):
            time.sleep(_YIELD_S)
