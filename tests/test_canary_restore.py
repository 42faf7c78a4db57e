"""A restored run's first step is compared with the canary its record keeps, at no extra step.

The stored prompt asked for again restores all but its last token, and the first generation step
runs that token from there: the canary's own step. A record whose K/V were altered together with
their checksums (no checksum sees it) then gives another answer: the run warns once, naming the
record, counts it (`stats()["canary_mismatches"]`) and quarantines the records the restore used
(the canary cannot tell which holds the damage), so the next run computes the prompt again and answers as a cold run does. A store with 8-bit K/V on disk is
judged within its bounds and only reported.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from kvtest import alter_record, rewrite_blob, run_cli

import kvstore
from kvstore import canary as canaries
from kvstore.certify.firststep import check_first_step
from kvstore.model.prefill import canary_of, insert_generated, prompt_cache, run
from kvstore.storage import blobformat

C = 16


def toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def canary_record(store) -> bytes:
    """The record that keeps the stored prompt's canary."""
    for path in sorted((store / "blobs").rglob("*.safetensors")):
        if isinstance(blobformat.read_record(path.read_bytes(), path).extensions.get("canary"), canaries.Canary):
            return bytes.fromhex(path.stem)
    raise AssertionError("no record keeps a canary")


def generate(mc, prompt: list[int]):
    """The first step of a generation as `kvstore generate` runs it, checked against the canary;
    the prompt stored as it stores it. Returns (check, first step's log-probabilities, reused)."""
    start = prompt_cache(mc, prompt)
    logprobs = run(mc.model, start.cache, start.rest)
    canary = canary_of(len(prompt) - 1, prompt[-1], logprobs)
    if start.hold is not None:
        start.hold.submit(canary)
    moved = check_first_step(mc, prompt, logprobs)
    logprobs = np.asarray(logprobs.astype(mx.float32))
    if moved is None or moved.ok:
        insert_generated(mc, prompt, [int(np.argmax(logprobs))], start.cache, canary)
    return moved, logprobs, start.reused


def first_record(store) -> bytes:
    """The prompt's first record (its first chunk): not the one that keeps the canary."""
    with kvstore.open(store, chunk_size=C) as s:
        return min(s.index.rows(), key=lambda r: r.depth).hash


@pytest.mark.parametrize("exact, altered", [(32, canary_record), ("off", canary_record), (32, first_record)])
def test_an_altered_record_is_caught_by_its_canary_on_a_repeat(tmp_path, llama, caplog, exact, altered):
    """Whichever record of the path holds the damage (the canary's own or one before it), the
    canary sees it, and every record the restore used is quarantined: the next run computes the
    whole prompt again, as a cold run does."""
    path, model = llama
    prompt = toks(60, 1 if altered is canary_record else 4)  # (a record is warned of once a process)
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=exact) as store:
        mc = store.bind(model, path)
        first, cold, _ = generate(mc, prompt)
        assert first is None  # nothing was restored: no canary to compare
        again, _, reused = generate(mc, prompt)
        assert reused == len(prompt) - 1 and again is not None and again.ok  # the canary's step, reproduced
        store.flush()
    assert altered(tmp_path / "s") != canary_record(tmp_path / "s") or altered is canary_record
    alter_record(tmp_path / "s", altered(tmp_path / "s"), "1.keys", 1.5, strip_tag=True)
    with caplog.at_level(logging.WARNING, logger="kvstore"), \
            kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=exact, memory_bytes=0) as store:
        mc = store.bind(model, path)
        moved, _, reused = generate(mc, prompt)
        assert reused == len(prompt) - 1 and moved is not None and not moved.ok
        assert store.stats()["canary_mismatches"] == 1
        said = [r.getMessage() for r in caplog.records if "does not give the canary" in r.getMessage()]
        assert len(said) == 1 and "quarantined" in said[0]
        _, after, reused = generate(mc, prompt)  # every record it used is quarantined: computed again
        assert reused == 0
        # What the first, cold run gave: bit for bit in exact mode, within kernel noise off it.
        assert np.array_equal(after, cold) if exact != "off" else np.allclose(after, cold, atol=1e-4)


