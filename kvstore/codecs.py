"""How each mlx-lm cache class is stored and restored: one codec per class.

Two kinds of codec:
- *sliceable* codecs (`KVCache`, `QuantizedKVCache`, `RotatingKVCache`) store, in every chunk or
  tail record, the layer's arrays for that record's tokens (a delta along the token axis, axis 2).
  A delta is always a suffix of its record's tokens: a sliding-window cache only still holds the
  last tokens it saw, so older records may carry a shorter delta or none.
- *checkpoint* codecs (`ArraysCache`, and any class kvstore does not know) store the whole layer
  state at one position, in a checkpoint record that hangs from the chunk or tail ending there.

A layer can be restored at position p only if its codec says `valid(p)`; the store picks the
largest p every layer accepts. Nothing is ever restored from data that does not cover p exactly.
"""

from __future__ import annotations

import json
from typing import Sequence

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

Arrays = dict[str, mx.array]
# One record's share of a layer: (record start, record end, the layer's tensors in that record)
Piece = tuple[int, int, Arrays]


def sub(arrays: Arrays, prefix: str) -> Arrays:
    """The entries of `arrays` under `prefix.`, with the prefix removed."""
    head = prefix + "."
    return {k[len(head):]: v for k, v in arrays.items() if k.startswith(head)}


def covered(pieces: Sequence[Piece], start: int, end: int) -> bool:
    """Whether the pieces' token-axis data covers every position in [start, end)."""
    pos = start
    for s, e, arrays in pieces:
        if pos >= end:
            break
        n = _length(arrays)
        if n and e - n <= pos < e:
            pos = e
    return pos >= end


def gather(pieces: Sequence[Piece], start: int, end: int) -> Arrays:
    """Every tensor of the pieces cut to [start, end) and joined along the token axis."""
    parts: dict[str, list[mx.array]] = {}
    for s, e, arrays in pieces:
        n = _length(arrays)
        lo, hi = max(start, e - n), min(end, e)
        if not n or lo >= hi:
            continue
        for name, a in arrays.items():
            first = lo - (e - n)
            part = a if (first == 0 and hi - lo == n) else a[:, :, first : first + hi - lo]
            parts.setdefault(name, []).append(part)
    return {k: v[0] if len(v) == 1 else mx.concatenate(v, axis=2) for k, v in parts.items()}


def _length(arrays: Arrays) -> int:
    for a in arrays.values():
        return a.shape[2]
    return 0


class Codec:
    """Stores and restores one cache class."""

    checkpointed = False  # True: whole-state checkpoints instead of per-token deltas

    def __init__(self, template):
        self.cls = type(template)

    def layout(self) -> dict:
        """What shapes this layer's stored data; part of the namespace."""
        return {"class": self.cls.__name__}

    def offset(self, layer) -> int | None:
        """Tokens the layer has processed (None if the class does not say)."""
        return getattr(layer, "offset", None)

    def deltas(self, layer, n: int) -> dict[str, tuple[mx.array, int]]:
        """Lazy views of the token-axis data the layer still holds: name -> (array, first token)."""
        return {}

    def checkpoint(self, layer) -> Arrays:
        """The whole state of the layer, for a checkpoint record."""
        return {}

    def valid(self, p: int, pieces: Sequence[Piece], has_checkpoint: bool) -> bool:
        raise NotImplementedError

    def restore(self, p: int, pieces: Sequence[Piece], checkpoint: Arrays | None):
        """A fresh cache object equivalent to this layer after processing p tokens."""
        raise NotImplementedError


class KVCodec(Codec):
    """`KVCache`: keys and values (B, heads, tokens, head_dim), restorable at any position."""

    def deltas(self, layer, n):
        if layer.keys is None:
            return {}
        return {"keys": (layer.keys[..., :n, :], 0), "values": (layer.values[..., :n, :], 0)}

    def valid(self, p, pieces, has_checkpoint):
        return covered(pieces, 0, p)

    def restore(self, p, pieces, checkpoint):
        layer = KVCache()
        if p:
            got = gather(pieces, 0, p)
            layer.keys, layer.values, layer.offset = got["keys"], got["values"], p
        return layer


