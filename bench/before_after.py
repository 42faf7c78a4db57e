"""Each change the benchmarks led to in the library, measured against the old behaviour in one run.

The old behaviour is switched back on in this process only, never by editing the library:

- `insert` on the caller's thread: lazy mlx views of the cache's tensors scheduled with
  `mx.async_eval` vs numpy views of the same memory (no mlx op), with the writer idle and busy;
- restore (fetch from disk, memory tier off): the general path (`blobs.read`: read into a buffer,
  checksum, one mlx array per tensor, then `mx.concatenate` per layer) vs `ModelCache._fetch_direct`
  (each layer allocated once, the page cache copied straight into it by `blobs.read_into`);
- the index: 4 KiB pages vs 16 KiB pages (schema 16: narrow rows, edges in `children`): lookup
  latency of a 32k-token prompt and size on disk, at 100k rows. (The step this measured first, from
  schema 3 to 4, added a covering index that schema 16 made unneeded.)

    python bench/before_after.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sqlite3
import time

import common as C
import index_scale
import numpy as np
import write_path

import kvstore
from kvstore.model import cache as modelcache
from kvstore.restore import codecs

FINGERPRINT = b"kvstore-bench-ba"


def restore(shape_name: str, tokens: int, reps: int) -> dict:
    shape = C.SHAPES[shape_name]
    cache = C.random_cache(shape, tokens, seed=21)
    toks = C.random_tokens(tokens, seed=21)
    query = np.concatenate([toks, [3]]).astype(np.int32)
    work = C.scratch_dir(f"ba-restore-{tokens}")
    store = kvstore.open(work / "store", memory_bytes=0)
    mc = store.bind(shape.model(), "bench-shape", fingerprint=FINGERPRINT)
    mc.insert(toks, cache)
    store.flush()
    del cache
    files = C.blob_files(work / "store")
    nbytes = sum(f.stat().st_size for f in files)
    buf = bytearray(nbytes)
    direct = modelcache.ModelCache._direct

    def general():
        modelcache.ModelCache._direct = property(lambda self: False)
        try:
            return mc.fetch(query)
        finally:
            modelcache.ModelCache._direct = direct

    fns = {"raw_read": lambda: C.raw_read(files, buf), "before": general, "after": lambda: mc.fetch(query)}
    assert general()[0][0].offset == tokens and mc.fetch(query)[0][0].offset == tokens
    times = {k: [] for k in fns}
    C.warm(files)
    for rnd in range(reps + 1):
        for k, fn in fns.items():
            gc.collect()
            t = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t
            del out
            if rnd:
                times[k].append(dt)
    cold = {"before": [], "after": []}
    for rnd in range(max(2, reps // 2)):
        for k in cold:
            C.make_cold(files)
            t = time.perf_counter()
            out = fns[k]()
            cold[k].append(time.perf_counter() - t)
            del out
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in times.items()}
    cmed = {k: float(np.median(v)) for k, v in cold.items()}
    return {"shape": shape_name, "tokens": tokens, "bytes": nbytes,
            "warm_ms": {k: v * 1e3 for k, v in med.items()},
            "warm_ratio_vs_raw": {k: med["raw_read"] / med[k] for k in ("before", "after")},
            "cold_ms": {k: v * 1e3 for k, v in cmed.items()},
            "speedup_warm": med["before"] / med["after"], "speedup_cold": cmed["before"] / cmed["after"]}


def _scheduled_views(self, layer, n):
    """`KVCodec.slices` saying no: `insert` then takes lazy mlx views and schedules them with
    `mx.async_eval` (the insert before numpy views)."""
    return None


def insert(tokens: int, idle: int, busy: int) -> dict:
    out = {}
    plain = codecs.KVCodec.slices
    for rnd in range(2):  # before, after, before, after: both see the same spells of machine load
        for label, patch in (("before", True), ("after", False)):
            if patch:
                codecs.KVCodec.slices = _scheduled_views
            try:
                got = write_path.insert_latency(tokens, idle, busy)
            finally:
                codecs.KVCodec.slices = plain
            for mode in ("idle", "busy"):
                out.setdefault(label, {}).setdefault(mode, []).extend(got[f"{mode}_samples"])
    summary = {label: {mode: _ms(samples) for mode, samples in modes.items()} for label, modes in out.items()}
    return {"tokens": tokens, "change": "numpy views", **summary}


def _ms(samples: list[float]) -> dict:
    s = C.summary(samples)
    return {"p50_ms": s["p50"] * 1e3, "p99_ms": s["p99"] * 1e3, "n": s["n"]}


def index(rows: int, lookups: int) -> dict:
    out = {}
    for label in ("before", "after"):
        work = C.scratch_dir(f"ba-index-{label}")
        path = work / "store"
        path.mkdir(mode=0o700)
        if label == "before":  # an index file made with 4 KiB pages, as stores before schema 4 were
            con = sqlite3.connect(path / "index.sqlite")
            con.execute("PRAGMA page_size = 4096")
            con.execute("PRAGMA journal_mode = WAL")
            con.execute("CREATE TABLE _made(x)")
            con.execute("DROP TABLE _made")
            con.close()
        store = kvstore.open(path, memory_bytes=0)
        mc = store.bind(index_scale.SHAPE.model(), "bench-shape", fingerprint=FINGERPRINT)
        rng = np.random.default_rng(rows)
        store.index.conn.execute("PRAGMA synchronous = OFF")  # building only
        prompt = C.random_tokens(index_scale.PROMPT_CHUNKS * index_scale.CHUNK_TOKENS, seed=rows)
        index_scale.insert_prompt(store, mc.ns, prompt, rng)
        index_scale.synthesise(store.index, mc.ns, rows - index_scale.PROMPT_CHUNKS, rng)
        store.close()
        store = kvstore.open(path, memory_bytes=0)
        mc = store.bind(index_scale.SHAPE.model(), "bench-shape", fingerprint=FINGERPRINT)
        page = store.index.conn.execute("PRAGMA page_size").fetchone()[0]
        hit = np.concatenate([prompt, [5]]).astype(np.int32)
        assert mc.stored_length(hit) == len(prompt)
        s = C.summary(C.measure(lambda: mc.stored_length(hit), lookups, warmup=5))
        store.close()
        out[label] = {"page_size": page, "lookup_p50_ms": s["p50"] * 1e3, "lookup_p99_ms": s["p99"] * 1e3,
                      "index_bytes": index_scale.index_bytes(path)}
        shutil.rmtree(work, ignore_errors=True)
    return {"rows": rows, **out}


def run(quick: bool = False) -> dict:
    restores = []
    if hasattr(modelcache.ModelCache, "_direct"):  # the 0.1 switch; one restore pipeline has none
        restores.append(restore("qwen3-0.6b", 2048, 3 if quick else 5))
        if not quick:
            restores.append(restore("llama-3-8b", 4096, 4))
    else:
        C.log("[before/after] restore skipped: ModelCache has no `_direct` switch any more (bench/restore.py "
              "measures the restore path)")
    for r in restores:
        C.log(f"[before/after] restore {r['shape']} {r['tokens']}: warm {r['warm_ms']['before']:.0f} -> "
              f"{r['warm_ms']['after']:.0f} ms ({r['speedup_warm']:.1f}x), cold {r['cold_ms']['before']:.0f} -> "
              f"{r['cold_ms']['after']:.0f} ms")
    ins = insert(4096, 10 if quick else 20, 10 if quick else 20)
    C.log(f"[before/after] insert 4k, writer busy: p50/p99 {ins['before']['busy']['p50_ms']:.2f}/"
          f"{ins['before']['busy']['p99_ms']:.2f} -> {ins['after']['busy']['p50_ms']:.2f}/"
          f"{ins['after']['busy']['p99_ms']:.2f} ms")
    ix = index(20_000 if quick else 100_000, 300)
    C.log(f"[before/after] index {ix['rows']} rows: lookup p99 {ix['before']['lookup_p99_ms']:.2f} -> "
          f"{ix['after']['lookup_p99_ms']:.2f} ms, {ix['before']['index_bytes'] / 1e6:.0f} -> "
          f"{ix['after']['index_bytes'] / 1e6:.0f} MB")
    return {"machine": C.machine(), "quick": quick, "restore": restores, "insert": ins, "index": ix}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    args = ap.parse_args()
    C.log_machine("before_after")
    print(C.write_result("before_after", run(args.quick)))


if __name__ == "__main__":
    main()
