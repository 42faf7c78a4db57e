"""The local disk as a tier: blob files and their index rows. A damaged record is quarantined
(but a record whose row states another tenant than its blob: that row is what is damaged, and
the record a miss until `verify --repair` mends it; and one whose tag is not the fleet key's
while the store is opened with another secret than its tags': a miss, kept as it is).

Every record opened here is checked against its row as it is opened (`records.check`: its
header, and that its token ids hash to its key), and each tensor against its own checksum as
it is read. `put` stores a record that came from elsewhere (the remote tier), already checked,
the way the writer does: blob first, then its row.

The disk tier owns what it knows of its records: how many it quarantined, the access times of
the ones it served (`AccessTimes`, written to the index by the writer's thread in batches) and
the byte budget of the disk (`DiskBudget`: over `max_bytes`, gc runs).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np
import xxhash

from kvstore import records, tenants
from kvstore.errors import BlobError, TenantMismatchError, WrongKeyError
from kvstore.storage import blobfile, blobtree, blobwrite
from kvstore.storage.index import Index, Row
from kvstore.storage.writesql import hour_of
from kvstore.trust import Trust
from kvstore.upkeep.anchors import Anchors

if TYPE_CHECKING:
    from kvstore.tiers.memory import MemoryTier
    from kvstore.upkeep.local import LocalStore

log = logging.getLogger("kvstore")


def record_tokens(blob: blobfile.BlobFile, row: Row) -> np.ndarray:
    """The token ids of a record, read from its blob and checked against its row: the header
    names it and the record's hash is the xxh3 of its parent and these ids (BlobError if not)."""
    tokens = blob.tokens()
    records.check(row, blob.metadata, tokens, where=blob.path)
    if row.tenant is not None and row.link is None:  # a copy in RAM is written from it again, link and all
        row.link = tenants.stated(blob.metadata)[1]
    return tokens


class BlobSource:
    """A record read from a blob file, checked against its index row as it is opened."""

    in_ram = False

    def __init__(self, blob: blobfile.BlobFile, row: Row):
        self.id, self.blob = row, blob
        self.tokens = record_tokens(blob, row)
        self.entries = blob.layout.deltas  # shared by every record of this layout: never changed

    def read_copies(self, copies, targets):
        self.blob.read_copies(copies, targets)

    def array(self, name: str) -> np.ndarray:
        return self.blob.array(name)

    def cold(self) -> bool:
        return not self.blob.cached()

    def close(self) -> None:
        self.blob.close()


#: Records of the last commits a budget check remembers, to tell a write the gc undid at once.
FRESH_REMEMBERED = 4096
#: A record the budget evicted as soon as it was written is not written again for this long (it
#: would be evicted again: what the budget holds is kept ahead of it).
WASTED_FOR_S = 60.0
#: An automatic budget (`max_bytes="auto"`) is derived again at a check at most this often: other
#: files may fill the disk while the store is open (it costs a statvfs and one query).
AUTO_EVERY_S = 30.0


