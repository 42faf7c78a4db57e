"""A reader in another process, for tests that change a store under it (gc, a writer dropping
tails): it fetches the given queries round and round, compares each restore with a recompute,
and prints one JSON line when started ({"ready": true}) and one when done ({"fetches", "wrong",
"reused", "worst"}). It stops once STOP exists and it has made at least MIN_FETCHES fetches (or
after two minutes). Started by `kvtest.readers`.

    python tests/reader_proc.py STORE MODEL CHUNK QUERIES_JSON_FILE STOP MIN_FETCHES
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from kvtest import logits_diff
from mlx_lm import load

import kvstore

TOL = 1e-4


def main(store_dir: str, model_dir: str, chunk: str, queries_file: str, stop_file: str, min_fetches: str) -> None:
    queries = json.loads(Path(queries_file).read_text())
    stop, least = Path(stop_file), int(min_fetches)
    model, _ = load(model_dir)
    done = wrong = reused = 0
    worst = 0.0
    with kvstore.open(store_dir, chunk_size=int(chunk), memory_bytes=0) as store:
        mc = store.bind(model, model_dir)
        print(json.dumps({"ready": True}), flush=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not stop.exists() or done < least):
            query = queries[done % len(queries)]
            cache, rest = mc.fetch(query)
            diff = logits_diff(model, cache, rest, query)
            worst = max(worst, diff)
            wrong += diff > TOL
            reused += len(query) - len(rest)
            done += 1
    print(json.dumps({"fetches": done, "wrong": wrong, "reused": reused, "worst": worst}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
