"""Write-behind to the bucket: the records this node's writer committed, uploaded in the background.

After the writer commits rows, `submit` queues them; worker threads upload each blob with a
create-only PUT, parents before children (a child waits for its parent's upload; a parent the
bucket lost, this node uploads again from its disk first; a child is skipped if its parent is
neither in the bucket nor on this disk). The queue is bounded by bytes; what it cannot hold is dropped
and counted. Only rows the writer wrote are queued, so a node never uploads what it downloaded
(the remote tier stores downloads through the disk tier, never through the writer), but for one
case: a shared record it read with an older fleet key goes up again under the current key (the
remote tier queues it), so a rotation leaves the shared prompts in the bucket.
Every object is sealed with the fleet's key (`remote.seal`), a tenant's with its tenant's key (a
row names its tenant by tag: the tenant must have been bound in this process, `Fleet.remember`;
else it is not uploaded, and counted). A create-only PUT that finds the
object there already reads it back: if it does not open, or is not the record, it was planted by
someone without the secret, and is overwritten (counted as `replaced`). While the remote is left
alone after a failure (`Health.down`), uploads are skipped and counted, manifests too.
A node whose key is not the fleet's of the bucket (`KeyCheck`, asked before its first upload)
uploads nothing, manifests included: counted (`skipped_wrong_key`), the mistake said once.
Nothing here raises into the writer: failures are counted (`Health`).

What a node uploads is decided by its disk, which a writer of its store folder could change:
every blob's header carries a trust tag (`kvstore.trust`, judged by `upkeep.anchors`). A record
whose blob changed since its commit (whole-file checksum), whose tag does not hold, or which has
no tag of this fleet and was written after the store had tags, is refused: counted
(`refused_uploads`) and said once per reason, naming neither the record nor a path. A record
from before the store had tags is tagged in place once checked whole, then uploaded. A child
whose parent is not in the bucket, nor uploaded from this disk (refused, or failed), is not uploaded
either.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

import xxhash

from kvstore.errors import BlobError
from kvstore.records import RecordId
from kvstore.remote.bucket import Bucket, RemoteError, TooLarge
from kvstore.remote.health import Health, KeyCheck
from kvstore.remote.layout import key_of, manifest_key
from kvstore.remote.objects import check_object, open_record
from kvstore.remote.seal import Fleet, Sealer, Unauthenticated
from kvstore.storage import blobformat
from kvstore.storage.blobfile import open_blob, read_file
from kvstore.storage.blobtree import blob_path
from kvstore.storage.index import Row
from kvstore.trust import Verdict
from kvstore.upkeep.anchors import Anchors

log = logging.getLogger("kvstore")

DEFAULT_UPLOAD_BYTES = 1 << 30
_KNOWN_LIMIT = 1 << 16
#: A parent the bucket was seen to hold is taken as there for this long, then asked again (a gc
#: of the bucket, or a key rotation, may have taken it since: it is then uploaded again).
KNOWN_FOR_S = 600.0


class Uploader:
    def __init__(self, bucket: Bucket, health: Health, fleet: Fleet, blob_root: Path,
                 row_of: Callable[[bytes], Row | None], publish_pins: Callable[[set[bytes]], None], *,
                 max_upload_bytes: int = DEFAULT_UPLOAD_BYTES, threads: int = 4, anchors: Anchors | None = None,
                 keys: KeyCheck | None = None):
        self.bucket, self.health, self.fleet, self.blob_root = bucket, health, fleet, blob_root
        self.keys = keys or KeyCheck(bucket, fleet, health)  # whether this node's key is the fleet's
        self.anchors = anchors  # the store's trust tags (None: every record is refused)
        self._said: set[str] = set()  # the reasons for refusing an upload said so far
        self._row_of, self._publish_pins = row_of, publish_pins
        self.max_upload_bytes = max_upload_bytes
        self.manifests: dict[bytes, bytes] = {}  # ns -> manifest JSON (uploaded once per process)
        self._manifest_done: set[bytes] = set()
        self._manifest_lock = threading.Lock()  # one upload (or replacement) of each manifest
        self._known: OrderedDict[bytes, float] = OrderedDict()  # hashes the bucket held -> when seen
        self._known_lock = threading.Lock()
        self._attempts: OrderedDict[bytes, float] = OrderedDict()  # records this node tried to upload -> when
        self._inflight: dict[bytes, threading.Event] = {}
        self._queue: deque[list[Row]] = deque()
        self._queued_bytes = 0
        self._active = 0
        self._active_rows = 0  # rows of the batches being uploaded now
        self._cond = threading.Condition()
        self._stop = False
        self._workers = [threading.Thread(target=self._loop, name=f"kvstore-remote-put-{i}", daemon=True)
                         for i in range(threads)]
        for w in self._workers:
            w.start()

    @property
    def pending_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes

    def submit(self, rows: list[Row]) -> None:
        """Queue rows the writer just committed (parents before children). Never raises."""
        try:
            rows = list(rows)
            size = sum(r.size for r in rows)
            with self._cond:
                if self._stop:
                    return
                if self._queued_bytes + size > self.max_upload_bytes and self._queued_bytes:
                    self.health.count("dropped_uploads", len(rows))
                    self.health.count("dropped_upload_bytes", size)
                    return
                for r in rows:
                    self._inflight.setdefault(r.hash, threading.Event())
                self._queue.append(rows)
                self._queued_bytes += size
                self._cond.notify_all()
        except Exception as e:  # the writer thread must go on whatever happens here
            self.health.error(e)

    @property
    def pending_uploads(self) -> int:
        """Records queued or being uploaded now."""
        with self._cond:
            return sum(len(rows) for rows in self._queue) + self._active_rows

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done (or dropped). False if `timeout` ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._active:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
        return True

    def close(self, timeout: float = 30.0) -> int:
        """Flush for at most `timeout`, then stop; how many records were left not uploaded."""
        self.flush(timeout)
        with self._cond:
            left = sum(len(rows) for rows in self._queue) + self._active_rows
            if left:
                self.health.count("left_uploads", left)
            self._queue.clear()
            self._queued_bytes = 0
            self._stop = True
            self._cond.notify_all()
        # Idle workers end at once; one stuck in a request (something was left) is a daemon: not waited out.
        end = time.monotonic() + (0.0 if left else 1.0)
        for w in self._workers:
            w.join(timeout=max(0.0, end - time.monotonic()))
        return left

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                rows = self._queue.popleft()
                self._active += 1
                self._active_rows += len(rows)
            try:
                self._upload_batch(rows)
            finally:
                with self._cond:
                    self._active -= 1
                    self._active_rows -= len(rows)
                    self._queued_bytes -= sum(r.size for r in rows)
                    self._cond.notify_all()

    def _upload_batch(self, rows: list[Row]) -> None:
        for row in rows:
            try:
                if self._stop:  # closed: counted as left by `close`
                    continue
                if self.health.down():  # left alone after a failure: skipped, counted
                    self.health.count("skipped_down_uploads")
                else:
                    self._tried(row.hash)  # (noted: a child below it does not try it again)
                    if self._upload(row):
                        self._remember(row.hash)
            except Exception as e:
                self.health.count("upload_errors")
                self.health.error(e, down=isinstance(e, RemoteError))
            finally:
                ev = self._inflight.pop(row.hash, None)
                if ev is not None:
                    ev.set()
        pinned = {r.ns for r in rows if r.pinned and r.hash in self._known}
        if pinned:
            try:
                self._publish_pins(pinned)
            except Exception as e:
                self.health.error(e, down=isinstance(e, RemoteError))

    def _tried(self, h: bytes) -> bool:
        """Whether this node tried to upload record `h` within `KNOWN_FOR_S` (noted now if not)."""
        now = time.monotonic()
        with self._known_lock:
            seen = self._attempts.get(h)
            self._attempts[h] = now if seen is None or now - seen >= KNOWN_FOR_S else seen
            self._attempts.move_to_end(h)
            while len(self._attempts) > _KNOWN_LIMIT:
                self._attempts.popitem(last=False)
        return seen is not None and now - seen < KNOWN_FOR_S

    def _upload(self, row: Row) -> bool:
        """Upload one record; True if the bucket holds it afterwards."""
        if row.parent != row.ns and not self._parent_uploaded(row):
            if self._key_wrong():
                self.health.count("skipped_wrong_key")
                return False
            # Not in the bucket (a gc of the bucket, a key rotation), but on this disk: it goes up
            # first, and so on up the chain, so that what is stored below it is shared again.
            # (Not one this node tried itself lately: its upload failed or was refused.)
            parent = self._row_of(row.parent) if not self._tried(row.parent) else None
            if parent is None or not self._upload(parent):
                self.health.count("skipped_no_parent")
                return False
            self._remember(parent.hash)
        try:  # as the local reads do: a regular file, never a link nor a FIFO, its size checked first
            buf = read_file(blob_path(self.blob_root, row.hash), limit=row.size)
        except BlobError:  # evicted (or damaged) locally since it was written: nothing to share
            return False
        if xxhash.xxh3_64_intdigest(buf) != row.checksum:
            return self._refuse("its blob changed after it was committed (checksum mismatch)")
        try:
            _, meta = check_object(buf, row.hash)
        except BlobError:
            self.health.count("skipped_old_format")
            return False
        if meta.get("ns") != row.ns.hex():
            return False
        buf = self._trusted(row, buf)
        if buf is None:
            return False
        if self.keys.judge(list(self.manifests), claim=True):  # not the fleet's key: nothing goes up
            self.health.count("skipped_wrong_key")
            return False
        s = self._sealer(row)
        if s is None:
            self.health.count("skipped_unknown_tenant")
            return False
        self._put_manifest(row.ns)
        stored = blobformat.read_record(buf, row.hash.hex())
        key = key_of(s, row, stored.tokens)
        # Without this node's model path and trust tag: the tensors' checksums still hold.
        body = s.seal(key, blobformat.restamp(buf, blobformat.portable(stored.metadata)))
        if self.bucket.put_new(key, body):
            self.health.count("uploads")
            self.health.count("upload_bytes", len(body))
        elif self._theirs_good(s, key, row, int(meta.get("chunk_size", "0")), len(body)):
            # Sent (the create-only PUT carries the body) and read back to check: traffic too.
            self.health.count("already_there")
            self.health.count("already_there_bytes", len(body))
        else:  # planted by someone without the fleet secret (or damaged): ours replaces it
            self.bucket.put(key, body)
            self.health.count("replaced")
        return True

    def _key_wrong(self) -> bool:
        """Whether this node's key is not the fleet's, asked once if not yet: under a wrong key
        every parent is missing (its name is a MAC under that key), and a node whose first
        records are children of ones it holds would else never be told (nor count them as such)."""
        try:
            return bool(self.keys.judge(list(self.manifests)))
        except RemoteError as e:
            self.health.error(e, down=True)
            return bool(self.keys.wrong)

    def _trusted(self, row: Row, buf: bytearray) -> bytes | bytearray | None:
        """The blob to upload if its trust tag lets it go (tagged first if it is from before
        the store had tags); None if refused (counted, said once)."""
        if self.anchors is None:
            return self._refuse("the store has no trust key to check its records with")
        verdict, why = self.anchors.judge(row, buf)
        if why is not None:
            return self._refuse(why)
        if verdict is Verdict.GOOD:
            return buf
        tagged = self.anchors.tag_in_place(row, buf)
        if tagged is None:  # written again or evicted meanwhile: the next commit uploads it
            return None
        self.health.count("tagged_records")
        return tagged

    def _refuse(self, why: str) -> None:
        """A record refused: counted, and said once per reason (no record, path or key named)."""
        self.health.count("refused_uploads")
        with self._known_lock:
            say = why not in self._said
            self._said.add(why)
        if say:
            log.warning("kvstore: remote tier: refused to upload a record: %s; its children are not "
                        "uploaded either (`kvstore verify` finds it)", why)
        return None

    def _theirs_good(self, s: Sealer, key: str, row: Row, chunk_size: int, size: int) -> bool:
        """Whether the object another node stored at `key` is this record, sealed by the fleet."""
        try:
            theirs = self.bucket.get(key, max_bytes=2 * size + (1 << 20))
        except TooLarge:
            return False
        if theirs is None:  # deleted since: the next node to store it uploads it again
            return True
        rid = RecordId(row.hash, row.ns, row.parent, row.depth, row.kind, row.ntokens, row.first_token,
                       tenant=row.tenant)
        try:
            open_record(s, key, theirs, rid, chunk_size)
        except BlobError:
            return False
        return True

    def _parent_uploaded(self, row: Row) -> bool:
        """Whether the bucket holds `row`'s parent (waiting for its upload if it is queued)."""
        ev = self._inflight.get(row.parent)
        if ev is not None:
            ev.wait(timeout=120)
        seen = self._known.get(row.parent)
        if seen is not None and time.monotonic() - seen < KNOWN_FOR_S:
            return True
        parent = self._row_of(row.parent)
        s = self._sealer(parent) if parent is not None else None
        if s is None:
            return False
        try:  # its key is made from its tokens, read from its blob
            with open_blob(self.blob_root, parent.hash, size=parent.size, checksum=parent.checksum) as blob:
                tokens = blob.tokens()
        except BlobError:
            return False
        found = self.bucket.head(key_of(s, parent, tokens)) is not None
        if found:
            self._remember(row.parent)
        return found

    def _sealer(self, row: Row) -> Sealer | None:
        """The keys `row` is sealed and named with: its namespace's, or its tenant's (None when
        this process does not know the tenant its tag names)."""
        if row.tenant is None:
            return self.fleet.sealer(row.ns)
        tenant = self.fleet.tenant_of(row.tenant)
        return None if tenant is None else self.fleet.sealer(row.ns, tenant)

    def _put_manifest(self, ns: bytes) -> None:
        """The namespace's manifest, once per process; a planted one is replaced."""
        if ns in self._manifest_done or ns not in self.manifests:
            return
        with self._manifest_lock:
            if ns not in self._manifest_done:
                self._put_manifest_once(ns)
                self._manifest_done.add(ns)

    def _put_manifest_once(self, ns: bytes) -> None:
        """A planted manifest is replaced; one written before manifests stated the model's
        geometry is completed by a node that knows it."""
        folder = self.fleet.sealer(ns).folder
        key, box = manifest_key(folder), self.fleet.manifest_box(folder)
        if not self.bucket.put_new(key, box.seal(key, self.manifests[ns])):
            try:
                theirs = self.bucket.get(key, max_bytes=1 << 20)
                if theirs is not None and "geometry" not in json.loads(box.open(key, theirs)) \
                        and "geometry" in json.loads(self.manifests[ns]):
                    self.bucket.put(key, box.seal(key, self.manifests[ns]))
            except (Unauthenticated, TooLarge, ValueError, TypeError):
                self.bucket.put(key, box.seal(key, self.manifests[ns]))
                self.health.count("replaced")

    def _remember(self, h: bytes) -> None:
        with self._known_lock:
            self._known[h] = time.monotonic()
            self._known.move_to_end(h)
            while len(self._known) > _KNOWN_LIMIT:
                self._known.popitem(last=False)
