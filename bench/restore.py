"""Restore benchmark: kvstore `fetch` against raw reads of the same bytes and against mlx-lm.

    PYTHONPATH=. python bench/restore.py            # the full run (about 10 minutes on 2 cores)
    PYTHONPATH=. python bench/restore.py --quick    # one small cache, few repetitions: < 1 minute

For caches shaped like Qwen3-0.6B's (2k and 8k tokens) and Llama-3-8B's (4k tokens) K/V, random
bfloat16 in mlx-lm `KVCache`s, inserted through `store.bind(...).insert` of a stand-in model, every
method of `restore_methods.METHODS` runs twice: all of them in one process, interleaved call by call
(the headline: a server is one process, and every restore there shares mlx's buffer cache), and
each in a process of its own (restore, free, repeat; page faults per call from getrusage). In the
full run both are done twice, the second round in reverse order, so drifting machine load touches
every method alike. The CPU, BLAS and load average are printed beside the table. Medians; every
ratio is of two methods of the same run (baseline time / kvstore time: above 1, kvstore is faster).

Writes bench/results/restore.json and restore.md, then bench/README.md (bench/report.py) unless
`--out` or `--no-report` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# First: in this process too, it imports mlx-lm's cache code without mlx_lm/__init__ (transformers).
from restore_methods import FINGERPRINT, METHODS, MODEL_ID

# isort: split
import common as C
import numpy as np

FULL = [("qwen3-0.6b", 2048), ("qwen3-0.6b", 8192), ("llama-3-8b", 4096)]
QUICK = [("qwen3-0.6b", 1024)]
SHAPES = {**C.SHAPES, "tiny": C.Shape("tiny", layers=2, kv_heads=2, head_dim=32)}  # tiny: the smoke test
WORKER = C.HERE / "restore_methods.py"
WORKER_TIMEOUT_S = 1800

# (key, what, kvstore method, baseline methods (the fastest counts), ratio needed, ratio needed at 32k
# tokens or more). Judged in the shared process (every method in one process, as in a server).
TARGETS = [
    ("warm", "restore from disk, warm >= 0.9x a raw read (1 thread, into faulted memory of its own; 0.8x at 32k)",
     "kvstore_restore_warm", ("raw_read_aligned_1t",), 0.9, 0.8),
    ("alone", "restore from disk >= 1.0x mlx-lm `load_prompt_cache` alone", "kvstore_restore_warm",
     ("load_prompt_cache",), 1.0, 1.0),
    ("cold", "restore from disk, cold >= 1.0x a buffered cold read", "kvstore_restore_cold",
     ("buffered_cold_read",), 1.0, 1.0),
    ("first_step", "restore + first step >= 2.0x faster than `load_prompt_cache` + first step",
     "kvstore_restore_first_step", ("load_prompt_cache_first_step",), 2.0, 2.0),
    ("memory", "memory tier + first step >= 2.0x faster than `LRUPromptCache` + first step",
     "kvstore_memory_first_step", ("lru_fetch_first_step",), 2.0, 2.0),
]
LONG = 32768  # from this many tokens on, the second ratio of a target applies
INSERT_P99_MS = 2.0


# -- running ------------------------------------------------------------------------------------

def prepare(shape: C.Shape, tokens: int, work: Path) -> dict:
    """The cache stored two ways: a kvstore store (through the public API) and one mlx-lm file."""
    from mlx_lm.models.cache import save_prompt_cache

    import kvstore

    cache = C.random_cache(shape, tokens, seed=tokens)
    toks = C.random_tokens(tokens, seed=tokens)
    np.save(work / "tokens.npy", toks)
    store = kvstore.open(work / "store", memory_bytes=0)
    try:
        mc = store.bind(shape.model(), MODEL_ID, fingerprint=FINGERPRINT)
        mc.insert(toks, cache)
        if not store.flush(timeout=600):
            raise RuntimeError("kvstore did not finish writing the benchmark cache in 10 minutes")
    finally:
        store.close()
    one_file = work / "prompt_cache.safetensors"
    save_prompt_cache(str(one_file), cache)
    files = C.blob_files(work / "store")
    if not files:
        raise RuntimeError(f"kvstore wrote no blob files under {work / 'store'}")
    return {"kv_bytes": C.cache_nbytes(cache), "blob_files": len(files),
            "blob_bytes": sum(f.stat().st_size for f in files), "one_file_bytes": one_file.stat().st_size}


def run_method(name: str, spec: dict, reps: int) -> dict:
    """One process running `name` for `reps` timed calls (after one warm-up call)."""
    spec_file = Path(spec["work"]) / f"spec-{name}.json"
    out_file = Path(spec["work"]) / f"out-{name}.json"
    out_file.unlink(missing_ok=True)
    spec_file.write_text(json.dumps(dict(spec, method=name, reps=reps, warmup=1)))  # "shared": spec["methods"]
    try:
        proc = subprocess.run([sys.executable, str(WORKER), str(spec_file), str(out_file)],
                              capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, cwd=str(C.REPO))
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        code, err = "timeout", f"no result after {WORKER_TIMEOUT_S} s"
    result = json.loads(out_file.read_text()) if out_file.exists() else {"method": name}
    result["exit_code"] = code
    if code != 0:
        result["stderr_tail"] = err[-2000:]
        C.log(f"[restore] {name}: exit {code}\n{err[-2000:]}")
    return result


def run_config(shape_name: str, tokens: int, reps: int, cold_reps: int, rounds: int, methods: list[str]) -> dict:
    shape = SHAPES[shape_name]
    work = C.scratch_dir(f"restore-{shape_name}-{tokens}")
    try:
        C.log(f"[restore] {shape_name} {tokens} tokens: preparing the store and the mlx-lm file")
        info = prepare(shape, tokens, work)
        spec = {"shape": {"name": shape.name, "layers": shape.layers, "kv_heads": shape.kv_heads,
                          "head_dim": shape.head_dim},
                "tokens": tokens, "work": str(work), "store": str(work / "store"),
                "one_file": str(work / "prompt_cache.safetensors"), "tokens_file": str(work / "tokens.npy")}
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        shared: dict[str, list[dict]] = {m: [] for m in methods}
        load = [os.getloadavg()[0]]
        for r in range(rounds):
            for name in (methods if r % 2 == 0 else methods[::-1]):
                want = cold_reps if "cold" in name else reps
                n = -(-want // rounds)
                C.log(f"[restore] {shape_name} {tokens}: {name} (round {r + 1}/{rounds}, {n} calls)")
                runs[name].append(run_method(name, spec, n))
            C.log(f"[restore] {shape_name} {tokens}: every method in one process (round {r + 1}/{rounds})")
            got = run_method("shared", dict(spec, methods=methods), -(-reps // rounds))
            for name in methods:
                one = got.get("runs", {}).get(name, {"method": name})
                shared[name].append(dict(one, exit_code=got["exit_code"], stderr_tail=got.get("stderr_tail")))
            load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"shape": shape_name, "tokens": tokens, "layers": shape.layers, "kv_heads": shape.kv_heads,
           "head_dim": shape.head_dim, "load_average": load, **info}
    out["methods"] = {m: summarise(shared[m], info) for m in methods}  # the headline: one process
    out["separate"] = {m: summarise(runs[m], info) for m in methods}  # each in a process of its own
    out["targets"] = {key: judge(out["methods"], kv, bases, need if tokens < LONG else long)
                      for key, _, kv, bases, need, long in TARGETS}
    out["targets_separate"] = {key: judge(out["separate"], kv, bases, need if tokens < LONG else long)
                               for key, _, kv, bases, need, long in TARGETS}
    return out


def summarise(runs: list[dict], info: dict) -> dict:
    samples = [s for r in runs for s in r.get("samples_s", [])]
    minflt = [f for r in runs for f in r.get("minflt", [])]
    majflt = [f for r in runs for f in r.get("majflt", [])]
    cpu = [c for r in runs for c in r.get("cpu_s", [])]
    checks: dict = {}
    for r in runs:
        for k, v in r.get("checks", {}).items():
            if k == "cold_method":
                checks[k] = sorted(set(checks.get(k, [])) | set(v))
            else:
                checks.setdefault(k, v)
    exits = [r["exit_code"] for r in runs]
    row = {"n": len(samples), "exit_codes": exits, "checks": checks,
           "errors": [r["stderr_tail"] for r in runs if r.get("stderr_tail")]}
    if any(e != 0 for e in exits):
        row["failed"] = True  # an error, or (with samples) an abort at exit: both are reported
    if samples:
        med = float(np.median(samples))
        nbytes = info["blob_bytes"] if runs[0]["method"].startswith(("raw_", "buffered_")) else info["kv_bytes"]
        row.update(median_s=med, min_s=min(samples), max_s=max(samples), samples_s=samples,
                   gb_per_s=C.gbps(nbytes, med), minflt_median=float(np.median(minflt)),
                   majflt_median=float(np.median(majflt)), setup_s=[r.get("setup_s") for r in runs])
        if cpu:
            row["cpu_median_s"] = float(np.median(cpu))
        if "cold_method" in checks and "" in checks["cold_method"]:
            row["not_cold"] = True  # the page cache could not be dropped for some call
    return row


def judge(methods: dict, kv: str, bases: tuple[str, ...], need: float) -> dict:
    """baseline time / kvstore time against `need`, with the fastest of `bases` as the baseline."""
    timed = [b for b in bases if methods.get(b, {}).get("median_s")]
    k = methods.get(kv, {})
    if not timed or not k.get("median_s") or k.get("not_cold") or any(methods[b].get("not_cold") for b in timed):
        return {"ratio": None, "met": None, "baseline": None, "need": need}
    base = min(timed, key=lambda b: methods[b]["median_s"])
    ratio = methods[base]["median_s"] / k["median_s"]
    each = {b: methods[b]["median_s"] / k["median_s"] for b in timed}
    return {"ratio": ratio, "met": ratio >= need, "baseline": base, "need": need, "vs_each": each}


def insert_p99() -> dict | None:
    """insert's worst p99 from bench/write_path.py's last results (this benchmark does not time insert)."""
    f = C.RESULTS / "write_path.json"
    if not f.exists():
        return None
    data = json.loads(f.read_text())
    rows = data.get("insert") or []
    if not rows:
        return None
    p99 = max(max(r["idle"]["p99_ms"], r["busy"]["p99_ms"]) for r in rows)
    when = data.get("written_utc", "date not recorded") + (", quick" if data.get("quick") else "")
    return {"p99_ms": p99, "met": p99 < INSERT_P99_MS, "when": when}


def run(configs: list[tuple[str, int]], quick: bool, rounds: int, methods: list[str], note: str = "") -> dict:
    reps, cold_reps = (3, 2) if quick else (8, 6)
    started, load0 = time.time(), os.getloadavg()[0]
    results = [run_config(s, n, reps, cold_reps, rounds, methods) for s, n in configs]
    import kvstore

    code = Path(kvstore.__file__).resolve().parent
    return {"machine": C.machine(), "blas": C.blas_in_use(), "quick": quick, "rounds": rounds, "note": note,
            "kvstore": {"path": str(code), "commit": _commit(code)},
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "seconds": time.time() - started, "load_average_start": load0, "load_average_end": os.getloadavg()[0],
            "methods": {m: METHODS[m][0] for m in methods}, "results": results, "insert": insert_p99()}


def _commit(folder: Path) -> str:
    """The git commit of the measured kvstore's checkout (and whether it had changes), if it is one."""
    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--", "."], capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + (" with uncommitted changes" if head and dirty else "")


