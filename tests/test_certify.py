"""Canaries, `verify --exact` and the restore's backend self-check.

- A canary is kept in the header of the record that stores a prompt's end, by `warm` (one step
  of the last token) and by `generate` (its first step), in exact mode and out of it; it survives
  a rebuilt index; its text is checked as any header field.
- `kvstore verify --exact` exits 0 on a healthy store and never modifies it (every file's bytes
  and times, the index included, are the same after); a record whose K/V were altered together
  with their checksums (so no checksum can see it) makes it exit 1, caught by the record's canary
  and by the K/V comparison; `Store.verify_exact` is the same check.
- The first restore of a process compares its arrays, through mlx, with the bytes they were read
  from; when they differ (here: the restore made to write into a copy instead of mlx's memory)
  the process restores by copy from then on, says so once and counts it, and serves exact K/V.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from kvtest import alter_record, run_cli

import kvstore
from kvstore import canary as canaries
from kvstore.errors import BlobError
from kvstore.model.prefill import run
from kvstore.restore import fill, selfcheck
from kvstore.storage import blobformat

C = 16


def toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def stored_canaries(store: Path) -> list[canaries.Canary]:
    out = []
    for path in sorted((store / "blobs").rglob("*.safetensors")):
        found = blobformat.read_record(path.read_bytes(), path).extensions.get("canary")
        if found is not None:
            out.append(found)
    return out


def snapshot(store: Path) -> dict[str, tuple]:
    """Every file under the store: its bytes' hash, size and modification time."""
    return {str(p.relative_to(store)): (xxhash.xxh3_64_hexdigest(p.read_bytes()), p.stat().st_size,
                                        p.stat().st_mtime_ns)
            for p in sorted(store.rglob("*")) if p.is_file()}


def test_a_canary_round_trips_and_checks_a_replay():
    lp = np.log(np.array([0.5, 0.2, 0.1, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005]))
    c = canaries.of(41, 7, lp)
    assert c.ids[:3] == (0, 1, 2) and len(c.ids) == 8 and c.at == 41 and c.token == 7
    assert canaries.parse(c.text()) == c
    assert canaries.check(c, lp).ok and canaries.check(c, lp + 3.0).ok  # logits: normalised first
    moved = lp.copy()
    moved[0], moved[1] = moved[1], moved[0]
    assert canaries.check(c, moved).reason.startswith("the best token")
    for bad in ('{"v":1}', "[]", "x" * 2000, c.text().replace('"token":7', '"token":-7')):
        with pytest.raises(ValueError):
            canaries.parse(bad)
    assert canaries.parse('{"v":2,"what":"a later canary"}') is None  # kept, not read, not damage
    meta = blobformat.with_extensions({"hash": "00"}, {"canary": c.text()})
    assert blobformat.extensions(meta)["canary"] == c
    with pytest.raises(BlobError, match="x-canary"):
        blobformat.extensions({"x-canary": '{"v":1,"at":1}'})


@pytest.mark.parametrize("exact", [256, "off"])
def test_warm_and_generate_keep_the_canary_of_the_prompts_end(tmp_path, demo_model_path, exact):
    store = tmp_path / "s"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"tokens": toks(300, 1)}) + "\n")
    run_cli("warm", "--store", store, "--model", demo_model_path, "--prompts", prompts, "--exact-prefill", exact)
    run_cli("generate", "--store", store, "--model", demo_model_path, "--prompt", "a" * 40, "--max-tokens", "4")
    found = {c.at: c for c in stored_canaries(store)}
    assert set(found) == {299, 39}  # each prompt's last token
    assert found[299].token == toks(300, 1)[-1] and found[39].token == ord("a")
    result = run_cli("verify", "--store", store, "--exact", "--sample", "all", "--model", demo_model_path)
    assert "2 canaries reproduced" in result.stdout and "exact: 2 of 2" in result.stdout


def test_verify_exact_passes_a_healthy_store_and_writes_nothing(tmp_path, demo_model_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:  # the command's chunk size
        mc = store.bind(model, path)
        base = toks(260, 2)
        for i in range(3):
            mc.prefill(base + toks(30 + 9 * i, 3 + i))
    before = snapshot(tmp_path / "s")
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path)
    assert result.returncode == 0
    assert "exact: 3 of 3 stored prompts checked (exact mode, steps of 256" in result.stdout
    assert "bit for bit" in result.stdout and "3 canaries reproduced" in result.stdout
    with kvstore.open(tmp_path / "s") as store:  # the library, through a read-only twin
        report = store.verify_exact(model, path, sample=2)
    assert report.ok and len(report.checks) == 2 and report.stored_prompts == 3
    assert all(c.kv_bitwise and c.logprobs == 0 and c.greedy == 32 for c in report.checks)
    assert snapshot(tmp_path / "s") == before  # no access time, no admission row, nothing


