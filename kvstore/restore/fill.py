"""Filling the final arrays of a plan from the records' sources, on a small thread pool.

Each final array is allocated once (`alloc`), not zeroed (small ones are, which is cheaper),
with spare capacity after the restored tokens (zeroed) so the first decode step writes
in place; every record's `Source` copies its tokens straight into place (disk: `preadv` from the
page cache, checksummed per tensor). Records held in RAM, in small pieces, are gathered tensor by
tensor instead, one numpy call per final tensor. A record that fails its check is reported,
never used.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import mlx.core as mx
import numpy as np

from kvstore.errors import BlobError
from kvstore.restore import selfcheck
from kvstore.restore.alloc import allocate, keep_buffers, zeroed
from kvstore.restore.arrays import host_array
from kvstore.restore.plan import Copy, Plan
from kvstore.restore.source import Source
from kvstore.storage.blobformat import nbytes
from kvstore.storage.readplan import Target, target

_POOL_MIN_BYTES = 4 << 20  # below this, threads cost more than they save
_READ_THREADS = 8  # reader threads when records come from a cold disk
_WARM_THREADS = 2  # ... and from RAM or the page cache
_SMALL_COPY_BYTES = 64 << 10  # records in RAM copied in pieces smaller than this: on one thread
_pool: ThreadPoolExecutor | None = None


def fill(pl: Plan, sources: Sequence[Source]) -> tuple[dict[str, mx.array], list[tuple[int, BlobError]]]:
    """The final arrays of the plan, filled from `sources` (one per part) and the spare zeroed;
    and the (part, error) of every part that failed its checks (then the arrays must not be used
    past that part's start). The first restore of the process is checked (`selfcheck`); after a
    mismatch, restores fill memory of their own and hand it to mlx by copy."""
    keep_buffers(pl.nbytes)
    specs = {name: (e.tag, e.shape) for name, e in pl.finals.items()}
    if selfcheck.copying():
        return _fill(pl, sources, specs, copy=True)
    finals, errors = _fill(pl, sources, specs, copy=False)
    if not errors and selfcheck.due() and not selfcheck.check(pl, sources, finals):
        return _fill(pl, sources, specs, copy=True)  # this restore too
    return finals, errors


def _fill(pl: Plan, sources: Sequence[Source], specs: dict, *, copy: bool
          ) -> tuple[dict[str, mx.array], list[tuple[int, BlobError]]]:
    """`fill`, into mlx's arrays' own memory, or (`copy`) into numpy's, copied to mlx after."""
    host = selfcheck.allocate_host(specs) if copy else None
    finals = {} if copy else allocate(specs)
    views = {name: target(a) for name, a in host.items()} if copy else \
        {name: target(_host(a)) for name, a in finals.items()}
    spare = [] if not copy and zeroed(specs) else [name for name, view in views.items()
                                                       if pl.filled[name] < view.array.shape[2]]
    jobs = pl.jobs

    def run(k: int) -> BlobError | None:
        try:
            sources[k].read_copies(jobs[k], views)
        except BlobError as e:
            return e
        return None

    def zero(names: list[str]) -> None:  # numpy lets go of the GIL while it fills
        for name in names:
            views[name].array[:, :, pl.filled[name]:] = 0

    def runs(ks: list[int]) -> list[BlobError | None]:
        return [run(k) for k in ks]

    keys = list(jobs)
    # Records in RAM copied in small pieces: gathered tensor by tensor, on this thread. Each copy
    # lets go of the GIL and takes it back, and two threads doing that fight over it (32k tokens
    # of head_dim 4: 63 ms on two threads, 41 ms on one, 30 ms gathered; from 64 KiB a copy, two
    # threads copying record by record win).
    copied = sum(nbytes(e) * pl.filled[name] // max(1, e.shape[2]) for name, e in pl.finals.items())
    alone = (copied < _SMALL_COPY_BYTES * max(1, len(pl.copies))
             and all(getattr(sources[k], "in_ram", False) for k in keys))
    if len(jobs) > 1 and pl.nbytes >= _POOL_MIN_BYTES and not alone:
        pool = _threads()
        zeroing = [pool.submit(zero, spare[i::2]) for i in range(2)]
        # From RAM or the page cache, more threads than cores only fight over the GIL; reads
        # that wait for a disk want many in flight. The chain's last record is the least shared,
        # so the first to leave the page cache: it and the first are asked (one syscall each;
        # asking all 128 records of a 32k-token prompt took 2.5 ms).
        n = _READ_THREADS if any(_cold(sources[k]) for k in {keys[-1], keys[0]}) else _WARM_THREADS
        groups = [keys[i::n] for i in range(n)]
        got = dict(zip((k for g in groups for k in g), (e for es in pool.map(runs, groups) for e in es)))
        results = [got[k] for k in keys]
        for f in zeroing:
            f.result()
    elif alone:
        zero(spare)
        _gather(pl, sources, views)
        results = [None] * len(keys)
    else:
        zero(spare)
        results = runs(keys)
    views.clear()  # the final arrays are their memory's only owners again (donatable, in place)
    if copy:
        finals = selfcheck.to_mlx(host, specs)
    return finals, [(k, e) for k, e in zip(keys, results) if e is not None]


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
        # 2); from the page cache or RAM 2 are used (8 fight over the GIL: ~10% slower here).
        _pool = ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="kvstore-read")
    return _pool