class QuantizedKVCodec(KVCodec):
    """`QuantizedKVCache`: packed weights, scales and biases, each stored as they are."""

    def __init__(self, template):
        super().__init__(template)
        self.group_size, self.bits = template.group_size, template.bits

    def layout(self):
        return {"class": self.cls.__name__, "group_size": self.group_size, "bits": self.bits}

    def deltas(self, layer, n):
        if layer.keys is None:
            return {}
        if (layer.group_size, layer.bits) != (self.group_size, self.bits):
            raise ValueError(
                f"quantized with group size {layer.group_size} and {layer.bits} bits, but the "
                f"store was bound for {self.group_size} and {self.bits}")
        out = {}
        for kind in ("keys", "values"):
            for j, a in enumerate(getattr(layer, kind)):
                out[f"{kind}.{j}"] = (a[..., :n, :], 0)
        return out

    def restore(self, p, pieces, checkpoint):
        layer = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if p:
            got = gather(pieces, 0, p)
            layer.keys = tuple(got[f"keys.{j}"] for j in range(3))
            layer.values = tuple(got[f"values.{j}"] for j in range(3))
            layer.offset = p
        return layer


class RotatingCodec(Codec):
    """`RotatingKVCache` (sliding window): deltas of the tokens still in the window.

    Restoring at p needs the kept first tokens and the last `max_size - keep` tokens before p;
    the result is the cache a model would hold after processing p tokens, in temporal order.
    """

    def __init__(self, template):
        super().__init__(template)
        self.max_size, self.keep = template.max_size, template.keep

    def layout(self):
        return {"class": self.cls.__name__, "max_size": self.max_size, "keep": self.keep}

    def deltas(self, layer, n):
        if layer.keys is None:
            return {}
        keys, values = layer._temporal_order(layer.keys), layer._temporal_order(layer.values)
        held = keys.shape[2]
        if held >= n:  # the window still holds every token
            return {"keys": (keys[..., :n, :], 0), "values": (values[..., :n, :], 0)}
        # Only the kept first tokens and the last held - keep tokens are left: store the latter.
        recent = held - self.keep
        return {"keys": (keys[..., self.keep :, :], n - recent),
                "values": (values[..., self.keep :, :], n - recent)}

    def _ranges(self, p: int) -> list[tuple[int, int]]:
        if p <= self.max_size:
            return [(0, p)]
        return [(0, self.keep), (p - (self.max_size - self.keep), p)]

    def valid(self, p, pieces, has_checkpoint):
        return all(covered(pieces, a, b) for a, b in self._ranges(p))

    def restore(self, p, pieces, checkpoint):
        layer = RotatingKVCache(max_size=self.max_size, keep=self.keep)
        if p:
            parts = [gather(pieces, a, b) for a, b in self._ranges(p) if b > a]
            join = (lambda k: parts[0][k] if len(parts) == 1 else mx.concatenate([q[k] for q in parts], axis=2))
            layer.keys, layer.values = join("keys"), join("values")
            layer.offset, layer._idx = p, layer.keys.shape[2]
        return layer


class ArraysCodec(Codec):
    """`ArraysCache` (recurrent/SSM state): restorable only where a checkpoint was taken."""

    checkpointed = True

    def __init__(self, template):
        super().__init__(template)
        self.size = len(template.cache)

    def layout(self):
        return {"class": self.cls.__name__, "size": self.size}

    def offset(self, layer):
        return None

    def checkpoint(self, layer):
        if layer.lengths is not None or layer.left_padding is not None:
            raise ValueError("a batched ArraysCache (with padding or lengths) cannot be stored")
        return {str(j): a for j, a in enumerate(layer.cache) if a is not None}

    def valid(self, p, pieces, has_checkpoint):
        return has_checkpoint

    def restore(self, p, pieces, checkpoint):
        layer = ArraysCache(self.size)
        for j in range(self.size):
            layer.cache[j] = (checkpoint or {}).get(str(j))
        return layer