@pytest.mark.parametrize("exact", ["off", "256"])
def test_generate_answers_as_a_cold_run_when_the_canary_does_not_hold(tmp_path, demo_model_path, exact):
    """The first step's check comes before any text is printed: the answer is computed again
    without the quarantined records (the cold run's text, never the damaged restore's), said in
    a line, its report counts the prompt as computed, and what it computed is stored again: the
    next run restores it and answers the same, in exact mode too."""
    store = tmp_path / "s"
    text = "the quick brown fox " * 16
    common = ("--store", store, "--model", demo_model_path, "--prompt", text, "--max-tokens", "8")
    cold = run_cli("generate", *common, "--exact-prefill", exact)
    alter_record(store, canary_record(store), "1.keys", 1.5, strip_tag=True)
    hit = run_cli("generate", *common)
    assert "does not give the canary it keeps" in hit.stderr
    assert "the answer is computed again without them" in hit.stderr, hit.stderr
    assert hit.stdout == cold.stdout
    last = hit.stderr.strip().splitlines()[-1]
    assert ", 0 reused from the store, " in last and "nothing stored" not in last, last
    again = run_cli("generate", *common)
    assert "canary" not in again.stderr and ", 0 reused" not in again.stderr
    assert "canary" not in again.stderr
    assert again.stdout == cold.stdout


def test_an_8bit_store_is_judged_within_its_bounds_and_only_reported(tmp_path, demo_model):
    from mlx_lm import load

    model_dir = str(demo_model("llama", "small", "bfloat16"))
    model = load(model_dir)[0]
    prompt = toks(60, 2)
    with kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=8) as store:
        mc = store.bind(model, model_dir)
        generate(mc, prompt)
        moved, _, reused = generate(mc, prompt)
        assert reused == len(prompt) - 1 and moved is not None and moved.ok, moved  # within 8-bit K/V's bound


@pytest.mark.parametrize("exact", [None, 32])
def test_a_cache_mlx_lm_quantizes_is_judged_within_its_bounds_out_of_exact_mode(tmp_path, demo_model, exact):
    """`serve --kv-bits 4`: a cold run computes the prompt before mlx-lm quantizes it, a restored
    one after, so their first steps differ by the quantization (0.015 on the demo model, far more
    on a real one). Out of exact mode a first step that far from the canary is within 4-bit K/V's
    bounds: not quarantined (every repeat would be computed again). In exact mode it is not."""
    from mlx_lm import load

    model_path = demo_model("llama", "small")  # head size 32: one group of 32
    model = load(str(model_path))[0]
    prompt = toks(60, 5)
    opts = {} if exact is None else {"exact_prefill": exact}
    with kvstore.open(tmp_path / "s", chunk_size=C, **opts) as store:
        mc = store.bind(model, model_path, kv_bits=4, kv_group_size=32)
        generate(mc, prompt)
        store.flush()  # (on disk, where a quarantine is counted: not only queued, as on a busy machine)
        start = prompt_cache(mc, prompt)
        assert start.reused == len(prompt) - 1
        logprobs = run(mc.model, start.cache, start.rest)
        moved = check_first_step(mc, prompt, logprobs + mx.where(mx.arange(logprobs.size) == mx.argmax(logprobs),
                                                                  0.3, 0.0).astype(logprobs.dtype))
        assert moved is not None and moved.ok is (exact is None), moved
        assert (store.stats()["quarantined"] > 0) is (exact is not None), store.stats()


def _scale_quantized(store, h: bytes, factor: float) -> None:
    """Scale every bf16 `*.scales` tensor of record `h` (K/V quantized on disk) and write their
    checksums with them, untagged: no checksum tells it from the record that was stored."""
    import json
    import struct

    from kvstore.storage import blobtree
    from kvstore.trust import HEADER_KEY

    path = blobtree.blob_path(store / "blobs", h)
    buf = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(buf[8 : 8 + n])
    sums = json.loads(header["__metadata__"]["checksums"])
    for name in [k for k in header if k.endswith(".scales")]:
        start, end = header[name]["data_offsets"]
        wide = np.frombuffer(bytes(buf[8 + n + start : 8 + n + end]), dtype="<u2").astype(np.uint32) << 16
        data = ((wide.view(np.float32) * np.float32(factor)).view(np.uint32) >> 16).astype("<u2")
        buf[8 + n + start : 8 + n + end] = data.tobytes()
        sums[name] = blobformat.tensor_checksum(data)
    header["__metadata__"]["checksums"] = json.dumps(sums, separators=(",", ":"))
    header["__metadata__"].pop(HEADER_KEY, None)
    rewrite_blob(store, h, buf, header)


def test_generate_on_an_8bit_store_answers_cold_and_does_not_say_it_quarantined(tmp_path, demo_model):
    """With K/V quantized on disk a missed canary is only reported: the records are kept. `kvstore
    generate` said they were quarantined and the answer computed again without them, then restored
    them again and answered from the damaged restore. It computes the prompt cold instead (as
    `kvstore serve` does), and says that the records are kept."""
    store = tmp_path / "s"
    model_dir = demo_model("llama", "small", "bfloat16")
    common = ("--store", store, "--model", model_dir, "--prompt", "the quick brown fox " * 16, "--max-tokens", "8")
    cold = run_cli("generate", *common, "--disk-kv-bits", "8")
    _scale_quantized(store, canary_record(store), 4.0)
    hit = run_cli("generate", *common)
    assert "does not give the canary it keeps" in hit.stderr and "the record is kept" in hit.stderr, hit.stderr
    assert "quarantined" not in hit.stderr and "its records are kept" in hit.stderr, hit.stderr
    assert hit.stdout == cold.stdout
    last = hit.stderr.strip().splitlines()[-1]
    assert ", 0 reused from the store, " in last, last


