"""`ModelCache`: the store as one model version sees it — `fetch` and `insert` token sequences.

Fetch walks the chunk-boundary hashes of the prompt (one index query), compares the tokens of
the children of the deepest stored chunk, then picks the largest position p that every layer's
codec can restore exactly (see `codecs`), always leaving at least one token to process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from . import blobs, keys
from .codecs import (ArraysCodec, CacheListCodec, Codec, KVCodec, Piece, QuantizedKVCodec,
                     RotatingCodec, make_codec, sub)
from .errors import BlobError, InvalidInputError
from .index import CHECKPOINT, CHUNK, TAIL, Row
from .memory import Record
from .writer import Job, Spec

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("kvstore")

Tokens = Sequence[int] | np.ndarray | mx.array

#: Default for `prefill`: a recurrent-state checkpoint every this many chunks (see README).
CHECKPOINT_EVERY = 4
# A pin that finds its records evicted under it (by another process) stores them again, this often.
PIN_ATTEMPTS = 3

# Codecs whose restore is one gather of [0, p) per tensor (exact classes: see `_fetch_direct`).
_DIRECT_CODECS = (KVCodec, QuantizedKVCodec)


def checkpoint_hash(record_hash: bytes) -> bytes:
    """Key of the checkpoint taken at the end of a chunk or tail."""
    return xxhash.xxh3_128_digest(record_hash + b"\x00checkpoint")


def make_template(model, kv_bits: int | None, kv_group_size: int) -> list:
    """The caches this model's generation uses: `make_prompt_cache`, with `KVCache` layers
    quantized the way mlx-lm's `maybe_quantize_kv_cache` does when `kv_bits` is set."""
    cache = make_prompt_cache(model)
    if kv_bits is not None:
        cache = [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c
                 for c in cache]
    return cache


def describe(model, template: list) -> tuple[dict, list[Codec]]:
    """The cache layout (part of the namespace) and one codec per layer."""
    codecs = [make_codec(layer) for layer in template]
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    return {"layers": [c.layout() for c in codecs], "param_dtypes": dtypes}, codecs


