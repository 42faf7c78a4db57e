"""`ModelCache`: the store as one model version sees it — `fetch` and `insert` token sequences.

Fetch looks the prompt up in the tiers (`tiers`: the chain's rows in one index query, then the
children of the deepest stored chunk), opens the records it needs, and hands them to the restore
pipeline (`restore`: plan, fill, build), always leaving at least one token to process. Records
read from beyond RAM are checked against the model's shapes (`records`).
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from kvstore import keys
from kvstore.errors import BlobError, InvalidInputError
from kvstore.keys import checkpoint_hash
from kvstore.restore.arrays import host_array, host_bits
from kvstore.restore.codecs import CacheListCodec, Codec, RotatingCodec, make_codec
from kvstore.restore.pipeline import Part, Plan, build, checkpoint_arrays, fill, host_slice, plan
from kvstore.restore.shapes import RecordCheck
from kvstore.storage import blobformat
from kvstore.storage.index import CHECKPOINT, CHUNK, TAIL
from kvstore.tiers.base import Source
from kvstore.tiers.base import find as tiers_find
from kvstore.tiers.memory import Record
from kvstore.write.writer import Job, Spec

if TYPE_CHECKING:
    from kvstore.store import Store

log = logging.getLogger("kvstore")

Tokens = Sequence[int] | np.ndarray | mx.array

#: Default for `prefill`: a recurrent-state checkpoint every this many chunks (see README).
CHECKPOINT_EVERY = 4
# A pin that finds its records evicted under it (by another process) stores them again, this often.
PIN_ATTEMPTS = 3

_ATTEMPTS = 3  # plans per fetch: each damaged record found while filling costs one more
_RAM_TIERS = ("memory", "pending")  # records made in this process from the model's own caches


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
        self.check = RecordCheck(model, codecs, self.new_cache, model_id)
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

        At least one token is always left. On a miss: a fresh cache and all of `tokens`. The
        restored caches have room for at least 256 more tokens (the next decode step writes in
        place). A damaged record ends the prefix where it starts: quarantined and counted.
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
            for _ in range(_ATTEMPTS):  # a damaged record found while filling: plan again without it
                done = self._restore(toks)
                if done is not None:
                    cache, p = done
                    if p <= 0:
                        break
                    store.counters["reused_tokens"] += p
                    return cache, toks[p:].tolist()
        except Exception as e:  # a broken disk or index is a miss, never an error in generation
            log.error("kvstore: fetch failed, serving a miss (%s: %s)", type(e).__name__, e)
            store.counters["fetch_errors"] = store.counters.get("fetch_errors", 0) + 1
        return self.new_cache(), toks.tolist()

    def _restore(self, toks: np.ndarray) -> tuple[list, int] | None:
        """One attempt: look up, open the records, plan, fill, build. (cache, p), (None, 0) on a
        miss, or None when a record failed its checksum while filling (it is quarantined now) or
        left every tier between the lookup and its opening (the writer replaced a tail, or gc
        evicted it): the next attempt looks up again."""
        C, tiers = self.chunk_size, self.store.tiers
        chain, options, where = self._match(toks)
        cap = len(toks) - 1
        opened: dict[bytes, Source | None] = {}
        vanished: list[bytes] = []
        try:
            best: tuple[Plan, list[Source]] | None = None
            for child, matched in options:
                length = min(len(chain) * C + matched, cap)
                if length <= (best[0].p if best else 0):
                    continue
                path = chain + ([child] if child is not None else [])
                parts, sources = self._open(path[: -(-length // C)], where, opened, vanished)
                length = min(length, sum(q.ntokens for q in parts))
                pl = plan(parts, self.codecs, length, self._checkpoints(parts, length, where))
                if pl is not None and pl.p > (best[0].p if best else 0):
                    best = (pl, sources[: len(pl.parts)])
            if vanished:  # what the lookup chose is gone: another option may be what replaced it
                return None
            if best is None:
                return None, 0
            pl, sources = best
            ckpt = None
            if pl.checkpoint is not None:
                source = self._open_one(pl.checkpoint, where, opened)
                if source is None:
                    return None
                try:
                    ckpt = checkpoint_arrays(source)
                except BlobError as e:
                    self._damaged(pl.checkpoint, where, e)
                    return None
            finals, errors = fill(pl, sources)
            if errors:
                for k, e in errors:
                    self._damaged(pl.parts[k].hash, where, e)
                return None
            cache = build(pl, self.codecs, finals, ckpt)
            self._keep_in_memory(pl, finals, sources, where)
            used = [q.hash for q in pl.parts] + ([pl.checkpoint] if pl.checkpoint is not None else [])
            for tier in tiers:
                tier.touch(used)
            return cache, pl.p
        finally:
            for source in opened.values():
                if source is not None:
                    source.close()

    def _open(self, path: list[bytes], where: dict, opened: dict,
              vanished: list[bytes]) -> tuple[list[Part], list[Source]]:
        """The records of `path` as plan parts and sources, up to the first one that is missing
        or damaged (the prefix ends there); a record no tier holds any more goes in `vanished`."""
        C = self.chunk_size
        disk = [h for h in path if h not in opened and getattr(where.get(h, (None,))[0], "name", "") == "disk"]
        if len(disk) > 1:
            where[disk[0]][0].prefetch(disk)  # readahead of every file at once
        parts, sources = [], []
        for i, h in enumerate(path):
            source = self._open_one(h, where, opened, vanished)
            if source is None:
                break
            parts.append(Part(h, i * C, source.ntokens, source.entries))
            sources.append(source)
        return parts, sources

    def _open_one(self, h: bytes, where: dict, opened: dict, vanished: list[bytes] | None = None) -> Source | None:
        """A checked source of record `h` from the first tier that has it, or None (and `h` in
        `vanished` if the tiers the lookup saw it in all let it go since)."""
        if h in opened:
            return opened[h]
        found = where.get(h)
        source = None
        while found is not None and source is None:
            tier, ref = found
            try:
                source = tier.open(h, ref)
                if tier.name not in _RAM_TIERS:
                    self.check(source.kind, source.ntokens, source.entries)
            except KeyError:  # gone from that tier since the lookup: ask the ones after it
                rest = self.store.tiers[self.store.tiers.index(tier) + 1 :]
                found = tiers_find(rest, [h]).get(h)
                where.pop(h, None)
                if found is not None:
                    where[h] = found
                elif vanished is not None:
                    vanished.append(h)
            except BlobError as e:
                if source is not None:
                    source.close()
                    source = None
                tier.damaged(h, e, ref)
                where.pop(h, None)
                found = None
                if vanished is not None and h not in tiers_find(self.store.tiers, [h]):
                    vanished.append(h)  # its file went with its row (gc, or a tail replaced): no damage
        opened[h] = source
        return source

    def _damaged(self, h: bytes, where: dict, error: BlobError) -> None:
        found = where.pop(h, None)
        if found is not None:
            found[0].damaged(h, error, found[1])

    def _checkpoints(self, parts: list[Part], length: int, where: dict) -> dict[int, bytes]:
        """Position -> hash of the checkpoints some tier holds at the ends of these parts."""
        if not self.checkpointed:
            return {}
        wanted = {checkpoint_hash(q.hash): q.start + q.ntokens for q in parts if q.start + q.ntokens <= length}
        found = tiers_find(self.store.tiers, [h for h in wanted if h not in where])
        where.update(found)
        return {wanted[h]: h for h in wanted if h in where}

    def _keep_in_memory(self, pl: Plan, finals: dict[str, mx.array], sources: list[Source], where: dict) -> None:
        """Records read from beyond RAM go into the memory tier too, as copies of their own (the
        memory tier must not keep the restored arrays alive: they would stop being written in place)."""
        memory = self.store.memory
        if not memory.capacity:
            return
        kept = []
        for k, q in enumerate(pl.parts):
            tier = where.get(q.hash, (None,))[0]
            if tier is None or tier.name in _RAM_TIERS:
                continue
            got = {c.name: (c.lo, c.dst, c.hi) for c in pl.jobs.get(k, ())}
            if set(got) != set(q.entries) or any(lo != 0 or hi != q.entries[n].shape[2]
                                                 for n, (lo, _, hi) in got.items()):
                continue  # only part of it was restored (a sliding window): nothing to keep
            nbytes = sum(map(blobformat.nbytes, q.entries.values())) + 4 * q.ntokens
            if nbytes > memory.capacity:
                continue
            arrays, views = {}, {}
            for name, (lo, dst, hi) in got.items():
                arrays[name] = mx.array(host_slice(finals[name], dst, dst + hi - lo))
                if q.entries[name].tag == "BF16":
                    views[name] = mx.bfloat16
            src = sources[k]
            kept.append(Record(q.hash, src.ns, src.parent, src.depth, src.kind, src.tokens, arrays, views))
        if kept:
            mx.eval([a for r in kept for a in r.arrays.values()])
            memory.put(reversed(kept))

    def stored_length(self, tokens: Tokens) -> int:
        """How many leading tokens of `tokens` have stored K/V (no cap, nothing is loaded)."""
        toks = _tokens(tokens)
        if len(toks) == 0:
            return 0
        chain, options, _ = self._match(toks)
        return len(chain) * self.chunk_size + (options[0][1] if options else 0)

    def _match(self, toks: np.ndarray) -> tuple[list[bytes], list[tuple[bytes | None, int]], dict]:
        """The stored full chunks of `toks` (deepest run from the start), the children of the
        last one that share tokens with what follows: (hash, tokens shared), best first, then
        every other child it matches whole (a checkpoint or a sliding window may be restorable at
        a shorter child's end where the longest match's is not); and where each one is held."""
        C, tiers = self.chunk_size, self.store.tiers
        hashes = keys.chain(self.ns, toks, C)
        where = tiers_find(tiers, hashes)  # one index query for the whole chain
        depth = 0
        while depth < len(hashes) and hashes[depth] in where:
            depth += 1
        parent = hashes[depth - 1] if depth else self.ns
        rest = toks[depth * C :]
        found: dict[bytes, tuple[bytes, int, bool]] = {}
        if len(rest):
            for tier in tiers:
                for h, child_tokens, ref in tier.children(parent, int(rest[0])):
                    if len(child_tokens) == 0 or h in found:
                        continue
                    n = keys.common_prefix(child_tokens, rest)
                    if n:
                        found[h] = (h, n, n == len(child_tokens))
                        where.setdefault(h, (tier, ref))
        ranked = sorted(found.values(), key=lambda f: -f[1])
        options = ranked[:1] + [f for f in ranked[1:] if f[2]]
        return hashes[:depth], [(h, n) for h, n, _ in options] or [(None, 0)], where

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
        lazy: list[mx.array] = []
        wants_checkpoint = any(s.kind == CHECKPOINT for s in new)
        try:
            for i, (codec, layer) in enumerate(zip(self.codecs, cache)):
                plain = codec.slices(layer, n)
                if plain is not None:  # plain ranges of the layer's arrays: numpy views, no mlx op
                    for name, (a, origin, end) in plain.items():
                        arrays[f"{i}.{name}"] = _held_range(a, origin, end)
                        origins[f"{i}.{name}"] = origin
                        if a.dtype == mx.bfloat16:
                            views[f"{i}.{name}"] = mx.bfloat16
                else:
                    for name, (a, origin) in codec.deltas(layer, n).items():
                        arrays[f"{i}.{name}"], view = host_bits(a)
                        lazy.append(arrays[f"{i}.{name}"])
                        origins[f"{i}.{name}"] = origin
                        if view is not None:
                            views[f"{i}.{name}"] = view
                if wants_checkpoint:
                    for name, a in codec.checkpoint(layer).items():
                        saved[f"{i}.{name}"], view = host_bits(a)
                        lazy.append(saved[f"{i}.{name}"])
                        if view is not None:
                            views[f"{i}.{name}"] = view
        except (ValueError, BlobError) as e:
            raise InvalidInputError(f"cannot store this cache: {e}") from e
        # Lazy views (a codec that computes its deltas) are scheduled, not waited for: the writer
        # reads them later and waits if it must. Even scheduling them waits for mlx's thread
        # while the writer keeps the cores busy (milliseconds for 56 views), which is why plain
        # token ranges are numpy views instead.
        if lazy:
            mx.async_eval(lazy)
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
        h = checkpoint_hash(self._record_hashes(toks)[-1])
        return h not in tiers_find(self.store.tiers, [h])

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


def _held_range(a: mx.array, first: int, end: int) -> np.ndarray:
    """Tokens [first, end) of axis 2 of `a` as a numpy view of its memory (bfloat16 as its bits),
    through a second reference to the same array: the layer's next update then writes a new
    buffer (mlx updates in place only an array nothing else holds), so what the view sees never
    changes, and the memory lives as long as the view. Evaluates `a` if it is not yet."""
    held = copy.copy(a)  # the same data, one more holder; no op
    return host_array(held)[:, :, first:end]


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
