"""The methods `bench/restore.py` times, each run in a process of its own (restore, free, repeat).

    python bench/restore_methods.py SPEC.json OUT.json    # started by bench/restore.py

SPEC names the method (or "shared" and a list of `methods`: all of them in this one process,
interleaved), the cache shape, the files `restore.py` prepared (a kvstore store holding
one sequence, the same cache in one `save_prompt_cache` file, its token ids) and the repetitions.
Every call is timed alone, with the page faults it took (getrusage: every thread of the process);
what it returns is freed (and garbage-collected) untimed before the next call. kvstore is used only
through its public API (`kvstore.open`, `bind`, `insert`, `flush`, `fetch`), so this measures
whatever restore code is installed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


def _mlx_lm_models_only() -> None:
    """Make `mlx_lm.models.*` importable without running `mlx_lm/__init__.py`, which imports
    `mlx_lm.generate` and transformers (about 1.5 s of CPU a process, before anything is timed).
    A worker uses only mlx-lm's cache classes and kvstore's restore path; no call it times
    touches what this skips. Only in the benchmark's own processes (`_light_process`), never when
    another script imports this module."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return  # not a package as expected: the plain import below says what is wrong
    pkg = types.ModuleType("mlx_lm")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__, pkg.__file__, pkg.__package__ = spec, spec.origin, "mlx_lm"
    sys.modules["mlx_lm"] = pkg
    from mlx_lm._version import __version__

    pkg.__version__ = __version__


def _light_process() -> bool:
    """A worker (this file run as a script), or the process of `bench/restore.py` itself (which
    imports this module first), where the same holds: mlx-lm's cache code is all it uses."""
    main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return __name__ == "__main__" or os.path.abspath(main) == os.path.join(os.path.dirname(__file__), "restore.py")


if "mlx_lm" not in sys.modules and _light_process():
    _mlx_lm_models_only()

import common as C  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache, LRUPromptCache, load_prompt_cache  # noqa: E402

FINGERPRINT = b"kvstore-bench-fp"
MODEL_ID = "bench-shape"
NEXT_TOKEN = 7  # the query is the stored tokens plus this one: every stored token is reusable


@dataclass
class Ctx:
    """What a method's setup gets: the prepared files and a few helpers."""

    shape: C.Shape
    tokens: int
    work: Path
    store: Path
    one_file: Path
    toks: np.ndarray
    files: list[Path] = field(default_factory=list)
    checks: dict = field(default_factory=dict)

    @property
    def query(self) -> np.ndarray:
        return np.concatenate([self.toks, [NEXT_TOKEN]]).astype(np.int32)

    def step_inputs(self) -> tuple[mx.array, mx.array]:
        one = mx.zeros((1, self.shape.kv_heads, 1, self.shape.head_dim), mx.bfloat16)
        mx.eval(one)
        return one, one


@dataclass
class Method:
    """`call` is timed; `before` runs untimed ahead of each call; `check` once on a result; `after_all` last."""

    call: Callable[[], object]
    before: Callable[[], object] | None = None
    check: Callable[[object], None] | None = None
    cold: bool = False
    after_all: Callable[[], None] | None = None


# -- the pieces every method is made of ---------------------------------------------------------

def first_step(cache: list, k1: mx.array, v1: mx.array) -> list:
    """One token through every layer's `update_and_fetch`, evaluated: what generation does next."""
    out = []
    for layer in cache:
        out += list(layer.update_and_fetch(k1, v1))
    mx.eval(out + [a for layer in cache for a in (layer.keys, layer.values)])
    return cache


def reference(ctx: Ctx) -> tuple[list[np.ndarray], int]:
    """K and V of the first and last layer as numpy (to check restores against), and the layer count."""
    loaded = load_prompt_cache(str(ctx.one_file))
    ref = [np.array(a.view(mx.uint16)) for c in (loaded[0], loaded[-1]) for a in (c.keys, c.values)]
    return ref, len(loaded)


