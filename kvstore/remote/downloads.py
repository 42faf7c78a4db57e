"""Downloads of the remote tier: each record's object fetched, opened and checked, within the
fetch's wait and a bound of bytes in flight.

`Downloads` belongs to one `tiers.remote.RemoteTier`: it runs the GETs (and the tier's HEADs and
listings) on its pool, opens each sealed object as its bytes arrive (`remote.seal.Opening`: no
copy of the sealed bytes), checks it is the record it is fetched as
(`remote.objects.check_opened`), and remembers for a while the object keys that failed
(unauthenticated, corrupt, too large, or their download failed: not asked for again until
`BAD_FOR_S` has passed, on its `clock`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable

import numpy as np

from kvstore.errors import BlobError
from kvstore.records import RecordId
from kvstore.remote.bucket import MAX_OBJECT_BYTES, Bucket, RemoteError, TooLarge, TooLate
from kvstore.remote.health import Health
from kvstore.remote.objects import check_opened
from kvstore.remote.seal import OVERHEAD, Sealer, Unauthenticated

log = logging.getLogger("kvstore")

#: The bytes of downloads started and not yet ended (a path's downloads start as this allows).
INFLIGHT_BYTES = 512 << 20
#: The longest a fetch waits for the bucket (`wait_complete`); what a download waits when its
#: fetch set no wait (none does: see `RemoteTier.until`).
LONGEST_S = 600.0


#: An object key that failed (unauthenticated, corrupt, too large, or its download failed) is not
#: asked for again for this long.
BAD_FOR_S = 300.0
_BAD_MAX = 4096


class Ref:
    """A record the bucket holds, as this tier found it: its identity, key, and its plaintext
    once downloaded, opened and checked."""

    __slots__ = ("rid", "key", "lookup", "sealer", "future", "body", "tokens", "named", "size", "queued", "again")

    def __init__(self, rid: RecordId, key: str, lookup: Any, sealer: Sealer, *, named: bool = False,
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


class _Gone(Exception):
    """The object is not in the bucket (deleted since a HEAD or listing showed it)."""


class Downloads:
    def __init__(self, bucket: Bucket, health: Health, *, threads: int = 8,
                 clock: Callable[[], float] = time.monotonic):
        self.bucket, self.health = bucket, health
        self.clock = clock  # of the memory of bad keys (a test moves it on)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-remote-get")
        self._bad: OrderedDict[str, float] = OrderedDict()  # object key -> until when it is not asked for
        self._lock = threading.Lock()
        self._inflight = 0  # bytes of downloads started and not yet ended
        self._waiting: deque[Ref] = deque()  # downloads to start as the bytes in flight allow

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def bad_object(self, error: BlobError, ref: Ref | None) -> None:
        """An object that failed its check: counted, and not asked for again for a while."""
        if isinstance(error, Unauthenticated):
            self.health.count("unauthenticated")
            log.warning("kvstore: a remote object failed authentication, not used: %s", error)
        else:
            self.health.count("corrupt_objects")
            log.warning("kvstore: a remote object is damaged, not used: %s", error)
        if ref is not None:
            self.remember_bad(ref.key)

    def prefetch(self, items: Iterable[tuple[bytes, Ref]]) -> None:
        """Start downloading these (record, ref)s now, in order, as many at once as the bound of
        bytes in flight allows (`open` then waits for each; the rest start as others finish)."""
        self.start(ref for _, ref in items)

    def start(self, refs: Iterable[Ref]) -> None:
        for ref in refs:
            with self._lock:
                if ref.body is not None or ref.future is not None or ref.queued:
                    continue
                if self._inflight and self._inflight + ref.estimate > INFLIGHT_BYTES:
                    ref.queued = True
                    self._waiting.append(ref)
                    continue
            self._launch(ref)

    def _launch(self, ref: Ref) -> None:
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

    def _get(self, ref: Ref) -> Future | None:
        """Start the download of a record's object, at most its size (None if it is known to be
        larger: a planted object is never read)."""
        if ref.size is not None and ref.size > ref.cap:
            self._too_large(ref)
            return None
        until = _until(ref.lookup)
        try:
            return self.pool.submit(self._get_open, ref.sealer, ref.key, ref.cap, until, ref.rid,
                                    ref.lookup.chunk_size, ref.named)
        except RuntimeError:  # closed
            return None

    def _get_open(self, s: Sealer, key: str, cap: int, until: float, rid: RecordId, chunk_size: int,
                  named: bool) -> tuple | None:
        """(sealed size, plaintext, token ids, record) of the object at `key`, or None past the
        wait: on a download thread, so that opening and checking overlap the other downloads.
        _Gone if the bucket holds no such object; Unauthenticated if it does not open; BlobError if it is not the record `rid` (`named`:
        known by its name only), intact."""
        opening = self.bucket.get(key, cap, until, into=s.opener(key))  # opened as it arrives
        if opening is None:
            raise _Gone(key)
        size, plain = opening.size, opening.done()  # (Unauthenticated unless every byte came, intact)
        tokens, rid = check_opened(s, plain, rid, chunk_size, named=named)
        # Counted as it arrives, whether or not a fetch takes it (past its wait, after a record
        # of its path that failed, or stored by the request meanwhile: a download unused).
        self.health.count("downloads")
        self.health.count("download_bytes", size)
        if time.monotonic() > until:
            return None
        return size, plain, tokens, rid

    def _too_large(self, ref: Ref) -> None:
        self.health.count("oversized_objects")
        self.remember_bad(ref.key)

    def fetch(self, ref: Ref) -> bytes | None:
        """The record's object, opened and checked (`ref.body`, `ref.tokens` and `ref.rid` are
        then set), from its download in flight or a new one, within the fetch's wait (a download
        past it stops and drops what it read); None if it did not come. BlobError if it is not
        the record (Unauthenticated if it does not open with the fleet's key)."""
        end = _until(ref.lookup)
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
            self.remember_bad(ref.key)
            self.health.error(e, down=True)
            return None
        except _Gone:  # deleted behind this node's back: the chain ends before it, and the next
            self.remember_bad(ref.key)  # plan of this fetch keeps what comes before it
            return None
        finally:
            ref.future = None  # the future holds the bytes: only what is returned may from here on
        if got is None:
            return None
        self.health.answered()
        ref.body, ref.tokens, ref.rid, ref.named = got[1], got[2], got[3], False
        return got[1]

    def _late(self, lookup: Any) -> None:
        """A download of this fetch missed its wait: counted, and if some of its path came, the
        fetch is a partial remote restore (counted once)."""
        self.health.count("deadline_misses")
        if "remote" in lookup.notes and "partial" not in lookup.notes:
            lookup.notes.add("partial")
            self.health.count("partial_restores")

    def download(self, refs: list[Ref], end: float) -> list[Ref]:
        """Download these records at once, within the deadline; the checked ones that came."""
        self.start(refs)
        got = []
        for ref in refs:
            try:
                if self.fetch(ref) is None:
                    continue
            except BlobError as e:
                self.bad_object(e, ref)
                continue
            got.append(ref)
        return got

    def remember_bad(self, key: str) -> None:
        self._bad[key] = self.clock() + BAD_FOR_S
        self._bad.move_to_end(key)
        while len(self._bad) > _BAD_MAX:
            self._bad.popitem(last=False)

    def known_bad(self, key: str) -> bool:
        until = self._bad.get(key)
        if until is not None and until < self.clock():
            self._bad.pop(key, None)
            return False
        return until is not None


def _until(lookup: Any) -> float:
    """When the fetch of `lookup` (a `tiers.base.Lookup`) stops waiting for the bucket."""
    return lookup.remote_until if lookup.remote_until is not None else time.monotonic() + LONGEST_S