def test_verify_exact_checks_caches_stored_quantized_by_mlx_lm(tmp_path, demo_model):
    """A store of QuantizedKVCache caches (bound with kv_bits, as mlx_lm.server --kv-bits makes
    them): the command finds them by itself when they are all the store holds of the model, and
    takes --kv-bits when it holds both kinds."""
    from mlx_lm import load

    path = demo_model_path = demo_model("llama", "small")  # head size 32: one group of 32
    model = load(str(path))[0]
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:
        store.bind(model, path, kv_bits=8, kv_group_size=32).prefill(toks(300, 4))
    before = snapshot(tmp_path / "s")
    found = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path)
    assert found.returncode == 0, found.stdout + found.stderr
    assert "QuantizedKVCache, 8 bits, group size 32): checking those" in found.stderr
    assert "exact: 1 of 1 stored prompts checked" in found.stdout and "bit for bit" in found.stdout
    assert snapshot(tmp_path / "s") == before  # read, never written
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:  # and the same model unquantized
        store.bind(model, path).prefill(toks(300, 5))
    plain = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path)
    assert plain.returncode == 0 and "exact: 1 of 1" in plain.stdout
    asked = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path,
                    "--kv-bits", "8", "--kv-group-size", "32")
    assert asked.returncode == 0 and "exact: 1 of 1" in asked.stdout and "checking those" not in asked.stderr
    wrong = run_cli("verify", "--store", tmp_path / "s", "--kv-bits", "8", check=False)
    assert wrong.returncode == 2 and "go with --exact" in wrong.stderr
    alone = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path,
                    "--kv-group-size", "32", check=False)  # was ignored: the unquantized caches checked
    assert alone.returncode == 2 and "--kv-group-size goes with --kv-bits" in alone.stderr, alone.stdout
    odd = run_cli("verify", "--store", tmp_path / "s", "--exact", "--kv-bits", "8", "--kv-group-size", "7",
                  check=False)
    assert odd.returncode == 2 and "argument --kv-group-size: invalid choice: 7" in odd.stderr, odd.stderr


def test_caches_mlx_lm_quantized_after_its_prefill_are_judged_within_the_bounds(tmp_path, demo_model):
    """Out of exact mode `serve --kv-bits` stores what mlx_lm.server computed: the prompt with a
    plain cache, quantized after its prefill; the certificate's cold run quantizes from token 0.
    The two differ by the quantization, and the packed words by anything: the certificate said
    MISMATCH on a healthy store (a packed word 'differing by 1.7e7') and printed the `rm` of every
    record. They are compared as the K/V they hold, within the bounds of 8-bit K/V; a record
    altered with its checksums is still named."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    path = demo_model("llama", "small")  # head size 32: one group of 32
    model = load(str(path))[0]
    prompt = toks(300, 4)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))  # as mlx-lm prefills: plain, then quantized
    cache = [layer.to_quantized(group_size=32, bits=8) for layer in cache]
    with kvstore.open(tmp_path / "s") as store:
        store.bind(model, path, kv_bits=8, kv_group_size=32).insert(prompt, cache)
        store.flush()
        first = next(r for r in store.index.rows() if r.depth == 1)
    healthy = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", path, check=False)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "8-bit K/V quantized by mlx-lm, judged against its bounds" in healthy.stdout
    assert "rm " not in healthy.stdout and "keys.0" not in healthy.stdout, healthy.stdout
    alter_record(tmp_path / "s", first.hash, "1.values.1", 1.5, strip_tag=True)  # its scales
    damaged = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", path, check=False)
    assert damaged.returncode == 1 and damaged.stdout.strip().splitlines()[-1].startswith("MISMATCH"), damaged.stdout
    assert f"record {first.hash.hex()[:12]} (tokens 0-256: most in 1.values" in damaged.stdout, damaged.stdout


def test_prompts_stored_with_another_exact_step_are_named_and_checked_when_asked(tmp_path, demo_model_path):
    """Each exact_prefill is a namespace of its own: a check of the store's own step says how many
    records of the model it did not check and with which option to check them, and
    `--exact-prefill` checks those, keeping nothing (the store's kept step is as it was)."""
    common = ("--store", tmp_path / "s", "--model", demo_model_path, "--max-tokens", "2")
    run_cli("generate", *common, "--prompt", "abc " * 100)  # exact mode off
    run_cli("generate", *common, "--prompt", "xyz " * 100, "--exact-prefill", "256")  # kept: 256
    before = snapshot(tmp_path / "s")
    own = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path)
    assert "exact: 1 of 1 stored prompts checked (exact mode, steps of 256" in own.stdout, own.stdout
    assert ("not checked: this model's prompts stored with another exact_prefill (2 records under off): "
            "check them with --exact-prefill off") in own.stderr, own.stderr
    off = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path, "--exact-prefill", "off")
    assert "exact: 1 of 1 stored prompts checked (token-exact reuse" in off.stdout, off.stdout
    assert "(2 records under 256): check them with --exact-prefill 256" in off.stderr
    assert snapshot(tmp_path / "s") == before
    alone = run_cli("verify", "--store", tmp_path / "s", "--exact-prefill", "off", check=False)
    assert alone.returncode == 2 and "--exact-prefill go with --exact" in alone.stderr


