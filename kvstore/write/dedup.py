"""Conversation dedup: after a job is written, drop the older tails a newer record holds, and
complete the stored records a sliding window lacked.

A multi-turn chat inserts each turn's whole history: without this, every turn would leave its
tail behind beside the longer one of the next turn. Rows go first in their own transaction, under
the exclusive tree lock as gc takes it, files after the commit.
"""

from __future__ import annotations

import os

from kvstore import keys
from kvstore.errors import BlobError
from kvstore.records import TAIL, Span
from kvstore.storage import blobfile, blobformat, blobtree, blobwrite
from kvstore.write import jobs
from kvstore.write.jobs import Destination, Hosts, Job


def drop_redundant(dest: Destination, job: Job, written: list[Span]) -> None:
    """Drop the older tails that a record just written makes redundant: under the same
    parent, their tokens a prefix of its tokens, and every layer's K/V for those tokens in
    it (a sliding window that slid past them does not count). A multi-turn chat then keeps
    one tail per branch instead of one per turn. The DELETE refuses a pinned record, one with
    children such as a checkpoint, and one whose newer record is gone. In exact mode nothing is
    dropped: a restore cannot end inside the newer tail, so the older one is the only restore of
    its prompt."""
    if dest.keep_prefixes:
        return
    pairs = [pair for spec in written if job.holds_all_layers(spec) for pair in _older_prefixes(dest, job, spec)]
    if not pairs:
        return
    if dest.index is None:  # RAM only
        gone = [h for h, _ in pairs]
        freed = sum(r.nbytes for r in map(dest.memory.get, gone) if r is not None)
    else:
        try:
            # Exclusive, as gc: no writer finds one of these rows and then loses its file.
            with blobtree.tree_lock(dest.root, exclusive=True):
                deleted = dest.index.drop_redundant(pairs)
                for h, _ in deleted:
                    blobtree.remove(dest.root, h)
        except Exception as e:  # only space is lost
            dest.count_error(e)
            return
        gone, freed = [h for h, _ in deleted], sum(size for _, size in deleted)
    dest.memory.discard(gone)
    dest.stats.redundant_dropped += len(gone)
    dest.stats.redundant_bytes += freed


def _older_prefixes(dest: Destination, job: Job, spec: Span) -> list[tuple[bytes, bytes]]:
    """(older tail, spec's hash) for every tail under the spec's parent whose tokens are a
    proper prefix of the spec's, in the memory tier or (unpinned) in the index."""
    newer = job.token_ids(spec)
    older = {r.hash: len(r.tokens) for r in dest.memory.children(spec.parent) if r.kind == TAIL}
    if dest.index is not None:
        older.update((r.hash, r.ntokens) for r in dest.index.children(spec.parent, int(newer[0]))
                     if r.kind == TAIL and not r.pinned)
    # A tail of n tokens under the same parent is a prefix of the newer record exactly when its
    # hash is that of the newer record's first n tokens (keys.tail_hash; a tenant's, of its link:
    # so only its own tails, never a shared one or another tenant's).
    return [(h, spec.hash) for h, n in older.items()
            if h != spec.hash and 0 < n < len(newer) and keys.tail_hash(spec.link or spec.parent, newer[:n]) == h]


def refill(dest: Destination, job: Job, hosts: Hosts) -> None:
    """Write again, complete, the stored records of `job.refill` whose blobs lack some
    layer's K/V (a chunk first stored from a cache whose sliding window had already slid
    past it). Same hash, same tokens: the new blob is renamed over the old one and its row
    gets the new size and checksum, both under the exclusive tree lock, so no writer, gc or
    damage check (`DiskTier.damaged` looks again under the shared lock) sees them disagree."""
    for spec in job.refill:
        if spec.hash in dest.complete or dest.quarantined_in(job, spec.hash) is not None:
            continue
        stored, kept = stored_lengths(dest, spec.hash), _extension_fields(dest, spec.hash)
        want = {name: a.shape[2] for name, a in job.slices(spec, hosts.arrays).items()}
        if stored is None or all(stored.get(name, 0) >= n for name, n in want.items()):
            dest.remember_complete(spec.hash)
            continue
        tokens, tensors, meta = hosts.parts(job, spec)
        meta.update(kept)  # its canary stays with it
        try:
            with blobtree.tree_lock(dest.root, exclusive=True):
                row = dest.index.get(spec.hash)
                if row is None or row.bad or row.ntokens != len(tokens):
                    continue  # evicted (or quarantined) meanwhile: nothing to complete
                size, checksum = blobwrite.write(dest.root, spec.hash, tensors, meta, fsync=dest.fsync,
                                                 trust=dest.trust)
                dest.index.replace_blob(spec.hash, size, checksum)
        except Exception as e:  # the old, shorter record stays; only reuse is lost
            dest.count_error(e)
            continue
        dest.stats.refilled += 1
        dest.stats.bytes_written += size
        if dest.gate is not None and dest.gate.budget is not None:
            try:
                dest.gate.budget.count(size)
            except Exception as e:  # only the count is lost
                dest.count_error(e)
        dest.remember_complete(spec.hash)
        dest.memory.discard([spec.hash])
        dest.memory.put([jobs.compact(job, spec, tokens, tensors)])


def stored_lengths(dest: Destination, h: bytes) -> dict[str, int] | None:
    """Tokens of K/V each array of a stored record holds (None if it cannot be told)."""
    rec = dest.memory.get(h)
    if rec is not None:
        return {name: a.shape[2] for name, a in rec.arrays.items() if a.ndim >= 3}
    path = blobtree.blob_path(dest.root, h)
    try:
        fd = blobfile.open_regular(path)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        header = blobformat.parse(blobformat.read_head(fd, size), path, size)[0]
    except (OSError, BlobError):
        return None
    finally:
        os.close(fd)
    return {name: e["shape"][2] for name, e in header.items() if name != "tokens" and len(e["shape"]) >= 3}


def _extension_fields(dest: Destination, h: bytes) -> dict[str, str]:
    """The header extension fields (`x-...`: a canary) of a stored record, as text."""
    rec = dest.memory.peek(h)
    if rec is not None and rec.extensions:
        return {blobformat.EXTENSION_PREFIX + k: v for k, v in rec.extensions.items()}
    path = blobtree.blob_path(dest.root, h)
    try:
        fd = blobfile.open_regular(path)
    except OSError:
        return {}
    try:
        size = os.fstat(fd).st_size
        meta = blobformat.parse(blobformat.read_head(fd, size), path, size)[2]
    except (OSError, BlobError):
        return {}
    finally:
        os.close(fd)
    return {k: v for k, v in meta.items() if k.startswith(blobformat.EXTENSION_PREFIX)}
