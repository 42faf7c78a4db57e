"""The store: ties the memory tier, the index and the blob files together.

Data flows one way: caller -> `ModelCache` -> `restore` -> tiers (memory | pending writes | index
and blobs), in that order (`Store.tiers`).
`fetch` never raises for anything that went wrong on disk: a bad record is quarantined and the
caller gets the longest prefix that is still correct.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import sqlite3
import stat
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvstore import keys
from kvstore.errors import InvalidInputError, ModelFilesError, StoreOpenError
from kvstore.model.cache import ModelCache, describe, make_template
from kvstore.storage.index import Index, is_corruption
from kvstore.storage.stale import stale_namespaces
from kvstore.storage.stale import stamps as file_stamps
from kvstore.storage.storedir import BLOBS_NAME, INDEX_NAME, QUARANTINE_NAME, open_dir
from kvstore.tiers.base import DiskTier, MemoryTierView, PendingTier
from kvstore.tiers.memory import MemoryTier
from kvstore.write.writer import Writer

log = logging.getLogger("kvstore")

MEMORY = ":memory:"
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_PENDING_BYTES = 2 << 30
AUTO = "auto"
AUTO_SHARE = 4  # max_bytes="auto": 1/AUTO_SHARE of (what the store holds + the disk's free space)


# Stores still open at interpreter exit get their queued writes flushed (bounded in time).
_OPEN_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()


@atexit.register
def _flush_open_stores() -> None:
    for store in list(_OPEN_STORES):
        try:
            store.flush(timeout=30)
        except Exception:
            pass


def default_path() -> Path:
    """`$KVSTORE_DIR`, else `~/.cache/kvstore`."""
    env = os.environ.get("KVSTORE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstore"


class Store:
    """A prompt-cache store in one directory (or in RAM only, with `path=kvstore.MEMORY`).

    `create=False` opens only an existing store (nothing is created); `read_only=True` never
    writes to it (fetch and stats work, inserts are skipped and counted, gc and repair refuse);
    `read_only=None` is read-only exactly when this user may not write the store.
    """

    def __init__(self, path: str | os.PathLike | None = None, *, max_bytes: int | str | None = None,
                 memory_bytes: int | None = None, chunk_size: int = 256,
                 max_pending_bytes: int = DEFAULT_PENDING_BYTES, fsync: bool = True,
                 create: bool = True, read_only: bool | None = False,
                 remote: str | None = None, remote_deadline: float | None = None):
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidInputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        auto = max_bytes == AUTO
        for name, value in (("max_bytes", None if auto else max_bytes), ("memory_bytes", memory_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                extra = ' or "auto"' if name == "max_bytes" else ""
                raise InvalidInputError(f"{name} must be a non-negative integer{extra}, got {value!r}")
        if remote:  # a bad URL is an error before anything is opened
            from kvstore.remote.s3 import parse_url

            parse_url(remote)
        self.chunk_size = chunk_size
        self.max_bytes = None if auto else max_bytes
        self.max_bytes_rule: str | None = None  # how an automatic budget was found
        self.ram_only = str(path) == MEMORY
        self.read_only = False
        self.memory = MemoryTier(DEFAULT_MEMORY_BYTES if memory_bytes is None else memory_bytes)
        if self.ram_only:
            if memory_bytes == 0:
                raise InvalidInputError("a RAM-only store needs memory_bytes > 0")
            self.path, self.index, self.blob_root = None, None, None
        else:
            # Refuses a folder that is not a store, symbolic links among its own entries, and a
            # lost index (a new, empty one would orphan every blob).
            self.path, self.read_only = open_dir(
                Path(path) if path is not None else default_path(), create=create, read_only=read_only)
            self.blob_root = self.path / BLOBS_NAME
            index_file = self.path / INDEX_NAME
            if not self.read_only:
                flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                os.close(os.open(index_file, flags, 0o600))
            self.index = Index(index_file, read_only=self.read_only)
        if auto:
            self.max_bytes, self.max_bytes_rule = self._auto_budget()
        self._gc_lock = threading.Lock()
        self.remote = self._open_remote(remote, remote_deadline)
        self.counters = {"quarantined": 0, "skipped_inserts": 0, "fetches": 0, "reused_tokens": 0}
        writes = None if self.read_only else self.index
        self.writer = Writer(writes, None if self.read_only else self.blob_root, self.memory,
                             max_pending_bytes,
                             after_batch=self._enforce_budget if self.max_bytes is not None else None,
                             fsync=fsync, after_write=self.remote.submit if self.remote else None)
        # Where fetch reads records from, in order (see `tiers`); a remote tier is one more.
        self.tiers: list = [MemoryTierView(self.memory), PendingTier(self.writer)]
        if self.index is not None:
            self.tiers.append(DiskTier(self.index, self.blob_root, self.writer, self.counters))
        self._closed = False
        _OPEN_STORES.add(self)

    # -- public surface ---------------------------------------------------------------------

    def bind(self, model: Any, model_id: str | os.PathLike, *, kv_bits: int | None = None,
             kv_group_size: int = 64, adapter_path: str | os.PathLike | None = None,
             fingerprint: bytes | None = None) -> ModelCache:
        """A `ModelCache` for a loaded mlx-lm model and the path or repo id it was loaded from.

        The model's files are fingerprinted (memoised in the index by path, size, mtime, inode
        and ctime), so changed weights at the same path never get old K/V. `kv_bits`/`kv_group_size`: the
        caller's caches are `QuantizedKVCache`s (mlx-lm's `--kv-bits`); part of the namespace.
        `fingerprint` skips hashing files (for models that were not loaded from a folder).
        """
        self._check_open()
        if kv_bits is not None and kv_bits not in (2, 3, 4, 5, 6, 8):
            raise InvalidInputError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8, got {kv_bits!r}")
        template = make_template(model, kv_bits, kv_group_size)
        layout, codecs = describe(model, template)
        stamps = None
        if fingerprint is None:
            # Before hashing: a file that changes meanwhile shows as changed (stale) later.
            stamps = self._model_stamps(model_id, adapter_path)
            fingerprint = self._fingerprint(model_id, adapter_path)
        ns = keys.namespace(fingerprint, layout, self.chunk_size)
        mc = ModelCache(self, model, str(model_id), ns, fingerprint, layout, codecs,
                        kv_bits=kv_bits, kv_group_size=kv_group_size)
        mc.registered = self._register(mc, stamps)
        if self.remote is not None:
            self.remote.bind(mc)
        return mc

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every insert so far is durable (and uploaded, with a remote tier).
        False if `timeout` ran out first."""
        end = None if timeout is None else time.monotonic() + timeout
        done = self.writer.flush(timeout)
        if self.remote is not None:
            done = self.remote.flush(None if end is None else max(0.0, end - time.monotonic())) and done
        return done

    def close(self) -> None:
        if self._closed:
            return
        self.writer.close()
        if self.remote is not None:
            self.remote.close()
        _OPEN_STORES.discard(self)
        if self.index is not None:
            self.index.close()
        self._closed = True

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Totals (`bytes`, `chunks`, `tails`), `models` (one dict each), tiers and counters."""
        w = self.writer.stats
        out: dict[str, Any] = {
            "path": str(self.path) if self.path else MEMORY,
            "read_only": self.read_only,
            "chunk_size": self.chunk_size,
            "max_bytes": self.max_bytes,
            "max_bytes_auto": self.max_bytes_rule is not None,
            "max_bytes_rule": self.max_bytes_rule,
            "memory": {"bytes": self.memory.nbytes, "records": len(self.memory),
                       "capacity": self.memory.capacity, "hits": self.memory.hits},
            "writer": {"pending_bytes": self.writer.pending_bytes, "records_written": w.records_written,
                       "bytes_written": w.bytes_written, "dropped_jobs": w.dropped_jobs,
                       "dropped_bytes": w.dropped_bytes, "write_errors": w.write_errors,
                       "last_error": w.last_error, "redundant_dropped": w.redundant_dropped,
                       "redundant_bytes": w.redundant_bytes, "refilled": w.refilled},
            **self.counters,
            "remote": self.remote.stats() if self.remote is not None else None,
        }
        if self.index is not None:
            with self._damage_is_an_error():
                out.update(self.index.totals())
                out["models"] = self.index.models()
                recorded = self.index.model_files()
                why = stale_namespaces(recorded)
                for m in out["models"]:  # None: bound before kvstore recorded its files
                    ns = bytes.fromhex(m["namespace"])
                    m["stale"] = (ns in why) if ns in recorded else None
                    m["stale_reason"] = why.get(ns)
                out["quarantined_total"] = self.index.counters().get("count.quarantined", 0)
                n, size = self.index.quarantined()
                out["quarantined_now"] = {"records": n, "bytes": size}
            out["quarantine_folder"] = _folder_usage(self.path / QUARANTINE_NAME)
        else:
            kinds = self.memory.kinds()
            out.update(bytes=self.memory.nbytes, chunks=kinds.get(0, 0), tails=kinds.get(1, 0),
                       checkpoints=kinds.get(2, 0), models=[])
        return out

    def gc(self, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False,
           stale: bool = False) -> dict:
        """Evict down to `max_bytes` (and records unused for `max_age` seconds; with `stale`, every
        record of a model version whose files are gone or changed, pins aside). A budget evicts
        stale versions first. See `maintenance` and `evict`."""
        from kvstore.upkeep.maintenance import collect

        self._check_open()
        if not dry_run:
            self._check_writable("gc")
        if self.index is None:
            if max_bytes is not None:
                self.memory.trim_to(max_bytes)
            return {"evicted": 0, "freed_bytes": 0, "bytes": self.memory.nbytes, "dry_run": dry_run}
        with self._gc_lock, self._damage_is_an_error():
            old = set(stale_namespaces(self.index.model_files())) if stale or max_bytes is not None else set()
            result = collect(self.index, self.blob_root, max_bytes=max_bytes, max_age=max_age,
                             stale=stale, stale_namespaces=old, dry_run=dry_run)
        if not dry_run:
            self.memory.discard(result.pop("hashes"))
        else:
            result.pop("hashes")
        return result

    def verify(self, repair: bool = False, force: bool = False) -> list:
        """Problems found (empty when clean); `repair=True` fixes them. See `maintenance`.

        Repair deletes at most a small share of the blobs as orphans (no row, or a broken
        chain): more than that means the index, not the blobs, is wrong, and needs `force=True`.
        """
        from kvstore.upkeep.maintenance import verify

        self._check_open()
        if repair:
            self._check_writable("verify --repair")
        if self.index is None:
            return []
        self.flush()
        with self._damage_is_an_error():
            problems = verify(self.index, self.blob_root, repair=repair, force=force,
                              read_only=self.read_only)
        if repair:
            self.memory.clear()
        return problems

    # -- internals --------------------------------------------------------------------------

    def _open_remote(self, url: str | None, deadline: float | None):
        """The remote tier for `url` (`s3://BUCKET/PREFIX`), or None. Contacts nothing yet."""
        if not url:
            return None
        from kvstore.tiers.remote import DEFAULT_DEADLINE_S, RemoteTier

        if self.ram_only:
            raise InvalidInputError("a remote tier needs a store directory (not kvstore.MEMORY)")
        if deadline is not None and (not isinstance(deadline, (int, float)) or deadline < 0):
            raise InvalidInputError(f"remote_deadline must be a non-negative number of seconds, got {deadline!r}")
        tier = RemoteTier(url, deadline=DEFAULT_DEADLINE_S if deadline is None else deadline)
        tier.attach(self)
        return tier

    def _check_open(self) -> None:
        if self._closed:
            raise StoreOpenError("this store is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise StoreOpenError(f"the store {self.path} is open read-only: {what} needs to write "
                                 "to it (open it as a user who may write it)")

    @contextmanager
    def _damage_is_an_error(self):
        """A damaged index found after open is a `CorruptIndexError` that says how to rebuild it."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            if is_corruption(e):
                raise self.index.corrupt(e) from e
            raise

    def _auto_budget(self) -> tuple[int | None, str]:
        """`max_bytes="auto"`: a quarter of the space the store could use at open (what it holds
        plus its disk's free space). Unlike "held + a quarter of free", it does not grow with
        every restart, and it shrinks when other files fill the disk."""
        if self.index is None:
            return None, "auto: a RAM-only store writes no disk (memory_bytes bounds it)"
        held = self.index.totals()["bytes"]
        free = shutil.disk_usage(self.path).free
        budget = (held + free) // AUTO_SHARE
        return budget, (f"auto: 1/{AUTO_SHARE} of ({held} bytes held + {free} bytes free on the "
                        f"store's disk at open) = {budget} bytes")

    def _enforce_budget(self) -> None:
        if self.max_bytes is not None and self.index.totals()["bytes"] > self.max_bytes:
            self.gc(max_bytes=self.max_bytes)

    def _fingerprint(self, model_id, adapter_path) -> bytes:
        model_dir = resolve_model_dir(str(model_id))
        adapter_dir = Path(adapter_path) if adapter_path is not None else None
        if adapter_dir is not None and not adapter_dir.is_dir():
            raise ModelFilesError(f"adapter folder {adapter_dir} does not exist")
        files = keys.model_files(model_dir, adapter_dir)
        if not any(f.name == "config.json" for f in files):
            raise ModelFilesError(f"{model_dir} has no config.json: is it an mlx-lm model folder?")
        lookup = self.index.file_digest if self.index is not None else None
        remember = None
        if self.index is not None and not self.read_only:

            def remember(*args) -> None:
                try:
                    self.index.remember_file_digest(*args)
                except sqlite3.OperationalError:  # only a memo (the disk may be full)
                    pass
        return keys.fingerprint(files, model_dir, lookup, remember)

    def _model_stamps(self, model_id, adapter_path) -> list | None:
        """size/mtime/inode/ctime of the files a fingerprint covers (None if they cannot be
        listed: `_fingerprint` then says why)."""
        try:
            adapter_dir = Path(adapter_path) if adapter_path is not None else None
            return file_stamps(keys.model_files(resolve_model_dir(str(model_id)), adapter_dir))
        except (ModelFilesError, OSError):
            return None

    def _register(self, mc: ModelCache, stamps: list | None = None) -> bool:
        """Record a bound model version in the index (with its files' stamps, to tell later
        whether it went stale); False if the index cannot be written now (a full disk, a
        read-only or busy index): fetch goes on, inserts wait until it works."""
        if self.index is None:
            return True
        if self.read_only:
            return False
        try:
            self.index.register_model(mc.ns, mc.fingerprint, mc.model_id, json.dumps(mc.layout),
                                      self.chunk_size)
            if stamps:
                self.index.record_model_files(mc.ns, stamps)
            return True
        except sqlite3.OperationalError as e:
            log.warning("kvstore: cannot record model %s in the index (%s): serving reads only "
                        "until it can be written", mc.model_id, e)
            return False



