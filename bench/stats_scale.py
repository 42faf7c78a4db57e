"""`kvstore stats` on a store of 100,000 records: the whole command, in a fresh process.

Rows are synthesised through the index layer, as `index_scale.py` does (its `synthesise`: a
forest of shared prefixes and branches over four namespaces; no blob files), with the bound
model's row registered so that the per-model table has one. Timed: `python -m kvstore.cli stats
--store S` from start to exit (interpreter start-up, imports, opening the store, the queries,
printing), the median of several runs after one untimed run; next to it, a bare `python -c pass`
for the interpreter's own share. Target: < 0.3 s. Maintenance imports no mlx, which is most of
what this measures.

    python bench/stats_scale.py [--rows 100000] [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common as C
import numpy as np
from index_scale import CHUNK_TOKENS, FINGERPRINT, synthesise

from kvstore import keys
from kvstore.upkeep.local import LocalStore

REPO = Path(__file__).resolve().parents[1]
TARGET_S = 0.3


def build(path: Path, rows: int) -> int:
    """A store at `path` with about `rows` records; returns how many."""
    with LocalStore(path) as files:
        ns = keys.namespace(FINGERPRINT, {"bench": "stats"}, CHUNK_TOKENS)
        files.index.register_model(ns, FINGERPRINT, "bench-shape", "{}", CHUNK_TOKENS)
        return synthesise(files.index, ns, rows, np.random.default_rng(11))


def timed(argv: list[str], runs: int) -> list[float]:
    """Wall seconds of `argv` in a fresh process, `runs` times after one untimed run."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    seconds = []
    for i in range(runs + 1):
        t = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env, cwd=REPO)
        if i:
            seconds.append(time.perf_counter() - t)
    return seconds


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return C.machine().get("cpu", "?")
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def run(rows: int, runs: int) -> dict:
    path = C.scratch_dir("stats-scale") / "store"
    records = build(path, rows)
    stats = timed([sys.executable, "-m", "kvstore.cli", "stats", "--store", str(path)], runs)
    bare = timed([sys.executable, "-c", "pass"], runs)
    shutil.rmtree(path.parent, ignore_errors=True)
    return {"records": records, "runs": runs, "stats_median_s": statistics.median(stats),
            "stats_s": stats, "python_start_median_s": statistics.median(bare), "target_s": TARGET_S,
            "cpu": cpu_model()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=C.positive_int, default=100_000, help="records in the store (default: 100,000)")
    ap.add_argument("--runs", type=C.positive_int, default=7, help="timed runs (default: 7)")
    args = ap.parse_args()
    result = run(args.rows, args.runs)
    print(f"kvstore stats, {result['records']:,} records: {result['stats_median_s']:.3f} s median of "
          f"{result['runs']} fresh processes (python start alone: {result['python_start_median_s']:.3f} s; "
          f"target < {TARGET_S} s) on {result['cpu']}")
    print(C.write_result("stats_scale", result))


if __name__ == "__main__":
    main()
