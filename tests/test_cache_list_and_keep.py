"""Restores of a real CacheList model and of a sliding window that keeps its first tokens give
the logits and 20 greedy tokens of a recompute, each checked in a fresh process.

- `baichuan_m1` (a real mlx-lm architecture, built by the demo builder): every layer is a
  `CacheList` of a short-convolution `ArraysCache` and a `KVCache`, or a `RotatingKVCache` on its
  sliding-window layers.
- llama with mlx-lm's `--max-kv-size` cache: `RotatingKVCache(max_size, keep=4)` on every layer,
  filled well past its window so that it wraps, then restored there.

The inserts are setup, run in the test's process (flushed and closed before any check); a test's
checks run one after the other in one fresh process, each with the model loaded and the store
opened afresh.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvtest import run_procs
from procs import insert_here

C = 16
TOL = 1e-4


def run(mode, store, model, tokens, **extra) -> dict:
    return run_procs(mode, store, model, C, tokens, **extra)


def toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


def same_as_recompute(got: dict) -> None:
    assert got["max_abs_diff"] <= TOL, got
    assert len(got["greedy"]) == 20 and got["greedy"] == got["greedy_ref"], got


@pytest.mark.parametrize("steps", [None, 24], ids=["one-shot", "in-steps"])
def test_cache_list_model_restores_like_a_recompute(tmp_path, demo_model, steps):
    model = demo_model("baichuan_m1")  # window 32 on its sliding layers
    prompt = toks(3 * C + 21, 1)  # past the window
    extra = {"step": steps, "insert_each_step": True} if steps else {}
    stats = insert_here(tmp_path / "s", model, C, prompt, **extra)["stats"]
    assert stats["checkpoints"] >= 1  # the convolution state, at the end of what was inserted
    # The whole prompt, then a branch inside it: each from disk, in one fresh process.
    got, inside = run("checks", tmp_path / "s", model, [[prompt + toks(3, 2), {"memory_bytes": 0}],
                                                        [prompt[:40] + toks(3, 3), {"memory_bytes": 0}]])
    assert got["classes"] == ["CacheList"] * 4
    assert got["reused"] == len(prompt)
    same_as_recompute(got)
    # A branch inside the prompt: the convolution state there was never stored, so nothing is
    # restored rather than something wrong.
    assert inside["reused"] in (0, 24) if steps else inside["reused"] == 0
    same_as_recompute(inside)


@pytest.mark.parametrize("step", [8, 40], ids=["steps-within-window", "steps-past-window"])
def test_sliding_window_with_keep_restored_past_the_window(tmp_path, demo_model_path, step):
    rotating = [24, 4]  # window of 24 tokens, the first 4 always kept
    prompt = toks(5 * C + 7, 4)  # 87 tokens: the window has wrapped several times
    q = dict(rotating=rotating, step=step, insert_each_step=True)
    insert_here(tmp_path / "s", demo_model_path, C, prompt, **q)
    got = run("check", tmp_path / "s", demo_model_path, prompt + toks(3, 5), memory_bytes=0,
              rotating=rotating, ref_step=step)
    assert got["classes"] == ["RotatingKVCache"] * 4
    assert got["reused"] == len(prompt)
    same_as_recompute(got)
