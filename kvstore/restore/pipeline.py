"""The restore pipeline, one way down: plan, then fill the final arrays from the tiers, then build.

1. `plan` (pure: records' token ranges and tensor shapes, the codecs, the checkpoints there are)
   picks the restore point p that every layer can reach and says, for every tensor of every layer,
   which record supplies which of its tokens at which place of the final array.
2. `fill` allocates each final array once, unfilled (small ones zero-filled, which is cheaper),
   with spare capacity after the restored tokens (zeroed) so the first decode step writes in
   place, and has every record's `Source` copy its tokens straight into place (disk: `preadv`
   from the page cache, checksummed per tensor), on a small thread pool. Records held in RAM,
   in small pieces, are gathered tensor by tensor instead, one numpy call per final tensor. A
   record that fails its check is reported, never used.
3. `build` hands the arrays to the codecs, which make the mlx-lm cache objects.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from kvstore.errors import BlobError
from kvstore.restore.alloc import keep_buffers, unfilled, zero_filled
from kvstore.restore.arrays import host_array, mx_dtype
from kvstore.restore.codecs import Codec, sub
from kvstore.storage import blobfile
from kvstore.storage.blobformat import nbytes
from kvstore.tiers.base import Entry, Source

_POOL_MIN_BYTES = 4 << 20  # below this, threads cost more than they save
_READ_THREADS = 8  # reader threads when records come from a cold disk
_WARM_THREADS = 2  # ... and from RAM or the page cache
_SMALL_COPY_BYTES = 64 << 10  # records in RAM copied in pieces smaller than this: on one thread
_pool: ThreadPoolExecutor | None = None


class Part(NamedTuple):
    """A chunk or tail of the chain, as the plan sees it."""

    hash: bytes
    start: int  # position of its first token
    ntokens: int
    entries: Mapping[str, Entry]  # its tensors (no `tokens`): token axis 2, a suffix of its tokens


class Copy(NamedTuple):
    """Tokens [lo, hi) of tensor `name` of part `part` go to tokens [dst, dst + hi - lo) of the
    final tensor `name`."""

    part: int
    name: str
    lo: int
    hi: int
    dst: int


@dataclass
class Plan:
    p: int  # tokens restored
    parts: list[Part]  # the records used, in chain order
    finals: dict[str, Entry]  # every token-axis tensor of the cache, at its allocated capacity
    filled: dict[str, int]  # tokens of each final tensor the copies fill (the rest is spare)
    copies: list[Copy]
    checkpoint: bytes | None  # the checkpoint record restored at p, for checkpointed layers
    jobs: Mapping[int, tuple[Copy, ...]] = None  # the copies by part (one tuple per part: read
    # plans are cached by that tuple's identity, and a cached plan hands out the same tuples)

    def __post_init__(self) -> None:
        if self.jobs is None:
            jobs: dict[int, list[Copy]] = {}
            for c in self.copies:
                jobs.setdefault(c.part, []).append(c)
            self.jobs = {k: tuple(v) for k, v in jobs.items()}

    @property
    def nbytes(self) -> int:
        return sum(map(nbytes, self.finals.values()))


def restore_point(parts: Sequence[Part], codecs: Sequence[Codec], length: int,
                  checkpoints: Mapping[int, bytes]) -> tuple[int, bytes | None]:
    """The largest p <= length every layer can restore at (0 if none), and the checkpoint
    (from `checkpoints`: position -> record hash) that p needs, if any layer is checkpointed."""
    return _restore_point(_layout(parts, _leaves(codecs)), parts, codecs, length, checkpoints)


def plan(parts: Sequence[Part], codecs: Sequence[Codec], length: int,
         checkpoints: Mapping[int, bytes] | None = None) -> Plan | None:
    """What to copy where to restore the longest prefix (<= length) of the chain `parts`, or None.

    The plan depends on the parts' positions and tensor tables, not on which records they are:
    it is worked out once per (tables, length, checkpoint positions) and reused (a prompt seen
    again, or another of the same length), since at 32k tokens it is thousands of copies."""
    checkpoints = checkpoints or {}
    key = (tuple((q.start, q.ntokens, id(q.entries)) for q in parts), id(codecs), length, tuple(sorted(checkpoints)))
    with _PLANS_LOCK:
        hit = _PLANS.get(key)
        if hit is not None:
            _PLANS.move_to_end(key)
    if hit is not None and hit[1] is codecs and all(a is q.entries for a, q in zip(hit[0], parts)):
        shape = hit[2]
    else:
        shape = _plan(parts, codecs, length, checkpoints)
        with _PLANS_LOCK:  # the tables and codecs are kept alive with it: their ids stay theirs
            _PLANS[key] = ([q.entries for q in parts], codecs, shape)
            while len(_PLANS) > _PLANS_MAX:
                _PLANS.popitem(last=False)
    if shape is None:
        return None
    p, used, finals, filled, copies, jobs, checkpointed = shape
    return Plan(p, list(parts[:used]), finals, filled, copies, checkpoints.get(p) if checkpointed else None, jobs)


_PLANS: "OrderedDict[tuple, tuple]" = OrderedDict()
_PLANS_MAX = 256
_PLANS_LOCK = threading.Lock()


def _plan(parts: Sequence[Part], codecs: Sequence[Codec], length: int, checkpoints: Mapping[int, bytes]):
    """`plan`'s work, as (p, parts used, finals, filled, copies, copies by part, checkpointed) or None."""
    leaves = _leaves(codecs)
    layout = _layout(parts, leaves)
    p, checkpoint = _restore_point(layout, parts, codecs, length, checkpoints)
    if p <= 0:
        return None
    used = [q for q in parts if q.start < p]
    finals: dict[str, Entry] = {}
    filled: dict[str, int] = {}
    copies: list[Copy] = []
    for prefix, leaf in leaves:
        ranges = leaf.ranges(p)
        if not ranges:
            continue
        n = sum(b - a for a, b in ranges)
        cap = leaf.capacity(n)
        dst = 0
        for a, b in ranges:
            for k, start, end, held, names in layout[prefix]:
                if start >= p:
                    break
                first = end - held  # the delta is a suffix of the record
                lo, hi = max(a, first), min(b, end)
                if lo >= hi:
                    continue
                entries = parts[k].entries
                for name in names:
                    e = entries[name]
                    want = finals.get(name)
                    if want is None:
                        want = finals[name] = Entry(e.tag, (*e.shape[:2], cap, *e.shape[3:]))
                    elif want.tag != e.tag or want.shape[:2] != e.shape[:2] or want.shape[3:] != e.shape[3:]:
                        raise BlobError(f"record {parts[k].hash.hex()}: tensor {name!r} is {e.tag} "
                                        f"{list(e.shape)}, the chain's other records {want.tag} {list(want.shape)}")
                    copies.append(Copy(k, name, lo - first, hi - first, dst + lo - a))
                    filled[name] = filled.get(name, 0) + hi - lo
            dst += b - a
        for names in {tuple(names) for *_, names in layout[prefix]}:
            for name in names:
                if filled.get(name, n) != n:  # `valid` said covered: a record lied about its tensors
                    raise BlobError(f"tensor {name!r}: the chain fills {filled[name]} of its {n} tokens")
    pl = Plan(p, used, finals, filled, copies, checkpoint)
    return p, len(used), finals, filled, copies, pl.jobs, any(c.checkpointed for c in codecs)


