"""Run by tests/test_restore.py in fresh processes: insert a prompt, or restore it from one tier
and compare with a recompute.

    python tests/restore_proc.py insert|check STORE MODEL_DIR SPEC_JSON TOKENS_JSON [TIER]
    python tests/restore_proc.py checks STORES_JSON MODEL_DIR SPEC_JSON TOKENS_JSON [TIER]

STORES: a list of store folders, or of {"store": FOLDER, "spec": SPEC, "tier": TIER} for a store
checked with its own spec and tier (a quantized store and an unquantized one side by side).

SPEC: {"kv_bits": 8} for quantized caches, {"cachelist": true} for the model wrapped so every
layer's cache is a `CacheList`, {"disk_kv_bits": 8} for a store that quantizes K/V on disk
(compared with a recompute, like the others). TIER (check): "disk" (memory tier off, records from blob files),
"memory" (inserted, written, then served by the memory tier) or "pending" (inserted while the
writer is held: served from the writer's queue). `checks` checks several stores one after the
other, each opened afresh, in one process (one model load and interpreter start for all: the
damaged-blob tests check dozens of copies). Prints one JSON line (a list for `checks`).

`insert_here` is the `insert` mode in the calling process, for tests whose insert is only setup
(the restore they check runs in a fresh process): the store is flushed and closed when it returns.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from procs import greedy

C = 16
GREEDY = 20


class CacheListModel(nn.Module):
    """A real mlx-lm model whose every layer cache is a `CacheList(KVCache())`: the model runs on
    the lists' first caches (no small demo architecture uses CacheList)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.layers = inner.layers

    def make_cache(self):
        from mlx_lm.models.cache import CacheList, make_prompt_cache

        return [CacheList(c) for c in make_prompt_cache(self.inner)]

    def __call__(self, inputs, cache=None):
        return self.inner(inputs, cache=[c.caches[0] for c in cache] if cache is not None else None)


def load_model(model_dir: str, spec: dict):
    from mlx_lm import load

    model, _ = load(model_dir)
    return CacheListModel(model) if spec.get("cachelist") else model


def new_cache(model, spec: dict):
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def prefill(model, tokens, spec: dict):
    """The cache of `tokens` as generation makes it (quantized after the prompt with kv_bits)."""
    cache = new_cache(model, spec)
    model(mx.array([tokens]), cache=cache)
    if spec.get("kv_bits"):
        cache = [c.to_quantized(group_size=spec.get("kv_group_size", 64), bits=spec["kv_bits"]) for c in cache]
    mx.eval(arrays(cache))
    return cache


def arrays(cache) -> list:
    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


def token_layers(cache) -> list:
    """Every cache with a token axis, inside CacheLists too."""
    from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache

    out = []
    for c in cache:
        if isinstance(c, CacheList):
            out += token_layers(c.caches)
        elif isinstance(c, (KVCache, QuantizedKVCache, RotatingKVCache)) and c.keys is not None:
            out.append(c)
    return out


def first_keys(layer) -> mx.array:
    return layer.keys[0] if isinstance(layer.keys, tuple) else layer.keys


def address(a: mx.array) -> int:
    view = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    return view.__array_interface__["data"][0]


def room(layer) -> dict:
    keys = first_keys(layer)
    return {"class": type(layer).__name__, "dtype": str(keys.dtype), "capacity": int(keys.shape[2]),
            "offset": int(layer.offset),
            "max_size": getattr(layer, "max_size", None), "idx": getattr(layer, "_idx", None)}