def test_an_altered_record_is_caught_by_its_canary_and_verify_exact(tmp_path, demo_model_path, llama):
    path, model = llama
    prompt = toks(300, 4)
    with kvstore.open(tmp_path / "s", exact_prefill=256) as store:
        mc = store.bind(model, path)
        mc.prefill(prompt)
        store.flush()
        first = next(r for r in store.index.rows() if r.kind == 0)  # tokens [0, 256)
    # Its trust tag taken away too: a store without a remote tier takes an untagged record as it is.
    alter_record(tmp_path / "s", first.hash, "1.keys", 1.5, strip_tag=True)
    assert run_cli("verify", "--store", tmp_path / "s").returncode == 0  # every checksum agrees
    before = snapshot(tmp_path / "s")
    result = run_cli("verify", "--store", tmp_path / "s", "--exact", "--model", demo_model_path, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "MISMATCH: 1 of the 1 stored prompts checked" in result.stdout
    assert "not bit for bit" in result.stdout and "canary at token 299" in result.stdout
    assert snapshot(tmp_path / "s") == before
    # The canary alone: the prompt's first 59 tokens restored, its last token run as one step.
    (kept,) = stored_canaries(tmp_path / "s")
    with kvstore.open(tmp_path / "s", read_only=True, memory_bytes=0) as store:
        cache, rest = store.bind(model, path).fetch(prompt[: kept.at] + [kept.token])
        assert not canaries.check(kept, np.asarray(run(model, cache, rest, 256).astype(mx.float32))).ok


def test_the_canary_survives_a_rebuilt_index(tmp_path, llama):
    from kvstore.upkeep.rebuild import rebuild_index

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).prefill(toks(50, 5))
    (tmp_path / "s" / "index.sqlite").unlink()
    for extra in ("index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / "s" / extra).unlink(missing_ok=True)
    rebuild_index(tmp_path / "s")
    with kvstore.open(tmp_path / "s", chunk_size=C, read_only=True) as store:
        report = store.verify_exact(model, path)
    assert report.ok and sum(c.canaries_ok for c in report.checks) == 1


@pytest.fixture
def fresh_check():
    selfcheck.reset()
    yield
    selfcheck.reset()


def test_the_first_restore_is_checked_and_passes_on_this_backend(tmp_path, llama, fresh_check):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        mc.prefill(toks(80, 6))
        mc.fetch(toks(80, 6))
        got = store.stats()["restore_check"]
    assert got["checked"] and not got["copying"] and got["arrays_checked"] == 8 and got["mismatches"] == 0


def test_a_backend_that_loses_the_restores_writes_falls_back_to_copies(tmp_path, llama, fresh_check,
                                                                      monkeypatch, caplog):
    from mlx_lm.models.cache import make_prompt_cache

    path, model = llama
    prompt = toks(90, 7)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).prefill(prompt)
    real = fill._host
    monkeypatch.setattr(fill, "_host", lambda a: np.array(real(a)))  # writes land in a copy, not in mlx's memory
    cold = run(model, make_prompt_cache(model), prompt)
    with caplog.at_level(logging.WARNING, logger="kvstore"), \
            kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        for _ in range(2):
            cache, rest = mc.fetch(prompt)
            assert len(rest) == 1
            # the K/V restored by copy (a backend that lost the writes would leave zeros); the cold
            # run computes the prompt in other shapes, which OpenBLAS rounds differently
            assert mx.allclose(run(model, cache, rest), cold, atol=1e-4, rtol=1e-4).item()
        got = store.stats()["restore_check"]
    assert got["copying"] and got["mismatches"] == 8 and got["copy_restores"] == 2
    said = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert len(said) == 1 and "restores by copy" in said[0]
    assert os.environ.get("KVSTORE_FAULT") is None


