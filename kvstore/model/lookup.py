"""The lookup of one prompt: which stored records it can resume from, where each is held, and
opening them (checked) from the first tier that has them.

`match` hashes the prompt's chunk boundaries (`records.prompt_records`), asks the tiers in order
for the deepest run of stored chunks from the start (one query per tier for the whole chain),
then the children of the last one that share tokens with what follows. A later tier is asked for
children only while the earlier ones left the prompt uncovered. `Opening` opens the records of
one restore attempt, each once, and remembers which could not be used. `Tiers` holds the tiers
(`tiers.base.Tier`, from every layer below: the pending writes are the writer's) in that order.
"""

from __future__ import annotations

from typing import Callable, Container, Sequence

import numpy as np

from kvstore import keys
from kvstore.errors import BlobError
from kvstore.records import RecordId, Span, prompt_records
from kvstore.restore.plan import Part
from kvstore.storage import blobformat
from kvstore.tenants import Tenant
from kvstore.tiers.base import Lookup, Source, Tier, Where

Options = list[tuple[bytes | None, int]]  # (child, tokens it shares with the rest), best first


def match(tiers: Tiers, lookup: Lookup, ns: bytes, toks: np.ndarray, chunk_size: int,
          chain: list[Span] | None = None, *, local: bool = False) -> tuple[list[bytes], Options, Where]:
    """The stored full chunks of `toks` (deepest run from the start); the children of the last
    one that share tokens with what follows: (hash, tokens shared), best first, then every other
    child it matches whole (a checkpoint or a sliding window may be restorable at a shorter
    child's end where the longest match's is not); and where each one is held. With `local`,
    only the tiers of this machine are asked. `chain`: the prompt's shared chunks, if known.

    With the lookup's tenant, the shared chain is followed as far as it is stored, then the
    tenant's own (`records.prompt_records`): under its current key, or, if that holds none of
    it, under the keys it had before a rotation. `lookup.chain` is then that chain."""
    C = chunk_size
    if chain is None:
        chain = prompt_records(ns, toks, C, tail=False)
    where = tiers.find(lookup, chain, local=local)
    depth = _run(chain, where)
    found = chain[:depth]
    if lookup.tenant is not None:
        lookup.shared = depth
        own, owner = _tenant_chain(tiers, lookup, ns, toks, C, depth, where, local)
        lookup.chain, lookup.owner = [r.hash for r in chain[:depth] + own], owner
        found += own[: _run(own, where)]
    if found and len(toks) == len(found) * C:
        # The prompt ends on a chunk boundary, where a fetch cannot restore (it leaves the last
        # token): the last chunk is then one child of its parent, beside a tail that may end
        # at a checkpoint or sliding window the chunk's end-1 lacks.
        found = found[:-1]
    parent = found[-1].hash if found else ns
    rest = toks[len(found) * C :]
    kids: dict[bytes, tuple[bytes, int, bool]] = {}
    if len(rest):
        for tier in tiers:
            if local and getattr(tier, "shared", False):
                continue
            if any(n >= len(rest) - 1 for _, n, _ in kids.values()):
                break  # covered: nothing a later tier holds could restore more
            lookup.local_children = {h: n for h, n, _ in kids.values()}  # what a shared tier need not fetch
            for h, child_tokens, ref in tier.children(lookup, parent, rest):
                if len(child_tokens) == 0 or h in kids:
                    continue
                n = keys.common_prefix(child_tokens, rest)
                if n:
                    kids[h] = (h, n, n == len(child_tokens))
                    where.setdefault(h, (tier, ref))
    ranked = sorted(kids.values(), key=lambda f: (-f[1], not f[2]))  # a tie: the child used whole (no other touched)
    options = ranked[:1] + [f for f in ranked[1:] if f[2] or f[1] == ranked[0][1]]  # (a tie: each may restore)
    return [r.hash for r in found], [(h, n) for h, n, _ in options] or [(None, 0)], where


def cover(tiers: Tiers, lookup: Lookup, toks: np.ndarray, chunk_size: int) -> tuple[int, list[bytes]]:
    """How many leading tokens of `toks` the `tiers` of this machine hold K/V for (nothing remote
    is asked), and the records that hold them: the chain, then the child that goes furthest."""
    chain, options, _ = match(tiers, lookup, lookup.ns, toks, chunk_size, local=True)
    child, n = options[0] if options else (None, 0)
    return len(chain) * chunk_size + n, chain + ([child] if child is not None else [])


def _run(chain: Sequence[RecordId], where: Where) -> int:
    """How many records of `chain`, from its start, some tier holds."""
    depth = 0
    while depth < len(chain) and chain[depth].hash in where:
        depth += 1
    return depth


def _tenant_chain(tiers: Tiers, lookup: Lookup, ns: bytes, toks: np.ndarray, C: int, shared: int,
                  where: Where, local: bool) -> tuple[list[Span], Tenant]:
    """The tenant's chunks of `toks` after the `shared` ones, under the key that holds the most
    of them (the current one when none does), found in `where`; and the tenant under that key."""
    best: tuple[list[Span], Tenant, int] | None = None
    for owner in lookup.tenant.variants():
        own = prompt_records(ns, toks, C, tail=False, tenant=owner, shared=shared)[shared:]
        if not own:
            return [], lookup.tenant
        at = tiers.find(lookup, own, local=local)
        depth = _run(own, at)
        if best is None or depth > best[2]:
            where.update(at)
            best = (own, owner, depth)
        if depth == len(own):
            break
    return best[0], best[1]