def restore_checker(ctx: Ctx) -> Callable[[object], None]:
    """Checks a restored cache: every token reused, the same K/V bits, and records its capacity."""
    ref, layers = reference(ctx)
    n = ctx.tokens

    def check(result) -> None:
        cache, rest = result
        if list(rest) != [NEXT_TOKEN]:
            raise AssertionError(f"not every stored token was reused: {len(rest)} tokens left, expected 1")
        if len(cache) != layers:
            raise AssertionError(f"restored {len(cache)} layers, expected {layers}")
        got = [np.array(a[..., :n, :].view(mx.uint16)) for c in (cache[0], cache[-1]) for a in (c.keys, c.values)]
        if not all(np.array_equal(g, r) for g, r in zip(got, ref)):
            raise AssertionError("restored K/V differ from what was inserted")
        ctx.checks["offset"] = int(cache[0].offset)
        ctx.checks["capacity_tokens"] = int(cache[0].keys.shape[2])

    return check


def stepped_capacity(ctx: Ctx) -> Callable[[object], None]:
    """After a first step: did it reallocate? (its capacity changed; `with_capacity_probe` saw the one before)"""
    def check(cache) -> None:
        ctx.checks["capacity_after_step"] = int(cache[0].keys.shape[2])
        before = ctx.checks.get("capacity_before_step")
        if before is not None:
            ctx.checks["first_step_reallocates"] = before != ctx.checks["capacity_after_step"]
    return check


def with_capacity_probe(ctx: Ctx, restore: Callable[[], list]) -> Callable[[], list]:
    """`restore` whose first result's capacity is recorded once (untimed cost: one attribute read)."""
    def probed() -> list:
        cache = restore()
        if "capacity_before_step" not in ctx.checks and cache and getattr(cache[0], "keys", None) is not None:
            ctx.checks["capacity_before_step"] = int(cache[0].keys.shape[2])
        return cache
    return probed


def open_bound(path: Path, ctx: Ctx, memory_bytes: int):
    import kvstore

    store = kvstore.open(path, memory_bytes=memory_bytes)
    return store, store.bind(ctx.shape.model(), MODEL_ID, fingerprint=FINGERPRINT)


# -- baselines ------------------------------------------------------------------------------------

def bytes_checker(ctx: Ctx, offsets: list[int], buffer_of: Callable[[object], object]) -> Callable[[object], None]:
    """Checks that a raw read put every file's bytes where they belong (a baseline must do the work)."""
    def check(out) -> None:
        view = memoryview(buffer_of(out)).cast("B")
        for path, at in zip(ctx.files, offsets):
            data = path.read_bytes()
            if view[at : at + len(data)] != data:
                raise AssertionError(f"the raw read did not put {path.name} at offset {at}")
        ctx.checks["bytes_checked"] = True
    return check


def raw_read_aligned(ctx: Ctx, threads: int) -> Method:
    offsets, total = C.file_offsets(ctx.files)
    buf = C.aligned_buffer(total)  # faulted in once, here: no page faults while timed
    check = bytes_checker(ctx, offsets, lambda _: buf)
    C.warm(ctx.files)
    if threads == 1:
        return Method(lambda: C.read_files(ctx.files, buf, offsets), check=check)
    groups = C.split_by_bytes(ctx.files, threads)
    pool = ThreadPoolExecutor(threads)

    def read_group(g: list[int]) -> int:
        return C.read_files([ctx.files[i] for i in g], buf, [offsets[i] for i in g])

    return Method(lambda: sum(pool.map(read_group, groups)), check=check)


def raw_read_new_memory(ctx: Ctx) -> Method:
    offsets, total = C.file_offsets(ctx.files)
    C.warm(ctx.files)

    def call():
        out = np.empty(total, dtype=np.uint8)  # fresh memory, faulted in by the read (numpy asks for huge pages)
        C.read_files(ctx.files, out)
        return out

    return Method(call, check=bytes_checker(ctx, offsets, lambda out: out))


def buffered_cold_read(ctx: Ctx) -> Method:
    offsets, total = C.file_offsets(ctx.files)
    buf = C.aligned_buffer(total)
    return Method(lambda: C.read_files(ctx.files, buf, offsets), before=cold_before(ctx),
                  check=bytes_checker(ctx, offsets, lambda _: buf), cold=True)


def cold_before(ctx: Ctx) -> Callable[[], None]:
    hows = ctx.checks.setdefault("cold_method", [])

    def before() -> None:
        how = C.make_cold(ctx.files)
        if how not in hows:
            hows.append(how)
    return before


def load_prompt_cache_only(ctx: Ctx) -> Method:
    C.warm([ctx.one_file])
    return Method(lambda: C.eval_cache(load_prompt_cache(str(ctx.one_file))))