# -- reporting ----------------------------------------------------------------------------------

def _current(data: dict) -> bool:
    """Whether `data` was written by this benchmark (not by the one before it, which had no rounds)."""
    return "rounds" in data and all("methods" in r for r in data.get("results", []))


def _label(r: dict) -> str:
    return f"{r['shape']} {r['tokens'] / 1024:g}k"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.01 else f"{seconds * 1e3:.0f} ms"


def _fmt_ratio(t: dict) -> str:
    return "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"


def _verdict(met) -> str:
    return "not measured" if met is None else ("met" if met else "**missed**")


def evidence(r: dict, key: str) -> str:
    """What the numbers of one run say about a target: times, page faults, capacity, which tier served."""
    m = r["methods"]

    def timed(name: str) -> bool:
        return bool(m.get(name, {}).get("median_s"))

    def ms(name: str) -> str:
        return _ms(m[name]["median_s"]) if timed(name) else "n/a"

    def faults(name: str) -> str:
        return f"{m[name]['minflt_median']:,.0f}" if timed(name) else "n/a"

    def cpu(name: str) -> str:
        return _ms(m[name]["cpu_median_s"]) if timed(name) and "cpu_median_s" in m[name] else "n/a"

    def step(alone: str, stepped: str) -> str:
        return _ms(m[stepped]["median_s"] - m[alone]["median_s"]) if timed(alone) and timed(stepped) else "n/a"

    def realloc(name: str) -> str:
        c = m.get(name, {}).get("checks", {})
        if "first_step_reallocates" not in c:
            return "capacity unknown"
        what = "reallocates and copies the cache" if c["first_step_reallocates"] else "writes in place"
        return f"capacity {c['capacity_before_step']} tokens for {r['tokens']}: the first step {what}"

    if key == "alone":
        return (f"kvstore {ms('kvstore_restore_warm')} with {faults('kvstore_restore_warm')} minor page faults a "
                f"call; `load_prompt_cache` {ms('load_prompt_cache')} with {faults('load_prompt_cache')}")
    if key in ("warm", "cold"):
        kv, base = {"warm": ("kvstore_restore_warm", "raw_read_aligned_1t"),
                    "cold": ("kvstore_restore_cold", "buffered_cold_read")}[key]
        text = f"kvstore {ms(kv)} with {faults(kv)} minor page faults a call; {base} {ms(base)} with {faults(base)}"
        if key == "warm":
            text += f"; CPU a call (all threads): kvstore {cpu(kv)}, {base} {cpu(base)}"
        if timed(kv):
            share = m[kv]["minflt_median"] * 4096 / r["kv_bytes"]
            text += f" (kvstore's faults, at 4 KiB each, cover {share:.0%} of the K/V bytes"
            if timed("raw_read_new_memory"):
                text += (f"; a raw read into new `np.empty` memory takes {faults('raw_read_new_memory')} in "
                         f"{ms('raw_read_new_memory')}: numpy asks for transparent huge pages")
            text += ")"
        return text
    if key == "first_step":
        return (f"kvstore restore {ms('kvstore_restore_warm')} + step "
                f"{step('kvstore_restore_warm', 'kvstore_restore_first_step')} "
                f"({realloc('kvstore_restore_first_step')}); `load_prompt_cache` {ms('load_prompt_cache')} + step "
                f"{step('load_prompt_cache', 'load_prompt_cache_first_step')} "
                f"({realloc('load_prompt_cache_first_step')})")
    served = m.get("kvstore_memory_first_step", {}).get("checks", {}).get("served_from_memory")
    tier = {True: "no blob page was read: served from RAM", False: "blob pages were read: NOT served from RAM alone",
            None: "which tier served was not checked"}[served]
    return (f"kvstore memory tier {ms('kvstore_memory')} alone, {ms('kvstore_memory_first_step')} with the step "
            f"({realloc('kvstore_memory_first_step')}; {tier}); `LRUPromptCache` + step "
            f"{ms('lru_fetch_first_step')} ({realloc('lru_fetch_first_step')})")


