"""Building the mlx-lm cache objects of a filled plan: one per layer, by its codec."""

from __future__ import annotations

from typing import Mapping, Sequence

import mlx.core as mx

from kvstore.restore.arrays import mx_dtype
from kvstore.restore.codecs import Codec, by_prefix
from kvstore.restore.plan import Plan
from kvstore.restore.source import Source


def checkpoint_arrays(source: Source) -> dict[str, mx.array]:
    """Every tensor of a checkpoint record, checked, as mlx arrays of their real dtypes."""
    out = {}
    for name, e in source.entries.items():
        a = mx.array(source.array(name))
        dtype = mx_dtype(e.tag)
        out[name] = a.view(dtype) if a.dtype != dtype else a
    return out


def build(pl: Plan, codecs: Sequence[Codec], finals: Mapping[str, mx.array],
          checkpoint: Mapping[str, mx.array] | None) -> list:
    """The mlx-lm cache objects, one per layer, at position `pl.p`."""
    layers = by_prefix(finals)
    kept = by_prefix(checkpoint) if checkpoint is not None else None
    return [codec.build(pl.p, layers.get(str(i), {}), kept.get(str(i), {}) if kept is not None else None)
            for i, codec in enumerate(codecs)]


