"""The remote tier: a store shared by every node through an S3-compatible object store.

A record's object is its local blob file, byte for byte: it carries its tokens, parent, depth,
kind, namespace and (blob format 2) a checksum per tensor, so every object checks itself.

- Write-behind: after the writer commits rows, `submit` queues them; worker threads upload each
  blob with a create-only PUT, parents before children (a child waits for its parent's upload and
  is skipped if its parent is not in the bucket). The queue is bounded by bytes; what it cannot
  hold is dropped and counted. Only rows the writer wrote are ever queued, so a node never uploads
  what it downloaded (`fill` adds rows to the index directly, never through the writer).
- Read-through: `fill(mc, tokens)` runs before a local lookup. On a local miss it finds the
  deepest chunk of the prompt in the bucket by a binary search of HEADs, lists that chunk's
  children for the next token, downloads what is missing in parallel, checks every object (its
  checksums, and that its tokens hash to its key) and stores it locally, in chain order, so the
  local fetch that follows restores it. All of that runs under one deadline; past it, whatever
  was stored is used and the rest is left.
- Faults: nothing here raises into the caller. Errors are counted, and after a failed request
  the remote is left alone for a few seconds (`RETRY_AFTER_S`), so a dead endpoint costs one
  failed request, not one per fetch.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Iterable

import numpy as np
import xxhash

from kvstore import keys
from kvstore.errors import BlobError
from kvstore.keys import checkpoint_hash
from kvstore.remote.objects import check_object, check_record, write_blob
from kvstore.remote.s3 import LAYOUT_VERSION, Bucket, RemoteError, children_prefix, manifest_key, parse_key, record_key
from kvstore.storage import blobtree
from kvstore.storage.index import CHECKPOINT, CHUNK, TAIL, Row

if TYPE_CHECKING:
    from kvstore.model.cache import ModelCache
    from kvstore.store import Store

log = logging.getLogger("kvstore")

#: Default deadline of the remote part of one fetch, in seconds (see README "Remote tier").
DEFAULT_DEADLINE_S = 1.0
DEFAULT_UPLOAD_BYTES = 1 << 30
RETRY_AFTER_S = 5.0
MAX_CANDIDATES = 4  # children of the deepest chunk downloaded to compare their tokens
_KNOWN_LIMIT = 1 << 16
_COUNTER_PREFIX = "count.remote."


class RemoteTier:
    """The remote tier of one open store (`kvstore.open(path, remote="s3://BUCKET/PREFIX")`)."""

    def __init__(self, url: str, *, deadline: float = DEFAULT_DEADLINE_S,
                 max_upload_bytes: int = DEFAULT_UPLOAD_BYTES, upload_threads: int = 4,
                 download_threads: int = 8, bucket: Bucket | None = None):
        self.url = url
        self.bucket = bucket or Bucket(url)
        self.deadline = float(deadline)
        self.retry_after = RETRY_AFTER_S
        self.max_upload_bytes = max_upload_bytes
        self.counters = dict.fromkeys((
            "uploads", "upload_bytes", "already_there", "upload_errors", "dropped_uploads",
            "dropped_upload_bytes", "skipped_old_format", "skipped_no_parent", "lookups", "heads",
            "lists", "downloads", "download_bytes", "remote_hits", "remote_tokens", "corrupt_objects",
            "errors", "deadline_misses", "skipped_down"), 0)
        self.last_error = ""
        self._persisted: dict[str, int] = {}
        self._counter_lock = threading.Lock()
        self._store: "Store | None" = None
        self._manifests: dict[bytes, bytes] = {}  # ns -> manifest JSON (uploaded once per process)
        self._manifest_done: set[bytes] = set()
        self._known: OrderedDict[bytes, None] = OrderedDict()  # hashes the bucket is known to hold
        self._inflight: dict[bytes, threading.Event] = {}
        self._queue: deque[list[Row]] = deque()
        self._queued_bytes = 0
        self._active = 0
        self._cond = threading.Condition()
        self._stop = False
        self._down_until = 0.0
        self._pool = ThreadPoolExecutor(download_threads, thread_name_prefix="kvstore-remote-get")
        self._workers = [threading.Thread(target=self._upload_loop, name=f"kvstore-remote-put-{i}", daemon=True)
                         for i in range(upload_threads)]
        for w in self._workers:
            w.start()

    # -- wiring ---------------------------------------------------------------------------------

    def attach(self, store: "Store") -> None:
        self._store = store

    def bind(self, mc: "ModelCache") -> None:
        """Remember a bound model's manifest, uploaded before the first record of its namespace."""
        self._manifests[mc.ns] = json.dumps({
            "layout_version": LAYOUT_VERSION, "format": keys.FORMAT_VERSION, "namespace": mc.ns.hex(),
            "fingerprint": mc.fingerprint.hex(), "model_id": mc.model_id, "chunk_size": mc.chunk_size,
            "layout": mc.layout}, sort_keys=True).encode()

    def stats(self) -> dict:
        """This process's counters, and `totals`: every process's on this store, so far."""
        with self._cond:
            pending = self._queued_bytes
        totals = dict.fromkeys(self.counters, 0)
        index = self._store.index if self._store is not None else None
        if index is not None:
            try:
                for key, value in index.counters().items():
                    if key.startswith(_COUNTER_PREFIX) and key[len(_COUNTER_PREFIX):] in totals:
                        totals[key[len(_COUNTER_PREFIX):]] = value
            except Exception:
                pass
        for key, value in self.counters.items():
            totals[key] += value - self._persisted.get(key, 0)
        return {"url": self.url, "deadline_s": self.deadline, "pending_upload_bytes": pending,
                "last_error": self.last_error, **self.counters, "totals": totals}

    def gc(self, *, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False) -> dict:
        """Bound the bucket (see `remote_maint.collect_remote`); this node's pins are published first."""
        from kvstore.remote.upkeep import collect_remote

        self.flush(60)
        self.publish_pins()
        return collect_remote(self.bucket, max_bytes=max_bytes, max_age=max_age, dry_run=dry_run)

    def verify(self, *, repair: bool = False) -> list:
        """Problems of the bucket's objects (see `remote_maint.verify_remote`)."""
        from kvstore.remote.upkeep import verify_remote

        self.flush(60)
        return verify_remote(self.bucket, repair=repair)

    def publish_pins(self, namespaces=None) -> int:
        """Write this node's pins object(s): what gc on any node must keep."""
        from kvstore.remote.upkeep import node_id, publish_pins

        store = self._store
        if store is None or store.index is None:
            return 0
        return publish_pins(self.bucket, store.index, node_id(store.path), namespaces)

    def _sync_pins(self) -> None:
        """Publish this node's pins of the models bound here if the bucket's copy differs (a
        prompt pinned without a new upload, like `warm` pinning what it downloaded)."""
        store = self._store
        if store is None or store.index is None or time.monotonic() < self._down_until:
            return
        from kvstore.remote.s3 import pins_key
        from kvstore.remote.upkeep import node_id

        try:
            node = node_id(store.path)
            for ns in self._manifests:
                mine = sorted(h.hex() for h in store.index.pinned(ns))
                body = self.bucket.get(pins_key(ns, node))
                theirs = json.loads(body).get("pinned") if body else []
                if mine != theirs:
                    self.publish_pins([ns])
        except Exception as e:
            self._count_error(e)

    def _persist_counters(self) -> None:
        """Add what was counted since the last call to the store's totals (`kvstore stats`)."""
        index = self._store.index if self._store is not None else None
        if index is None:
            return
        now = dict(self.counters)
        deltas = {_COUNTER_PREFIX + k: v - self._persisted.get(k, 0) for k, v in now.items()
                  if v != self._persisted.get(k, 0)}
        if not deltas:
            return
        try:
            index.bump_counters(deltas)
            self._persisted = now
        except Exception:  # only statistics (the index may be busy or read-only)
            pass

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done (or dropped). False if `timeout` ran out."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._active:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(left, 0.5))
        self._persist_counters()
        return True

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._sync_pins()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for w in self._workers:
            w.join(timeout=1.0)
        self._persist_counters()

    # -- write-behind ---------------------------------------------------------------------------

    def submit(self, rows: list[Row]) -> None:
        """Queue rows the writer just committed (parents before children). Never raises."""
        try:
            rows = list(rows)
            size = sum(r.size for r in rows)
            with self._cond:
                if self._stop:
                    return
                if self._queued_bytes + size > self.max_upload_bytes and self._queued_bytes:
                    self._count("dropped_uploads", len(rows))
                    self._count("dropped_upload_bytes", size)
                    return
                for r in rows:
                    self._inflight.setdefault(r.hash, threading.Event())
                self._queue.append(rows)
                self._queued_bytes += size
                self._cond.notify_all()
        except Exception as e:  # the writer thread must go on whatever happens here
            self._count_error(e)

    def _upload_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                rows = self._queue.popleft()
                self._active += 1
            try:
                for row in rows:
                    try:
                        if self._upload(row):
                            self._remember(row.hash)
                    except Exception as e:
                        self._count("upload_errors", 1)
                        self._count_error(e)
                    finally:
                        ev = self._inflight.pop(row.hash, None)
                        if ev is not None:
                            ev.set()
                pinned = {r.ns for r in rows if r.pinned and r.hash in self._known}
                if pinned:
                    try:
                        self.publish_pins(pinned)
                    except Exception as e:
                        self._count_error(e)
            finally:
                with self._cond:
                    self._active -= 1
                    self._queued_bytes -= sum(r.size for r in rows)
                    self._cond.notify_all()

    def _upload(self, row: Row) -> bool:
        """Upload one record; True if the bucket holds it afterwards."""
        store = self._store
        if row.parent != row.ns and not self._parent_uploaded(row):
            self._count("skipped_no_parent", 1)
            return False
        try:
            with open(os.open(blobtree.blob_path(store.blob_root, row.hash), os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                buf = f.read()
        except OSError:  # evicted (or damaged) locally since it was written: nothing to share
            return False
        if xxhash.xxh3_64_intdigest(buf) != row.checksum:
            return False
        try:
            _, meta = check_object(buf, row.hash)
        except BlobError:
            self._count("skipped_old_format", 1)
            return False
        if meta.get("ns") != row.ns.hex():
            return False
        self._put_manifest(row.ns)
        created = self.bucket.put_new(_key_of(row), buf)
        if created:
            self._count("uploads", 1)
            self._count("upload_bytes", len(buf))
        else:
            self._count("already_there", 1)
        return True

    def _parent_uploaded(self, row: Row) -> bool:
        """Whether the bucket holds `row`'s parent (waiting for its upload if it is queued)."""
        ev = self._inflight.get(row.parent)
        if ev is not None:
            ev.wait(timeout=120)
        if row.parent in self._known:
            return True
        parent = self._store.index.get(row.parent) if self._store.index is not None else None
        if parent is None:
            return False
        found = self.bucket.head(_key_of(parent)) is not None
        if found:
            self._remember(row.parent)
        return found

    def _put_manifest(self, ns: bytes) -> None:
        if ns in self._manifest_done or ns not in self._manifests:
            return
        self.bucket.put_new(manifest_key(ns), self._manifests[ns])
        self._manifest_done.add(ns)

    def _remember(self, h: bytes) -> None:
        with self._counter_lock:
            self._known[h] = None
            self._known.move_to_end(h)
            while len(self._known) > _KNOWN_LIMIT:
                self._known.popitem(last=False)

    # -- read-through ---------------------------------------------------------------------------

    def fill(self, mc: "ModelCache", toks: np.ndarray) -> int:
        """Bring what the bucket has of `toks` beyond the local store into it, within the
        deadline. Returns how many more tokens are stored locally now. Never raises."""
        if time.monotonic() < self._down_until:
            self._count("skipped_down", 1)
            return 0
        end = time.monotonic() + self.deadline
        try:
            return self._fill(mc, toks, end)
        except _Late:  # the lookup itself was too slow: leave the remote alone for a while
            self._count("deadline_misses", 1)
            self._down_until = time.monotonic() + self.retry_after
            return 0
        except Exception as e:
            self._count_error(e)
            return 0

    def _fill(self, mc: "ModelCache", toks: np.ndarray, end: float) -> int:
        store, C = mc.store, mc.chunk_size
        if store.index is None:
            return 0
        before = mc.stored_length(toks)
        if before >= len(toks) - 1:
            return 0
        self._count("lookups", 1)
        chain = keys.chain(mc.ns, toks, C)
        local = before // C
        keys_ = chunk_keys(mc.ns, toks, chain, C)
        depth = self.deepest(keys_, local, end)
        parents = [mc.ns] + chain[:-1]
        # What to download: the chain beyond the local part (but what is local further down,
        # after a damaged record was quarantined), then the best children.
        here = _local(store, chain[local:depth])
        wanted: list[tuple[str, bytes, bytes, int, int]] = [  # (key, hash, parent, depth, kind)
            (keys_[i], chain[i], parents[i], i + 1, CHUNK) for i in range(local, depth) if chain[i] not in here]
        parent = chain[depth - 1] if depth else mc.ns
        rest = toks[depth * C :]
        if len(rest) > 1:
            listed = self._call(self.bucket.list, children_prefix(mc.ns, parent, int(rest[0])), end=end)
            self._count("lists", 1)
            children = [k for k in (parse_key(p, s, t) for p, s, t in listed) if k is not None
                        and k.parent == parent and k.ns == mc.ns]
            have = _local(store, [k.hash for k in children])
            for k in _best_children(children, parent, rest):
                if k.hash not in have:
                    wanted.append((k.path, k.hash, parent, depth + 1, k.kind))
        if mc.checkpointed:  # recurrent layers restore only where a checkpoint was taken
            ends = [(w[1], w[3]) for w in wanted] + ([(chain[local - 1], local)] if local else [])
            for h, d in ends:
                ck = checkpoint_hash(h)
                wanted.append((record_key(mc.ns, h, ck, CHECKPOINT, 0, None), ck, h, d, CHECKPOINT))
            have = _local(store, [w[1] for w in wanted if w[4] == CHECKPOINT])
            wanted = [w for w in wanted if w[4] != CHECKPOINT or w[1] not in have]
        if not wanted:
            return 0
        futures = [self._pool.submit(self.bucket.get, w[0]) for w in wanted]
        stored: set[bytes] = set(chain[:local]) | here
        try:
            for (key, h, par, d, kind), fut in zip(wanted, futures):
                if par != mc.ns and par not in stored and not _local(store, [par]):
                    continue  # its parent did not arrive: it would hang from nothing
                try:
                    buf = fut.result(timeout=max(0.0, end - time.monotonic()))
                except FutureTimeout:  # past the deadline: keep what arrived, serve the rest locally
                    self._count("deadline_misses", 1)
                    break
                except RemoteError as e:
                    self._count_error(e)
                    continue
                if buf is None:
                    continue  # a checkpoint that was never taken, or gc'd meanwhile
                self._count("downloads", 1)
                self._count("download_bytes", len(buf))
                if self._keep(mc, key, h, par, d, kind, buf):
                    stored.add(h)
        finally:
            for fut in futures:
                fut.cancel()
            gained = mc.stored_length(toks) - before
            if gained > 0:
                self._count("remote_hits", 1)
                self._count("remote_tokens", gained)
        return max(0, gained)

    def deepest(self, chunk_keys: list[str], known: int, end: float) -> int:
        """How many chunks of a chain the bucket holds (`known` of them are known to be there or
        are not needed). Chunks are uploaded parents first and deleted children first, so presence
        along a chain is a prefix: the deepest one is probed first (a repeated prompt), then a
        binary search of HEADs finds the end (7 requests for 128 chunks)."""
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

    def _keep(self, mc: "ModelCache", key: str, h: bytes, parent: bytes, depth: int, kind: int,
              buf: bytes) -> bool:
        """Check a downloaded object and store it locally (blob, then row). False if it is bad."""
        store = mc.store
        try:
            tokens = check_record(buf, h, mc.ns, parent, depth, kind, mc.chunk_size)
        except BlobError as e:
            self._count("corrupt_objects", 1)
            log.warning("kvstore: remote object %s is damaged, not used: %s", key, e)
            return False
        row = Row(h, mc.ns, parent, depth, kind, len(tokens) // 4, keys.first_token(tokens), len(buf),
                  xxhash.xxh3_64_intdigest(buf))
        with blobtree.tree_lock(store.blob_root, exclusive=False):
            if store.index.present([h]):
                return True
            # Not fsynced: the bucket holds this record, and a copy a power cut tears fails its
            # checksum when read, is quarantined and is downloaded again (measured: fsync was
            # 0.1 to 0.6 s of a 1 s restore of 2k tokens, bench/remote.py).
            write_blob(store.blob_root, h, buf, fsync=False)
            store.index.insert([row])
        return True

    def _head(self, key: str, end: float) -> bool:
        self._count("heads", 1)
        return self._call(self.bucket.head, key, end=end) is not None

    def _call(self, fn, *args, end: float):
        """Run a request on the pool and wait for it until `end` (raises _Late after)."""
        fut: Future = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:
            fut.cancel()
            raise _Late from None

    def _count(self, key: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[key] += n

    def _count_error(self, e: BaseException) -> None:
        self._count("errors", 1)
        self.last_error = f"{type(e).__name__}: {e}"
        if isinstance(e, RemoteError):
            self._down_until = time.monotonic() + self.retry_after
        log.warning("kvstore: remote tier: %s", self.last_error)


class _Late(Exception):
    """The deadline of the remote part of a fetch has passed."""


def _local(store: "Store", hashes: list[bytes]) -> set[bytes]:
    """Which of `hashes` the local store holds: in memory, queued for the writer, or indexed."""
    here = {h for h in hashes if h in store.memory or store.writer.is_pending(h)}
    rest = [h for h in hashes if h not in here]
    if rest and store.index is not None:
        here |= store.index.present(rest)
    return here


def chunk_keys(ns: bytes, toks: np.ndarray, chain: list[bytes], chunk_size: int) -> list[str]:
    """The object keys of the chunks of a prompt (`chain` = its chunk hashes)."""
    parents = [ns] + chain[:-1]
    return [record_key(ns, parents[i], h, CHUNK, chunk_size, int(toks[i * chunk_size]))
            for i, h in enumerate(chain)]


def _key_of(row: Row) -> str:
    return record_key(row.ns, row.parent, row.hash, row.kind, row.ntokens, row.first_token)


def _best_children(children: Iterable, parent: bytes, rest: np.ndarray) -> list:
    """The children worth downloading: the longest one whose key proves it is a prefix of `rest`
    (a tail's hash is of its parent and tokens), or, when none covers `rest`, a few others to
    compare by their tokens (a branch inside a stored tail reuses the common part)."""
    exact, others = None, []
    for k in children:
        if k.kind == TAIL and k.ntokens <= len(rest) and keys.tail_hash(parent, rest[: k.ntokens]) == k.hash:
            if exact is None or k.ntokens > exact.ntokens:
                exact = k
        else:
            others.append(k)
    if exact is not None and exact.ntokens >= len(rest) - 1:
        return [exact]
    others.sort(key=lambda k: -k.modified)
    return ([exact] if exact else []) + others[: MAX_CANDIDATES - (exact is not None)]
