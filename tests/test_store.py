"""The core store, end to end on a real (tiny, random-weight) mlx-lm llama from the demo builder."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtest import prefill
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

import kvstore
from kvstore.demo import build_demo_model
from kvstore.errors import InvalidInputError, SchemaTooNewError, StoreOpenError
from kvstore.storage import blobtree
from kvstore.storage.schema import available_migrations

HERE = Path(__file__).parent
C = 16  # a small chunk size makes short prompts span many chunks


def run_proc(*args, extra=None) -> dict:
    cmd = [sys.executable, str(HERE / "procs.py"), *map(str, args)]
    if extra is not None:
        cmd.append(json.dumps(extra))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def rand_tokens(n, seed=0, vocab=250):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


@pytest.fixture(params=["memory", "disk-only", "ram-only"])
def tier(request):
    return request.param


def open_store(tmp_path, tier, **kw):
    if tier == "memory":
        return kvstore.open(tmp_path / "store", chunk_size=C, **kw)
    if tier == "disk-only":
        return kvstore.open(tmp_path / "store", chunk_size=C, memory_bytes=0, **kw)
    return kvstore.open(kvstore.MEMORY, chunk_size=C, **kw)


def test_second_process_restores_what_first_inserted(tmp_path, llama):
    path, _ = llama
    prompt = rand_tokens(70, seed=1)
    run_proc("insert", tmp_path / "s", path, C, json.dumps(prompt))
    question = prompt + rand_tokens(5, seed=2)
    got = run_proc("check", tmp_path / "s", path, C, json.dumps(question), extra={"memory_bytes": 0})
    assert got["reused"] == len(prompt)
    assert got["max_abs_diff"] <= 1e-4
    assert got["greedy"] == got["greedy_ref"]


def test_exact_hit_leaves_one_token_and_branch_reuses_common_prefix(tmp_path, llama, tier):
    path, model = llama
    tokens = rand_tokens(53, seed=3)
    with open_store(tmp_path, tier) as store:
        mc = store.bind(model, path)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        cache, rest = mc.fetch(tokens)
        assert rest == tokens[-1:] and cache[0].offset == len(tokens) - 1
        # A branch in the middle of the second chunk: exactly the common prefix comes back.
        branch = tokens[:21] + [(tokens[21] + 1) % 250] + tokens[22:40]
        cache, rest = mc.fetch(branch)
        assert len(branch) - len(rest) == 21
        assert all(c.offset == 21 for c in cache)
        assert np.allclose(np.array(cache[0].keys[..., :21, :]), np.array(prefill(model, tokens[:21])[0].keys[..., :21, :]), atol=1e-5)
        # Longer than what is stored: all of it is reused.
        cache, rest = mc.fetch(tokens + [7, 8, 9])
        assert rest == [7, 8, 9]
        # Nothing shared: a miss with a fresh cache.
        cache, rest = mc.fetch([(tokens[0] + 1) % 250] + tokens[1:])
        assert len(rest) == len(tokens) and all(c.empty() for c in cache)


def test_restored_cache_continues_like_a_recompute(tmp_path, llama, tier):
    path, model = llama
    tokens = rand_tokens(40, seed=4)
    with open_store(tmp_path, tier) as store:
        mc = store.bind(model, path)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        query = tokens[:35] + [1, 2, 3]
        cache, rest = mc.fetch(query)
        assert len(rest) == 3
        logits = model(mx.array([rest]), cache=cache)
        ref = model(mx.array([query]), cache=make_prompt_cache(model))
        assert float(mx.abs(logits[0, -1] - ref[0, -1]).max()) <= 1e-4


def test_shared_prefix_is_stored_once(tmp_path, llama):
    path, model = llama
    system = rand_tokens(4 * C, seed=5)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        first = system + rand_tokens(C, seed=6)
        mc.insert(first, prefill(model, first))
        store.flush()
        before = store.stats()
        second = system + rand_tokens(C, seed=7)
        mc.insert(second, prefill(model, second))
        store.flush()
        after = store.stats()
    assert after["chunks"] - before["chunks"] == 1  # only the unique chunk is new
    per_chunk = before["bytes"] / before["chunks"]
    assert after["bytes"] - before["bytes"] == pytest.approx(per_chunk, rel=0.05)


def test_changed_weights_at_same_path_are_never_reused(tmp_path, llama):
    src, _ = llama
    path = tmp_path / "model"
    shutil.copytree(src, path)
    tokens = rand_tokens(30, seed=8)
    model, _ = load(str(path))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).insert(tokens, prefill(model, tokens))
        store.flush()
    # New weights, same path: no reuse.
    build_demo_model(tmp_path / "other", "llama", seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", path / "model.safetensors")
    model2, _ = load(str(path))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        cache, rest = store.bind(model2, path).fetch(tokens)
        assert len(rest) == len(tokens)
    # The original weights written again (new mtime): reuse.
    shutil.copy(src / "model.safetensors", path / "model.safetensors")
    os.utime(path / "model.safetensors")
    model3, _ = load(str(path))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        cache, rest = store.bind(model3, path).fetch(tokens)
        assert len(rest) == 1


def test_gc_bounds_bytes_evicts_leaves_first_and_keeps_pins(tmp_path, llama):
    path, model = llama
    root = rand_tokens(2 * C, seed=9)
    pinned = root + rand_tokens(2 * C, seed=10)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        mc.insert(pinned, prefill(model, pinned), pin=True)
        for i in range(6):
            t = root + rand_tokens(2 * C + 5, seed=20 + i)
            mc.insert(t, prefill(model, t))
        store.flush()
        total = store.stats()["bytes"]
        dry = store.gc(max_bytes=total // 2, dry_run=True)
        assert dry["evicted"] > 0 and store.stats()["bytes"] == total
        result = store.gc(max_bytes=total // 2)
        assert result["evicted"] == dry["evicted"]
        assert store.stats()["bytes"] <= total // 2
        assert store.verify() == []
        rows = {r.hash: r for r in store.index.rows()}
        for r in rows.values():  # leaves first: nothing left without its parent
            assert r.depth == 1 or r.parent in rows
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        cache, rest = mc.fetch(pinned)
        assert len(rest) == 1  # the pinned prompt survived whole
        logits = model(mx.array([rest]), cache=cache)
        ref = model(mx.array([pinned]), cache=make_prompt_cache(model))
        assert float(mx.abs(logits[0, -1] - ref[0, -1]).max()) <= 1e-4
        # Everything down to zero except what is pinned.
        store.gc(max_bytes=0)
        assert store.stats()["chunks"] == 4 and store.stats()["tails"] == 0
        assert store.verify() == []


def test_gc_by_age(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        t = rand_tokens(3 * C, seed=30)
        mc.insert(t, prefill(model, t))
        store.flush()
        assert store.gc(max_age=3600)["evicted"] == 0
        assert store.gc(max_age=0)["evicted"] == 3
        assert store.stats()["bytes"] == 0


def test_verify_finds_corruption_and_fetch_serves_a_shorter_correct_prefix(tmp_path, llama):
    path, model = llama
    tokens = rand_tokens(4 * C, seed=11)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        rows = sorted(store.index.rows(), key=lambda r: r.depth)
        third = blobtree.blob_path(store.blob_root, rows[2].hash)
    data = bytearray(third.read_bytes())
    data[-3] ^= 0xFF
    third.write_bytes(bytes(data))
    (store.blob_root / "zz").mkdir()
    (store.blob_root / "zz" / "junk.txt").write_text("not a blob")
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        cache, rest = mc.fetch(tokens)
        assert len(tokens) - len(rest) == 2 * C  # stops where the damaged record starts
        logits = model(mx.array([rest]), cache=cache)
        ref = model(mx.array([tokens]), cache=make_prompt_cache(model))
        assert float(mx.abs(logits[0, -1] - ref[0, -1]).max()) <= 1e-4
        assert store.stats()["quarantined"] == 1
        kinds = sorted(p.kind for p in store.verify())
        assert kinds == ["foreign_file", "orphan_row", "quarantined"]
        store.verify(repair=True)
        assert store.verify() == []
        assert store.stats()["chunks"] == 2


def test_verify_finds_missing_and_truncated_blobs(tmp_path, llama):
    path, model = llama
    tokens = rand_tokens(2 * C + 3, seed=12)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        rows = sorted(store.index.rows(), key=lambda r: r.depth)
        blobtree.blob_path(store.blob_root, rows[2].hash).unlink()
        p1 = blobtree.blob_path(store.blob_root, rows[1].hash)
        p1.write_bytes(p1.read_bytes()[:100])
        kinds = sorted(p.kind for p in store.verify())
        assert kinds == ["corrupt_blob", "missing_blob"]
        store.verify(repair=True)
        assert store.verify() == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fetch_returns_the_true_common_prefix(tmp_path_factory, llama, data):
    path, model = llama
    vocab = 4  # a tiny alphabet makes shared prefixes and branch points common
    seqs = data.draw(st.lists(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3 * C + 3),
                              min_size=1, max_size=4))
    query = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3 * C + 3))
    if data.draw(st.booleans()):
        base = seqs[data.draw(st.integers(0, len(seqs) - 1))]
        cut = data.draw(st.integers(0, len(base)))
        query = base[:cut] + query
    if data.draw(st.booleans()):
        # A branch at any position of a chunk, its last token included: the query follows a
        # stored sequence up to `cut` and differs there.
        base = data.draw(st.lists(st.integers(0, vocab - 1), min_size=C + 1, max_size=3 * C + 3))
        seqs.append(base)  # at least one full chunk, so the branch can fall inside one
        chunk = data.draw(st.integers(0, max(0, (len(base) - 1) // C)))
        offset = data.draw(st.one_of(st.sampled_from([0, C - 1]), st.integers(0, C - 1)))  # edges often
        cut = min(len(base) - 1, chunk * C + offset)
        query = base[:cut] + [(base[cut] + 1) % vocab] + query
    tmp = tmp_path_factory.mktemp("hyp")
    with kvstore.open(tmp / "s", chunk_size=C, memory_bytes=data.draw(st.sampled_from([0, 1 << 30]))) as store:
        mc = store.bind(model, path)
        for s in seqs:
            cache = make_prompt_cache(model)
            for layer in cache:  # fake K/V with the right shapes: prefix logic is what is tested
                layer.update_and_fetch(mx.zeros((1, 2, len(s), 16)), mx.zeros((1, 2, len(s), 16)))
            mc.insert(s, cache)
        if data.draw(st.booleans()):
            store.flush()
        expected = max(_lcp(s, query) for s in seqs)
        expected = min(expected, len(query) - 1)
        cache, rest = mc.fetch(query)
        assert len(query) - len(rest) == max(expected, 0)
        assert rest == query[len(query) - len(rest):]


def _fake_cache(model, n):
    cache = make_prompt_cache(model)
    for layer in cache:  # K/V of the right shapes: the prefix logic is what is tested
        layer.update_and_fetch(mx.zeros((1, 2, n, 16)), mx.zeros((1, 2, n, 16)))
    return cache


def test_a_branch_at_every_position_of_a_chunk_reuses_exactly_the_common_prefix(tmp_path, llama):
    """Every position of the first, a middle and the last chunk, and of the tail: a query that
    differs from the stored sequence there reuses exactly the tokens before it (a chain hash that
    skipped a chunk's last token would reuse the whole chunk at its last position)."""
    path, model = llama
    stored = rand_tokens(3 * C + 7, seed=50)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        mc.insert(stored, _fake_cache(model, len(stored)))
        store.flush()
        for cut in range(len(stored)):
            query = stored[:cut] + [(stored[cut] + 1) % 250] + stored[cut + 1 :]
            cache, rest = mc.fetch(query)
            assert len(query) - len(rest) == cut, f"branch at {cut} (position {cut % C} of chunk {cut // C + 1})"
            assert mc.stored_length(query) == cut


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_insert_returns_before_anything_is_written(tmp_path, llama):
    path, model = llama
    tokens = rand_tokens(3 * C, seed=13)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        store.writer.pause()
        try:
            assert mc.insert(tokens, prefill(model, tokens)) == 3
            assert store.stats()["chunks"] == 0
            assert list(blobtree.walk(store.blob_root)) == []
            cache, rest = mc.fetch(tokens)  # visible at once, before it is written
            assert len(rest) == 1
        finally:
            store.writer.resume()
        assert store.flush(timeout=60)
        assert store.stats()["chunks"] == 3
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        assert len(store.bind(model, path).fetch(tokens)[1]) == 1


def _kv(cache, n: int) -> list[np.ndarray]:
    """The first `n` tokens of every layer's keys and values, as float32 copies."""
    return [np.array(a.astype(mx.float32)) for c in cache for a in (c.keys[..., :n, :], c.values[..., :n, :])]


def test_insert_takes_no_view_of_an_mlx_array_on_the_callers_thread(tmp_path, llama, monkeypatch):
    # mlx lets go of the GIL to hand out an array's memory, and a busy writer thread then holds
    # it for up to Python's switch interval: the caller only holds its arrays, the writer views them.
    import threading

    from kvstore.write import views as insert_mod

    path, model = llama
    tokens = rand_tokens(3 * C, seed=17)
    viewed_on = []
    real = insert_mod.host_array

    def spy(a):
        viewed_on.append(threading.get_ident())
        return real(a)

    monkeypatch.setattr(insert_mod, "host_array", spy)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        cache = prefill(model, tokens)
        want = _kv(cache, 3 * C)
        store.writer.pause()
        try:
            assert mc.insert(tokens, cache) == 3
            assert viewed_on == []  # nothing taken on this thread by the insert itself
        finally:
            store.writer.resume()
        assert store.flush(timeout=60)
        assert viewed_on and threading.get_ident() not in viewed_on  # the writer took them
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        got, rest = store.bind(model, path).fetch(tokens + [1])
        assert rest == [1]
        restored = _kv(got, 3 * C)
        assert all(np.array_equal(w, r) for w, r in zip(want, restored))


def test_the_writer_waits_between_records_while_a_restore_runs_but_never_stops(tmp_path, llama):
    import time

    path, model = llama
    tokens = rand_tokens(3 * C, seed=19)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        store.writer.pause()
        assert mc.insert(tokens, prefill(model, tokens)) == 3
        with store.writer.reading():  # as a fetch does while it restores
            store.writer.resume()
            time.sleep(0.1)  # the writer may not pass its first wait before 0.25 s
            assert store.stats()["chunks"] == 0 and list(blobtree.walk(store.blob_root)) == []
            # A restore that never ends does not stop it: each wait is bounded.
            assert store.flush(timeout=30)
            assert store.stats()["chunks"] == 3
        tokens2 = rand_tokens(3 * C, seed=23)
        assert mc.insert(tokens2, prefill(model, tokens2)) == 3
        assert store.flush(timeout=30) and store.stats()["chunks"] == 6
        assert len(mc.fetch(tokens2 + [1])[1]) == 1


def test_a_cache_changed_in_place_after_insert_does_not_change_what_was_stored(tmp_path, llama):
    # insert keeps references to the caller's own K/V arrays (no copy, no mlx op) until the
    # writer has written them. Generation then goes on in the same cache: here it trims back into
    # the stored tokens and writes other tokens over them. What the queue serves, and what
    # reaches the disk, must still be the K/V of the tokens inserted.
    path, model = llama
    tokens = rand_tokens(3 * C, seed=21)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        cache = prefill(model, tokens)
        want = _kv(cache, 3 * C)
        store.writer.pause()
        try:
            assert mc.insert(tokens, cache) == 3
            for c in cache:
                c.trim(C + 3)  # back into the second chunk...
            model(mx.array([rand_tokens(C + 3, seed=22)]), cache=cache)  # ...and over it
            mx.eval([c.state for c in cache])
            assert not np.array_equal(np.array(cache[0].keys[..., 2 * C:3 * C, :].astype(mx.float32)),
                                      want[0][..., 2 * C:, :])
            pending, rest = mc.fetch(tokens + [1])
            assert len(rest) == 1
            got = _kv(pending, 3 * C)
            assert all(np.array_equal(g, w) for g, w in zip(got, want)), "the queued record changed with the cache"
        finally:
            store.writer.resume()
        assert store.flush(timeout=60)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        restored, rest = store.bind(model, path).fetch(tokens + [1])
        assert len(rest) == 1
        got = _kv(restored, 3 * C)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), "the stored record changed with the cache"


