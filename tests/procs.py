"""Scripts the tests run in fresh processes: insert a prompt, or restore one and compare it with
a recompute. Run as `python tests/procs.py insert|check STORE MODEL CHUNK TOKENS_JSON`."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np


def greedy(model, cache, logits, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


def main(argv: list[str]) -> dict:
    import kvstore
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    mode, store_dir, model_dir, chunk, tokens_json = argv[:5]
    extra = json.loads(argv[5]) if len(argv) > 5 else {}
    tokens = json.loads(tokens_json)
    model, _ = load(model_dir)
    with kvstore.open(store_dir, chunk_size=int(chunk), memory_bytes=extra.get("memory_bytes")) as store:
        mc = store.bind(model, model_dir, kv_bits=extra["kv_bits"]) if extra.get("kv_bits") else store.bind(model, model_dir)
        if mode == "insert":
            cache = mc.new_cache()
            if extra.get("kv_bits"):
                from mlx_lm.generate import maybe_quantize_kv_cache

                cache = mc.new_cache()
                step = extra.get("step", len(tokens))
                pos = 0
                while pos < len(tokens):
                    model(mx.array([tokens[pos : pos + step]]), cache=cache)
                    maybe_quantize_kv_cache(cache, 0, 64, extra["kv_bits"])
                    pos += step
            else:
                step = extra.get("step", len(tokens))
                for pos in range(0, len(tokens), step):
                    model(mx.array([tokens[pos : pos + step]]), cache=cache)
            mx.eval([c.state for c in cache])
            mc.insert(tokens, cache, pin=bool(extra.get("pin")))
            store.flush()
            return {"inserted": len(tokens)}
        cache, rest = mc.fetch(tokens)
        reused = len(tokens) - len(rest)
        logits = model(mx.array([rest]), cache=cache)
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
        }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