class ModelCache:
    """Fetch and insert the caches of one model version (made by `Store.bind`)."""

    def __init__(self, store: "Store", model, model_id: str, ns: bytes, fingerprint: bytes,
                 layout: dict, codecs: list[Codec], kv_bits: int | None = None, kv_group_size: int = 64):
        self.store, self.model, self.model_id = store, model, model_id
        self.ns, self.fingerprint, self.layout, self.codecs = ns, fingerprint, layout, codecs
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.chunk_size = store.chunk_size
        self.checkpointed = any(c.checkpointed for c in codecs)
        self._metadata = {"format": str(keys.FORMAT_VERSION), "ns": ns.hex(),
                          "fingerprint": fingerprint.hex(), "model_id": model_id,
                          "chunk_size": str(self.chunk_size)}
        self._shapes: tuple[dict, dict] | None | bool = False  # False: not traced yet
        self.registered = True  # False while the index could not record this model (Store.bind)

    @property
    def _windowed(self) -> bool:
        """Some layer keeps a sliding window (its records may be stored without its data)."""
        def windowed(c: Codec) -> bool:
            return isinstance(c, RotatingCodec) or (isinstance(c, CacheListCodec) and any(map(windowed, c.subs)))
        return any(map(windowed, self.codecs))

    @property
    def supported(self) -> bool:
        """Every cache class has a codec (unknown ones are checkpointed), so always True."""
        return True

    def new_cache(self) -> list:
        """Fresh, empty caches for this model (quantized when bound with `kv_bits`)."""
        return make_template(self.model, self.kv_bits, self.kv_group_size)

    # -- fetch ------------------------------------------------------------------------------

    def fetch(self, tokens: Tokens) -> tuple[list, list[int]]:
        """The cache of the longest restorable prefix of `tokens`, and the tokens still to process.

        At least one token is always left. On a miss: a fresh cache and all of `tokens`.
        """
        toks = _tokens(tokens)
        store = self.store
        store._check_open()
        store.counters["fetches"] += 1
        if len(toks) < 2:
            return self.new_cache(), toks.tolist()
        try:
            if store.remote is not None:  # a local miss is filled from the remote tier first
                store.remote.fill(self, toks)
            return self._fetch(toks)
        except Exception as e:  # a broken disk or index is a miss, never an error in generation
            log.error("kvstore: fetch failed, serving a miss (%s: %s)", type(e).__name__, e)
            store.counters["fetch_errors"] = store.counters.get("fetch_errors", 0) + 1
            return self.new_cache(), toks.tolist()

    def _fetch(self, toks: np.ndarray) -> tuple[list, list[int]]:
        store = self.store
        chain, options = self._match(toks)
        cap = len(toks) - 1
        if self._direct:
            child, row, matched = options[0]
            length = min(len(chain) * self.chunk_size + matched, cap)
            path = [(h, None) for h in chain] + ([(child, row)] if child is not None else [])
            done = self._fetch_direct(path, length) if length > 0 else None
            if done is not None:
                cache, p = done
                if p <= 0:
                    return self.new_cache(), toks.tolist()
                store.counters["reused_tokens"] += p
                return cache, toks[p:].tolist()
        loaded: dict[bytes, Record | None] = {}
        best: tuple[int, list[Record], Record | None, list[dict]] = (0, [], None, [])
        for child, row, matched in options:
            length = min(len(chain) * self.chunk_size + matched, cap)
            if length <= best[0]:
                continue
            path = [(h, None) for h in chain] + ([(child, row)] if child is not None else [])
            records, length = self._load(path, length, loaded)
            views = [r.views_all() for r in records]
            p, checkpoint = self._restore_point(records, views, length)
            if p > best[0]:
                best = (p, records, checkpoint, views)
        p, records, checkpoint, views = best
        if p <= 0:
            return self.new_cache(), toks.tolist()
        used = [r for r in records if r.depth_start(self.chunk_size) < p]
        touched = used + ([checkpoint] if checkpoint is not None else [])
        store.memory.touch(r.hash for r in reversed(touched))
        store.writer.touch([r.hash for r in touched])
        cache = self._assemble(used, views[: len(used)], p, checkpoint)
        store.counters["reused_tokens"] += p
        return cache, toks[p:].tolist()

    @property
    def _direct(self) -> bool:
        """Every layer is restored by one gather of [0, p) per tensor: `_fetch_direct` applies."""
        return self.store.index is not None and all(type(c) in _DIRECT_CODECS for c in self.codecs)

    def _fetch_direct(self, path: list[tuple[bytes, Row | None]], length: int) -> tuple[list, int] | None:
        """Restore a model whose layers are all (quantized) `KVCache`: each tensor of each layer
        is allocated once at its final length and every record is copied straight into place;
        disk records go from the page cache into it in one copy (`blobs.read_into`, checksummed
        as it reads) instead of read, decode, then concatenate. A damaged record ends the prefix
        where it starts, as in `_load`. Returns (cache, p), or None to leave it to the general
        path (nothing to read from disk, or records it does not expect).
        """
        store, C = self.store, self.chunk_size
        parts: list[tuple[int, bytes, Row | None, Record | None]] = []
        for h, row in path:
            start = len(parts) * C
            if start >= length:
                break
            rec = store.memory.get(h) or store.writer.pending(h)
            if rec is None:
                row = row or store.index.get(h)
                if row is None or row.bad:
                    length = start
                    break
            parts.append((start, h, row, rec))
        if length <= 0 or all(rec is not None for *_, rec in parts):
            return None
        blobs.prefetch(store.blob_root, [h for _, h, _, rec in parts if rec is None])
        finals: dict[str, mx.array] = {}
        views: dict[str, np.ndarray] = {}

        def allocate(spec: dict[str, tuple[mx.Dtype, list[int]]]) -> None:
            for name, (dtype, shape) in spec.items():
                finals[name] = mx.zeros([*shape[:2], length, *shape[3:]], dtype)
            mx.eval(list(finals.values()))
            for name, a in finals.items():
                view = np.asarray(_bits(a))
                if not (view.flags.c_contiguous and view.flags.writeable):
                    raise _NotDirect(name)
                views[name] = view

        read: list[tuple[int, bytes, Row]] = []
        checked: set[tuple] = set()  # record layouts already checked against the model's
        try:
            for start, h, row, rec in parts:
                if start >= length:
                    break
                ntok = len(rec.tokens) if rec is not None else row.ntokens
                take = min(ntok, length - start)
                if rec is not None:
                    arrays = {n: rec.array(n) for n in rec.arrays}
                    if not finals:
                        allocate({n: (a.dtype, list(a.shape)) for n, a in arrays.items()})
                    if set(arrays) != set(finals):
                        raise _NotDirect(h.hex())
                    for name, a in arrays.items():
                        if a.dtype != finals[name].dtype or a.ndim < 3 or a.shape[2] != ntok:
                            raise _NotDirect(name)
                        np.copyto(views[name][:, :, start : start + take], np.asarray(_bits(a))[:, :, :take])
                    continue

                def targets(entries: dict[str, dict], h=h, row=row, ntok=ntok, start=start, take=take):
                    spec = {n: (blobs.mx_dtype(e["dtype"]), e["shape"]) for n, e in entries.items() if n != "tokens"}
                    if not finals:
                        allocate(spec)
                    if set(spec) != set(finals) or any(
                            dt != finals[n].dtype or len(shape) < 3 or shape[2] != ntok
                            for n, (dt, shape) in spec.items()):
                        raise BlobError(f"record {h.hex()}: its tensors are not the ones this model stores")
                    key = (row.kind, ntok, tuple((n, str(dt), tuple(shape)) for n, (dt, shape) in spec.items()))
                    if key not in checked:  # the general path's check, on lazy stand-ins (never computed)
                        try:
                            self._check_record(row.kind, ntok, {n: mx.zeros(shape, dt) for n, (dt, shape) in spec.items()})
                        except BlobError as e:
                            raise BlobError(f"record {h.hex()}: {e}") from e
                        checked.add(key)
                    return {n: v[:, :, start : start + take] for n, v in views.items()}

                try:
                    extras, meta = blobs.read_into(store.blob_root, h, size=row.size, checksum=row.checksum,
                                                   targets=targets)
                    tokens = extras.get("tokens")
                    if tokens is None or tokens.tobytes() != row.tokens:
                        raise BlobError(f"record {h.hex()}: its tokens differ from the index")
                    store._check_header(h, row, meta)
                except BlobError as e:
                    store._quarantine(h, e)
                    length = start
                    break
                if take == ntok:
                    read.append((start, h, row))
        except _NotDirect:
            return None
        if length <= 0:
            return self.new_cache(), 0
        if store.memory.capacity and read:  # the memory tier keeps compact copies, as `_read` does
            kept = [Record(h, row.ns, row.parent, row.depth, row.kind, np.frombuffer(row.tokens, dtype="<i4"),
                           {n: _owned(a, views[n], s, s + row.ntokens) for n, a in finals.items()})
                    for s, h, row in read if s + row.ntokens <= length]
            mx.eval([a for r in kept for a in r.arrays.values()])
            store.memory.put(reversed(kept))
        used = [h for start, h, _, _ in parts if start < length]
        store.memory.touch(reversed(used))
        store.writer.touch(used)
        full = {n: a if a.shape[2] == length else a[:, :, :length] for n, a in finals.items()}
        cache = [codec.restore(length, [(0, length, sub(full, str(i)))], None)
                 for i, codec in enumerate(self.codecs)]
        mx.eval(_arrays_of(cache))
        return cache, length

    def stored_length(self, tokens: Tokens) -> int:
        """How many leading tokens of `tokens` have stored K/V (no cap, nothing is loaded)."""
        toks = _tokens(tokens)
        if len(toks) == 0:
            return 0
        chain, options = self._match(toks)
        return len(chain) * self.chunk_size + (options[0][2] if options else 0)

    def _match(self, toks: np.ndarray) -> tuple[list[bytes], list[tuple[bytes | None, Row | None, int]]]:
        """The stored full chunks of `toks` (deepest run from the start) and the children of the
        last one that share tokens with what follows: (hash, row or None, tokens shared), best
        first, then every other child it matches whole (a checkpoint or a sliding window may be
        restorable at a shorter child's end where the longest match's is not)."""
        C, store = self.chunk_size, self.store
        hashes = keys.chain(self.ns, toks, C)
        local = [h in store.memory or store.writer.is_pending(h) for h in hashes]
        on_disk: set[bytes] = set()
        if store.index is not None and not all(local):
            on_disk = store.index.present([h for h, here in zip(hashes, local) if not here])
        depth = 0
        while depth < len(hashes) and (local[depth] or hashes[depth] in on_disk):
            depth += 1
        parent = hashes[depth - 1] if depth else self.ns
        rest = toks[depth * C :]
        found: dict[bytes, tuple[bytes, Row | None, int, bool]] = {}
        if len(rest):
            candidates = [(r.hash, None, r.tokens) for r in store.memory.children(parent)]
            candidates += [(h, None, t) for h, t in store.writer.pending_children(parent)]
            if store.index is not None:
                candidates += [(row.hash, row, np.frombuffer(row.tokens, dtype="<i4"))
                               for row in store.index.children(parent, int(rest[0]))]
            for h, row, child_tokens in candidates:
                if len(child_tokens) == 0 or h in found:
                    continue
                n = keys.common_prefix(child_tokens, rest)
                if n:
                    found[h] = (h, row, n, n == len(child_tokens))
        ranked = sorted(found.values(), key=lambda f: -f[2])
        options = ranked[:1] + [f for f in ranked[1:] if f[3]]
        return hashes[:depth], [(h, row, n) for h, row, n, _ in options] or [(None, None, 0)]

    def _load(self, path: list[tuple[bytes, Row | None]], length: int,
              loaded: dict[bytes, Record | None]) -> tuple[list[Record], int]:
        """Records of `path` needed for `length` tokens: memory, pending, then disk. A damaged
        record ends the usable prefix where it starts."""
        records: list[Record] = []
        C = self.chunk_size
        for h, row in path:
            if len(records) * C >= length:
                break
            if h not in loaded:
                loaded[h] = self.store._get(h, row, check=self._check_record)
            if loaded[h] is None:
                length = min(length, len(records) * C)
                break
            records.append(loaded[h])
        return records, length

    def _restore_point(self, records: list[Record], views: list[dict], length: int) -> tuple[int, Record | None]:
        """The largest p <= length every layer can restore at, and the checkpoint it needs
        (`views`: each record's arrays with their real dtypes)."""
        C = self.chunk_size
        ends = [r.depth_start(C) + len(r.tokens) for r in records]
        candidates = sorted({length} | {e for e in ends if 0 < e < length}, reverse=True)
        at: dict[int, bytes] = {}
        if self.checkpointed:
            wanted = {checkpoint_hash(r.hash): e for r, e in zip(records, ends) if e <= length}
            for h in self.store._available(list(wanted)):
                at[wanted[h]] = h
        for p in candidates:
            if p <= 0:
                break
            ok = all(codec.valid(p, self._pieces(records, views, str(i)), p in at)
                     for i, codec in enumerate(self.codecs))
            if not ok:
                continue
            if not self.checkpointed:
                return p, None
            if p in at:
                checkpoint = self.store._get(at[p], None, check=self._check_record)
                if checkpoint is not None:
                    return p, checkpoint
            elif not any(c.checkpointed for c in self.codecs):
                return p, None
        return 0, None

    def _pieces(self, records: list[Record], views: list[dict], prefix: str) -> list[Piece]:
        C = self.chunk_size
        return [(r.depth_start(C), r.depth_start(C) + len(r.tokens), sub(v, prefix))
                for r, v in zip(records, views)]

    def _assemble(self, records: list[Record], views: list[dict], p: int, checkpoint: Record | None) -> list:
        ckpt = checkpoint.views_all() if checkpoint is not None else None
        cache = [codec.restore(p, self._pieces(records, views, str(i)),
                               sub(ckpt, str(i)) if ckpt is not None else None)
                 for i, codec in enumerate(self.codecs)]
        mx.eval(_arrays_of(cache))
        return cache

    # -- what a record read from disk must hold -----------------------------------------------

    def _check_record(self, kind: int, ntokens: int, arrays: dict[str, mx.array]) -> None:
        """Raise BlobError unless a record read from disk holds arrays of the names, shapes and
        dtypes this model's cache has (a blob that passed its checksum can still have been
        planted, or taken back by a rebuild); a wrong one would crash generation or be wrong."""
        expected = self._expected_shapes()
        if expected is None:
            return
        deltas, states = expected
        if kind == CHECKPOINT:
            for name, (shape, dtype) in states.items():
                a = arrays.get(name)
                if a is None or tuple(a.shape) != shape or a.dtype != dtype:
                    raise BlobError(f"checkpoint array {name!r} is not the {dtype} {list(shape)} this model has")
            return
        lengths: dict[str, set[int]] = {}
        for name, a in arrays.items():
            want = deltas.get(name)
            ok = want is not None and a.dtype == want[1] and a.ndim == len(want[0]) and a.shape[2] <= ntokens
            if not ok or any(n != m for i, (n, m) in enumerate(zip(a.shape, want[0])) if i != 2):
                raise BlobError(f"array {name!r} {a.dtype} {list(a.shape)} is not what this model's "
                                f"cache holds for {ntokens} tokens")
            lengths.setdefault(want[2], set()).add(a.shape[2])
        for group, found in lengths.items():
            if len(found) != 1 or sum(1 for name in arrays if deltas[name][2] == group) != \
                    sum(1 for d in deltas.values() if d[2] == group):
                raise BlobError(f"the arrays of layer {group} are incomplete or of different lengths")

    def _expected_shapes(self) -> tuple[dict, dict] | None:
        """name -> (shape, dtype, layer) of a record's deltas (token axis 2 free) and name ->
        (shape, dtype) of recurrent checkpoints, from the cache one token gives. The graph is
        built, never computed. None if the model cannot be traced (then nothing is checked)."""
        if self._shapes is False:
            try:
                cache = self.new_cache()
                self.model(mx.array([[0]]), cache=cache)
                deltas: dict = {}
                states: dict = {}

                def leaves(codec: Codec, layer, prefix: str) -> None:
                    if isinstance(codec, CacheListCodec):
                        for j, (c, sub_layer) in enumerate(zip(codec.subs, layer.caches)):
                            leaves(c, sub_layer, f"{prefix}.{j}")
                        return
                    for name, (a, _) in codec.deltas(layer, 1).items():
                        deltas[f"{prefix}.{name}"] = (tuple(a.shape), a.dtype, prefix)
                    if isinstance(codec, ArraysCodec):
                        for name, a in codec.checkpoint(layer).items():
                            states[f"{prefix}.{name}"] = (tuple(a.shape), a.dtype)

                for i, (codec, layer) in enumerate(zip(self.codecs, cache)):
                    leaves(codec, layer, str(i))
                self._shapes = (deltas, states)
            except Exception as e:  # an exotic model: records are still checked by checksum
                log.warning("kvstore: cannot trace %s to check record shapes (%s)", self.model_id, e)
                self._shapes = None
        return self._shapes

    # -- insert -----------------------------------------------------------------------------

    def insert(self, tokens: Tokens, cache: list, *, pin: bool = False, checkpoint: bool = True) -> int:
        """Store the cache of `tokens` (it must hold exactly `len(tokens)` processed tokens).

        Returns at once: new chunks, the tail and (for recurrent layers, when `checkpoint`) a
        checkpoint at the end are queued for the background writer and visible to `fetch`
        immediately. Returns how many new records were queued.
        """
        toks = _tokens(tokens)
        store = self.store
        store._check_open()
        if len(toks) == 0:
            raise InvalidInputError("insert needs at least one token")
        self._check_cache(cache, len(toks))
        if not self.registered:  # rows need their model's row, which bind could not write
            self.registered = store._register(self)
            if not self.registered:
                store.counters["skipped_inserts"] += 1
                return 0
        C, n = self.chunk_size, len(toks)
        hashes = keys.chain(self.ns, toks, C)
        specs = [Spec(h, hashes[i - 1] if i else self.ns, i + 1, CHUNK, i * C, (i + 1) * C)
                 for i, h in enumerate(hashes)]
        if n % C:
            parent = hashes[-1] if hashes else self.ns
            specs.append(Spec(keys.tail_hash(parent, toks[len(hashes) * C :]), parent,
                              len(hashes) + 1, TAIL, len(hashes) * C, n))
        if self.checkpointed and checkpoint:
            last = specs[-1]
            specs.append(Spec(checkpoint_hash(last.hash), last.hash, last.depth, CHECKPOINT, n, n))
        try:
            new = self._unknown(specs)
        except Exception as e:  # the index is unreachable: drop this insert, keep serving
            log.error("kvstore: insert dropped (%s: %s)", type(e).__name__, e)
            store.counters["skipped_inserts"] += 1
            return 0
        # Stored records a sliding window may have been missing data for (see Writer._refill).
        stored = [s for s in specs if s.kind != CHECKPOINT and s not in new
                  and not store.writer.known_complete(s.hash)] if self._windowed else []
        if not new and not pin and not stored:
            return 0
        arrays, origins, views, saved = {}, {}, {}, {}
        wants_checkpoint = any(s.kind == CHECKPOINT for s in new)
        try:
            for i, (codec, layer) in enumerate(zip(self.codecs, cache)):
                for name, (a, origin) in codec.deltas(layer, n).items():
                    arrays[f"{i}.{name}"], view = blobs.host_bits(a)
                    origins[f"{i}.{name}"] = origin
                    if view is not None:
                        views[f"{i}.{name}"] = view
                if wants_checkpoint:
                    for name, a in codec.checkpoint(layer).items():
                        saved[f"{i}.{name}"], view = blobs.host_bits(a)
                        if view is not None:
                            views[f"{i}.{name}"] = view
        except (ValueError, blobs.BlobError) as e:
            raise InvalidInputError(f"cannot store this cache: {e}") from e
        # Scheduled, not waited for: waiting needs mlx's own thread to get a core, which takes
        # milliseconds while the writer keeps one busy (bench/before_after.py). The writer reads
        # the views later and waits for them if it must.
        mx.async_eval(list(arrays.values()) + list(saved.values()))
        per_token: dict[int, int] = {}  # origin -> bytes per token of the arrays starting there
        for name, a in arrays.items():
            per_token[origins[name]] = per_token.get(origins[name], 0) + a.nbytes // max(1, a.shape[2])
        checkpoint_bytes = sum(a.nbytes for a in saved.values())
        for s in new:
            s.nbytes = checkpoint_bytes if s.kind == CHECKPOINT else 4 * (s.end - s.start) + sum(
                b * max(0, s.end - max(s.start, origin)) for origin, b in per_token.items())
        refill = [s for s in stored if all(o <= s.start for o in origins.values())]
        if not new and not pin and not refill:
            return 0
        for s in refill:
            s.nbytes = 4 * (s.end - s.start) + sum(b * (s.end - s.start) for b in per_token.values())
        job = Job(self.ns, toks, arrays, origins, views, new, self._metadata, checkpoint=saved,
                  pin=[s.hash for s in specs] if pin else [],
                  nbytes=sum(s.nbytes for s in new) + sum(s.nbytes for s in refill), refill=refill)
        store.writer.submit(job)
        return len(new)

    def prefill(self, tokens: Tokens, *, step: int | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
                pin: bool = False, progress: Callable[[int], None] | None = None) -> tuple[list | None, int, int]:
        """Make sure the cache of `tokens` is stored, computing only what is missing.

        Processes the missing tokens up to each chunk boundary (or `step` at a time) and inserts
        after each, so a crash or Ctrl-C keeps everything computed so far. Recurrent layers get a
        checkpoint every `checkpoint_every` chunks and at the end. Returns (the cache, or None if
        nothing had to be computed; tokens reused; tokens computed).
        """
        toks = _tokens(tokens)
        if len(toks) == 0:
            raise InvalidInputError("prefill needs at least one token")
        for _ in range(PIN_ATTEMPTS):
            # What this process holds in RAM may be gone from disk (gc in another process): a
            # prefill answers for the disk, so records the disk lost are forgotten and recomputed.
            self._forget_lost(toks)
            if self.stored_length(toks) < len(toks) or self._needs_end_checkpoint(toks):
                break
            if not pin or self._pin(toks):
                return None, len(toks), 0
        cache, rest = self.fetch(toks)
        reused = pos = len(toks) - len(rest)
        C = self.chunk_size
        while pos < len(toks):
            end = min(len(toks), pos + step) if step else min(len(toks), (pos // C + 1) * C)
            self.model(mx.array(toks[pos:end])[None], cache=cache)
            mx.eval(_arrays_of(cache))
            at_boundary = end % C == 0 and checkpoint_every > 0 and (end // C) % checkpoint_every == 0
            self.insert(toks[:end], cache, pin=pin and end == len(toks),
                        checkpoint=end == len(toks) or at_boundary)
            if progress is not None:
                progress(end - pos)
            pos = end
        return cache, reused, len(toks) - reused

    def _record_hashes(self, toks: np.ndarray) -> list[bytes]:
        """Hashes of the chunks and tail that `insert(toks, ...)` stores."""
        C = self.chunk_size
        hashes = keys.chain(self.ns, toks, C)
        if len(toks) % C:
            hashes.append(keys.tail_hash(hashes[-1] if hashes else self.ns, toks[len(hashes) * C :]))
        return hashes

    def _needs_end_checkpoint(self, toks: np.ndarray) -> bool:
        if not self.checkpointed:
            return False
        return not self.store._available([checkpoint_hash(self._record_hashes(toks)[-1])])

    def _durable_hashes(self, toks: np.ndarray) -> list[bytes]:
        """The records that must be on disk for `toks` to be stored whole (with the end checkpoint
        a recurrent model restores from)."""
        hashes = self._record_hashes(toks)
        return hashes + [checkpoint_hash(hashes[-1])] if self.checkpointed else hashes

    def _forget_lost(self, toks: np.ndarray) -> None:
        """Drop from the memory tier the records of `toks` that are neither queued nor on disk."""
        store = self.store
        if store.index is None:
            return
        held = [h for h in self._durable_hashes(toks) if h in store.memory and not store.writer.is_pending(h)]
        if held:
            on_disk = store.index.present(held)
            store.memory.discard([h for h in held if h not in on_disk and not store.writer.is_pending(h)])

    def _pin(self, toks: np.ndarray) -> bool:
        """Pin what is stored for `toks` (and so keep it through gc). False if some record is not
        on disk to be pinned (another process evicted it): the caller stores it again."""
        if self.store.index is None:
            return True
        self.store.flush()
        wanted = self._durable_hashes(toks)
        return self.store.index.pin(wanted) >= len(wanted)

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
        if len(cache) != len(self.codecs):
            raise InvalidInputError(f"cache has {len(cache)} layers; this model's cache has {len(self.codecs)}")
        for i, (codec, layer) in enumerate(zip(self.codecs, cache)):
            if type(layer) is not codec.cls:
                hint = (" (bind with kv_bits to store quantized caches)" if isinstance(layer, QuantizedKVCache)
                        else " (quantize it as mlx-lm does, or bind without kv_bits)" if self.kv_bits else "")
                raise InvalidInputError(
                    f"cache layer {i} is a {type(layer).__name__}; this model's layout has "
                    f"{codec.cls.__name__}{hint}")
            offset = codec.offset(layer)
            if offset is not None and offset != n:
                raise InvalidInputError(
                    f"cache layer {i} has processed {offset} tokens but {n} tokens were given: "
                    "insert the tokens the cache actually holds")


class _NotDirect(Exception):
    """Records `_fetch_direct` does not expect: the general path serves them."""


def _owned(full: mx.array, view: np.ndarray, start: int, end: int) -> mx.array:
    """Tokens [start, end) of `full` as an array of their own (the memory tier must not keep the
    whole restored tensor alive). `mx.array` of a strided numpy view would copy its whole span."""
    part = view[:, :, start:end]
    if part.flags.c_contiguous:  # a single head: `mx.contiguous` would return a view of `full`
        return mx.array(part).view(full.dtype)
    return mx.contiguous(full[:, :, start:end])


def _bits(a: mx.array) -> mx.array:
    """`a` as numpy can hold it: bfloat16 as its uint16 bits (a zero-copy view)."""
    return a.view(mx.uint16) if a.dtype == mx.bfloat16 else a


def _arrays_of(cache: list) -> list[mx.array]:
    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


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
        try:  # the common case, a list of ints, at numpy speed
            fast = np.array(items)
        except (ValueError, TypeError, OverflowError):
            fast = None
        if fast is not None and fast.ndim == 1 and fast.dtype.kind in "iu" and len(fast):
            return _tokens(fast)
        for pos, t in enumerate(items):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise InvalidInputError(f"token {pos} is {t!r}: token ids must be ints")
        if any(t >= 2**31 or t < 0 for t in items):
            pos = next(i for i, t in enumerate(items) if t >= 2**31 or t < 0)
            raise InvalidInputError(f"token {pos} is {items[pos]}: token ids must be in [0, 2**31)")
        arr = np.array(items, dtype=np.int64) if items else np.zeros(0, dtype=np.int64)
    bad = np.nonzero((arr < 0) | (arr >= 2**31))[0]
    if len(bad):
        raise InvalidInputError(f"token {bad[0]} is {arr[bad[0]]}: token ids must be in [0, 2**31)")
    return arr.astype(np.int32)
