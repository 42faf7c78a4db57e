"""Restore benchmark: kvstore fetch against the physical limit and against what users use instead.

For caches shaped like Qwen3-0.6B's and Llama-3-8B's KV (bfloat16, random data), in one run and
interleaved round by round so every method sees the same machine load, medians of several runs:

- disk, page cache warm: `fetch` (memory tier off) vs a raw read of the same blob files, into a
  reused buffer and into new memory, vs mlx-lm `load_prompt_cache` of the same cache in one file;
- disk, page cache cold: `fetch` vs an O_DIRECT read of the same files (and `load_prompt_cache`);
- memory tier: `fetch` vs a memcpy of the same bytes, vs mlx-lm `LRUPromptCache.fetch_nearest_cache`;
- `insert` latency on the caller's thread.

    python bench/restore.py [--quick] [--tokens 2048] [--shape qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache, save_prompt_cache

import common as C
import kvstore

FULL = [("qwen3-0.6b", 1024), ("qwen3-0.6b", 2048), ("qwen3-0.6b", 4096), ("qwen3-0.6b", 16384),
        ("llama-3-8b", 1024), ("llama-3-8b", 4096), ("llama-3-8b", 16384)]
QUICK = [("qwen3-0.6b", 1024), ("qwen3-0.6b", 2048), ("llama-3-8b", 4096)]
FINGERPRINT = b"kvstore-bench-fp"


def interleaved(fns: dict, reps: int, before: dict | None = None, warmup: int = 1) -> dict[str, list[float]]:
    """Run every function once per round, `reps` rounds (after `warmup` unrecorded ones).

    `before[name]` runs untimed ahead of each call (cache eviction). Results are dropped at once.
    """
    before = before or {}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for rnd in range(warmup + reps):
        for name, fn in fns.items():
            if name in before:
                before[name]()
            gc.collect()
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            del out
            if rnd >= warmup:
                times[name].append(dt)
    return times


def run_one(shape_name: str, tokens: int, reps: int, cold_reps: int) -> dict:
    shape = C.SHAPES[shape_name]
    C.log(f"[restore] {shape_name} {tokens} tokens: building the cache")
    cache = C.random_cache(shape, tokens, seed=tokens)
    toks = C.random_tokens(tokens, seed=tokens)
    query = np.concatenate([toks, [7]]).astype(np.int32)  # all `tokens` reusable, one left
    kv_bytes = C.cache_nbytes(cache)
    model = shape.model()
    work = C.scratch_dir(f"restore-{shape_name}-{tokens}")
    out: dict = {"shape": shape_name, "tokens": tokens, "kv_bytes": kv_bytes, "reps": reps}

    # -- the same cache stored three ways --------------------------------------------------
    store = kvstore.open(work / "store", memory_bytes=0)
    mc = store.bind(model, "bench-shape", fingerprint=FINGERPRINT)
    mc.insert(toks, cache)
    store.flush()
    files = C.blob_files(work / "store")
    file_bytes = sum(f.stat().st_size for f in files)
    one_file = str(work / "prompt_cache.safetensors")
    save_prompt_cache(one_file, cache)
    out.update(blob_files=len(files), blob_bytes=file_bytes)

    got, rest = mc.fetch(query)
    assert len(rest) == 1 and got[0].offset == tokens, "the benchmark cache was not fully reused"
    assert mx.array_equal(got[-1].values, cache[-1].values).item(), "restored values differ"
    del got

    # -- disk, page cache warm -------------------------------------------------------------
    C.warm(files + [one_file])
    reused = bytearray(file_bytes)
    t = interleaved({
        "raw_read": lambda: C.raw_read(files, reused),
        "raw_read_new_memory": lambda: C.raw_read(files, bytearray(file_bytes)),
        "kvstore_fetch": lambda: mc.fetch(query),
        "load_prompt_cache": lambda: C.eval_cache(load_prompt_cache(one_file)),
    }, reps)
    del reused
    out["warm"] = _report(t, kv_bytes, baseline="raw_read")
    out["warm"]["vs_load_prompt_cache"] = (_median(t["load_prompt_cache"]) / _median(t["kvstore_fetch"]))
    out["warm"]["vs_raw_read_new_memory"] = (_median(t["raw_read_new_memory"]) / _median(t["kvstore_fetch"]))

    # -- disk, page cache cold -------------------------------------------------------------
    how = C.make_cold(files + [one_file])
    out["cold_method"] = how or "could not evict the page cache (no fadvise effect, no drop_caches)"
    if how and C.direct_io_supported(files[0]):
        aligned = C.aligned_buffer(file_bytes + 4096 * len(files))
        evict_blobs = lambda: C.make_cold(files)  # noqa: E731
        t = interleaved({
            "direct_read": lambda: C.direct_read(files, aligned),
            "kvstore_fetch": lambda: mc.fetch(query),
            "load_prompt_cache": lambda: C.eval_cache(load_prompt_cache(one_file)),
        }, cold_reps, before={"kvstore_fetch": evict_blobs, "load_prompt_cache": lambda: C.make_cold([one_file])},
            warmup=0)
        aligned.close()
        out["cold"] = _report(t, kv_bytes, baseline="direct_read")
        out["cold"]["vs_load_prompt_cache"] = _median(t["load_prompt_cache"]) / _median(t["kvstore_fetch"])
    else:
        out["cold"] = None
    store.close()

    # -- memory tier -----------------------------------------------------------------------
    store = kvstore.open(work / "store", memory_bytes=2 * file_bytes + (64 << 20))
    mc = store.bind(model, "bench-shape", fingerprint=FINGERPRINT)
    mc.fetch(query)  # reads the disk once; the records stay in the memory tier
    assert len(store.memory) == len(files), "the memory tier did not keep every record"
    lru = LRUPromptCache(max_size=4)
    lru.insert_cache("bench-shape", toks.tolist(), cache)
    query_list = query.tolist()
    src = np.concatenate([np.asarray(a.view(mx.uint16)).reshape(-1) for a in C.kv_arrays(cache)])
    dst = np.empty_like(src)
    t = interleaved({
        "memcpy": lambda: np.copyto(dst, src),
        "memcpy_new_memory": lambda: _copy_new(src),
        "kvstore_fetch": lambda: mc.fetch(query),
        "lru_fetch_nearest": lambda: C.eval_cache(lru.fetch_nearest_cache("bench-shape", query_list)[0]),
    }, reps)
    out["memory"] = _report(t, kv_bytes, baseline="memcpy")
    out["memory"]["vs_lru_prompt_cache"] = _median(t["lru_fetch_nearest"]) / _median(t["kvstore_fetch"])
    out["memory"]["vs_memcpy_new_memory"] = _median(t["memcpy_new_memory"]) / _median(t["kvstore_fetch"])
    store.close()
    del src, dst, lru

    # -- insert on the caller's thread (issue 2) ---------------------------------------------
    if tokens <= 4096:
        out["insert"] = insert_latency(shape, cache, toks, work / "insert-store", reps=max(20, 4 * reps))

    del cache
    gc.collect()
    shutil.rmtree(work, ignore_errors=True)
    return out


def insert_latency(shape: C.Shape, cache, toks: np.ndarray, path, reps: int) -> dict:
    """`insert` of a cache whose records are all new, timed on the caller's thread."""
    store = kvstore.open(path, memory_bytes=0)
    mc = store.bind(shape.model(), "bench-shape", fingerprint=FINGERPRINT)
    samples = []
    for i in range(reps):
        fresh = toks.copy()
        fresh[0] = i  # a new first token: every chunk and the tail are new records
        t = time.perf_counter()
        mc.insert(fresh, cache)
        samples.append(time.perf_counter() - t)
        store.flush()  # keep the queue short so no insert is dropped for lack of room
    store.close()
    s = C.summary(samples)
    return {"p50_ms": s["p50"] * 1e3, "p99_ms": s["p99"] * 1e3, "max_ms": s["max"] * 1e3, "n": len(samples)}


