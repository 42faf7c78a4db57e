"""How each mlx-lm cache class is stored and restored, one codec per class.

A *sliceable* codec stores, for every record, the layer's state for exactly that record's tokens
(a delta along the token axis) and rebuilds a layer at any position from consecutive deltas.
Layers without a codec make the whole model unsupported: it is served from scratch and nothing is
stored for it, so nothing can ever be restored wrongly.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

# A getter that returns the stored array `name` of one record.
ArrayOf = Callable[[str], mx.array]


class Codec:
    """Stores and restores one cache class."""

    #: cache class this codec handles (exact type, not subclasses: a subclass may keep more state)
    cls: type = object

    def layout(self, layer) -> dict:
        """What about this layer shapes its stored data; part of the namespace."""
        return {"class": type(layer).__name__}

    def offset(self, layer) -> int:
        """How many tokens the layer has processed."""
        raise NotImplementedError

    def snapshot(self, layer, n: int) -> dict[str, mx.array]:
        """Lazy views of the layer's state for tokens [0, n) along the token axis."""
        raise NotImplementedError

    def restore(self, pieces: Sequence[dict[str, mx.array]], length: int):
        """A fresh cache object holding `length` tokens, from consecutive record pieces."""
        raise NotImplementedError


class KVCacheCodec(Codec):
    """`KVCache`: keys and values of shape (B, heads, tokens, head_dim)."""

    cls = KVCache
    names = ("keys", "values")

    def offset(self, layer) -> int:
        return int(layer.offset)

    def snapshot(self, layer, n: int) -> dict[str, mx.array]:
        if layer.keys is None:
            return {}
        return {"keys": layer.keys[..., :n, :], "values": layer.values[..., :n, :]}

    def restore(self, pieces: Sequence[dict[str, mx.array]], length: int):
        layer = KVCache()
        if length > 0:
            layer.keys = _concat([p["keys"] for p in pieces], length)
            layer.values = _concat([p["values"] for p in pieces], length)
            layer.offset = length
        return layer


def _concat(parts: list[mx.array], length: int) -> mx.array:
    """Join token-axis pieces and keep the first `length` tokens; the last piece may be cut."""
    kept, total = [], 0
    for part in parts:
        if total >= length:
            break
        take = min(part.shape[2], length - total)
        kept.append(part if take == part.shape[2] else part[:, :, :take])
        total += take
    return kept[0] if len(kept) == 1 else mx.concatenate(kept, axis=2)


CODECS: dict[type, Codec] = {c.cls: c for c in (KVCacheCodec(),)}


def codec_for(layer) -> Codec | None:
    return CODECS.get(type(layer))