def main(argv: list[str]) -> dict | list[dict]:
    mode, store_arg, model_dir, spec_json, tokens_json = argv[:5]
    tier = argv[5] if len(argv) > 5 else "disk"
    spec, tokens = json.loads(spec_json), json.loads(tokens_json)
    model = load_model(model_dir, spec)
    if mode == "checks":
        models = {bool(spec.get("cachelist")): model}
        refs: dict = {}  # the recompute of a restore point, the same for every store of a spec
        out = []
        for item in json.loads(store_arg):
            item = {"store": item} if isinstance(item, str) else item
            its_spec, its_tier = item.get("spec", spec), item.get("tier", tier)
            cachelist = bool(its_spec.get("cachelist"))
            if cachelist not in models:
                models[cachelist] = load_model(model_dir, its_spec)
            out.append(one("check", item["store"], models[cachelist], model_dir, its_spec, tokens, its_tier,
                           refs.setdefault(json.dumps(its_spec, sort_keys=True), {})))
        return out
    return one(mode, store_arg, model, model_dir, spec, tokens, tier)


def insert_here(store_dir, model_dir, spec: dict, tokens: list[int]) -> dict:
    """`insert` in this process (no interpreter and mlx-lm start-up to pay for), the store
    flushed and closed on return, before any checking process opens it."""
    model = load_model(str(model_dir), spec)
    return one("insert", str(store_dir), model, str(model_dir), spec, tokens, "disk")


def one(mode: str, store_dir: str, model, model_dir: str, spec: dict, tokens: list[int], tier: str,
        refs: dict | None = None) -> dict:
    """Insert, or restore from `tier` and compare with a recompute. The recompute depends only on
    the model, spec, tokens and restore point: `refs` keeps it for the next store checked."""
    import kvstore

    prompt = tokens[:-1]  # stored; the last token is what the restored cache processes first
    fingerprint = b"cachelist-model!" if spec.get("cachelist") else None
    memory = 0 if tier == "disk" else 1 << 30
    with kvstore.open(store_dir, chunk_size=C, memory_bytes=memory, disk_kv_bits=spec.get("disk_kv_bits")) as store:
        mc = store.bind(model, model_dir, kv_bits=spec.get("kv_bits"), kv_group_size=spec.get("kv_group_size", 64),
                        fingerprint=fingerprint)
        if mode == "insert" or tier in ("memory", "pending"):
            if tier == "pending":
                store.writer.pause()
            mc.insert(prompt, prefill(model, prompt, spec))
            if tier != "pending":
                store.flush()
        if mode == "insert":
            return {"inserted": len(prompt)}
        hits = store.memory.hits
        pending = store.writer.pending_bytes
        cache, rest = mc.fetch(tokens)
        served = {"memory_hits": store.memory.hits - hits, "pending_bytes": pending,
                  "quarantined": store.counters["quarantined"]}
        reused = len(tokens) - len(rest)
        layers = token_layers(cache)
        before = [room(layer) for layer in layers]
        where = [address(first_keys(layer)) for layer in layers]
        logits = model(mx.array([rest]), cache=cache)
        mx.eval(logits, arrays(cache))
        in_place = [address(first_keys(layer)) == a for layer, a in zip(layers, where)]
        after = [room(layer) for layer in layers]
        if tier == "pending":
            store.writer.resume()
        refs = {} if refs is None else refs
        if reused not in refs:
            if spec.get("kv_bits"):  # the reference: the quantized prompt cache, cut to the restore point
                ref_cache = prefill(model, prompt, spec)
                for c in ref_cache:
                    c.trim(c.offset - reused)
                ref = model(mx.array([rest]), cache=ref_cache)
            else:
                ref_cache = new_cache(model, spec)
                ref = model(mx.array([tokens]), cache=ref_cache)
            mx.eval(ref)
            refs[reused] = (ref[0, -1], greedy(model, ref_cache, ref, GREEDY))
        ref_logits, greedy_ref = refs[reused]
        return {
            "reused": reused,
            "max_abs_diff": float(mx.abs(logits[0, -1] - ref_logits).max().item()),
            "greedy": greedy(model, cache, logits, GREEDY),
            "greedy_ref": greedy_ref,
            "classes": sorted({type(c).__name__ for c in cache}),
            "before": before,
            "after": after,
            "in_place": in_place,
            **served,
        }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