class AccessTimes:
    """Uses of records not written to the index yet: hash -> (last use, uses since)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._uses: dict[bytes, tuple[float, int]] = {}

    def add(self, hashes: Iterable[bytes]) -> None:
        now = time.time()
        with self._lock:
            for h in hashes:
                self._uses[h] = (now, self._uses.get(h, (0.0, 0))[1] + 1)

    def take(self) -> dict[bytes, tuple[float, int]]:
        """What was counted since the last take (for `Index.touch`)."""
        with self._lock:
            uses, self._uses = self._uses, {}
        return uses

    def __bool__(self) -> bool:
        return bool(self._uses)


class DiskBudget:
    """Keeps the disk within `max_bytes` (and each tenant within `tenant_max_bytes`): `check()`,
    told whenever something reached the disk (a
    batch the writer committed, a download stored), runs gc on a thread of its own when the store
    is over it, one at a time; checks asked for while one runs make it check once more."""

    def __init__(self, files: "LocalStore", memory: "MemoryTier", max_bytes: int | None,
                 tenant_max_bytes: int | None = None, auto: str | None = None):
        self.files, self.memory, self.max_bytes = files, memory, max_bytes
        # `auto`: how an automatic `max_bytes` was derived (`LocalStore.auto_budget`), which
        # `_rederive` does again, at most every `AUTO_EVERY_S`; None: a budget that was given.
        self.auto_rule, self._derived = auto, time.monotonic()
        self.tenant_max_bytes = tenant_max_bytes  # each tenant's share of the disk
        self._cond = threading.Condition()
        self._due = self._running = False
        self._said_too_small = self._said_tenant_too_small = False
        self.evicted_records = self.evicted_bytes = 0  # what this process's budget gc took off the disk
        # Records just committed (the last checks' rows): one the next gc evicts was written for nothing.
        self._fresh: dict[bytes, int] = {}  # -> the role class it was written with
        self.wasted_records = 0  # written, and evicted by the gc that write called
        self._wasted_at: dict[bytes, tuple[float, int]] = {}  # those -> (when, monotonic; role), the last ones
        self._said_wasted = False

    def check(self, rows: list[Row] | None = None) -> None:
        """Something reached the disk (`rows`, when known: what). Never waits."""
        big = max((r.size for r in rows or ()), default=0)
        if self.max_bytes is not None and big > self.max_bytes and not self._said_too_small:
            self._said_too_small = True  # else every record written is evicted again, unsaid
            log.warning("kvstore: a record of %d bytes is larger than the disk budget (max_bytes %d): "
                        "records this big cannot stay on disk; raise the budget", big, self.max_bytes)
        mine = max((r.size for r in rows or () if r.tenant is not None), default=0)
        if self.tenant_max_bytes is not None and mine > self.tenant_max_bytes and not self._said_tenant_too_small:
            self._said_tenant_too_small = True  # (each such record of a tenant is evicted again at once)
            log.warning("kvstore: a tenant's record of %d bytes is larger than each tenant's share of the disk "
                        "(tenant_max_bytes %d): a tenant's records this big cannot stay on disk; raise it",
                        mine, self.tenant_max_bytes)
        with self._cond:
            self._due = True
            for r in rows or ():
                self._fresh[r.hash] = r.role
            while len(self._fresh) > FRESH_REMEMBERED:
                del self._fresh[next(iter(self._fresh))]
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="kvstore-budget", daemon=True).start()

    def _wasted(self, hashes: dict[bytes, int], done: dict) -> None:
        """Records this gc evicted that the write which called it had just committed: with the
        rest of the budget held by what is kept ahead of them (pinned records, stronger roles,
        their parents), every such write is wasted. Counted, and said once."""
        if not hashes:
            return
        self.wasted_records += len(hashes)
        now = time.monotonic()
        with self._cond:
            for h, role in hashes.items():
                self._wasted_at[h] = (now, role)
            while len(self._wasted_at) > FRESH_REMEMBERED:
                del self._wasted_at[next(iter(self._wasted_at))]
        if not (self._said_wasted or self._said_too_small or self._said_tenant_too_small):  # (those say it too)
            self._said_wasted = True
            limits = ", ".join(f"{name} {n}" for name, n in (("max_bytes", self.max_bytes),
                                                             ("tenant_max_bytes", self.tenant_max_bytes)) if n is not None)
            log.warning("kvstore: the disk budget (%s) evicted %d record%s as soon as %s written: what it holds "
                        "is kept ahead of them (pinned records, records of stronger roles: system > user > "
                        "assistant, and the parents of what stays), so writes like these are wasted; raise the "
                        "budget, or unpin (`kvstore pins --remove`)", limits, len(hashes),
                        "" if len(hashes) == 1 else "s", "it was" if len(hashes) == 1 else "they were")

    def wasted_lately(self, h: bytes, role: int) -> bool:
        """Whether record `h` was evicted as soon as it was written, within `WASTED_FOR_S`, with a
        role class as strong as `role` or stronger: the writer does not write it again for an
        insert of that role (`write.batch`); a stronger role may keep it, and writes it."""
        at = self._wasted_at.get(h)
        return at is not None and time.monotonic() - at[0] < WASTED_FOR_S and role <= at[1]

    def holds(self, per_token: int, chunk_size: int) -> None:
        """A model was bound whose records take about `per_token` bytes a token: said now, not at
        its first write, if one chunk of `chunk_size` tokens is more than the budget."""
        if self.max_bytes is not None and per_token * chunk_size > self.max_bytes and not self._said_too_small:
            self._said_too_small = True
            longest = self.max_bytes // per_token
            log.warning("kvstore: a chunk (%d tokens) of this model takes about %d bytes on disk, more than the disk "
                        "budget (max_bytes %d): %s can stay on disk; raise the budget", chunk_size,
                        per_token * chunk_size, self.max_bytes,
                        f"no prompt of it longer than about {longest} tokens" if longest else "no prompt of it")
        share = self.tenant_max_bytes
        if share is not None and per_token * chunk_size > share and not self._said_tenant_too_small:
            self._said_tenant_too_small = True
            log.warning("kvstore: a chunk (%d tokens) of this model takes about %d bytes on disk, more than each "
                        "tenant's share of the disk (tenant_max_bytes %d): a tenant's own chunks cannot stay on disk "
                        "(each is written, then evicted again); raise it", chunk_size,
                        per_token * chunk_size, share)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until no check is due or running; False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)

    def _rederive(self) -> None:
        """An automatic budget derived again, when the last derivation is `AUTO_EVERY_S` old."""
        if self.auto_rule is None or time.monotonic() - self._derived < AUTO_EVERY_S:
            return
        self._derived = time.monotonic()
        was = self.max_bytes
        self.max_bytes, self.auto_rule = self.files.auto_budget(now=True)
        if was is not None and self.max_bytes < was * 0.9:  # (the disk filled: said, as it evicts now)
            log.warning("kvstore: the automatic disk budget is now %d bytes (was %d): other files took space on "
                        "the store's disk; %s", self.max_bytes, was, self.auto_rule)

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._due:
                        self._running = False
                        self._cond.notify_all()
                        return
                    self._due = False
                    fresh, self._fresh = self._fresh, {}
                try:
                    self._rederive()
                    if self.files.over_budget(self.max_bytes, self.tenant_max_bytes):
                        done = evict(self.files, self.memory, max_bytes=self.max_bytes,
                                     tenant_max_bytes=self.tenant_max_bytes, keep_hashes=True)
                        self.evicted_records += done["evicted"]
                        self.evicted_bytes += done["freed_bytes"]
                        self._wasted({h: fresh[h] for h in done.pop("hashes") if h in fresh}, done)
                except Exception as e:  # only the budget: the next check tries again
                    log.warning("kvstore: gc for the disk budget failed: %s", e)
        finally:  # a thread a check: its index connection goes with it (else two open files each)
            self.files.index.release()


def evict(files: "LocalStore", memory: "MemoryTier", keep_hashes: bool = False, **options) -> dict:
    """`LocalStore.gc(**options)`, and the evicted records dropped from the memory tier too (a
    record held in RAM only would let a later insert store its children with no parent on disk).
    `keep_hashes`: the result keeps the evicted records' hashes (`"hashes"`)."""
    result = files.gc(**options)
    hashes = result["hashes"] if keep_hashes else result.pop("hashes")
    if not options.get("dry_run"):
        memory.discard(hashes)
    return result


