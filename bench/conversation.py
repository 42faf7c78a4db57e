"""Conversation benchmark: disk bytes of a multi-turn chat inserted as a server does.

A 300-token system prompt, then 20 turns of 90 tokens (45 of user message, 45 of reply). Every turn
does what `kvstore serve` does: `fetch` the prompt (system + history + the new message), run the
model over what was not restored and over the reply (the reply's K/V are what decoding would
have added), then `insert` prompt + reply. Reported: store bytes at the end against the K/V of the
final conversation alone (layers x K and V x heads x head dim x dtype x tokens), bytes written per
turn, tokens reused per turn; with the writer dropping redundant tails (now) and without (before,
the same code with that step switched off).

    python bench/conversation.py [--arch llama] [--size small] [--turns 20]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import common as C
import mlx.core as mx
import numpy as np
from mlx_lm import load

import kvstore
from kvstore.demo import build_demo_model
from kvstore.write.writer import Writer

SYSTEM, USER, REPLY = 300, 45, 45


def kv_bytes_per_token(model) -> int:
    """Bytes of K/V one token adds to a fresh cache (every layer, keys and values)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[1, 2]]), cache=cache)
    return sum(int(c.keys[..., :2, :].nbytes + c.values[..., :2, :].nbytes) for c in cache) // 2


def conversation(model, model_dir: Path, store_dir: Path, turns: int, drop: bool) -> dict:
    rng = np.random.default_rng(0)
    vocab = 250
    history = rng.integers(1, vocab, SYSTEM).tolist()
    per_turn = []
    original = Writer._drop_redundant
    if not drop:
        Writer._drop_redundant = lambda self, job, written: None
    try:
        with kvstore.open(store_dir) as store:
            mc = store.bind(model, model_dir)
            for turn in range(turns):
                prompt = history + rng.integers(1, vocab, USER).tolist()
                reply = rng.integers(1, vocab, REPLY).tolist()
                written = store.writer.stats.bytes_written
                t = time.perf_counter()
                cache, rest = mc.fetch(prompt)
                reused = len(prompt) - len(rest)
                model(mx.array([rest + reply]), cache=cache)
                C.eval_cache(cache)
                history = prompt + reply
                mc.insert(history, cache)
                store.flush()
                per_turn.append({"turn": turn + 1, "tokens": len(history), "reused": reused,
                                 "bytes_written": store.writer.stats.bytes_written - written,
                                 "store_bytes": store.stats()["bytes"], "seconds": time.perf_counter() - t})
            stats = store.stats()
    finally:
        Writer._drop_redundant = original
    return {"store_bytes": stats["bytes"], "chunks": stats["chunks"], "tails": stats["tails"],
            "final_tokens": len(history), "turns": per_turn}


def run(arch: str, size: str, turns: int) -> dict:
    work = C.scratch_dir(f"conversation-{arch}")
    model_dir = build_demo_model(work / "model", arch, size=size)
    model, _ = load(str(model_dir))
    per_token = kv_bytes_per_token(model)
    out = {"machine": C.machine(), "arch": arch, "size": size, "chunk_size": 256, "system_tokens": SYSTEM,
           "turn_tokens": USER + REPLY, "turns": turns, "kv_bytes_per_token": per_token}
    for name, drop in (("now", True), ("before", False)):
        with tempfile.TemporaryDirectory(dir=work) as d:
            got = conversation(model, model_dir, Path(d) / "store", turns, drop)
        final_kv = per_token * got["final_tokens"]
        got["final_kv_bytes"] = final_kv
        got["ratio"] = got["store_bytes"] / final_kv
        out[name] = got
        written = [t["bytes_written"] for t in got["turns"]]
        C.log(f"[conversation {arch}-{size}] {name}: {got['store_bytes']} bytes stored for "
              f"{got['final_tokens']} tokens ({got['chunks']} chunks, {got['tails']} tails) = "
              f"{got['ratio']:.3f}x their K/V; bytes written per turn: median {int(np.median(written))}, "
              f"max {max(written)}")
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="llama", choices=("llama", "gemma3_text"))
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--turns", type=C.positive_int, default=20)
    ap.add_argument("--quick", action="store_true", help="the tiny model, 6 turns")
    args = ap.parse_args()
    C.log_machine("conversation")
    if args.quick:
        args.size, args.turns = "tiny", 6
    result = {"runs": [run(args.arch, args.size, args.turns)]}
    if args.arch == "llama":  # a sliding-window model too: its window layers hold less per record
        result["runs"].append(run("gemma3_text", args.size, args.turns))
    print(C.write_result("conversation", result))


if __name__ == "__main__":
    main()
