"""The background writer: one daemon thread that turns queued inserts into blob files and rows.

The caller's thread only queues a `Job` (see `jobs.py`) and never waits on disk; this thread
writes each job (`batch.py`: files, then rows in one transaction, then memory-tier copies) and
then tidies what the job made redundant (`dedup.py`). The queue is bounded by bytes: a job that
does not fit is dropped and counted. Full disks and other write errors drop the job and are
counted; they never reach the caller.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from kvstore.errors import BlobError
from kvstore.records import CHECKPOINT, Span
from kvstore.storage import blobtree
from kvstore.storage.index import Index, Row
from kvstore.tiers.disk import DiskBudget, DiskTier
from kvstore.tiers.memory import MemoryTier, Record
from kvstore.trust import Trust
from kvstore.write import batch, dedup
from kvstore.write.admission import Gate
from kvstore.write.jobs import Destination, Job, WriterStats, from_memory

log = logging.getLogger("kvstore")

__all__ = ["Writer", "Job", "WriterStats"]

TOUCH_INTERVAL_S = 2.0
# The longest the writer waits for restores between two records (then it writes one anyway:
# a stream of restores never stops it).
YIELD_MAX_S = 0.25


class Writer:
    """One daemon thread per open store. `root=None` means RAM only: nothing is written."""

    def __init__(self, index: Index | None, root: Path | None, memory: MemoryTier,
                 max_pending_bytes: int, fsync: bool = True, gate: Gate | None = None,
                 disk: DiskTier | None = None, trust: Trust | None = None, exact: bool = False):
        self.index, self.root, self.memory = index, root, memory
        self.max_pending_bytes = max_pending_bytes
        # Told the rows of each batch once committed (still under the tree lock), on this thread:
        # the one event that leaves the writer. Subscribed once, where the store is built.
        self.on_commit: list[Callable[[list[Row]], None]] = []
        # Told, under the queue's lock (so in the order it happened), the records a job queued
        # (with their token ids) and, once it is done, the keys no longer queued.
        self.on_queue: list[Callable[[list[tuple[Span, np.ndarray]]], None]] = []
        self.on_unqueue: list[Callable[[list[bytes]], None]] = []
        self.access = disk.access if disk is not None else None  # its uses of records: written with the gate's counts
        self._dest = Destination(index, root, memory, fsync, gate=gate, between_records=self._let_reads_go,
                                 trust=trust, keep_prefixes=exact)
        if disk is not None:  # a record quarantined while its row was on its way: quarantined on disk once in
            self._dest.damaged = lambda h, why: disk.damaged(h, BlobError(why))
        self._reads = 0  # restores running now (`reading`): the writer waits for them between records
        self.gate = gate
        self.stats: WriterStats = self._dest.stats
        self._jobs: deque[Job] = deque()
        self._pending: dict[bytes, tuple[Job, Span]] = {}
        self._children: dict[bytes, set[bytes]] = {}  # parent -> queued records under it
        self._pending_bytes = 0
        self._queued = 0  # jobs queued since the store was opened (`Job.seq`)
        self._busy = False
        self._cond = threading.Condition()
        self._last_touch_flush = time.monotonic()
        self._said_touches = False  # that access times could not be written (said once)
        self._stop = False
        self._paused = threading.Event()
        self._paused.set()
        self._thread = threading.Thread(target=self._run, name="kvstore-writer", daemon=True)
        self._thread.start()

    def follow_budget(self, budget: DiskBudget) -> None:
        """The disk budget checks every commit; a record its gc evicted as soon as it was written
        is not written again for a while (`DiskBudget.wasted_lately`): left out, "evicted"."""
        self.on_commit.append(budget.check)
        self._dest.wasted = budget.wasted_lately

    def landing(self, wait: Callable[[list[bytes]], None]) -> None:
        """Before a job's records are checked against the index, `wait` for those being stored
        by another path (the remote tier's downloads), so that none is written twice."""
        self._dest.landing = wait

    # -- caller side ------------------------------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Queue a job; False (and counted) when the queue is full (a job alone in an empty queue
        fits, however large, unless the bound is 0: every insert is dropped), or closed (an insert
        that raced the store's close: no thread would write it)."""
        with self._cond:
            full = self._pending_bytes + job.nbytes > self.max_pending_bytes and (
                self._pending_bytes or not self.max_pending_bytes)
            if self._stop or full:
                self.stats.dropped_jobs += 1
                self.stats.dropped_bytes += job.nbytes
                if self.stats.dropped_jobs == 1:  # once: a busy server would say it at every insert
                    why = "the store was closing" if self._stop else (
                        f"the write queue holds {self._pending_bytes} of its max_pending_bytes={self.max_pending_bytes}")
                    log.warning("kvstore: an insert of %d bytes was dropped: %s; stats()['writer']['dropped_jobs'] "
                                "counts the drops", job.nbytes, why)
                return False
            self._queued += 1
            job.seq = self._queued
            self._jobs.append(job)
            for spec in job.specs:
                self._pending[spec.hash] = (job, spec)
                self._children.setdefault(spec.parent, set()).add(spec.hash)
            self._pending_bytes += job.nbytes
            for listener in self.on_queue if job.specs else ():
                listener([(s, job.tokens[s.start : s.end]) for s in job.specs])
            self._cond.notify_all()
            return True

    def write_held(self, hashes: list[bytes], prompt: np.ndarray, metadata: dict[str, str], *,
                   whole: bool = True) -> int:
        """Queue for writing, from the memory tier's copies, these records of `prompt` that the
        admission policy kept in RAM only (parents first): seen again, they may go to disk now.
        Never waits on disk; a record no longer in RAM, or queued already, is left out. How many
        were queued. (`whole`: see `Job.whole`.)"""
        C, ends, queued = int(metadata["chunk_size"]), {}, 0
        for h in hashes:
            rec = self.memory.peek(h)
            if rec is None:
                continue
            start = ends.get(rec.parent, rec.depth * C) if rec.kind == CHECKPOINT else (rec.depth - 1) * C
            ends[h] = start + rec.ntokens
            role = self.gate.role_of(h) if self.gate is not None else 0
            job = from_memory(rec, start, prompt, metadata, role=role, whole=whole)
            with self._cond:  # checked and queued at once: a fetch and this thread may both find it
                if h not in self._pending:
                    queued += self.submit(job)
        return queued

    def quarantine(self, h: bytes, why: str) -> None:
        """Record `h` restored wrong from what the writer's queue or RAM holds of it: no job
        queued now writes it (nor what hangs below it), and the queue no longer serves it. A job
        writing it at this moment quarantines its row on disk once committed."""
        with self._cond:
            self._dest.quarantine(h, self._queued, why)
            found = self._pending.get(h)
            if found is not None:
                self._unqueue(found[1])
                for listener in self.on_unqueue:
                    listener([h])
        self.memory.discard([h])  # (after the mark: a copy the writer put in RAM meanwhile goes too)

    def pending(self, h: bytes) -> Record | None:
        """The queued record `h` as views of its job (None if it is not queued)."""
        with self._cond:
            found = self._pending.get(h)
        return found[0].record(found[1]) if found else None

    def pending_children(self, parent: bytes) -> list[tuple[bytes, np.ndarray, str | None]]:
        """(hash, tokens, tenant tag) of the queued records under `parent`: what a lookup compares."""
        with self._cond:
            found = [self._pending[h] for h in self._children.get(parent, ())]
            return [(s.hash, j.tokens[s.start : s.end], s.tenant) for j, s in found]

    def known_complete(self, h: bytes) -> bool:
        """Whether a stored record is known to hold every layer's K/V (nothing to refill)."""
        return h in self._dest.complete

    def unwritten(self, hashes: set[bytes]) -> set[bytes]:
        """Of `hashes`, those a tier holds in RAM only because their write failed: to write again."""
        left = self._dest.left_out
        return {h for h in hashes if left.get(h) == "write_failed"} if left else set()

    def kept_out(self, h: bytes) -> str | None:
        """Why the writer left record `h` out lately, when no policy did ("under_evicted",
        "quarantined", "under_quarantined"), else None."""
        why = self._dest.left_out.get(h)
        return why if why in ("under_evicted", *batch.QUARANTINED) else None

    def is_pending(self, h: bytes) -> bool:
        """Whether `h` is queued and not written yet."""
        return h in self._pending

    @property
    def pending_bytes(self) -> int:
        """Bytes of the jobs queued now (bounded by `max_pending_bytes`)."""
        return self._pending_bytes

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
        """Flush, then stop the thread."""
        self.flush()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around a restore: while one runs, the writer waits between records (at most
        `YIELD_MAX_S` each time), so the restore has both cores and the memory bandwidth to itself.
        (A warm 2k-token restore took 62 ms beside a writer writing, 37 ms alone, here.)"""
        with self._cond:
            self._reads += 1
        try:
            yield
        finally:
            with self._cond:
                self._reads -= 1
                if not self._reads:
                    self._cond.notify_all()

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
                    due = bool(self.access) or (self.gate is not None and self.gate.dirty)
                    if due and time.monotonic() - self._last_touch_flush > TOUCH_INTERVAL_S:
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
            due = []
            try:
                due = self._write(job)
            except Exception as e:  # never let one bad job kill the thread
                self._count_error(e)
                batch.say_unstored(self._dest, job)
            finally:
                self._done(job, due)
            if time.monotonic() - self._last_touch_flush > TOUCH_INTERVAL_S:
                self._flush_touches()

    def _unqueue(self, spec: Span) -> None:
        """Record `spec` is no longer served from the queue (under `_cond`)."""
        del self._pending[spec.hash]
        siblings = self._children.get(spec.parent)
        if siblings is not None:
            siblings.discard(spec.hash)
            if not siblings:
                del self._children[spec.parent]

    def _done(self, job: Job, due: list[Span]) -> None:
        """Take a finished job off the queue: its records are no longer pending. Those of them
        to write from RAM now (`Gate.kept`) are queued before it counts as done (for `flush`)."""
        with self._cond:
            self._jobs.popleft()
            unqueued = []
            for spec in job.specs:
                if self._pending.get(spec.hash, (None,))[0] is job:
                    self._unqueue(spec)
                    unqueued.append(spec.hash)
            for listener in self.on_unqueue if unqueued else ():
                listener(unqueued)
            if due:
                try:
                    self.write_held([s.hash for s in due], job.tokens, job.metadata,
                                    whole=all(job.holds_all_layers(s) for s in due if s.kind != CHECKPOINT))
                except Exception as e:  # they stay in RAM; the next fetch of them tries again
                    self._count_error(e)
            self._pending_bytes -= job.nbytes
            self._busy = False
            self._cond.notify_all()

    def _let_reads_go(self) -> None:
        """Between two records: wait while a restore runs (`reading`), at most `YIELD_MAX_S`."""
        deadline = time.monotonic() + YIELD_MAX_S
        with self._cond:
            while self._reads and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def _write(self, job: Job) -> list[Span]:
        """Write `job`; the records of it to write again from RAM (see `batch.Batch.due`)."""
        self.stats.jobs += 1
        done = batch.write(self._dest, job, self._committed)
        if done.written and (done.rows or self.index is None):
            self._drop_redundant(job, [s for s in done.written if s.kind != CHECKPOINT and s.hash not in done.kept])
        if job.refill and self.index is not None:
            dedup.refill(self._dest, job, done.hosts)
        return done.due

    def _committed(self, rows: list[Row]) -> None:
        for listener in self.on_commit:
            listener(rows)

    def _drop_redundant(self, job: Job, written: list[Span]) -> None:
        # A method of its own so that a benchmark can switch dedup off to measure what it saves.
        dedup.drop_redundant(self._dest, job, written)

    def _flush_touches(self) -> None:
        """Write the access times, and what the gate counted and saw, to the index."""
        touches = self.access.take() if self.access is not None else {}
        with self._cond:
            self._last_touch_flush = time.monotonic()
        marks = self.gate is not None and self.gate.dirty
        if (touches or marks) and self.index is not None:
            # Under the shared tree lock, as every write of the index: while gc (which holds it
            # exclusively around its transactions) runs, this waits on the lock and wakes when gc
            # commits, instead of polling SQLite's lock with sleeps of up to 100 ms.
            lock = blobtree.tree_lock(self.root, exclusive=False) if self.root is not None else nullcontext()
            try:
                with lock:
                    if touches:
                        self.index.touch(touches)
                    if marks:
                        self.gate.save()
            except Exception as e:  # bookkeeping, no write of a record: said once, not counted as one
                if not self._said_touches:
                    self._said_touches = True
                    log.warning("kvstore: the index cannot record the last uses of records (%s: %s): no "
                                "record is lost, gc's order may be off until it can", type(e).__name__, e)

    def _count_error(self, e: BaseException) -> None:
        self._dest.count_error(e)
