"""Run every benchmark, then write bench/results/*.json, the plot and bench/README.md.

    python bench/run_all.py            # the full run (`make bench`), about 25 minutes on 2 cores
    python bench/run_all.py --quick    # smaller caches, fewer repetitions: a few minutes

Each benchmark runs in its own process, one after the other (nothing else of ours competes for
the CPU). The time-to-first-token benchmarks (ttft.py, and serve.py for the two servers it
starts) and exact.py (whose point is OpenBLAS's sums) run with Debian's OpenBLAS preloaded (`LD_PRELOAD`) when `libopenblas0-pthread` is
installed, since the mlx-cpu wheel's bundled reference BLAS makes CPU prefill several times
slower (how many depends on the CPU); the report says which BLAS each run used.
Nothing here needs OpenBLAS: without it the same run uses the bundled BLAS (and fewer lengths fit
the time budget).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import common as C

STEPS = ["restore", "write_path", "index_scale", "conversation", "before_after", "ttft", "serve", "agent_trace",
         "kv8", "exact"]


def run_step(name: str, quick: bool, env: dict | None = None) -> dict:
    cmd = [sys.executable, str(C.HERE / f"{name}.py")] + (["--quick"] if quick else [])
    C.log(f"== {name}: {' '.join(cmd[1:])}" + (f" (LD_PRELOAD={env['LD_PRELOAD']})" if env and "LD_PRELOAD" in env else ""))
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=str(C.REPO))
    seconds = time.perf_counter() - started
    C.log(f"== {name}: exit {proc.returncode} after {seconds:.0f} s")
    return {"name": name, "seconds": seconds, "returncode": proc.returncode,
            "ld_preload": (env or {}).get("LD_PRELOAD", "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller caches and fewer repetitions")
    ap.add_argument("--only", nargs="*", choices=STEPS, help="run only these benchmarks (the report uses "
                    "the JSON files already in bench/results for the others)")
    args = ap.parse_args()
    steps = args.only or STEPS
    C.RESULTS.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    machine_before = C.machine()
    runs = []
    for name in steps:
        env = None
        if name in ("ttft", "serve", "exact"):  # (serve.py preloads it for its servers itself)
            blas = C.openblas_path()
            if blas and blas not in os.environ.get("LD_PRELOAD", ""):
                env = dict(os.environ, LD_PRELOAD=blas)
        result = run_step(name, args.quick, env)
        if result["returncode"] != 0 and env is not None:  # never depend on the preloaded BLAS
            C.log(f"== {name} failed with OpenBLAS preloaded; running it again with the bundled BLAS")
            result = run_step(name, args.quick, None)
        runs.append(result)
    plotted = subprocess.run([sys.executable, str(C.HERE / "plot.py")], cwd=str(C.REPO)).returncode == 0
    meta = {"quick": args.quick, "steps": runs, "total_seconds": time.perf_counter() - started,
            "machine": machine_before, "load_average_end": os.getloadavg()[0], "plot": plotted,
            "finished": time.strftime("%Y-%m-%d %H:%M %Z")}
    previous = {}
    run_file = C.RESULTS / "run.json"
    if args.only and run_file.exists():  # keep the record of the steps not run now
        previous = {s["name"]: s for s in json.loads(run_file.read_text()).get("steps", [])}
        now = {r["name"]: r for r in runs}
        meta["steps"] = [now.get(n) or previous[n] for n in STEPS if n in now or n in previous]
        meta["rerun"] = [r["name"] for r in runs]
    C.write_result("run", meta)
    from report import write_report

    out = write_report()
    C.log(f"== report: {out} ({meta['total_seconds'] / 60:.1f} min)")
    if any(r["returncode"] != 0 for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
