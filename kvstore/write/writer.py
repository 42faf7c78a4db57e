"""The background writer: turns queued inserts into blob files and index rows.

The caller's thread only queues a `Job` (views of its cache, no copy: numpy views of the memory of
its arrays, or lazy mlx views where a codec computes its deltas). This thread copies each new
record out of those views, writes its blob (temp file, fsync, rename), then inserts the rows
in one transaction, and hands compact copies to the memory tier (only of what it can keep: with
the memory tier off, nothing is copied for RAM). Full disks and other write errors
drop the job and are counted; they never reach the caller.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from kvstore import faults, keys
from kvstore.errors import BlobError
from kvstore.restore.arrays import tag_of
from kvstore.storage import blobformat, blobtree, blobwrite
from kvstore.storage.index import CHECKPOINT, CHUNK, TAIL, Index, Row
from kvstore.tiers.memory import MemoryTier, Record

log = logging.getLogger("kvstore")

TOUCH_INTERVAL_S = 2.0


@dataclass
class Spec:
    """One record a job will write: key, place in the chain, and token range in the job."""

    hash: bytes
    parent: bytes
    depth: int
    kind: int
    start: int
    end: int
    nbytes: int = 0


@dataclass
class Job:
    ns: bytes
    tokens: np.ndarray
    arrays: dict[str, np.ndarray | mx.array]  # "layer.name" -> view (numpy, or mlx scheduled), token axis 2
    origins: dict[str, int]  # "layer.name" -> the token its element 0 holds
    views: dict[str, mx.Dtype]  # names carried as raw bits (bfloat16 as uint16) -> real dtype
    specs: list[Spec]
    metadata: dict[str, str]
    checkpoint: dict[str, mx.array] = field(default_factory=dict)  # for the CHECKPOINT spec
    pin: list[bytes] = field(default_factory=list)
    nbytes: int = 0
    # Stored chunks and tails this job holds every layer's K/V for: a stored one that lacks some
    # (a sliding window had slid past them when it was written) is written again, complete.
    refill: list[Spec] = field(default_factory=list)

    def slices(self, spec: Spec, arrays: dict) -> dict:
        """The part of each array that falls in the spec's tokens (always a suffix of them)."""
        out = {}
        for name, a in arrays.items():
            origin = self.origins[name]
            lo = max(spec.start, origin)
            if lo < spec.end:
                out[name] = a[:, :, lo - origin : spec.end - origin]
        return out

    def record(self, spec: Spec) -> Record:
        """The record `spec` as zero-copy views of the queued arrays (visible before it is written)."""
        return Record(spec.hash, self.ns, spec.parent, spec.depth, spec.kind,
                      self.tokens[spec.start : spec.end],
                      dict(self.checkpoint) if spec.kind == CHECKPOINT else self.slices(spec, self.arrays),
                      dict(self.views), nbytes=spec.nbytes)


@dataclass
class WriterStats:
    jobs: int = 0
    records_written: int = 0
    bytes_written: int = 0
    dropped_jobs: int = 0
    dropped_bytes: int = 0
    write_errors: int = 0
    last_error: str = ""
    redundant_dropped: int = 0  # older tails dropped because a newer record holds their tokens
    redundant_bytes: int = 0
    refilled: int = 0  # stored records written again with the window data they lacked


