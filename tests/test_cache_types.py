"""Every mlx-lm cache type restores exactly: sliding window, hybrid/SSM, quantized KV, CacheList,
and classes kvstore does not know. Every restore that matters runs in a fresh process (a test's
queries one after the other in one, each with the model loaded and the store opened afresh); the
inserts before them are setup, run here and closed before it starts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvtest import run_procs
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, QuantizedKVCache, RotatingKVCache
from procs import insert_here

import kvstore
from kvstore.demo import build_demo_model

C = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    built = {arch: build_demo_model(root / arch, arch) for arch in ("llama", "gemma3_text", "qwen3_5")}
    # mlx quantizes in groups of 32 or more along head_dim: the tiny models' head_dim is 16.
    built["llama-small"] = build_demo_model(root / "llama-small", "llama", size="small")
    return built


def run(mode, store, model, tokens, **extra) -> dict:
    return run_procs(mode, store, model, C, tokens, **extra)


def insert(store, model, tokens, **extra) -> dict:
    """procs.py's `insert` in this process: flushed and closed before any check starts."""
    return insert_here(store, model, C, tokens, **extra)


def toks(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


def check(store, model, query, **extra):
    return checks(store, model, (query, extra))[0]


def checks(store, model, *queries) -> list[dict]:
    """Each (query, extra) restored from disk and compared with a recompute, in one fresh process."""
    if len(queries) == 1:
        (query, extra), = queries
        got = [run("check", store, model, query, memory_bytes=0, **extra)]
    else:
        got = run("checks", store, model, [[query, {"memory_bytes": 0, **extra}] for query, extra in queries])
    for one in got:
        assert one["max_abs_diff"] <= 1e-4, one
        assert one["greedy"] == one["greedy_ref"]
    return got


def test_sliding_window_prefilled_in_steps_larger_than_the_window(tmp_path, models):
    model = models["gemma3_text"]  # window 32 on every other layer
    prompt = toks(100, 1)
    # Inserted after each 48-token step, the way a chunked prefill would.
    insert(tmp_path / "s", model, prompt, step=48, insert_each_step=True)
    full, branch = checks(tmp_path / "s", model, (prompt + toks(3, 2), {}), (prompt[:70] + toks(6, 3), {}))
    assert full["reused"] == 100
    assert "RotatingKVCache" in full["classes"]
    assert branch["reused"] == 70


def test_sliding_window_one_shot_insert_restores_at_its_end_only(tmp_path, models):
    model = models["gemma3_text"]
    prompt = toks(100, 4)
    insert(tmp_path / "s", model, prompt, step=48)  # the window only holds the last tokens
    full, got = checks(tmp_path / "s", model, (prompt + toks(2, 5), {}), (prompt[:70] + toks(6, 6), {}))
    assert full["reused"] == 100
    # Inside the prompt, the window's tokens were gone at insert time: nothing wrong is restored.
    assert got["reused"] == 0


def test_sliding_window_stores_deltas_not_windows(tmp_path, models):
    model = models["gemma3_text"]
    prompt = toks(8 * C, 7)
    stats = insert(tmp_path / "s", model, prompt)["stats"]
    # 4 layers x (K + V) x 2 heads x 16 dims x 4 bytes = 1 KiB of K/V per token, plus headers.
    per_token = stats["bytes"] / len(prompt)
    assert 1024 <= per_token < 1024 * 1.25, per_token


def test_hybrid_restores_at_the_insert_point_and_never_from_a_mismatched_state(tmp_path, models):
    model = models["qwen3_5"]
    prompt = toks(45, 8)
    stats = insert(tmp_path / "s", model, prompt)["stats"]
    assert stats["checkpoints"] == 1
    exact, branch, again = checks(tmp_path / "s", model, (prompt + toks(4, 9), {}),
                                  (prompt[:30] + toks(5, 10), {}), (prompt, {}))
    assert exact["reused"] == 45
    assert exact["classes"].count("ArraysCache") == 3
    # A branch before the only checkpoint: the recurrent state there is unknown, so nothing.
    assert branch["reused"] == 0
    # The same prompt again: one token must be left, and there is no checkpoint before it.
    assert again["reused"] == 0


def test_hybrid_warmed_with_boundary_checkpoints_restores_at_the_deepest_one(tmp_path, models):
    model = models["qwen3_5"]
    prompt = toks(5 * C + 7, 11)
    stats = insert(tmp_path / "s", model, prompt, prefill=True, checkpoint_every=1)["stats"]
    assert stats["checkpoints"] == 7  # one per chunk boundary, one at the end and one before it
    got = check(tmp_path / "s", model, prompt[: 3 * C + 9] + toks(4, 12))
    assert got["reused"] == 3 * C


def test_hybrid_checkpoint_every_two_chunks(tmp_path, models):
    model = models["qwen3_5"]
    prompt = toks(5 * C + 7, 13)
    stats = insert(tmp_path / "s", model, prompt, prefill=True, checkpoint_every=2)["stats"]
    assert stats["checkpoints"] == 4  # after chunks 2 and 4, at the end and before it
    assert check(tmp_path / "s", model, prompt[: 3 * C + 9] + toks(4, 14))["reused"] == 2 * C


def test_hybrid_warmed_prompt_asked_again_resumes_at_its_last_token_but_one(tmp_path, models):
    model = models["qwen3_5"]
    prompt = toks(3 * C + 5, 15)  # no checkpoint every 4 chunks before it: only its own
    insert(tmp_path / "s", model, prompt, prefill=True, pin=True)
    assert check(tmp_path / "s", model, prompt)["reused"] == len(prompt) - 1
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(load(str(model))[0], str(model))
        assert mc.unpin(prompt)["records"] == 3 + 2 + 2  # the chunks, tail and checkpoint of both ends
        assert store.pins() == []


@pytest.mark.parametrize("arch, chunk", [("qwen3_5", C), ("gemma3_text", 64)])  # gemma: chunk > window (32)
def test_a_warmed_prompt_ending_on_a_chunk_boundary_asked_again_resumes(tmp_path, models, arch, chunk):
    model, prompt = models[arch], toks(2 * chunk, 16)
    insert_here(tmp_path / "s", model, chunk, prompt, prefill=True)
    got = run_procs("check", tmp_path / "s", model, chunk, prompt, memory_bytes=0)
    assert got["reused"] == len(prompt) - 1
    assert got["max_abs_diff"] <= 1e-4 and got["greedy"] == got["greedy_ref"]


def test_sliding_window_tie_between_a_chunk_and_a_tail_tries_both(tmp_path, models):
    model, prompt = models["gemma3_text"], toks(128, 17)  # chunks of 64, window 32
    insert_here(tmp_path / "s", model, 64, prompt[:10], prefill=True)  # its tail holds tokens 0..10
    insert_here(tmp_path / "s", model, 64, prompt, prefill=True)  # the chunk 0..64 lacks them
    got = run_procs("check", tmp_path / "s", model, 64, prompt[:5], memory_bytes=0)
    assert got["reused"] == 4
    assert got["max_abs_diff"] <= 1e-4 and got["greedy"] == got["greedy_ref"]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_restores_identical_data(tmp_path, models, bits):
    model = models["llama-small"]
    prompt = toks(3 * C + 5, 15)
    q = dict(kv_bits=bits, kv_group_size=32, step=20)
    insert(tmp_path / "s", model, prompt, **q)
    queries = (prompt + toks(3, 16), prompt[: 2 * C + 3] + toks(3, 17))
    results = checks(tmp_path / "s", model, *((query, dict(inserted=prompt, **q)) for query in queries))
    for query, got in zip(queries, results, strict=True):
        assert got["classes"] == ["QuantizedKVCache"] * 4
        assert got["reused"] == min(len(prompt), len(query) - 3)
        assert got["same_data"] is True
        assert got["max_abs_diff"] == 0.0
        assert got["greedy"] == got["greedy_ref"]


def test_quantized_and_plain_caches_never_mix(tmp_path, models):
    model, _ = load(str(models["llama"]))
    prompt = toks(C + 3, 18)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        plain = store.bind(model, models["llama"])
        q8 = store.bind(model, models["llama"], kv_bits=8)
        assert plain.ns != q8.ns
        cache = plain.new_cache()
        model(mx.array([prompt]), cache=cache)
        plain.insert(prompt, cache)
        with pytest.raises(kvstore.InvalidInputError, match="KVCache"):
            q8.insert(prompt, cache)
        store.flush()
        cache, rest = q8.fetch(prompt + [1])
        assert len(rest) == len(prompt) + 1 and isinstance(cache[0], QuantizedKVCache)


def _filled(layer, n, seed):
    rng = np.random.default_rng(seed)
    if isinstance(layer, CacheList):
        for j, c in enumerate(layer.caches):
            _filled(c, n, seed + j)
    elif isinstance(layer, ArraysCache):
        layer.cache = [mx.array(rng.standard_normal((1, 3, 8)).astype(np.float32)),
                       mx.array(rng.standard_normal((1, 2, 4, 4)).astype(np.float32))]
    else:
        for pos in range(0, n, 7):
            m = min(7, n - pos)
            layer.update_and_fetch(mx.array(rng.standard_normal((1, 2, m, 16)).astype(np.float32)),
                                   mx.array(rng.standard_normal((1, 2, m, 16)).astype(np.float32)))
    return layer


class _ListModel:
    """A stand-in model whose make_cache returns CacheLists (no small mlx-lm architecture the
    demo builder makes uses CacheList); kvstore only calls make_cache and parameters()."""

    def __init__(self, make):
        self.layers = [None, None]
        self.make_cache = make

    def parameters(self):
        return {"w": mx.zeros((1,), dtype=mx.float32)}


def test_cache_list_of_kv_rotating_and_arrays(tmp_path):
    make = lambda: [CacheList(KVCache(), RotatingKVCache(max_size=64), ArraysCache(2)) for _ in range(2)]
    model = _ListModel(make)
    n = 2 * C + 5
    tokens = toks(n, 19)
    original = [_filled(layer, n, 100 + i) for i, layer in enumerate(make())]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, "cachelist", fingerprint=b"f" * 16)
        assert mc.insert(tokens, original) == 4  # 2 chunks, a tail, a checkpoint
        store.flush()
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, "cachelist", fingerprint=b"f" * 16)
        cache, rest = mc.fetch(tokens + [1, 2])
        assert rest == [1, 2]
        for got, want in zip(cache, original):
            assert isinstance(got, CacheList)
            kv, rot, arr = got.caches
            assert kv.offset == rot.offset == n
            k, _ = want.caches[0].keys_and_values() if hasattr(want.caches[0], "keys_and_values") else (None, None)
            # restored with spare room after the n tokens: keys_and_values() is what they hold
            assert mx.array_equal(kv.keys_and_values()[0], want.caches[0].keys[..., :n, :])
            assert mx.array_equal(rot.keys_and_values()[0], want.caches[1]._temporal_order(want.caches[1].keys))
            assert all(mx.array_equal(a, b) for a, b in zip(arr.cache, want.caches[2].cache))
        # Inside the sequence there is no checkpoint for the ArraysCache part: a miss.
        cache, rest = mc.fetch(tokens[: C + 3] + [1])
        assert len(rest) == C + 4


def test_unknown_cache_class_is_checkpointed_never_restored_wrongly(tmp_path, models):
    path = models["llama"]
    model, _ = load(str(path))

    class Odd(KVCache):  # a subclass kvstore has no codec for: it may keep more state
        pass

    model.make_cache = lambda: [Odd() for _ in model.layers]
    tokens = toks(C + 3, 20)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        cache = mc.new_cache()
        model(mx.array([tokens]), cache=cache)
        assert mc.insert(tokens, cache) == 3  # a chunk and a tail (no deltas in them) + checkpoint
        store.flush()
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        cache, rest = mc.fetch(tokens)
        assert len(rest) == len(tokens)  # only the end of the sequence has a state
        cache, rest = mc.fetch(tokens + [5, 6])
        assert rest == [5, 6] and all(type(c) is Odd for c in cache)
        logits = model(mx.array([rest]), cache=cache)
        ref = model(mx.array([tokens + [5, 6]]))
        assert float(mx.abs(logits[0, -1] - ref[0, -1]).max()) <= 1e-4