def test_a_record_gone_between_lookup_and_read_is_looked_up_again(tmp_path, llama, monkeypatch):
    # The writer replaces a tail by a longer one that holds its K/V, and gc evicts: a fetch may
    # choose a record that no tier holds any more when it opens it. It looks up again and uses
    # what is there (here the longer tail), instead of serving a miss.
    from kvstore import keys
    from kvstore.model import cache as modelcache
    from kvstore.records import TAIL
    from kvstore.tiers.memory import Record

    path, model = llama
    short, longer = [3], [3, 2, 2, 1, 0, 3]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        for seq in (short, longer):
            mc.insert(seq, prefill(model, seq))
        assert store.flush(timeout=60)
        assert store.writer.stats.redundant_dropped == 1  # the short tail is gone: the longer holds it
        # The longer tail only on disk, the short one back in RAM, as a fetch could still see it
        # while the writer drops it...
        store.memory.discard([keys.tail_hash(mc.ns, np.array(longer, dtype=np.int32))])
        gone = keys.tail_hash(mc.ns, np.array(short, dtype=np.int32))
        kv = prefill(model, short)
        store.memory.put([Record(gone, mc.ns, mc.ns, 1, TAIL, len(short), short[0], np.array(short, dtype=np.int32),
                                 {f"{i}.{n}": getattr(c, n)[..., :1, :] for i, c in enumerate(kv)
                                  for n in ("keys", "values")})])
        real_match = modelcache.match
        removed = []

        def match_then_lose_it(*args):
            chain, options, where = real_match(*args)
            if not removed and options[0][0] == gone:  # ...and it goes before it is opened
                store.memory.discard([gone])
                removed.append(gone)
            return chain, options, where

        monkeypatch.setattr(modelcache, "match", match_then_lose_it)
        # (the deletion log says the short tail is gone: read, it would drop it from RAM before the lookup)
        monkeypatch.setattr(store.backing.deleted_elsewhere, "forget", lambda b: None)
        cache, rest = mc.fetch(short + [1])
        assert removed == [gone] and rest == [1]  # one token reused, from the longer tail


