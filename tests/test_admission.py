"""Admission: `kvstore.open(admit="all" | "reused" | "pinned")` says which records go to disk."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvtest import logits_diff, prefill

import kvstore
from kvstore.errors import InvalidInputError

C = 16
PROMPT = list(range(1, 100))  # 6 chunks and a tail


def on_disk(store, mc, tokens) -> int:
    """How many of the records `insert(tokens)` stores are rows of the index."""
    store.flush()
    return len(store.index.present(mc.record_hashes(tokens)))


def first_sight(store, mc, tokens):
    """A request as a server makes it: fetch (a miss), compute, insert."""
    _, rest = mc.fetch(tokens)
    assert len(rest) == len(tokens)
    mc.insert(tokens, prefill(mc.model, tokens))


def test_reused_keeps_a_prompt_seen_once_in_ram_only(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        mc = store.bind(model, path)
        first_sight(store, mc, PROMPT)
        assert on_disk(store, mc, PROMPT) == 0
        stats = store.stats()
        assert stats["bytes"] == 0 and stats["writer"]["bytes_written"] == 0
        assert stats["writes"]["not_admitted"] == 7 and stats["writes"]["not_admitted_bytes"] > 0
        assert stats["writes"]["bytes_lifetime"] == 0
        # Still a RAM hit on the second sight, in the same process.
        cache, rest = mc.fetch(PROMPT)
        assert rest == PROMPT[-1:]
        assert logits_diff(model, cache, rest, PROMPT) < 1e-4


def test_reused_writes_on_the_second_sight_from_ram(tmp_path, llama):
    path, model = llama
    longer = PROMPT + [7, 8, 9]
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        mc = store.bind(model, path)
        first_sight(store, mc, PROMPT)
        store.flush()  # the writer has kept the first sight in RAM
        cache, rest = mc.fetch(longer)  # the second sight: restored from RAM
        assert rest == [7, 8, 9]
        model(mx.array([rest]), cache=cache)
        mc.insert(longer, cache)
        store.flush()
        chunks = mc.record_hashes(PROMPT)[:-1]
        assert store.index.present(chunks) == set(chunks)
        assert store.stats()["writes"]["bytes_lifetime"] == store.stats()["bytes"] > 0
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:  # a restart: the chunks are on disk
        mc = store.bind(model, path)
        cache, rest = mc.fetch(PROMPT)
        assert rest == PROMPT[-1:]  # the first tail too: the fetch restored from it in RAM
        assert logits_diff(model, cache, rest, PROMPT) < 1e-4


def test_reused_counts_a_sight_from_another_process(tmp_path, llama):
    """The first sight was in a process that has gone: its marks are in the index."""
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        first_sight(store, store.bind(model, path), PROMPT)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:  # admit="reused" is kept in the store
        mc = store.bind(model, path)
        _, rest = mc.fetch(PROMPT)
        assert len(rest) == len(PROMPT)  # a restart recomputes what was seen once
        mc.insert(PROMPT, prefill(model, PROMPT))
        chunks = mc.record_hashes(PROMPT)[:-1]
        store.flush()
        assert store.index.present(chunks) == set(chunks)


@pytest.mark.parametrize("policy", ["reused", "pinned"])
def test_warm_and_pin_always_write(tmp_path, llama, policy):
    path, model = llama
    other = list(range(200, 260))
    with kvstore.open(tmp_path / "s", chunk_size=C, admit=policy) as store:
        mc = store.bind(model, path)
        _, reused, computed = mc.prefill(PROMPT)  # what `kvstore warm` runs
        assert (reused, computed) == (0, len(PROMPT))
        assert on_disk(store, mc, PROMPT) == 7
        mc.insert(other, prefill(model, other), pin=True)
        assert on_disk(store, mc, other) == 4
        assert store.index.pinned(mc.ns) >= set(mc.record_hashes(other))
        assert store.stats()["writes"]["not_admitted"] == 0


def test_warm_writes_a_prompt_held_in_ram_without_recomputing_it(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        mc = store.bind(model, path)
        first_sight(store, mc, PROMPT)
        _, reused, computed = mc.prefill(PROMPT)
        assert (reused, computed) == (len(PROMPT) - 1, 1)
        assert on_disk(store, mc, PROMPT) == 7


def test_pinned_writes_nothing_else_even_when_reused(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="pinned") as store:
        mc = store.bind(model, path)
        for _ in range(3):
            _, rest = mc.fetch(PROMPT)
            mc.insert(PROMPT, prefill(model, PROMPT))
        assert on_disk(store, mc, PROMPT) == 0
        assert store.stats()["writes"]["not_admitted"] == 7  # each record counted once


def test_all_is_the_default_and_writes_on_first_sight(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        first_sight(store, mc, PROMPT)
        assert on_disk(store, mc, PROMPT) == 7
        writes = store.stats()["writes"]
        assert writes["admit"] == "all" and writes["not_admitted"] == 0
        assert writes["bytes_lifetime"] == writes["bytes_last_day"] == store.stats()["bytes"]
        assert writes["days"][-1]["bytes"] == store.stats()["bytes"] and len(writes["days"]) == 7


def test_settings_are_kept_in_the_store_until_given_again(tmp_path):
    with kvstore.open(tmp_path / "s", admit="reused", max_write_rate="1GB/day"):
        pass
    with kvstore.open(tmp_path / "s") as store:
        assert (store.gate.policy, store.gate.per_day) == ("reused", 10**9)
    with kvstore.open(tmp_path / "s", admit="all", max_write_rate="off"):
        pass
    with kvstore.open(tmp_path / "s") as store:
        writes = store.stats()["writes"]
        assert (writes["admit"], writes["max_write_rate"]) == ("all", None)
    with kvstore.open(tmp_path / "s", read_only=True, admit="pinned") as store:  # not kept: read-only
        assert store.gate.policy == "pinned"
    with kvstore.open(tmp_path / "s") as store:
        assert store.gate.policy == "all"


def test_bad_settings_name_the_option(tmp_path):
    with pytest.raises(InvalidInputError, match="admit"):
        kvstore.open(tmp_path / "s", admit="sometimes")
    with pytest.raises(InvalidInputError, match="max_write_rate"):
        kvstore.open(tmp_path / "s", max_write_rate="fast")
    assert not (tmp_path / "s").exists()  # refused before anything was made


def test_metrics_show_writes_and_what_was_kept_out(llama, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from kvstore import PersistentPromptCache
    from kvstore.serve.metrics import ServerMetrics

    path, model = llama
    key = ("test", None, None)
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused", max_write_rate="1GB/day") as store:
        pc = PersistentPromptCache(store)
        pc.register(key, store.bind(model, str(path)))
        metrics = ServerMetrics(pc)
        for tokens in (PROMPT, PROMPT + [3]):  # seen once, then again: written the second time
            pc.fetch_nearest_cache(key, tokens)
            pc.insert_cache(key, tokens, prefill(model, tokens))
            store.flush()
        body = metrics.render()[0].decode()
        metrics.close()
        writes = store.stats()["writes"]
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(body) for s in family.samples}
    assert got[("kvstore_writes_bytes_lifetime_total", ())] == writes["bytes_lifetime"] > 0
    assert got[("kvstore_writes_bytes_last_day", ())] == writes["bytes_last_day"]
    assert got[("kvstore_writes_not_admitted_total", (("unit", "records"),))] == writes["not_admitted"] > 0
    assert got[("kvstore_writes_not_admitted_total", (("unit", "bytes"),))] == writes["not_admitted_bytes"]
    assert got[("kvstore_writes_over_budget_total", (("unit", "records"),))] == 0
    assert got[("kvstore_write_budget_bytes_per_day", ())] == 10**9


def test_a_store_from_before_the_write_log_opens_and_restores_unchanged(tmp_path, llama):
    import sqlite3

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).insert(PROMPT, prefill(model, PROMPT))
    con = sqlite3.connect(tmp_path / "s" / "index.sqlite", isolation_level=None)  # back to schema 17
    con.execute("DROP TABLE write_log")
    con.execute("DROP TABLE seen_prefixes")
    con.execute("DELETE FROM schema_migrations WHERE version IN (18, 20)")  # 20 adds to write_log
    con.close()
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:  # migrated, then as before
        assert 18 in store.index.applied()
        writes = store.stats()["writes"]
        assert (writes["bytes_lifetime"], writes["not_admitted"]) == (0, 0)  # the log starts here
        mc = store.bind(model, path)
        cache, rest = mc.fetch(PROMPT)
        assert rest == PROMPT[-1:] and logits_diff(model, cache, rest, PROMPT) < 1e-4
        assert on_disk(store, mc, PROMPT) == 7


def test_serve_with_admit_reused_writes_a_request_on_its_second_sight(demo_model, tmp_path):
    """`kvstore serve --admit reused`: the first request stays in RAM (its repeat hits there),
    the repeat writes it, and a restarted server restores it from disk."""
    import requests
    from test_server import Server, ask, cached, chat_messages

    model, store = demo_model("llama"), tmp_path / "store"
    with Server(model, store, tmp_path / "a.log", "--admit", "reused", "--max-write-rate", "1GB/day") as server:
        _, first = ask(server, messages=chat_messages())
        assert cached(first) == 0
        assert requests.get(server.url + "/kvstore/stats", timeout=60).json()["writes"]["bytes_lifetime"] == 0
        _, again = ask(server, messages=chat_messages())
        assert cached(again) >= first["prompt_tokens"] - 1  # a RAM hit
        assert server.stop() == 0
    with kvstore.open(store, read_only=True) as s:
        writes = s.stats()["writes"]
    assert (writes["admit"], writes["max_write_rate"]) == ("reused", 10**9)
    assert writes["bytes_lifetime"] > 0 and writes["not_admitted"] > 0
    with Server(model, store, tmp_path / "b.log") as server:  # the kept settings apply
        _, after = ask(server, messages=chat_messages())
        assert cached(after) >= first["prompt_tokens"] // C * C - C
        assert server.stop() == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])  # qwen3_5: the prompt is prefilled for its checkpoint
def test_generate_with_admit_reused_writes_a_prompt_on_its_second_run(demo_model, tmp_path, capsys, arch):
    """Each `kvstore generate` is a process of its own: the first run keeps its prompt in RAM, the
    second (a restart) recomputes it and writes it, the third restores it from disk."""
    import re

    from kvstore.cli.main import main

    args = ["generate", "--store", str(tmp_path / "s"), "--model", str(demo_model(arch)), "--max-tokens", "4",
            "--prompt", "You are a helpful assistant. Answer briefly. " * 8 + "What is a KV cache?"]  # 1 chunk +
    runs = []
    for extra in (["--admit", "reused"], [], []):
        assert main(args + extra) == 0
        err = capsys.readouterr().err
        runs.append(tuple(map(int, re.search(r"prompt: (\d+) tokens, (\d+) reused from the store", err).groups())))
        with kvstore.open(tmp_path / "s", read_only=True) as store:
            runs[-1] += (store.stats()["bytes"],)
    (n, first, bytes1), (_, second, bytes2), (_, third, _) = runs
    assert (first, bytes1) == (0, 0)  # seen once: nothing on disk
    assert second == 0 and bytes2 > 0  # a restart recomputes it; its second sight writes it
    if arch == "llama":  # restored from disk: its whole chunks (the tail is recomputed)
        assert third >= n // 256 * 256 > 0
    # (qwen3_5 restores only from a checkpoint: the one at the prompt's end hangs from its tail,
    # which is not written under reused; one every 4 chunks is, with its chunk: docs/writes.md)


def test_reused_a_fetch_alone_writes_what_it_restored_from_ram(tmp_path, llama):
    """Insert once, fetch twice, no second insert: the fetches write the prompt from the memory
    tier's copies, and a new process restores it in full (its tail too)."""
    from kvtest import run_procs

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        mc = store.bind(model, path)
        first_sight(store, mc, PROMPT)
        assert on_disk(store, mc, PROMPT) == 0  # seen once: RAM only
        for _ in range(2):
            _, rest = mc.fetch(PROMPT + [1])
            assert rest == [1]  # from RAM
    got = run_procs("check", tmp_path / "s", path, C, PROMPT + [1])
    assert got["reused"] == len(PROMPT) and got["max_abs_diff"] < 1e-4
    assert got["greedy"] == got["greedy_ref"]


