"""K/V quantized on disk (`kvstore.open(disk_kv_bits=8)`): codecs that store a bf16/f16 layer's
keys and values with mlx's affine quantization and restore them to the layer's own class and dtype.

A quantized layer stores, for each of `keys` and `values`, three tensors with the token axis 2:
`NAME.q` (the packed codes, uint32, as `mx.quantize` gives them), `NAME.scales` and `NAME.biases`
(one per group of `group_size` elements of head_dim, in the cache's dtype). Every token is
quantized on its own, so a record's tensors are the same whichever prompt wrote it, and the
restore moves these bytes like any other (checksummed per tensor). `build` then decodes the
filled arrays in one pass into the final keys and values: the model gets a plain `KVCache` (or
`RotatingKVCache`) of its dtype, with the same shapes, offset and spare capacity as a bf16 store
gives. Spare capacity stays zero: zero codes, scales and biases decode to zeros.

Records in RAM (the memory tier, the writer's queue) hold the same quantized tensors: every tier
serves the same K/V, and a chain mixing records of several tiers restores consistently.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx

from kvstore.errors import InvalidInputError
from kvstore.restore.codecs import Arrays, KVCodec, RotatingCodec

#: The `disk_kv_bits` values the store accepts (None or 0: K/V stored as the cache holds them).
DISK_KV_BITS = (4, 8)
GROUP_SIZES = (64, 32)  # mlx-lm's QuantizedKVCache default first; 32 for head_dim 32, 96, 160...
_PARTS = ("q", "scales", "biases")
# The stored layer fields an `_OnDisk` codec quantizes (a sliding window's too).
_QUANTIZED = ("keys", "values")


def check_disk_kv_bits(value) -> int | None:
    """`disk_kv_bits` as the store uses it: 4 or 8, or None (0 and None: not quantized)."""
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    if isinstance(value, bool) or value not in DISK_KV_BITS:
        raise InvalidInputError(
            f"disk_kv_bits must be one of {', '.join(map(str, DISK_KV_BITS))} (or 0/None: K/V "
            f"stored as the cache holds them), got {value!r}")
    return int(value)


def group_size_for(head_dims: list[int]) -> int | None:
    """The quantization group size for a layer whose keys and values have these last dimensions:
    64 if it divides them all, else 32, else None (the layer is stored unquantized)."""
    for g in GROUP_SIZES:
        if all(d % g == 0 for d in head_dims):
            return g
    return None


def decode(q: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """`mx.dequantize` of these tensors, lazily: in float32 with one rounding to the scales' dtype
    for 8 bits (the same formula, half the time of `mx.dequantize` on mlx-cpu, and never further
    from the original); `mx.dequantize` itself for other widths."""
    if bits != 8:
        return mx.dequantize(q, scales, biases, group_size=group_size, bits=bits)
    codes = q.view(mx.uint8).reshape(*q.shape[:-1], scales.shape[-1], group_size)
    out = codes.astype(mx.float32) * scales[..., None].astype(mx.float32) + biases[..., None].astype(mx.float32)
    return out.astype(scales.dtype).reshape(*q.shape[:-1], scales.shape[-1] * group_size)


_DECODE_THREADS = 2  # keys and values of a layer; mlx-cpu runs each op on one core
_decoders: ThreadPoolExecutor | None = None
_streams = threading.local()  # mlx streams belong to the thread that made them


def _pool() -> ThreadPoolExecutor:
    global _decoders
    if _decoders is None:
        _decoders = ThreadPoolExecutor(max_workers=_DECODE_THREADS, thread_name_prefix="kvstore-decode")
    return _decoders


def _decoded(q: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int) -> mx.array:
    """`decode`, evaluated on this thread's own stream."""
    stream = getattr(_streams, "decode", None)
    if stream is None:
        stream = _streams.decode = mx.new_stream(mx.cpu)
    with mx.stream(stream):
        out = decode(q, scales, biases, bits, group_size)
        mx.eval(out)
    return out


class _OnDisk:
    """Mixed into a codec of a token-axis class: its `keys` and `values` deltas are stored quantized."""

    deferred = True  # quantizing costs about what reading the bytes does: not on the caller's thread

    def __init__(self, template, bits: int, group_size: int):
        super().__init__(template)
        self.bits, self.group_size = bits, group_size

    def layout(self) -> dict:
        return {**super().layout(), "disk_bits": self.bits, "disk_group_size": self.group_size}

    def encode(self, name, a):
        if name not in _QUANTIZED:
            return {name: a}
        return dict(zip((f"{name}.{part}" for part in _PARTS),
                        mx.quantize(a, group_size=self.group_size, bits=self.bits)))

    def build(self, p, arrays: Arrays, checkpoint):
        decoded = dict(arrays)
        names = [name for name in _QUANTIZED if f"{name}.q" in arrays]
        parts = [[decoded.pop(f"{name}.{part}") for part in _PARTS] for name in names]
        # Keys and values decoded side by side, now (part of the restore, not of the first step).
        decoded.update(zip(names, _pool().map(lambda qsb: _decoded(*qsb, self.bits, self.group_size), parts)))
        return super().build(p, decoded, checkpoint)


class KVOnDisk(_OnDisk, KVCodec):
    """`KVCache` with its keys and values quantized on disk."""


class RotatingOnDisk(_OnDisk, RotatingCodec):
    """`RotatingKVCache` (sliding window) with its keys and values quantized on disk."""


_ON_DISK = {KVCodec: KVOnDisk, RotatingCodec: RotatingOnDisk}


def quantized_codecs(codecs: list, traced: list, bits: int | None) -> list:
    """The codecs with every layer that can be quantized on disk replaced by its quantizing codec:
    a `KVCache` or `RotatingKVCache` layer whose traced K/V (`traced`: the layer after one token,
    or None if unknown) are bf16 or f16 with a head_dim that 64 or 32 divides. Other layers (f32,
    already quantized, recurrent, lists of caches, unknown classes) keep their codec."""
    if bits is None:
        return codecs
    out = []
    for codec, layer in zip(codecs, traced):
        kind = _ON_DISK.get(type(codec))
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if kind is None or not isinstance(keys, mx.array) or not isinstance(values, mx.array) \
                or keys.dtype not in (mx.bfloat16, mx.float16) or values.dtype != keys.dtype:
            out.append(codec)
            continue
        group = group_size_for([keys.shape[-1], values.shape[-1]])
        out.append(codec if group is None else kind(layer, bits, group))
    return out


def layout_bits(layout: object) -> int | None:
    """The bits a cache layout (a bound model's, or a pack manifest's, read as it comes) stores
    K/V quantized to on disk (`disk_kv_bits`: a layer's own, or a CacheList part's), or None
    where no layer is."""
    layers = layout.get("layers") if isinstance(layout, dict) else None
    for layer in layers if isinstance(layers, list) else ():
        found = re.search(r"'disk_bits': (\d+)", str(layer))
        if found:
            return int(found[1])
    return None
