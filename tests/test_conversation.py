"""Multi-turn conversations store each prefix once: a newer record drops the older tails whose
tokens it holds."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvtest import logits_diff, prefill, readers
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import kvstore

C = 16


def turns(n: int, first: int, step: int, seed: int = 0) -> list[list[int]]:
    """The sequences a chat server inserts: each turn's prompt + reply extends the last."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(1, 200, first).tolist()
    out = [list(seq)]
    for _ in range(n - 1):
        seq += rng.integers(1, 200, step).tolist()
        out.append(list(seq))
    return out


def records(store) -> list:
    return list(store.index.rows()) if store.index is not None else []


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_a_conversation_keeps_one_tail(tmp_path, llama, where):
    path, model = llama
    convo = turns(8, 37, 11)
    target = kvstore.MEMORY if where == "ram" else tmp_path / "s"
    with kvstore.open(target, chunk_size=C) as store:
        mc = store.bind(model, path)
        for seq in convo:
            mc.insert(seq, prefill(model, seq))
            store.flush()
        final = convo[-1]
        stats = store.stats()
        assert stats["tails"] == 1 and stats["chunks"] == len(final) // C
        # every turn's tail but the last one's (a turn that ends on a chunk boundary has none)
        assert stats["writer"]["redundant_dropped"] == sum(len(seq) % C > 0 for seq in convo[:-1])
        assert stats["writer"]["redundant_bytes"] > 0
        if where == "disk":
            assert {r.ntokens for r in records(store) if r.kind == 1} == {len(final) % C}
            assert store.verify() == []
        # Every earlier turn is still restored in full from the newer records, exactly.
        for seq in convo:
            query = seq + [7]
            cache, rest = mc.fetch(query)
            assert len(rest) == 1 and logits_diff(model, cache, rest, query) < 1e-4
    if where == "disk":  # the bytes of the final conversation alone
        with kvstore.open(tmp_path / "alone", chunk_size=C) as alone:
            alone.bind(model, path).insert(final, prefill(model, final))
            alone.flush()
            assert stats["bytes"] == alone.stats()["bytes"]


def test_pinned_and_branching_tails_stay(tmp_path, llama):
    path, model = llama
    base = list(range(1, 40))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        mc.insert(base, prefill(model, base), pin=True)
        branch = base[:35] + [99, 98]  # not an extension of base: both tails are needed
        mc.insert(branch, prefill(model, branch))
        store.flush()
        longer = base + [5, 6]
        mc.insert(longer, prefill(model, longer))  # holds base's tail, but that one is pinned
        store.flush()
        tails = {r.ntokens: r for r in records(store) if r.kind == 1}
        assert sorted(tails) == sorted([len(base) % C, len(branch) % C, len(longer) % C])
        assert store.writer.stats.redundant_dropped == 0


def test_a_tail_with_a_checkpoint_stays_when_the_next_turn_extends_it(tmp_path, demo_model):
    # A hybrid model restores only where a checkpoint is, and turn 1's checkpoint hangs under
    # turn 1's tail: turn 2's longer tail holds the same K/V but not that recurrent state.
    folder = demo_model("qwen3_5")
    model, _ = load(str(folder))
    turn1, turn2 = turns(2, 2 * C + 5, 6, seed=7)  # turn 2 ends in the same chunk: its tail extends turn 1's
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, folder)
        for seq in (turn1, turn2):
            mc.insert(seq, prefill(model, seq))
            store.flush()
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:  # from disk
        mc = store.bind(model, folder)
        for seq in (turn1, turn2):
            query = seq + [250]
            cache, rest = mc.fetch(query)
            assert len(rest) == 1, len(seq)
            assert logits_diff(model, cache, rest, query) < 1e-4
        assert store.verify() == []
        assert store.stats()["tails"] == 2