def _copy_new(src: np.ndarray) -> bytearray:
    buf = bytearray(src.nbytes)
    np.copyto(np.frombuffer(buf, dtype=src.dtype), src)
    return buf


def _median(samples: list[float]) -> float:
    return float(np.median(samples))


def _report(times: dict[str, list[float]], nbytes: int, baseline: str) -> dict:
    base = _median(times[baseline])
    rows = {}
    for name, samples in times.items():
        med = _median(samples)
        rows[name] = {"median_s": med, "min_s": min(samples), "max_s": max(samples),
                      "gb_per_s": C.gbps(nbytes, med), "n": len(samples)}
    return {"methods": rows, "baseline": baseline,
            "ratio": base / rows["kvstore_fetch"]["median_s"]}


def run(quick: bool = False, configs=None) -> dict:
    configs = configs or (QUICK if quick else FULL)
    reps, cold_reps = (3, 2) if quick else (5, 3)
    results = []
    for shape_name, tokens in configs:
        r = run_one(shape_name, tokens, reps if tokens < 16384 else 3, cold_reps)
        results.append(r)
        w, c, m = r["warm"], r["cold"], r["memory"]
        C.log(f"[restore] {shape_name} {tokens}: warm {w['ratio']:.2f}x raw read, "
              f"{w['vs_load_prompt_cache']:.2f}x load_prompt_cache; "
              f"cold {c['ratio'] if c else float('nan'):.2f}x direct read; memory {m['ratio']:.2f}x memcpy, "
              f"{m['vs_lru_prompt_cache']:.2f}x LRUPromptCache")
    return {"machine": C.machine(), "blas": C.blas_in_use(), "quick": quick, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer, smaller caches and fewer repetitions")
    ap.add_argument("--tokens", type=int, nargs="*", help="cache lengths to run (default: the full set)")
    ap.add_argument("--shape", choices=sorted(C.SHAPES), nargs="*", help="cache shapes to run")
    args = ap.parse_args()
    configs = None
    if args.tokens or args.shape:
        configs = [(s, n) for s in (args.shape or sorted(C.SHAPES)) for n in (args.tokens or [1024, 4096, 16384])]
    data = run(args.quick, configs)
    print(C.write_result("restore", data))


if __name__ == "__main__":
    main()
