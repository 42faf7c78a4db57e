"""Which `ModelCache` a server's model key means: registered ones, or bound through mlx-lm's provider.

mlx_lm.server names a model by its `ModelProvider.model_key`, `(model path or repo id, adapter path,
draft model path)`. `KeyBindings.resolve` turns such a key into a `Binding` (the store as that model
sees it), or says why the key is not stored: `IN_RAM` (served by mlx-lm's own in-RAM cache) or
`UNCACHED` (not cached at all).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any, Hashable

import numpy as np

from kvstore.errors import InvalidInputError, KVStoreError
from kvstore.model.cache import ModelCache
from kvstore.store import Store
from kvstore.tenants import Tenant

log = logging.getLogger("kvstore")

# What `KeyBindings.resolve` returns for a key the store does not serve.
IN_RAM = "in RAM"  # mlx-lm's own LRUPromptCache, as stock mlx_lm.server
UNCACHED = "uncached"  # no prompt caching at all: even mlx-lm's in-RAM reuse would be wrong
MAX_VIEWS = 1024  # tenants' views of a binding kept (one is cheap to make again)


class Binding:
    """The store as one server model sees it: plain K/V, and with `--kv-bits` also quantized K/V;
    each as the shared namespace or as a tenant sees it (`tenant`, from `Store.tenant`)."""

    def __init__(self, plain: ModelCache, quantized: ModelCache | None = None):
        self.plain, self.quantized = plain, quantized
        self._views: OrderedDict[tuple, ModelCache] = OrderedDict()  # (ns, tag) -> a tenant's view

    def choose(self, tokens: np.ndarray, tenant: Tenant | None = None) -> ModelCache:
        """The namespace that holds more of `tokens` (for `tenant`)."""
        mc = self._view(self.plain, tenant)
        if self.quantized is not None:
            q = self._view(self.quantized, tenant)
            if q.stored_length(tokens) > mc.stored_length(tokens):
                mc = q
        return mc

    def for_cache(self, cache: list, tenant: Tenant | None = None) -> ModelCache:
        """The namespace a server cache belongs in (quantized once mlx-lm quantized it), for `tenant`."""
        if self.quantized is not None and any(type(c).__name__ == "QuantizedKVCache" for c in cache):
            return self._view(self.quantized, tenant)
        return self._view(self.plain, tenant)

    def _view(self, mc: ModelCache, tenant: Tenant | None) -> ModelCache:
        if tenant is None:
            return mc
        slot = (mc.ns, tenant.tag, tenant.salt)
        view = self._views.get(slot)
        if view is None:
            view = self._views[slot] = mc.with_tenant(tenant)
            while len(self._views) > MAX_VIEWS:
                self._views.popitem(last=False)
        self._views.move_to_end(slot)
        return view


class KeyBindings:
    """Server keys and the bindings they resolve to; each key that cannot be stored is logged once.

    Not thread-safe on its own: `PersistentPromptCache` calls it under its lock.
    """

    def __init__(self, store: Store):
        if not isinstance(store, Store):  # a path here would serve every request without a store
            raise InvalidInputError(f"store: give an open kvstore Store, as kvstore.open(PATH) returns, not "
                                    f"{type(store).__name__} {store!r:.60}")
        self.store = store
        self.registered: dict[Hashable, Binding] = {}
        self.provider: Any = None
        self._bound: tuple[Hashable, Any, Binding | str] | None = None
        self._warned: set[tuple[Hashable, str]] = set()

    def register(self, key: Hashable, model_cache: ModelCache) -> None:
        """Serve `key` from `model_cache`, whatever the provider has loaded."""
        if not isinstance(model_cache, ModelCache):
            raise InvalidInputError(f"model_cache: give what store.bind(model, model_id) returns, not "
                                    f"{type(model_cache).__name__}")
        self.registered[key] = Binding(model_cache)

    def forget(self) -> None:
        """Drop the binding of the provider's model (it is being unloaded)."""
        self._bound = None

    def resolve(self, key: Hashable, tokens: list) -> Binding | str:
        """The bound model for `key`, else `IN_RAM` or `UNCACHED`."""
        try:
            negative = bool(tokens) and min(tokens) < 0
        except TypeError:
            raise InvalidInputError("token ids must be ints") from None
        if negative:  # image placeholders (mlx_lm.server's vision cache keys)
            return self._unstorable(key, "image prompts are cached in RAM only")
        binding = self.registered.get(key)
        if binding is not None:
            return binding
        provider = self.provider
        if provider is None:
            return self._unstorable(key, "no model is registered for this key")
        model = getattr(provider, "model", None)
        if model is None or getattr(provider, "model_key", None) != key:
            return self._unstorable(key, "the server has another model loaded")
        if self._bound is not None and self._bound[0] == key and self._bound[1] is model:
            return self._bound[2]
        binding = self._bind(key, provider, model)
        self._bound = (key, model, binding)
        return binding

    def _bind(self, key: Hashable, provider: Any, model: Any) -> Binding | str:
        model_id, adapter, draft = split_key(key)
        if draft is not None or getattr(provider, "draft_model", None) is not None:
            return self._unstorable(key, "speculative decoding: with a draft model nothing is cached",
                                    UNCACHED)
        if model_id is None:
            return self._unstorable(key, f"cannot tell which model the key {key!r} means")
        try:
            plain = self.store.bind(model, model_id, adapter_path=adapter)
            quantized = self._bind_quantized(provider, model, model_id, adapter)
        except KVStoreError as e:
            return self._unstorable(key, str(e))
        binding = Binding(plain, quantized)
        log.info("kvstore: serving %s (fingerprint %s) from the store", model_id, plain.fingerprint.hex()[:12])
        return binding

    def _bind_quantized(self, provider: Any, model: Any, model_id: Any, adapter: Any) -> ModelCache | None:
        """With `--kv-bits`, the server's caches turn into `QuantizedKVCache`s once they pass
        `--quantized-kv-start` tokens: those go to a second namespace, shorter ones to the plain one."""
        cli_args = getattr(provider, "cli_args", None)
        kv_bits = getattr(cli_args, "kv_bits", None)
        if kv_bits is None:
            return None
        group = getattr(cli_args, "kv_group_size", None) or 64
        return self.store.bind(model, model_id, adapter_path=adapter, kv_bits=kv_bits, kv_group_size=group)

    def _unstorable(self, key: Hashable, reason: str, where: str = IN_RAM) -> str:
        if (key, reason) not in self._warned:
            self._warned.add((key, reason))
            then = "they stay in RAM as in stock mlx_lm.server" if where == IN_RAM else "every prompt is computed"
            log.warning("kvstore: not storing prompt caches for %r (%s); %s", key, reason, then)
        return where


def split_key(key: Hashable) -> tuple[Any, Any, Any]:
    """`(model_id, adapter_path, draft_model_path)` of a server key (a tuple, or a bare path)."""
    if isinstance(key, tuple):
        parts = list(key) + [None] * 3
        return parts[0], parts[1], parts[2]
    if isinstance(key, (str, os.PathLike)):
        return key, None, None
    return None, None, None
