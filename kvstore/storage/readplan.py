"""Read plans: how the copies of one record's token ranges become `preadv` buffers and checks.

A plan depends only on a blob layout (its tensor table) and the copies and target shapes asked
for, so it is worked out once and kept on the layout. Reads go in file order, in batches small
enough that each tensor is hashed while its bytes are still in the CPU's caches; tokens read
only so that a whole tensor can be checked land in scratch memory.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

import numpy as np

from kvstore.errors import BlobError
from kvstore.storage.blobformat import DTYPES

if TYPE_CHECKING:
    from pathlib import Path

IOV_BATCH = 512  # buffers per preadv call (the kernel takes at most IOV_MAX = 1024)
JOIN_BELOW = 16 << 10  # buffers smaller than this are hashed joined: one call beats many
# A batch read in one preadv stops at this size, so that its tensors are hashed while still in
# the CPU's caches (a larger batch is read to memory, then read again from it to be hashed).
BATCH_BYTES = 256 << 10


class ReadPlan(NamedTuple):
    """How to read a set of copies from one layout into targets of given shapes: batches of
    (offset from the data start, bytes, buffers as (target index or -1 for scratch, start, end),
    checks as (tensor name, first buffer, end buffer, join small buffers before hashing)),
    the targets' names and the scratch bytes needed (tokens read only to be checked)."""

    batches: list[tuple[int, int, list[tuple[int, int, int]], list[tuple[str, int, int, bool]]]]
    names: list[str]
    scratch: int




class Target(NamedTuple):
    """Memory a read copies tensors into: a C-contiguous (B, H, capacity, ...) array, and the
    same memory as a flat byte view (cut into per-head buffers by arithmetic, not by numpy)."""

    array: np.ndarray
    flat: memoryview


def target(array: np.ndarray) -> Target:
    if not (array.flags.c_contiguous and array.flags.writeable):
        raise ValueError("a read target must be C-contiguous and writable")
    return Target(array, memoryview(array.reshape(-1).view(np.uint8)))



def read_plan(layout, copies: Sequence, targets: Mapping[str, Target], path: Path) -> ReadPlan:
    """The buffers (in file order) and checks of `copies`; BlobError if a copy does not fit."""
    todo = []
    for c in copies:
        info = layout.infos.get(c.name)
        if info is None:
            raise BlobError(f"{path}: no tensor {c.name!r}")
        tag, shape, start, end = info
        itemsize = DTYPES[tag].itemsize
        t = targets[c.name].array
        if (len(shape) < 3 or t.ndim != len(shape) or t.dtype.itemsize != itemsize
                or t.shape[:2] != shape[:2] or t.shape[3:] != shape[3:]
                or not 0 <= c.lo <= c.hi <= shape[2] or c.dst < 0 or c.dst + c.hi - c.lo > t.shape[2]):
            raise BlobError(f"{path}: tensor {c.name!r} {list(shape)} has no tokens [{c.lo}, {c.hi}) "
                            f"for a {list(t.shape)} array")
        todo.append((start, end, c, shape, itemsize, t.shape[2]))
    todo.sort(key=lambda x: x[0])
    names: dict[str, int] = {}
    batches: list = []
    buffers: list[tuple[int, int, int]] = []
    checks: list[tuple[str, int, int, bool]] = []
    scratch = 0
    batch_start = batch_end = -1
    for start, end, c, shape, itemsize, cap in todo:
        ti = names.setdefault(c.name, len(names))
        pieces, scratch = _pieces(shape, itemsize, c.lo, c.hi, ti, cap, c.dst, scratch)
        if start != batch_end or len(buffers) + len(pieces) > IOV_BATCH or end - batch_start > BATCH_BYTES:
            if buffers:
                batches.append((batch_start, batch_end - batch_start, buffers, checks))
            buffers, checks, batch_start = [], [], start
        small = len(pieces) > 1 and (end - start) < JOIN_BELOW * len(pieces)
        checks.append((c.name, len(buffers), len(buffers) + len(pieces), small))
        buffers += pieces
        batch_end = end
    if buffers:
        batches.append((batch_start, batch_end - batch_start, buffers, checks))
    return ReadPlan(batches, list(names), scratch)


def _pieces(shape: tuple[int, ...], itemsize: int, lo: int, hi: int, ti: int, cap: int, dst: int,
            scratch: int) -> tuple[list[tuple[int, int, int]], int]:
    """Buffers in file order for tokens [lo, hi) of a (B, H, T, ...) tensor going to tokens
    [dst, ...) of target `ti`, a flat (B, H, cap, ...) array; scratch (index -1, from byte
    `scratch` on) for the tokens around them. Heads whose tokens follow each other in the
    target (the whole capacity is read) become one buffer. Returns them and the scratch used."""
    row = itemsize * math.prod(shape[3:])
    T, heads = shape[2], shape[0] * shape[1]
    before, after, take = lo * row, (T - hi) * row, (hi - lo) * row
    out: list[tuple[int, int, int]] = []
    if not before and not after and dst == 0 and hi - lo == cap:  # the target is the tensor
        return ([(ti, 0, heads * take)] if take * heads else []), scratch
    for head in range(heads):
        if before:
            out.append((-1, scratch, scratch + before))
            scratch += before
        if take:
            at = (head * cap + dst) * row
            out.append((ti, at, at + take))
        if after:
            out.append((-1, scratch, scratch + after))
            scratch += after
    return out, scratch