def test_queue_bounded_by_bytes_counts_drops(tmp_path, llama, caplog):
    """A dropped insert says so: it returns 0 records queued, and the first drop is logged."""
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, max_pending_bytes=1) as store:
        mc = store.bind(model, path)
        store.writer.pause()
        try:
            a, b = rand_tokens(C, seed=14), rand_tokens(C, seed=15)
            assert mc.insert(a, prefill(model, a)) == 1
            with caplog.at_level(logging.WARNING, logger="kvstore"):
                assert mc.insert(b, prefill(model, b)) == 0  # the queue holds one job: this one is dropped
            assert store.stats()["writer"]["dropped_jobs"] == 1
            assert "was dropped: the write queue holds" in caplog.text
        finally:
            store.writer.resume()
        store.flush()
        assert store.stats()["chunks"] == 1


def test_max_pending_bytes_0_drops_every_insert_as_documented(tmp_path, llama):
    """`max_pending_bytes=0` is documented as "every insert is dropped": an insert into the empty
    queue went in all the same (one alone always fits a bound above 0, however large)."""
    path, model = llama
    tokens = rand_tokens(C + 3, seed=17)
    with kvstore.open(tmp_path / "s", chunk_size=C, max_pending_bytes=0) as store:
        assert store.bind(model, path).insert(tokens, prefill(model, tokens)) == 0
        store.flush()
        assert (store.stats()["chunks"], store.stats()["writer"]["dropped_jobs"]) == (0, 1)
    with kvstore.open(tmp_path / "s", chunk_size=C, max_pending_bytes=1) as store:
        assert store.bind(model, path).insert(tokens, prefill(model, tokens)) == 2  # alone, larger than 1 byte


