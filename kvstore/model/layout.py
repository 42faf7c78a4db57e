"""A model's cache layout: the caches its generation uses, one codec per layer, and the layout
that goes into the namespace (changed caches never share records)."""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from kvstore.errors import InvalidInputError
from kvstore.restore.codecs import Codec, make_codec
from kvstore.restore.quant import quantized_codecs

log = logging.getLogger("kvstore")
_SAID: set[tuple[int, bool]] = set()  # (model, not kv_bits) told that disk_kv_bits does nothing for them (once each)


def make_template(model, kv_bits: int | None, kv_group_size: int) -> list:
    """The caches this model's generation uses: `make_prompt_cache`, with `KVCache` layers
    quantized the way mlx-lm's `maybe_quantize_kv_cache` does when `kv_bits` is set."""
    check_model(model)
    if kv_bits is not None and kv_bits not in (2, 3, 4, 5, 6, 8):
        raise InvalidInputError(f"kv_bits must be one of 2, 3, 4, 5, 6, 8, got {kv_bits!r}")
    if kv_bits is not None and kv_group_size not in (32, 64, 128):  # MLX's quantize aborts on 0
        raise InvalidInputError(f"kv_group_size must be 32, 64 or 128, got {kv_group_size!r}")
    cache = make_prompt_cache(model)
    if kv_bits is not None:
        cache = [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c
                 for c in cache]
    return cache


def check_model(model) -> None:
    """Refuse what is no loaded mlx-lm model, before mlx-lm's own code fails on it somewhere inside."""
    if isinstance(model, tuple):
        raise InvalidInputError("model: give the loaded mlx-lm model, not the (model, tokenizer) pair "
                                "mlx_lm.load returns: `model, tokenizer = load(MODEL)`")
    if not (hasattr(model, "parameters")
            and (hasattr(model, "make_cache") or hasattr(model, "layers"))):
        raise InvalidInputError(f"model: give the loaded mlx-lm model (from mlx_lm.load), not "
                                f"{type(model).__name__} {model!r:.60}; its folder or repo id goes in model_id")


def describe(model, template: list, disk_kv_bits: int | None = None) -> tuple[dict, list[Codec]]:
    """The cache layout (part of the namespace) and one codec per layer. With `disk_kv_bits`, the
    layers whose K/V are bf16/f16 are stored quantized (`restore.quant`); the model runs one token
    into `template` to tell their dtype and head_dim (the graph is built, never computed)."""
    codecs = [make_codec(layer) for layer in template]
    dtypes = sorted({str(v.dtype) for _, v in tree_flatten(model.parameters())})
    if disk_kv_bits is not None:
        plain = codecs
        codecs = quantized_codecs(codecs, _traced(model, template), disk_kv_bits)
        # (kvstore serve --kv-bits binds twice: its prompt caches, not yet quantized, are stored
        # through the plain bind, where disk_kv_bits may act; so only mlx-lm's caches are named)
        mlx = next((c for c in template if isinstance(c, QuantizedKVCache)), None)
        if all(a is b for a, b in zip(plain, codecs)) and (id(model), mlx is None) not in _SAID:
            _SAID.add((id(model), mlx is None))
            if mlx is not None:
                log.warning("kvstore: disk_kv_bits=%d has no effect on the caches mlx-lm quantizes (kv_bits=%d): "
                            "their K/V are stored as they are", disk_kv_bits, mlx.bits)
            else:
                log.warning("kvstore: disk_kv_bits=%d has no effect on this model: %s, so its K/V are stored as "
                            "they are", disk_kv_bits, _why_unquantized(template, dtypes))
    return {"layers": [c.layout() for c in codecs], "param_dtypes": dtypes}, codecs


def _why_unquantized(traced: list, dtypes: list[str]) -> str:
    """Why no layer of `traced` (the layers after one token) is quantized on disk: no bf16/f16
    K/V, or (a bf16 model of a small head_dim) no quantization group that divides its head_dim."""
    half = [layer for layer in traced if isinstance(getattr(layer, "keys", None), mx.array)
            and layer.keys.dtype in (mx.bfloat16, mx.float16)]
    if not half and not {"mlx.core.bfloat16", "mlx.core.float16"} & set(dtypes):
        return f"none of its attention layers holds bf16 or f16 K/V (its parameters are {', '.join(dtypes)})"
    if not half:  # (a CacheList's parts, recurrent state, K/V quantized by mlx-lm: stored as they are)
        kinds = ", ".join(sorted({type(layer).__name__ for layer in traced}))
        return f"none of its layers is a KVCache or RotatingKVCache of bf16 or f16 K/V (its caches: {kinds})"
    dims = sorted({d for layer in half for d in (layer.keys.shape[-1], layer.values.shape[-1])})
    return (f"its bf16/f16 K/V have a head_dim of {', '.join(map(str, dims))}, which neither 64 nor 32 "
            "(the quantization groups) divides")


def _traced(model, template: list) -> list:
    """`template` after the model ran one token into it (lazily). Caches mlx-lm quantizes
    (`kv_bits`) run as plain `KVCache`s here: they are stored as they are whatever their dtype, and
    a quantization group that does not divide the head_dim must not fail a setting that has no
    effect on them (that is mlx-lm's to say, when it quantizes)."""
    traced = [KVCache() if isinstance(c, QuantizedKVCache) else c for c in template]
    try:
        model(mx.array([[0]]), cache=traced)
    except Exception as e:
        raise InvalidInputError(
            f"disk_kv_bits needs to run the model on one token to find its K/V dtype, which "
            f"failed ({type(e).__name__}: {e}): open the store with disk_kv_bits=0") from e
    return traced
