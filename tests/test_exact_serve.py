"""`kvstore serve` and `PersistentPromptCache` in exact mode, and the canary of a request's first step.

In exact mode the prompt cache prefills the prompt but its last token itself, in the store's steps,
stores it as it goes, and leaves the last token to the server; what the server computes after
that (the first step, decoding) is never stored. The first step's log-probabilities (mlx_lm.server's
own, hooked where it runs them) are the prompt's canary, in the header of the record that stores the
prompt's end. Out of exact mode the canary goes with the request's insert. Over real HTTP: a repeated
prompt reuses all but its last token, answers as the cold request did, and its canary is on disk.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from test_certify import stored_canaries
from test_server import Server, ask, cached

import kvstore
from kvstore.model.prefill import last_step
from kvstore.serve.promptcache import PersistentPromptCache

C = 16


def toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def serve_one(pc: PersistentPromptCache, model, prompt: list[int], made: int = 3) -> list[int]:
    """What mlx_lm.server does with one request: fetch, the rest on the cache it got (or a new
    one), the first step shown to the cache, decoding, then the insert of every token."""
    cache, rest = pc.fetch_nearest_cache("m", prompt)
    if cache is None:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
    if len(rest) > 1:
        model(mx.array([rest[:-1]]), cache=cache)
    logprobs = last_step(model, cache, rest[-1])
    pc.first_steps.seen(logprobs, rest=rest)
    out = [int(mx.argmax(logprobs))]
    while len(out) < made:
        out.append(int(mx.argmax(last_step(model, cache, out[-1]))))
    pc.insert_cache("m", prompt + out, cache)
    return out


def test_exact_mode_prefills_stores_the_prompt_and_keeps_its_canary(tmp_path, llama):
    path, model = llama
    prompt = toks(75, 1)
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=32) as store:
        pc = PersistentPromptCache(store)
        pc.register("m", store.bind(model, path))
        cache, rest = pc.fetch_nearest_cache("m", prompt)
        assert len(rest) == 1 and cache[0].offset == 74  # prefilled here, in steps of 32
        assert pc.counters["reused_tokens"] == 0
        logprobs = last_step(model, cache, rest[0])
        pc.first_steps.seen(logprobs, rest=rest)
        pc.insert_cache("m", prompt + [int(mx.argmax(logprobs))], cache)  # computed by the server: not stored
        pc.flush()
        stats = store.stats()
        assert (stats["chunks"], stats["tails"]) == (2, 1)  # [0, 32), [32, 64), [64, 74)
        assert len(pc) == 1 and pc.first_steps.canaries == 1
        again, rest = pc.fetch_nearest_cache("m", prompt)  # the same prompt: all but its last token
        assert len(rest) == 1 and pc.counters["reused_tokens"] == 74
        assert mx.array_equal(last_step(model, again, rest[0]), logprobs).item()
    (canary,) = stored_canaries(tmp_path / "s")
    assert (canary.at, canary.token, canary.ids[0]) == (74, prompt[-1], int(mx.argmax(logprobs)))


def test_out_of_exact_mode_the_canary_goes_with_the_requests_insert(tmp_path, llama):
    path, model = llama
    prompt = toks(50, 2)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        pc = PersistentPromptCache(store)
        pc.register("m", store.bind(model, path))
        serve_one(pc, model, prompt)
        serve_one(pc, model, prompt + toks(10, 3))  # a hit: the rest is computed on the store's cache
        pc.flush()
    found = sorted((c.at, c.token) for c in stored_canaries(tmp_path / "s"))
    assert found == [(49, prompt[-1]), (59, toks(10, 3)[-1])]
    with kvstore.open(tmp_path / "s", chunk_size=C, read_only=True) as store:
        report = store.verify_exact(model, path, sample=None)
    assert report.ok and sum(c.canaries_ok for c in report.checks) == 2, report.table()


def test_kvstore_serve_in_exact_mode(demo_model, tmp_path):
    """Over real HTTP (mlx_lm.server's batched path): the first request is prefilled by kvstore
    in steps of 256 and stored; the same prompt again reuses all but its last token and answers
    as the cold request did; the first step's canary reached the disk. A request whose logits a
    logit bias changes is neither a canary nor checked against one: the record stays."""
    model = demo_model("llama")
    prompt = "".join(chr(97 + i % 26) for i in range(300))
    with Server(model, tmp_path / "store", tmp_path / "log", "--exact-prefill", "256") as server:
        cold, usage = ask(server, prompt=prompt, max_tokens=8, logit_bias={})  # the model's own logits
        again, usage2 = ask(server, prompt=prompt, max_tokens=8, logit_bias={})
        _, biased = ask(server, prompt=prompt, max_tokens=8, logit_bias={"65": 50.0})  # another best token
        _, usage4 = ask(server, prompt=prompt, max_tokens=8, logit_bias={})
        assert server.stop() == 0
    log = server.log()
    assert "computed in exact steps and stored" in log
    assert again == cold
    assert cached(usage2) == usage2["prompt_tokens"] - 1
    assert cached(usage) == 0  # handed over in the cache, but computed by kvstore: not cached tokens
    assert [c.at for c in stored_canaries(tmp_path / "store")] == [usage["prompt_tokens"] - 1]
    assert "does not give the canary" not in log and "quarantined" not in log, log
    assert cached(biased) == cached(usage4) == usage["prompt_tokens"] - 1
