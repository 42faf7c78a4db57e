"""The backend self-check: do mlx's arrays hold what the restore wrote into their memory?

The restore writes records straight into the memory of the final mlx arrays, through numpy views
of it (`restore.fill`). On mlx-cpu that memory is what mlx computes from; a backend where it is
not (an array whose data lives elsewhere, a view that is a copy) would restore garbage, and
nothing here can run Metal, where most users are. So the first restore of each process compares,
for every final array, the tokens one record supplied, read back through mlx (a copy computed by
mlx, after evaluation), with the bytes the record holds (read again from its source). On a
mismatch the process restores by copy from then on (`copying()`: numpy arrays of its own, filled,
then handed to mlx with `mx.array`, which copies them as mlx's own path does), says so once in the
log, and counts it (`state()`, in `Store.stats()["restore_check"]`).
"""

from __future__ import annotations

import logging
import threading
from typing import Mapping, Sequence

import mlx.core as mx
import numpy as np

from kvstore.errors import BlobError
from kvstore.restore.arrays import MX_DTYPES
from kvstore.restore.plan import Copy, Plan
from kvstore.restore.source import Source
from kvstore.storage.blobformat import DTYPES

log = logging.getLogger("kvstore")

_LOCK = threading.Lock()
_STATE = {"checked": False, "copying": False, "arrays_checked": 0, "mismatches": 0, "copy_restores": 0}


def state() -> dict:
    """What the self-check found in this process: `checked` (a restore was compared),
    `copying` (restores copy since a mismatch), the arrays compared, those that differed, and
    the restores done by copy."""
    with _LOCK:
        return dict(_STATE)


def copying() -> bool:
    """Whether restores in this process copy (the self-check found a mismatch)."""
    return _STATE["copying"]


def due() -> bool:
    """Whether the next restore is to be checked (the first of the process)."""
    return not _STATE["checked"]


def reset() -> None:
    """Forget what the check found (for tests: the next restore is checked again)."""
    with _LOCK:
        _STATE.update(checked=False, copying=False, arrays_checked=0, mismatches=0, copy_restores=0)


def check(pl: Plan, sources: Sequence[Source], finals: Mapping[str, mx.array]) -> bool:
    """Compare a sample of every final array with the bytes it was filled from (see the module
    docstring); False on a mismatch (then restores copy from now on, said once)."""
    sample = _one_copy_each(pl.copies)
    bad = []
    for name, c in sample.items():
        try:
            want = sources[c.part].array(name)[:, :, c.lo : c.hi]
        except BlobError:
            continue  # the record is damaged: the restore reports it, not this check
        if not _same_bits(_through_mlx(finals[name], c.dst, c.dst + c.hi - c.lo), want):
            bad.append(name)
    with _LOCK:
        first = not _STATE["copying"] and bool(bad)
        _STATE["checked"] = True
        _STATE["arrays_checked"] += len(sample)
        _STATE["mismatches"] += len(bad)
        if bad:
            _STATE["copying"] = True
    if first:
        log.warning("kvstore: the restore's self-check found %d of %d arrays that do not hold what was "
                    "written into their memory (%s...): this process restores by copy from now on "
                    "(slower, exact). Please report this machine and mlx version.",
                    len(bad), len(sample), bad[0])
    return not bad


def _one_copy_each(copies: Sequence[Copy]) -> dict[str, Copy]:
    """One copy per final array: the last one (the chain's least shared record)."""
    out: dict[str, Copy] = {}
    for c in copies:
        if c.hi > c.lo:
            out[c.name] = c
    return out


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two arrays hold the same bytes. Compared by value, K/V holding NaN (a float16
    model that overflowed, token ids past the embedding) would never equal themselves, and the
    process would be told its backend loses the restore's writes."""
    if got.shape != want.shape or got.dtype.itemsize != want.dtype.itemsize:
        return False
    return np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


def _through_mlx(final: mx.array, lo: int, hi: int) -> np.ndarray:
    """Tokens [lo, hi) of a final array as mlx itself reads them: a copy computed by mlx,
    evaluated, then its bytes (bfloat16 as its uint16 bits)."""
    part = mx.contiguous(final[:, :, lo:hi])
    if part.dtype == mx.bfloat16:
        part = part.view(mx.uint16)
    mx.eval(part)
    return np.array(part, copy=True)


def allocate_host(specs: Mapping[str, tuple[str, Sequence[int]]]) -> dict[str, np.ndarray]:
    """The copying restore's arrays: numpy memory of its own for each final array."""
    return {name: np.empty([int(d) for d in shape], dtype=DTYPES[tag]) for name, (tag, shape) in specs.items()}


def to_mlx(host: Mapping[str, np.ndarray], specs: Mapping[str, tuple[str, Sequence[int]]]) -> dict[str, mx.array]:
    """The copying restore's filled arrays handed to mlx, copied by mlx (bfloat16 from its bits)."""
    out = {}
    for name, a in host.items():
        arr = mx.array(a)
        dtype = MX_DTYPES[specs[name][0]]
        out[name] = arr.view(dtype) if arr.dtype != dtype else arr
    mx.eval(list(out.values()))
    with _LOCK:
        _STATE["copy_restores"] += 1
    return out