class DiskTier:
    name = "disk"
    in_process = False

    def __init__(self, index: Index, root: Path, budget: DiskBudget | None = None, trust: Trust | None = None):
        self.index, self.root, self.budget = index, root, budget
        self.anchors = Anchors(trust, index, root) if trust is not None else None
        self.access = AccessTimes()
        self.quarantined = 0  # records this process found damaged
        self.mistagged: set[bytes] = set()  # records whose row's tenant is not their blob's: misses, not quarantined
        self.damaged_read_only: set[bytes] = set()  # damaged records a read-only opening met (it marks none)
        self.said_wrong_key = False  # that the fleet secret is not the one the store's tags were made with
        # Told the row of each record `put` stored (a download): subscribed where the store is built.
        self.on_store: list[Callable[[list[Row]], None]] = []

    def find(self, lookup, ids):
        return self.index.rows_of([r.hash for r in ids]) if ids else {}

    def holds(self, hashes: list[bytes]) -> set[bytes]:
        return self.index.present(hashes)

    def children(self, lookup, parent, rest):
        """The records under `parent` that start with the next token and the lookup may see (shared,
        or its tenant's), with their token ids read from their blobs (a record whose blob cannot
        give them is quarantined, left out)."""
        found = []
        for row in self.index.children(parent, int(rest[0]), lookup.tags()):  # never another tenant's
            try:
                with blobfile.open_blob(self.root, row.hash, size=row.size, checksum=row.checksum) as blob:
                    self._check_trust(blob, row)
                    found.append((row.hash, record_tokens(blob, row), row))
            except BlobError as e:
                self.damaged(row.hash, e, row)
        return found

    def open(self, h, ref):
        row = ref if ref is not None else self.index.get(h)
        if row is None or row.bad:
            raise KeyError(h)
        blob = blobfile.open_blob(self.root, h, size=row.size, checksum=row.checksum)
        try:
            self._check_trust(blob, row)
            return BlobSource(blob, row)
        except BaseException:
            blob.close()
            raise

    def _check_trust(self, blob: blobfile.BlobFile, row: Row) -> None:
        """BlobError if the blob's trust tag is refused (`Trust.refuse`): a record changed
        after it was written is never restored, nor continued from and uploaded."""
        trust = self.anchors.trust if self.anchors is not None else None
        verdict = blob.verdict(trust) if trust is not None else None
        if verdict is not None:  # (WrongKeyError under a wrong fleet secret: a miss, kept)
            trust.refuse(verdict, row.created, self.anchors.epoch, blob.path)

    def prefetch(self, items: Iterable[tuple[bytes, Row]]) -> None:
        """Start reading these (record, row)s' files ahead, all at once."""
        blobfile.prefetch(self.root, [h for h, _ in items])

    def put(self, row: Row, data: bytes, *, fsync: bool = False, explicit: bool = False,
            trust: Trust | None = None, owner: str | None = None) -> bool:
        """Store a checked record that came from elsewhere: its blob, then its row. False if it
        was stored already. The blob is fsynced only with `fsync` (a download's copy in the bucket
        stays: one a power cut tears fails its checksums, is quarantined and fetched again).
        The blob is tagged as this store's (`Anchors.tagged`): `row` gets its new size and checksum.
        The write log counts it as a download, or with `explicit` (a pack's record, imported on
        purpose) as an explicit write, as a warmed prompt's. `trust`: tag it with these keys
        instead (a pack imported into a fleet node's store opened without its remote). `owner`: the
        tag of the tenant whose quota the record's salted tenant shares, kept with its row."""
        anchors = Anchors(trust, self.index, self.root) if trust is not None else self.anchors
        if anchors is not None:
            data = anchors.tagged(data)
            row.size, row.checksum = len(data), xxhash.xxh3_64_intdigest(data)
        with blobtree.tree_lock(self.root, exclusive=False):
            if self.index.present([row.hash]):
                return False
            blobwrite.write_bytes(self.root, row.hash, data, fsync=fsync)
            try:
                self.index.insert([row], {row.tenant: owner} if owner is not None and row.tenant else None)
            except BaseException:  # (a full disk, most often): no row points to the file, which goes
                blobtree.remove(self.root, row.hash)
                raise
            for listener in self.on_store:
                listener([row])
        counts = {"bytes": len(data), "records": 1, "explicit": len(data)} if explicit else {"downloaded": len(data)}
        try:  # the store's write log counts what reaches its disk from elsewhere too
            self.index.log_writes(hour_of(time.time()), counts)
        except Exception as e:
            log.debug("kvstore: a download was not counted (%s)", e)
        if self.budget is not None:
            self.budget.check([row])
        return True

    def damaged(self, h, error, ref=None):
        """Mark a record whose blob failed to read as bad: a miss from it on, counted."""
        try:
            if self.index.get(h) is None:  # evicted (by gc, maybe in another process) under the read
                log.debug("kvstore: record %s was evicted while it was read", h.hex())
                return
        except Exception:
            pass
        if self._replaced(h, ref):  # completed by a writer under the read: the new blob is good
            return
        if isinstance(error, TenantMismatchError):  # the row's tenant is wrong, not the blob: a miss
            if h not in self.mistagged:  # (said once per record a process meets)
                self.mistagged.add(h)
                log.warning("kvstore: a record's index row is damaged (run `kvstore verify --repair`): %s", error)
            return
        if isinstance(error, WrongKeyError):  # the secret is wrong, not the record: a miss, kept
            if not self.said_wrong_key:  # (said once: every record of the store may be one)
                self.said_wrong_key = True
                log.warning("kvstore: %s", self.anchors.trust.mismatch if self.anchors else error)
            return
        if self.index.read_only:  # a read-only opening marks nothing: it says what did happen, once a record
            if h not in self.damaged_read_only:
                self.damaged_read_only.add(h)
                self.quarantined += 1
                log.warning("kvstore: a damaged record is a miss, not quarantined (the store is open read-only; "
                            "`kvstore verify --repair` drops it): %s", error)
            return
        log.warning("kvstore: quarantined a damaged record: %s", error)
        self.quarantined += 1
        try:
            if self.index.mark_bad(h):
                self.index.bump_counter("count.quarantined")
        except Exception:  # the index may be busy or read-only; the miss is what matters
            pass

    def _replaced(self, h: bytes, ref: Row | None) -> bool:
        """Whether the record's row changed since `ref` was read, looked at under the shared tree
        lock: a writer that completes a record replaces its blob and row together under the
        exclusive lock, and a read between the two is no damage."""
        try:
            with blobtree.tree_lock(self.root, exclusive=False):
                row = self.index.get(h)
        except Exception:
            return False
        return ref is not None and row is not None and (row.size, row.checksum) != (ref.size, ref.checksum)

    def touch(self, hashes):
        self.access.add(hashes)
