"""Token sequences as the library takes them: any sequence of ids, checked once, as int32."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kvstore.errors import InvalidInputError

Tokens = Sequence[int] | np.ndarray | mx.array


def as_tokens(tokens) -> np.ndarray:
    """Validate a token sequence: a 1-D sequence of ints in [0, 2**31); int32."""
    if isinstance(tokens, mx.array):
        tokens = np.asarray(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InvalidInputError(
                f"tokens must be a 1-D sequence of ints, got an array of shape {tokens.shape} "
                f"and dtype {tokens.dtype}")
        arr = tokens.astype(np.int64)
    else:
        if isinstance(tokens, (str, bytes)):
            raise InvalidInputError("tokens must be a sequence of token ids, not text: tokenize first")
        try:
            items = list(tokens)
        except TypeError as e:
            raise InvalidInputError(f"tokens must be a sequence of ints, got {type(tokens).__name__}") from e
        try:  # the common case, a list of ints, at numpy speed
            fast = np.array(items)
        except (ValueError, TypeError, OverflowError):
            fast = None
        if fast is not None and fast.ndim == 1 and fast.dtype.kind in "iu" and len(fast):
            return as_tokens(fast)
        for pos, t in enumerate(items):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise InvalidInputError(f"token {pos} is {t!r}: token ids must be ints")
        if any(t >= 2**31 or t < 0 for t in items):
            pos = next(i for i, t in enumerate(items) if t >= 2**31 or t < 0)
            raise InvalidInputError(f"token {pos} is {items[pos]}: token ids must be in [0, 2**31)")
        arr = np.array(items, dtype=np.int64) if items else np.zeros(0, dtype=np.int64)
    bad = np.nonzero((arr < 0) | (arr >= 2**31))[0]
    if len(bad):
        raise InvalidInputError(f"token {bad[0]} is {arr[bad[0]]}: token ids must be in [0, 2**31)")
    return arr.astype(np.int32)


def token_list(tokens) -> list:
    """`tokens` as a list, for an API that takes mlx-lm's lists (ids checked later, where a bad one
    is a miss); `InvalidInputError` for text or what is not a sequence at all."""
    if isinstance(tokens, (mx.array, np.ndarray)):
        return np.asarray(tokens).tolist()
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise InvalidInputError(f"tokens must be a sequence of token ids, got {type(tokens).__name__}"
                                + (": tokenize first" if isinstance(tokens, (str, bytes)) else ""))
    return list(tokens)


def arrays_of(cache: list) -> list[mx.array]:
    """Every mlx array a list of cache objects holds (to evaluate them)."""
    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]