class Writer:
    """One daemon thread per open store. `root=None` means RAM only: nothing is written."""

    def __init__(self, index: Index | None, root: Path | None, memory: MemoryTier,
                 max_pending_bytes: int, after_batch: Callable[[], None] | None = None,
                 fsync: bool = True, after_write: Callable[[list[Row]], None] | None = None):
        self.index, self.root, self.memory = index, root, memory
        self.max_pending_bytes = max_pending_bytes
        self.after_batch = after_batch
        self.after_write = after_write  # gets the rows of each committed batch (the remote uploader)
        self.fsync = fsync
        self.stats = WriterStats()
        self._jobs: deque[Job] = deque()
        self._pending: dict[bytes, tuple[Job, Spec]] = {}
        self._children: dict[bytes, set[bytes]] = {}  # parent -> queued records under it
        self._pending_bytes = 0
        self._busy = False
        self._cond = threading.Condition()
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._last_touch_flush = time.monotonic()
        self._stop = False
        self._complete: dict[bytes, None] = {}  # records known to hold every layer's K/V (bounded)
        self._paused = threading.Event()
        self._paused.set()
        self._thread = threading.Thread(target=self._run, name="kvstore-writer", daemon=True)
        self._thread.start()

    # -- caller side ------------------------------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Queue a job; False (and counted) when the queue is full."""
        with self._cond:
            if self._pending_bytes + job.nbytes > self.max_pending_bytes and self._pending_bytes:
                self.stats.dropped_jobs += 1
                self.stats.dropped_bytes += job.nbytes
                return False
            self._jobs.append(job)
            for spec in job.specs:
                self._pending[spec.hash] = (job, spec)
                self._children.setdefault(spec.parent, set()).add(spec.hash)
            self._pending_bytes += job.nbytes
            self._cond.notify_all()
            return True

    def pending(self, h: bytes) -> Record | None:
        with self._cond:
            found = self._pending.get(h)
        return found[0].record(found[1]) if found else None

    def pending_children(self, parent: bytes) -> list[tuple[bytes, np.ndarray]]:
        """(hash, tokens) of the queued records under `parent`: what a lookup compares."""
        with self._cond:
            found = [self._pending[h] for h in self._children.get(parent, ())]
            return [(s.hash, j.tokens[s.start : s.end]) for j, s in found]

    def known_complete(self, h: bytes) -> bool:
        """Whether a stored record is known to hold every layer's K/V (nothing to refill)."""
        return h in self._complete

    def is_pending(self, h: bytes) -> bool:
        return h in self._pending

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def touch(self, hashes: list[bytes]) -> None:
        now = time.time()
        with self._cond:
            for h in hashes:
                _, n = self._touches.get(h, (0.0, 0))
                self._touches[h] = (now, n + 1)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is durable (and access times are written)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._cond.notify_all()
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.5)
        self._flush_touches()
        return True

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # -- for tests: hold the writer before it starts the next job ---------------------------

    def pause(self) -> None:
        self._paused.clear()

    def resume(self) -> None:
        self._paused.set()

    # -- writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stop:
                    self._cond.wait(TOUCH_INTERVAL_S)
                    if self._touches and time.monotonic() - self._last_touch_flush > TOUCH_INTERVAL_S:
                        break
                if self._stop and not self._jobs:
                    return
                job = None
                if self._jobs:
                    self._busy = True
                    job = self._jobs[0]
            if job is None:
                self._flush_touches()
                continue
            self._paused.wait()
            try:
                self._write(job)
            except Exception as e:  # never let one bad job kill the thread
                self._count_error(e)
            finally:
                with self._cond:
                    self._jobs.popleft()
                    for spec in job.specs:
                        if self._pending.get(spec.hash, (None,))[0] is job:
                            del self._pending[spec.hash]
                            siblings = self._children.get(spec.parent)
                            if siblings is not None:
                                siblings.discard(spec.hash)
                                if not siblings:
                                    del self._children[spec.parent]
                    self._pending_bytes -= job.nbytes
                    self._busy = False
                    self._cond.notify_all()
            if time.monotonic() - self._last_touch_flush > TOUCH_INTERVAL_S:
                self._flush_touches()

    def _write(self, job: Job) -> None:
        self.stats.jobs += 1
        # Plain numpy views of the caller's arrays (already numpy, or mlx views insert scheduled:
        # numpy waits for those if they are not done yet): no mlx computation on this thread.
        tags = {name: "BF16" if name in job.views else tag_of(a.dtype)
                for name, a in {**job.arrays, **job.checkpoint}.items()}
        hosts = {name: np.asarray(a) for name, a in job.arrays.items()}
        checkpoint_hosts = {name: np.asarray(a) for name, a in job.checkpoint.items()}

        def record(spec: Spec) -> tuple[np.ndarray, dict[str, blobformat.Tensor], dict[str, str]]:
            tokens = np.ascontiguousarray(job.tokens[spec.start : spec.end], dtype="<i4")
            tensors: dict[str, blobformat.Tensor] = {"tokens": ("I32", tokens)}
            parts = checkpoint_hosts if spec.kind == CHECKPOINT else job.slices(spec, hosts)
            for name, arr in parts.items():
                tensors[name] = (tags[name], np.ascontiguousarray(arr))
            meta = dict(job.metadata, hash=spec.hash.hex(), parent=spec.parent.hex(),
                        depth=str(spec.depth), kind=str(spec.kind))
            return tokens, tensors, meta

        # The blobs this job will need are written to temporary files and fsynced first, holding
        # no lock (gc never touches a temporary file); under the lock only their renames and rows.
        staged: dict[bytes, blobwrite.Staged] = {}
        built: dict[bytes, tuple] = {}  # the records the memory tier keeps: copied once
        failed: tuple[bytes, OSError] | None = None
        if self.root is not None and self.index is not None and job.specs:
            for spec in self._still_needed(job):
                parts = record(spec)
                if self.memory.keeps(spec.nbytes):
                    built[spec.hash] = parts
                try:
                    staged[spec.hash] = blobwrite.stage(self.root, spec.hash, *parts[1:], fsync=self.fsync)
                except OSError as e:
                    failed = (spec.hash, e)  # later records hang from this one: stop there
                    break
        # Shared with other writers, exclusive of gc and repair: from "is it stored?" to the row.
        lock = blobtree.tree_lock(self.root, exclusive=False) if self.root is not None else nullcontext()
        with lock:
            todo = job.specs
            if self.index is not None and todo:
                todo = self._still_needed(job)
            rows: list[Row] = []
            compact: list[Record] = []
            written: list[Spec] = []
            for spec in todo:
                st = staged.pop(spec.hash, None)
                keep = self.memory.keeps(spec.nbytes)  # with memory_bytes=0 nothing is copied for RAM
                if spec.hash in built:
                    tokens, tensors, meta = built.pop(spec.hash)
                elif st is not None and not keep:  # its file is written: only its token ids are needed
                    tokens, tensors = np.ascontiguousarray(job.tokens[spec.start : spec.end], dtype="<i4"), {}
                else:
                    tokens, tensors, meta = record(spec)
                if self.root is not None:
                    try:
                        if failed is not None and failed[0] == spec.hash:
                            raise failed[1]
                        size, checksum = blobwrite.place(st) if st is not None else \
                            blobwrite.write(self.root, spec.hash, tensors, meta, fsync=self.fsync)
                    except OSError as e:
                        self._count_error(e)
                        break  # later records hang from this one; without it they are unreachable
                    faults.hit("after_rename")
                    rows.append(Row(spec.hash, job.ns, spec.parent, spec.depth, spec.kind,
                                    spec.end - spec.start, keys.first_token(tokens), size, checksum,
                                    pinned=int(spec.hash in job.pin)))
                    self.stats.bytes_written += size
                if keep:
                    compact.append(self._compact(job, spec, tokens, tensors))
                written.append(spec)
                if spec.kind != CHECKPOINT and all(o <= spec.start for o in job.origins.values()):
                    self._remember_complete(spec.hash)
            for st in staged.values():  # stored meanwhile by another writer, or after a failure
                blobwrite.discard(st)
            if rows and self.index is not None:
                try:
                    self.index.insert(rows)
                except Exception as e:
                    for row in rows:  # the rows are not there: the files are orphans now
                        blobtree.remove(self.root, row.hash)
                    self._count_error(e)
                    return
                self.stats.records_written += len(rows)
                if self.after_write is not None:
                    self.after_write(rows)
            if job.pin and self.index is not None:
                self.index.pin(job.pin)
        if compact:
            self.memory.put(reversed(compact))
        if written and (rows or self.index is None):
            self._drop_redundant(job, [s for s in written if s.kind != CHECKPOINT])
        if job.refill and self.index is not None:
            self._refill(job, hosts, tags)
        if self.after_batch is not None and rows:
            self.after_batch()

    def _drop_redundant(self, job: Job, written: list[Spec]) -> None:
        """Drop the older tails that a record just written makes redundant: under the same
        parent, their tokens a prefix of its tokens, and every layer's K/V for those tokens in
        it (a sliding window that slid past them does not count). A multi-turn chat then keeps
        one tail per branch instead of one per turn. Rows go first in their own transaction
        (the DELETE refuses a pinned record, one with children such as a checkpoint, and one
        whose newer record is gone), files after the commit, as gc does."""
        pairs: list[tuple[bytes, bytes]] = []
        for spec in written:
            if any(origin > spec.start for origin in job.origins.values()):
                continue  # this record lacks some layer's K/V for the first tokens
            newer = np.ascontiguousarray(job.tokens[spec.start : spec.end], dtype="<i4")
            older = {r.hash: len(r.tokens) for r in self.memory.children(spec.parent) if r.kind == TAIL}
            if self.index is not None:
                older.update((r.hash, r.ntokens) for r in self.index.children(spec.parent, int(newer[0]))
                             if r.kind == TAIL and not r.pinned)
            # A tail of n tokens under the same parent is a prefix of the newer record exactly
            # when its hash is that of the newer record's first n tokens (keys.tail_hash).
            pairs += [(h, spec.hash) for h, n in older.items()
                      if h != spec.hash and 0 < n < len(newer) and keys.tail_hash(spec.parent, newer[:n]) == h]
        if not pairs:
            return
        if self.index is None:  # RAM only
            gone = [h for h, _ in pairs]
            freed = sum(r.nbytes for r in map(self.memory.get, gone) if r is not None)
        else:
            try:
                # Exclusive, as gc: no writer finds one of these rows and then loses its file.
                with blobtree.tree_lock(self.root, exclusive=True):
                    deleted = self.index.drop_redundant(pairs)
                    for h, _ in deleted:
                        blobtree.remove(self.root, h)
            except Exception as e:  # only space is lost
                self._count_error(e)
                return
            gone, freed = [h for h, _ in deleted], sum(size for _, size in deleted)
        self.memory.discard(gone)
        self.stats.redundant_dropped += len(gone)
        self.stats.redundant_bytes += freed

    def _refill(self, job: Job, hosts: dict, tags: dict) -> None:
        """Write again, complete, the stored records of `job.refill` whose blobs lack some
        layer's K/V (a chunk first stored from a cache whose sliding window had already slid
        past it). Same hash, same tokens: the new blob is renamed over the old one and its row
        gets the new size and checksum, both under the exclusive tree lock, so no writer, gc or
        damage check (`DiskTier.damaged` looks again under the shared lock) sees them disagree."""
        for spec in job.refill:
            if spec.hash in self._complete:
                continue
            stored = self._stored_lengths(spec.hash)
            want = {name: a.shape[2] for name, a in job.slices(spec, hosts).items()}
            if stored is None or all(stored.get(name, 0) >= n for name, n in want.items()):
                self._remember_complete(spec.hash)
                continue
            tokens = np.ascontiguousarray(job.tokens[spec.start : spec.end], dtype="<i4")
            tensors: dict[str, blobformat.Tensor] = {"tokens": ("I32", tokens)}
            for name, arr in job.slices(spec, hosts).items():
                tensors[name] = (tags[name], np.ascontiguousarray(arr))
            meta = dict(job.metadata, hash=spec.hash.hex(), parent=spec.parent.hex(),
                        depth=str(spec.depth), kind=str(spec.kind))
            try:
                with blobtree.tree_lock(self.root, exclusive=True):
                    row = self.index.get(spec.hash)
                    if row is None or row.bad or row.ntokens != len(tokens):
                        continue  # evicted (or quarantined) meanwhile: nothing to complete
                    size, checksum = blobwrite.write(self.root, spec.hash, tensors, meta, fsync=self.fsync)
                    self.index.replace_blob(spec.hash, size, checksum)
            except Exception as e:  # the old, shorter record stays; only reuse is lost
                self._count_error(e)
                continue
            self.stats.refilled += 1
            self.stats.bytes_written += size
            self._remember_complete(spec.hash)
            self.memory.discard([spec.hash])
            self.memory.put([self._compact(job, spec, tokens, tensors)])

    def _stored_lengths(self, h: bytes) -> dict[str, int] | None:
        """Tokens of K/V each array of a stored record holds (None if it cannot be told)."""
        rec = self.memory.get(h)
        if rec is not None:
            return {name: a.shape[2] for name, a in rec.arrays.items() if a.ndim >= 3}
        path = blobtree.blob_path(self.root, h)
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                header, _ = blobformat.parse_header(head + f.read(min(n, 1 << 24)), path,
                                               size=os.fstat(f.fileno()).st_size)
        except (OSError, BlobError):
            return None
        return {name: e["shape"][2] for name, e in header.items() if name != "tokens" and len(e["shape"]) >= 3}

    def _remember_complete(self, h: bytes) -> None:
        self._complete[h] = None
        if len(self._complete) > 100_000:
            del self._complete[next(iter(self._complete))]

    def _still_needed(self, job: Job) -> list[Spec]:
        """The job's records that are not stored yet, parents first. If gc (in any process)
        evicted a record the job hangs from after `insert` looked, the chain is written again
        from the job's own tokens and arrays: no record is ever stored under a missing parent."""
        inside = {s.hash for s in job.specs}
        outside = {s.parent for s in job.specs if s.parent not in inside and s.parent != job.ns}
        present = self.index.present([s.hash for s in job.specs] + list(outside))
        specs = job.specs
        if outside - present:
            first = next((s for s in specs if s.kind != CHECKPOINT), None)
            if first is not None and first.parent != job.ns and first.parent not in present:
                C = int(job.metadata["chunk_size"])
                chain = keys.chain(job.ns, job.tokens[: (first.depth - 1) * C], C)
                ancestors = [Spec(h, chain[i - 1] if i else job.ns, i + 1, CHUNK, i * C, (i + 1) * C)
                             for i, h in enumerate(chain)]
                present |= self.index.present([a.hash for a in ancestors])
                specs = ancestors + specs
            have = present | {s.hash for s in specs}
            specs = [s for s in specs if s.parent == job.ns or s.parent in have]
        return [s for s in specs if s.hash not in present]

    @staticmethod
    def _compact(job: Job, spec: Spec, tokens: np.ndarray, tensors: dict[str, blobformat.Tensor]) -> Record:
        """A copy of the record that owns its memory (the caller's cache can then be freed)."""
        arrays, views = {}, {}
        for name, (tag, arr) in tensors.items():
            if name == "tokens":
                continue
            arrays[name] = mx.array(arr)
            if tag == "BF16":
                views[name] = mx.bfloat16
        return Record(spec.hash, job.ns, spec.parent, spec.depth, spec.kind, tokens, arrays, views)

    def _flush_touches(self) -> None:
        with self._cond:
            touches, self._touches = self._touches, {}
            self._last_touch_flush = time.monotonic()
        if touches and self.index is not None:
            # Under the shared tree lock, as every write of the index: while gc (which holds it
            # exclusively around its transactions) runs, this waits on the lock and wakes when gc
            # commits, instead of polling SQLite's lock with sleeps of up to 100 ms.
            lock = blobtree.tree_lock(self.root, exclusive=False) if self.root is not None else nullcontext()
            try:
                with lock:
                    self.index.touch(touches)
            except Exception as e:
                self._count_error(e)

    def _count_error(self, e: BaseException) -> None:
        self.stats.write_errors += 1
        self.stats.last_error = f"{type(e).__name__}: {e}"
        level = logging.WARNING if isinstance(e, OSError) and e.errno == errno.ENOSPC else logging.ERROR
        log.log(level, "kvstore: a write was dropped (%s)", self.stats.last_error)
