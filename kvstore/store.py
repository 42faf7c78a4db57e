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
import sqlite3
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import keys
from .errors import CorruptIndexError, InvalidInputError, ModelFilesError, StoreOpenError
from .index import Index, is_corruption
from .memory import MemoryTier
from .modelcache import ModelCache, describe, make_template
from .tiers import DiskTier, MemoryTierView, PendingTier
from .writer import Writer

log = logging.getLogger("kvstore")

MEMORY = ":memory:"
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_PENDING_BYTES = 2 << 30
INDEX_NAME = "index.sqlite"
BLOBS_NAME = "blobs"


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
    """A prompt-cache store in one directory (or in RAM only, with `path=kvstore.MEMORY`)."""

    def __init__(self, path: str | os.PathLike | None = None, *, max_bytes: int | None = None,
                 memory_bytes: int | None = None, chunk_size: int = 256,
                 max_pending_bytes: int = DEFAULT_PENDING_BYTES, fsync: bool = True):
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidInputError(f"chunk_size must be a positive integer, got {chunk_size!r}")
        for name, value in (("max_bytes", max_bytes), ("memory_bytes", memory_bytes)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise InvalidInputError(f"{name} must be a non-negative integer, got {value!r}")
        self.chunk_size = chunk_size
        self.max_bytes = max_bytes
        self.ram_only = str(path) == MEMORY
        self.memory = MemoryTier(DEFAULT_MEMORY_BYTES if memory_bytes is None else memory_bytes)
        if self.ram_only:
            if memory_bytes == 0:
                raise InvalidInputError("a RAM-only store needs memory_bytes > 0")
            self.path, self.index, self.blob_root = None, None, None
        else:
            self.path = _prepare_dir(Path(path).expanduser() if path is not None else default_path())
            self.blob_root = self.path / BLOBS_NAME
            index_file = self.path / INDEX_NAME
            if _index_lost(index_file, self.blob_root):  # a new, empty index would orphan every blob
                raise CorruptIndexError(
                    f"the index {index_file} is missing or empty but {self.blob_root} holds blobs; "
                    f"run `kvstore verify --repair --store {self.path}` to rebuild it from them")
            if not index_file.exists():
                os.close(os.open(index_file, os.O_WRONLY | os.O_CREAT, 0o600))
            self.index = Index(index_file)
        self._gc_lock = threading.Lock()
        self.counters = {"quarantined": 0, "skipped_inserts": 0, "fetches": 0, "reused_tokens": 0}
        self.writer = Writer(self.index, self.blob_root, self.memory, max_pending_bytes,
                             after_batch=self._enforce_budget if max_bytes is not None else None,
                             fsync=fsync)
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

        The model's files are fingerprinted (memoised in the index by path, size and mtime), so
        changed weights at the same path never get old K/V. `kv_bits`/`kv_group_size`: the
        caller's caches are `QuantizedKVCache`s (mlx-lm's `--kv-bits`); part of the namespace.
        `fingerprint` skips hashing files (for models that were not loaded from a folder).
        """
        self._check_open()
        if kv_bits is not None and kv_bits not in (2, 3, 4, 5, 6, 8):
            raise InvalidInputError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8, got {kv_bits!r}")
        template = make_template(model, kv_bits, kv_group_size)
        layout, codecs = describe(model, template)
        if fingerprint is None:
            fingerprint = self._fingerprint(model_id, adapter_path)
        ns = keys.namespace(fingerprint, layout, self.chunk_size)
        mc = ModelCache(self, model, str(model_id), ns, fingerprint, layout, codecs,
                        kv_bits=kv_bits, kv_group_size=kv_group_size)
        mc.registered = self._register(mc)
        return mc

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every insert so far is durable. False if `timeout` ran out first."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self.writer.close()
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
            "chunk_size": self.chunk_size,
            "max_bytes": self.max_bytes,
            "memory": {"bytes": self.memory.nbytes, "records": len(self.memory),
                       "capacity": self.memory.capacity, "hits": self.memory.hits},
            "writer": {"pending_bytes": self.writer.pending_bytes, "records_written": w.records_written,
                       "bytes_written": w.bytes_written, "dropped_jobs": w.dropped_jobs,
                       "dropped_bytes": w.dropped_bytes, "write_errors": w.write_errors,
                       "last_error": w.last_error},
            **self.counters,
        }
        if self.index is not None:
            with self._damage_is_an_error():
                out.update(self.index.totals())
                out["models"] = self.index.models()
                out["quarantined_total"] = self.index.counters().get("count.quarantined", 0)
        else:
            kinds = self.memory.kinds()
            out.update(bytes=self.memory.nbytes, chunks=kinds.get(0, 0), tails=kinds.get(1, 0),
                       checkpoints=kinds.get(2, 0), models=[])
        return out

    def gc(self, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False) -> dict:
        """Evict down to `max_bytes` (and records unused for `max_age` seconds); see `maintenance`."""
        from .maintenance import collect

        self._check_open()
        if self.index is None:
            if max_bytes is not None:
                self.memory.trim_to(max_bytes)
            return {"evicted": 0, "freed_bytes": 0, "bytes": self.memory.nbytes, "dry_run": dry_run}
        with self._gc_lock, self._damage_is_an_error():
            result = collect(self.index, self.blob_root, max_bytes=max_bytes, max_age=max_age,
                             dry_run=dry_run)
        if not dry_run:
            self.memory.discard(result.pop("hashes"))
        else:
            result.pop("hashes")
        return result

    def verify(self, repair: bool = False) -> list:
        """Problems found (empty when clean); `repair=True` fixes them. See `maintenance`."""
        from .maintenance import verify

        self._check_open()
        if self.index is None:
            return []
        self.flush()
        with self._damage_is_an_error():
            problems = verify(self.index, self.blob_root, repair=repair)
        if repair:
            self.memory.clear()
        return problems

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreOpenError("this store is closed")

    @contextmanager
    def _damage_is_an_error(self):
        """A damaged index found after open is a `CorruptIndexError` that says how to rebuild it."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            if is_corruption(e):
                raise self.index.corrupt(e) from e
            raise

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
        lookup = remember = None
        if self.index is not None:
            lookup = self.index.file_digest

            def remember(*args) -> None:
                try:
                    self.index.remember_file_digest(*args)
                except sqlite3.OperationalError:  # only a memo (the disk may be full)
                    pass
        return keys.fingerprint(files, model_dir, lookup, remember)

    def _register(self, mc: ModelCache) -> bool:
        """Record a bound model version in the index; False if the index cannot be written now
        (a full disk, a read-only or busy index): fetch goes on, inserts wait until it works."""
        if self.index is None:
            return True
        try:
            self.index.register_model(mc.ns, mc.fingerprint, mc.model_id, json.dumps(mc.layout),
                                      self.chunk_size)
            return True
        except sqlite3.OperationalError as e:
            log.warning("kvstore: cannot record model %s in the index (%s): serving reads only "
                        "until it can be written", mc.model_id, e)
            return False


