"""Retention by role: a budget evicts records that only assistant-typed inserts reached, then
user-reached ones, then system prompts, LRU inside each class and never a parent before its
children; pins override; the roles live in the index (a restart keeps them) and a store written
before them opens and evicts as it did. (The rule against a one-leaf-at-a-time reference, roles
included, is tests/test_gc.py's property test.)"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvtest import prefill

import kvstore
from kvstore import PersistentPromptCache
from kvstore.errors import InvalidInputError
from kvstore.upkeep import evict

C = 8  # small chunks: a prompt of a few dozen tokens is a chain of records

SYSTEM = list(range(10, 34))  # 3 chunks
USER = SYSTEM + list(range(100, 122))  # 2 more chunks and a tail
ASSISTANT = USER + list(range(150, 183))  # 4 more chunks (the first holds the user's tail) and a tail
SIDE = SYSTEM + list(range(200, 220))  # another user turn under the system prompt: 2 chunks, a tail


def roles(store) -> dict[bytes, int]:
    return dict(store.index.conn.execute("SELECT hash, role FROM records").fetchall())


def sizes(store) -> dict[bytes, int]:
    return dict(store.index.conn.execute("SELECT hash, size FROM records").fetchall())


def conversation(store, model, model_path, *, side_type: str = "user", pin_side: bool = False):
    """The three inserts mlx_lm.server makes for one request (the system prompt, the prompt, the
    prompt and its answer), then another user turn under the same system prompt; the answer is
    used last. By LRU alone the other turn's tail would go first. Returns the records (system,
    user, assistant-only) and the other turn's records."""
    mc = store.bind(model, str(model_path))
    for tokens, cache_type, pin in ((SYSTEM, "system", False), (USER, "user", False),
                                    (ASSISTANT, "assistant", False), (SIDE, side_type, pin_side)):
        mc.insert(tokens, prefill(model, tokens), cache_type=cache_type, pin=pin)
        store.flush()
        time.sleep(0.01)
    mc.fetch(ASSISTANT + [1])  # the newest use: the answer's chain
    store.flush()
    a, side = mc.record_hashes(ASSISTANT), mc.record_hashes(SIDE)
    # The user's tail went when the answer's chunk 6 came to hold its tokens (the writer drops
    # such tails): chunk 6 took its role.
    assert mc.record_hashes(USER)[-1] not in sizes(store)
    return set(a[:3]), set(a[3:6]) | set(side[3:]), set(a[6:]), side


