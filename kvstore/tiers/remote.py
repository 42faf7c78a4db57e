"""The remote tier: the records every node shares through a bucket, as the last tier of the lookup.

It is asked only for what the tiers before it lack. `find` binary-searches the prompt's chain
with HEADs for the deepest chunk the bucket holds (chunks are uploaded parents first and deleted
children first, so presence along a chain is a prefix), and downloads the checkpoints asked for;
`children` lists a chunk's children that start with the next token, one bounded listing, and
compares them with the prompt by what their keys say (`layout.mark_lengths`): the one that goes
furthest is downloaded, and only if it goes further than what this machine holds and shares at
least a quarter of its tokens (a child this machine holds is never downloaded). `open` downloads
a record (`prefetch` starts the downloads of a whole path at once: `remote.downloads`), checks it
(intact, and the record it is fetched as: `remote.objects.check_record`) and gives the restore a
source in memory; it is written through to the local disk tier in the background, so the next
fetch finds it locally. Every object is sealed with the fleet's key (`remote.seal`): one that
does not open (planted or copied by someone without the secret) is a miss, counted as
`unauthenticated`, and never stored; one that opens but fails its check is counted as corrupt.
Either key is not asked for again for a while, nor is one that failed to download or was larger
than the record can be (a GET reads at most that much).

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
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterable, Sequence

import numpy as np

from kvstore import keys, settings
from kvstore.errors import BlobError
from kvstore.records import CHECKPOINT, TAIL, RecordId
from kvstore.remote.bucket import Bucket, RemoteError
from kvstore.remote.downloads import LONGEST_S, Downloads, Ref
from kvstore.remote.health import Health, KeyCheck
from kvstore.remote.layout import ObjectKey, children_prefix, key_of, mark_lengths, parse_key
from kvstore.remote.seal import Fleet, Sealer
from kvstore.storage import blobfile
from kvstore.storage.index import Row
from kvstore.tiers.base import Lookup
from kvstore.tiers.disk import BlobSource, DiskTier
from kvstore.tiers.writethrough import WriteThrough

log = logging.getLogger("kvstore")

POLICIES = settings.BY_NAME["remote_prefetch"].choices
#: The `timeout` policy's wait: this, plus PREFETCH_PER_1K_S for every 1,024 tokens the local tiers
#: lack, at most PREFETCH_CAP_S (SGLang's is 2 s + 0.1 s per 1,024 tokens, capped).
PREFETCH_BASE_S = 1.0
PREFETCH_PER_1K_S = 0.1
PREFETCH_CAP_S = 10.0
#: What `wait_complete` and the background lookups of `best_effort` wait at most, in all.
WAIT_COMPLETE_S = LONGEST_S
#: A lookup that ran out of its wait with no answer at all from the endpoint for this long leaves
#: the remote alone for a while (`Health`): it hangs, and the next fetches would wait for it too.
SILENT_S = 0.1
#: The keys one listing of a children folder reads at most (one request): a folder flooded with
#: keys costs one bounded LIST; the children past it are not seen.
LIST_LIMIT = 1000
#: Background lookups (`best_effort`) queued at most; more are dropped, counted.
BACKGROUND_JOBS = 16


class _Late(Exception):
    """The wait of the remote part of a fetch has passed."""


class RemoteTier:
    name = "remote"
    in_process = False
    shared = True  # not on this machine: `Tiers.holds` never asks it

    def __init__(self, bucket: Bucket, health: Health, disk: DiskTier, fleet: Fleet, *,
                 policy: str = "timeout", deadline: float | None = None, threads: int = 8,
                 reupload: Callable[[list[Row]], None] | None = None, keys: KeyCheck | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"remote_prefetch must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.bucket, self.health, self.disk, self.fleet = bucket, health, disk, fleet
        self.keys = keys or KeyCheck(bucket, fleet, health)  # (the uploader's too: one answer a process)
        self.policy, self.deadline = policy, None if deadline is None else float(deadline)
        self.downloads = Downloads(bucket, health, threads=threads, clock=clock)
        # Downloads on their way to the local disk; shared records read with an older key go back
        # up under the current one (`reupload`: `Uploader.submit`).
        self.stored = WriteThrough(disk, health, reupload)
        self._later = ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-later")  # best_effort's
        self._jobs: set = set()  # what the background is doing or will do (each once)
        self._lock = threading.Lock()
        self._key_checked = False  # whether the bucket was asked if any namespace opens with the key
        self._closed = False

    @property
    def clock(self) -> Callable[[], float]:
        return self.downloads.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.downloads.clock = clock

    def close(self, timeout: float = 30.0) -> None:
        """Stop; what was downloaded is stored on the local disk first (within `timeout`)."""
        self._closed = True
        self._later.shutdown(wait=False, cancel_futures=True)
        self.downloads.close()
        self.stored.close(timeout)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until what was downloaded is on the local disk; False if `timeout` ran out."""
        return self.stored.settle(timeout)

    def prefetch(self, items: Iterable[tuple[bytes, Ref]]) -> None:
        """Start downloading these (record, ref)s now (`Downloads.prefetch`)."""
        self.downloads.prefetch(items)

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
                                    local_children=dict(lookup.local_children))  # (`until`: WAIT_COMPLETE_S)

        def run() -> None:
            try:
                work(later)
            except Exception as e:  # a background job never raises anywhere
                if not self._closed:  # (one cut short by close: its pool refuses new requests)
                    self.health.error(e)
            finally:
                with self._lock:
                    self._jobs.discard(job)

        try:
            self._later.submit(run)
        except RuntimeError:  # closed
            with self._lock:
                self._jobs.discard(job)

    def _store(self, later: Lookup, found: list[tuple[bytes, Ref]]) -> None:
        """A background job's records, downloaded and stored on the local disk, a path in order
        (it stops at the first that does not come)."""
        self.prefetch(found)
        for h, ref in found:
            if self.disk.holds([h]):  # the request stored it itself meanwhile: not downloaded again
                if ref.future is not None:
                    ref.future.cancel()
                continue
            try:
                self.open(h, ref).close()
            except KeyError:
                break
            except BlobError as e:
                self.damaged(h, e, ref)
                break

    # -- the tier protocol ----------------------------------------------------------------------

    def find(self, lookup: Lookup | None, ids: Sequence[RecordId]) -> dict[bytes, Ref]:
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
        rest = later.tokens[later.start_of(got[-1]) + got[-1].ntokens if got else later.start_of(chain[0]):]
        if len(rest) > 1 and (parent == later.ns or parent in later.chain):
            self._store_child(later, parent, rest)

    def _store_child(self, later: Lookup, parent: bytes, rest: np.ndarray) -> None:
        """The child of `parent` worth downloading for `rest`, if any, stored on the local disk."""
        self._store(later, [(h, ref) for h, _, ref in self._children(later, parent, rest)])

    def _find(self, lookup: Lookup, ids: Sequence[RecordId]) -> dict[bytes, Ref]:
        records = [r for r in ids if r.kind != CHECKPOINT]
        end = self.until(lookup, len(lookup.tokens) - (lookup.start_of(records[0]) if records else len(lookup.tokens)))
        found: dict[bytes, Ref] = {}
        try:
            got = 0  # records of the chain found so far, from its start
            for s in self._sealers(lookup, records[0]) if records else []:
                named = [key_of(s, r, lookup.tokens_of(r)) for r in records]
                bad = next((i for i, k in enumerate(named) if self.downloads.known_bad(k)), len(named))
                if bad <= got:
                    continue  # a chain ends at a damaged record
                if not found:
                    self.health.count("lookups")
                    got = self._downloaded(lookup, s, records, named, found)
                depth = self.deepest(named[:bad], min(got, bad), end)
                found.update((r.hash, Ref(r, k, lookup, s)) for r, k in zip(records[got:depth], named[got:depth]))
                got = max(got, depth)
                if got == len(records):
                    break
            if records and not found and records[0].depth == 1:
                self._check_key(lookup, end)
            checkpoints = [(r, self._sealers(lookup, r)) for r in ids if r.kind == CHECKPOINT]
            for turn in range(max((len(s) for _, s in checkpoints), default=0)):  # each key, all at once
                refs = [Ref(r, key_of(s[turn], r), lookup, s[turn]) for r, s in checkpoints
                        if turn < len(s) and r.hash not in found and not self.downloads.known_bad(key_of(s[turn], r))]
                for ref in self.downloads.download(refs, end):
                    found[ref.rid.hash] = ref
        except _Late:  # the lookup itself was too slow: leave the remote alone for a while
            self._failed(lookup, None)
        except RemoteError as e:
            self._failed(lookup, e)
        return found

    def _downloaded(self, lookup: Lookup, s: Sealer, records: list[RecordId], named: list[str],
                    found: dict[bytes, Ref]) -> int:
        """How many records of the chain, from its start, were downloaded and are still being
        stored locally: found as they are, with no request (a fetch right after another)."""
        held = self.stored.held(records)
        for r, k, body in zip(records, named, held):
            ref = found[r.hash] = Ref(r, k, lookup, s)
            ref.body, ref.again = body, True
        return len(held)

    def children(self, lookup: Lookup | None, parent: bytes, rest: np.ndarray) -> list[tuple[bytes, np.ndarray, Ref]]:
        if lookup is None or len(rest) <= 1 or not self._usable(lookup):
            return []
        if parent != lookup.ns and parent not in lookup.chain:
            return []
        if self.policy == "best_effort" and "background" not in lookup.notes:
            if "later" in lookup.notes:  # the lookup's job asks for them
                return []
            self._in_background(lookup, ("children", parent, len(rest)),
                                lambda later: self._store_child(later, parent, rest))
            return []
        return self._children(lookup, parent, rest)

    def _children(self, lookup: Lookup, parent: bytes, rest: np.ndarray) -> list[tuple[bytes, np.ndarray, Ref]]:
        end = self.until(lookup, len(rest))
        depth = lookup.depth_of(parent) + 1
        have = max(lookup.local_children.values(), default=0)  # what this machine restores already
        best: tuple[int, ObjectKey, bool, Sealer] | None = None  # (tokens shared, key, proven, folder's sealer)
        try:
            for s in self._branches(lookup, depth):
                found = self._best_in(lookup, s, parent, rest, end)
                if found is not None and found[0] > (best[0] if best else 0):
                    best = (*found, s)
                if best is not None and best[0] >= len(rest) - 1:
                    break  # covered
            if best is None and parent == lookup.ns and not have:  # nothing of the prompt anywhere
                self._check_key(lookup, end)
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
            return [(rid.hash, rest[:n], Ref(rid, k.path, lookup, s, size=k.size))]
        ref = Ref(RecordId(k.hash, lookup.ns, parent, depth, k.kind, k.ntokens, int(rest[0]), **owner), k.path,
                   lookup, s, named=True, size=k.size)
        return [(r.rid.hash, r.tokens, r) for r in self.downloads.download([ref], end)]

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
        marks: dict[int, str] | None = None  # length -> the prompt's mark there (made once, if needed)
        best: tuple[int, ObjectKey, bool] | None = None
        for k in (parse_key(p, n, t) for p, n, t in listed):
            if k is None or not k.path.startswith(folder) or k.kind == CHECKPOINT or k.owned != s.owned \
                    or k.hash.hex() in held or k.marks is None or self.downloads.known_bad(k.path):
                continue  # (an object of an older layout says nothing of its tokens: not read)
            if k.kind == TAIL and k.ntokens <= len(rest) and \
                    s.name(keys.tail_hash(base, rest[: k.ntokens])) == k.hash.hex():
                shared, exact = k.ntokens, True
            else:
                if marks is None:  # the lengths are one ladder: the prompt's marks, up to a chunk
                    top = min(len(rest), lookup.chunk_size)
                    ladder = mark_lengths(top + 1)
                    marks = dict(zip(ladder, s.marks(parent, rest[:top], ladder)))
                shared = max((n for n, m in zip(mark_lengths(k.ntokens), k.marks) if marks.get(n) == m), default=0)
                exact = False
            if shared and (best is None or shared > best[0] or shared == best[0] and exact > best[2]):
                best = (shared, k, exact)
        return best

    def _check_key(self, lookup: Lookup, end: float) -> None:
        """Once a process, after a lookup that found nothing of its prompt: whether the bucket
        exists, and whether this node's keys are the fleet's (`KeyCheck`: a wrong fleet secret is
        said once). Waited for within the fetch's wait; past it, it goes on in the background."""
        with self._lock:
            if self._key_checked:
                return
            self._key_checked = True
        if "background" in lookup.notes:  # (on the background thread already)
            return self.keys.check([lookup.ns])
        try:
            self._later.submit(self.keys.check, [lookup.ns]).result(timeout=max(0.0, end - time.monotonic()))
        except (FutureTimeout, RuntimeError):  # slow (it goes on), or closed
            pass

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

    def open(self, h: bytes, ref: Ref | None):
        """The record, downloaded and checked, as a source read from memory; once the restore
        closes it, it is written through to the local disk in the background (`settle` waits for
        that), so the next fetch finds it locally. KeyError if it cannot be had in time (or is
        gone); BlobError if it is not what it claims."""
        if ref is None:
            raise KeyError(h)
        if ref.body is None and self.downloads.fetch(ref) is None:  # BlobError if it is not the record
            raise KeyError(h)
        r, body = ref.rid, ref.body
        row = Row(r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, len(body), 0, tenant=r.tenant)
        source = _Downloaded(blobfile.in_memory(body, h, f"remote record {h.hex()}"), row, self.stored)
        background = "background" in ref.lookup.notes  # `best_effort`: counted once stored, for the next fetch
        self.stored.hold(row, body, reupload=r.tenant is None and ref.sealer.key_id != self.fleet.key_id,
                         prefetched=background)
        if not background:
            if "remote" not in ref.lookup.notes:
                ref.lookup.notes.add("remote")
                self.health.count("remote_hits")
            if not ref.again:
                self.health.count("downloads_used")
        ref.body = None  # the source and the write hold it: nothing else
        return source

    def restored(self, tokens: int) -> None:
        """A restore took `tokens` tokens from records of the bucket (the count the reports give:
        a record the restore ends inside counts only for what was used of it)."""
        if tokens:
            self.health.count("remote_tokens", tokens)

    def damaged(self, h: bytes, error: BlobError, ref: Ref | None = None) -> None:
        """An object that failed its check: counted, and not asked for again for a while."""
        self.downloads.bad_object(error, ref)

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
        """Whether to ask the bucket for this lookup: not with a deadline of 0 (fetches never
        wait for it), not once this lookup gave up on it, not while it is left alone after a
        failure (counted once per lookup)."""
        if self.deadline == 0 or "remote failed" in lookup.notes:
            return False
        if self.health.down():
            if not lookup.notes & {"remote skipped", "remote failed"}:  # failed in this lookup: counted
                lookup.notes.add("remote skipped")
                self.health.count("skipped_down")
            return False
        return True

    def _failed(self, lookup: Lookup, e: RemoteError | None) -> None:
        """A request of this lookup failed (`e`): the remote is left alone for a while. Or the
        lookup ran out of its wait (None): counted, and the remote is left alone only if nothing
        answered since the lookup began, for at least SILENT_S (a hanging endpoint). A wait that
        ends on a slow but answering endpoint is the policy's normal outcome: uploads and later
        fetches go on."""
        lookup.notes.add("remote failed")
        if e is None:
            self.health.count("deadline_misses")
            now = time.monotonic()
            if self.health.answered_at < lookup.started and now - lookup.started >= SILENT_S:
                self.health.mark_down()
        else:
            self.health.error(e, down=True)

    def _head(self, key: str, end: float) -> bool:
        self.health.count("heads")
        return self._call(self.bucket.head, key, end=end) is not None

    def _call(self, fn, *args, end: float):
        """Run a request on the pool and wait for it until `end` (raises _Late after)."""
        fut: Future = self.downloads.pool.submit(fn, *args)
        try:
            answer = fut.result(timeout=max(0.0, end - time.monotonic()))
            self.health.answered()
            return answer
        except FutureTimeout:
            fut.cancel()
            raise _Late from None


class _Downloaded(BlobSource):
    """A downloaded record read from memory: closed (the restore is done with it), it goes to
    the local disk."""

    def __init__(self, blob, row: Row, stored: WriteThrough):
        super().__init__(blob, row)
        self._stored = stored

    def close(self) -> None:
        super().close()
        self._stored.release(self.id.hash)
