"""Downloaded records on their way to the local disk: the remote tier restores a download from
memory and stores it here, on one background thread, so that a fetch does not wait for the disk.

`WriteThrough.hold` keeps a checked record (its row and plaintext) and `release`, once the
restore that reads it is done, queues it for the disk tier's `put`; until it is there, `held`
gives it to the remote tier's lookup again (a fetch right after another needs no request).
`settle` waits for the queue (`Store.flush` and close do); what was never released is dropped
at close.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import xxhash

from kvstore import tenants
from kvstore.records import RecordId
from kvstore.storage import blobformat
from kvstore.storage.index import Row
from kvstore.tiers.disk import DiskTier

log = logging.getLogger("kvstore")
#: The longest the writer waits for a download being stored here (`landed`) before it writes the
#: record itself: a local write of bytes already in RAM takes milliseconds, unless the disk is stuck.
LANDING_S = 10.0


class WriteThrough:
    def __init__(self, disk: DiskTier, health, reupload: Callable[[list[Row]], None] | None):
        self.disk, self.health, self.reupload = disk, health, reupload
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._writing: dict[bytes, tuple] = {}  # downloaded, not on the local disk yet: (row, body, flags, started)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-store")

    def hold(self, row: Row, body, *, reupload: bool, prefetched: bool = False) -> None:
        """A downloaded record to store on the local disk once the restore that reads it is done
        (`release`), so that writing it never competes with the fetch (`reupload`: read with an
        older fleet key, it goes up again under the current one once it is there; `prefetched`:
        downloaded for a later fetch, counted as such only if it is stored, not found there)."""
        with self._lock:
            if row.hash not in self._writing:
                self._writing[row.hash] = (row, body, (reupload, prefetched), False)

    def release(self, h: bytes) -> None:
        """Store record `h` now, in the background (once)."""
        with self._lock:
            got = self._writing.get(h)
            if got is None or got[3]:
                return
            row, body, flags, _ = got
            self._writing[h] = (row, body, flags, True)
        try:
            self._pool.submit(self._write, row, body, *flags)
        except RuntimeError:  # closed
            with self._lock:
                self._writing.pop(h, None)
                self._settled.notify_all()

    def _write(self, row: Row, body, reupload: bool, prefetched: bool) -> None:
        try:
            row.size, row.checksum = len(body), xxhash.xxh3_64_intdigest(body)
            stored = self.disk.put(row, body, owner=_owner_of(row, body))
            if stored and prefetched:
                self.health.count("prefetched")
            if reupload and self.reupload is not None:
                self.reupload([row])  # (a tenant's old records are stored again under its new salt as it uses them)
        except OSError as e:  # a full disk: the record stays a miss here
            self.health.error(e)
        except Exception as e:  # never raises anywhere: a cache write that failed is a miss later
            log.warning("kvstore: a downloaded record was not stored locally (%s: %s)", type(e).__name__, e)
        finally:
            with self._lock:
                self._writing.pop(row.hash, None)
                self._settled.notify_all()  # (`landed` waits for some, `settle` for all)

    def __contains__(self, h: bytes) -> bool:
        """Whether record `h` was downloaded and is not on the local disk yet."""
        with self._lock:
            return h in self._writing

    def held(self, records: list[RecordId]) -> list:
        """The downloaded bodies of `records`, from the first, that are still being stored."""
        with self._lock:
            out = []
            for r in records:
                got = self._writing.get(r.hash)
                if got is None:
                    break
                out.append(got[1])
            return out

    def landed(self, hashes, timeout: float = LANDING_S) -> None:
        """Wait (at most `timeout`) until those of `hashes` that are being stored are on the local
        disk: the writer asks before it decides what of a job is still to write, so that a record
        downloaded and then inserted is written once (by this), not twice."""
        end = time.monotonic() + timeout
        with self._lock:
            while any(h in self._writing and self._writing[h][3] for h in hashes):
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._settled.wait(left)

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until what was queued is on the local disk; False if `timeout` ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._writing:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Stop, once what was queued is stored (within `timeout`)."""
        for h in list(self._writing):
            self.release(h)
        self.settle(timeout)
        self._pool.shutdown(wait=False)


def _owner_of(row: Row, body) -> str | None:
    """The owner tag a downloaded record of a salted tenant states (`x-owner`), so that the local
    index counts the tenant within its owner's quota as the uploading node's did (None: a shared
    record, a tenant of its own, or a field that is not a tag). The body was checked already."""
    if row.tenant is None:
        return None
    try:
        owner = tenants.stated_owner(blobformat.header_metadata(body))
    except (ValueError, TypeError):
        return None
    return owner if owner != row.tenant else None