def test_a_slid_window_does_not_make_a_tail_redundant(tmp_path, demo_model):
    folder = demo_model("gemma3_text")  # sliding window of 32 tokens
    model, _ = load(str(folder))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, folder)
        short = list(range(1, 20))  # one chunk and a 3-token tail
        mc.insert(short, prefill(model, short))
        store.flush()
        # 50 tokens, then 10 more: the window layers keep the last 31 + 10 tokens, no longer the
        # old tail's, so that tail is still what restores `short` exactly.
        long = short + list(range(30, 71))
        cache = make_prompt_cache(model)
        model(mx.array([long[:50]]), cache=cache)
        model(mx.array([long[50:]]), cache=cache)
        mx.eval([c.state for c in cache])
        mc.insert(long, cache)
        store.flush()
        assert store.writer.stats.redundant_dropped == 0
        query = short + [9]
        cache, rest = mc.fetch(query)
        assert len(rest) == 1 and logits_diff(model, cache, rest, query) < 1e-4
        # A newer record that still holds every layer's K/V for them does replace it.
        near = short + [4, 5]
        mc.insert(near, prefill(model, near))
        store.flush()
        assert store.writer.stats.redundant_dropped == 1
        query = short + [4]  # the dropped tail's tokens, served from the newer tail
        cache, rest = mc.fetch(query)
        assert len(rest) == 1 and logits_diff(model, cache, rest, query) < 1e-4


def test_readers_in_another_process_restore_correctly_while_tails_go(tmp_path, llama):
    path, model = llama
    convo = turns(12, 20, 9, seed=3)
    store_dir = tmp_path / "s"
    with kvstore.open(store_dir, chunk_size=C) as store:
        store.bind(model, path)
    with readers(store_dir, path, [seq + [3] for seq in convo], C, tmp_path) as finish:
        with kvstore.open(store_dir, chunk_size=C) as store:
            mc = store.bind(model, path)
            for seq in convo:
                mc.insert(seq, prefill(model, seq))
                store.flush()
            assert store.writer.stats.redundant_dropped == sum(len(seq) % C > 0 for seq in convo[:-1])
            assert store.verify() == []
        [result] = finish()
    assert result["fetches"] > 0 and result["wrong"] == 0, result


def test_a_chunk_stored_without_window_data_gets_it_later(tmp_path, demo_model):
    folder = demo_model("gemma3_text")  # sliding window of 32 tokens
    model, _ = load(str(folder))
    rng = np.random.default_rng(5)
    tokens = rng.integers(1, 200, 61).tolist()
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, folder)
        # As a server stores after generating: the window layers hold only their last 32 tokens,
        # so chunks 1 and 2 are stored without (all of) their data.
        cache = make_prompt_cache(model)
        model(mx.array([tokens[:60]]), cache=cache)
        model(mx.array([tokens[60:]]), cache=cache)
        mx.eval([c.state for c in cache])
        mc.insert(tokens, cache)
        store.flush()
        query = tokens[:20] + [7]
        cache, rest = mc.fetch(query)
        assert len(rest) == len(query)  # no window data for [0, 20): nothing restorable
        before = store.stats()["bytes"]
        # A later insert that has the window data for them (a prompt prefilled in one step).
        mc.insert(tokens[:40], prefill(model, tokens[:40]))
        store.flush()
        assert store.stats()["writer"]["refilled"] == 2 and store.stats()["bytes"] > before
        assert store.verify() == []
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:  # from disk
        mc = store.bind(model, folder)
        cache, rest = mc.fetch(query)
        assert len(rest) == 1 and logits_diff(model, cache, rest, query) < 1e-4
        query = tokens + [3]  # and the long prompt still restores in full
        cache, rest = mc.fetch(query)
        assert len(rest) == 1 and logits_diff(model, cache, rest, query) < 1e-4
        # Inserting the same again writes nothing: the records are complete now.
        mc.insert(tokens[:40], prefill(model, tokens[:40]))
        store.flush()
        assert store.writer.stats.refilled == 0 and store.writer.stats.bytes_written == 0
