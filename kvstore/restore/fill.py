"""Filling the final arrays of a plan from the records' sources.

Each final array is allocated once (`alloc`), not zeroed (small ones are, which is cheaper),
with spare capacity after the restored tokens (zeroed) so the first decode step writes in place.
Sources that read in steps (the disk: `read_steps`) are read on pool threads, a `preadv` per step
straight into place, which lets go of the GIL, while this thread checks every step that landed
against its tensors' checksums (xxhash holds the GIL) and zeroes the spare when nothing waits:
one core copies while the other hashes what is still in the CPU's caches. What a step is (and any
decoding of landed bytes) is the source's; this loop only moves steps between the two threads.
Records held in RAM are copied, or gathered tensor by tensor when in small pieces. A record that
fails its check is reported, never used.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import mlx.core as mx
import numpy as np

from kvstore.errors import BlobError
from kvstore.restore.alloc import allocate, keep_buffers, zeroed
from kvstore.restore.arrays import host_array
from kvstore.restore.plan import Copy, Plan
from kvstore.restore.source import Source
from kvstore.storage.blobformat import nbytes
from kvstore.storage.readplan import Target, target

_POOL_MIN_BYTES = 4 << 20  # below this, threads cost more than they save
_READ_THREADS = 8  # reader threads when records come from a cold disk
_WARM_READERS = 1  # ... and from the page cache: one copies while this thread checks
# Landed steps are handed to the checking thread this many bytes at a time: each hand-off wakes it
# (a few µs of CPU each, 448 of them for 235 MB in 512 KiB steps), and 2 MiB is still in L3 when hashed.
_HANDOFF_BYTES = 2 << 20
_SMALL_COPY_BYTES = 64 << 10  # records in RAM copied in pieces smaller than this: on one thread
_pool: ThreadPoolExecutor | None = None


def fill(pl: Plan, sources: Sequence[Source]) -> tuple[dict[str, mx.array], list[tuple[int, BlobError]]]:
    """The final arrays of the plan, filled from `sources` (one per part) and the spare zeroed;
    and the (part, error) of every part that failed its checks (then the arrays must not be used
    past that part's start)."""
    keep_buffers(pl.nbytes)
    specs = {name: (e.tag, e.shape) for name, e in pl.finals.items()}
    finals = allocate(specs)
    views = {name: target(_host(a)) for name, a in finals.items()}
    spare = [] if zeroed(specs) else [name for name, view in views.items()
                                           if pl.filled[name] < view.array.shape[2]]
    jobs = pl.jobs
    keys = list(jobs)
    failed: dict[int, BlobError] = {}

    def zero_one(name: str) -> None:  # numpy lets go of the GIL while it fills
        views[name].array[:, :, pl.filled[name]:] = 0

    def zero() -> None:
        for name in spare:
            zero_one(name)

    def copy(ks: list[int]) -> None:
        for k in ks:
            try:
                sources[k].read_copies(jobs[k], views)
            except BlobError as e:
                failed[k] = e

    # Records in RAM copied in small pieces: gathered tensor by tensor, on this thread. Each copy
    # lets go of the GIL and takes it back, and two threads doing that fight over it (32k tokens
    # of head_dim 4: 63 ms on two threads, 41 ms on one, 30 ms gathered).
    copied = sum(nbytes(e) * pl.filled[name] // max(1, e.shape[2]) for name, e in pl.finals.items())
    in_ram = [k for k in keys if getattr(sources[k], "in_ram", False)]
    staged = [k for k in keys if hasattr(sources[k], "read_steps")] if pl.nbytes >= _POOL_MIN_BYTES else []
    rest = [k for k in keys if k not in set(staged)]
    gather = len(in_ram) == len(keys) and copied < _SMALL_COPY_BYTES * max(1, len(pl.copies))
    try:
        if staged:
            # The chain's last record is the least shared, so the first to leave the page cache:
            # it and the first are asked (one syscall each; asking all 128 of a 32k-token prompt
            # took 2.5 ms). A cold disk wants many reads in flight; the page cache one reader.
            cold = any(_cold(sources[k]) for k in {staged[-1], staged[0]})
            idle = [lambda: copy(rest)] + [lambda name=name: zero_one(name) for name in spare]
            _overlapped(sources, jobs, staged, views, failed, _READ_THREADS if cold else _WARM_READERS, idle)
        elif gather:
            zero()
            _gather(pl, sources, views)
        elif len(keys) > 1 and pl.nbytes >= _POOL_MIN_BYTES:  # numpy copies let go of the GIL
            pool = _threads()
            halves = [pool.submit(copy, keys[i::2]) for i in range(2)]
            zero()
            for f in halves:
                f.result()
        else:
            zero()
            copy(keys)
    finally:
        views.clear()  # the final arrays are their memory's only owners again (donatable, in place)
    return finals, sorted(failed.items())


def _overlapped(sources: Sequence[Source], jobs: Mapping[int, tuple[Copy, ...]], keys: list[int],
                views: Mapping[str, Target], failed: dict[int, BlobError], readers: int, idle: list) -> None:
    """Read the records `keys` on `readers` pool threads, step by step (a `preadv` each, which
    lets go of the GIL), and check every step on this thread as soon as it has landed, while its
    bytes are still in the CPU's caches: xxhash holds the GIL, so one thread checking while another
    copies is what keeps both cores busy. The small tasks `idle` run on this thread whenever no
    step is waiting to be checked (zeroing the spare, one tensor each: checks never fall behind).
    A record whose step fails is read no further; its error goes in `failed`."""
    landed: queue.SimpleQueue = queue.SimpleQueue()

    def read(group: list[int]) -> None:
        try:
            for k in group:
                src = sources[k]
                steps, nbytes = [], 0
                try:
                    for step in src.read_steps(jobs[k], views):
                        if k in failed:
                            break
                        src.read_step(step)
                        steps.append(step)
                        nbytes += step.nbytes
                        if nbytes >= _HANDOFF_BYTES:  # a wake-up of the checking thread per few steps
                            landed.put((k, steps))
                            steps, nbytes = [], 0
                    if steps:
                        landed.put((k, steps))
                except BlobError as e:
                    landed.put((k, e))
        finally:
            landed.put(None)

    pool = _threads()
    futures = [pool.submit(read, keys[i::readers]) for i in range(readers)]
    running = len(futures)
    todo = list(reversed(idle))
    try:
        while running:  # never return while a reader may still write into the arrays
            try:
                item = landed.get(block=not todo)
            except queue.Empty:
                todo.pop()()
                continue
            if item is None:
                running -= 1
                continue
            k, steps = item
            if k in failed:
                continue
            if isinstance(steps, BlobError):
                failed[k] = steps
                continue
            try:
                for step in steps:
                    sources[k].check_step(step)
            except BlobError as e:
                failed[k] = e
    finally:
        while running:  # an idle task raised: wait for the readers all the same
            running -= landed.get() is None
        for f in futures:
            f.result()
    while todo:
        todo.pop()()


def _gather(pl: Plan, sources: Sequence[Source], views: Mapping[str, Target]) -> None:
    """The copies of records held in RAM (nothing to check), tensor by tensor: one numpy call
    per run of copies that lie end to end in a final tensor, instead of one per copy."""
    for name, start, end, run in _runs(pl.copies):
        pieces = []
        for part, lo, hi in run:  # 7,168 of them at 32k tokens of a 28-layer model: no slice if whole
            a = sources[part].array(name)
            pieces.append(a if not lo and hi == a.shape[2] else a[:, :, lo:hi])
        np.concatenate(pieces, axis=2, out=views[name].array[:, :, start:end], casting="no")


def _runs(copies: list[Copy]) -> list[tuple[str, int, int, list[tuple[int, int, int]]]]:
    """`copies` as (tensor, first token, end, [(part, lo, hi)...]): runs that lie end to end in
    their final tensor. Worked out once per cached plan (its copies are the same list)."""
    hit = _RUNS.get(id(copies))
    if hit is not None and hit[0] is copies:
        return hit[1]
    by_name: dict[str, list[Copy]] = {}
    for c in copies:
        by_name.setdefault(c.name, []).append(c)
    out = []
    for name, cs in by_name.items():
        cs.sort(key=lambda c: c.dst)
        start = 0
        for i in range(1, len(cs) + 1):
            if i == len(cs) or cs[i].dst != cs[i - 1].dst + cs[i - 1].hi - cs[i - 1].lo:
                run = cs[start:i]
                out.append((name, run[0].dst, run[-1].dst + run[-1].hi - run[-1].lo,
                            [(c.part, c.lo, c.hi) for c in run]))
                start = i
    with _RUNS_LOCK:
        if len(_RUNS) >= _RUNS_MAX:
            _RUNS.clear()
        _RUNS[id(copies)] = (copies, out)  # the list is kept alive with it: its id stays its own
    return out


_RUNS: dict[int, tuple[list, list]] = {}
_RUNS_MAX = 256
_RUNS_LOCK = threading.Lock()


def _cold(source: Source) -> bool:
    cold = getattr(source, "cold", None)  # a tier's source that cannot say is taken as warm
    try:
        return bool(cold()) if cold is not None else False
    except Exception:
        return False




def host_slice(final: mx.array, lo: int, hi: int) -> np.ndarray:
    """Tokens [lo, hi) of a final array as a numpy view (bfloat16 as its uint16 bits)."""
    return _host(final)[:, :, lo:hi]


def _host(a: mx.array) -> np.ndarray:
    view = host_array(a)
    if not (view.flags.writeable and view.flags.c_contiguous):
        raise BlobError("mlx handed out an array numpy cannot write in place")
    return view


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        # A cold disk keeps 8 reads in flight (2k tokens of a Qwen3-0.6B cache: ~15% faster than
        # 2); the page cache one, RAM two (more only fight over the GIL).
        _pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="kvstore-read")
    return _pool

