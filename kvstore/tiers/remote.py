"""The remote tier: the records every node shares through a bucket, as the last tier of the lookup.

It is asked only for what the tiers before it lack. `find` binary-searches the prompt's chain
with HEADs for the deepest chunk the bucket holds (chunks are uploaded parents first and deleted
children first, so presence along a chain is a prefix), and downloads the checkpoints asked for;
`children` lists a chunk's children that start with the next token. `open` downloads a record
(`prefetch` starts the downloads of a whole path at once), checks it (intact, and the record
it is fetched as: `remote.objects.check_record`) and writes it through to the local disk tier,
then opens it from there: the next fetch finds it locally. A record that fails its check is a
miss, counted, and never stored.

All of it keeps to one deadline per fetch, from the `Lookup`'s start: past it, what is local is
served. Nothing here raises into the caller but BlobError and KeyError (the tier protocol's);
other failures are counted and leave the remote alone for a while (`Health`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Iterable, Sequence

import numpy as np
import xxhash

from kvstore import keys
from kvstore.errors import BlobError
from kvstore.records import CHECKPOINT, TAIL, RecordId
from kvstore.remote.bucket import Bucket, RemoteError
from kvstore.remote.health import Health
from kvstore.remote.layout import ObjectKey, children_prefix, key_of, parse_key
from kvstore.remote.objects import check_record
from kvstore.storage.index import Row
from kvstore.tiers.base import Lookup
from kvstore.tiers.disk import DiskTier

log = logging.getLogger("kvstore")

#: Default deadline of the remote part of one fetch, in seconds.
DEFAULT_DEADLINE_S = 1.0
MAX_CANDIDATES = 4  # children of the deepest chunk downloaded to compare their tokens
#: A record whose object failed its check is not asked for again for this long.
BAD_FOR_S = 300.0
_BAD_MAX = 4096


class _Late(Exception):
    """The deadline of the remote part of a fetch has passed."""


class _Ref:
    """A record the bucket holds, as this tier found it: its identity, key, and its bytes once
    downloaded (checked ones only in `checked`)."""

    __slots__ = ("rid", "key", "lookup", "future", "body", "tokens")

    def __init__(self, rid: RecordId, key: str, lookup: Lookup, body: bytes | None = None,
                 tokens: np.ndarray | None = None):
        self.rid, self.key, self.lookup = rid, key, lookup
        self.future: Future | None = None
        self.body, self.tokens = body, tokens


class RemoteTier:
    name = "remote"
    in_process = False
    shared = True  # not on this machine: `Tiers.holds` never asks it

    def __init__(self, bucket: Bucket, health: Health, disk: DiskTier, *, deadline: float = DEFAULT_DEADLINE_S,
                 threads: int = 8):
        self.bucket, self.health, self.disk = bucket, health, disk
        self.deadline = float(deadline)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-remote-get")
        self._bad: OrderedDict[bytes, float] = OrderedDict()  # record -> until when it is not asked for

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the tier protocol ----------------------------------------------------------------------

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId]) -> dict[bytes, _Ref]:
        if lookup is None or not ids or not self._usable(lookup):
            return {}
        end = lookup.started + self.deadline
        records = [r for r in ids if r.kind != CHECKPOINT]
        bad = next((i for i, r in enumerate(records) if self._known_bad(r.hash)), None)
        records = records[:bad]  # a chain ends at a damaged record
        found: dict[bytes, _Ref] = {}
        try:
            if records:
                self.health.count("lookups")
                depth = self.deepest([key_of(r) for r in records], 0, end)
                found.update((r.hash, _Ref(r, key_of(r), lookup)) for r in records[:depth])
            checkpoints = [_Ref(r, key_of(r), lookup) for r in ids
                           if r.kind == CHECKPOINT and not self._known_bad(r.hash)]
            for ref in self._download(checkpoints, end):
                found[ref.rid.hash] = ref
        except _Late:  # the lookup itself was too slow: leave the remote alone for a while
            self._failed(lookup, None)
        except RemoteError as e:
            self._failed(lookup, e)
        return found

    def children(self, lookup: Lookup | None, parent: bytes, rest: np.ndarray) -> list[tuple[bytes, np.ndarray, _Ref]]:
        if lookup is None or len(rest) <= 1 or not self._usable(lookup):
            return []
        if parent != lookup.ns and parent not in lookup.chain:
            return []
        end = lookup.started + self.deadline
        depth = _depth_of(lookup, parent) + 1
        try:
            listed = self._call(self.bucket.list, children_prefix(lookup.ns, parent, int(rest[0])), end=end)
            self.health.count("lists")
            keys_ = [k for k in (parse_key(p, s, t) for p, s, t in listed)
                     if k is not None and k.parent == parent and k.ns == lookup.ns and not self._known_bad(k.hash)]
            exact, others = _best_children(keys_, parent, rest)
            out = []
            if exact is not None:  # its key proves its tokens: rest[:n]
                out.append((exact.hash, rest[: exact.ntokens], _Ref(_placed(exact, depth), exact.path, lookup)))
            refs = [_Ref(_placed(k, depth), k.path, lookup) for k in others]
            for ref in self._download(refs, end):
                out.append((ref.rid.hash, ref.tokens, ref))
            return out
        except _Late:
            self._failed(lookup, None)
        except RemoteError as e:
            self._failed(lookup, e)
        return []

    def prefetch(self, items: Iterable[tuple[bytes, _Ref]]) -> None:
        """Start downloading these (record, ref)s now, all at once (`open` then waits for each)."""
        self._start(ref for _, ref in items)

    def _start(self, refs: Iterable[_Ref]) -> None:
        for ref in refs:
            if ref.body is None and ref.future is None:
                ref.future = self._pool.submit(self.bucket.get, ref.key)

    def open(self, h: bytes, ref: _Ref | None):
        """The record, downloaded, checked, written through to the local disk and opened there.
        KeyError if it cannot be had in time (or is gone); BlobError if it is not what it claims."""
        if ref is None:
            raise KeyError(h)
        if ref.body is None:
            ref.body = self._fetch(ref)
            if ref.body is None:
                raise KeyError(h)
        if ref.tokens is None:
            ref.tokens = check_record(ref.body, ref.rid, ref.lookup.chunk_size)
        r = ref.rid
        row = Row(r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, len(ref.body),
                  xxhash.xxh3_64_intdigest(ref.body))
        try:
            self.disk.put(row, ref.body)
        except OSError as e:  # a full disk: the record stays a miss here
            self.health.error(e)
            raise KeyError(h) from None
        if "remote" not in ref.lookup.notes:
            ref.lookup.notes.add("remote")
            self.health.count("remote_hits")
        self.health.count("remote_tokens", r.ntokens)
        ref.body = None  # on disk now: hold no copy
        return self.disk.open(h, row)

    def damaged(self, h: bytes, error: BlobError, ref: _Ref | None = None) -> None:
        """An object that failed its check: counted, and not asked for again for a while."""
        self.health.count("corrupt_objects")
        log.warning("kvstore: a remote object is damaged, not used: %s", error)
        self._bad[h] = time.monotonic() + BAD_FOR_S
        self._bad.move_to_end(h)
        while len(self._bad) > _BAD_MAX:
            self._bad.popitem(last=False)

    def _known_bad(self, h: bytes) -> bool:
        until = self._bad.get(h)
        if until is not None and until < time.monotonic():
            self._bad.pop(h, None)
            return False
        return until is not None

    def touch(self, hashes: list[bytes]) -> None:
        pass

    # -- requests under the deadline ------------------------------------------------------------

    def deepest(self, chunk_keys: list[str], known: int, end: float) -> int:
        """How many of these chunk keys of a chain the bucket holds (`known` of them are known to
        be there). The deepest is probed first (a repeated prompt), then a binary search of HEADs
        finds the end (7 requests for 128 chunks)."""
        lo, hi = known, len(chunk_keys)
        if hi > lo:
            if self._head(chunk_keys[hi - 1], end):
                return hi
            hi -= 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._head(chunk_keys[mid - 1], end):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _usable(self, lookup: Lookup) -> bool:
        """Whether to ask the bucket for this lookup: not while it is left alone after a failure
        (counted once per lookup)."""
        if self.health.down():
            if not lookup.notes & {"remote skipped", "remote failed"}:  # failed in this lookup: counted
                lookup.notes.add("remote skipped")
                self.health.count("skipped_down")
            return False
        return True

    def _failed(self, lookup: Lookup, e: RemoteError | None) -> None:
        """A request of this lookup failed (`e`) or missed the deadline (None): the remote is
        left alone for a while."""
        lookup.notes.add("remote failed")
        if e is None:
            self.health.count("deadline_misses")
            self.health.mark_down()
        else:
            self.health.error(e, down=True)

    def _head(self, key: str, end: float) -> bool:
        self.health.count("heads")
        return self._call(self.bucket.head, key, end=end) is not None

    def _call(self, fn, *args, end: float):
        """Run a request on the pool and wait for it until `end` (raises _Late after)."""
        fut: Future = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:
            fut.cancel()
            raise _Late from None

    def _fetch(self, ref: _Ref) -> bytes | None:
        """The record's bytes, from its download in flight or a new one, within the deadline."""
        end = ref.lookup.started + self.deadline
        if ref.future is None:
            ref.future = self._pool.submit(self.bucket.get, ref.key)
        try:
            body = ref.future.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:  # past the deadline: what is local is served
            ref.future.cancel()
            self.health.count("deadline_misses")
            return None
        except RemoteError as e:
            self.health.error(e, down=True)
            return None
        if body is not None:
            self.health.count("downloads")
            self.health.count("download_bytes", len(body))
        return body

    def _download(self, refs: list[_Ref], end: float) -> list[_Ref]:
        """Download these records at once, within the deadline; the checked ones that came."""
        self._start(refs)
        got = []
        for ref in refs:
            body = self._fetch(ref)
            if body is None:
                continue
            ref.body = body
            try:
                ref.tokens = check_record(body, ref.rid, ref.lookup.chunk_size)
            except BlobError as e:
                self.damaged(ref.rid.hash, e, ref)
                continue
            got.append(ref)
        return got


def _depth_of(lookup: Lookup, h: bytes) -> int:
    """The depth of a chunk of the lookup's chain (0 for its namespace)."""
    return 0 if h == lookup.ns else lookup.chain.index(h) + 1


def _placed(k: ObjectKey, depth: int) -> RecordId:
    return RecordId(k.hash, k.ns, k.parent, depth, k.kind, k.ntokens, k.first_token)


def _best_children(children: list[ObjectKey], parent: bytes, rest: np.ndarray) -> tuple[ObjectKey | None, list]:
    """The children worth downloading: the longest one whose key proves it is a prefix of `rest`
    (a tail's hash is of its parent and tokens), and, when it does not cover `rest`, a few others
    to compare by their tokens (a branch inside a stored tail reuses the common part)."""
    exact, others = None, []
    for k in children:
        if k.kind == TAIL and k.ntokens <= len(rest) and keys.tail_hash(parent, rest[: k.ntokens]) == k.hash:
            if exact is None or k.ntokens > exact.ntokens:
                exact = k
        else:
            others.append(k)
    if exact is not None and exact.ntokens >= len(rest) - 1:
        return exact, []
    others.sort(key=lambda k: -k.modified)
    return exact, others[: MAX_CANDIDATES - (exact is not None)]
