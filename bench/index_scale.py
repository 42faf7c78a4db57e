"""Index-scale benchmark: lookups, open and gc with 10k, 100k and 1M chunk rows.

Rows are synthesised through the index layer (`kvstore.storage.index.Index.insert`, real `Row`s); their
blob files do not exist, unless `--files`: then every row gets an empty file where its blob would be,
so that gc pays for the unlinks a real store's gc makes (one per record). The rows form a realistic forest: groups of prompts that share an
8-chunk system prompt and branch into chains of 1 to 120 chunks, spread over four model
namespaces, plus one real 32k-token prompt of the bound model (128 chunks, hashed by
`kvstore.keys`), so lookups walk real chains and hit.

Measured per size: `ModelCache.stored_length` of a 32k-token prompt (the fetch lookup: chain
hashes, one `present` query, the children of the deepest match) p50/p99, for a full hit and for a
prompt that branches off inside chunk 100; time to open the store (`kvstore.open` + `bind`), in
this process and in a fresh one with the index evicted from the page cache; the index size on
disk; and `gc` down to half the bytes, while another process fetches (the lookup of the 32k-token
prompt) and inserts (a small record through the store's writer, waiting until it is durable) in a
loop: the longest each of them took during gc, next to the same before gc started.

    python bench/index_scale.py [--quick] [--rows 10000 100000] [--files]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import common as C
import numpy as np

import kvstore
from kvstore import keys
from kvstore.records import CHUNK, TAIL
from kvstore.storage import blobtree, blobwrite
from kvstore.storage.index import Row

FINGERPRINT = b"kvstore-bench-ix"
SHAPE = C.SHAPES["qwen3-0.6b"]
CHUNK_TOKENS = 256
PROMPT_CHUNKS = 128  # 32k tokens
RECORD_BYTES = CHUNK_TOKENS * SHAPE.bytes_per_token + 6000  # a chunk blob of this shape, with header
BATCH = 20_000


def synthesise(index, ns: bytes, total: int, rng: np.random.Generator) -> int:
    """Insert about `total` filler rows (a forest of shared prefixes and branches). Returns how many."""
    namespaces = [ns] + [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(3)]
    done = 0
    batch: list[Row] = []
    while done < total:
        group_ns = namespaces[int(rng.integers(0, len(namespaces)))]
        parent = group_ns
        system = []
        for depth in range(1, 9):  # the group's shared system prompt
            h = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
            system.append((h, depth))
            batch.append(_row(h, group_ns, parent, depth, CHUNK, rng))
            parent = h
        done += 8
        for _ in range(int(rng.integers(2, 40))):  # branches of random depth, some with a tail
            parent, depth = system[-1]
            for _ in range(int(rng.integers(1, 120))):
                depth += 1
                h = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
                batch.append(_row(h, group_ns, parent, depth, CHUNK, rng))
                parent = h
                done += 1
            if rng.random() < 0.5:
                h = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
                batch.append(_row(h, group_ns, parent, depth + 1, TAIL, rng, ntokens=int(rng.integers(1, 256))))
                done += 1
            if done >= total:
                break
        if len(batch) >= BATCH:
            index.insert(batch)
            batch = []
    if batch:
        index.insert(batch)
    return done


def _row(h, ns, parent, depth, kind, rng, ntokens=CHUNK_TOKENS, size=None) -> Row:
    if size is None:
        size = (ntokens * SHAPE.bytes_per_token + 6000) if kind == TAIL else RECORD_BYTES
    return Row(h, ns, parent, depth, kind, ntokens, int(rng.integers(0, 150_000)), size,
               int(rng.integers(0, 1 << 63)))


def insert_prompt(store, ns: bytes, prompt: np.ndarray, rng) -> None:
    """The 32k-token prompt's rows, each with a blob file that holds its token ids only (a lookup
    that branches inside a chunk reads the ids of that chunk's stored child from its blob)."""
    hashes = keys.chain(ns, prompt, CHUNK_TOKENS)
    rows = []
    for i, h in enumerate(hashes):
        toks = np.ascontiguousarray(prompt[i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS], dtype="<i4")
        parent = hashes[i - 1] if i else ns
        meta = {"hash": h.hex(), "ns": ns.hex(), "parent": parent.hex(), "depth": str(i + 1), "kind": str(CHUNK)}
        size, checksum = blobwrite.write(store.blob_root, h, {"tokens": ("I32", toks)}, meta, fsync=False)
        rows.append(Row(h, ns, parent, i + 1, CHUNK, CHUNK_TOKENS, int(toks[0]), size, checksum))
    store.index.insert(rows)


def touch_blobs(store) -> int:
    """An empty file at the blob path of every row that has none (`--files`). Returns how many."""
    made, folders = 0, set()
    for (h,) in store.index.conn.execute("SELECT hash FROM records"):
        path = blobtree.blob_path(store.blob_root, h)
        if path.parent not in folders:
            path.parent.mkdir(parents=True, exist_ok=True)
            folders.add(path.parent)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            made += 1
        except FileExistsError:
            pass
    return made


