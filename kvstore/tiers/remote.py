"""The remote tier: the records every node shares through a bucket, as the last tier of the lookup.

It is asked only for what the tiers before it lack. `find` binary-searches the prompt's chain
with HEADs for the deepest chunk the bucket holds (chunks are uploaded parents first and deleted
children first, so presence along a chain is a prefix), and downloads the checkpoints asked for;
`children` lists a chunk's children that start with the next token, one bounded listing, and
compares them with the prompt by what their keys say (`layout.mark_lengths`): the one that goes
furthest is downloaded, and only if it goes further than what this machine holds (a child this
machine holds is never downloaded). `open` downloads a record (`prefetch` starts the downloads
of a whole path at once, within a bound of bytes in flight), checks it (intact, and the record
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

How long a fetch waits is the prefetch policy's (`remote_prefetch`, after SGLang's HiCache):
- `timeout` (the default): up to `PREFETCH_BASE_S` + `PREFETCH_PER_1K_S` per 1,024 tokens the
  local tiers lack, at most `PREFETCH_CAP_S`, from the fetch's start; what arrived by then is
  restored (a partial remote restore, counted), the rest is prefilled;
- `best_effort`: the fetch serves what is local at once; the lookup and the downloads go on in
  the background and store what they get on the local disk, for the next fetch;
- `wait_complete`: the fetch waits for the whole path (each request bounded by the client's
  timeouts).
`remote_deadline`, when given, bounds each of them. Nothing here raises into the caller but
BlobError and KeyError (the tier protocol's); other failures are counted and leave the remote
alone for a while (`Health`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections import OrderedDict, deque
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
from kvstore.remote.layout import ObjectKey, children_prefix, key_of, manifest_key, mark_lengths, parse_key
from kvstore.remote.objects import check_opened
from kvstore.remote.seal import KEY_ENV, OVERHEAD, Fleet, Sealer, Unauthenticated
from kvstore.storage import blobfile
from kvstore.storage.index import Row
from kvstore.tiers.base import Lookup
from kvstore.tiers.disk import BlobSource, DiskTier

log = logging.getLogger("kvstore")

POLICIES = settings.BY_NAME["remote_prefetch"].choices
#: The `timeout` policy's wait: this, plus PREFETCH_PER_1K_S for every 1,024 tokens the local tiers
#: lack, at most PREFETCH_CAP_S (SGLang's is 2 s + 0.1 s per 1,024 tokens, capped).
PREFETCH_BASE_S = 1.0
PREFETCH_PER_1K_S = 0.1
PREFETCH_CAP_S = 10.0
#: What `wait_complete` and the background lookups of `best_effort` wait at most, in all.
WAIT_COMPLETE_S = 600.0
#: The bytes of downloads started and not yet stored (a path's downloads start as this allows).
INFLIGHT_BYTES = 512 << 20
#: The keys one listing of a children folder reads at most (one request): a folder flooded with
#: keys costs one bounded LIST; the children past it are not seen.
LIST_LIMIT = 1000
#: Background lookups (`best_effort`) queued at most; more are dropped, counted.
BACKGROUND_JOBS = 16
#: The namespaces' manifests read at most to tell whether any opens with this node's key.
KEY_CHECK_FOLDERS = 16
_NAME = re.compile(r"[0-9a-f]{32}")
#: An object key that failed (unauthenticated, corrupt, too large, or its download failed) is not
#: asked for again for this long.
BAD_FOR_S = 300.0
_BAD_MAX = 4096


class _Late(Exception):
    """The deadline of the remote part of a fetch has passed."""


class _Ref:
    """A record the bucket holds, as this tier found it: its identity, key, and its plaintext
    once downloaded, opened and checked."""

    __slots__ = ("rid", "key", "lookup", "sealer", "future", "body", "tokens", "named", "size", "queued", "again")

    def __init__(self, rid: RecordId, key: str, lookup: Lookup, sealer: Sealer, *, named: bool = False,
                 size: int | None = None):
        self.rid, self.key, self.lookup, self.sealer = rid, key, lookup, sealer
        self.future: Future | None = None
        self.body: bytes | None = None  # the plaintext, once downloaded and checked
        self.tokens: np.ndarray | None = None
        self.named = named  # known by its name only: its hash is read from the object
        self.size = size  # as the listing showed it
        self.queued = False  # waiting for the bytes in flight to allow its download
        self.again = False  # downloaded by an earlier fetch, still being stored: no new download

    @property
    def estimate(self) -> int:
        """What its download is likely to hold: its size as listed, else about what the model's
        shapes say (`cap` is twice that, and more)."""
        return self.size if self.size is not None else max(1, (self.cap - (1 << 20)) // 2)

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
                 policy: str = "timeout", deadline: float | None = None, threads: int = 8,
                 reupload: Callable[[list[Row]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"remote_prefetch must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.bucket, self.health, self.disk, self.fleet = bucket, health, disk, fleet
        # Shared records read with an older key go back up under the current one (`Uploader.submit`).
        self.reupload = reupload
        self.policy, self.deadline = policy, None if deadline is None else float(deadline)
        self.clock = clock  # of the memory of bad keys (a test moves it on)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-remote-get")
        self._later = ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-later")  # best_effort's
        self._jobs: set = set()  # what the background is doing or will do (each once)
        self._bad: OrderedDict[str, float] = OrderedDict()  # object key -> until when it is not asked for
        self._lock = threading.Lock()
        self._inflight = 0  # bytes of downloads started and not yet stored or dropped
        self._waiting: deque[_Ref] = deque()  # downloads to start as the bytes in flight allow
        self._key_checked = False  # whether the bucket was asked if any namespace opens with the key
        self._disk_writes = ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-store")
        self._writing: dict[bytes, tuple[Row, object]] = {}  # downloaded, not on the local disk yet
        self._settled = threading.Condition(self._lock)

    def close(self, timeout: float = 30.0) -> None:
        """Stop; what was downloaded is stored on the local disk first (within `timeout`)."""
        self._later.shutdown(wait=False, cancel_futures=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.settle(timeout)
        self._disk_writes.shutdown(wait=False)

    # -- how long a fetch waits (the prefetch policy) -------------------------------------------

    def until(self, lookup: Lookup, missing: int) -> float:
        """When this fetch stops waiting for the bucket (`monotonic` time): the policy's wait
        for `missing` tokens the local tiers lack, from the fetch's start, set once a fetch."""
        if lookup.remote_until is None:
            if self.policy == "timeout":
                wait = min(PREFETCH_CAP_S, PREFETCH_BASE_S + PREFETCH_PER_1K_S * max(0, missing) / 1024)
            else:
                wait = WAIT_COMPLETE_S
            if self.deadline is not None:
                wait = min(wait, self.deadline)
            lookup.remote_until = lookup.started + wait
        return lookup.remote_until

    def _in_background(self, lookup: Lookup, job: tuple, work: Callable[[Lookup], None]) -> None:
        """`best_effort`: do `work` (a lookup and its downloads, stored on the local disk) in the
        background, for the next fetch; each job once, at most BACKGROUND_JOBS waiting."""
        with self._lock:
            if job in self._jobs:
                return
            if len(self._jobs) >= BACKGROUND_JOBS:
                self.health.count("dropped_prefetches")
                return
            self._jobs.add(job)
        later = dataclasses.replace(lookup, started=time.monotonic(), notes={"background"}, remote_until=None,
                                    local_children=dict(lookup.local_children))
        later.remote_until = later.started + min(WAIT_COMPLETE_S, self.deadline if self.deadline is not None
                                                 else WAIT_COMPLETE_S)

        def run() -> None:
            try:
                work(later)
            except Exception as e:  # a background job never raises anywhere
                self.health.error(e)
            finally:
                with self._lock:
                    self._jobs.discard(job)

        try:
            self._later.submit(run)
        except RuntimeError:  # closed
            with self._lock:
                self._jobs.discard(job)

    def _store(self, later: Lookup, found: list[tuple[bytes, _Ref]]) -> None:
        """A background job's records, downloaded and stored on the local disk, a path in order
        (it stops at the first that does not come)."""
        self.prefetch(found)
        for h, ref in found:
            try:
                self.open(h, ref).close()
            except KeyError:
                break
            except BlobError as e:
                self.damaged(h, e, ref)
                break

    # -- the tier protocol ----------------------------------------------------------------------

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId]) -> dict[bytes, _Ref]:
        if lookup is None or not ids or not self._usable(lookup):
            return {}
        if self.policy == "best_effort" and "background" not in lookup.notes:
            wanted = list(ids)
            if any(r.kind != CHECKPOINT for r in wanted):
                lookup.notes.add("later")  # the job asks for the children of what it finds too
            self._in_background(lookup, ("find", wanted[0].hash, wanted[-1].hash),
                                lambda later: self._find_and_store(later, wanted))
            return {}
        return self._find(lookup, ids)

    def _find_and_store(self, later: Lookup, ids: list[RecordId]) -> None:
        """`best_effort`'s job: the records of `ids` the bucket holds, then the child of the
        deepest that goes furthest along the prompt, stored on the local disk."""
        found = self._find(later, ids)
        self._store(later, [(r.hash, found[r.hash]) for r in ids if r.hash in found])
        chain = [r for r in ids if r.kind != CHECKPOINT]
        if not chain:
            return
        got = [r for r in chain if r.hash in found]
        parent = got[-1].hash if got else chain[0].parent
        rest = later.tokens[_start(later, got[-1]) + got[-1].ntokens if got else _start(later, chain[0]):]
        if len(rest) > 1 and (parent == later.ns or parent in later.chain):
            self._store(later, [(h, ref) for h, _, ref in self._children(later, parent, rest)])

    def _find(self, lookup: Lookup, ids: Sequence[RecordId]) -> dict[bytes, _Ref]:
        records = [r for r in ids if r.kind != CHECKPOINT]
        end = self.until(lookup, len(lookup.tokens) - (_start(lookup, records[0]) if records else len(lookup.tokens)))
        found: dict[bytes, _Ref] = {}
        try:
            got = 0  # records of the chain found so far, from its start
            for s in self._sealers(lookup, records[0]) if records else []:
                named = [key_of(s, r, _tokens(lookup, r)) for r in records]
                bad = next((i for i, k in enumerate(named) if self._known_bad(k)), len(named))
                if bad <= got:
                    continue  # a chain ends at a damaged record
                if not found:
                    self.health.count("lookups")
                    got = self._downloaded(lookup, s, records, named, found)
                depth = self.deepest(named[:bad], min(got, bad), end)
                found.update((r.hash, _Ref(r, k, lookup, s)) for r, k in zip(records[got:depth], named[got:depth]))
                got = max(got, depth)
                if got == len(records):
                    break
            if records and not found and records[0].depth == 1:
                self._check_key(lookup, end)
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

    def _downloaded(self, lookup: Lookup, s: Sealer, records: list[RecordId], named: list[str],
                    found: dict[bytes, _Ref]) -> int:
        """How many records of the chain, from its start, were downloaded and are still being
        stored locally: found as they are, with no request (a fetch right after another)."""
        with self._lock:
            held = []
            for r in records:
                got = self._writing.get(r.hash)
                if got is None:
                    break
                held.append(got[1])
        for r, k, body in zip(records, named, held):
            ref = found[r.hash] = _Ref(r, k, lookup, s)
            ref.body, ref.again = body, True
        return len(held)

    def children(self, lookup: Lookup | None, parent: bytes, rest: np.ndarray) -> list[tuple[bytes, np.ndarray, _Ref]]:
        if lookup is None or len(rest) <= 1 or not self._usable(lookup):
            return []
        if parent != lookup.ns and parent not in lookup.chain:
            return []
        if self.policy == "best_effort" and "background" not in lookup.notes:
            if "later" in lookup.notes:  # the lookup's job asks for them
                return []
            self._in_background(lookup, ("children", parent, len(rest)), lambda later: self._store(
                later, [(h, ref) for h, _, ref in self._children(later, parent, rest)][:1]))
            return []
        return self._children(lookup, parent, rest)

    def _children(self, lookup: Lookup, parent: bytes, rest: np.ndarray) -> list[tuple[bytes, np.ndarray, _Ref]]:
        end = self.until(lookup, len(rest))
        depth = _depth_of(lookup, parent) + 1
        have = max(lookup.local_children.values(), default=0)  # what this machine restores already
        best: tuple[int, Sealer, ObjectKey, bool] | None = None
        try:
            for s in self._branches(lookup, depth):
                found = self._best_in(lookup, s, parent, rest, end)
                if found is not None and found[0] > (best[0] if best else 0):
                    best = (*found, s)
                if best is not None and best[0] >= len(rest) - 1:
                    break  # covered
        except _Late:
            self._failed(lookup, None)
            return []
        except RemoteError as e:
            self._failed(lookup, e)
            return []
        if best is None or best[0] <= have or 4 * best[0] < best[1].ntokens and best[0] < len(rest) - 1:
            return []  # nothing more than what is here, or too little of what it would download
        n, k, exact, s = best
        owner = {"tenant": s.tenant.tag, "link": s.tenant.link(parent)} if s.owned else {}
        if exact:  # its name proves its tokens: rest[:n]
            base = owner.get("link") or parent
            rid = RecordId(keys.tail_hash(base, rest[:n]), lookup.ns, parent, depth, TAIL, n, int(rest[0]), **owner)
            return [(rid.hash, rest[:n], _Ref(rid, k.path, lookup, s, size=k.size))]
        ref = _Ref(RecordId(k.hash, lookup.ns, parent, depth, k.kind, k.ntokens, int(rest[0]), **owner), k.path,
                   lookup, s, named=True, size=k.size)
        return [(r.rid.hash, r.tokens, r) for r in self._download([ref], end)]

    def _best_in(self, lookup: Lookup, s: Sealer, parent: bytes, rest: np.ndarray,
                 end: float) -> tuple[int, ObjectKey, bool] | None:
        """The child of `parent` in one folder (`s`: whose, under which key) that goes furthest
        along `rest` by what its key says: (tokens it shares at least, its key, whether its name
        proves them), leaving out what this machine holds; None if none shares any."""
        folder = children_prefix(s, parent, int(rest[0]))
        listed, more = self._call(self.bucket.list_page, folder, LIST_LIMIT, end=end)
        self.health.count("lists")
        if more:
            self.health.count("truncated_lists")
        held = {s.name(h) for h in lookup.local_children}
        base = s.tenant.link(parent) if s.owned else parent
        marks: dict[int, str] = {}  # length -> the prompt's mark there
        best: tuple[int, ObjectKey, bool] | None = None
        for k in (parse_key(p, n, t) for p, n, t in listed):
            if k is None or not k.path.startswith(folder) or k.kind == CHECKPOINT or k.owned != s.owned \
                    or k.hash.hex() in held or k.marks is None or self._known_bad(k.path):
                continue  # (an object of an older layout says nothing of its tokens: not read)
            if k.kind == TAIL and k.ntokens <= len(rest) and \
                    s.name(keys.tail_hash(base, rest[: k.ntokens])) == k.hash.hex():
                shared, exact = k.ntokens, True
            else:
                shared, exact = 0, False
                lengths = mark_lengths(k.ntokens)
                for i in range(len(lengths) - 1, -1, -1):  # the longest prefix whose mark matches
                    n = lengths[i]
                    if n > len(rest):
                        continue
                    if n not in marks:
                        marks[n] = s.marks(parent, rest[:n], [n])[0]
                    if marks[n] == k.marks[i]:
                        shared = n
                        break
            if shared and (best is None or shared > best[0] or shared == best[0] and exact > best[2]):
                best = (shared, k, exact)
        return best

    def _check_key(self, lookup: Lookup, end: float) -> None:
        """Once a process, after a lookup that found nothing of its prompt: whether the bucket
        exists, and whether it holds namespaces of which none opens with this node's keys (its
        manifests; names are MACs, so which model they are of cannot be told): a wrong fleet
        secret, said once. Waited for within the fetch's wait; past it, it goes on in the background."""
        with self._lock:
            if self._key_checked:
                return
            self._key_checked = True
        if "background" in lookup.notes:  # (on the background thread already)
            self._say_key(lookup.ns)
            return
        try:
            self._later.submit(self._say_key, lookup.ns).result(timeout=max(0.0, end - time.monotonic()))
        except (FutureTimeout, RuntimeError):  # slow (it goes on), or closed
            pass

    def _say_key(self, ns: bytes) -> None:
        try:
            folders = [f for f in self.bucket.folders("") if _NAME.fullmatch(f)]
            if not folders or any(f.ns_name(ns) in folders for f in self.fleet.keyring()):
                return
            for folder in folders[:KEY_CHECK_FOLDERS]:
                key = manifest_key(folder)
                body = self.bucket.get(key, max_bytes=1 << 20)
                if body is None:
                    continue
                for f in self.fleet.keyring():
                    try:
                        f.manifest_box(folder).open(key, body)
                        return  # a namespace of this fleet (another model's)
                    except Unauthenticated:
                        pass
        except RemoteError as e:  # no such bucket, no answer...: said once (`Health.error`)
            self.health.error(e, down=True)
            return
        self.health.count("foreign_namespaces", len(folders))
        log.warning("kvstore: the bucket %s holds %d namespace%s and none opens with this key (%s): is %s the "
                    "fleet's? (nothing stored by the nodes that wrote them can be reused here)", self.bucket.url,
                    len(folders), "" if len(folders) == 1 else "s", self.fleet.key_id, KEY_ENV)

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
        """Start downloading these (record, ref)s now, in order, as many at once as the bound of
        bytes in flight allows (`open` then waits for each; the rest start as others finish)."""
        self._start(ref for _, ref in items)

    def _start(self, refs: Iterable[_Ref]) -> None:
        for ref in refs:
            with self._lock:
                if ref.body is not None or ref.future is not None or ref.queued:
                    continue
                if self._inflight and self._inflight + ref.estimate > INFLIGHT_BYTES:
                    ref.queued = True
                    self._waiting.append(ref)
                    continue
            self._launch(ref)

    def _launch(self, ref: _Ref) -> None:
        """Start `ref`'s download now (if it has none), counted in the bytes in flight until it ends."""
        with self._lock:
            if ref.future is not None or ref.body is not None:
                return
            ref.queued = False
            ref.future = self._get(ref)
            if ref.future is None:
                return
            n = ref.estimate
            self._inflight += n
        ref.future.add_done_callback(lambda _, n=n: self._ended(n))

    def _ended(self, n: int) -> None:
        """A download ended: start the ones waiting that now fit (not those past their fetch's wait)."""
        start = []
        with self._lock:
            self._inflight -= n
            while self._waiting:
                ref = self._waiting[0]
                if not ref.queued or ref.future is not None:
                    self._waiting.popleft()
                    continue
                if self._inflight and self._inflight + ref.estimate > INFLIGHT_BYTES:
                    break
                self._waiting.popleft()
                ref.queued = False
                if time.monotonic() < (ref.lookup.remote_until or 0.0):
                    start.append(ref)
                    self._inflight += ref.estimate  # (taken back by `_launch`'s own count below)
        for ref in start:
            with self._lock:
                self._inflight -= ref.estimate
            self._launch(ref)

    def _get(self, ref: _Ref) -> Future | None:
        """Start the download of a record's object, at most its size (None if it is known to be
        larger: a planted object is never read)."""
        if ref.size is not None and ref.size > ref.cap:
            self._too_large(ref)
            return None
        until = self.until(ref.lookup, 0)
        try:
            return self._pool.submit(self._get_open, ref.sealer, ref.key, ref.cap, until)
        except RuntimeError:  # closed
            return None

    def _get_open(self, s: Sealer, key: str, cap: int, until: float) -> tuple[int, bytes] | None:
        """(sealed size, plaintext) of the object at `key`, or None: on a download thread, so that
        opening overlaps the other downloads. Unauthenticated if it does not open."""
        body = self.bucket.get(key, cap, until)
        if body is None:
            return None
        size = len(body)
        plain = s.open(key, body, in_place=True)  # a view of `body`: no second copy
        if time.monotonic() > until:
            return None
        return size, plain

    def _too_large(self, ref: _Ref) -> None:
        self.health.count("oversized_objects")
        self._remember_bad(ref.key)

    def open(self, h: bytes, ref: _Ref | None):
        """The record, downloaded and checked, as a source read from memory; it is written
        through to the local disk in the background (`settle` waits for that), so the next fetch
        finds it locally. KeyError if it cannot be had in time (or is gone); BlobError if it is
        not what it claims."""
        if ref is None:
            raise KeyError(h)
        if ref.body is None:
            plain = self._fetch(ref)  # BlobError if it does not open
            if plain is None:
                raise KeyError(h)
            self._check(ref, plain)
        r, body = ref.rid, ref.body
        row = Row(r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, len(body),
                  xxhash.xxh3_64_intdigest(body), tenant=r.tenant)
        source = BlobSource(blobfile.in_memory(body, h, f"remote record {h.hex()}"), row)
        self._write_through(row, body, reupload=r.tenant is None and ref.sealer.key_id != self.fleet.key_id)
        if "background" in ref.lookup.notes:  # `best_effort`: stored for the next fetch
            self.health.count("prefetched")
        else:
            if "remote" not in ref.lookup.notes:
                ref.lookup.notes.add("remote")
                self.health.count("remote_hits")
            if not ref.again:
                self.health.count("downloads_used")
            self.health.count("remote_tokens", r.ntokens)
        ref.body = None  # the source and the write hold it: nothing else
        return source

    def _write_through(self, row: Row, body, *, reupload: bool) -> None:
        """Store a downloaded record on the local disk, in the background (one writer thread);
        until it is there, `find` gives it from memory."""
        with self._lock:
            if row.hash in self._writing:
                return
            self._writing[row.hash] = (row, body)
        try:
            self._disk_writes.submit(self._write, row, body, reupload)
        except RuntimeError:  # closed
            with self._lock:
                self._writing.pop(row.hash, None)

    def _write(self, row: Row, body, reupload: bool) -> None:
        try:
            self.disk.put(row, body)
            if reupload and self.reupload is not None:  # read with an older key: up again under the current one
                self.reupload([row])  # (a tenant's old records are stored again under its new salt as it uses them)
        except OSError as e:  # a full disk: the record stays a miss here
            self.health.error(e)
        except Exception as e:  # never raises anywhere: a cache write that failed is a miss later
            log.warning("kvstore: a downloaded record was not stored locally (%s: %s)", type(e).__name__, e)
        finally:
            with self._lock:
                self._writing.pop(row.hash, None)
                if not self._writing:
                    self._settled.notify_all()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until what was downloaded is on the local disk; False if `timeout` ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._writing:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
        return True

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
        self._bad[key] = self.clock() + BAD_FOR_S
        self._bad.move_to_end(key)
        while len(self._bad) > _BAD_MAX:
            self._bad.popitem(last=False)

    def _known_bad(self, key: str) -> bool:
        until = self._bad.get(key)
        if until is not None and until < self.clock():
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
        end = self.until(ref.lookup, 0)
        if ref.future is None:  # not started yet (or waiting for room): needed now
            self._launch(ref)
            if ref.future is None:
                return None
        try:
            got = ref.future.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:  # past the policy's wait: what arrived is restored, the rest prefilled
            ref.future.cancel()
            self._late(ref.lookup)
            return None
        except TooLarge:
            self._too_large(ref)
            return None
        except TooLate:  # it ran into the deadline (as the waiter did): dropped, not remembered
            self._late(ref.lookup)
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

    def _late(self, lookup: Lookup) -> None:
        """A download of this fetch missed its wait: counted, and if some of its path came, the
        fetch is a partial remote restore (counted once)."""
        self.health.count("deadline_misses")
        if "remote" in lookup.notes and "partial" not in lookup.notes:
            lookup.notes.add("partial")
            self.health.count("partial_restores")

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


def _start(lookup: Lookup, r: RecordId) -> int:
    """Where record `r` of the lookup's chain starts in its prompt."""
    start = getattr(r, "start", None)
    return start if start is not None else (r.depth - 1) * lookup.chunk_size


def _tokens(lookup: Lookup, r: RecordId) -> np.ndarray:
    """The tokens of record `r` of the lookup's chain."""
    at = _start(lookup, r)
    return lookup.tokens[at : at + r.ntokens]