def test_an_insert_that_races_close_is_counted_dropped_not_queued(tmp_path, llama):
    """An insert on another thread that passed its open check as `close` stopped the writer (the
    point in `Store.close` where it is): its records were queued where no thread writes them, and
    it returned them as queued. It is counted as dropped and returns 0."""
    path, model = llama
    tokens = rand_tokens(C + 3, seed=16)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        store.writer.close()
        assert mc.insert(tokens, prefill(model, tokens)) == 0
        assert store.stats()["writer"]["dropped_jobs"] == 1 and not store.writer.pending_bytes


def test_bad_input_is_refused_with_a_clear_message(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, path)
        cache = prefill(model, [1, 2, 3])
        with pytest.raises(InvalidInputError, match="token 1 is -4"):
            mc.insert([1, -4, 3], cache)
        with pytest.raises(InvalidInputError, match="token 2 is 'x'"):
            mc.fetch([1, 2, "x"])
        with pytest.raises(InvalidInputError, match="at least one token"):
            mc.insert([], cache)
        with pytest.raises(InvalidInputError, match="processed 3 tokens but 4"):
            mc.insert([1, 2, 3, 4], cache)
        with pytest.raises(InvalidInputError, match="layers"):
            mc.insert([1, 2, 3], cache[:1])
        with pytest.raises(InvalidInputError, match="not text"):
            mc.fetch("hello")
        vocab = model.args.vocab_size  # (an id past it crashed the process in the embedding)
        with pytest.raises(InvalidInputError, match=rf"tokens\[2\]: {vocab} is outside the model's vocabulary"):
            mc.prefill([1, 2, vocab, 4])
        for bad in ({"step": -5}, {"step": 0}, {"step": "x"}, {"step": 1.5}, {"checkpoint_every": -2},
                    {"checkpoint_every": "x"}):  # (a negative step cut nothing and blamed the cache)
            with pytest.raises(InvalidInputError, match=f"{next(iter(bad))}: give a whole number"):
                mc.prefill([1, 2, 3, 4], **bad)
        assert store.stats()["chunks"] == 0
    with pytest.raises(InvalidInputError, match="the store's path is empty"):  # not the current folder
        kvstore.open("")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(StoreOpenError, match="not a directory"):
        kvstore.open(a_file)
    with pytest.raises(StoreOpenError, match="cannot create"):
        kvstore.open(a_file / "sub")
    with pytest.raises(InvalidInputError, match="chunk_size"):
        kvstore.open(tmp_path / "x", chunk_size=0)


