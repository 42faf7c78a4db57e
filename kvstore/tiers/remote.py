"""The remote tier: the records every node shares through a bucket, as the last tier of the lookup.

It is asked only for what the tiers before it lack. `find` binary-searches the prompt's chain
with HEADs for the deepest chunk the bucket holds (chunks are uploaded parents first and deleted
children first, so presence along a chain is a prefix), and downloads the checkpoints asked for;
`children` lists a chunk's children that start with the next token. `open` downloads a record
(`prefetch` starts the downloads of a whole path at once), checks it (intact, and the record
it is fetched as: `remote.objects.check_record`) and writes it through to the local disk tier,
then opens it from there: the next fetch finds it locally. Every object is sealed with the
fleet's key (`remote.seal`): one that does not open (planted or copied by someone without the
secret) is a miss, counted as `unauthenticated`, and never stored; one that opens but fails its
check is counted as corrupt. Either key is not asked for again for a while, nor is one that
failed to download or was larger than the record can be (a GET reads at most that much).

A tenant's lookup asks for the shared chain with the namespace's keys and for the tenant's with
the tenant's (`remote.seal.TenantSealer`), and lists a shared record's children in both folders
(its tenant's folder only under one of its own records). With older fleet keys (a rotation not
finished), what the current key does not find is asked for with each older one.

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
from typing import Callable, Iterable, Sequence

import numpy as np
import xxhash

from kvstore import keys, settings
from kvstore.errors import BlobError
from kvstore.records import CHECKPOINT, TAIL, RecordId
from kvstore.remote.bucket import MAX_OBJECT_BYTES, Bucket, RemoteError, TooLarge, TooLate
from kvstore.remote.health import Health
from kvstore.remote.layout import ObjectKey, children_prefix, key_of, parse_key
from kvstore.remote.objects import check_opened
from kvstore.remote.seal import OVERHEAD, Fleet, Sealer, Unauthenticated
from kvstore.storage.index import Row
from kvstore.tiers.base import Lookup
from kvstore.tiers.disk import DiskTier

log = logging.getLogger("kvstore")

#: Default deadline of the remote part of one fetch, in seconds.
DEFAULT_DEADLINE_S: float = settings.BY_NAME["remote_deadline"].default
MAX_CANDIDATES = 4  # children of the deepest chunk downloaded to compare their tokens
#: An object key that failed (unauthenticated, corrupt, too large, or its download failed) is not
#: asked for again for this long.
BAD_FOR_S = 300.0
_BAD_MAX = 4096


class _Late(Exception):
    """The deadline of the remote part of a fetch has passed."""


class _Ref:
    """A record the bucket holds, as this tier found it: its identity, key, and its plaintext
    once downloaded, opened and checked."""

    __slots__ = ("rid", "key", "lookup", "sealer", "future", "body", "tokens", "named", "size")

    def __init__(self, rid: RecordId, key: str, lookup: Lookup, sealer: Sealer, *, named: bool = False,
                 size: int | None = None):
        self.rid, self.key, self.lookup, self.sealer = rid, key, lookup, sealer
        self.future: Future | None = None
        self.body: bytes | None = None  # the plaintext, once downloaded and checked
        self.tokens: np.ndarray | None = None
        self.named = named  # known by its name only: its hash is read from the object
        self.size = size  # as the listing showed it

    @property
    def cap(self) -> int:
        """The most bytes this record's object can hold (as the model's shapes say)."""
        bound = self.lookup.object_bytes
        most = MAX_OBJECT_BYTES if bound is None else bound(self.rid.kind, self.rid.ntokens)
        return min(MAX_OBJECT_BYTES, most + OVERHEAD)


class RemoteTier:
    name = "remote"
    in_process = False
    shared = True  # not on this machine: `Tiers.holds` never asks it

    def __init__(self, bucket: Bucket, health: Health, disk: DiskTier, fleet: Fleet, *,
                 deadline: float = DEFAULT_DEADLINE_S, threads: int = 8,
                 reupload: Callable[[list[Row]], None] | None = None):
        self.bucket, self.health, self.disk, self.fleet = bucket, health, disk, fleet
        # Shared records read with an older key go back up under the current one (`Uploader.submit`).
        self.reupload = reupload
        self.deadline = float(deadline)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-remote-get")
        self._bad: OrderedDict[str, float] = OrderedDict()  # object key -> until when it is not asked for

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the tier protocol ----------------------------------------------------------------------

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId]) -> dict[bytes, _Ref]:
        if lookup is None or not ids or not self._usable(lookup):
            return {}
        end = lookup.started + self.deadline
        records = [r for r in ids if r.kind != CHECKPOINT]
        found: dict[bytes, _Ref] = {}
        try:
            got = 0  # records of the chain found so far, from its start
            for s in self._sealers(lookup, records[0]) if records else []:
                named = [key_of(s, r) for r in records]
                bad = next((i for i, k in enumerate(named) if self._known_bad(k)), len(named))
                if bad <= got:
                    continue  # a chain ends at a damaged record
                if not found:
                    self.health.count("lookups")
                depth = self.deepest(named[:bad], 0, end)
                found.update((r.hash, _Ref(r, k, lookup, s)) for r, k in zip(records[got:depth], named[got:depth]))
                got = max(got, depth)
                if got == len(records):
                    break
            checkpoints = [(r, self._sealers(lookup, r)) for r in ids if r.kind == CHECKPOINT]
            for turn in range(max((len(s) for _, s in checkpoints), default=0)):  # each key, all at once
                refs = [_Ref(r, key_of(s[turn], r), lookup, s[turn]) for r, s in checkpoints
                        if turn < len(s) and r.hash not in found and not self._known_bad(key_of(s[turn], r))]
                for ref in self._download(refs, end):
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
        out: list[tuple[bytes, np.ndarray, _Ref]] = []
        try:
            for s in self._branches(lookup, depth):
                out += self._children_in(lookup, s, parent, rest, depth, end)
                if any(len(t) >= len(rest) - 1 for _, t, _ in out):
                    break  # covered
        except _Late:
            self._failed(lookup, None)
        except RemoteError as e:
            self._failed(lookup, e)
        return out

    def _children_in(self, lookup: Lookup, s: Sealer, parent: bytes, rest: np.ndarray, depth: int,
                     end: float) -> list[tuple[bytes, np.ndarray, _Ref]]:
        """The children of `parent` in one folder (`s`: whose, under which key) that may share
        tokens with `rest`."""
        folder = children_prefix(s, parent, int(rest[0]))
        listed = self._call(self.bucket.list, folder, end=end)
        self.health.count("lists")
        keys_ = [k for k in (parse_key(p, n, t) for p, n, t in listed)
                 if k is not None and k.path.startswith(folder) and k.kind != CHECKPOINT
                 and k.owned == s.owned and not self._known_bad(k.path)]
        owner = {"tenant": s.tenant.tag, "link": s.tenant.link(parent)} if s.owned else {}
        base = owner.get("link") or parent
        exact, others = _best_children(keys_, s, base, rest)
        out = []
        if exact is not None:  # its name proves its tokens: rest[:n]
            rid = RecordId(keys.tail_hash(base, rest[: exact.ntokens]), lookup.ns, parent, depth, TAIL,
                           exact.ntokens, int(rest[0]), **owner)
            out.append((rid.hash, rest[: exact.ntokens], _Ref(rid, exact.path, lookup, s, size=exact.size)))
        refs = [_Ref(RecordId(k.hash, lookup.ns, parent, depth, k.kind, k.ntokens, int(rest[0]), **owner), k.path,
                     lookup, s, named=True, size=k.size) for k in others]
        for ref in self._download(refs, end):
            out.append((ref.rid.hash, ref.tokens, ref))
        return out

    def _sealers(self, lookup: Lookup, r: RecordId) -> list[Sealer]:
        """The keys record `r` may be found under, in order: a shared record's, the namespace's
        under every key of the fleet; a tenant's, its tenant's under the key it was made with."""
        if r.tenant is None:
            return [f.sealer(lookup.ns) for f in self.fleet.keyring()]
        owner = lookup.owner_of(r.tenant)
        fleet = self.fleet.by_key(owner.key_id) if owner is not None else None
        return [] if fleet is None else [fleet.sealer(lookup.ns, owner)]

    def _branches(self, lookup: Lookup, depth: int) -> list[Sealer]:
        """The folders a lookup lists the children of its record at `depth - 1` in: under one of
        its tenant's records, that tenant's; else the shared ones, then its tenant's (under each
        key it may have been made with)."""
        if lookup.tenant is not None and depth - 1 > lookup.shared and lookup.owner is not None:
            fleet = self.fleet.by_key(lookup.owner.key_id)
            return [] if fleet is None else [fleet.sealer(lookup.ns, lookup.owner)]
        out = [f.sealer(lookup.ns) for f in self.fleet.keyring()]
        for t in lookup.tenant.variants() if lookup.tenant is not None else ():
            fleet = self.fleet.by_key(t.key_id)
            if fleet is not None:
                out.append(fleet.sealer(lookup.ns, t))
        return out

    def prefetch(self, items: Iterable[tuple[bytes, _Ref]]) -> None:
        """Start downloading these (record, ref)s now, all at once (`open` then waits for each)."""
        self._start(ref for _, ref in items)

    def _start(self, refs: Iterable[_Ref]) -> None:
        for ref in refs:
            if ref.body is None and ref.future is None:
                ref.future = self._get(ref)

    def _get(self, ref: _Ref) -> Future | None:
        """Start the download of a record's object, at most its size (None if it is known to be
        larger: a planted object is never read)."""
        if ref.size is not None and ref.size > ref.cap:
            self._too_large(ref)
            return None
        until = ref.lookup.started + self.deadline
        return self._pool.submit(self._get_open, ref.sealer, ref.key, ref.cap, until)

    def _get_open(self, s: Sealer, key: str, cap: int, until: float) -> tuple[int, bytes] | None:
        """(sealed size, plaintext) of the object at `key`, or None: on a download thread, so that
        opening overlaps the other downloads. Unauthenticated if it does not open."""
        body = self.bucket.get(key, cap, until)
        if body is None:
            return None
        size = len(body)
        plain = s.open(key, body)
        del body  # only the plaintext is held from here on
        if time.monotonic() > until:
            return None
        return size, plain

    def _too_large(self, ref: _Ref) -> None:
        self.health.count("oversized_objects")
        self._remember_bad(ref.key)

    def open(self, h: bytes, ref: _Ref | None):
        """The record, downloaded, checked, written through to the local disk and opened there.
        KeyError if it cannot be had in time (or is gone); BlobError if it is not what it claims."""
        if ref is None:
            raise KeyError(h)
        if ref.body is None:
            plain = self._fetch(ref)  # BlobError if it does not open
            if plain is None:
                raise KeyError(h)
            self._check(ref, plain)
        r = ref.rid
        row = Row(r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, len(ref.body),
                  xxhash.xxh3_64_intdigest(ref.body), tenant=r.tenant)
        try:
            self.disk.put(row, ref.body)
        except OSError as e:  # a full disk: the record stays a miss here
            self.health.error(e)
            raise KeyError(h) from None
        if r.tenant is None and ref.sealer.key_id != self.fleet.key_id and self.reupload is not None:
            self.reupload([row])  # (a tenant's old records are stored again under its new salt as it uses them)
        if "remote" not in ref.lookup.notes:
            ref.lookup.notes.add("remote")
            self.health.count("remote_hits")
        self.health.count("remote_tokens", r.ntokens)
        ref.body = None  # on disk now: hold no copy
        return self.disk.open(h, row)

    def damaged(self, h: bytes, error: BlobError, ref: _Ref | None = None) -> None:
        """An object that failed its check: counted, and not asked for again for a while."""
        if isinstance(error, Unauthenticated):
            self.health.count("unauthenticated")
            log.warning("kvstore: a remote object failed authentication, not used: %s", error)
        else:
            self.health.count("corrupt_objects")
            log.warning("kvstore: a remote object is damaged, not used: %s", error)
        if ref is not None:
            self._remember_bad(ref.key)

    def _remember_bad(self, key: str) -> None:
        self._bad[key] = time.monotonic() + BAD_FOR_S
        self._bad.move_to_end(key)
        while len(self._bad) > _BAD_MAX:
            self._bad.popitem(last=False)

    def _known_bad(self, key: str) -> bool:
        until = self._bad.get(key)
        if until is not None and until < time.monotonic():
            self._bad.pop(key, None)
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
        """The record's object, opened, from its download in flight or a new one, within the
        deadline (a download past it stops and drops what it read). Unauthenticated if it does
        not open with the fleet's key."""
        end = ref.lookup.started + self.deadline
        if ref.future is None:
            ref.future = self._get(ref)
            if ref.future is None:
                return None
        try:
            got = ref.future.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:  # past the deadline: what is local is served
            ref.future.cancel()
            self.health.count("deadline_misses")
            return None
        except TooLarge:
            self._too_large(ref)
            return None
        except TooLate:  # it ran into the deadline (as the waiter did): dropped, not remembered
            self.health.count("deadline_misses")
            return None
        except RemoteError as e:
            self._remember_bad(ref.key)
            self.health.error(e, down=True)
            return None
        finally:
            ref.future = None  # the future holds the bytes: only what is returned may from here on
        if got is None:
            return None
        self.health.count("downloads")
        self.health.count("download_bytes", got[0])
        return got[1]

    def _check(self, ref: _Ref, plain: bytes) -> None:
        """Check an opened object is the record it is fetched as (BlobError)."""
        tokens, rid = check_opened(ref.sealer, plain, ref.rid, ref.lookup.chunk_size, named=ref.named)
        ref.body, ref.tokens, ref.rid, ref.named = plain, tokens, rid, False

    def _download(self, refs: list[_Ref], end: float) -> list[_Ref]:
        """Download these records at once, within the deadline; the checked ones that came."""
        self._start(refs)
        got = []
        for ref in refs:
            try:
                plain = self._fetch(ref)
                if plain is None:
                    continue
                self._check(ref, plain)
            except BlobError as e:
                self.damaged(ref.rid.hash, e, ref)
                continue
            got.append(ref)
        return got


def _depth_of(lookup: Lookup, h: bytes) -> int:
    """The depth of a chunk of the lookup's chain (0 for its namespace)."""
    return 0 if h == lookup.ns else lookup.chain.index(h) + 1


def _best_children(children: list[ObjectKey], s: Sealer, base: bytes,
                   rest: np.ndarray) -> tuple[ObjectKey | None, list]:
    """The children worth downloading: the longest one whose name proves it is a prefix of `rest`
    (a tail's hash is of its parent, or its tenant's link, `base`, and its tokens), and, when it
    does not cover `rest`, a few others to compare by their tokens (a branch inside a stored
    tail reuses the common part)."""
    exact, others = None, []
    for k in children:
        if k.kind == TAIL and k.ntokens <= len(rest) and \
                s.name(keys.tail_hash(base, rest[: k.ntokens])) == k.hash.hex():
            if exact is None or k.ntokens > exact.ntokens:
                exact = k
        else:
            others.append(k)
    if exact is not None and exact.ntokens >= len(rest) - 1:
        return exact, []
    others.sort(key=lambda k: -k.modified)
    return exact, others[: MAX_CANDIDATES - (exact is not None)]
