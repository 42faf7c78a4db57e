"""Profile `fetch` against a raw read of the same blob bytes (a quick look, not the benchmark).

    python bench/profile_fetch.py [--tokens 2048] [--shape qwen3-0.6b] [--reps 10] [--cprofile]
                                  [--head-dim D] [--chunk-size 256]

Builds a store with one cache of the shape (random bfloat16 K/V), then in this one process times,
interleaved: a raw read of the blob files into a reused buffer, `fetch` from disk (memory tier off),
`fetch` + first decode step, `fetch` from the memory tier + first step, and mlx-lm's
`LRUPromptCache.fetch_nearest_cache` + first step; with minor page faults per call.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common as C  # noqa: E402
import mlx.core as mx  # noqa: E402

import kvstore  # noqa: E402


def first_step(cache, shape):
    kv = mx.zeros((1, shape.kv_heads, 1, shape.head_dim), mx.bfloat16)
    out = [layer.update_and_fetch(kv, kv) for layer in cache]
    mx.eval(out)


def timed(fn, reps):
    times, faults = [], []
    fn()
    for _ in range(reps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        del out
    return statistics.median(times) * 1e3, statistics.median(faults)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=C.positive_int, default=2048)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(C.SHAPES))
    ap.add_argument("--reps", type=C.positive_int, default=10)
    ap.add_argument("--cprofile", action="store_true", help="print the top of a cProfile of fetch")
    ap.add_argument("--head-dim", type=C.positive_int, default=None,
                    help="override the shape's head_dim (tiny: measures the Python overhead alone)")
    ap.add_argument("--serial", action="store_true", help="fill on the calling thread only")
    ap.add_argument("--chunk-size", type=C.positive_int, default=256, help="the stores' chunk size (tokens a record)")
    ap.add_argument("--cache-limit", type=C.non_negative_float, default=None, metavar="GB",
                    help="mx.set_cache_limit before timing (keeps freed buffers for reuse)")
    args = ap.parse_args()
    C.log_machine("profile")
    if args.serial:
        import kvstore.restore.fill as R
        R._POOL_MIN_BYTES = 1 << 62
    if args.cache_limit is not None:
        mx.set_cache_limit(int(args.cache_limit * 1e9))
    shape = C.SHAPES[args.shape]
    if args.head_dim:
        shape = C.Shape(f"{shape.name}-d{args.head_dim}", shape.layers, shape.kv_heads, args.head_dim)
    model = shape.model()
    tokens = C.random_tokens(args.tokens).tolist()
    cache = C.random_cache(shape, args.tokens)
    root = C.scratch_dir("profile-fetch")
    with kvstore.open(root / "s", memory_bytes=0, chunk_size=args.chunk_size) as store:
        store.bind(model, "shape", fingerprint=b"s" * 16).insert(tokens, cache)
        store.flush()
    files = C.blob_files(root / "s")
    nbytes = sum(p.stat().st_size for p in files)
    buf = C.aligned_buffer(nbytes)
    query = tokens + [1]
    disk = kvstore.open(root / "s", memory_bytes=0, chunk_size=args.chunk_size)
    mc = disk.bind(model, "shape", fingerprint=b"s" * 16)
    ram = kvstore.open(kvstore.MEMORY, memory_bytes=4 << 30, chunk_size=args.chunk_size)
    mr = ram.bind(model, "shape", fingerprint=b"s" * 16)
    mr.insert(tokens, cache)
    ram.flush()
    from mlx_lm.models.cache import LRUPromptCache

    lru = LRUPromptCache(max_size=4)
    lru.insert_cache("m", tokens, C.trimmed_copy(cache, len(tokens)))

    def lru_fetch():
        got, rest = lru.fetch_nearest_cache("m", query)
        first_step(got, shape)
        return got

    def fetch_step(m):
        def run():
            got, rest = m.fetch(query)
            first_step(got, shape)
            return got
        return run

    methods = {
        "raw read (reused buffer)": lambda: C.raw_read(files, buf),
        "fetch, disk": lambda: mc.fetch(query),
        "fetch, disk + first step": fetch_step(mc),
        "fetch, memory tier + first step": fetch_step(mr),
        "LRUPromptCache + first step": lru_fetch,
    }
    print(f"{args.shape}, {args.tokens} tokens, {nbytes / 1e6:.0f} MB of blobs")
    results = {name: timed(fn, args.reps) for name, fn in methods.items()}
    raw = results["raw read (reused buffer)"][0]
    for name, (ms, faults) in results.items():
        print(f"  {name:34s} {ms:8.1f} ms  {faults:8.0f} minor faults  ({raw / ms:.2f}x raw read)")
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps):
            mc.fetch(query)
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    disk.close()
    ram.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
