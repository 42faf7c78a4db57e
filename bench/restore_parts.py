"""Where a warm restore's time goes: its parts timed one by one, in one process, interleaved.

    PYTHONPATH=. python bench/restore_parts.py                  # 2k and 32k tokens of Qwen3-0.6B's shape
    PYTHONPATH=. python bench/restore_parts.py --tokens 2048 --reps 11

For each cache (random bfloat16 K/V stored through `store.bind(...).insert`), every call below runs
once per round, in the same process, round after round (medians):

- `raw_1t`, `raw_2t`: the blob files read whole into a reused, faulted buffer (1 and 2 threads);
- `fetch`: kvstore's whole warm restore from disk (memory tier off), evaluated;
- `load_prompt_cache`: mlx-lm's loader of the same cache in one file, evaluated;
- `allocate`: only the restore's final arrays (mlx hands them out one evaluation each);
- `reads_1t`, `reads_2t`: only the restore's reads into those arrays (already allocated), every
  tensor checked against its checksum, on 1 and 2 threads;
- `reads_unchecked_2t`: the same `preadv` calls into the same places, no checksum: what checking costs;
- `hash_pieces_1t`, `hash_pieces_2t`: xxh3 of the K/V bytes in the pieces the restore hashes
  (one head of one record), on 1 and 2 threads: xxhash keeps the GIL for pieces of 64 KiB or less.

Then, in two small processes of their own (one free to use every core, one pinned to one core),
what a hand-off between threads costs: a round trip between two Python threads, a trivial mlx
evaluation (the caller wakes mlx's stream thread and waits for it) and the final arrays of the
first cache's shape. Waking a thread on another core is what the final arrays wait for.

Writes bench/results/restore_parts.json; bench/report.py puts it in bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import common as C
import mlx.core as mx
import numpy as np
import xxhash
from restore_methods import FINGERPRINT, MODEL_ID, NEXT_TOKEN

import kvstore
import kvstore.model.cache as model_cache
from kvstore.restore import alloc, buffers, fill
from kvstore.storage.readplan import target

SHAPES = {**C.SHAPES, "tiny": C.Shape("tiny", layers=2, kv_heads=2, head_dim=32)}  # tiny: the smoke test


def captured_fill(mc, query):
    """The plan and opened sources of one fetch of `query`, kept open for timing (and the fetch's own
    result, checked to have reused every stored token)."""
    seen = {}
    real = model_cache.fill

    def spy(pl, sources):
        finals, errors = real(pl, sources)
        seen["plan"], seen["sources"] = pl, list(sources)
        seen["closes"] = [s.close for s in sources]
        for s in sources:  # kept open past the fetch: the timed reads use them
            s.close = lambda: None
        return finals, errors

    model_cache.fill = spy
    try:
        cache, rest = mc.fetch(query)
    finally:
        model_cache.fill = real
    if list(rest) != [NEXT_TOKEN]:
        raise AssertionError(f"the fetch left {len(rest)} tokens, not 1")
    del cache
    return seen


def parts(shape: C.Shape, tokens: int, reps: int) -> dict:
    work = C.scratch_dir(f"restore-parts-{shape.name}-{tokens}")
    try:
        return _parts(shape, tokens, reps, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _parts(SHAPE: C.Shape, tokens: int, reps: int, work) -> dict:
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    C.log(f"[parts] {tokens} tokens: preparing")
    cache = C.random_cache(SHAPE, tokens, seed=tokens)
    toks = C.random_tokens(tokens, seed=tokens)
    store = kvstore.open(work / "store", memory_bytes=0)
    mc = store.bind(SHAPE.model(), MODEL_ID, fingerprint=FINGERPRINT)
    mc.insert(toks, cache)
    if not store.flush(timeout=1200):
        raise RuntimeError("the benchmark cache was not written in 20 minutes")
    one_file = work / "prompt_cache.safetensors"
    save_prompt_cache(str(one_file), cache)
    kv_bytes = C.cache_nbytes(cache)
    del cache
    files = C.blob_files(work / "store")
    offsets, total = C.file_offsets(files)
    buf = C.aligned_buffer(total)
    C.warm(files + [one_file])
    query = np.concatenate([toks, [NEXT_TOKEN]]).astype(np.int32)
    seen = captured_fill(mc, query)
    pl, sources = seen["plan"], seen["sources"]
    specs = {name: (e.tag, e.shape) for name, e in pl.finals.items()}
    finals = alloc.allocate(specs)
    views = {name: target(fill._host(a)) for name, a in finals.items()}
    keys = list(pl.jobs)
    pool = ThreadPoolExecutor(2)
    groups_files = C.split_by_bytes(files, 2)

    def raw_2t():
        list(pool.map(lambda g: C.read_files([files[i] for i in g], buf, [offsets[i] for i in g]), groups_files))

    def fetch():
        c, _ = mc.fetch(query)
        C.eval_cache(c)
        return c

    def reads(ks, check=True):
        for k in ks:
            if check:
                sources[k].read_copies(pl.jobs[k], views)
            else:
                _unchecked(sources[k], pl.jobs[k], views)

    def on_two(fn):
        halves = [keys[0::2], keys[1::2]]
        return lambda: list(pool.map(fn, halves))

    piece = SHAPE.head_dim * 2 * 256  # one head of one 256-token record, bfloat16
    hashed = np.frombuffer(buf, dtype=np.uint8)[: total - total % piece]
    pieces = [memoryview(hashed)[i : i + piece] for i in range(0, len(hashed), piece)]

    def hash_pieces(ps):
        for p in ps:
            xxhash.xxh3_64_intdigest(p)

    methods = {
        "raw_1t": lambda: C.read_files(files, buf, offsets),
        "raw_2t": raw_2t,
        "fetch": fetch,
        "load_prompt_cache": lambda: C.eval_cache(load_prompt_cache(str(one_file))),
        "allocate": lambda: alloc.allocate(specs),
        "reads_1t": lambda: reads(keys),
        "reads_2t": on_two(reads),
        "reads_unchecked_2t": on_two(lambda ks: reads(ks, check=False)),
        "hash_pieces_1t": lambda: hash_pieces(pieces),
        "hash_pieces_2t": lambda: list(pool.map(hash_pieces, [pieces[0::2], pieces[1::2]])),
    }
    samples = {name: [] for name in methods}
    faults = {name: [] for name in methods}
    load = [os.getloadavg()[0]]
    for r in range(reps + 1):
        for name, fn in (methods.items() if r % 2 == 0 else reversed(methods.items())):
            gc.collect()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            del out
            if r:  # the first round warms up
                samples[name].append(dt)
                faults[name].append(f1 - f0)
        load.append(os.getloadavg()[0])
    restored = fetch()  # what the timed reads wrote is what a fetch restores
    for layer, c in enumerate(restored):
        for name, got in ((f"{layer}.keys", c.keys), (f"{layer}.values", c.values)):
            n = pl.filled[name]
            if not np.array_equal(views[name].array[:, :, :n], np.asarray(got.view(mx.uint16))[:, :, :n]):
                raise AssertionError(f"the timed reads of {name} differ from what fetch restores")
    del restored
    for close in seen["closes"]:
        close()
    store.close()
    med = {name: float(np.median(s)) for name, s in samples.items()}
    return {"shape": SHAPE.name, "tokens": tokens, "kv_bytes": kv_bytes, "blob_bytes": total, "blob_files": len(files),
            "final_arrays": len(specs), "records": len(keys), "piece_bytes": piece, "load_average": load,
            "buffer_cache_bound": buffers.bound(), "final_bytes": pl.nbytes,
            "specs": {name: [tag, [int(d) for d in shape]] for name, (tag, shape) in specs.items()},
            "median_s": med, "samples_s": samples,
            "minflt_median": {n: float(np.median(f)) for n, f in faults.items()}}


def _unchecked(source, copies, views) -> None:
    """The `preadv` calls `read_copies` makes, into the same places, without the checksums."""
    from kvstore.storage.blobfile import _preadv_all

    blob = source.blob
    plan = blob._read_plan(copies, views)
    flats = [views[name].flat for name in plan.names]
    scratch = memoryview(bytearray(plan.scratch)) if plan.scratch else None
    for start, nbytes, pieces, _ in plan.batches:
        bufs = [flats[t][a:b] if t >= 0 else scratch[a:b] for t, a, b in pieces]
        _preadv_all(blob.fd, bufs, blob.base + start, blob.path, nbytes)


_HANDOFF_CHILD = r"""
import json, math, statistics, sys, threading, time
import mlx.core as mx
from kvstore.restore import alloc, buffers
from kvstore.storage.blobformat import DTYPES
specs = {name: (tag, tuple(shape)) for name, (tag, shape) in json.loads(sys.argv[1]).items()}
ping, pong = threading.Event(), threading.Event()
N = 2000
def other():
    for _ in range(N):
        ping.wait(); ping.clear(); pong.set()
