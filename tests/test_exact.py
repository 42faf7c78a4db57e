"""Exact mode (`exact_prefill`): a restored run computes what a cold run computes, bit for bit.

The regression cases from the field, each a paired comparison in fresh processes
(`exact_proc.py`: the store written as `kvstore generate` writes it, then the query restored
from it and run as generation runs it, against a cold run of the query in the same steps): an
exact hit, a hit one token short, a sliding window that wrapped, a hybrid model's checkpoint at a
chunk boundary, a quantized cache, a conversation's third turn, and an 8-bit store. In exact mode
every one gives the cold run's K/V after the restore point bit for bit, its logits and its 32
greedy tokens (the 8-bit store: within its documented bounds). With exact mode off the same cases
run too, and with OpenBLAS preloaded (where the prefill's steps change the sums) at least one
differs from its cold run: what exact mode buys.

Also: the setting (kept, a multiple of the chunk size, its own namespace), the restore points
it allows, and that nothing computed after the prompt is stored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.errors import InvalidInputError

HERE = Path(__file__).resolve().parent
OPENBLAS = Path(f"/usr/lib/{os.uname().machine}-linux-gnu/openblas-pthread/libblas.so.3")
C, S = 16, 32  # chunk size, exact step


def toks(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, 250, n)]


def proc(action: str, cases: list[dict]) -> dict:
    env = {**os.environ, "LD_PRELOAD": str(OPENBLAS) if OPENBLAS.exists() else ""}
    out = subprocess.run([sys.executable, str(HERE / "exact_proc.py"), action, json.dumps(cases)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def cases(demo_model, root: Path, exact: bool) -> list[dict]:
    tiny = {a: str(demo_model(a)) for a in ("llama", "gemma3_text", "qwen3_5")}
    small = str(demo_model("llama", "small", "float32"))
    bf16 = str(demo_model("llama", "small", "bfloat16"))
    mode = {"chunk_size": C, "exact_prefill": S if exact else "off", "memory_bytes": 0}
    base = toks(100, 1)
    spec = {  # name -> model, extra settings, bind options, turns, query
        "exact hit": (tiny["llama"], {}, {}, [base], {"cut": 100}),
        "one token short": (tiny["llama"], {}, {}, [base], {"cut": 99}),
        "sliding window wrapped": (tiny["gemma3_text"], {}, {}, [toks(150, 2)], {"tokens": toks(20, 3)}),
        # exact: restored at the checkpoint of the last full step (96); off: at 64 (every 4 chunks)
        "hybrid checkpoint at a chunk boundary": (tiny["qwen3_5"], {}, {}, [base], {"cut": 97}),
        "quantized cache": (small, {}, {"kv_bits": 8, "kv_group_size": 32}, [base], {"tokens": toks(30, 4)}),
        "third turn": (tiny["llama"], {}, {}, [toks(70, 5), toks(25, 6)], {"tokens": toks(30, 7)}),
        "8-bit store": (bf16, {"disk_kv_bits": 8}, {}, [base], {"tokens": toks(30, 8)}),
    }
    out = []
    for i, (name, (model, extra, bind, turns, query)) in enumerate(spec.items()):
        out.append({"name": name, "store": str(root / f"s{i}"), "model": model, "settings": {**mode, **extra},
                    "bind": bind, "turns": turns, "new": 8, "query": query})
    return out


@pytest.fixture(scope="module")
def compared(demo_model, tmp_path_factory):
    """{exact: {case: result}} for exact mode on and off: every store written in one process,
    every query compared in another."""
    todo = {exact: cases(demo_model, tmp_path_factory.mktemp("exact" if exact else "off"), exact)
            for exact in (True, False)}
    for exact, group in todo.items():
        for case in group:
            case["name"] = f"{exact}:{case['name']}"
    every = todo[True] + todo[False]
    queries = proc("write", every)
    for case in every:
        case["query_tokens"] = queries[case["name"]]
    results = proc("compare", every)
    return {exact: {name.split(":", 1)[1]: got for name, got in results.items() if name.startswith(f"{exact}:")}
            for exact in (True, False)}


CASES = ["exact hit", "one token short", "sliding window wrapped", "hybrid checkpoint at a chunk boundary",
         "quantized cache", "third turn"]


@pytest.mark.parametrize("name", CASES)
def test_every_regression_case_is_a_cold_run_bit_for_bit_in_exact_mode(compared, name):
    got = compared[True][name]
    assert got["restored"] > 0, got  # something was reused
    assert got["kv_after_bitwise"] and got["kv_after"] == 0.0, got
    assert got["kv_before"] == 0.0 and got["logits"] == 0.0, got
    assert got["greedy"] == got["greedy_cold"]


def test_the_restore_points_of_exact_mode(compared):
    exact = {name: compared[True][name]["restored"] for name in CASES}
    assert exact["exact hit"] == 99  # the stored tail ends where the last token starts
    assert exact["one token short"] == 96  # a whole number of steps: the tail's piece is not the query's
    assert exact["hybrid checkpoint at a chunk boundary"] == 96  # the checkpoint at a full step's end
    assert all(p % S == 0 for name, p in exact.items() if name != "exact hit")
    off = {name: compared[False][name]["restored"] for name in CASES}
    assert off["exact hit"] == 99 and off["one token short"] == 98  # token-exact: what it costs is what exact rounds off
    assert sum(off.values()) > sum(exact.values())


def test_an_8bit_store_is_within_its_bounds_in_both_modes(compared):
    for exact in (True, False):
        got = compared[exact]["8-bit store"]
        assert got["restored"] > 0 and 0 < got["logits"] <= 0.25, got  # docs/kv8.md's bound


def test_exact_mode_off_shows_what_it_buys(compared):
    """Off, restores are token-exact and the steps that computed the stored K/V are not the cold
    run's: with OpenBLAS (whose sums depend on a matrix's rows) some case differs. The bundled
    reference BLAS gives the same bits whatever the steps, on these models."""
    off = compared[False]
    differs = [name for name in CASES if not off[name]["kv_after_bitwise"] or off[name]["logits"] > 0]
    if not OPENBLAS.exists():
        pytest.skip(f"no OpenBLAS at {OPENBLAS}: on the bundled BLAS no case differs ({differs})")
    assert differs, off


def test_the_setting_is_kept_checked_and_its_own_namespace(tmp_path, llama):
    path, model = llama
    with pytest.raises(InvalidInputError, match="multiple of the chunk size"):
        kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=24)
    with pytest.raises(InvalidInputError, match="off"):
        kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=0)
    prompt = toks(70, 9)
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=S) as store:
        mc = store.bind(model, path)
        assert (mc.exact, mc.chunk_size, mc.layout["exact_prefill"]) == (S, S, S)
        _, reused, computed = mc.prefill(prompt)
        assert (reused, computed) == (0, 70)
        store.flush()
        exact_ns = mc.ns
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:  # kept: a later open uses it
        assert store.stats()["settings"]["exact_prefill"] == {"value": S, "source": "kept"}
        mc = store.bind(model, path)
        assert mc.ns == exact_ns and mc.prefill(prompt)[2] == 0  # stored: nothing computed
        assert mc.placement(prompt).on_disk == 69  # the prompt but its last token
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill="off") as store:
        mc = store.bind(model, path)
        assert mc.ns != exact_ns and mc.exact is None
        assert len(mc.fetch(prompt)[1]) == 70  # the exact records are not this namespace's
    kvstore.open(tmp_path / "s2", chunk_size=C, exact_prefill=48).close()
    # A kept step this chunk size does not divide never stops the open: the default, said once.
    with kvstore.open(tmp_path / "s2", chunk_size=32) as store:
        assert store.exact_prefill is None and store.settings["exact_prefill"] == (None, "default")


def test_nothing_computed_after_the_prompt_is_stored_in_exact_mode(tmp_path, llama):
    from kvstore.model.prefill import insert_generated, prompt_cache, run

    path, model = llama
    prompt = toks(50, 10)
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=S) as store:
        mc = store.bind(model, path)
        start = prompt_cache(mc, prompt)
        assert len(start.rest) == 1 and start.hold is not None
        run(model, start.cache, start.rest)
        assert insert_generated(mc, prompt, [1, 2, 3], start.cache) == 0
        start.hold.submit()
        store.flush()
        assert store.stats()["chunks"] == 1 and store.stats()["tails"] == 1  # [0, 32) and [32, 49)
        with pytest.raises(InvalidInputError, match="steps"):
            mc.prefill(prompt, step=8)



def test_ctrl_c_in_exact_mode_counts_a_prompt_stored_whole(tmp_path, llama):
    """A stop raised from `prefill`'s progress once a prompt is stored (its last report comes after
    its last insert) leaves it stored whole: all but its last token, in exact mode."""
    path, model = llama
    prompt = toks(70, 12)

    class Stop(Exception):
        pass

    told = []

    def progress(n: int) -> None:
        told.append(n)
        if sum(told) == len(prompt):
            raise Stop

    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=S) as store:
        mc = store.bind(model, path)
        with pytest.raises(Stop):
            mc.prefill(prompt, progress=progress)
        assert told == [32, 32, 6] and mc.stored_whole(prompt) and not mc.stored_whole(prompt + [1])


def test_a_stored_prompt_keeps_its_own_restore_when_longer_and_shorter_ones_are_stored(llama, tmp_path):
    """In exact mode a restore ends at a step or at a stored prompt's own end, never inside a
    tail: so a prompt's tail is not dropped when a prompt one token longer is stored (the writer
    drops such older tails out of exact mode), and a prompt whose tokens a longer one's records
    hold, but not ending where its own restore must end, is stored with records of its own."""
    path, model = llama
    long = toks(3 * S + 12, 9)  # 3 steps and 12 tokens
    longer, prefix = long + [7], long[: 2 * S]  # one token more; a whole number of steps, inside `long`
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=S) as store:
        mc = store.bind(model, str(path))
        for prompt in (long, longer, prefix, long):
            mc.prefill(prompt)
        store.flush()
    with kvstore.open(tmp_path / "s", chunk_size=C, exact_prefill=S, memory_bytes=0) as store:
        mc = store.bind(model, str(path))
        for prompt in (long, longer, prefix):
            _, rest = mc.fetch(prompt)
            assert len(rest) == 1, (len(prompt), len(rest))  # all but the last token, each
            assert mc.stored_whole(prompt)


def test_warm_of_a_one_token_prompt_in_exact_mode_says_there_is_nothing_to_store(tmp_path, demo_model_path):
    """In exact mode a prompt's last token is the first generation step's and is never stored: a
    one-token prompt has nothing to store, and warm says so, rather than "1 not stored (not
    written)" and a summary that counts a token as missing from the disk."""
    from kvtest import run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "A"}\n{"prompt": "Hello there, a longer prompt."}\n')
    out = run_cli("warm", "--store", tmp_path / "s", "--model", demo_model_path, "--exact-prefill", "256",
                  "--prompts", prompts)
    assert "1 token, 0 reused, 1 computed, nothing to store (in exact mode" in out.stderr, out.stderr
    assert "not written" not in out.stderr + out.stdout
    assert "on disk: 2 of 2 warmed prompts whole; 28 of 28 tokens" in out.stdout, out.stdout
