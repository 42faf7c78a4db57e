"""Scripts the tests run in fresh processes: insert a prompt, or restore one and compare it with
a recompute. Run as `python tests/procs.py insert|check STORE MODEL CHUNK TOKENS_JSON [EXTRA_JSON]`,
or `python tests/procs.py checks STORE MODEL CHUNK QUERIES_JSON`: QUERIES is a list of
[TOKENS, EXTRA] checked one after the other in one process (one interpreter and mlx-lm start-up
for all), each as `check` does it alone: the model loaded and the store opened afresh.

`insert_here` is `insert` in the calling process, for tests whose insert is only setup (the
restores they check run in a fresh process): the store is flushed and closed when it returns."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx.utils import tree_flatten


def greedy(model, cache, logits, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


def build(model, mc, tokens, extra, insert):
    """Process `tokens` `step` at a time as mlx-lm would (quantizing the KV cache when asked),
    inserting after the last step or, with `insert_each_step`, after every step."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    step = extra.get("step") or len(tokens)
    for pos in range(0, len(tokens), step):
        end = min(len(tokens), pos + step)
        model(mx.array([tokens[pos:end]]), cache=cache)
        if extra.get("kv_bits"):
            maybe_quantize_kv_cache(cache, 0, extra.get("kv_group_size", 64), extra["kv_bits"])
        mx.eval([v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)])
        if insert and (end == len(tokens) or extra.get("insert_each_step")):
            mc.insert(tokens[:end], cache, checkpoint=extra.get("checkpoint", True) or end == len(tokens))
    return cache


def insert_here(store, model_dir, chunk: int, tokens: list[int], **extra) -> dict:
    """`insert` in this process (no interpreter and mlx-lm start-up to pay for); the store is
    flushed and closed on return, before any checking process opens it."""
    return main(["insert", str(store), str(model_dir), str(chunk), json.dumps(tokens), json.dumps(extra)])


def main(argv: list[str]) -> dict | list[dict]:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    import kvstore

    mode, store_dir, model_dir, chunk, tokens_json = argv[:5]
    if mode == "checks":
        return [main(["check", store_dir, model_dir, chunk, json.dumps(tokens), json.dumps(extra)])
                for tokens, extra in json.loads(tokens_json)]
    extra = json.loads(argv[5]) if len(argv) > 5 else {}
    tokens = json.loads(tokens_json)
    model, _ = load(model_dir)
    if extra.get("rotating"):
        # What mlx-lm's make_prompt_cache(model, max_kv_size=N) builds (keep=4), as generate's
        # --max-kv-size does: a sliding window that keeps the first `keep` tokens.
        from mlx_lm.models.cache import RotatingKVCache

        size, keep = extra["rotating"]
        model.make_cache = lambda: [RotatingKVCache(max_size=size, keep=keep) for _ in model.layers]
    with kvstore.open(store_dir, chunk_size=int(chunk), memory_bytes=extra.get("memory_bytes"),
                      remote=extra.get("remote")) as store:
        mc = store.bind(model, model_dir, kv_bits=extra.get("kv_bits"), kv_group_size=extra.get("kv_group_size", 64))
        if mode == "insert":
            if extra.get("prefill"):  # the store's own chunked prefill (checkpoints at boundaries)
                mc.prefill(tokens, checkpoint_every=extra.get("checkpoint_every", 4), pin=bool(extra.get("pin")))
            else:
                build(model, mc, tokens, extra, insert=True)
            store.flush()
            stats = store.stats()
            return {"inserted": len(tokens), "remote": stats["remote"],
                    "stats": {k: stats[k] for k in ("bytes", "chunks", "tails", "checkpoints")}}
        cache, rest = mc.fetch(tokens)
        reused = len(tokens) - len(rest)
        logits = model(mx.array([rest]), cache=cache)
        same_data = None
        if extra.get("kv_bits"):
            # The reference is the original quantized cache, cut to the restore point, continued.
            ref_cache = build(model, mc, extra["inserted"], extra, insert=False)
            for c in ref_cache:
                c.trim(c.offset - reused)
            same_data = all(
                bool(mx.array_equal(a[..., :reused, :], b[..., :reused, :]))
                for c, r in zip(cache, ref_cache)
                for a, b in zip(c.keys + c.values, r.keys + r.values))
            ref = model(mx.array([rest]), cache=ref_cache)
        elif extra.get("ref_step"):
            # The recompute takes the same steps as the insert: with a window that keeps its
            # first tokens, what a step attends to depends on the steps taken before it.
            ref_cache = make_prompt_cache(model)
            step = extra["ref_step"]
            for pos in range(0, reused, step):
                model(mx.array([tokens[pos : min(reused, pos + step)]]), cache=ref_cache)
            ref = model(mx.array([rest]), cache=ref_cache)
        else:
            ref_cache = make_prompt_cache(model)
            ref = model(mx.array([tokens]), cache=ref_cache)
        diff = float(mx.abs(logits[0, -1] - ref[0, -1]).max().item())
        n = extra.get("greedy", 20)
        return {
            "reused": reused,
            "max_abs_diff": diff,
            "greedy": greedy(model, cache, logits, n),
            "greedy_ref": greedy(model, ref_cache, ref, n),
            "classes": [type(c).__name__ for c in cache],
            "same_data": same_data,
            "remote": store.stats()["remote"],
        }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
