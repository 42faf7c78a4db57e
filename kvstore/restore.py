"""The restore pipeline, one way down: plan, then fill the final arrays from the tiers, then build.

1. `plan` (pure: records' token ranges and tensor shapes, the codecs, the checkpoints there are)
   picks the restore point p that every layer can reach and says, for every tensor of every layer,
   which record supplies which of its tokens at which place of the final array.
2. `fill` allocates each final array once, unfilled, with spare capacity after the restored tokens
   (zeroed) so the first decode step writes in place, and has every record's `Source` copy its
   tokens straight into place (disk: `preadv` from the page cache, checksummed per tensor), on a
   small thread pool. A record that fails its check is reported, never used.
3. `build` hands the arrays to the codecs, which make the mlx-lm cache objects.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from . import blobs
from .codecs import Codec, sub
from .errors import BlobError
from .tiers import Entry, Source
from .unfilled import unfilled

_POOL_MIN_BYTES = 4 << 20  # below this, threads cost more than they save
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

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(e) for e in self.finals.values())


def restore_point(parts: Sequence[Part], codecs: Sequence[Codec], length: int,
                  checkpoints: Mapping[int, bytes]) -> tuple[int, bytes | None]:
    """The largest p <= length every layer can restore at (0 if none), and the checkpoint
    (from `checkpoints`: position -> record hash) that p needs, if any layer is checkpointed."""
    checkpointed = any(c.checkpointed for c in codecs)
    ends = [q.start + q.ntokens for q in parts]
    for p in sorted({length} | {e for e in ends if 0 < e < length}, reverse=True):
        if p <= 0:
            break
        has = p in checkpoints
        if checkpointed and not has:
            continue
        if all(codec.valid(p, _pieces(parts, str(i)), has) for i, codec in enumerate(codecs)):
            return p, checkpoints.get(p) if checkpointed else None
    return 0, None


def plan(parts: Sequence[Part], codecs: Sequence[Codec], length: int,
         checkpoints: Mapping[int, bytes] | None = None) -> Plan | None:
    """What to copy where to restore the longest prefix (<= length) of the chain `parts`, or None."""
    p, checkpoint = restore_point(parts, codecs, length, checkpoints or {})
    if p <= 0:
        return None
    used = [q for q in parts if q.start < p]
    finals: dict[str, Entry] = {}
    filled: dict[str, int] = {}
    copies: list[Copy] = []
    for i, codec in enumerate(codecs):
        for prefix, leaf in codec.leaves(str(i)):
            ranges = leaf.ranges(p)
            if not ranges:
                continue
            head = prefix + "."
            n = sum(b - a for a, b in ranges)
            cap = leaf.capacity(n)
            dst = 0
            for a, b in ranges:
                for k, q in enumerate(used):
                    names = [name for name in q.entries if name.startswith(head)]
                    if not names:
                        continue
                    end = q.start + q.ntokens
                    first = end - q.entries[names[0]].shape[2]  # the delta is a suffix of the record
                    lo, hi = max(a, first), min(b, end)
                    if lo >= hi:
                        continue
                    for name in names:
                        e = q.entries[name]
                        want = finals.setdefault(name, Entry(e.tag, (*e.shape[:2], cap, *e.shape[3:])))
                        if want.tag != e.tag or want.shape[:2] + want.shape[3:] != e.shape[:2] + e.shape[3:]:
                            raise BlobError(f"record {q.hash.hex()}: tensor {name!r} is {e.tag} {list(e.shape)}, "
                                            f"the chain's other records {want.tag} {list(want.shape)}")
                        copies.append(Copy(k, name, lo - first, hi - first, dst + lo - a))
                        filled[name] = filled.get(name, 0) + hi - lo
                dst += b - a
            for name in [nm for nm in finals if nm.startswith(head)]:
                if filled[name] != n:  # `valid` said covered: a record lied about its tensors
                    raise BlobError(f"tensor {name!r}: the chain fills {filled[name]} of its {n} tokens")
    return Plan(p, used, finals, filled, copies, checkpoint)


def fill(pl: Plan, sources: Sequence[Source]) -> tuple[dict[str, mx.array], list[tuple[int, BlobError]]]:
    """The final arrays of the plan, filled from `sources` (one per part) and the spare zeroed;
    and the (part, error) of every part that failed its checks (then the arrays must not be used
    past that part's start)."""
    finals = unfilled({name: (e.tag, e.shape) for name, e in pl.finals.items()})
    views = {name: _host(a) for name, a in finals.items()}
    for name, view in views.items():
        view[:, :, pl.filled[name]:] = 0
    jobs: dict[int, list[Copy]] = {}
    for c in pl.copies:
        jobs.setdefault(c.part, []).append(c)

    def run(k: int) -> BlobError | None:
        try:
            for c in jobs[k]:
                sources[k].read_tokens(c.name, c.lo, c.hi, views[c.name][:, :, c.dst : c.dst + c.hi - c.lo])
        except BlobError as e:
            return e
        return None

    if len(jobs) > 1 and pl.nbytes >= _POOL_MIN_BYTES:
        results = list(_threads().map(run, list(jobs)))
    else:
        results = [run(k) for k in jobs]
    del views  # the final arrays are their memory's only owners again (donatable, in place)
    return finals, [(k, e) for k, e in zip(jobs, results) if e is not None]


def checkpoint_arrays(source: Source) -> dict[str, mx.array]:
    """Every tensor of a checkpoint record, checked, as mlx arrays of their real dtypes."""
    out = {}
    for name, e in source.entries.items():
        a = mx.array(source.array(name))
        dtype = blobs.mx_dtype(e.tag)
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
    view = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    if not (view.flags.writeable and view.flags.c_contiguous):
        raise BlobError("mlx handed out an array numpy cannot write in place")
    return view


def _pieces(parts: Sequence[Part], prefix: str) -> list:
    return [(q.start, q.start + q.ntokens, sub(dict(q.entries), prefix)) for q in parts]


def _nbytes(e: Entry) -> int:
    n = blobs._DTYPES[e.tag][0].itemsize
    for d in e.shape:
        n *= d
    return n


def _threads() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(4, max(2, (os.cpu_count() or 2))),
                                   thread_name_prefix="kvstore-read")
    return _pool
