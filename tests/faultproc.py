"""Child processes for the fault suite (tests/test_faults*.py): work on a store until told to stop,
killed, or done, and say what they did as JSON lines on stdout.

    python tests/faultproc.py warm   STORE MODEL CHUNK SEED COUNT [PIN_EVERY]
    python tests/faultproc.py gc     STORE MODEL CHUNK MAX_BYTES
    python tests/faultproc.py worker STORE MODEL CHUNK SEED ROLE SECONDS THREADS

`warm` prefills COUNT prompts with the store's own chunked prefill (as `kvstore warm` does) and
prints {"flushed": i} once prompt i is durable. `worker` runs ROLE (warm, fetch, gc, verify) on
THREADS threads for SECONDS and prints one summary line: what it did and every error it saw.
Fault points are armed through KVSTORE_FAULT in the environment (see kvstore/faults.py).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

VOCAB = 250
HERE = Path(__file__).parent


def prompts(seed: int, count: int, chunk: int) -> list[list[int]]:
    """Prompts sharing a 2-chunk system prompt (as a server sees), with unique parts of varied
    length (some end on a chunk boundary, most in a tail), and a few sharing a longer prefix."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in np.random.default_rng(12345).integers(0, VOCAB, 2 * chunk)]
    out: list[list[int]] = []
    for i in range(count):
        if out and i % 4 == 3:  # a follow-up turn of an earlier prompt
            base = out[int(rng.integers(len(out)))]
            extra = int(rng.integers(1, 2 * chunk))
            out.append(base + [int(t) for t in rng.integers(0, VOCAB, extra)])
            continue
        n = int(rng.choice([chunk, 2 * chunk, int(rng.integers(1, 3 * chunk))]))
        out.append(system + [int(t) for t in rng.integers(0, VOCAB, n)])
    return out


# -- used by the tests, in the test process ---------------------------------------------------

class Child:
    """A faultproc.py process whose JSON lines are collected as they come."""

    def __init__(self, mode: str, *args, fault: str | None = None):
        env = {k: v for k, v in os.environ.items() if k != "KVSTORE_FAULT"}
        if fault:
            env["KVSTORE_FAULT"] = fault
        self.proc = subprocess.Popen([sys.executable, str(HERE / "faultproc.py"), mode, *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[dict] = []
        self.ready = threading.Event()
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.lines.append(item)
            if item.get("ready"):
                self.ready.set()
        self.ready.set()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout: float = 180) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        self.stderr = self.proc.stderr.read()
        return code

    def flushed(self) -> list[int]:
        return [item["flushed"] for item in self.lines if "flushed" in item]


# -- the child processes ---------------------------------------------------------------------

def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def open_store(store_dir: str, chunk: int, **kw):
    import kvstore

    return kvstore.open(store_dir, chunk_size=chunk, **kw)


def load_model(model_dir: str):
    from mlx_lm import load

    model, _ = load(model_dir)
    return model


def warm(store_dir, model_dir, chunk, seed, count, pin_every=0) -> None:
    model = load_model(model_dir)
    with open_store(store_dir, int(chunk)) as store:
        mc = store.bind(model, model_dir)
        say(ready=True)
        for i, p in enumerate(prompts(int(seed), int(count), int(chunk))):
            mc.prefill(p, pin=bool(int(pin_every)) and i % int(pin_every) == 0)
            store.flush()
            say(flushed=i)
        say(done=True, stats=store.stats()["writer"])


def gc(store_dir, model_dir, chunk, max_bytes) -> None:
    with open_store(store_dir, int(chunk)) as store:
        say(ready=True)
        result = store.gc(max_bytes=int(max_bytes))
        result.pop("seconds", None)
        say(done=True, **result)


def worker(store_dir, model_dir, chunk, seed, role, seconds, threads) -> None:
    """ROLE on THREADS threads until SECONDS have passed; one summary line at the end."""
    import mlx.core as mx

    chunk, seed, seconds, threads = int(chunk), int(seed), float(seconds), int(threads)
    model = load_model(model_dir) if role in ("warm", "fetch") else None
    errors: list[str] = []
    counts = {"ops": 0, "reused": 0, "flushed": [], "max_diff": 0.0}
    lock = threading.Lock()
    store = open_store(store_dir, chunk)
    mc = store.bind(model, model_dir) if model is not None else None
    pool = prompts(seed, 24, chunk)
    deadline = time.monotonic() + seconds

    def run(k: int) -> None:
        rng = random.Random(seed * 100 + k)
        i = k
        while time.monotonic() < deadline:
            try:
                if role == "warm":
                    # Thread k warms prompts k, k + threads, ...; pinned ones must never be lost.
                    p = pool[i % len(pool)]
                    mc.prefill(p, pin=i % 3 == 0)
                    store.flush()
                    with lock:
                        counts["flushed"].append(i % len(pool))
                    i += threads
                elif role == "fetch":
                    base = rng.choice(prompts(rng.choice([seed, seed + 1, seed + 2]), 24, chunk))
                    query = base[: rng.randint(1, len(base))] + [rng.randrange(VOCAB)]
                    cache, rest = mc.fetch(query)
                    logits = model(mx.array([rest]), cache=cache)
                    ref = model(mx.array([query]))
                    diff = float(mx.abs(logits[0, -1] - ref[0, -1]).max().item())
                    with lock:
                        counts["reused"] += len(query) - len(rest)
                        counts["max_diff"] = max(counts["max_diff"], diff)
                elif role == "gc":
                    budget = store.stats()["bytes"] // 2
                    store.gc(max_bytes=budget)
                    time.sleep(0.05)
                elif role == "verify":
                    store.verify()  # reports only: a concurrent repair is the operator's call
                    time.sleep(0.05)
                with lock:
                    counts["ops"] += 1
            except BaseException:
                with lock:
                    errors.append(traceback.format_exc(limit=6))
                time.sleep(0.05)
        _end_of_mlx_thread()

    pool_threads = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in pool_threads:
        t.start()
    for t in pool_threads:
        t.join()
    writer = None
    try:
        writer = store.stats()["writer"]
        store.close()
    except BaseException:
        errors.append(traceback.format_exc(limit=6))
    counts["flushed"] = sorted(set(counts["flushed"]))
    say(role=role, errors=errors, writer=writer, **counts)
    _end_of_mlx_thread()


def _end_of_mlx_thread() -> None:
    """MLX (0.32) aborts at exit ("terminate called without an active exception") when a thread
    that evaluated arrays did not free its streams: mlx asks for `mx.clear_streams()` at the end
    of every such thread, the main one included (ml-explore/mlx#3126)."""
    import mlx.core as mx

    if hasattr(mx, "clear_streams"):
        mx.clear_streams()


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"warm": warm, "gc": gc, "worker": worker}[mode](*args)