def _leaves(codecs: Sequence[Codec]) -> list[tuple[str, Codec]]:
    """(name prefix, codec) of every cache of every layer (a CacheList's caches one by one)."""
    return [leaf for i, codec in enumerate(codecs) for leaf in codec.leaves(str(i))]


def _layout(parts: Sequence[Part], leaves: list[tuple[str, Codec]]) -> dict[str, list[tuple]]:
    """Per leaf prefix: (part index, start, end, tokens its tensors hold, their names) of every
    part holding tensors of that leaf, in chain order."""
    prefixes = tuple(prefix for prefix, _ in leaves)
    out: dict[str, list[tuple]] = {prefix: [] for prefix in prefixes}
    for k, q in enumerate(parts):
        end = q.start + q.ntokens
        for prefix, names in _groups(tuple(q.entries), prefixes).items():
            out[prefix].append((k, q.start, end, q.entries[names[0]].shape[2], names))
    return out


def _groups(names: tuple[str, ...], prefixes: tuple[str, ...]) -> dict[str, list[str]]:
    """The tensor names of a record grouped by the leaf they belong to (the longest leaf prefix
    of the name); the same for every record of one layout, so it is worked out once."""
    key = (names, prefixes)
    got = _GROUPS.get(key)
    if got is None:
        known = set(prefixes)
        got = {}
        for name in names:
            parts = name.split(".")
            for cut in range(len(parts) - 1, 0, -1):
                prefix = ".".join(parts[:cut])
                if prefix in known:
                    got.setdefault(prefix, []).append(name)
                    break
        if len(_GROUPS) > 256:
            _GROUPS.clear()
        _GROUPS[key] = got
    return got