def target_rows(data: dict, with_insert: bool = True) -> list[tuple[str, str, bool | None, str]]:
    """(target, measured, met, why-if-missed) for every target, over every cache of the run."""
    if not _current(data):
        return []
    rows = []
    for key, text, *_ in TARGETS:
        per = [(r, r["targets"][key]) for r in data["results"] if key in r["targets"]]
        measured = "; ".join(f"{_fmt_ratio(t)} ({_label(r)})" for r, t in per)
        mets = [t["met"] for _, t in per]
        met = None if not mets or any(x is None for x in mets) else all(mets)
        why = "; ".join(f"{_label(r)}: {_fmt_ratio(t)}, "
                        f"{t['ratio'] / t['need']:.0%} of the target; {evidence(r, key)}"
                        for r, t in per if t["met"] is False)
        if key == "warm" and why:
            why += ". What the final arrays and the checks leave of the raw read: \"Where a warm restore's time goes\""
        rows.append((text, measured, met, why))
    if with_insert:
        ins = data.get("insert")
        rows.append(("`insert` on the caller's thread, p99 < 2 ms",
                     f"worst p99 {ins['p99_ms']:.2f} ms (bench/write_path.py, {ins['when']})" if ins
                     else "not measured: run bench/write_path.py", ins["met"] if ins else None,
                     "see the write-path section" if ins and not ins["met"] else ""))
    return rows


