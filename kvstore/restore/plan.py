"""The restore plan: a pure function of a chain's records and the model's codecs, no I/O.

`plan` picks the restore point p that every layer can reach (contiguous K/V for attention
layers; for a sliding window, the records covering the window; a checkpoint at exactly p for
recurrent layers) and says, for every tensor of every layer, which record supplies which of its
tokens at which place of the final array. It is the same for every prompt whose records have the
same positions and tensor tables, so it is worked out once and kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from kvstore.errors import BlobError
from kvstore.restore.codecs import Codec
from kvstore.storage.blobformat import Entry, nbytes


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

    def tokens_from(self, records: set[bytes]) -> int:
        """How many of the `p` tokens restored come from these records (the parts start at token
        0, in chain order: the last one may be used in part)."""
        n = start = 0
        for q in self.parts:
            if q.hash in records:
                n += max(0, min(self.p, start + q.ntokens) - start)
            start += q.ntokens
        return n



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