_GROUPS: dict[tuple, dict[str, list[str]]] = {}


def _restore_point(layout: dict[str, list[tuple]], parts: Sequence[Part], codecs: Sequence[Codec],
                   length: int, checkpoints: Mapping[int, bytes]) -> tuple[int, bytes | None]:
    checkpointed = any(c.checkpointed for c in codecs)
    pieces = {prefix: [(start, end, held) for _, start, end, held, _ in rows] for prefix, rows in layout.items()}
    leaves = _leaves(codecs)
    ends = [q.start + q.ntokens for q in parts]
    for p in sorted({length} | {e for e in ends if 0 < e < length}, reverse=True):
        if p <= 0:
            break
        has = p in checkpoints
        if checkpointed and not has:
            continue
        if all(leaf.valid(p, pieces[prefix], has) for prefix, leaf in leaves):
            return p, checkpoints.get(p) if checkpointed else None
    return 0, None


def fill(pl: Plan, sources: Sequence[Source]) -> tuple[dict[str, mx.array], list[tuple[int, BlobError]]]:
    """The final arrays of the plan, filled from `sources` (one per part) and the spare zeroed;
    and the (part, error) of every part that failed its checks (then the arrays must not be used
    past that part's start)."""
    keep_buffers(pl.nbytes)
    specs = {name: (e.tag, e.shape) for name, e in pl.finals.items()}
    finals = unfilled(specs)
    views = {name: blobfile.target(_host(a)) for name, a in finals.items()}
    spare = [] if zero_filled(specs) else [name for name, view in views.items()
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
        zeroed = [pool.submit(zero, spare[i::2]) for i in range(2)]
        # From RAM or the page cache, more threads than cores only fight over the GIL; reads
        # that wait for a disk want many in flight. The chain's last record is the least shared,
        # so the first to leave the page cache: it and the first are asked (one syscall each;
        # asking all 128 records of a 32k-token prompt took 2.5 ms).
        n = _READ_THREADS if any(_cold(sources[k]) for k in {keys[-1], keys[0]}) else _WARM_THREADS
        groups = [keys[i::n] for i in range(n)]
        got = dict(zip((k for g in groups for k in g), (e for es in pool.map(runs, groups) for e in es)))
        results = [got[k] for k in keys]
        for f in zeroed:
            f.result()
    elif alone:
        zero(spare)
        _gather(pl, sources, views)
        results = [None] * len(keys)
    else:
        zero(spare)
        results = runs(keys)
    del views  # the final arrays are their memory's only owners again (donatable, in place)
    return finals, [(k, e) for k, e in zip(keys, results) if e is not None]


def _gather(pl: Plan, sources: Sequence[Source], views: Mapping[str, blobfile.Target]) -> None:
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
    with _PLANS_LOCK:
        if len(_RUNS) >= _PLANS_MAX:
            _RUNS.clear()
        _RUNS[id(copies)] = (copies, out)  # the list is kept alive with it: its id stays its own
    return out


_RUNS: dict[int, tuple[list, list]] = {}


def _cold(source: Source) -> bool:
    cold = getattr(source, "cold", None)  # a tier's source that cannot say is taken as warm
    try:
        return bool(cold()) if cold is not None else False
    except Exception:
        return False


def checkpoint_arrays(source: Source) -> dict[str, mx.array]:
    """Every tensor of a checkpoint record, checked, as mlx arrays of their real dtypes."""
    out = {}
    for name, e in source.entries.items():
        a = mx.array(source.array(name))
        dtype = mx_dtype(e.tag)
        out[name] = a.view(dtype) if a.dtype != dtype else a
    return out


def build(pl: Plan, codecs: Sequence[Codec], finals: Mapping[str, mx.array],
          checkpoint: Mapping[str, mx.array] | None) -> list:
    """The mlx-lm cache objects, one per layer, at position `pl.p`."""
    cache = [codec.build(pl.p, sub(dict(finals), str(i)),
                         sub(dict(checkpoint), str(i)) if checkpoint is not None else None)
             for i, codec in enumerate(codecs)]
    return cache


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
