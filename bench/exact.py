"""Exact mode (`exact_prefill`) on and off: what it buys, what it costs, and `verify --exact`.

    python bench/exact.py [--quick]    # starts itself again with Debian's OpenBLAS preloaded, if installed

1. Exactness and reuse (the demo models, float32, every architecture kvstore restores: llama,
   gemma3_text's sliding window, qwen3_5's hybrid, baichuan_m1's CacheList, and llama "small"
   with a QuantizedKVCache): a prompt of 2k or 8k tokens is stored as `kvstore generate` stores it,
   then queries that share a prefix of it (a random length, and the whole prompt) are restored
   from disk and run as generation runs them, against a cold run of the query in the same steps
   (mlx-lm's 2048 with exact mode off). Per mode: greedy agreement over 32 tokens, K/V bit for bit
   after the restore point, the largest next-token logit difference, and the tokens reused.
   Modes: off, exact_prefill=256 (the chunk size) and 2048 (mlx-lm's default prefill step).
2. Prefill speed: a cold prefill of 2k and 8k tokens (demo llama "small") in steps of 256, 2048
   and 8192 (one piece at 8k), and the canary's cost: the last token as a step of its own.
3. `verify --exact` on a 100-prompt store (exact mode on and off): seconds per prompt, and that
   no file of the store changed (bytes and times).
4. A conversation (demo llama tiny): 12 turns of a 64-token user message and a 48-token reply
   after a 1,024-token system prompt, each turn generated and stored as `kvstore generate` does;
   the tokens each mode reuses (exact mode recomputes each reply in the next turn).
5. The backend self-check's cost: the first restore of a process (a Qwen3-0.6B-shaped cache of 8k
   tokens from disk, page cache warm), with the check and with it skipped, each in fresh
   processes, alternating.

With OpenBLAS preloaded (its sums depend on the number of rows), exact mode off differs from a
cold run by kernel noise; on the mlx-cpu wheel's bundled BLAS nothing differs on these models.
Writes bench/results/exact.json and prints its tables. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import common as C
import mlx.core as mx
import numpy as np
import report_sections
import xxhash
from mlx_lm.models.cache import make_prompt_cache

import kvstore
from kvstore.demo import build_demo_model
from kvstore.model.prefill import canary_of, insert_generated, last_step, process, prompt_cache, run

GREEDY, MLX_STEP = 32, 2048
MODELS = [("llama", "tiny", {}), ("gemma3_text", "tiny", {}), ("qwen3_5", "tiny", {}), ("baichuan_m1", "tiny", {}),
          ("llama", "small", {"kv_bits": 8, "kv_group_size": 32})]
MODES = ["off", 256, 2048]
PARTS = ("exactness", "prefill", "verify", "conversation", "selfcheck")


def toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def generate(mc, tokens: list[int], n: int = 8) -> None:
    """Store `tokens` (and, out of exact mode, `n` generated tokens) as `kvstore generate` does."""
    start = prompt_cache(mc, tokens)
    logprobs = run(mc.model, start.cache, start.rest, mc.exact or MLX_STEP)
    canary = canary_of(len(tokens) - 1, tokens[-1], logprobs)
    if start.hold is not None:
        start.hold.submit(canary)
    out = [int(mx.argmax(logprobs))]
    while len(out) < n:
        out.append(int(mx.argmax(last_step(mc.model, start.cache, out[-1]))))
    insert_generated(mc, tokens, out, start.cache, canary)


def greedy(model, cache, logprobs) -> list[int]:
    out = [int(mx.argmax(logprobs))]
    while len(out) < GREEDY:
        out.append(int(mx.argmax(last_step(model, cache, out[-1]))))
    return out


def compare(mc, query: list[int]) -> dict:
    """The query restored and run as generation runs it, against a cold run in the same steps."""
    step = mc.exact or MLX_STEP
    t0 = time.perf_counter()
    restored, rest = mc.fetch(query)
    mine = run(mc.model, restored, rest, step)
    warm_s = time.perf_counter() - t0
    p = len(query) - len(rest)
    t0 = time.perf_counter()
    cold = mc.new_cache()
    theirs = run(mc.model, cold, query, step)
    cold_s = time.perf_counter() - t0
    bitwise = True
    for codec, x, y in zip(mc.codecs, restored, cold):
        for name, (a, origin) in codec.deltas(x, len(query)).items():
            b = codec.deltas(y, len(query))[name][0]
            cut = max(0, min(a.shape[2], p - origin))
            bitwise &= bool(mx.array_equal(a[:, :, cut:], b[:, :, cut:]).item())
        for name, a in codec.checkpoint(x).items():
            if isinstance(a, mx.array):
                bitwise &= bool(mx.array_equal(a, codec.checkpoint(y)[name]).item())
    ours, ref = greedy(mc.model, restored, mine), greedy(mc.model, cold, theirs)
    return {"tokens": len(query), "reused": p, "kv_bitwise": bitwise,
            "logit_diff": float(mx.abs(mine.astype(mx.float32) - theirs.astype(mx.float32)).max()),
            "greedy_agree": sum(a == b for a, b in zip(ours, ref)), "warm_s": warm_s, "cold_s": cold_s}


def exactness(work: Path, lengths: list[int], queries: int) -> list[dict]:
    from mlx_lm import load

    rows = []
    for arch, size, bind in MODELS:
        model_dir = build_demo_model(work / f"{arch}-{size}", arch, size=size)
        model, _ = load(str(model_dir))
        for n in lengths:
            base = toks(n, n)
            cuts = [int(c) for c in np.random.default_rng(n + 1).integers(n // 4, n - 1, queries)]
            for mode in MODES:
                store = work / f"store-{arch}-{size}-{n}-{mode}"
                with kvstore.open(store, exact_prefill=mode, memory_bytes=0) as s:
                    mc = s.bind(model, model_dir, **bind)
                    generate(mc, base)
                    s.flush()
                    got = [compare(mc, base[:c] + toks(64, c)) for c in cuts] + [compare(mc, base)]
                shutil.rmtree(store)
                row = {"model": f"{arch} {size}" + (" (QuantizedKVCache)" if bind else ""), "tokens": n,
                       "mode": mode, "queries": len(got),
                       "greedy_agree": sum(g["greedy_agree"] for g in got), "greedy_total": GREEDY * len(got),
                       "kv_bitwise": sum(g["kv_bitwise"] for g in got),
                       "max_logit_diff": max(g["logit_diff"] for g in got),
                       "reused": sum(g["reused"] for g in got), "query_tokens": sum(g["tokens"] for g in got),
                       "warm_s": statistics.median(g["warm_s"] for g in got),
                       "cold_s": statistics.median(g["cold_s"] for g in got)}
                rows.append(row)
                C.log(f"{row['model']} {n} {mode}: {row}")
    return rows


def prefill_speed(work: Path, lengths: list[int], reps: int) -> list[dict]:
    """Cold prefill of `n` tokens in steps of 256, 2048 and one piece; and the canary's step."""
    from mlx_lm import load

    model_dir = build_demo_model(work / "llama-small-speed", "llama", size="small")
    model, _ = load(str(model_dir))
    rows = []
    for n in lengths:
        prompt = toks(n, 7)
        times: dict[str, list[float]] = {}
        for _ in range(reps):  # round by round: every step size sees the same load
            for name, step in (("256", 256), ("2048", 2048), ("whole", n)):
                cache = make_prompt_cache(model)
                t0 = time.perf_counter()
                process(model, cache, prompt[:-1], list(range(step, n - 1, step)) + [n - 1])
                times.setdefault(f"prefill_{name}", []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                canary_of(n - 1, prompt[-1], last_step(model, cache, prompt[-1]))
                times.setdefault("last_step", []).append(time.perf_counter() - t0)
        rows.append({"tokens": n, **{k: statistics.median(v) for k, v in times.items()}})
        C.log(f"prefill {n}: {rows[-1]}")
    return rows


def conversation(work: Path, turns: int) -> list[dict]:
    from mlx_lm import load

    model_dir = build_demo_model(work / "llama-tiny-chat", "llama", size="tiny")
    model, _ = load(str(model_dir))
    rows = []
    for mode in MODES:
        store = work / f"chat-{mode}"
        with kvstore.open(store, exact_prefill=mode, memory_bytes=0) as s:
            mc = s.bind(model, model_dir)
            prompt, reused, total = toks(1024, 21), 0, 0
            for turn in range(turns):
                prompt = prompt + toks(64, 30 + turn)
                start = prompt_cache(mc, prompt)
                reused, total = reused + start.reused, total + len(prompt)
                logprobs = run(model, start.cache, start.rest, mc.exact or MLX_STEP)
                canary = canary_of(len(prompt) - 1, prompt[-1], logprobs)
                if start.hold is not None:
                    start.hold.submit(canary)
                reply = [int(mx.argmax(logprobs))]
                while len(reply) < 48:
                    reply.append(int(mx.argmax(last_step(model, start.cache, reply[-1]))))
                insert_generated(mc, prompt, reply, start.cache, canary)
                prompt = prompt + reply
        shutil.rmtree(store)
        rows.append({"mode": mode, "turns": turns, "reused": reused, "prompt_tokens": total})
        C.log(f"conversation {mode}: {rows[-1]}")
    return rows


def snapshot(store: Path) -> dict:
    return {str(p): (xxhash.xxh3_64_hexdigest(p.read_bytes()), p.stat().st_mtime_ns)
            for p in sorted(store.rglob("*")) if p.is_file()}


def verify_speed(work: Path, prompts: int) -> list[dict]:
    from mlx_lm import load

    model_dir = build_demo_model(work / "llama-tiny-verify", "llama", size="tiny")
    model, _ = load(str(model_dir))
    system = toks(256, 11)
    rows = []
    for mode in (256, "off"):
        store = work / f"verify-{mode}"
        with kvstore.open(store, exact_prefill=mode) as s:
            mc = s.bind(model, model_dir)
            for i in range(prompts):
                mc.prefill(system + toks(50 + (i * 37) % 400, 100 + i))
        before = snapshot(store)
        t0 = time.perf_counter()
        with kvstore.open(store, read_only=True, memory_bytes=0, create=False) as s:
            report = s.verify_exact(model, model_dir, sample=None)
        seconds = time.perf_counter() - t0
        rows.append({"mode": mode, "prompts": len(report.checks), "ok": report.ok, "seconds": seconds,
                     "per_prompt_s": seconds / max(1, len(report.checks)),
                     "canaries": sum(c.canaries_ok for c in report.checks),
                     "unchanged": snapshot(store) == before, "verdict": report.verdict()})
        C.log(f"verify {mode}: {rows[-1]}")
        shutil.rmtree(store)
    return rows


FIRST_RESTORE = """
import sys, time
sys.path.insert(0, {bench!r})
import common as C
import kvstore
from kvstore.restore import selfcheck
if sys.argv[1] == "skip":
    selfcheck._STATE["checked"] = True  # as if this process had checked a restore already
with kvstore.open(sys.argv[2], memory_bytes=0) as store:
    mc = store.bind(C.SHAPES["qwen3-0.6b"].model(), "qwen-shape", fingerprint=bytes(16))
    tokens = C.random_tokens({tokens}, 1).tolist()
    t0 = time.perf_counter()
    cache, rest = mc.fetch(tokens)
    print(time.perf_counter() - t0, len(tokens) - len(rest), selfcheck.state()["arrays_checked"])
"""


def selfcheck_cost(work: Path, tokens: int, rounds: int) -> dict:
    """The first restore of a fresh process with the self-check and with it skipped."""
    import subprocess
    import sys

    shape = C.SHAPES["qwen3-0.6b"]
    store = work / "selfcheck"
    with kvstore.open(store) as s:
        mc = s.bind(shape.model(), "qwen-shape", fingerprint=bytes(16))
        mc.insert(C.random_tokens(tokens, 1).tolist(), C.random_cache(shape, tokens))
    script = FIRST_RESTORE.format(bench=str(C.HERE), tokens=tokens + 1)
    times: dict[str, list[float]] = {"checked": [], "skip": []}
    for _ in range(rounds):
        for how in ("checked", "skip"):
            out = subprocess.run([sys.executable, "-c", script, how, str(store)], capture_output=True, text=True,
                                 check=True, cwd=str(C.REPO)).stdout.split()
            times[how].append(float(out[0]))
    shutil.rmtree(store)
    row = {"tokens": tokens, "kv_bytes": shape.bytes_per_token * tokens,
           **{f"first_restore_{k}_s": statistics.median(v) for k, v in times.items()}}
    C.log(f"self-check: {row}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2k tokens only, fewer queries and prompts")
    ap.add_argument("--only", nargs="*", choices=PARTS, help="run these parts, keep the others' last results")
    ap.add_argument("--table", action="store_true", help="print the last run's tables")
    args = ap.parse_args()
    last = C.RESULTS / "exact.json"
    if args.table:
        print(report_sections.exact_table(json.loads(last.read_text())))
        return
    C.preload_openblas("exact")
    data = json.loads(last.read_text()) if args.only and last.exists() else {}
    data.update(cpu=C.machine().get("cpu"), blas=C.blas_in_use(), load_before=round(os.getloadavg()[0], 2))
    work = Path(tempfile.mkdtemp(prefix="kvstore-exact-"))
    lengths = [2048] if args.quick else [2048, 8192]
    run = {"exactness": lambda: exactness(work, lengths, 2 if args.quick else 4),
           "prefill": lambda: prefill_speed(work, lengths, 2 if args.quick else 3),
           "verify": lambda: verify_speed(work, 20 if args.quick else 100),
           "conversation": lambda: conversation(work, 6 if args.quick else 12),
           "selfcheck": lambda: selfcheck_cost(work, 2048 if args.quick else 8192, 3 if args.quick else 5)}
    try:
        for part in args.only or PARTS:
            data[part] = run[part]()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data["load_after"] = round(os.getloadavg()[0], 2)
    path = C.write_result("exact", data)
    print(report_sections.exact_table(json.loads(path.read_text())))
    C.log(f"wrote {path}")


if __name__ == "__main__":
    main()
