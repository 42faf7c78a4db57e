"""The store: ties the memory tier, the index and the blob files together.

Data flows one way: caller -> `ModelCache` -> (memory tier | pending writes | index -> blobs).
`fetch` never raises for anything that went wrong on disk: a bad record is quarantined and the
caller gets the longest prefix that is still correct.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from . import blobs, keys
from .codecs import Codec, codec_for
from .errors import BlobError, InvalidInputError, ModelFilesError, StoreOpenError
from .index import CHUNK, TAIL, Index, Row
from .memory import MemoryTier, Record
from .writer import Job, Spec, Writer

log = logging.getLogger("kvstore")

MEMORY = ":memory:"
DEFAULT_MEMORY_BYTES = 1 << 30
DEFAULT_PENDING_BYTES = 2 << 30
INDEX_NAME = "index.sqlite"
BLOBS_NAME = "blobs"


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
            if not index_file.exists():
                os.close(os.open(index_file, os.O_WRONLY | os.O_CREAT, 0o600))
            self.index = Index(index_file)
        self._gc_lock = threading.Lock()
        self.counters = {"quarantined": 0, "skipped_inserts": 0, "fetches": 0, "reused_tokens": 0}
        self.writer = Writer(self.index, self.blob_root, self.memory, max_pending_bytes,
                             after_batch=self._enforce_budget if max_bytes is not None else None,
                             fsync=fsync)
        self._closed = False

    # -- public surface ---------------------------------------------------------------------

    def bind(self, model: Any, model_id: str | os.PathLike, *, adapter_path: str | os.PathLike | None = None,
             fingerprint: bytes | None = None) -> "ModelCache":
        """A `ModelCache` for a loaded mlx-lm model and the path or repo id it was loaded from.

        The model's files are fingerprinted (memoised in the index by path, size and mtime), so
        changed weights at the same path never get old K/V.
        """
        self._check_open()
        template = make_prompt_cache(model)
        layout, codecs = describe(model, template)
        if fingerprint is None:
            fingerprint = self._fingerprint(model_id, adapter_path)
        ns = keys.namespace(fingerprint, layout, self.chunk_size)
        if self.index is not None:
            self.index.register_model(ns, fingerprint, str(model_id), json.dumps(layout), self.chunk_size)
        return ModelCache(self, model, str(model_id), ns, fingerprint, layout, codecs)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every insert so far is durable. False if `timeout` ran out first."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self.writer.close()
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
            out.update(self.index.totals())
            out["models"] = self.index.models()
            out["quarantined_total"] = self.index.counters().get("count.quarantined", 0)
        else:
            out.update(bytes=self.memory.nbytes, chunks=sum(1 for _ in ()), tails=0, models=[])
        return out

    def gc(self, max_bytes: int | None = None, max_age: float | None = None, dry_run: bool = False) -> dict:
        """Evict down to `max_bytes` (and records unused for `max_age` seconds); see `maintenance`."""
        from .maintenance import collect

        self._check_open()
        if self.index is None:
            if max_bytes is not None:
                self.memory.trim_to(max_bytes)
            return {"evicted": 0, "freed_bytes": 0, "bytes": self.memory.nbytes, "dry_run": dry_run}
        with self._gc_lock:
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
        problems = verify(self.index, self.blob_root, repair=repair)
        if repair:
            self.memory.clear()
        return problems

    # -- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreOpenError("this store is closed")

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
            lookup, remember = self.index.file_digest, self.index.remember_file_digest
        return keys.fingerprint(files, model_dir, lookup, remember)

    def _read(self, h: bytes, row: Row) -> Record | None:
        """A record from disk, checked; None (quarantined and counted) if it is damaged."""
        try:
            arrays, meta = blobs.read(self.blob_root, h, size=row.size, checksum=row.checksum)
            tokens = arrays.pop("tokens", None)
            if tokens is None or np.asarray(tokens).tobytes() != row.tokens:
                raise BlobError(f"record {h.hex()}: its tokens differ from the index")
            mx.eval(list(arrays.values()))
        except BlobError as e:
            log.warning("kvstore: quarantined a damaged record: %s", e)
            self.counters["quarantined"] += 1
            try:
                if self.index.mark_bad(h):
                    self.index.bump_counter("count.quarantined")
            except Exception:  # the index may be busy or read-only; the miss is what matters
                pass
            return None
        return Record(h, row.ns, row.parent, row.depth, row.kind,
                      np.frombuffer(row.tokens, dtype="<i4"), arrays)


class ModelCache:
    """The store as seen by one model version: `fetch` and `insert` token sequences."""

    def __init__(self, store: Store, model, model_id: str, ns: bytes, fingerprint: bytes,
                 layout: dict, codecs: list[Codec] | None):
        self.store, self.model, self.model_id = store, model, model_id
        self.ns, self.fingerprint, self.layout = ns, fingerprint, layout
        self.codecs = codecs
        self.chunk_size = store.chunk_size
        self._metadata = {"format": str(keys.FORMAT_VERSION), "ns": ns.hex(),
                          "fingerprint": fingerprint.hex(), "model_id": model_id,
                          "chunk_size": str(self.chunk_size)}

    @property
    def supported(self) -> bool:
        """False when a layer's cache class has no codec: such a model is never stored."""
        return self.codecs is not None

    def new_cache(self) -> list:
        return make_prompt_cache(self.model)

    # -- fetch ------------------------------------------------------------------------------

    def fetch(self, tokens: Sequence[int] | np.ndarray | mx.array) -> tuple[list, list[int]]:
        """The cache of the longest stored prefix of `tokens` and the tokens still to process.

        At least one token is always left. On a miss: a fresh cache and all of `tokens`.
        """
        toks = _tokens(tokens)
        self.store._check_open()
        self.store.counters["fetches"] += 1
        if not self.supported or len(toks) < 2:
            return self.new_cache(), toks.tolist()
        path, length = self._longest(toks)
        length = min(length, len(toks) - 1)
        if length <= 0:
            return self.new_cache(), toks.tolist()
        records, length = self._load(path, length)
        if length <= 0:
            return self.new_cache(), toks.tolist()
        cache = self._assemble(records, length)
        self.store.counters["reused_tokens"] += length
        return cache, toks[length:].tolist()

    def _longest(self, toks: np.ndarray) -> tuple[list[tuple[bytes, Row | None]], int]:
        """The chain of records covering the longest stored prefix, and its length."""
        C, store = self.chunk_size, self.store
        hashes = keys.chain(self.ns, toks, C)
        local = [h in store.memory or store.writer.is_pending(h) for h in hashes]
        on_disk: set[bytes] = set()
        if store.index is not None and not all(local):
            on_disk = store.index.present([h for h, here in zip(hashes, local) if not here])
        depth = 0
        while depth < len(hashes) and (local[depth] or hashes[depth] in on_disk):
            depth += 1
        path: list[tuple[bytes, Row | None]] = [(h, None) for h in hashes[:depth]]
        parent = hashes[depth - 1] if depth else self.ns
        rest = toks[depth * C :]
        best, best_len = None, 0
        if len(rest):
            for rec in store.memory.children(parent) + store.writer.pending_children(parent):
                n = keys.common_prefix(rec.tokens, rest)
                if n > best_len:
                    best, best_len = (rec.hash, None), n
            if store.index is not None and best_len < min(len(rest), C):
                for row in store.index.children(parent):
                    n = keys.common_prefix(np.frombuffer(row.tokens, dtype="<i4"), rest)
                    if n > best_len:
                        best, best_len = (row.hash, row), n
        if best is not None:
            path.append(best)
        return path, depth * C + best_len

    def _load(self, path: list[tuple[bytes, Row | None]], length: int) -> tuple[list[Record], int]:
        """Records of `path` needed for `length` tokens: memory, then pending, then disk.

        A damaged record ends the usable prefix where it starts.
        """
        store, C = self.store, self.chunk_size
        records: list[Record] = []
        from_disk: list[Record] = []
        for h, row in path:
            if len(records) * C >= length:
                break
            rec = store.memory.get(h) or store.writer.pending(h)
            if rec is None and store.index is not None:
                row = row or store.index.get(h)
                rec = store._read(h, row) if row is not None and not row.bad else None
                if rec is not None:
                    from_disk.append(rec)
            if rec is None:
                length = min(length, len(records) * C)
                break
            records.append(rec)
        store.memory.put(reversed(from_disk))
        store.memory.touch(r.hash for r in reversed(records))
        store.writer.touch([r.hash for r in records])
        return records, length

    def _assemble(self, records: list[Record], length: int) -> list:
        cache = []
        for i, codec in enumerate(self.codecs):
            names = [n for n in records[0].arrays if n.split(".", 1)[0] == str(i)]
            pieces = [{n.split(".", 1)[1]: rec.array(n) for n in names} for rec in records]
            cache.append(codec.restore(pieces, length))
        mx.eval([c.state for c in cache])
        return cache

    def stored_length(self, tokens: Sequence[int] | np.ndarray | mx.array) -> int:
        """How many leading tokens of `tokens` the store could restore (no cap, nothing loaded)."""
        toks = _tokens(tokens)
        if not self.supported or len(toks) == 0:
            return 0
        return self._longest(toks)[1]

    def prefill(self, tokens: Sequence[int] | np.ndarray | mx.array, *, step: int | None = None,
                progress: Callable[[int], None] | None = None) -> tuple[list | None, int, int]:
        """Make sure the cache of `tokens` is stored, computing only what is missing.

        Processes the missing tokens `step` at a time (default: up to each chunk boundary) and
        inserts after each step, so a crash or Ctrl-C keeps everything computed so far.
        Returns (cache or None if nothing had to be computed, tokens reused, tokens computed).
        """
        toks = _tokens(tokens)
        if len(toks) == 0:
            raise InvalidInputError("prefill needs at least one token")
        if self.supported and self.stored_length(toks) >= len(toks):
            return None, len(toks), 0
        cache, rest = self.fetch(toks)
        reused = pos = len(toks) - len(rest)
        C = self.chunk_size
        while pos < len(toks):
            end = min(len(toks), pos + step) if step else min(len(toks), (pos // C + 1) * C)
            self.model(mx.array(toks[pos:end])[None], cache=cache)
            mx.eval([c.state for c in cache])
            self.insert(toks[:end], cache)
            if progress is not None:
                progress(end - pos)
            pos = end
        return cache, reused, len(toks) - reused

    # -- insert -----------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int] | np.ndarray | mx.array, cache: list, *, pin: bool = False) -> int:
        """Store the cache of `tokens` (it must hold exactly `len(tokens)` processed tokens).

        Returns at once: new chunks and the tail are queued for the background writer and are
        visible to `fetch` immediately. Returns how many new records were queued.
        """
        toks = _tokens(tokens)
        store = self.store
        store._check_open()
        if len(toks) == 0:
            raise InvalidInputError("insert needs at least one token")
        self._check_cache(cache, len(toks))
        if not self.supported:
            store.counters["skipped_inserts"] += 1
            return 0
        C = self.chunk_size
        hashes = keys.chain(self.ns, toks, C)
        specs = [Spec(h, hashes[i - 1] if i else self.ns, i + 1, CHUNK, i * C, (i + 1) * C)
                 for i, h in enumerate(hashes)]
        if len(toks) % C:
            parent = hashes[-1] if hashes else self.ns
            start = len(hashes) * C
            specs.append(Spec(keys.tail_hash(parent, toks[start:]), parent, len(hashes) + 1,
                              TAIL, start, len(toks)))
        new = self._unknown(specs)
        if not new and not pin:
            return 0
        arrays: dict[str, mx.array] = {}
        views: dict[str, mx.Dtype] = {}
        for i, (codec, layer) in enumerate(zip(self.codecs, cache)):
            for name, a in codec.snapshot(layer, len(toks)).items():
                arrays[f"{i}.{name}"], view = blobs.host_bits(a)
                if view is not None:
                    views[f"{i}.{name}"] = view
        mx.eval(list(arrays.values()))
        per_token = sum(a.nbytes // max(1, a.shape[2]) for a in arrays.values()) if arrays else 0
        for s in new:
            s.nbytes = per_token * (s.end - s.start) + 4 * (s.end - s.start)
        job = Job(self.ns, toks, arrays, views, new, self._metadata,
                  pin=[s.hash for s in specs] if pin else [],
                  nbytes=sum(s.nbytes for s in new))
        store.writer.submit(job)
        return len(new)

    def _unknown(self, specs: list[Spec]) -> list[Spec]:
        store = self.store
        unknown = [s for s in specs if s.hash not in store.memory and not store.writer.is_pending(s.hash)]
        if unknown and store.index is not None:
            present = store.index.present([s.hash for s in unknown])
            unknown = [s for s in unknown if s.hash not in present]
        return unknown

    def _check_cache(self, cache: list, n: int) -> None:
        if not isinstance(cache, (list, tuple)):
            raise InvalidInputError(f"cache must be a list of mlx-lm cache objects, got {type(cache).__name__}")
        expected = len(self.layout["layers"])
        if len(cache) != expected:
            raise InvalidInputError(f"cache has {len(cache)} layers; this model's cache has {expected}")
        for i, layer in enumerate(cache):
            if type(layer).__name__ != self.layout["layers"][i]["class"]:
                raise InvalidInputError(
                    f"cache layer {i} is a {type(layer).__name__}; this model makes "
                    f"{self.layout['layers'][i]['class']}")
            if self.codecs is not None:
                offset = self.codecs[i].offset(layer)
                if offset != n:
                    raise InvalidInputError(
                        f"cache layer {i} has processed {offset} tokens but {n} tokens were given: "
                        "insert the tokens the cache actually holds")


def describe(model, template: list) -> tuple[dict, list[Codec] | None]:
    """The cache layout (part of the namespace) and a codec per layer, or None if unsupported."""
    codecs = [codec_for(layer) for layer in template]
    layers = [(c.layout(layer) if c else {"class": type(layer).__name__}) for c, layer in zip(codecs, template)]
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    layout = {"layers": layers, "param_dtypes": dtypes}
    return layout, (None if any(c is None for c in codecs) else codecs)


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


def _tokens(tokens) -> np.ndarray:
    """Validate a token sequence: a 1-D sequence of ints in [0, 2**31)."""
    if isinstance(tokens, mx.array):
        tokens = np.asarray(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidInputError(
                f"tokens must be a 1-D sequence of ints, got an array of shape {tokens.shape} "
                f"and dtype {tokens.dtype}")
        arr = tokens.astype(np.int64)
    else:
        if isinstance(tokens, (str, bytes)):
            raise InvalidInputError("tokens must be a sequence of token ids, not text: tokenize first")
        try:
            items = list(tokens)
        except TypeError as e:
            raise InvalidInputError(f"tokens must be a sequence of ints, got {type(tokens).__name__}") from e
        for pos, t in enumerate(items):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise InvalidInputError(f"token {pos} is {t!r}: token ids must be ints")
        arr = np.array(items, dtype=np.int64) if items else np.zeros(0, dtype=np.int64)
    bad = np.nonzero((arr < 0) | (arr >= 2**31))[0]
    if len(bad):
        raise InvalidInputError(f"token {bad[0]} is {arr[bad[0]]}: token ids must be in [0, 2**31)")
    return arr.astype(np.int32)


def _prepare_dir(path: Path) -> Path:
    """Create the store directory (0700) or check an existing one is a writable directory."""
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
