"""Time to first token: recompute vs restore (kvstore disk and memory tiers, mlx-lm's file).

For each model and prompt length, a prompt P is prefilled from scratch (recompute), then its
first 90% is stored three ways: in a kvstore store (disk tier: memory tier off; memory tier) and
as an mlx-lm `save_prompt_cache` file for each fraction. A query that shares 50% or 90% of P and
then differs is answered by each method: restore, prefill the rest in steps of 2,048 tokens as
`mlx_lm.generate` does, sample the first token. Every number is that whole time.

Models: the built-in demo model (llama, tiny, float32) and a realistic configuration, Qwen3-0.6B's
architecture (28 layers, 16 query / 8 KV heads of 128, hidden 1,024, vocabulary 151,936) with
random float32 weights. CPU prefill here is dominated by attention, whose cost grows with the
square of the prompt, so each model runs the lengths that fit its time budget (the rest are
listed as skipped). The BLAS in use is recorded: when Debian's OpenBLAS is installed and not
preloaded, this script starts itself again with it preloaded (as `bench/run_all.py` starts it).

    python bench/ttft.py [--quick] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time

import common as C
import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models import qwen3
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

import kvstore
from kvstore.demo import build_demo_model

PREFILL_STEP = 2048  # mlx_lm.generate's default prefill_step_size
QWEN3_0_6B = dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40960,
                  tie_word_embeddings=True)


def first_token(model, tokens: list[int], cache: list) -> int:
    """Process `tokens` on top of `cache` and sample the first new token, as mlx_lm.generate does."""
    y = mx.array(tokens)
    while y.size > 1:
        n = min(PREFILL_STEP, y.size - 1)
        model(y[:n][None], cache=cache)
        C.eval_cache(cache)
        y = y[n:]
    logits = model(y[None], cache=cache)
    tok = mx.argmax(logits[:, -1, :], axis=-1)
    mx.eval(tok)
    return int(tok.item())


def load_models(quick: bool):
    demo_path = build_demo_model()
    demo, _ = mlx_lm.load(str(demo_path))
    models = [{"name": "demo (llama tiny, float32)", "key": "demo", "model": demo, "model_id": str(demo_path),
               "fingerprint": None, "vocab": 256, "lengths": [512, 1024, 2048, 4096, 8192] if not quick else [512, 2048],
               "fractions": [0.5, 0.9], "reps": 1 if quick else 3}]
    mx.random.seed(0)
    qwen = qwen3.Model(qwen3.ModelArgs.from_dict(QWEN3_0_6B))
    mx.eval(qwen.parameters())
    models.append({"name": "Qwen3-0.6B architecture (random weights, float32)", "key": "qwen3-0.6b",
                   "model": qwen, "model_id": "qwen3-0.6b-random", "fingerprint": b"bench-qwen3-0.6b",
                   "vocab": 151_000, "lengths": [512, 1024, 2048] if not quick else [512],
                   "fractions": [0.9], "reps": 1})
    return models


def run_model(spec: dict, budget_s: float) -> dict:
    model, name = spec["model"], spec["name"]
    work = C.scratch_dir(f"ttft-{spec['key']}")
    disk = kvstore.open(work / "store", memory_bytes=0)
    mem = kvstore.open(work / "store", memory_bytes=8 << 30)
    binds = {}
    for tier, store in (("disk", disk), ("memory", mem)):
        binds[tier] = store.bind(model, spec["model_id"], fingerprint=spec["fingerprint"])
    points, skipped = [], []
    started = time.perf_counter()
    last = None  # (length, recompute seconds)
    for length in spec["lengths"]:
        r = spec["reps"] if length <= 2048 else 1
        if last is not None:  # attention-bound: the cost grows with the square of the length
            work_per_rep = 1 + 3 * sum(1 - f * f for f in spec["fractions"])  # recompute + 3 methods
            estimate = last[1] * (length / last[0]) ** 2 * work_per_rep * r
            if time.perf_counter() - started + estimate > budget_s:
                skipped.append(length)
                continue
        C.log(f"[ttft] {name}: {length} tokens")
        rng = np.random.default_rng(length)
        prompt = rng.integers(0, spec["vocab"], length).tolist()
        times, cache = [], None
        for _ in range(r):
            cache = make_prompt_cache(model)
            t = time.perf_counter()
            first_token(model, prompt, cache)
            times.append(time.perf_counter() - t)
        point = {"length": length, "recompute_s": float(np.median(times)), "reps": r, "fractions": {}}
        last = (length, point["recompute_s"])
        stored = int(max(spec["fractions"]) * length)
        binds["disk"].insert(prompt[:stored], C.trimmed_copy(cache, stored))
        disk.flush()
        binds["memory"].fetch(prompt[:stored] + [0])  # the memory tier now holds every record
        for f in spec["fractions"]:
            n = int(f * length)
            query = prompt[:n] + [(t + 1) % spec["vocab"] for t in prompt[n:]]  # differs from token n on
            file = str(work / f"prompt-{length}-{f}.safetensors")
            save_prompt_cache(file, C.trimmed_copy(cache, n))
            C.warm([file])
            row: dict = {"cached_tokens": n}
            firsts = {}
            for method in ("kvstore_disk", "kvstore_memory", "mlx_lm_file"):
                samples, fetch_s = [], []
                for _ in range(r):
                    t = time.perf_counter()
                    if method == "mlx_lm_file":
                        c, rest = load_prompt_cache(file), query[n:]
                        C.eval_cache(c)
                    else:
                        c, rest = binds[method.split("_")[1]].fetch(query)
                    fetch_s.append(time.perf_counter() - t)
                    assert len(query) - len(rest) == n, f"{method} reused {len(query) - len(rest)} of {n} tokens"
                    firsts[method] = first_token(model, rest, c)
                    samples.append(time.perf_counter() - t)
                    del c
                row[method] = {"ttft_s": float(np.median(samples)), "restore_s": float(np.median(fetch_s))}
            row["first_tokens_agree"] = len(set(firsts.values())) == 1
            point["fractions"][str(f)] = row
            C.log(f"[ttft]   {int(f * 100)}% cached: recompute {point['recompute_s']:.2f} s, "
                  + ", ".join(f"{m} {row[m]['ttft_s']:.2f} s" for m in ("kvstore_disk", "kvstore_memory", "mlx_lm_file")))
        points.append(point)
        del cache
        gc.collect()
    disk.close()
    mem.close()
    shutil.rmtree(work, ignore_errors=True)
    return {"model": name, "key": spec["key"], "points": points, "skipped_lengths": skipped,
            "budget_s": budget_s}


def run(quick: bool = False, budget_s: float | None = None) -> dict:
    models = load_models(quick)
    budget = budget_s or (60.0 if quick else 240.0)
    results = [run_model(m, budget * (1.5 if m["key"] == "demo" else 1.0)) for m in models]
    return {"machine": C.machine(), "blas": C.blas_in_use(), "quick": quick, "prefill_step": PREFILL_STEP,
            "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer lengths, one repetition")
    ap.add_argument("--budget", type=C.non_negative_float, help="seconds per model (longer prompts are skipped past it)")
    args = ap.parse_args()
    C.preload_openblas("ttft")
    if args.budget == 0:
        ap.error("argument --budget: 0 seconds leaves no time for any prompt length (omit it for the default)")
    C.log_machine("ttft")
    print(C.write_result("ttft", run(args.quick, args.budget)))


if __name__ == "__main__":
    main()