def load_prompt_cache_step(ctx: Ctx) -> Method:
    C.warm([ctx.one_file])
    k1, v1 = ctx.step_inputs()
    load = with_capacity_probe(ctx, lambda: load_prompt_cache(str(ctx.one_file)))
    return Method(lambda: first_step(load(), k1, v1), check=stepped_capacity(ctx))


def lru_step(ctx: Ctx) -> Method:
    """Stock `mlx_lm.server`'s cache, holding the cache as prefill leaves it (capacity in 256-token steps)."""
    cache = []
    for c in load_prompt_cache(str(ctx.one_file)):
        layer = KVCache()
        layer.update_and_fetch(c.keys, c.values)
        cache.append(layer)
    C.eval_cache(cache)
    lru = LRUPromptCache(max_size=4)
    lru.insert_cache(MODEL_ID, ctx.toks.tolist(), cache)
    query = ctx.query.tolist()
    k1, v1 = ctx.step_inputs()

    def fetch() -> list:
        got, rest = lru.fetch_nearest_cache(MODEL_ID, query)
        if got is None or list(rest) != [NEXT_TOKEN]:
            raise AssertionError(f"LRUPromptCache did not reuse every token ({len(rest)} left)")
        return got

    fetch = with_capacity_probe(ctx, fetch)
    return Method(lambda: first_step(fetch(), k1, v1), check=stepped_capacity(ctx))


# -- kvstore --------------------------------------------------------------------------------------

def kvstore_disk(ctx: Ctx, *, cold: bool = False, step: bool = False) -> Method:
    _, mc = open_bound(ctx.store, ctx, memory_bytes=0)  # memory tier off: every fetch reads the disk
    query = ctx.query
    C.warm(ctx.files)
    return _kvstore_method(ctx, mc, query, step, before=cold_before(ctx) if cold else None, cold=cold)


def kvstore_memory(ctx: Ctx, *, step: bool = False) -> Method:
    """A repeated prompt from RAM: a fresh store with a memory tier, the cache inserted, fetched once."""
    path = ctx.work / f"memory-store-{os.getpid()}{'-step' if step else ''}"  # two in a shared process
    shutil.rmtree(path, ignore_errors=True)
    kv_bytes = ctx.shape.bytes_per_token * ctx.tokens
    store, mc = open_bound(path, ctx, memory_bytes=3 * kv_bytes + (64 << 20))
    source = load_prompt_cache(str(ctx.one_file))
    mc.insert(ctx.toks, source)
    store.flush()
    del source
    query = ctx.query
    mc.fetch(query)  # whatever the tier keeps after an insert and a first fetch
    gc.collect()
    files = C.blob_files(path)
    ctx.checks["memory_store_files"] = len(files)
    evicted = C.make_cold(files)  # any fetch that reads the disk now shows up in the page cache
    method = _kvstore_method(ctx, mc, query, step)

    def after_all() -> None:
        ctx.checks["served_from_memory"] = C.resident_fraction(files) == 0.0 if evicted else None
        store.close()
        shutil.rmtree(path, ignore_errors=True)

    method.after_all = after_all
    return method


def _kvstore_method(ctx: Ctx, mc, query, step: bool, before=None, cold: bool = False) -> Method:
    check = restore_checker(ctx)
    if not step:
        def restore():
            cache, rest = mc.fetch(query)
            C.eval_cache(cache)
            return cache, rest
        return Method(restore, before=before, check=check, cold=cold)
    k1, v1 = ctx.step_inputs()

    def fetch() -> list:
        cache, rest = mc.fetch(query)
        if list(rest) != [NEXT_TOKEN]:
            raise AssertionError(f"kvstore did not reuse every token ({len(rest)} left)")
        return cache

    step_check = stepped_capacity(ctx)

    def check_both(cache) -> None:
        step_check(cache)
        check(mc.fetch(query))  # the bits, on a fetch of its own: the timed call is fetch + first step

    fetch = with_capacity_probe(ctx, fetch)
    return Method(lambda: first_step(fetch(), k1, v1), before=before, check=check_both, cold=cold)