def index_bytes(path) -> int:
    return sum(os.path.getsize(path / n) for n in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm")
               if (path / n).exists())


_OPEN_CHILD = """
import json, sys, time
sys.path.insert(0, {bench!r})
import common as C
import kvstore
import kvstore.store  # the library itself, imported before the clock starts: opening is what is timed
t = time.perf_counter()
store = kvstore.open({path!r}, memory_bytes=0)
mc = store.bind(C.SHAPES[{shape!r}].model(), "bench-shape", fingerprint={fp!r})
opened = time.perf_counter() - t
t = time.perf_counter()
n = mc.stored_length(__import__("numpy").load({query!r}))
first = time.perf_counter() - t
store.close()
print(json.dumps({{"open_s": opened, "first_lookup_s": first, "stored": n}}))
"""


_CLIENT = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
import common as C
import kvstore
stop = Path({stop!r})
store = kvstore.open({path!r}, memory_bytes=0)
mc = store.bind(C.SHAPES[{shape!r}].model(), "bench-shape", fingerprint={fp!r})
small = C.ShapeModel(2, 1, 64)  # inserts of small records, under a namespace of their own
ins = store.bind(small, "bench-small", fingerprint=b"kvstore-bench-sm")
query = np.load({query!r})
fetches, inserts = [], []
print("ready", flush=True)
i = 0
while not stop.exists():
    t = time.time(); mc.stored_length(query); fetches.append((t, time.time() - t))
    toks = np.random.default_rng(i).integers(0, 150_000, 40).astype(np.int32)
    cache = make_prompt_cache(small)
    small(mx.array(toks[None]), cache=cache)
    C.eval_cache(cache)
    t = time.time(); ins.insert(toks, cache); store.flush(); inserts.append((t, time.time() - t))
    i += 1
    time.sleep(0.005)
