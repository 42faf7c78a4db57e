"""What a record read from beyond this process must hold, and a cache a caller inserts: the
names, shapes and dtypes of the arrays this model's cache has. A blob that passed its checksums
can still have been planted, or taken back by a rebuild from another model's files; a wrong one
would crash generation or be wrong.
"""

from __future__ import annotations

import logging
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvstore.errors import BlobError, InvalidInputError
from kvstore.records import CHECKPOINT
from kvstore.restore.arrays import mx_dtype
from kvstore.restore.codecs import ArraysCodec, CacheListCodec, Codec
from kvstore.tiers.base import SizeBound

log = logging.getLogger("kvstore")


class RecordCheck:
    """`check(kind, ntokens, entries)` raises BlobError unless a record's tensors (name -> dtype tag
    and shape) are what this model's cache holds; each record layout is checked once."""

    def __init__(self, model, codecs: list[Codec], new_cache: Callable[[], list], model_id: str):
        self.model, self.codecs, self.new_cache, self.model_id = model, codecs, new_cache, model_id
        self._shapes: tuple[dict, dict] | None | bool = False  # False: not traced yet
        self._raw: dict[str, tuple[tuple, mx.Dtype]] = {}  # what each layer holds, before encoding
        self._bound: SizeBound | None | bool = False  # False: not worked out yet
        self._checked: set[tuple] = set()  # record layouts already found to be this model's
        # The same, by the identity of a tensor table shared by every blob of its layout (blobs
        # hands out one dict per table, never changed): a 32k-token prompt opens 128 records, and
        # building the key above for each cost 2 ms. The table is kept, so its id stays its own.
        self._known: dict[int, tuple[dict, set[tuple[int, int]]]] = {}

    def __call__(self, kind: int, ntokens: int, entries: dict) -> None:
        known = self._known.get(id(entries))
        if known is not None and known[0] is entries and (kind, ntokens) in known[1]:
            return
        expected = self._expected_shapes()
        if expected is None:
            return
        key = (kind, ntokens, tuple((n, e.tag, e.shape) for n, e in entries.items()))
        if key not in self._checked:
            arrays = {name: _Shaped(tuple(e.shape), mx_dtype(e.tag)) for name, e in entries.items()}
            self._check_arrays(kind, ntokens, arrays)
            self._checked.add(key)
        if len(self._known) >= 1024:
            self._known.clear()
        self._known.setdefault(id(entries), (entries, set()))[1].add((kind, ntokens))

    def caller(self, cache: list, n: int, kv_bits: int | None) -> None:
        """InvalidInputError unless the caller's `cache` (of `n` tokens, to insert) is one of this
        model: its layers, their classes (`kv_bits`: quantized, as bound), the tokens each has
        processed, and each array's shape but for the token axis and its dtype (a cache of
        another model would be stored, then restored into this one and crash its next step)."""
        if not isinstance(cache, (list, tuple)):
            raise InvalidInputError(f"cache must be a list of mlx-lm cache objects, got {type(cache).__name__}")
        if len(cache) != len(self.codecs):
            raise InvalidInputError(f"cache has {len(cache)} layers; this model's cache has {len(self.codecs)}")
        for i, (codec, layer) in enumerate(zip(self.codecs, cache)):
            if type(layer) is not codec.cls:
                hint = (" (bind with kv_bits to store quantized caches)" if isinstance(layer, QuantizedKVCache)
                        else " (quantize it as mlx-lm does, or bind without kv_bits)" if kv_bits else "")
                raise InvalidInputError(f"cache layer {i} is a {type(layer).__name__}; this model's layout has "
                                        f"{codec.cls.__name__}{hint}")
            offset = codec.offset(layer)
            if offset is not None and offset != n:
                raise InvalidInputError(f"cache layer {i} has processed {offset} tokens but {n} tokens were given: "
                                        "insert the tokens the cache actually holds")
        if self._expected_shapes() is None:
            return

        def walk(codec: Codec, layer, prefix: str) -> str | None:
            if isinstance(codec, CacheListCodec):
                return next(filter(None, (walk(c, sub, f"{prefix}.{j}")
                                          for j, (c, sub) in enumerate(zip(codec.subs, layer.caches)))), None)
            plain = codec.slices(layer, n)  # the layer's own arrays, when they are: no mlx op made
            held = {k: v[0] for k, v in plain.items()} if plain is not None else \
                {k: v[0] for k, v in codec.deltas(layer, n).items()}
            for raw, delta in held.items():
                want = self._raw.get(f"{prefix}.{raw}")
                shape = tuple(delta.shape)
                if want is not None and (delta.dtype != want[1] or len(shape) != len(want[0]) or any(
                        a != b for i, (a, b) in enumerate(zip(shape, want[0])) if i != 2)):
                    return (f"cache layer {prefix}'s {raw} is {delta.dtype} {list(shape)}, not the "
                            f"{want[1]} {list(want[0][:2]) + ['n'] + list(want[0][3:])} this model's cache holds")
            return None

        why = next(filter(None, (walk(c, layer, str(i)) for i, (c, layer) in enumerate(zip(self.codecs, cache)))),
                   None)
        if why is not None:
            raise InvalidInputError(f"{why}: a cache of another model")

    def bound(self) -> SizeBound | None:
        """The most bytes a record of this model can be (None if the model cannot be traced);
        worked out once, as the shapes are (every fetch asks)."""
        if self._bound is False:
            self._bound = self._size_bound()
        return self._bound

    def _size_bound(self) -> SizeBound | None:
        expected = self._expected_shapes()
        if expected is None:
            return None
        deltas, states = expected
        return SizeBound(per_token=sum(_nbytes(shape, dtype) for shape, dtype, _ in deltas.values()) + 4,
                         checkpoint=sum(_nbytes(shape, dtype) for shape, dtype in states.values()),
                         tensors=len(deltas) + len(states))

    def _check_arrays(self, kind: int, ntokens: int, arrays: dict) -> None:
        deltas, states = self._expected_shapes()
        if kind == CHECKPOINT:
            for name, (shape, dtype) in states.items():
                a = arrays.get(name)
                if a is None or tuple(a.shape) != shape or a.dtype != dtype:
                    raise BlobError(f"checkpoint array {name!r} is not the {dtype} {list(shape)} this model has")
            return
        lengths: dict[str, set[int]] = {}
        for name, a in arrays.items():
            want = deltas.get(name)
            ok = want is not None and a.dtype == want[1] and a.ndim == len(want[0]) and a.shape[2] <= ntokens
            if not ok or any(n != m for i, (n, m) in enumerate(zip(a.shape, want[0])) if i != 2):
                raise BlobError(f"array {name!r} {a.dtype} {list(a.shape)} is not what this model's "
                                f"cache holds for {ntokens} tokens")
            lengths.setdefault(want[2], set()).add(a.shape[2])
        for group, found in lengths.items():
            if len(found) != 1 or sum(1 for name in arrays if deltas[name][2] == group) != \
                    sum(1 for d in deltas.values() if d[2] == group):
                raise BlobError(f"the arrays of layer {group} are incomplete or of different lengths")

    def _expected_shapes(self) -> tuple[dict, dict] | None:
        """name -> (shape, dtype, layer) of a record's deltas (token axis 2 free) and name ->
        (shape, dtype) of recurrent checkpoints, from the cache one token gives. The graph is
        built, never computed. None if the model cannot be traced (then nothing is checked)."""
        if self._shapes is False:
            try:
                cache = self.new_cache()
                self.model(mx.array([[0]]), cache=cache)
                deltas: dict = {}
                states: dict = {}

                def leaves(codec: Codec, layer, prefix: str) -> None:
                    if isinstance(codec, CacheListCodec):
                        for j, (c, sub_layer) in enumerate(zip(codec.subs, layer.caches)):
                            leaves(c, sub_layer, f"{prefix}.{j}")
                        return
                    for raw, (delta, _) in codec.deltas(layer, 1).items():
                        self._raw[f"{prefix}.{raw}"] = (tuple(delta.shape), delta.dtype)
                        for name, a in codec.encode(raw, delta).items():  # what records hold
                            deltas[f"{prefix}.{name}"] = (tuple(a.shape), a.dtype, prefix)
                    if isinstance(codec, ArraysCodec):
                        for name, a in codec.checkpoint(layer).items():
                            states[f"{prefix}.{name}"] = (tuple(a.shape), a.dtype)

                for i, (codec, layer) in enumerate(zip(self.codecs, cache)):
                    leaves(codec, layer, str(i))
                self._shapes = (deltas, states)
            except Exception as e:  # an exotic model: records are still checked by checksum
                log.warning("kvstore: cannot trace %s to check record shapes (%s)", self.model_id, e)
                self._shapes = None
        return self._shapes


def _nbytes(shape: tuple[int, ...], dtype: mx.Dtype) -> int:
    n = dtype.size
    for d in shape:
        n *= d
    return n


class _Shaped:
    """What `_check_arrays` looks at of an array: shape, dtype, ndim (from a header entry)."""

    def __init__(self, shape: tuple[int, ...], dtype: mx.Dtype):
        self.shape, self.dtype, self.ndim = shape, dtype, len(shape)
