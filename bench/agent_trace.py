"""An agent-like trace under `admit="all"` and `admit="reused"`: what is written, and what it costs.

The trace: PROMPTS prompts of TOKENS/4 to TOKENS tokens (default 200 of 1,025-2,048; `--tokens
8192` gives 2,048-8,192, several times slower), each one of 10 shared system prompts (1,024
tokens) and a task of its own; 30% of them come again later (the
same prompt, sent at a random later point). Every prompt is served as a server does it: fetch
the longest stored prefix, prefill the rest (in steps of 2,048 tokens, as mlx_lm.generate),
sample the first token, insert the prompt. Each policy runs on a fresh store:

- bytes written to disk (the store's write log: `stats()["writes"]`), records kept out, bytes held;
- the hit rate: prompt tokens restored instead of computed, over the whole trace;
- time to first token of the repeats, in the trace and after a restart (the store closed and
  opened again, memory tier empty), with the recompute of the same prompts beside them.

The model is the built-in demo model (llama, tiny, float32: 1 KiB of K/V a token), so that the
default trace runs in minutes on a CPU with mlx's reference BLAS; `--prompts` and `--tokens`
scale it (`--prompts 20` for a quick look). The load average is recorded beside
the numbers: compare the two policies within one run.

    python bench/agent_trace.py [--prompts 200] [--tokens 2048] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import time

import common as C
import mlx.core as mx
import mlx_lm
import numpy as np
import report_sections

import kvstore
from kvstore.demo import VOCAB_SIZE, build_demo_model

SYSTEM_PROMPTS = 10
SYSTEM_TOKENS = 1024
REPEAT_SHARE = 0.3
PREFILL_STEP = 2048
POLICIES = ("all", "reused")


def make_trace(n: int, max_tokens: int, seed: int) -> tuple[list[list[int]], list[bool]]:
    """`n` prompts, and whether each is a repeat of an earlier one."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, VOCAB_SIZE) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEM_PROMPTS)]
    repeats = int(n * REPEAT_SHARE)
    first = []
    for i in range(n - repeats):
        length = rng.randint(max(max_tokens // 4, SYSTEM_TOKENS + 1), max_tokens)
        task = [rng.randrange(1, VOCAB_SIZE) for _ in range(length - SYSTEM_TOKENS)]
        first.append(systems[i % SYSTEM_PROMPTS] + task)
    trace = [(p, False) for p in first]
    for _ in range(repeats):  # each repeat comes at a random point after its first sight
        k = rng.randrange(len(first))
        at = rng.randint(trace.index((first[k], False)) + 1, len(trace))
        trace.insert(at, (first[k], True))
    return [p for p, _ in trace], [r for _, r in trace]


def serve(model, mc, tokens: list[int]) -> tuple[float, int]:
    """(time to first token, tokens restored) for one prompt, inserted afterwards."""
    t0 = time.perf_counter()
    cache, rest = mc.fetch(tokens) if mc is not None else (mlx_lm.models.cache.make_prompt_cache(model), tokens)
    for i in range(0, len(rest), PREFILL_STEP):
        logits = model(mx.array([rest[i : i + PREFILL_STEP]]), cache=cache)
    mx.eval(mx.argmax(logits[0, -1]))
    ttft = time.perf_counter() - t0
    if mc is not None:
        mc.insert(tokens, cache)
    return ttft, len(tokens) - len(rest)


def run_policy(policy: str, model, model_path, trace, repeat, work) -> dict:
    store_dir = work / policy
    asked = sum(map(len, trace))
    with kvstore.open(store_dir, admit=policy) as store:
        mc = store.bind(model, model_path)
        ttft, restored = [], 0
        for tokens, again in zip(trace, repeat):
            t, got = serve(model, mc, tokens)
            restored += got
            if again:
                ttft.append(t)
        store.flush()
        stats = store.stats()
    w = stats["writes"]
    repeats = [t for t, again in zip(trace, repeat) if again]
    with kvstore.open(store_dir) as store:  # a restart: RAM is empty, the disk is what is left
        mc = store.bind(model, model_path)
        after = [serve(model, mc, tokens) for tokens in repeats]
    return {
        "policy": policy, "bytes_written": w["bytes_lifetime"], "records_written": w["records_lifetime"],
        "bytes_on_disk": stats["bytes"], "not_admitted": w["not_admitted"],
        "not_admitted_bytes": w["not_admitted_bytes"], "hit_rate": restored / asked,
        "repeat_ttft_median_s": statistics.median(ttft),
        "repeat_ttft_after_restart_median_s": statistics.median(t for t, _ in after),
        "repeat_hit_rate_after_restart": sum(got for _, got in after) / sum(map(len, repeats)),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=C.positive_int, default=200, help="prompts in the trace (default 200)")
    ap.add_argument("--tokens", type=C.positive_int, default=2048, help="longest prompt; the shortest is a quarter, at least the system prompt and one token (default 2048; 8192 for 2-8k prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="20 prompts (as bench/run_all.py --quick asks)")
    args = ap.parse_args()
    if args.quick:
        args.prompts = min(args.prompts, 20)
    work = C.scratch_dir("agent-trace")
    model_path = build_demo_model(work / "model", "llama", size="tiny", dtype="float32")
    model, _ = mlx_lm.load(str(model_path))
    trace, repeat = make_trace(args.prompts, args.tokens, args.seed)
    load_start = round(os.getloadavg()[0], 2)
    C.log(f"{len(trace)} prompts, {sum(map(len, trace))} tokens, {sum(repeat)} repeats; load {load_start}")
    recompute = [serve(model, None, t)[0] for t, again in zip(trace, repeat) if again]
    rows = []
    for policy in POLICIES:
        t0 = time.perf_counter()
        rows.append(run_policy(policy, model, model_path, trace, repeat, work))
        C.log(f"{policy}: {time.perf_counter() - t0:.0f}s", rows[-1])
    shutil.rmtree(work, ignore_errors=True)
    out = {"machine": C.machine(), "load_start": load_start, "blas": C.blas_in_use(), "quick": args.quick, "prompts": len(trace),
           "min_tokens": max(args.tokens // 4, SYSTEM_TOKENS + 1), "max_tokens": args.tokens,
           "tokens": sum(map(len, trace)), "repeats": sum(repeat),
           "recompute_ttft_median_s": statistics.median(recompute), "policies": rows}
    path = C.write_result("agent_trace", out)
    report_sections.agent_trace(print, json.loads(path.read_text()))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
