"""A model's cache layout: the caches its generation uses, one codec per layer, and the layout
that goes into the namespace (changed caches never share records)."""

from __future__ import annotations

from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from kvstore.restore.codecs import Codec, make_codec


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