@pytest.mark.parametrize("host", [False, True], ids=["mlx", "numpy"])
def test_the_server_adapter_checks_the_first_step_and_stores_none_of_a_wrong_restore(tmp_path, llama, caplog, host):
    """`PersistentPromptCache` (an own server's calls, as mlx_lm.server makes them): the first
    step of a request that restored the stored prompt is compared with its canary; on a miss the
    record is quarantined and the request's cache is not stored again. An own server may hand
    `seen` its log-probabilities as a numpy array (`host`): they are kept and compared the same."""
    from kvstore.serve.promptcache import PersistentPromptCache

    path, model = llama
    prompt = toks(60, 3 + host)  # (another record each: a process warns of a record once)

    def request(store) -> int:
        pc = PersistentPromptCache(store)
        pc.register("m", store.bind(model, path))
        cache, rest = pc.fetch_nearest_cache("m", prompt)
        cache = cache if cache is not None else store.bind(model, path).new_cache()
        logprobs = run(model, cache, rest)
        pc.first_steps.seen(np.asarray(logprobs) if host else logprobs, rest=rest)
        pc.insert_cache("m", prompt + [int(np.argmax(np.asarray(logprobs)))], cache)
        store.flush()
        return len(prompt) - len(rest)

    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert request(store) == 0
    alter_record(tmp_path / "s", canary_record(tmp_path / "s"), "1.keys", 1.5, strip_tag=True)
    with caplog.at_level(logging.WARNING, logger="kvstore"), \
            kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        assert request(store) == len(prompt) - 1
        assert store.stats()["canary_mismatches"] == 1
        assert request(store) == 0  # the records it used are quarantined, and the tail was not stored again
    assert any("does not give the canary" in r.getMessage() for r in caplog.records)


