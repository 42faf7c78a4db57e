"""Run by tests/test_exact.py in fresh processes: the paired cold-against-restored comparisons.

    python tests/exact_proc.py write CASES_JSON     # generate each case's turns, storing as `generate` does
    python tests/exact_proc.py compare CASES_JSON   # each case's query: restored from its store vs cold

A case: {"store", "model", "settings" (kvstore.open), "bind" (store.bind options), "turns" (token
lists: a turn after the first is the previous turn, its generated tokens, then these), "new"
(max tokens each turn generates), "query": how the compared prompt is made from the last turn:
{"tokens": [...]} appended to the last turn and its generation, or {"cut": n} its first n tokens}.
`write` prints {name: query tokens}; `compare` reads them back from the case's "query_tokens"
and prints {name: result}. A generation runs as `kvstore generate` does (`model.prefill.prompt_cache`,
the rest as mlx-lm's generation runs it, the first step's canary, then the insert).
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np

import kvstore
from kvstore.model.prefill import canary_of, insert_generated, last_step, prompt_cache, run

GREEDY = 32
MLX_STEP = 2048  # mlx-lm's prefill_step_size


_MODELS: dict[str, object] = {}


def _open(case: dict):
    from mlx_lm import load

    if case["model"] not in _MODELS:
        _MODELS[case["model"]] = load(case["model"])[0]
    model = _MODELS[case["model"]]
    store = kvstore.open(case["store"], **case.get("settings", {}))
    return model, store, store.bind(model, case["model"], **case.get("bind", {}))


def generate(mc, tokens: list[int], n: int) -> list[int]:
    """`n` greedy tokens for `tokens`, reusing and storing as `kvstore generate` does."""
    start = prompt_cache(mc, tokens)
    logprobs = run(mc.model, start.cache, start.rest, mc.exact or MLX_STEP)
    canary = canary_of(len(tokens) - 1, tokens[-1], logprobs)
    if start.hold is not None:
        start.hold.submit(canary)
    out = [int(mx.argmax(logprobs))]
    while len(out) < n:
        out.append(int(mx.argmax(last_step(mc.model, start.cache, out[-1]))))
    insert_generated(mc, tokens, out, start.cache, canary)
    return out


def write(cases: list[dict]) -> dict:
    queries = {}
    for case in cases:
        model, store, mc = _open(case)
        with store:
            prompt, made = [], []
            for turn in case["turns"]:
                prompt = prompt + made + turn
                made = generate(mc, prompt, case.get("new", 8))
            q = case["query"]
            queries[case["name"]] = prompt[: q["cut"]] if "cut" in q else prompt + made + q["tokens"]
    return queries


def _greedy(model, cache: list, logprobs: mx.array) -> tuple[list[int], list[float]]:
    tokens, leads = [], []
    for i in range(GREEDY):
        lp = np.asarray(logprobs.astype(mx.float32))
        top = np.sort(lp)[-2:]
        tokens.append(int(np.argmax(lp)))
        leads.append(float(top[1] - top[0]))
        if i + 1 < GREEDY:
            logprobs = last_step(model, cache, tokens[-1])
    return tokens, leads


def _kv(mc, cache: list, n: int) -> dict[str, tuple[mx.array, int | None]]:
    out = {}
    for i, (codec, layer) in enumerate(zip(mc.codecs, cache)):
        out.update({f"{i}.{k}": v for k, v in codec.deltas(layer, n).items()})
        out.update({f"{i}.state.{k}": (a, None) for k, a in codec.checkpoint(layer).items()
                    if isinstance(a, mx.array) and a.ndim >= 3})
    return out


def compare(case: dict) -> dict:
    """The case's query restored from its store and run as generation runs it, against a cold
    run of it on an empty cache, in the same steps (the store's in exact mode)."""
    model, store, mc = _open(case)
    with store:
        q = case["query_tokens"]
        step = mc.exact or MLX_STEP
        restored, rest = mc.fetch(q)
        p = len(q) - len(rest)
        mine = run(model, restored, rest, step)
        cold = mc.new_cache()
        theirs = run(model, cold, q, step)
        a, b = _kv(mc, restored, len(q)), _kv(mc, cold, len(q))
        before, after, bitwise_after = 0.0, 0.0, True
        for name, (x, origin) in a.items():
            y = b[name][0]
            cut = max(0, min(x.shape[2], p - origin)) if origin is not None else 0
            diff = mx.abs(x.astype(mx.float32) - y.astype(mx.float32))
            if cut:
                before = max(before, float(diff[:, :, :cut].max()))
            if x.shape[2] > cut:
                after = max(after, float(diff[:, :, cut:].max()))
                bitwise_after &= bool(mx.array_equal(x[:, :, cut:], y[:, :, cut:]).item())
        ours, _ = _greedy(model, restored, mine)
        ref, leads = _greedy(model, cold, theirs)
        return {"restored": p, "tokens": len(q), "kv_before": before, "kv_after": after,
                "kv_after_bitwise": bitwise_after,
                "logits": float(mx.abs(mine.astype(mx.float32) - theirs.astype(mx.float32)).max()),
                "greedy": ours, "greedy_cold": ref, "leads": leads}


if __name__ == "__main__":
    action, cases = sys.argv[1], json.loads(sys.argv[2])
    if action == "write":
        print(json.dumps(write(cases)))
    else:
        print(json.dumps({case["name"]: compare(case) for case in cases}))
