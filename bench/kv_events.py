"""KV events: how fast a restarted node announces its store, and what publishing costs an insert.

- announce: a store of `--records` records (chunks of 256 tokens and tails, tiny demo llama) is
  served by `kvstore serve --kv-events-config ...` started afresh; a subscriber (bound on
  127.0.0.1, as llm-d's router binds; the node connects to it) times, from the moment the
  process is started, its `/health` and the last batch of the announce (every record's blocks
  received: counted from the events themselves, with the replay socket filling what the live
  socket missed). Target: announced within 5 s of start.
- insert: the caller-side time of `ModelCache.insert` into a store that publishes (a subscriber
  keeping up) and into one that does not, the same caches, interleaved one by one. Target:
  under 5% more. Afterwards the subscriber's sequence numbers must have no gap and what it
  believes the store holds must be what it holds.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python bench/kv_events.py [--records 1000] [--inserts 600] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common as C
import requests

sys.path.insert(0, str(C.REPO / "tests"))
from vllm_events import Consumer, free_port  # noqa: E402  (the decoder written from vLLM's schema)

import kvstore  # noqa: E402
from kvstore.demo import build_demo_model  # noqa: E402

CHUNK, BLOCK = 256, 64


def _prefill(model, tokens):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def build_store(path: Path, model_dir: Path, records: int) -> int:
    """A store of `records` records (each prompt: three chunks and a tail). Blocks it holds."""
    from mlx_lm import load

    model, _ = load(str(model_dir))
    blocks = 0
    with kvstore.open(path) as store:
        mc = store.bind(model, str(model_dir))
        for i in range(records // 4):
            tokens = [(i * 7 + j * 13) % 250 + 1 for j in range(3 * CHUNK + 100)]
            tokens[0] = i % 250 + 1
            tokens[1] = i // 250 + 1  # every prompt its own first chunk
            mc.insert(tokens, _prefill(model, tokens))
            blocks += len(tokens) // BLOCK
        store.flush()
        stats = store.stats()
    assert stats["chunks"] + stats["tails"] == records // 4 * 4, stats
    return blocks


def announce(model_dir: Path, store: Path, blocks: int) -> dict:
    consumer = Consumer()
    port = free_port()
    config = json.dumps(consumer.config(block_size=BLOCK, buffer_steps=100_000))
    env = dict(os.environ)
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.serve", "--model", str(model_dir), "--store", str(store),
                             "--port", str(port), "--kv-events-config", config], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, ready, announced = f"http://127.0.0.1:{port}", None, None
    try:
        while time.monotonic() - started < 120:
            if ready is None:
                try:
                    if requests.get(url + "/health", timeout=1).status_code == 200:
                        ready = time.monotonic() - started
                except requests.RequestException:
                    pass
            with consumer._lock:
                held = sum(len(e.block_hashes) for b in consumer.live.values() for e in b.events
                           if type(e).__name__ == "BlockStored" and e.medium == "DISK")
            if held >= blocks and announced is None:
                announced = time.monotonic() - started
            if ready is not None and announced is not None:
                break
            time.sleep(0.01)
        stats = requests.get(url + "/kvstore/stats", timeout=10).json()["events"]
        batches = consumer.batches(stats["next_sequence"])
        view = consumer.view(batches)
        return {"records": None, "blocks": blocks, "health_s": ready, "announced_s": announced,
                "announce_in_process_s": stats["announce_seconds"], "batches": len(batches),
                "largest_batch": max(len(b.events) for _, b in batches),
                "blocks_believed": len(view.get("DISK", {})), "live_missed": stats["next_sequence"] - len(consumer.live)}
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        consumer.close()


def held_blocks(store, mc, prompts) -> set[int]:
    """The ids of the blocks the store holds on disk for `prompts`, from its records."""
    from kvstore.events.blocks import block_ids
    from kvstore.records import CHECKPOINT, prompt_records

    out: set[int] = set()
    for tokens in prompts:
        for s in prompt_records(mc.ns, tokens, CHUNK):
            if s.kind != CHECKPOINT and store.index.present([s.hash]):
                out.update(block_ids(s.parent, tokens[s.start : s.end], BLOCK))
    return out


def inserts(model_dir: Path, n: int, tmp: Path) -> dict:
    """Caller-side insert time with and without a publisher, interleaved."""
    from mlx_lm import load

    model, _ = load(str(model_dir))
    consumer = Consumer()
    plain = kvstore.open(tmp / "plain")
    events = kvstore.open(tmp / "events", kv_events=consumer.config(block_size=BLOCK, max_queue_size=1_000_000))
    try:
        mcs = {"plain": plain.bind(model, str(model_dir)), "events": events.bind(model, str(model_dir))}
        times = {"plain": [], "events": []}
        prompts = []
        for i in range(n):
            tokens = [(i * 31 + j * 7) % 250 + 1 for j in range(CHUNK + 64 + i % 128)]
            cache = _prefill(model, tokens)
            prompts.append(tokens)
            for name in (("plain", "events") if i % 2 else ("events", "plain")):
                t = time.perf_counter()
                mcs[name].insert(tokens, cache)
                times[name].append(time.perf_counter() - t)
        for store in (plain, events):
            store.flush()
        assert events.events.settle(60)
        sent = events.events.publisher.sent
        batches = consumer.batches(sent)
        gapless = [n for n, _ in batches] == list(range(sent))
        view = consumer.view(batches)
        want = held_blocks(events, mcs["events"], prompts)
        out = {"inserts": n}
        for name, ts in times.items():
            ts = sorted(ts)
            out[name] = {"median_ms": statistics.median(ts) * 1e3, "p99_ms": ts[int(0.99 * (len(ts) - 1))] * 1e3,
                         "mean_ms": statistics.fmean(ts) * 1e3,
                         # without the slowest 5% (a scheduler stall on a busy 2-core machine)
                         "trimmed_mean_ms": statistics.fmean(ts[: int(0.95 * len(ts))]) * 1e3}
        out["overhead_mean"] = out["events"]["mean_ms"] / out["plain"]["mean_ms"] - 1
        out["overhead_trimmed_mean"] = out["events"]["trimmed_mean_ms"] / out["plain"]["trimmed_mean_ms"] - 1
        out["overhead_median"] = out["events"]["median_ms"] / out["plain"]["median_ms"] - 1
        out["batches"], out["gapless"] = sent, gapless
        out["disk_view_equals_store"] = set(view.get("DISK", {})) == want
        out["disk_blocks_believed"], out["disk_blocks_held"] = len(view.get("DISK", {})), len(want)
        return out
    finally:
        plain.close()
        events.close()
        consumer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=C.positive_int, default=1000)
    p.add_argument("--inserts", type=C.positive_int, default=600)
    p.add_argument("--out", default=str(C.RESULTS / "kv_events.json"))
    args = p.parse_args()
    C.log_machine("kv_events")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = build_demo_model(tmp / "model", arch="llama", size="tiny")
        blocks = build_store(tmp / "store", model_dir, args.records)
        result = {"machine": C.machine(), "blas": C.blas_in_use(),
                  "written_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        result["announce"] = announce(model_dir, tmp / "store", blocks)
        result["announce"]["records"] = args.records
        print(json.dumps(result["announce"], indent=1))
        result["insert"] = inserts(model_dir, args.inserts, tmp)
        print(json.dumps(result["insert"], indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
