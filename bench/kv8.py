"""K/V quantized on disk (`kvstore.open(disk_kv_bits=8)`) against bf16 on disk: accuracy, bytes, speed.

    python bench/kv8.py [--quick]     (--table: print the last run's table again)

1. Demo models (kvstore/demo.py, "small": head_dim 32, so group size 32; bf16 and f16): a prompt
   is stored, restored from disk in this process (memory tier off) and compared with a recompute
   of the whole prompt: max and mean |logit difference| at the first step, and greedy agreement
   over 50 tokens (tokens equal to the recompute's, and the first that differs).
2. A Qwen3-0.6B-shaped cache (28 layers, 8 kv heads, head_dim 128, bf16; group size 64) of random
   K/V (bench/common.random_cache's bits, and N(0, 1)): K/V error, the error of one attention
   read-out per layer with a random query, bytes on disk, and restore speed from disk with the
   page cache warm, bf16 and quantized stores fetched round by round in one process.

Writes bench/results/kv8.json and prints its tables (bench/README.md's "8-bit K/V on disk"
section, from report_sections.kv8_table). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import common as C
import mlx.core as mx
import numpy as np
import report_sections
from mlx_lm.models.cache import KVCache, make_prompt_cache

import kvstore
from kvstore.demo import build_demo_model

CHUNK = 256
GREEDY = 50
DEMO = [("llama", "bfloat16"), ("llama", "float16"), ("gemma3_text", "bfloat16"), ("qwen3_5", "bfloat16"),
        ("qwen3_5", "float16")]
BITS = (0, 8, 4)  # 0: the bf16 (or f16) store, the exact baseline


def greedy(model, cache, logits, n: int) -> list[int]:
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)
    return out


def demo_accuracy(work: Path, arch: str, dtype: str, tokens: int) -> list[dict]:
    """Restore-vs-recompute numbers of one demo model at every width of BITS."""
    from mlx_lm import load

    model_dir = build_demo_model(work / f"{arch}-{dtype}", arch, size="small", dtype=dtype)
    model, _ = load(str(model_dir))
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, 250, tokens)]
    query = prompt + [7]
    ref_cache = make_prompt_cache(model)
    ref = model(mx.array([query]), cache=ref_cache)
    top = mx.sort(ref[0, -1].astype(mx.float32))
    margin = float(top[-1] - top[-2])  # how near a tie the recompute's first greedy token is
    ref_tokens = greedy(model, ref_cache, ref, GREEDY)
    rows = []
    for bits in BITS:
        path = work / f"store-{arch}-{dtype}-{bits}"
        with kvstore.open(path, chunk_size=CHUNK, memory_bytes=0, disk_kv_bits=bits) as store:
            mc = store.bind(model, model_dir)
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            mc.insert(prompt, cache)
            store.flush()
            disk = store.stats()["bytes"]
        with kvstore.open(path, chunk_size=CHUNK, memory_bytes=0) as store:
            restored, rest = store.bind(model, model_dir).fetch(query)
        logits = model(mx.array([rest]), cache=restored)
        diff = mx.abs(logits[0, -1].astype(mx.float32) - ref[0, -1].astype(mx.float32))
        got = greedy(model, restored, logits, GREEDY)
        first = next((i for i, (a, b) in enumerate(zip(got, ref_tokens)) if a != b), None)
        rows.append({"model": f"{arch} small {dtype}", "bits": bits, "reused": len(query) - len(rest),
                     "max_logit_diff": float(diff.max()), "mean_logit_diff": float(diff.mean()),
                     "logit_scale": float(mx.abs(ref[0, -1]).max()), "ref_margin": margin,
                     "greedy_agree": sum(a == b for a, b in zip(got, ref_tokens)), "greedy_first_diff": first,
                     "disk_bytes": disk})
        C.log(f"[kv8] {rows[-1]}")
    return rows


def gaussian_cache(shape: C.Shape, tokens: int, seed: int = 0) -> list[KVCache]:
    rng = np.random.default_rng(seed)
    cache = []
    for _ in range(shape.layers):
        layer = KVCache()
        dims = (1, shape.kv_heads, tokens, shape.head_dim)
        k, v = (mx.array(rng.standard_normal(dims, dtype=np.float32)).astype(mx.bfloat16) for _ in range(2))
        layer.update_and_fetch(k, v)
        mx.eval(layer.keys, layer.values)
        cache.append(layer)
    return cache


def readout_error(exact: list, restored: list, n: int, seed: int = 0) -> tuple[float, float]:
    """(max, mean) |difference| of softmax(q K^T / sqrt(d)) V per layer, for one random query."""
    rng = np.random.default_rng(seed)
    worst, means = 0.0, []
    for a, b in zip(exact, restored):
        q = mx.array(rng.standard_normal((1, a.keys.shape[1], 1, a.keys.shape[3]), dtype=np.float32))
        outs = [mx.fast.scaled_dot_product_attention(q, c.keys[:, :, :n].astype(mx.float32),
                                                     c.values[:, :, :n].astype(mx.float32),
                                                     scale=a.keys.shape[3] ** -0.5) for c in (a, b)]
        d = mx.abs(outs[0] - outs[1])
        worst, means = max(worst, float(d.max())), means + [float(d.mean())]
    return worst, float(np.mean(means))


def kv_error(exact: list, restored: list, n: int) -> tuple[float, float]:
    worst, means = 0.0, []
    for a, b in zip(exact, restored):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            d = mx.abs(x[:, :, :n].astype(mx.float32) - y[:, :, :n].astype(mx.float32))
            worst, means = max(worst, float(d.max())), means + [float(d.mean())]
    return worst, float(np.mean(means))


def qwen_shape(work: Path, tokens: int, rounds: int, reps: int) -> dict:
    """Bytes, errors and warm restore times of bf16 and quantized stores of one random cache."""
    shape = C.SHAPES["qwen3-0.6b"]
    out: dict = {"tokens": tokens, "kv_bytes": tokens * shape.bytes_per_token, "stores": {}}
    toks = C.random_tokens(tokens, seed=tokens)
    query = np.concatenate([toks, toks[:1]])
    stores = {}
    for kind, make in (("random bits", C.random_cache), ("normal", gaussian_cache)):
        cache = make(shape, tokens)
        for bits in BITS:
            if kind == "normal" and bits == 0:
                continue  # bf16 is exact whatever the values: one baseline is enough
            path = work / f"qwen-{tokens}-{kind.replace(' ', '-')}-{bits}"
            with kvstore.open(path, memory_bytes=0, disk_kv_bits=bits) as store:
                mc = store.bind(shape.model(), "qwen3-0.6b-shaped", fingerprint=b"kv8-bench-qwen3!")
                t = time.perf_counter()
                mc.insert(toks, cache)
                insert_s = time.perf_counter() - t
                store.flush()
                disk = store.stats()["bytes"]
                restored, rest = mc.fetch(query)
            row = {"disk_bytes": disk, "vs_bf16_kv": disk / out["kv_bytes"], "insert_call_ms": insert_s * 1e3}
            row["kv_max_err"], row["kv_mean_err"] = kv_error(cache, restored, tokens)
            row["readout_max_err"], row["readout_mean_err"] = readout_error(cache, restored, tokens)
            out["stores"][f"{kind}, {bits or 16} bits"] = row
            if kind == "random bits":
                stores[bits] = path
            C.log(f"[kv8] qwen3-0.6b {tokens} {kind} {bits}: {row}")
            del restored
        del cache
    times = restore_times(stores, shape, query, rounds, reps)
    for bits, samples in times.items():
        row = out["stores"][f"random bits, {bits or 16} bits"]
        row["restore_warm_ms"] = statistics.median(samples) * 1e3
        row["restore_vs_bf16"] = statistics.median(times[0]) / statistics.median(samples)
    return out


def restore_times(stores: dict[int, Path], shape: C.Shape, query: np.ndarray, rounds: int, reps: int
                  ) -> dict[int, list[float]]:
    """Warm-page-cache fetch times of each store, round by round (order reversed every round)."""
    opened = {}
    for bits, path in stores.items():
        C.warm(C.blob_files(path))
        store = kvstore.open(path, memory_bytes=0)
        opened[bits] = (store, store.bind(shape.model(), "qwen3-0.6b-shaped", fingerprint=b"kv8-bench-qwen3!"))
    times: dict[int, list[float]] = {bits: [] for bits in stores}
    try:
        order = list(stores)
        for r in range(rounds):
            for bits in (order if r % 2 == 0 else order[::-1]):
                mc = opened[bits][1]
                times[bits] += C.measure(lambda: mc.fetch(query), reps)
    finally:
        for store, _ in opened.values():
            store.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter prompts, fewer rounds")
    ap.add_argument("--table", action="store_true", help="print the table of the last run's results, run nothing")
    args = ap.parse_args()
    if args.table:
        sys.stdout.write(report_sections.kv8_table(json.loads((C.RESULTS / "kv8.json").read_text())))
        return
    work = C.scratch_dir("kv8")
    load_before = os.getloadavg()
    try:
        demo = [row for arch, dtype in DEMO for row in demo_accuracy(work, arch, dtype, 300 if args.quick else 1000)]
        sizes = [1024] if args.quick else [2048, 8192]
        qwen = [qwen_shape(work, n, 2 if args.quick else 4, 3 if args.quick else 5) for n in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = {"demo": demo, "qwen": qwen, "cpu": C.machine().get("cpu", "?"),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    C.write_result("kv8", data)
    sys.stdout.write(report_sections.kv8_table(data))


if __name__ == "__main__":
    main()