def answer(server, body: dict, headers: dict) -> tuple[list, int, int]:
    """One completion: (each token with its 5 most likely and their log-probabilities, the
    prompt's tokens, the cached ones)."""
    import requests

    r = requests.post(server.url + "/v1/completions", json={**body, "logprobs": True, "top_logprobs": 5},
                      headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    return out["choices"][0]["logprobs"]["content"], usage["prompt_tokens"], \
        usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("exact, alone, tenant", [("off", False, None), ("off", True, None), ("256", False, None),
                                                 ("off", False, "a")])
def test_serve_answers_a_wrong_restore_as_a_cold_run(demo_model, tmp_path, exact, alone, tenant):
    """`kvstore serve` over real HTTP, batched (mlx_lm.server's default) and served alone (a
    request with a seed), for one tenant of several too: a request whose restore does not give
    its canary is computed again from its whole prompt before any of its tokens is sent, so its
    answer (every token and its top log-probabilities) is the cold request's, its usage counts no
    cached token, and what it computed is stored, as its tenant's: the next request restores it."""
    from test_server import Server, scrape

    store, text = tmp_path / "s", "".join(chr(97 + i * 7 % 26) for i in range(600))
    body = dict(prompt=text, max_tokens=8, temperature=0.0, **({"seed": 3} if alone else {}))
    tenants = ("--tenant-from", "header:X-Tenant") if tenant else ()
    headers = {"X-Tenant": tenant} if tenant else {}
    with Server(demo_model("llama"), store, tmp_path / "cold.log", "--exact-prefill", exact, *tenants) as server:
        cold, n, _ = answer(server, body, headers)
        assert server.stop() == 0
    alter_record(store, canary_record(store), "1.keys", 1.5, strip_tag=True)
    with Server(demo_model("llama"), store, tmp_path / "hit.log", *tenants) as server:
        hit, _, hit_cached = answer(server, body, headers)
        again, _, again_cached = answer(server, body, headers)
        recomputed = scrape(server)[("kvstore_canary_recomputes_total", ())]
        assert server.stop() == 0
    assert hit == cold  # every token and its top log-probabilities, not only the text
    assert hit_cached == 0
    log = server.log()
    assert "does not give the canary it keeps" in log, log
    assert "this request is computed again from its whole prompt before it is answered" in log, log
    # Exact mode stores what it computes in its own steps, so the next request restores it; out
    # of it the request's cache is stored after generation, and the RAM tier serves it.
    assert (again, again_cached) == (cold, n - 1)
    assert recomputed == 1


@pytest.mark.parametrize("fails", [False, True])
def test_the_request_is_computed_again_in_the_server_loop_or_answered_from_its_restore(tmp_path, llama, monkeypatch,
                                                                                      caplog, fails):
    """mlx_lm.server's `stream_generate`, as `kvstore serve` hooks it, in an own loop: a wrong
    restore is computed again (its reused tokens then count as computed, and its cache, the cold
    one, is stored: the next request restores it). When computing it again fails (its prefill
    raises here), the request is answered from the restore after all: its tokens count as
    reused, a warning says so, and none of its cache is stored."""
    from mlx_lm import load, stream_generate

    from kvstore.serve.promptcache import PersistentPromptCache
    from kvstore.serve.steps import hooks

    path, model = llama
    tokenizer = load(str(path))[1]
    prompt = toks(60, 6)

    def request(store) -> tuple[int, int]:
        pc = PersistentPromptCache(store)
        pc.register("m", store.bind(model, path))
        cache, rest = pc.fetch_nearest_cache("m", prompt)
        cache = cache if cache is not None else store.bind(model, path).new_cache()
        generate = hooks.first_step_stream(stream_generate, pc.first_steps)
        out = [r.token for r in generate(model=model, tokenizer=tokenizer, prompt=rest, prompt_cache=cache,
                                         max_tokens=3)]
        pc.insert_cache("m", prompt + out, cache)
        store.flush()
        return len(prompt) - len(rest), pc.first_steps.take_computed(prompt)

    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert request(store) == (0, 0)
    alter_record(tmp_path / "s", canary_record(tmp_path / "s"), "1.keys", 1.5, strip_tag=True)
    with caplog.at_level(logging.INFO, logger="kvstore"), \
            kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        with monkeypatch.context() as patch:
            if fails:
                patch.setattr(hooks, "prompt_cache", lambda *a, **k: 1 / 0)
            assert request(store) == (len(prompt) - 1, 0 if fails else len(prompt) - 1)
        assert request(store)[0] == (0 if fails else len(prompt) - 1)
    said = [r.getMessage() for r in caplog.records if "could not be computed again" in r.getMessage()]
    assert len(said) == fails
    # The lookup's own line said the prompt was reused: the one computed again says it was not.
    again = [r.getMessage() for r in caplog.records if "computed again: 0 reused" in r.getMessage()]
    assert again == ([] if fails else [f"kvstore: prompt {len(prompt)} tokens, computed again: 0 reused from the store"])


@pytest.mark.parametrize("hold", ["queued", "being_written"])
def test_a_record_quarantined_before_the_writer_wrote_it_is_never_served_from_disk(tmp_path, llama, monkeypatch,
                                                                                 hold):
    """A restore from RAM (the records still queued for the writer) whose first step misses the
    canary: the writer does not write those records afterwards ("queued"), or, when it was
    writing them at that moment ("being_written": the blob in place, its row not yet), it
    quarantines the row it has just committed. Either way no process restores them again."""
    import threading

    from kvstore import faults

    path, model = llama
    prompt = toks(60, 7)
    reached, go = threading.Event(), threading.Event()
    real_hit = faults.hit

    def slow(point):
        if point == "after_rename" and hold == "being_written" and go_armed.is_set() and not reached.is_set():
            reached.set()
            assert go.wait(60)
        real_hit(point)

    go_armed = threading.Event()
    monkeypatch.setattr(faults, "hit", slow)
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=32) as store:
        mc = store.bind(model, path)
        store.writer.pause()
        try:
            generate(mc, prompt)  # computed and queued, nothing written
            assert store.stats()["chunks"] == 0
            start = prompt_cache(mc, prompt)
            assert start.reused == len(prompt) - 1  # from RAM
            used = mc.restored_canary(prompt)[0]
            logprobs = run(mc.model, start.cache, start.rest)
            if hold == "being_written":
                go_armed.set()
                store.writer.resume()
                assert reached.wait(60)  # the writer is between a blob's rename and its row
            wrong = logprobs + mx.where(mx.arange(logprobs.size) == mx.argmax(logprobs), 0.3, 0.0).astype(logprobs.dtype)
            moved = check_first_step(mc, prompt, wrong)
            assert moved is not None and not moved.ok
        finally:
            go.set()
            store.writer.resume()
        assert store.flush(timeout=60)
        rows = {r.hash: r for r in store.index.rows()}
        assert len(used) == 2 and all(h not in rows or rows[h].bad for h in used), [(h.hex(), rows.get(h)) for h in used]
        assert mc.fetch(prompt)[1] == prompt  # nor from RAM
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=32) as store:
        assert store.bind(model, path).fetch(prompt)[1] == prompt
