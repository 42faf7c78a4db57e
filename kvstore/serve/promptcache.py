"""`PersistentPromptCache`: mlx-lm's `LRUPromptCache` contract, answered from a kvstore `Store`.

`mlx_lm.server` keeps its prompt cache in an in-RAM `LRUPromptCache`. This class answers the same
calls (`fetch_nearest_cache`, `insert_cache`, `trim_to`, `len()`, `nbytes`, `stats_by_type`) from a
store, so cached prompts survive restarts and are shared by every process that opens the store.

What RAM holds is bounded as `LRUPromptCache` bounds it: `len()` counts the inserted sequences
held in RAM, `max_size` bounds them, `max_bytes` and `trim_to(n_sequences=, n_bytes=)` evict them
in mlx-lm's order (assistant, then user, then system turns, oldest first). A sequence evicted from
RAM is still on disk (when the store has one) and is served from there: that is the point.

With tenants (`tenants=True`; `kvstore serve --tenant-from`), each lookup and insert is of the
tenant of the request it is for (`tenancy.RequestTenants`; a server of your own says it with
`for_tenant`): it reuses shared prompts and that tenant's own, never another tenant's.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from kvstore.errors import InvalidInputError, check_flags
from kvstore.keys import checkpoint_hash
from kvstore.model.blas import long_prefill_note
from kvstore.model.cache import ModelCache
from kvstore.model.prefill import prompt_cache
from kvstore.model.tokens import as_tokens, token_list
from kvstore.serve.binding import IN_RAM, Binding, KeyBindings
from kvstore.serve.ramlru import CACHE_TYPES, RamSequences, SystemPrompts, can_trim, check_bounds
from kvstore.serve.steps.firststeps import FirstSteps
from kvstore.serve.tenancy.policy import UNKNOWN, RequestTenants, SharedWrites
from kvstore.store import Store
from kvstore.tenants import Tenant

log = logging.getLogger("kvstore")

#: The entry of `stats_by_type` for the store's disk (its count is records, not sequences).
DISK_TYPE = "kvstore disk"

#: How many recent system prompts the memory tier keeps fresh (see `SystemPrompts`).
MAX_SYSTEM_PROMPTS = 32

Observer = Callable[[float, int], None]


class PersistentPromptCache:
    """A drop-in for `mlx_lm.models.cache.LRUPromptCache`, backed by a kvstore `Store`.

    Keys are whatever the server passes as `model` (mlx_lm.server uses its `ModelProvider.model_key`,
    `(model path or repo id, adapter path, draft model path)`). A key resolves to a bound
    `ModelCache` through `register()` or through an attached `ModelProvider`. A key that cannot be
    stored (image prompts, model files that cannot be fingerprinted) is served by an in-RAM
    `LRUPromptCache` exactly as stock mlx_lm.server would. One exception: with a draft model
    (speculative decoding) nothing is cached, because mlx-lm 0.32's own cache then restores caches
    that change the greedy output; a miss is slower but never wrong.

    RAM: `len()`, `nbytes`, `max_size`, `max_bytes` and `trim_to` describe and bound the sequences
    held in RAM as `LRUPromptCache` does (plus its in-RAM fallback); `nbytes` is what the store's
    memory tier and its write queue hold. The disk is bounded by the store's own `max_bytes`.
    Deliberate differences: an exact hit leaves one token to process (mlx-lm then has nothing to
    compute the first logits from), a sequence RAM evicted is still a disk hit, and an empty
    sequence holds no K/V, so it is neither stored nor counted.

    `max_insert_tokens`: a longer sequence is served but not stored (None: no cap).
    `tenants`: every call is for a tenant (`for_tenant`, or `kvstore serve`'s requests); a lookup
    or insert whose tenant is not known is served without the store. `shared_writes`: without
    tenants, inserts go on only while it allows (`tenancy.policy.SharedWrites`).
    No call raises into the server: a failure is logged and served as a miss.
    """

    def __init__(self, store: Store, max_size: int = 10, max_bytes: int | None = None, *,
                 max_insert_tokens: int | None = None, tenants: bool = False,
                 shared_writes: SharedWrites | None = None):
        check_bounds(max_size, max_bytes)
        check_flags(tenants=tenants)  # ("no" would serve every call outside `for_tenant` without the store)
        self.store = store
        self.tenants = RequestTenants(tenants)
        self.shared_writes = shared_writes
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.max_insert_tokens = max_insert_tokens
        self._fallback_cache = None
        self._keys = KeyBindings(store)
        self._system = SystemPrompts(MAX_SYSTEM_PROMPTS)
        self._ram = RamSequences()
        self._evicted: set[bytes] = set()  # dropped from RAM while the writer still held them
        self._lock = threading.RLock()
        self.observers: list[Observer] = []  # called with (seconds, tokens reused) after each fetch
        self.first_steps = FirstSteps()  # requests' first steps: their prompts' canaries
        self.counters = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "fallback_requests": 0,
                         "inserts": 0, "errors": 0, "fetch_errors": 0, "not_stored_too_long": 0,
                         "tenant_unknown": 0, "reused_by_tier": {"memory": 0, "disk": 0, "remote": 0},
                         "prefetches": 0, "prefetch_tokens": 0, "prefetches_refused": 0, "warmed_prompts": 0}

    # -- telling it which model a key means --------------------------------------------------

    def register(self, key: Hashable, model_cache: ModelCache) -> None:
        """Serve `key` from `model_cache` (from `store.bind(model, model_id)`): for own servers."""
        with self._lock:
            self._keys.register(key, model_cache)

    def attach(self, model_provider: Any) -> None:
        """Resolve keys through an `mlx_lm.server.ModelProvider` (its `model_key` and `model`).

        The provider's `reset` is wrapped so a model it unloads is released here too, before the
        next one is loaded (a binding holds a reference to its model).
        """
        with self._lock:
            self._keys.provider = model_provider
            cli_args = getattr(model_provider, "cli_args", None)
            size = getattr(cli_args, "prompt_cache_size", None)
            if isinstance(size, int):
                self.max_size = size
        reset = getattr(model_provider, "reset", None)
        if callable(reset) and not getattr(reset, "_kvstore_wrapped", False):
            def reset_and_forget(*args, **kwargs):
                self._forget_binding()
                return reset(*args, **kwargs)

            reset_and_forget._kvstore_wrapped = True
            model_provider.reset = reset_and_forget

    def for_tenant(self, tenant_id: str | None):
        """Within (a context manager): this thread's lookups and inserts are `tenant_id`'s (None:
        the shared namespace's), for a server of your own made with `tenants=True`."""
        if tenant_id is not None and not self.tenants.active:  # (its tenants would share one another's prompts)
            raise InvalidInputError("for_tenant: this PersistentPromptCache serves no tenants: make it with "
                                    "PersistentPromptCache(store, tenants=True)")
        return self.tenants.single(tenant_id)

    # -- what mlx_lm.server calls ------------------------------------------------------------

    def fetch_nearest_cache(self, model: Hashable, tokens: Sequence[int]) -> tuple[list | None, list[int]]:
        """`(cache, tokens still to process)` for the longest stored prefix of `tokens`.

        A miss is `(None, tokens)`, as from `LRUPromptCache`; the server then makes a fresh cache.
        In exact mode (`exact_prefill`) the prompt but its last token is prefilled here, in the
        store's steps, and stored (outside this object's lock: stats answer meanwhile).
        """
        tokens = token_list(tokens)
        tenant_id = self.tenants.take()
        with self._lock:
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(tokens)
            try:
                if tenant_id is UNKNOWN:
                    return self._unknown("a lookup", tokens)
                binding = self._resolve(model, tokens)
                if not isinstance(binding, Binding):
                    return self._fetch_elsewhere(binding, (model, tenant_id) if self.tenants.active else model,
                                                 tokens)
                toks = as_tokens(tokens)  # once, for both lookups (InvalidInputError: a miss)
                mc = binding.choose(toks, self._tenant(tenant_id))
                self._settle()  # records RAM let go while the writer held them are gone from it now
                in_ram = mc.ram_length(toks)
                self.first_steps.fetched(tokens, mc, tenant_id)
                if not mc.exact:
                    return self._fetched_from(mc, toks, in_ram, lambda: (*mc.fetch(toks), 0))
            except Exception as e:  # never into the generation loop
                return self._fetch_failed(e, tokens)
        try:
            return self._fetched_from(mc, toks, in_ram, lambda: self._exact_start(model, mc, toks, tenant_id))
        except Exception as e:
            with self._lock:
                return self._fetch_failed(e, tokens)

    def _fetched_from(self, mc: ModelCache, toks: np.ndarray, in_ram: int,
                      start: Callable[[], tuple[list, list[int], int]]) -> tuple[list | None, list[int]]:
        """Run `start` (the fetch: cache, rest, tokens computed here), count and log it."""
        tokens = toks.tolist()
        remote_before = _remote_tokens(self.store)
        started = time.perf_counter()
        cache, rest, computed = start()
        seconds = time.perf_counter() - started
        reused = len(tokens) - len(rest) - computed
        with self._lock:
            self._count_reuse(reused, in_ram, remote_before)
        for observe in self.observers:
            observe(seconds, reused)
        from_bucket = 0 if remote_before is None else min(reused, _remote_tokens(self.store) - remote_before)
        where = (f"reused ({from_bucket} from the bucket {self.store.remote.url}, {reused - from_bucket} "
                 "from the local store)") if from_bucket else "reused from the store"
        log.info("kvstore: prompt %d tokens, %d %s%s", len(tokens), reused, where,
                 f", {computed} computed in exact steps and stored" if mc.exact else "")
        slow = long_prefill_note(lambda: len(rest))
        if slow:
            log.warning("%s", slow)
        if reused + computed == 0:
            return None, tokens
        return cache, list(rest)

    def _fetch_failed(self, e: Exception, tokens: list) -> tuple[None, list]:
        self.counters["fetch_errors"] += 1
        self._error("fetch", e)
        return None, tokens

    def insert_cache(self, model: Hashable, tokens: Sequence[int], prompt_cache: list, *,
                     cache_type: str = "assistant") -> None:
        """Store the cache of `tokens` (queued for the background writer; returns at once)."""
        tokens = token_list(tokens)
        tenant_id = self.tenants.of_cache(prompt_cache)
        with self._lock:
            try:
                if tenant_id is UNKNOWN:
                    self._unknown("an insert", tokens)
                    return
                binding = self._resolve(model, tokens)
                if binding == IN_RAM:
                    key = (model, tenant_id) if self.tenants.active else model
                    self._fallback().insert_cache(key, tokens, prompt_cache, cache_type=cache_type)
                if isinstance(binding, Binding) and tokens and (
                        self.shared_writes is None or self.shared_writes.allowed(self.store)):
                    self._insert(binding, model, tokens, prompt_cache, cache_type, self._tenant(tenant_id))
            except Exception as e:
                self._error("insert", e)
            self._bound_ram()

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Evict from RAM, in mlx-lm's order, down to `n_sequences` sequences and `n_bytes` bytes
        (the in-RAM fallback first). What the store holds on disk stays there."""
        with self._lock:
            try:
                self._settle()
                if self._fallback_cache is not None:
                    self._fallback_cache.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
                if n_sequences is not None:
                    while len(self._ram) > max(0, n_sequences):
                        self._evict(*self._ram.pop())
                if n_bytes is not None:
                    n_bytes = max(0, n_bytes - self._fallback_nbytes())
                    while self._ram_bytes() > n_bytes and len(self._ram):
                        self._evict(*self._ram.pop())
                    if self._ram_bytes() > n_bytes:  # records fetches read from disk, held by no sequence
                        self.store.memory.trim_to(n_bytes)
            except Exception as e:
                self._error("trim", e)

    def __len__(self) -> int:
        """Sequences held in RAM (by the store and by the in-RAM fallback)."""
        with self._lock:
            self._settle()
            return len(self._ram) + (len(self._fallback_cache) if self._fallback_cache else 0)

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM: the memory tier, the queued records of the sequences held, and the
        in-RAM fallback. (Queued records of sequences already evicted are the write queue's.)"""
        with self._lock:
            self._settle()
            return self._ram_bytes() + self._fallback_nbytes()

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        """Per cache type (as `LRUPromptCache`): sequences held in RAM and their bytes; then the
        store's disk (`n_sequences` there counts records) and what the in-RAM fallback holds."""
        with self._lock:
            self._settle()
            out = {}
            for cache_type, (count, hashes) in self._ram.by_type().items():
                out[cache_type] = {"n_sequences": count, "n_bytes": self._bytes_of(hashes)}
            index = self.store.index
            if index is not None:
                try:
                    totals = index.totals()
                    out[DISK_TYPE] = {"n_sequences": totals["chunks"] + totals["tails"],
                                           "n_bytes": totals["bytes"]}
                except Exception as e:  # a busy or damaged index must not stop a request
                    self._error("stats", e)
            if self._fallback_cache is not None and len(self._fallback_cache):
                for cache_type, stats in self._fallback_cache.stats_by_type().items():
                    out[f"in-RAM only, {cache_type}"] = dict(stats)
            return out

    def prefetch(self, model: Hashable, tokens: Sequence[int], *, binding: Binding | None = None,
                 tenant_id: str | None = None, request: bool = True) -> dict:
        """Restore what the store holds of `tokens` into the memory tier, ahead of the request that
        will need it (`binding`: the bound model, else `model` is resolved as for a request),
        within `tenant_id`'s namespace (None: the shared one): what its request would reuse.
        Counted as a prefetch request unless `request` is False (`--warm-top`: its tokens count).
        Returns `ModelCache.load_into_ram`'s answer (`"refused"` says why it did nothing)."""
        tokens = token_list(tokens)
        with self._lock:
            self.counters["prefetches"] += request
            out = {"tokens": len(tokens), "stored": 0, "in_ram": 0, "loaded": 0}
            try:
                binding = binding or self._resolve(model, tokens)
                if not isinstance(binding, Binding):
                    return {**out, "refused": f"this model's caches are not stored ({binding})"}
                toks = as_tokens(tokens)
                out = binding.choose(toks, self._tenant(tenant_id)).load_into_ram(toks)
                if "refused" in out:
                    self.counters["prefetches_refused"] += request
                self.counters["prefetch_tokens"] += out["loaded"]
                return out
            except Exception as e:
                self._error("prefetch", e)
                return {**out, "refused": f"{type(e).__name__}: {e}"}

    def bind_served(self) -> Binding | str:
        """The binding of the model the attached provider has loaded, made now: at start, so its
        stored records are announced at once (KV events) and can be warmed."""
        with self._lock:
            provider = self._keys.provider
            key = getattr(provider, "model_key", None)
            return self._resolve(key, []) if key is not None else IN_RAM

    # -- start-up and shut-down --------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for pending writes (False if `timeout` ran out first); exact-mode inserts still
        waiting for a first step are queued without their canary first."""
        self.first_steps.release()
        return self.store.flush(timeout)

    # -- internals: inserting and holding sequences in RAM -------------------------------------

    def _insert(self, binding: Binding, key: Hashable, tokens: list, prompt_cache: list,
                cache_type: str, tenant: Tenant | None = None) -> None:
        held = self._held_tokens(tokens, prompt_cache)
        if held is None:
            return
        if self.max_insert_tokens is not None and len(held) > self.max_insert_tokens:
            self.counters["not_stored_too_long"] += 1
            log.info("kvstore: not stored: %d tokens is over the cap of %d tokens per request",
                     len(held), self.max_insert_tokens)
            return
        cache_type = cache_type if cache_type in CACHE_TYPES else "assistant"
        mc = binding.for_cache(prompt_cache, tenant)
        if self.first_steps.wrong(held):  # its restore missed its canary: its K/V are not stored again
            return
        if mc.exact:  # stored as it was prefilled: what generation computed is not a cold prefill's
            self.first_steps.settle(held)
            return
        # The store keeps it by type too, with its first step's canary.
        mc.insert(held, prompt_cache, cache_type=cache_type, canary=self.first_steps.canary_for(held))
        self.counters["inserts"] += 1
        if log.isEnabledFor(logging.INFO):
            placed = mc.placement(held)
            placed.undecided = self.store.backing.gate is not None and self.store.backing.gate.selective
            log.info("kvstore: %s", placed.summary(named=True))
        hashes = mc.record_hashes(held)
        seq = ((key, tenant.tag) if tenant is not None else key, mc.ns, tuple(held))
        self._ram.add(seq, hashes, cache_type)
        self._evicted.difference_update(hashes)
        if can_trim(prompt_cache):  # a trimmable cache makes every stored prefix of it redundant
            for prefix in self._ram.prefixes_of(seq):
                self._evict(prefix, self._ram.remove(prefix))
        if cache_type == "system":
            self._system.remember(hashes)
        else:
            self.store.memory.touch(self._system.hashes())

    def _exact_start(self, key: Hashable, mc: ModelCache, toks: np.ndarray,
                     tenant_id: object = None) -> tuple[list, list[int], int]:
        """Exact mode's start of a request: the stored prefix at a multiple of the step, the
        prompt but its last token prefilled in full steps and stored (its end waits for the first
        step's canary), the last token left to the server. Returns (cache, rest, computed)."""
        start = prompt_cache(mc, toks)
        if start.hold is not None:
            self.first_steps.expect(toks.tolist(), start.hold)
        computed = len(toks) - len(start.rest) - start.reused
        if computed:  # not reused (`cached_tokens`), and held in RAM as an inserted sequence is
            self.first_steps.computed(toks.tolist(), computed, tenant_id)
            with self._lock:
                seq = ((key, mc.tenant.tag) if mc.tenant is not None else key, mc.ns, tuple(toks[:-1].tolist()))
                self._ram.add(seq, mc.record_hashes(toks[:-1]), "assistant")
        return start.cache, start.rest, computed

    def _bound_ram(self) -> None:
        """`LRUPromptCache`'s bounds after an insert: `max_size` sequences, `max_bytes` bytes."""
        try:
            self._settle()
            while len(self._ram) > max(0, self.max_size):
                self._evict(*self._ram.pop())
            if self._fallback_cache is not None:
                self._fallback_cache.max_size = self.max_size
            if self.max_bytes is not None:
                self.trim_to(n_bytes=self.max_bytes)
        except Exception as e:
            self._error("trim", e)

    def _evict(self, seq: tuple, hashes: list[bytes]) -> None:
        """Drop a sequence's records from RAM, except those another held sequence shares."""
        keep = self._ram.held_hashes()
        gone = [h for h in hashes if h not in keep]
        gone += [checkpoint_hash(h) for h in gone]
        self.store.memory.discard(gone)
        # The writer puts records into the memory tier once written: drop those again then.
        self._evicted.update(h for h in gone if self.store.writer.is_pending(h))

    def _settle(self) -> None:
        """Forget sequences the memory tier let go by itself (its own byte bound), and drop
        records evicted here that the writer has since put into the memory tier."""
        store = self.store
        if self._evicted:
            done = {h for h in self._evicted if not store.writer.is_pending(h)}
            store.memory.discard(done - self._ram.held_hashes())
            self._evicted -= done
        for seq, hashes in self._ram.items():
            last = hashes[-1]
            if last not in store.memory and not store.writer.is_pending(last):
                self._evict(seq, self._ram.remove(seq))

    def _ram_bytes(self) -> int:
        """What evicting here can free: the memory tier, and the queued records of held sequences."""
        memory = self.store.memory
        queued = self._bytes_of({h for h in self._ram.held_hashes() if h not in memory})
        return memory.nbytes + queued

    def _bytes_of(self, hashes: set[bytes]) -> int:
        """Bytes of these records, in the memory tier or the write queue."""
        memory, writer = self.store.memory, self.store.writer
        total = 0
        for h in hashes:
            rec = memory._records.get(h)  # a look without moving it in the LRU
            if rec is None and writer.is_pending(h):
                rec = writer.pending(h)
            total += rec.nbytes if rec is not None else 0
        return total

    def _count_reuse(self, reused: int, in_ram: int, remote_before: int | None) -> None:
        """Reused tokens by tier: what RAM held, what the remote tier filled in during this fetch,
        and the rest from the local disk."""
        by_tier = self.counters["reused_by_tier"]
        self.counters["reused_tokens"] += reused
        from_ram = min(reused, in_ram)
        remote_after = _remote_tokens(self.store)
        from_remote = 0
        if remote_before is not None and remote_after is not None:
            from_remote = min(reused - from_ram, max(0, remote_after - remote_before))
        by_tier["memory"] += from_ram
        by_tier["remote"] += from_remote
        by_tier["disk"] += reused - from_ram - from_remote

    # -- internals: keys and models ----------------------------------------------------------

    def _tenant(self, tenant_id: str | None) -> Tenant | None:
        return None if tenant_id is None else self.store.tenant(tenant_id)

    def _unknown(self, what: str, tokens: list) -> tuple[None, list]:
        """A lookup or insert no request told the tenant of: served without the store."""
        self.counters["tenant_unknown"] += 1
        log.warning("kvstore: %s of %d tokens came with no tenant: served without the store", what, len(tokens))
        return None, tokens

    def _resolve(self, key: Hashable, tokens: list) -> Binding | str:
        """The bound model for `key`, else `IN_RAM` or `UNCACHED`."""
        return self._keys.resolve(key, tokens)

    def _forget_binding(self) -> None:
        with self._lock:
            self._keys.forget()

    def _fallback(self):
        if self._fallback_cache is None:
            from mlx_lm.models.cache import LRUPromptCache

            limits = {} if self.max_bytes is None else {"max_bytes": self.max_bytes}
            self._fallback_cache = LRUPromptCache(self.max_size, **limits)
        return self._fallback_cache

    def _fallback_nbytes(self) -> int:
        return self._fallback_cache.nbytes if self._fallback_cache is not None else 0

    def _fetch_elsewhere(self, where: str, key: Hashable, tokens: list) -> tuple[list | None, list[int]]:
        self.counters["fallback_requests"] += 1
        cache, rest = None, tokens
        if where == IN_RAM:
            cache, rest = self._fallback().fetch_nearest_cache(key, tokens)
        log.info("kvstore: prompt %d tokens, 0 reused from the store (%d from RAM)", len(tokens),
                 len(tokens) - len(rest))
        return cache, rest

    @staticmethod
    def _held_tokens(tokens: list, cache: list) -> list | None:
        """The tokens the cache really holds: `tokens`, or a prefix if every layer has fewer
        (mlx_lm.server inserts the prompt and every generated token, the last never processed)."""
        from kvstore.model.prefill import held_length

        held = held_length((getattr(layer, "offset", None) for layer in cache), len(tokens))
        if held is None:
            log.debug("kvstore: not stored: the cache does not hold a prefix of the %d tokens given", len(tokens))
            return None
        return tokens if held == len(tokens) else tokens[:held]

    def _error(self, what: str, e: Exception) -> None:
        self.counters["errors"] += 1
        log.warning("kvstore: %s failed, served without the store: %s: %s", what, type(e).__name__, e,
                    exc_info=log.isEnabledFor(logging.DEBUG))


def _remote_tokens(store: Store) -> int | None:
    """Tokens the remote tier has filled in for this process so far (None without a remote tier)."""
    counters = getattr(getattr(store, "remote", None), "counters", None)
    value = counters.get("remote_tokens") if isinstance(counters, dict) else None
    return value if isinstance(value, int) else None