store.close()
print(json.dumps({{"fetch": fetches, "insert": inserts}}))
"""


def gc_with_clients(path, work, query_file) -> dict:
    """gc down to half the bytes while another process fetches and inserts in a loop."""
    stop = work / "stop"
    code = _CLIENT.format(bench=str(C.HERE), path=str(path), shape=SHAPE.name, fp=FINGERPRINT,
                          query=str(query_file), stop=str(stop))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(3)  # the client's timings before gc
        store = kvstore.open(path, memory_bytes=0)
        before = store.stats()
        started = time.time()
        t = time.perf_counter()
        result = store.gc(max_bytes=before["bytes"] // 2)
        took = time.perf_counter() - t
        ended = time.time()
        store.close()
        time.sleep(1)
        stop.touch()
        out, _ = child.communicate(timeout=600)
    finally:
        if child.poll() is None:
            child.kill()
    got = json.loads(out.strip().splitlines()[-1])
    res = {"gc_half_s": took, "gc_plan_s": result["plan_seconds"], "gc_evicted": result["evicted"],
           "gc_longest_transaction_ms": result["longest_transaction_seconds"] * 1e3,
           "gc_bytes_before": before["bytes"], "gc_bytes_after": result["bytes"]}
    for op in ("fetch", "insert"):
        during = [d for t, d in got[op] if started <= t + d and t <= ended]
        calm = [d for t, d in got[op] if t + d < started]
        res[f"{op}_during_gc"] = {"n": len(during), "max_ms": max(during, default=0) * 1e3,
                                  "p99_ms": C.percentile(during, 99) * 1e3 if during else 0.0}
        res[f"{op}_before_gc"] = {"n": len(calm), "max_ms": max(calm, default=0) * 1e3}
    return res


def run_one(rows: int, lookups: int, files: bool = False) -> dict:
    C.log(f"[index] {rows} rows: synthesising")
    rng = np.random.default_rng(rows)
    work = C.scratch_dir(f"index-{rows}")
    path = work / "store"
    model = SHAPE.model()
    store = kvstore.open(path, memory_bytes=0)
    mc = store.bind(model, "bench-shape", fingerprint=FINGERPRINT)
    t = time.perf_counter()
    # Building only (not measured): a bigger page cache and no fsync for this connection.
    store.index.conn.execute("PRAGMA cache_size = -262144")
    store.index.conn.execute("PRAGMA synchronous = OFF")
    prompt = C.random_tokens(PROMPT_CHUNKS * CHUNK_TOKENS, seed=rows)
    insert_prompt(store, mc.ns, prompt, rng)
    filler = synthesise(store.index, mc.ns, rows - PROMPT_CHUNKS, rng)
    build_s = time.perf_counter() - t
    blob_files = touch_blobs(store) if files else 0
    total_rows = store.stats()["chunks"] + store.stats()["tails"]
    # A store that grew over time has had its WAL checkpointed into the main file; lookups are
    # measured in that steady state, with the index in the OS page cache (cold open is below).
    store.index.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()  # measure with the store as anyone opens it
    C.warm([f for f in (path / "index.sqlite", path / "index.sqlite-wal") if f.exists()])
    store = kvstore.open(path, memory_bytes=0)
    mc = store.bind(model, "bench-shape", fingerprint=FINGERPRINT)

    hit = np.concatenate([prompt, [5]]).astype(np.int32)
    branch = prompt.copy()
    cut = 99 * CHUNK_TOKENS + 37
    branch[cut:] = C.random_tokens(len(prompt) - cut, seed=rows + 1)
    assert mc.stored_length(hit) == len(prompt), "the 32k-token prompt is not found"
    assert mc.stored_length(branch) == cut, "the branching prompt does not stop where it branches"
    out = {"rows": total_rows, "filler_rows": filler, "build_s": build_s, "empty_blob_files": blob_files,
           "load_at_start": os.getloadavg()}
    for name, query in (("lookup_hit", hit), ("lookup_branch", branch)):
        s = C.summary(C.measure(lambda: mc.stored_length(query), lookups, warmup=5))
        out[name] = {"p50_ms": s["p50"] * 1e3, "p99_ms": s["p99"] * 1e3, "n": s["n"]}
    store.close()

    # open + bind, warm (this process, index pages cached) and cold (a fresh process, evicted)
    def reopen():
        s = kvstore.open(path, memory_bytes=0)
        s.bind(model, "bench-shape", fingerprint=FINGERPRINT)
        s.close()
    warm = C.summary(C.measure(reopen, 5))
    files = [f for f in (path / "index.sqlite", path / "index.sqlite-wal") if f.exists()]
    query_file = work / "query.npy"
    np.save(query_file, hit)
    cold_runs = []
    for _ in range(3):
        evicted = C.make_cold(files)
        code = _OPEN_CHILD.format(bench=str(C.HERE), path=str(path), shape=SHAPE.name,
                                  fp=FINGERPRINT, query=str(query_file))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"the open child failed: {res.stderr[-2000:]}")
        got = json.loads(res.stdout.strip().splitlines()[-1])
        got["evicted"] = evicted
        cold_runs.append(got)
    out["open_warm_ms"] = warm["median"] * 1e3
    out["open_cold_ms"] = float(np.median([r["open_s"] for r in cold_runs])) * 1e3
    out["first_lookup_cold_ms"] = float(np.median([r["first_lookup_s"] for r in cold_runs])) * 1e3
    out["cold_evicted_with"] = cold_runs[0]["evicted"] or "could not evict"
    out["index_bytes"] = index_bytes(path)

    # gc down to half the bytes: alone (on a copy), then with a client in another process
    alone = work / "alone"
    shutil.copytree(path, alone)
    store = kvstore.open(alone, memory_bytes=0)
    t = time.perf_counter()
    result = store.gc(max_bytes=store.stats()["bytes"] // 2)
    out["gc_alone_s"] = time.perf_counter() - t
    out["gc_alone_longest_transaction_ms"] = result["longest_transaction_seconds"] * 1e3
    out["gc_alone_plan_s"] = result["plan_seconds"]
    out["load_after_gc_alone"] = os.getloadavg()
    store.close()
    shutil.rmtree(alone)
    out.update(gc_with_clients(path, work, query_file))
    out["index_bytes_after_gc"] = index_bytes(path)
    shutil.rmtree(work, ignore_errors=True)
    C.log(f"[index] {total_rows} rows: lookup p99 {out['lookup_hit']['p99_ms']:.2f} ms (hit), "
          f"{out['lookup_branch']['p99_ms']:.2f} ms (branch); open {out['open_warm_ms']:.1f} ms warm, "
          f"{out['open_cold_ms']:.1f} ms cold; index {out['index_bytes'] / 1e6:.0f} MB; "
          f"gc half alone {out['gc_alone_s']:.1f} s; with a client {out['gc_half_s']:.1f} s ({out['gc_evicted']} rows, longest transaction "
          f"{out['gc_longest_transaction_ms']:.0f} ms); during gc another process's fetch took at most "
          f"{out['fetch_during_gc']['max_ms']:.1f} ms, its insert {out['insert_during_gc']['max_ms']:.1f} ms "
          f"(before gc: {out['fetch_before_gc']['max_ms']:.1f} / {out['insert_before_gc']['max_ms']:.1f} ms)")
    return out


def run(quick: bool = False, sizes=None, files: bool = False) -> dict:
    sizes = sizes or ([10_000, 100_000] if quick else [10_000, 100_000, 1_000_000])
    results = [run_one(n, 200 if n < 1_000_000 else 300, files) for n in sizes]
    return {"machine": C.machine(), "quick": quick, "files": files, "chunk_tokens": CHUNK_TOKENS,
            "kvstore": os.path.dirname(os.path.dirname(kvstore.__file__)),
            "prompt_tokens": PROMPT_CHUNKS * CHUNK_TOKENS, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10k and 100k rows only")
    ap.add_argument("--rows", type=C.positive_int, nargs="*", help="index sizes to run")
    ap.add_argument("--files", action="store_true", help="an empty blob file for every row, which gc unlinks")
    args = ap.parse_args()
    C.log_machine("index")
    print(C.write_result("index_scale" + ("_files" if args.files else ""), run(args.quick, args.rows, args.files)))


if __name__ == "__main__":
    main()