# name -> (what it is, how to build it). bench/restore.py runs them in this order.
METHODS: dict[str, tuple[str, Callable[[Ctx], Method]]] = {
    "raw_read_aligned_1t": ("raw read of the blob files into a reused page-aligned buffer, 1 thread",
                            lambda c: raw_read_aligned(c, 1)),
    "raw_read_aligned_2t": ("the same, 2 threads (files split by bytes)", lambda c: raw_read_aligned(c, 2)),
    "raw_read_new_memory": ("raw read into new memory (`np.empty` each call), 1 thread", raw_read_new_memory),
    "buffered_cold_read": ("buffered read of the blob files, evicted from the page cache before each call",
                           buffered_cold_read),
    "load_prompt_cache": ("mlx-lm `load_prompt_cache` of the same cache in one file, evaluated",
                          load_prompt_cache_only),
    "load_prompt_cache_first_step": ("`load_prompt_cache` + first step", load_prompt_cache_step),
    "lru_fetch_first_step": ("`LRUPromptCache.fetch_nearest_cache` + first step (stock `mlx_lm.server`)", lru_step),
    "kvstore_restore_warm": ("kvstore `fetch` from disk, page cache warm, memory tier off", kvstore_disk),
    "kvstore_restore_cold": ("kvstore `fetch` from disk, blob files evicted before each call",
                             lambda c: kvstore_disk(c, cold=True)),
    "kvstore_restore_first_step": ("kvstore `fetch` from disk (warm) + first step",
                                   lambda c: kvstore_disk(c, step=True)),
    "kvstore_memory": ("kvstore `fetch` from the memory tier", kvstore_memory),
    "kvstore_memory_first_step": ("kvstore `fetch` from the memory tier + first step",
                                  lambda c: kvstore_memory(c, step=True)),
}


def make_ctx(spec: dict) -> Ctx:
    sh = spec["shape"]
    ctx = Ctx(shape=C.Shape(sh["name"], sh["layers"], sh["kv_heads"], sh["head_dim"]), tokens=spec["tokens"],
              work=Path(spec["work"]), store=Path(spec["store"]), one_file=Path(spec["one_file"]),
              toks=np.load(spec["tokens_file"]))
    ctx.files = C.blob_files(ctx.store)
    return ctx


def one_call(method: Method, check: bool) -> tuple[float, int, int, float]:
    """One timed call: (seconds, minor faults, major faults, CPU seconds); what it returns is
    checked (`check`) and freed, untimed."""
    if method.before:
        method.before()
    gc.collect()
    f0 = C.page_faults()
    c0 = C.cpu_seconds()
    t = time.perf_counter()
    out = method.call()
    dt = time.perf_counter() - t
    c1 = C.cpu_seconds()
    f1 = C.page_faults()
    if check and method.check:
        method.check(out)
    del out  # free, untimed, before the next call
    gc.collect()
    return dt, f1[0] - f0[0], f1[1] - f0[1], c1 - c0


def run(spec: dict) -> dict:
    """One method in this process (spec["method"]), or every method of spec["methods"] in this
    one process, interleaved call by call (the order reversed every other round), as a server
    runs them: they share mlx's buffer cache. Cold calls are followed by warming the files again."""
    names = spec["methods"] if spec.get("method") == "shared" else [spec["method"]]
    built, ctxs, setup = {}, {}, {}
    for name in names:
        ctx = ctxs[name] = make_ctx(spec)
        t0 = time.perf_counter()
        built[name] = METHODS[name][1](ctx)
        setup[name] = time.perf_counter() - t0
    rows = {name: {"samples_s": [], "minflt": [], "majflt": [], "cpu_s": []} for name in names}
    for i in range(spec["warmup"] + spec["reps"]):
        for name in (names if i % 2 == 0 else names[::-1]):
            method = built[name]
            dt, minor, major, cpu = one_call(method, check=i == 0)
            if method.cold and len(names) > 1:
                C.warm(ctxs[name].files)  # the next method finds the page cache as it expects
            if i >= spec["warmup"]:
                row = rows[name]
                row["samples_s"].append(dt)
                row["minflt"].append(minor)
                row["majflt"].append(major)
                row["cpu_s"].append(cpu)
    for name in names:
        if built[name].after_all:
            built[name].after_all()
    out = {name: dict(rows[name], method=name, setup_s=setup[name], checks=ctxs[name].checks,
                      cold=built[name].cold) for name in names}
    return out[names[0]] if len(names) == 1 and spec.get("method") != "shared" else {"method": "shared", "runs": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", type=Path, help="the JSON spec bench/restore.py wrote")
    ap.add_argument("out", help="where the results go (JSON)")
    args = ap.parse_args()
    result = run(json.loads(args.spec.read_text()))
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
