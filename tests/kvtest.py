"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def prefill(model, tokens):
    """A fresh cache of `model` holding `tokens`, computed in one step."""
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def logits_diff(model, cache, rest, query) -> float:
    """Max |logits| difference at the last position: restored cache + `rest` vs `query` from scratch."""
    logits = model(mx.array([rest]), cache=cache)
    ref = model(mx.array([query]), cache=make_prompt_cache(model))
    return float(mx.abs(logits[0, -1] - ref[0, -1]).max().item())