class Opening:
    """The records one restore attempt opens: each once, from the first tier that holds it,
    checked (`check`) unless a tier of this process made it. Close it when done."""

    def __init__(self, tiers: Tiers, lookup: Lookup | None, where: Where, check: Callable[[Source], None]):
        self.tiers, self.lookup, self.where, self.check = tiers, lookup, where, check
        self.opened: dict[bytes, Source | None] = {}
        self.vanished: list[bytes] = []  # records every tier let go since the lookup saw them

    def path(self, hashes: list[bytes], chunk_size: int) -> tuple[list[Part], list[Source]]:
        """The records of `hashes` (a chain from its start) as plan parts and sources, up to the
        first one that is missing or damaged (the prefix ends there)."""
        by_tier: dict[object, list] = {}
        for h in hashes:
            if h not in self.opened and h in self.where:
                tier, ref = self.where[h]
                by_tier.setdefault(tier, []).append((h, ref))
        for tier, items in by_tier.items():  # readahead of every record at once, where a tier can
            prefetch = getattr(tier, "prefetch", None)
            if prefetch is not None and len(items) > 1:
                prefetch(items)
        parts, sources = [], []
        for i, h in enumerate(hashes):
            source = self.one(h, track=True)
            if source is None:
                break
            parts.append(Part(h, i * chunk_size, source.id.ntokens, source.entries))
            sources.append(source)
        return parts, sources

    def one(self, h: bytes, *, track: bool = False) -> Source | None:
        """A checked source of record `h` from the first tier that has it, or None (and, with
        `track`, `h` in `vanished` if the tiers the lookup saw it in all let it go since)."""
        if h in self.opened:
            return self.opened[h]
        found = self.where.get(h)
        source = None
        while found is not None and source is None:
            tier, ref = found
            try:
                source = tier.open(h, ref)
                if not tier.in_process:
                    self.check(source)
            except KeyError:  # gone from that tier since the lookup: ask the ones after it
                found = self._after(tier, h)
                if found is None and track:
                    self.vanished.append(h)
            except BlobError as e:
                if source is not None:
                    source.close()
                    source = None
                tier.damaged(h, e, ref)
                self.where.pop(h, None)
                found = None
                if track and not self.tiers.holds([_Named(h)]):
                    self.vanished.append(h)  # its file went with its row (gc, or a tail replaced): no damage
        self.opened[h] = source
        return source

    def damaged(self, h: bytes, error: BlobError) -> None:
        found = self.where.pop(h, None)
        if found is not None:
            found[0].damaged(h, error, found[1])

    def close(self) -> None:
        for source in self.opened.values():
            if source is not None:
                source.close()

    def _after(self, tier, h: bytes):
        """Where else on this machine `h` is held: a record a tier let go since the lookup (the
        writer's queue, once written) is in a tier after it."""
        self.where.pop(h, None)
        found = self.tiers.find(None, [_Named(h)], after=tier, local=True).get(h)
        if found is not None:
            self.where[h] = found
        return found


def kept_canary(source: Source) -> str | None:
    """The canary text an opened record keeps in its header (a blob's, or a RAM record's fields
    for its blob), unparsed (`canary.parse` reads it when a first step is compared with it);
    None when it keeps none."""
    blob = getattr(source, "blob", None)
    if blob is not None:
        text = blob.metadata.get(blobformat.EXTENSION_PREFIX + "canary")
    else:
        text = (getattr(getattr(source, "record", None), "extensions", None) or {}).get("canary")
    return text if isinstance(text, str) else None


class _Named:
    """A record known only by its key: the tiers of this machine look records up by key alone."""

    __slots__ = ("hash",)

    def __init__(self, h: bytes):
        self.hash = h


class Tiers:
    """The tiers of a store in lookup order."""

    def __init__(self, tiers: Sequence[Tier]):
        self.all = list(tiers)

    def __iter__(self):
        return iter(self.all)

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId], *, after: Tier | None = None,
             local: bool = False) -> Where:
        """Where each of `ids` can be read from: the first tier (in order; with `after`, of those
        after it; with `local`, of those on this machine) that holds it."""
        out: Where = {}
        tiers = self.all[self.all.index(after) + 1 :] if after is not None else self.all
        for tier in tiers:
            if local and getattr(tier, "shared", False):
                continue
            rest = [r for r in ids if r.hash not in out]
            if not rest:
                break
            for h, ref in tier.find(lookup, rest).items():
                out[h] = (tier, ref)
        return out

    def holds(self, ids: Sequence[RecordId]) -> set[bytes]:
        """Which of `ids` some tier on this machine holds (nothing remote is asked). A tier may
        answer this with a cheaper `holds(hashes)` of its own."""
        out: set[bytes] = set()
        for tier in self.all:
            if getattr(tier, "shared", False):
                continue
            rest = [r for r in ids if r.hash not in out]
            if not rest:
                break
            cheap = getattr(tier, "holds", None)
            out |= cheap([r.hash for r in rest]) if cheap is not None else set(tier.find(None, rest))
        return out

    def landing(self) -> Container[bytes]:
        """The records downloaded from the bucket that are on their way to the local disk."""
        return next((t.stored for t in self.all if t.name == "remote"), ())

    def touch(self, hashes: list[bytes]) -> None:
        for tier in self.all:
            tier.touch(hashes)