def test_store_path_not_writable_is_refused(tmp_path):
    """A folder this process cannot write. Root writes through any mode bits, so as root the
    folder is a read-only bind mount (what a read-only share looks like); else mode 0500."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    mounted = False
    if os.geteuid() == 0:
        result = subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"root, and no read-only bind mount here ({result.stderr.strip()})")
        mounted = True
    try:
        with pytest.raises(StoreOpenError) as refused:
            kvstore.open(ro)
        message = str(refused.value)  # names the folder and why
        assert str(ro) in message and re.search(r"not writable|read-only file system|Read-only file system|Permission denied", message)
        assert "read_only=True" in message  # what a library user opens it with instead
        assert os.listdir(ro) == []  # nothing was made in it
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)


def test_store_from_a_newer_schema_refuses_to_open(tmp_path):
    kvstore.open(tmp_path / "s").close()
    import sqlite3

    con = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    con.execute("INSERT INTO schema_migrations VALUES (9999, '9999_future.sql', 0)")
    con.commit()
    con.close()
    with pytest.raises(SchemaTooNewError, match="upgrade kvstore"):
        kvstore.open(tmp_path / "s")


def test_permissions(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        t = rand_tokens(C + 2, seed=16)
        store.bind(model, path).insert(t, prefill(model, t))
        store.flush()
        assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
        assert (tmp_path / "s" / "index.sqlite").stat().st_mode & 0o777 == 0o600
        for f in blobtree.walk(store.blob_root):
            assert f.stat().st_mode & 0o777 == 0o600
            assert f.parent.stat().st_mode & 0o777 == 0o700


def test_bf16_stays_bf16_bit_exact(tmp_path, llama):
    path, model = llama
    model16, _ = load(str(build_demo_model(tmp_path / "m16", "llama", dtype="bfloat16")))
    tokens = rand_tokens(C + 5, seed=17)
    cache = prefill(model16, tokens)
    assert cache[0].keys.dtype == mx.bfloat16
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model16, tmp_path / "m16")
        mc.insert(tokens, cache)
        store.flush()
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        got, rest = store.bind(model16, tmp_path / "m16").fetch(tokens + [1])
        assert got[0].keys.dtype == mx.bfloat16
        a = np.array(got[1].keys[..., : len(tokens), :].view(mx.uint16))  # then spare room
        b = np.array(cache[1].keys[..., : len(tokens), :].view(mx.uint16))
        assert (a == b).all()


def test_chain_hash_known_answers():
    """Fixed digests, computed once and written here: any change to what is hashed (a skipped
    token, another byte order, another seed) changes them, and every stored key with them."""
    import xxhash

    from kvstore import keys

    ns = b"n" * 16
    t = np.arange(600)
    assert [h.hex() for h in keys.chain(ns, t, 256)] == [
        "cef3683032303d7b54c546fe4be52cb0", "26f985d324c89d5c47b5bf74d550275e"]
    assert keys.tail_hash(keys.chain(ns, t, 256)[-1], t[512:]).hex() == "1149666bb216dede4ff41bcafaaf0370"
    assert [h.hex() for h in keys.chain(ns, np.arange(8), 4)] == [
        "fdfba931761ea2d34ea05ddcdc0d8fec", "e216afdc39744c5d0bc93722cc79efb3"]
    assert keys.tail_hash(ns, np.array([7])).hex() == "7360ffde8d52d9f58edcd131d97563a9"
    assert keys.namespace(b"\x01" * 16, {"layers": [{"class": "KVCache"}]}, 256).hex() == \
        "f09f2ed7a961c8abd9f0d3b07d7ead22"
    # The definition itself: h_i = xxh3_128(h_{i-1} || chunk i as little-endian int32).
    h1 = xxhash.xxh3_128_digest(ns + np.arange(4, dtype="<i4").tobytes())
    assert keys.chain(ns, np.arange(8), 4) == [h1, xxhash.xxh3_128_digest(h1 + np.arange(4, 8, dtype="<i4").tobytes())]
    # Every token of a chunk counts, its last one too.
    for i in range(4):
        other = np.arange(8)
        other[4 + i] += 1
        assert keys.chain(ns, other, 4)[1] != keys.chain(ns, np.arange(8), 4)[1], i


def test_chain_hashes_are_the_same_in_every_process():
    from kvstore import keys

    code = ("from kvstore import keys; import numpy as np; "
            "print(keys.chain(b'n'*16, np.arange(600), 256)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout for seed in (1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip() == keys.chain(b"n" * 16, np.arange(600), 256)[-1].hex()




def test_blobs_are_standard_safetensors_and_the_index_a_plain_sqlite_file(tmp_path, llama):
    """Other tools can read what kvstore writes: the official safetensors reader opens every blob
    with its metadata, and sqlite-utils sees the schema the migrations made."""
    from safetensors import safe_open
    from sqlite_utils import Database

    path, model = llama
    tokens = rand_tokens(C + 4, seed=40)
    cache = prefill(model, tokens)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).insert(tokens, cache)
        store.flush()
        rows = {r.hash: r for r in store.index.rows()}
        for f in blobtree.walk(store.blob_root):
            h = blobtree.hash_of(f)
            with safe_open(str(f), framework="numpy") as st:
                meta = st.metadata()
                assert meta["hash"] == h.hex() and int(meta["depth"]) == rows[h].depth
                toks = st.get_tensor("tokens")
                assert toks.tolist() == tokens[(rows[h].depth - 1) * C :][: rows[h].ntokens]
                assert rows[h].first_token == toks[0]
                keys = st.get_tensor("0.keys")
                start = (rows[h].depth - 1) * C
                want = np.array(cache[0].keys[..., start : start + rows[h].ntokens, :])
                assert np.array_equal(keys, want)
    db = Database(tmp_path / "s" / "index.sqlite")
    assert {"records", "children", "models", "totals", "meta", "file_digests",
            "schema_migrations"} <= set(db.table_names())
    assert {"hash", "parent", "depth", "ntokens", "first_token", "size", "checksum", "last_access", "hits",
            "pinned"} <= set(db["records"].columns_dict)
    assert {"parent", "first_token", "hash", "tenant"} == set(db["children"].columns_dict)
    assert [r["version"] for r in db["schema_migrations"].rows] == [v for v, *_ in available_migrations()]


def test_library_bounds_and_ids_of_the_wrong_kind_are_refused_and_delete_nothing(llama, tmp_path, caplog):
    """gc's bounds read as `kvstore.open`'s settings do (a size, a duration, never negative), a
    fingerprint is kvstore's 16 bytes, and a server's lookup of token ids that are no ids is a
    logged miss: an InvalidInputError (or a miss), never a bare TypeError or a store emptied."""
    from kvstore import PersistentPromptCache, UnknownTenantError

    assert issubclass(UnknownTenantError, InvalidInputError)
    path, model = llama
    tokens = list(range(100, 140))
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        mc = store.bind(model, str(path))
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        held = store.stats()["bytes"]
        for bad in (-5, "lots", True, [1]):
            with pytest.raises(InvalidInputError, match="max_bytes"):
                store.gc(max_bytes=bad)
        with pytest.raises(InvalidInputError, match="max_age: -1 is negative"):
            store.gc(max_age=-1)
        assert store.stats()["bytes"] == held
        assert store.gc(max_bytes="1GB")["evicted"] == 0 and store.gc(max_age="7d")["evicted"] == 0
        for bad in ("abc", b"short"):
            with pytest.raises(InvalidInputError, match="16-byte fingerprint"):
                store.bind(model, str(path), fingerprint=bad)
        # MLX's quantize kills the process (SIGFPE) on a group size of 0: refused at bind
        for bits, group, what in ((7, 64, "kv_bits"), (8, 0, "kv_group_size"), (4, 16, "kv_group_size")):
            with pytest.raises(InvalidInputError, match=f"{what} must be"):
                store.bind(model, str(path), kv_bits=bits, kv_group_size=group)
        pc = PersistentPromptCache(store)
        pc.register("m", mc)
        asked = [float(t) + 0.5 for t in tokens]
        assert pc.fetch_nearest_cache("m", asked) == (None, asked)  # a miss, with what was asked
        assert pc.counters["fetch_errors"] == 1


def test_a_server_authors_wrong_arguments_are_refused_when_given_naming_them(llama, tmp_path):
    """The mistakes of a first server: the store's path where the store goes, mlx_lm.load's
    (model, tokenizer) pair as the model, a bound that is no count, text where a list or a flag
    goes, a misspelt keyword. Each is refused when it is given, with an InvalidInputError (or, for
    the keyword, a TypeError) that names the argument: never an AttributeError from inside, and
    never a prompt cache that runs and silently stores nothing."""
    from kvstore import PersistentPromptCache

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        for bad in ((model, None), str(path), None):
            with pytest.raises(InvalidInputError, match=r"model: .*mlx-lm model"):
                store.bind(bad, str(path))
        with pytest.raises(InvalidInputError, match=r"model: .*\(model, tokenizer\)"):
            store.bind((model, None), str(path))
        for bad in (model, None):  # (the message was the model's whole module tree, or 'None')
            with pytest.raises(InvalidInputError, match=r"model_id: .*folder or Hugging Face repo id"):
                store.bind(model, bad)
        with pytest.raises(InvalidInputError, match=r"store: .*kvstore\.open"):
            PersistentPromptCache(str(tmp_path / "s"))
        for kw in ({"max_size": -1}, {"max_size": "10"}, {"max_size": True}, {"max_bytes": -1}, {"max_bytes": 1.5}):
            with pytest.raises(InvalidInputError, match=f"{next(iter(kw))}: "):
                PersistentPromptCache(store, **kw)
        assert PersistentPromptCache(store, 0, 2**30).max_bytes == 2**30  # LRUPromptCache's own values
        pc = PersistentPromptCache(store)
        with pytest.raises(InvalidInputError, match=r"model_cache: .*store\.bind"):
            pc.register("m", model)
        with pytest.raises(InvalidInputError, match=r"for_tenant: .*tenants=True"):  # (alice's prompts were shared)
            pc.for_tenant("alice")
        with pc.for_tenant(None):  # the shared namespace's, as every call of it is
            pass
        with pytest.raises(InvalidInputError, match="adapter_path: .*not int"):  # (a bare TypeError)
            store.bind(model, str(path), adapter_path=5)
        with pytest.raises(InvalidInputError, match="drop_tenants: .*list"):
            store.gc(drop_tenants="abc")
        with pytest.raises(InvalidInputError, match="timeout: "):
            store.flush(timeout="1s")
        mc, tokens = store.bind(model, str(path)), list(range(1, 40))
        for kw in ({"pin": "yes"}, {"durable": 1}, {"checkpoint": None}):
            with pytest.raises(InvalidInputError, match=f"{next(iter(kw))}: give True or False"):
                mc.insert(tokens, prefill(model, tokens), **kw)
        with pytest.raises(InvalidInputError, match="pin: give True or False"):
            mc.prefill(tokens, pin="no")
        assert store.stats()["chunks"] == 0  # nothing of any of them was stored
    for bad in (123, ["a"]):
        with pytest.raises(InvalidInputError, match="path: "):
            kvstore.open(bad)
    kvstore.open(os.fsencode(tmp_path / "b")).close()  # a path in bytes, as os.fspath gives it
    for kw in ({"read_only": "no"}, {"create": "yes"}):
        with pytest.raises(InvalidInputError, match=f"{next(iter(kw))}: "):
            kvstore.open(tmp_path / "t", **kw)
    with pytest.raises(TypeError, match=r"kvstore\.open\(\) got an unexpected keyword argument 'max_byte'.*max_bytes"):
        kvstore.open(tmp_path / "t", max_byte=5)
    assert not (tmp_path / "t").exists()  # nothing was made for any of them


def test_flags_of_gc_verify_and_the_prompt_cache_that_are_not_true_or_false_are_refused(llama, tmp_path):
    """`gc(stale="no")` read as true and evicted the pinned records of a changed model,
    `verify(repair="no")` repaired, `PersistentPromptCache(tenants="no")` served every call
    outside `for_tenant` without the store: each is refused naming the flag, deleting nothing."""
    from kvstore import PersistentPromptCache

    path, model = llama
    tokens = list(range(100, 140))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, str(path)).prefill(tokens, pin=True)
        store.flush()
        held = store.stats()["bytes"]
        for call, flag in ((lambda v: store.gc(max_bytes=0, stale=v), "stale"),
                           (lambda v: store.gc(max_bytes=0, dry_run=v), "dry_run"),
                           (lambda v: store.verify(repair=v), "repair"), (lambda v: store.verify(force=v), "force"),
                           (lambda v: PersistentPromptCache(store, tenants=v), "tenants")):
            for bad in ("no", 0, None):
                with pytest.raises(InvalidInputError, match=f"{flag}: give True or False, not {bad!r}"):
                    call(bad)
        assert store.stats()["bytes"] == held and store.pins()[0]["records"] > 0
        assert store.gc(dry_run=np.bool_(True))["dry_run"]  # numpy's bools are bools
    with kvstore.open(kvstore.MEMORY, chunk_size=C) as ram:  # every key the docs list, in RAM too
        assert ram.stats()["quarantined_now"] == {"records": 0, "bytes": 0}


def test_a_closed_store_refuses_every_call_of_its_models(tmp_path, llama, tier):
    """After `close()` a store in RAM still answered `stored_length`, `stored_whole` and `placement`
    from what it held, and `prefill` said its prompt was stored (`(None, n, 0)`), while `fetch`
    and `insert` refused: each refuses now, as it does on a store on disk. flush and close pass."""
    path, model = llama
    tokens = rand_tokens(3 * C + 5)
    store = open_store(tmp_path, tier)
    mc = store.bind(model, path)
    mc.prefill(tokens)
    store.close()
    for call in (lambda: mc.fetch(tokens), lambda: mc.insert(tokens, prefill(model, tokens)),
                 lambda: mc.prefill(tokens), lambda: mc.stored_length(tokens), lambda: mc.stored_whole(tokens),
                 lambda: mc.placement(tokens), lambda: mc.unpin(tokens), lambda: store.gc(), store.pins,
                 store.verify, lambda: store.bind(model, path)):
        with pytest.raises(StoreOpenError, match="store is closed"):
            call()
    assert store.flush() is True
    store.close()


def test_a_cache_of_another_model_is_refused_at_insert(llama, demo_model, tmp_path):
    """The same layers and cache classes, other head sizes: refused with what differs, nothing
    stored (it would be restored into this model and crash its next step)."""
    from mlx_lm import load

    path, model = llama
    other = load(str(demo_model("llama", "small")))[0]
    tokens = list(range(100, 140))
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        mc = store.bind(model, str(path))
        foreign = prefill(other, tokens)
        if [type(c) for c in foreign] != [type(c) for c in mc.new_cache()] or len(foreign) != len(mc.new_cache()):
            pytest.skip("the small demo model has another layer count: the layer check refuses it first")
        with pytest.raises(InvalidInputError, match=r"cache layer 0's keys is .* not the .* a cache of another model"):
            mc.insert(tokens, foreign)
        store.flush()
        assert store.stats()["bytes"] == 0 and store.stats()["memory"]["records"] == 0
        assert mc.insert(tokens, prefill(model, tokens)) > 0  # its own still goes in


def test_a_model_bound_with_another_models_id_is_refused(llama, demo_model, tmp_path):
    """`bind(model, model_id)` with the id of another model (its config.json says another
    architecture or other sizes than the loaded model's own) is refused, naming the field: its
    K/V would be stored under the other model's fingerprint and served to it. A model whose K/V
    have the same shapes (here: another intermediate size) would not be caught at any insert."""
    path, model = llama
    other = tmp_path / "other"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        with pytest.raises(InvalidInputError, match=r"model_id: '.*other' is not the model given to bind: its "
                                                     r"config.json has intermediate_size=256, the loaded model "
                                                     r"intermediate_size=128"):
            store.bind(model, other)
        with pytest.raises(InvalidInputError, match=r"model_type='gemma3_text', the loaded model model_type='llama'"):
            store.bind(model, demo_model("gemma3_text"))
        assert store.bind(model, path).insert([1, 2, 3], prefill(model, [1, 2, 3])) == 1  # its own folder binds


def test_prefill_on_a_read_only_store_is_refused(llama, tmp_path):
    """`prefill` computes to store: on a store open read-only it computed the prompt, stored
    nothing, pinned nothing and returned as if it had; it is refused, as `unpin` is. A fetch works."""
    path, model = llama
    kvstore.open(tmp_path / "s", chunk_size=16).close()
    with kvstore.open(tmp_path / "s", chunk_size=16, read_only=True) as store:
        mc = store.bind(model, path)
        with pytest.raises(StoreOpenError, match="open read-only: prefill needs to write to it"):
            mc.prefill(list(range(1, 40)), pin=True)
        assert mc.fetch(list(range(1, 40)))[1] == list(range(1, 40))


def test_bytes_written_counts_only_records_whose_rows_went_in(llama, tmp_path):
    """A batch whose rows the index refused (a full disk at the commit) removes its files again:
    the bytes written count nothing of it (they were counted as the files were placed)."""
    from kvstore import faults

    path, model = llama
    tokens = list(range(100, 140))
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        mc = store.bind(model, str(path))
        faults.arm("in_transaction", "enospc")
        try:
            mc.insert(tokens, prefill(model, tokens))
            store.flush()
        finally:
            faults.disarm()
        w = store.stats()["writer"]
        assert w["write_errors"] >= 1 and store.stats()["bytes"] == 0
        assert w["bytes_written"] == 0 and w["records_written"] == 0


def test_the_wal_is_cut_back_after_a_checkpoint(tmp_path):
    """The index's WAL file keeps no more than `WAL_SIZE_LIMIT` once checkpointed: else it stays
    as large as it ever grew (on a disk that filled up, taking back the space freed since)."""
    from kvstore.storage.schema import WAL_SIZE_LIMIT

    with kvstore.open(tmp_path / "s") as store:
        conn = store.index.conn
        assert conn.execute("PRAGMA journal_size_limit").fetchone()[0] == WAL_SIZE_LIMIT
        conn.execute("CREATE TABLE scratch (x BLOB)")
        conn.execute("INSERT INTO scratch VALUES (?)", (os.urandom(3 * WAL_SIZE_LIMIT),))  # a big WAL
        assert os.path.getsize(tmp_path / "s" / "index.sqlite-wal") > 2 * WAL_SIZE_LIMIT
        conn.execute("DROP TABLE scratch")
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        conn.execute("INSERT INTO meta (key, value) VALUES ('scratch', 'x')")  # the next write cuts it back
        assert os.path.getsize(tmp_path / "s" / "index.sqlite-wal") <= WAL_SIZE_LIMIT


def test_last_uses_that_cannot_be_recorded_are_no_dropped_write(tmp_path, llama, caplog, monkeypatch):
    """On a full disk a fetch-only process could not record its records' last uses: it said "a
    write was dropped" each time and counted write errors, though no record was lost."""
    import sqlite3

    path, model = llama
    tokens = list(range(100, 140))
    with kvstore.open(tmp_path / "s", chunk_size=16, memory_bytes=0) as store:
        mc = store.bind(model, str(path))
        mc.insert(tokens, prefill(model, tokens))
        store.flush()

        def full(*args, **kwargs):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(store.index, "touch", full)
        with caplog.at_level("WARNING", logger="kvstore"):
            for _ in range(2):
                mc.fetch(tokens + [1])
                store.flush()
        assert store.stats()["writer"]["write_errors"] == 0
    said = [r.getMessage() for r in caplog.records if "last uses" in r.getMessage()]
    assert len(said) == 1 and "no record is lost" in said[0] and "write was dropped" not in caplog.text