def markdown(data: dict, targets: bool = True) -> str:
    """The restore section of bench/README.md (`targets=False`: the report lists them at its top)."""
    lines = ["## Restore: kvstore vs raw reads and vs mlx-lm", ""]
    add = lines.append
    if not _current(data):
        add("results/restore.json was written by an older restore benchmark: run `PYTHONPATH=. python "
            "bench/restore.py` to measure and fill in this section.")
        return "\n".join(lines) + "\n"
    add("Re-run with `PYTHONPATH=. python bench/restore.py` (this section, results/restore.json and the targets; "
        "`--quick` for a smoke run) or `python bench/run_all.py --only restore`.")
    add("")
    add("Caches of random bfloat16 K/V in mlx-lm `KVCache`s shaped like Qwen3-0.6B (28 layers, 8 KV heads, "
        "head_dim 128) and Llama-3-8B (32 layers, 8 KV heads, head_dim 128), inserted into a store through "
        "`store.bind(...).insert` and fetched by a prompt one token longer (every stored token reused). Every "
        "method runs twice: all of them in one process, interleaved call by call (the headline, and what the "
        "targets are judged on: a server is one process, where every restore shares mlx's buffer cache), and each "
        "in a process of its own (restore, free, repeat; labelled), "
        + (f"{data['rounds']} rounds, in reverse order every other one; " if data["rounds"] > 1 else "")
        + "medians. \"First step\" = one token through every layer's `update_and_fetch`, evaluated. Ratios: "
        "baseline time / kvstore time (above 1: kvstore is faster).")
    add("")
    add(f"Run {data['started']}{' (quick)' if data['quick'] else ''}, {data['seconds'] / 60:.1f} minutes on "
        f"{data['machine'].get('cpu')}, {data['machine'].get('cores')} cores, BLAS {data.get('blas')}: load average {data['load_average_start']:.2f} at the start, "
        f"{data['load_average_end']:.2f} at the end (this benchmark adds about 1)."
        + (f" kvstore measured: commit {data['kvstore']['commit']}." if data.get("kvstore", {}).get("commit") else "")
        + (f" {data['note']}" if data.get("note") else ""))
    add("")
    rows = target_rows(data)
    if targets:
        add("| target | measured | |")
        add("| --- | --- | --- |")
        for text, measured, met, _ in rows:
            add(f"| {text} | {measured} | {_verdict(met)} |")
        add("")
    else:
        add("The targets, met or missed, are in the table at the top of this page.")
        add("")
    missed = [(text, why) for text, _, met, why in rows if met is False]
    if missed and targets:
        add("Missed, by how much, and what the same run measured about why:")
        add("")
        for text, why in missed:
            add(f"- {text}: {why}.")
        add("")
    for r in data["results"]:
        add(f"**{r['shape']}, {r['tokens']:,} tokens**: {r['kv_bytes'] / 1e6:,.0f} MB of K/V in {r['blob_files']} "
            f"blob files ({r['blob_bytes'] / 1e6:,.0f} MB; raw reads read these bytes); load average "
            + ", ".join(f"{x:.2f}" for x in r.get("load_average", [])) + " (start, after each round)")
        add("")
        for title, rows_of in (("every method in one process, interleaved (the headline: as in a server, they "
                                "share mlx's buffer cache)", r["methods"]),
                               ("each method in a process of its own (labelled: there only kvstore raises mlx's "
                                "buffer-cache limit, so the baselines page-fault fresh memory every call)",
                                r.get("separate", {}))):
            if not rows_of:
                continue
            add(f"*{title}*")
            add("")
            _table(add, rows_of)
            sep = r.get("targets_separate")
            if sep and rows_of is r.get("separate"):
                add("Ratios in separate processes: " + "; ".join(f"{k} {_fmt_ratio(t)}" for k, t in sep.items()) + ".")
                add("")
    how = sorted({h for r in data["results"] for row in r["methods"].values()
                  for h in row.get("checks", {}).get("cold_method", [])})
    add("Methods: " + "; ".join(f"`{k}`: {v}" for k, v in data["methods"].items()) + ". Cold calls: the blob "
        f"files are evicted from the page cache before each call with {', '.join(how) or 'nothing'} "
        "(`fadvise` = `posix_fadvise(POSIX_FADV_DONTNEED)` per file, checked with `mincore`; `drop_caches` = "
        "`echo 1 > /proc/sys/vm/drop_caches`, only if fadvise left pages in). GB/s: of the blob bytes for the "
        "raw reads, of the K/V bytes otherwise. CPU / call: user + system time of the whole process (every "
        "thread) during the call, median; above the median time, more than one core was busy.")
    add("")
    return "\n".join(lines)


