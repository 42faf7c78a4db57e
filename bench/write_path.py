"""Write-path benchmark: what `insert` costs the caller, how fast the writer drains, disk bytes.

- `insert` latency on the caller's thread (p50/p99/max, page faults per call), with the writer idle
  and with the writer busy writing an earlier insert (the usual case in a server), for caches of
  1k/4k/16k tokens, 200 samples per case;
- background write throughput (insert -> flush) vs a raw write of the same bytes to as many files
  with an fsync each;
- disk bytes for 100 prompts that share a 2,048-token system prompt, vs the KV bytes of their
  unique tokens, vs one file per prompt (mlx-lm `save_prompt_cache`).

    python bench/write_path.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import time

import common as C
import numpy as np
from mlx_lm.models.cache import KVCache, save_prompt_cache

import kvstore
from kvstore import keys

FINGERPRINT = b"kvstore-bench-wp"
SHAPE = C.SHAPES["qwen3-0.6b"]


def view_cache(base: list[KVCache], n: int) -> list[KVCache]:
    """KVCache objects that have processed the first `n` tokens of `base` (no copies)."""
    out = []
    for b in base:
        c = KVCache()
        c.keys, c.values, c.offset = b.keys, b.values, n
        out.append(c)
    return out


def _thread_counts() -> tuple[int, int]:
    """(page faults, involuntary context switches) of the calling thread so far."""
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_minflt + r.ru_majflt, r.ru_nivcsw


def insert_latency(tokens: int, reps: int, busy_reps: int | None = None) -> dict:
    """`insert` timed on the caller's thread, `reps` times with the writer idle (flushed before)
    and `busy_reps` (default `reps`) times with it busy writing a fresh `tokens`-token sequence queued just before.

    Each timed insert is a chat turn's: `tokens` tokens of which all but the last chunk are
    stored (pinned, so the untimed gc between rounds keeps them), so it queues one new 256-token
    record and the disk sees 29 MB per sample instead of the whole cache. The caller's work
    (a view per tensor, the chain's hashes, one index query, the queue) is that of any insert
    of this length; `all_new` times a few inserts of wholly new sequences to show it."""
    work = C.scratch_dir(f"insert-{tokens}")
    base = C.random_cache(SHAPE, tokens, seed=3)
    toks = C.random_tokens(tokens, seed=3)
    # A queue with room for the load and every timed insert behind it: none may be dropped.
    store = kvstore.open(work / "store", memory_bytes=0, max_pending_bytes=4 * SHAPE.bytes_per_token * tokens + (1 << 30))
    mc = store.bind(SHAPE.model(), "bench-shape", fingerprint=FINGERPRINT)
    chunk = store.chunk_size
    mc.insert(toks[: tokens - chunk], view_cache(base, tokens - chunk), pin=True)
    serial = iter(range(1, 1 << 30))
    per_load = max(5, tokens // 200)  # timed inserts per busy spell (a load of 16k tokens lasts seconds)

    def turn() -> np.ndarray:  # the stored prefix, then a last chunk never seen before
        t = toks.copy()
        t[tokens - chunk] = next(serial)
        return t

    def fresh() -> np.ndarray:  # a sequence never seen before
        t = toks.copy()
        t[0] = next(serial)
        return t

    def timed(seq: np.ndarray, out: list, faults: list) -> None:
        f0, p0 = _thread_counts()
        t0 = time.perf_counter()
        mc.insert(seq, base)
        out.append(time.perf_counter() - t0)
        f1, p1 = _thread_counts()
        faults.append((f1 - f0, p1 - p0))

    mc.insert(turn(), base)  # warm-up (first-use costs)
    store.flush()
    idle, idle_faults, busy, busy_faults, all_new = [], [], [], [], []
    for _ in range(reps):
        timed(turn(), idle, idle_faults)
        store.flush()
    not_busy = 0
    while len(busy) < (reps if busy_reps is None else busy_reps):
        load = fresh()
        mc.insert(load, base)  # the writer starts on this one...
        first = keys.chain(mc.ns, load[:chunk], chunk)[0]
        for _ in range(per_load):
            time.sleep(0.005)
            if not store.writer.is_pending(first):
                not_busy += 1  # it finished already: not a busy sample
                break
            timed(turn(), busy, busy_faults)  # ...while these are timed
        store.flush()
        store.gc(max_bytes=0)  # untimed: drops all but the pinned prefix
    for _ in range(10):
        timed(fresh(), all_new, [])
        store.flush()
        store.gc(max_bytes=0)
    dropped = store.writer.stats.dropped_jobs
    store.close()
    shutil.rmtree(work, ignore_errors=True)

    def stats(samples: list, faults: list | None = None) -> dict:
        s = C.summary(samples)
        out = {"p50_ms": s["p50"] * 1e3, "p99_ms": s["p99"] * 1e3, "max_ms": s["max"] * 1e3, "n": s["n"]}
        if faults is not None:
            f = [n for n, _ in faults]
            out["faults_p50"], out["faults_max"] = float(np.median(f)), int(max(f))
            # Calls over 2 ms, and how many of them the kernel preempted (the caller lost its core)
            slow = [p for t, (_, p) in zip(samples, faults) if t > 2e-3]
            out["over_2ms"], out["over_2ms_preempted"] = len(slow), sum(1 for p in slow if p)
        return out

    return {"tokens": tokens, "kv_bytes": SHAPE.bytes_per_token * tokens,
            "idle": stats(idle, idle_faults), "busy": stats(busy, busy_faults), "all_new": stats(all_new),
            "loads_finished_early": not_busy, "dropped_jobs": dropped,
            "idle_samples": idle, "busy_samples": busy}


def control(p50_ms: float, reps: int) -> dict:
    """The machine's own tail: the same timing around CPU work sized like an insert (its p50),
    counting loop iterations rather than trusting the clock, idle and while the writer writes."""
    # Calibrate a fixed amount of work (iterations) that takes p50_ms when nothing interferes.
    n, t = 1000, 0.0
    while t < p50_ms / 1e3:
        n *= 2
        t0 = time.perf_counter()
        _loop(n)
        t = time.perf_counter() - t0
    n = int(n * (p50_ms / 1e3) / t)
    work = C.scratch_dir("control")
    base = C.random_cache(SHAPE, 1024, seed=9)
    toks = C.random_tokens(1024, seed=9)
    store = kvstore.open(work / "store", memory_bytes=0)
    mc = store.bind(SHAPE.model(), "bench-shape", fingerprint=FINGERPRINT)
    idle, busy = [], []
    for i in range(reps):
        t0 = time.perf_counter()
        _loop(n)
        idle.append(time.perf_counter() - t0)
        fresh = toks.copy()
        fresh[0] = i + 1
        mc.insert(fresh, base)  # the writer now writes while the same work is timed
        time.sleep(0.01)
        t0 = time.perf_counter()
        _loop(n)
        busy.append(time.perf_counter() - t0)
        store.flush()
        store.gc(max_bytes=0)
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    si, sb = C.summary(idle), C.summary(busy)
    return {"work_ms": p50_ms, "idle": {"p50_ms": si["p50"] * 1e3, "p99_ms": si["p99"] * 1e3, "n": si["n"]},
            "busy": {"p50_ms": sb["p50"] * 1e3, "p99_ms": sb["p99"] * 1e3, "n": sb["n"]}}


def _loop(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def write_throughput(tokens: int, reps: int, memory_bytes: int) -> dict:
    """insert -> flush of a new cache vs writing the same blob bytes raw, one file each, fsync'd."""
    work = C.scratch_dir(f"throughput-{tokens}")
    base = C.random_cache(SHAPE, tokens, seed=5)
    toks = C.random_tokens(tokens, seed=5)
    store = kvstore.open(work / "store", memory_bytes=memory_bytes)
    mc = store.bind(SHAPE.model(), "bench-shape", fingerprint=FINGERPRINT)
    kv_times, raw_times, written = [], [], []
    for rep in range(reps):
        t = toks.copy()
        t[0] = rep + 1
        before = store.writer.stats.bytes_written
        files_before = set(C.blob_files(work / "store"))
        t0 = time.perf_counter()
        mc.insert(t, base)
        store.flush()
        kv_times.append(time.perf_counter() - t0)
        written.append(store.writer.stats.bytes_written - before)
        new_files = sorted(set(C.blob_files(work / "store")) - files_before)
        blobs = [f.read_bytes() for f in new_files]
        raw_dir = work / f"raw-{rep}"
        raw_dir.mkdir()
        t0 = time.perf_counter()
        for i, data in enumerate(blobs):
            fd = os.open(raw_dir / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        raw_times.append(time.perf_counter() - t0)
        del blobs
        shutil.rmtree(raw_dir)
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    nbytes = int(np.median(written))
    kv, raw = float(np.median(kv_times)), float(np.median(raw_times))
    return {"tokens": tokens, "memory_bytes": memory_bytes, "bytes": nbytes,
            "kvstore_s": kv, "raw_write_fsync_s": raw,
            "kvstore_gb_per_s": C.gbps(nbytes, kv), "raw_gb_per_s": C.gbps(nbytes, raw),
            "ratio": raw / kv, "n": reps}


def shared_prefix(prompts: int, system: int, max_unique: int) -> dict:
    """Disk bytes of `prompts` prompts = one `system`-token prefix + a unique part each."""
    work = C.scratch_dir("shared")
    rng = np.random.default_rng(11)
    uniques = rng.integers(max_unique // 8, max_unique + 1, size=prompts)
    longest = system + int(uniques.max())
    base = C.random_cache(SHAPE, -(-longest // KVCache.step) * KVCache.step, seed=11)
    prefix = C.random_tokens(system, seed=11)
    store = kvstore.open(work / "store", memory_bytes=0)
    mc = store.bind(SHAPE.model(), "bench-shape", fingerprint=FINGERPRINT)
    one_file_bytes = 0
    for i, u in enumerate(uniques):
        toks = np.concatenate([prefix, C.random_tokens(int(u), seed=1000 + i)])
        cache = view_cache(base, len(toks))
        mc.insert(toks, cache)
        if i % 8 == 7:
            store.flush()  # keep the queue well under its byte bound: nothing may be dropped
        one_file_bytes += _prompt_file_bytes(cache, work, measure=(i == 0))
    store.flush()
    stats = store.stats()
    dropped = store.writer.stats.dropped_jobs
    store.close()
    unique_tokens = system + int(uniques.sum())
    unique_kv = unique_tokens * SHAPE.bytes_per_token
    shutil.rmtree(work, ignore_errors=True)
    return {"prompts": prompts, "system_tokens": system, "unique_tokens": unique_tokens,
            "unique_kv_bytes": unique_kv, "kvstore_bytes": stats["bytes"],
            "records": stats["chunks"] + stats["tails"], "dropped_jobs": dropped,
            "one_file_per_prompt_bytes": one_file_bytes,
            "kvstore_vs_unique": stats["bytes"] / unique_kv,
            "one_file_vs_unique": one_file_bytes / unique_kv}


_FILE_OVERHEAD: dict[str, int] = {}


def _prompt_file_bytes(cache: list[KVCache], work, measure: bool) -> int:
    """What `save_prompt_cache` writes for this cache: its arrays (mlx-lm saves each layer's whole
    buffer, rounded up to 256 tokens) plus the header. The first prompt is really saved to
    measure the header; the others are computed the same way without writing 100 files."""
    arrays = sum(int(c.keys[..., : _rounded(c), :].nbytes + c.values[..., : _rounded(c), :].nbytes) for c in cache)
    if measure:
        path = str(work / "one-prompt.safetensors")
        save_prompt_cache(path, [_exact(c) for c in cache])
        _FILE_OVERHEAD["bytes"] = os.path.getsize(path) - arrays
        os.unlink(path)
    return arrays + _FILE_OVERHEAD.get("bytes", 0)


def _rounded(c: KVCache) -> int:
    return (c.offset + KVCache.step - 1) // KVCache.step * KVCache.step


def _exact(c: KVCache) -> KVCache:
    """The cache as mlx-lm would hold it after processing its tokens: a buffer rounded up to 256."""
    out = KVCache()
    n = _rounded(c)
    out.keys, out.values, out.offset = c.keys[..., :n, :], c.values[..., :n, :], c.offset
    return out


def run(quick: bool = False) -> dict:
    sizes = [1024, 4096] if quick else [1024, 4096, 16384]
    inserts = []
    for tokens in sizes:
        r = insert_latency(tokens, 40 if quick else 200)
        C.log(f"[write] insert {tokens}: idle p50/p99/max {r['idle']['p50_ms']:.2f}/{r['idle']['p99_ms']:.2f}/"
              f"{r['idle']['max_ms']:.2f} ms, faults {r['idle']['faults_p50']:.0f}; busy p50/p99/max "
              f"{r['busy']['p50_ms']:.2f}/{r['busy']['p99_ms']:.2f}/{r['busy']['max_ms']:.2f} ms, faults "
              f"{r['busy']['faults_p50']:.0f}; all new p50/max {r['all_new']['p50_ms']:.2f}/"
              f"{r['all_new']['max_ms']:.2f} ms")
        inserts.append(r)
    jitter = control(inserts[0]["idle"]["p50_ms"], 30 if quick else 60)
    C.log(f"[write] control ({jitter['work_ms']:.2f} ms of Python work): idle p99 {jitter['idle']['p99_ms']:.2f} ms, "
          f"busy p99 {jitter['busy']['p99_ms']:.2f} ms")
    throughput = []
    for memory_bytes in (0, None):
        r = write_throughput(2048 if quick else 4096, 2 if quick else 3,
                             memory_bytes if memory_bytes is not None else 1 << 30)
        C.log(f"[write] throughput (memory tier {'off' if memory_bytes == 0 else 'on'}): "
              f"{r['kvstore_gb_per_s']:.2f} GB/s vs raw {r['raw_gb_per_s']:.2f} GB/s = {r['ratio']:.2f}x")
        throughput.append(r)
    shared = shared_prefix(100, 2048, 256 if quick else 512)
    C.log(f"[write] 100 prompts sharing 2k tokens: {shared['kvstore_vs_unique']:.4f}x unique KV bytes; "
          f"one file per prompt {shared['one_file_vs_unique']:.2f}x")
    return {"machine": C.machine(), "quick": quick, "shape": SHAPE.name, "insert": inserts, "control": jitter,
            "throughput": throughput, "shared_prefix": shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller caches and fewer repetitions")
    args = ap.parse_args()
    C.log_machine("write")
    print(C.write_result("write_path", run(args.quick)))


if __name__ == "__main__":
    main()