def _index_lost(index_file: Path, blob_root: Path) -> bool:
    """No index (or an empty one) beside a blob tree with blob folders: it was deleted or lost."""
    for f in (index_file, Path(f"{index_file}-wal")):
        try:
            if f.stat().st_size > 0:
                return False
        except FileNotFoundError:
            pass
    try:
        with os.scandir(blob_root) as entries:
            return any(len(e.name) == 2 and e.is_dir(follow_symlinks=False) for e in entries)
    except OSError:
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


def _prepare_dir(path: Path) -> Path:
    """Create the store directory (0700) or check an existing one is a writable directory."""
    path = path.resolve()  # `a/../s` is `s`: no folder `a` is made on the way
    if path.exists() and not path.is_dir():
        raise StoreOpenError(f"store path {path} exists and is not a directory")
    try:
        created = not path.exists()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if created:
            os.chmod(path, 0o700)
        (path / BLOBS_NAME).mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise StoreOpenError(f"cannot create the store directory {path}: {e.strerror or e}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise StoreOpenError(f"store directory {path} is not writable by this user")
    return path


def open(path: str | os.PathLike | None = None, *, max_bytes: int | None = None,
         memory_bytes: int | None = None, chunk_size: int = 256, **options) -> Store:
    """Open (creating if needed) the store at `path`, `$KVSTORE_DIR` or `~/.cache/kvstore`.

    `path=kvstore.MEMORY` keeps everything in RAM (nothing is written); `memory_bytes=0` turns
    the memory tier off (every fetch reads the disk).
    """
    return Store(path, max_bytes=max_bytes, memory_bytes=memory_bytes, chunk_size=chunk_size, **options)