class StateCodec(Codec):
    """Any other class: its `state` and `meta_state` as a checkpoint, rebuilt with `from_state`,
    as mlx-lm's own `load_prompt_cache` does."""

    checkpointed = True

    def layout(self):
        return {"class": f"{self.cls.__module__}.{self.cls.__qualname__}", "checkpoint": True}

    def offset(self, layer):
        return None

    def checkpoint(self, layer):
        out: Arrays = {}
        leaves = []
        for path, value in tree_flatten(layer.state):
            if isinstance(value, mx.array):
                out[f"a.{len(leaves)}"] = value
                leaves.append([path, "array"])
            elif value is None or isinstance(value, (bool, int, float, str)):
                leaves.append([path, value])
            else:
                raise ValueError(f"cannot checkpoint a {type(value).__name__} in {self.cls.__name__}.state")
        meta = getattr(layer, "meta_state", "")
        out["meta"] = mx.array(list(json.dumps({"leaves": leaves, "meta": meta}).encode()), dtype=mx.uint8)
        return out

    def valid(self, p, pieces, has_checkpoint):
        return has_checkpoint

    def restore(self, p, pieces, checkpoint):
        info = json.loads(bytes(checkpoint["meta"].tolist()).decode())
        leaves = [(path, checkpoint[f"a.{i}"] if value == "array" else value)
                  for i, (path, value) in enumerate(info["leaves"])]
        layer = self.cls.from_state(tree_unflatten(leaves) if leaves else [])
        if info["meta"]:
            layer.meta_state = info["meta"]
        return layer


class CacheListCodec(Codec):
    """`CacheList`: its caches, each with its own codec, under `j.` prefixes."""

    def __init__(self, template):
        super().__init__(template)
        self.subs = [make_codec(c) for c in template.caches]
        self.checkpointed = any(s.checkpointed for s in self.subs)

    def layout(self):
        return {"class": self.cls.__name__, "caches": [s.layout() for s in self.subs]}

    def offset(self, layer):
        offsets = {s.offset(c) for s, c in zip(self.subs, layer.caches)} - {None}
        return offsets.pop() if len(offsets) == 1 else None

    def deltas(self, layer, n):
        return {f"{j}.{k}": v for j, (s, c) in enumerate(zip(self.subs, layer.caches))
                for k, v in s.deltas(c, n).items()}

    def checkpoint(self, layer):
        return {f"{j}.{k}": v for j, (s, c) in enumerate(zip(self.subs, layer.caches))
                for k, v in s.checkpoint(c).items()}

    def valid(self, p, pieces, has_checkpoint):
        return all(s.valid(p, _sub_pieces(pieces, str(j)), has_checkpoint) for j, s in enumerate(self.subs))

    def restore(self, p, pieces, checkpoint):
        return CacheList(*(s.restore(p, _sub_pieces(pieces, str(j)),
                                     sub(checkpoint, str(j)) if checkpoint is not None else None)
                           for j, s in enumerate(self.subs)))


def _sub_pieces(pieces: Sequence[Piece], prefix: str) -> list[Piece]:
    return [(s, e, sub(arrays, prefix)) for s, e, arrays in pieces]


_CODECS = {
    KVCache: KVCodec,
    QuantizedKVCache: QuantizedKVCodec,
    RotatingKVCache: RotatingCodec,
    ArraysCache: ArraysCodec,
    CacheList: CacheListCodec,
}


def make_codec(template) -> Codec:
    """The codec of a cache object's exact class (a subclass may keep more state: checkpoint it)."""
    return _CODECS.get(type(template), StateCodec)(template)