t = threading.Thread(target=other); t.start()
trips = []
for _ in range(N):
    t0 = time.perf_counter(); ping.set(); pong.wait(); pong.clear(); trips.append(time.perf_counter() - t0)
t.join()
stream, tiny, evals = mx.new_stream(mx.cpu), mx.zeros((4,)), []
for _ in range(500):
    t0 = time.perf_counter(); mx.eval(mx.add(tiny, 1, stream=stream)); evals.append(time.perf_counter() - t0)
buffers.keep(sum(DTYPES[tag].itemsize * math.prod(shape) for tag, shape in specs.values()))
allocs = []
for _ in range(21):
    t0 = time.perf_counter(); out = alloc.allocate(specs); allocs.append(time.perf_counter() - t0); del out
print(json.dumps({"thread_round_trip_s": statistics.median(trips[100:]),
                  "mlx_eval_round_trip_s": statistics.median(evals[50:]),
                  "allocate_s": statistics.median(allocs[1:]), "arrays": len(specs)}))
"""


def handoffs(specs: dict) -> dict:
    """What waking another thread costs, in a process free to use every core and in one pinned to
    one (`_HANDOFF_CHILD`; bfloat16 final arrays of `specs`' shapes)."""
    arg = json.dumps({name: [tag, list(shape)] for name, (tag, shape) in specs.items()})
    out = {}
    pinned = getattr(os, "sched_setaffinity", None)
    for where in ("every core", "one core"):
        if where == "one core" and pinned is None:
            continue
        first = sorted(os.sched_getaffinity(0))[0] if pinned else 0
        proc = subprocess.run([sys.executable, "-c", _HANDOFF_CHILD, arg], capture_output=True, text=True,
                              timeout=600, cwd=str(C.REPO), env=dict(os.environ, PYTHONPATH=str(C.REPO)),
                              preexec_fn=(lambda: os.sched_setaffinity(0, {first})) if where == "one core" else None)
        if proc.returncode != 0:
            raise RuntimeError(f"the hand-off child ({where}) failed: {proc.stderr[-2000:]}")
        out[where] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _ceiling(r: dict, ms: dict) -> str:
    """What the parts allow: the restore against the raw read if its reads ran as fast as the raw
    read on two threads, without and with the checks."""
    checks = ms["reads_2t"] - ms["reads_unchecked_2t"]
    best = ms["raw_2t"] + ms["allocate"]
    out = (f"**What this allows.** Were the reads as fast as the raw read on two threads and the checks "
            f"free, the final arrays alone would hold the restore to {ms['raw_1t'] / best:.2f}x the raw read "
            f"({ms['raw_2t']:.1f} + {ms['allocate']:.1f} ms); with the checks, {ms['raw_1t'] / (best + checks):.2f}x.")
    gap = ms["reads_unchecked_2t"] - ms["raw_2t"]
    if gap <= 0:
        return out + (f" Unchecked, the restore's reads into the final arrays took {-gap:.1f} ms less than the raw "
                      f"read on two threads here, where two threads read little faster than one ({ms['raw_1t']:.1f} "
                      f"against {ms['raw_2t']:.1f} ms).")
    return out + (f" Unchecked, the restore's reads take {gap:.1f} ms more than the raw read on two threads, "
                  f"which reads whole files into one page-aligned buffer: they land in pieces of "
                  f"{r['piece_bytes'] // 1024} KiB (one head of one record), one `preadv` a batch, at addresses "
                  "mlx-cpu's allocator puts 8 bytes past a multiple of 16, which the kernel copies to more "
                  "slowly (`bench/copy_alignment.py`). mlx makes every array it hands out itself: "
                  "its zero-copy import of memory allocated elsewhere (`mx.asarray(a, copy=False)`) takes only "
                  "Metal buffers (on the CPU: \"Cannot import a CPU array without a copy\"), and asking for more "
                  "bytes to align the data leaves the sizes its buffer cache reuses.")


def markdown(data: dict) -> list[str]:
    lines = ["## Where a warm restore's time goes", ""]
    add = lines.append
    add("Re-run with `PYTHONPATH=. python bench/restore_parts.py`. Each part of a warm restore from disk is "
        "timed alone, in one process, interleaved with the whole restore and its baselines (medians; "
        f"{data['reps']} rounds). Run {data['written_utc']} on {data['machine'].get('cpu')}, "
        f"{data['machine'].get('cores')} cores.")
    add("")
    for r in data["results"]:
        m = r["median_s"]
        ms = {k: v * 1e3 for k, v in m.items()}
        add(f"**{r['shape']} shape, {r['tokens']:,} tokens**: {r['kv_bytes'] / 1e6:,.0f} MB of K/V in "
            f"{r['records']} records, {r['final_arrays']} final arrays; load average "
            + ", ".join(f"{x:.2f}" for x in r["load_average"][:: max(1, len(r['load_average']) // 4)]) + ".")
        add("")
        add("| part | median | raw read (1 thread) time / this | minor faults |")
        add("| --- | ---: | ---: | ---: |")
        for name, v in ms.items():
            add(f"| `{name}` | {v:.1f} ms | {m['raw_1t'] / m[name]:.2f}x | {r['minflt_median'][name]:,.0f} |")
        add("")
        rest = ms["fetch"] - ms["allocate"] - ms["reads_2t"]
        add(f"The whole restore is {m['raw_1t'] / m['fetch']:.2f}x the raw read and "
            f"{m['load_prompt_cache'] / m['fetch']:.2f}x `load_prompt_cache`. Of its {ms['fetch']:.1f} ms: "
            f"the final arrays {ms['allocate']:.1f} ms ({r['final_arrays']} mlx evaluations, "
            f"{ms['allocate'] * 1e3 / r['final_arrays']:.0f} µs each), the checked reads on two threads "
            f"{ms['reads_2t']:.1f} ms ({m['raw_1t'] / m['reads_2t']:.2f}x the raw read; unchecked "
            f"{ms['reads_unchecked_2t']:.1f} ms, so checking costs {ms['reads_2t'] - ms['reads_unchecked_2t']:.1f} ms), "
            f"and the rest (lookup, opening {r['records']} files, plan, build, page faults) {rest:.1f} ms. Hashing "
            f"{r['piece_bytes'] // 1024} KiB pieces takes {ms['hash_pieces_1t']:.1f} ms on one thread and "
            f"{ms['hash_pieces_2t']:.1f} ms on two: xxhash lets go of the GIL only above 64 KiB.")
        add("")
        add(_ceiling(r, ms))
        faulted = r["minflt_median"]["fetch"] * 4096
        if faulted > 0.05 * r["kv_bytes"] and "buffer_cache_bound" in r:
            add("")
            add(f"Here the restore page-faulted {faulted / 1e9:.2f} GB of fresh memory a call: mlx-cpu reuses a freed "
                f"buffer only for a request of its own size, keeps a freed buffer only while its cache has room "
                f"(once it is full, what is freed goes back to the OS and what it holds stays), and the bound "
                f"({r['buffer_cache_bound'] / 1e9:.1f} GB, a quarter of RAM) holds less than this restore's "
                f"{r['final_bytes'] / 1e9:.1f} GB and `load_prompt_cache`'s arrays, which this run interleaves "
                "with it.")
        add("")
    hand = data.get("handoffs")
    if hand:
        every, one = hand.get("every core"), hand.get("one core")
        shape, tokens = data.get("handoffs_shape", ["", 0])
        add(f"**What the final arrays wait for.** In a process of its own free to use every core, a round trip "
            f"between two Python threads takes {every['thread_round_trip_s'] * 1e6:.0f} µs and a trivial mlx "
            f"evaluation {every['mlx_eval_round_trip_s'] * 1e6:.0f} µs (the caller wakes mlx's stream thread and "
            f"waits for it); the {every['arrays']} final arrays of {shape} at {tokens:,} tokens take "
            f"{every['allocate_s'] * 1e3:.1f} ms."
            + (f" Pinned to one core, the same take {one['thread_round_trip_s'] * 1e6:.0f} µs, "
               f"{one['mlx_eval_round_trip_s'] * 1e6:.0f} µs and {one['allocate_s'] * 1e3:.1f} ms"
               + (f": {1 - one['allocate_s'] / every['allocate_s']:.0%} of the final arrays' time is spent waking "
                  "a thread on the other core (each array is an evaluation that goes through mlx's stream and "
                  "I/O threads), not in work." if one["allocate_s"] < 0.5 * every["allocate_s"] else ".")
               if one else ""))
        add("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--tokens", type=C.positive_int, nargs="*", default=[2048, 32768])
    ap.add_argument("--out", type=Path, help="write the JSON here instead of bench/results/restore_parts.json")
    ap.add_argument("--reps", type=C.positive_int, default=9, help="timed rounds (each runs every part once)")
    args = ap.parse_args()
    C.log_machine("parts")
    results = []
    for n in args.tokens:
        results.append(parts(SHAPES[args.shape], n, args.reps if n < 16384 else max(3, args.reps // 2)))
        gc.collect()
        mx.clear_cache()
    C.log("[parts] hand-offs between threads, on every core and on one")
    first = {name: (tag, tuple(shape)) for name, (tag, shape) in [r.pop("specs") for r in results][0].items()}
    data = {"machine": C.machine(), "blas": C.blas_in_use(), "reps": args.reps, "results": results,
            "handoffs": handoffs(first), "handoffs_shape": [results[0]["shape"], results[0]["tokens"]]}
    out = C.write_result("restore_parts", data, args.out)
    for line in markdown(dict(data, written_utc="now")):
        if line.startswith("The whole"):
            C.log("[parts] " + line)
    print(out)


if __name__ == "__main__":
    main()