def _table(add, methods: dict) -> None:
    add("| method | median | GB/s | CPU / call | minor faults / call | major faults / call | calls | notes |")
    add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, row in methods.items():
        if not row.get("median_s"):
            add(f"| {name} | failed (exit {row['exit_codes']}) | | | | | {row['n']} | see restore.json |")
            continue
        cpu = f"{row['cpu_median_s'] * 1e3:.1f} ms" if "cpu_median_s" in row else "-"
        add(f"| {name} | {row['median_s'] * 1e3:.1f} ms | {row['gb_per_s']:.2f} | {cpu} | {row['minflt_median']:,.0f} "
            f"| {row['majflt_median']:,.0f} | {row['n']} | {_notes(row)} |")
    add("")


def _notes(row: dict) -> str:
    c = row.get("checks", {})
    out = []
    if "capacity_before_step" in c:
        out.append(f"capacity {c['capacity_before_step']} -> {c.get('capacity_after_step')} tokens")
    elif "capacity_tokens" in c:
        out.append(f"restored capacity {c['capacity_tokens']} tokens")
    if "served_from_memory" in c:
        out.append("no disk read" if c["served_from_memory"] else "read the disk")
    if row.get("not_cold"):
        out.append("page cache NOT dropped")
    if row.get("failed"):
        out.append(f"**process exit {row['exit_codes']}** (see restore.json)")
    return ", ".join(out) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small cache, 3 calls a method, one round (< 1 minute)")
    ap.add_argument("--shape", choices=sorted(SHAPES), nargs="*", help="cache shapes (with --tokens: every pair)")
    ap.add_argument("--tokens", type=C.positive_int, nargs="*", help="cache lengths (with --shape: every pair)")
    ap.add_argument("--methods", nargs="*", choices=list(METHODS), help="run only these methods")
    ap.add_argument("--rounds", type=C.positive_int, help="processes per method (default 2, 1 with --quick)")
    ap.add_argument("--note", default="", help="a sentence about the run, printed in the README section")
    ap.add_argument("--out", type=Path, help="write the JSON here (and the .md beside it) instead of bench/results; "
                    "bench/README.md is then left alone")
    ap.add_argument("--no-report", action="store_true", help="do not regenerate bench/README.md")
    args = ap.parse_args()
    configs = QUICK if args.quick else FULL
    if args.shape or args.tokens:
        configs = [(s, n) for s in (args.shape or ["qwen3-0.6b"]) for n in (args.tokens or [2048])]
    rounds = args.rounds or (1 if args.quick else 2)
    data = run(configs, args.quick, rounds, args.methods or list(METHODS), args.note)
    out = args.out or C.RESULTS / "restore.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=C._jsonable) + "\n")
    out.with_suffix(".md").write_text(markdown(data))
    C.log(f"[restore] CPU {data['machine'].get('cpu')}, {data['machine'].get('cores')} cores, BLAS {data['blas']}; "
          f"load average {data['load_average_start']:.2f} -> {data['load_average_end']:.2f}")
    for text, measured, met, _ in target_rows(data):
        C.log(f"[restore] {text}: {measured}: {_verdict(met)}")
    for r in data["results"]:
        C.log(f"[restore] {_label(r)}, one process: " + ", ".join(
            f"{n} {_ms(m['median_s'])} ({m['minflt_median']:,.0f} faults)" for n, m in r["methods"].items()
            if m.get("median_s")))
    print(out)
    if not (args.out or args.no_report):
        from report import write_report

        C.log(f"[restore] report: {write_report()}")
    if any(e != 0 for r in data["results"] for rows in (r["methods"], r["separate"]) for row in rows.values()
           for e in row["exit_codes"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