def test_each_record_keeps_the_strongest_role_that_reached_it(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        system, user, assistant, _ = conversation(store, model, path)
        got = roles(store)
        assert {got[h] for h in system} == {2}
        assert {got[h] for h in user} == {1}
        assert {got[h] for h in assistant} == {0}
        assert set(got) == system | user | assistant
        # A weaker insert later never lowers a role; a stronger one raises it, stored or not.
        mc = store.bind(model, str(path))
        mc.insert(SYSTEM, prefill(model, SYSTEM), cache_type="assistant")
        mc.insert(ASSISTANT, prefill(model, ASSISTANT), cache_type="user")
        store.flush()
        got = roles(store)
        assert {got[h] for h in system} == {2}
        assert {got[h] for h in user | assistant} == {1}
        with pytest.raises(InvalidInputError, match="cache_type must be one of"):
            mc.insert(SYSTEM, prefill(model, SYSTEM), cache_type="tool")


def test_a_budget_evicts_assistant_then_user_then_system_and_a_restart_keeps_the_order(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        system, user, assistant, side = conversation(store, model, path)
    # The roles are the index's: a new process (here, a new open) plans with them.
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        size = sizes(store)
        total = sum(size.values())
        bytes_of = lambda hashes: sum(size[h] for h in hashes)  # noqa: E731
        # Budgets that cut more and more: the classes go in order, each whole before the next.
        for cut, gone in ((bytes_of(assistant), assistant), (bytes_of(assistant | user), assistant | user),
                          (total, assistant | user | system)):
            assert set(store.files.gc(max_bytes=total - cut, dry_run=True)["hashes"]) == gone
        # One step into the user class: all of the answer, then the least recently used user
        # leaf (the other turn's tail), although the answer was used after it.
        budget = total - bytes_of(assistant) - 1
        plan = store.files.gc(max_bytes=budget, dry_run=True)["hashes"]
        assert set(plan[: len(assistant)]) == assistant and plan[len(assistant):] == [side[-1]]
        store.gc(max_bytes=budget)
        assert set(sizes(store)) == (system | user) - {side[-1]}


def test_pinned_records_stay_whatever_their_role(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        system, user, assistant, side = conversation(store, model, path, side_type="assistant", pin_side=True)
        assert {roles(store)[h] for h in side[3:]} == {0}
        store.gc(max_bytes=0)
        # The pinned assistant turn stays, with the system prompt it hangs from; the user turn
        # and the answer, stronger or not, go.
        assert set(sizes(store)) == set(side)


def test_a_store_written_before_roles_opens_unchanged_and_evicts_by_lru(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        _, _, _, side = conversation(store, model, path)
    # The index as a kvstore before roles wrote it: no role column, no migration 19.
    with sqlite3.connect(tmp_path / "s" / "index.sqlite") as db:
        db.execute("ALTER TABLE records DROP COLUMN role")
        db.execute("DELETE FROM schema_migrations WHERE version = 19")
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        assert set(roles(store).values()) == {0}
        mc = store.bind(model, str(path))
        cache, rest = mc.fetch(ASSISTANT + [1])
        assert rest == [1] and cache[0].offset == len(ASSISTANT)
        store.flush()
        # Every record is of one class: the order is the LRU rule's, the other turn's tail first.
        graph = evict.Graph.from_index(store.index.eviction_graph())
        graph.role = None
        plan = store.files.gc(max_bytes=0, dry_run=True)["hashes"]
        assert plan == evict.choose_victims(graph, max_bytes=0, cutoff=None, stale=False).hashes and plan[0] == side[-1]


def test_max_age_does_not_look_at_roles(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, str(path))
        old = SYSTEM + [5, 6, 7, 8]  # the system prompt's chunks and a tail
        mc.insert(old, prefill(model, old), cache_type="system")
        store.flush()
        time.sleep(1.0)
        mc.insert(SIDE, prefill(model, SIDE))
        store.flush()
        # The system prompt's tail was last used over 0.5 s ago, the rest is under a new record.
        result = store.files.gc(max_age=0.5)
        assert result["hashes"] == [mc.record_hashes(old)[-1]]


def test_the_prompt_cache_passes_on_mlx_lm_server_cache_types(llama, tmp_path):
    path, model = llama
    key = ("test", None, None)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        pc = PersistentPromptCache(store, max_size=10)
        pc.register(key, store.bind(model, str(path)))
        pc.insert_cache(key, SYSTEM, prefill(model, SYSTEM), cache_type="system")
        pc.insert_cache(key, USER, prefill(model, USER), cache_type="user")
        pc.insert_cache(key, ASSISTANT, prefill(model, ASSISTANT))  # mlx-lm's default: assistant
        store.flush()
        a = store.bind(model, str(path)).record_hashes(ASSISTANT)
        got = roles(store)
        assert [got[h] for h in a] == [2] * 3 + [1] * 3 + [0] * 4


def test_warm_marks_the_system_prompt_of_a_messages_line(demo_model_path, tmp_path):
    from mlx_lm import load

    messages = [{"role": "system", "content": "You are a careful assistant. " * 20},
                {"role": "user", "content": "What is the capital of France, and why? " * 15}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": messages}) + "\n" + json.dumps({"prompt": "a plain one"}) + "\n")
    store_dir = tmp_path / "s"
    subprocess.run([sys.executable, "-m", "kvstore.cli", "warm", "--store", str(store_dir), "--model",
                    str(demo_model_path), "--prompts", str(prompts)], check=True, capture_output=True, timeout=300)
    model, tokenizer = load(str(demo_model_path))
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    head = tokenizer.apply_chat_template(messages[:1] + [{"role": "user", "content": ""}])
    system_end = next(i for i, (a, b) in enumerate(zip(head, prompt)) if a != b)
    with kvstore.open(store_dir, memory_bytes=0) as store:
        mc = store.bind(model, str(demo_model_path))
        got = roles(store)
        full = mc.record_hashes(prompt)
        # The records that hold the system prompt's tokens (its tail's went to the record that
        # holds them now) are "system"; the rest of a prompt that ends in a user turn is "user".
        k = -(-system_end // mc.chunk_size)
        assert 0 < k < len(full)
        assert [got[h] for h in full] == [2] * k + [1] * (len(full) - k)
        assert got[mc.record_hashes(tokenizer.encode("a plain one"))[-1]] == 1


def test_the_index_graph_carries_the_role(tmp_path):
    from kvstore.storage.index import Index, Row

    index = Index(Path(tmp_path) / "index.sqlite")
    ns = bytes(16)
    rows = [Row(bytes([i]) * 16, ns, ns if i == 1 else bytes([i - 1]) * 16, i, 0, 8, 0, 1000 + i, 0, role=r)
            for i, r in ((1, 2), (2, 1), (3, 0))]
    index.insert(rows)
    g = evict.Graph.from_index(index.eviction_graph())
    assert sorted(zip(g.sizes.tolist(), g.role.tolist())) == [(1001, 2), (1002, 1), (1003, 0)]
    index.close()
    shutil.rmtree(tmp_path, ignore_errors=True)