def resolve_model_dir(model_id: str) -> Path:
    """The local folder of a model path or an already-downloaded Hugging Face repo id."""
    p = Path(model_id).expanduser()
    if p.is_dir():
        return p.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as e:
        raise ModelFilesError(
            f"cannot find the files of model {model_id!r} to fingerprint them: pass the local "
            "folder it was loaded from (or a repo id that is already downloaded)") from e


def open(path: str | os.PathLike | None = None, *, max_bytes: int | str | None = None,
         memory_bytes: int | None = None, chunk_size: int = 256, remote: str | None = None,
         **options) -> Store:
    """Open (creating if needed) the store at `path`, `$KVSTORE_DIR` or `~/.cache/kvstore`.

    `max_bytes` bounds the disk (the writer evicts to stay within it); `max_bytes="auto"` sets it
    at open to a quarter of (what the store holds + its disk's free space): `stats()` shows the
    number and the rule.

    `path=kvstore.MEMORY` keeps everything in RAM (nothing is written); `memory_bytes=0` turns
    the memory tier off (every fetch reads the disk). A folder that is not a store (it holds
    files but no kvstore index) is refused, never used. `create=False` opens only an existing
    store; `read_only=True` (or `None`: when this user may not write it) writes nothing.
    `remote="s3://BUCKET/PREFIX"` shares the store with other nodes through an S3-compatible
    object store (see `kvstore.tiers.remote`); `remote_deadline` (seconds, default 1) bounds the remote
    part of each fetch.
    """
    return Store(path, max_bytes=max_bytes, memory_bytes=memory_bytes, chunk_size=chunk_size,
                 remote=remote, **options)


def _folder_usage(folder: Path) -> dict[str, int]:
    """{"files", "bytes"} of the regular files under a folder (no link is followed)."""
    files = size = 0
    if folder.is_symlink():
        return {"files": 0, "bytes": 0}
    for top, _, names in os.walk(folder):
        for name in names:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            files += 1
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return {"files": files, "bytes": size}