def test_reused_a_fetch_while_the_first_sight_is_in_the_writer_keeps_its_tail(tmp_path, llama, monkeypatch):
    """The writer has decided the job (its chunks reused, its tail not: in RAM only) and is
    placing it when a fetch restores the tail from its queue: the tail is written once the job
    is done, and a new process restores the whole prompt."""
    import threading

    from kvtest import run_procs

    from kvstore import faults

    path, model = llama
    placing, go = threading.Event(), threading.Event()
    real_hit = faults.hit

    def hold(point):
        if point == "after_rename" and not placing.is_set():
            placing.set()
            assert go.wait(60)
        real_hit(point)

    monkeypatch.setattr(faults, "hit", hold)
    with kvstore.open(tmp_path / "s", chunk_size=C, admit="reused") as store:
        mc = store.bind(model, path)
        for _ in range(2):  # its chunks asked for twice: they are admitted, the tail (no chunk key) is not
            assert len(mc.fetch(PROMPT)[1]) == len(PROMPT)
        mc.insert(PROMPT, prefill(model, PROMPT))
        assert placing.wait(60)  # the first chunk is in place: the tail is decided, not yet kept
        _, rest = mc.fetch(PROMPT + [1])  # from the writer's queue
        assert rest == [1]
        go.set()
        store.flush()
        assert on_disk(store, mc, PROMPT) == 7
    got = run_procs("check", tmp_path / "s", path, C, PROMPT + [1])
    assert got["reused"] == len(PROMPT) and got["max_abs_diff"] < 1e-4
