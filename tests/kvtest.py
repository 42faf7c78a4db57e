"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def run_procs(mode: str, store, model, chunk: int, tokens, **extra) -> dict:
    """Run `tests/procs.py MODE` (insert or check a prompt) in a fresh process; its last JSON line."""
    cmd = [sys.executable, str(Path(__file__).parent / "procs.py"), mode, str(store), str(model),
           str(chunk), json.dumps(tokens), json.dumps(extra)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
