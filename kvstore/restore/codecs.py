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

Codecs only describe: `ranges(p)` says which token ranges a sliceable layer's tensors hold at p (in
order), `capacity(n)` how long to allocate them, and `build(p, arrays, checkpoint)` makes the
mlx-lm cache object from arrays the restore (`restore.fill`) has already filled.
"""

from __future__ import annotations

import json
from typing import Mapping, Sequence

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
# One record's share of a layer: (record start, record end, how many of its last tokens the
# layer's tensors hold in that record: a delta is always a suffix of its record's tokens)
Piece = tuple[int, int, int]
STEP = 256  # mlx-lm's cache growth step: restored caches get at least this much spare room


def sub(arrays: Arrays, prefix: str) -> Arrays:
    """The entries of `arrays` under `prefix.`, with the prefix removed."""
    head = prefix + "."
    return {k[len(head):]: v for k, v in arrays.items() if k.startswith(head)}


def by_prefix(arrays: Mapping[str, mx.array]) -> dict[str, Arrays]:
    """`arrays` split at the first dot of their names: {"3": {"keys": ..., "values": ...}, ...}
    (`sub` of every prefix at once, in one pass instead of one pass per layer)."""
    out: dict[str, Arrays] = {}
    for k, v in arrays.items():
        head, dot, rest = k.partition(".")
        if dot:
            out.setdefault(head, {})[rest] = v
    return out


def covered(pieces: Sequence[Piece], start: int, end: int) -> bool:
    """Whether the pieces' token-axis data covers every position in [start, end)."""
    pos = start
    for s, e, n in pieces:
        if pos >= end:
            break
        if n and e - n <= pos < e:
            pos = e
    return pos >= end


def spare(n: int, step: int = STEP) -> int:
    """A token-axis length with room for at least `step` more tokens than `n`, in whole steps."""
    return (n + step + step - 1) // step * step


class Codec:
    """Stores and restores one cache class."""

    checkpointed = False  # True: whole-state checkpoints instead of per-token deltas
    deferred = False  # True: `encode` costs real work, done off the caller's thread

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

    def slices(self, layer, n: int) -> dict[str, tuple[mx.array, int, int]] | None:
        """`deltas` as plain token ranges of the layer's own arrays, when that is all they are:
        name -> (array, first token, end), the tokens [first, end) of axis 2. None when a delta
        needs computing (then `deltas` is used). Saving such a range needs no mlx op at all."""
        return None

    def encode(self, name: str, a: mx.array) -> Arrays:
        """What the store keeps of delta `name` (lazy mlx ops, token axis 2 kept): by default the
        delta itself. A `deferred` codec's encoding runs on the writer's thread (see insert)."""
        return {name: a}

    def checkpoint(self, layer) -> Arrays:
        """The whole state of the layer, for a checkpoint record."""
        return {}

    def valid(self, p: int, pieces: Sequence[Piece], has_checkpoint: bool) -> bool:
        """Whether the layer can be restored at p from these pieces (or the checkpoint at p)."""
        raise NotImplementedError

    def leaves(self, prefix: str) -> list[tuple[str, "Codec"]]:
        """(name prefix, codec) of every cache this layer is made of (itself, but for CacheList)."""
        return [(prefix, self)]

    def ranges(self, p: int) -> list[tuple[int, int]]:
        """The token ranges, in order, that this layer's token-axis tensors hold at position p."""
        return []

    def capacity(self, n: int) -> int:
        """How long to allocate the token axis when `n` tokens are restored into it."""
        return spare(n)

    def build(self, p: int, arrays: Arrays, checkpoint: Arrays | None):
        """A fresh cache object equivalent to this layer after processing p tokens, from its
        token-axis tensors (already filled for `ranges(p)`, then spare capacity) or its checkpoint."""
        raise NotImplementedError


class KVCodec(Codec):
    """`KVCache`: keys and values (B, heads, tokens, head_dim), restorable at any position."""

    def deltas(self, layer, n):
        if layer.keys is None:
            return {}
        return {"keys": (layer.keys[..., :n, :], 0), "values": (layer.values[..., :n, :], 0)}

    def slices(self, layer, n):
        if type(layer) is not KVCache or layer.keys is None or layer.keys.ndim != 4:
            return None  # a subclass may hold its tensors differently
        return {"keys": (layer.keys, 0, n), "values": (layer.values, 0, n)}

    def valid(self, p, pieces, has_checkpoint):
        return covered(pieces, 0, p)

    def ranges(self, p):
        return [(0, p)] if p else []

    def capacity(self, n):
        return spare(n, KVCache.step)

    def build(self, p, arrays, checkpoint):
        layer = KVCache()
        if p and arrays:
            layer.keys, layer.values, layer.offset = arrays["keys"], arrays["values"], p
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

    def capacity(self, n):
        return spare(n, QuantizedKVCache.step)

    def build(self, p, arrays, checkpoint):
        layer = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        if p and arrays:
            layer.keys = tuple(arrays[f"keys.{j}"] for j in range(3))
            layer.values = tuple(arrays[f"values.{j}"] for j in range(3))
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

    def ranges(self, p):
        return [(a, b) for a, b in self._ranges(p) if b > a] if p else []

    def capacity(self, n):
        # A full window is rotated in place; a shorter one grows by `step` up to the window.
        return n if n >= self.max_size else min(self.max_size, spare(n, RotatingKVCache.step))

    def build(self, p, arrays, checkpoint):
        layer = RotatingKVCache(max_size=self.max_size, keep=self.keep)
        if p and arrays:
            layer.keys, layer.values = arrays["keys"], arrays["values"]
            # _idx: where the next token goes, after the tokens restored in temporal order.
            layer.offset, layer._idx = p, sum(b - a for a, b in self.ranges(p))
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

    def build(self, p, arrays, checkpoint):
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

    def build(self, p, arrays, checkpoint):
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

    def slices(self, layer, n):
        out = {}
        for j, (s, c) in enumerate(zip(self.subs, layer.caches)):
            got = s.slices(c, n)
            if got is None:
                return None
            out.update({f"{j}.{k}": v for k, v in got.items()})
        return out

    def checkpoint(self, layer):
        return {f"{j}.{k}": v for j, (s, c) in enumerate(zip(self.subs, layer.caches))
                for k, v in s.checkpoint(c).items()}

    def valid(self, p, pieces, has_checkpoint):
        raise TypeError("a CacheList is restored cache by cache: see `leaves`")

    def leaves(self, prefix):
        return [leaf for j, s in enumerate(self.subs) for leaf in s.leaves(f"{prefix}.{j}")]

    def build(self, p, arrays, checkpoint):
        return CacheList(*(s.build(p, sub(arrays, str(j)),
                                   sub(checkpoint, str(j)) if checkpoint is not None else None)
                           for j, s in enumerate(self.subs)))


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