def test_a_tenants_prompts_are_checked_as_that_tenant(tmp_path, llama):
    """A tenant's records are keyed under its salt: checked as that tenant they restore (and are
    compared); the shared view holds none of them, and a prompt that restores nothing says so."""
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=32) as store:
        store.bind(model, path, tenant="alice").prefill(toks(70, 8))
        store.bind(model, path).prefill(toks(40, 9))
        store.flush()
        mine = store.verify_exact(model, path, tenant="alice")
        shared = store.verify_exact(model, path)
    assert mine.ok and [(c.tokens, c.restored) for c in mine.checks] == [(69, 69)]
    assert shared.ok and [(c.tokens, c.restored) for c in shared.checks] == [(39, 39)]


def test_kv_holding_nan_passes_the_self_check(tmp_path, llama, fresh_check, caplog):
    """The check compares bytes: K/V with NaN in it (a float16 model that overflowed) restores
    zero-copy, never as 'a backend that loses the writes' (NaN equals nothing, itself included)."""
    from kvtest import prefill

    path, model = llama
    prompt = toks(2 * C + 5, 8)
    cache = prefill(model, prompt)
    for layer in cache:
        layer.keys[..., 0] = mx.nan  # (every token's first feature)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).insert(prompt, cache)
    with caplog.at_level(logging.WARNING, logger="kvstore"), \
            kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        restored, rest = store.bind(model, path).fetch(prompt)
        assert len(rest) == 1 and mx.isnan(restored[0].state[0]).any().item()  # the case at hand
        got = store.stats()["restore_check"]
    assert got["checked"] and not got["copying"] and got["mismatches"] == 0
    assert "self-check" not in caplog.text


def test_the_table_flags_leads_and_greedy_ties_by_the_stores_own_tie_margin():
    # A store with K/V quantized on disk calls a lead under its logit bound (0.25 at 8 bits) a tie:
    # the table's `*` and its footnotes must say that bound, not the 0.02 of an exact store.
    from kvstore.certify import Report
    from kvstore.certify.report import Bounds, PromptCheck, judge

    bounds = Bounds("8-bit K/V on disk", exact=False, kv=1 / 16, logprobs=0.25, greedy=False, tie=0.25)
    check = judge(PromptCheck("ab" * 16, 100, restored=100, margin=0.1, greedy=4, greedy_tie=True, restore_points=1),
                  bounds)
    text = Report([check], bounds, 1).table()
    assert "0.100*" in text, text
    assert "led the next by under 0.25" in text and "led by under 0.25 are tie-sensitive" in text, text
    exact = Bounds("exact mode", exact=True)
    assert "*" not in Report([judge(PromptCheck("cd" * 16, 100, restored=100, margin=0.1, restore_points=1), exact)],
                             exact, 1).table()


def test_the_library_check_refuses_a_sample_that_checks_nothing(tmp_path, llama):
    # sample=0 said "the store holds no prompt of this model" of a store that holds one, and a
    # negative one raised random's "Sample larger than population or is negative".
    from kvstore.errors import InvalidInputError

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).prefill(toks(40, 6))
        for bad in (0, -3, "2", 1.5):
            with pytest.raises(InvalidInputError, match=f"sample={bad!r}: give how many stored prompts"):
                store.verify_exact(model, path, sample=bad)
        report = store.verify_exact(model, path, sample=100)  # more than the store holds: all of them
    assert report.ok and len(report.checks) == report.stored_prompts == 1


@pytest.mark.parametrize("exact", [None, 256])
def test_a_step_whose_logits_are_not_numbers_stores_the_prompt_without_a_canary(tmp_path, llama, monkeypatch, exact):
    # A model that overflows gives NaN logits: such a canary is a header the writer refuses, and
    # the record holding the prompt's end was dropped with it ("a write was dropped").
    from kvstore.model import prefill as prefilling

    path, model = llama
    real = prefilling.last_step
    monkeypatch.setattr(prefilling, "last_step", lambda *a: real(*a) * mx.array(float("nan")))
    prompt = toks(300, 7)
    with kvstore.open(tmp_path / "s", chunk_size=256 if exact else C, exact_prefill=exact) as store:
        store.bind(model, path).prefill(prompt)
        store.flush()
        assert store.stats()["writer"]["dropped_jobs"] == 0
    with kvstore.open(tmp_path / "s", chunk_size=256 if exact else C, read_only=True, memory_bytes=0) as store:
        # the prompt stored whole (exact mode: but its last token, restored for the same prompt again)
        _, rest = store.bind(model, path).fetch(prompt if exact else prompt + [1])
    assert len(rest) == 1
    assert stored_canaries(tmp_path / "s") == []
