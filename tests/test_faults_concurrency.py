"""Fault suite, part 3: several processes and threads on one store, and the races between them.

The races are made deterministic with events that hold one side at the critical point (a
monkeypatched `kvstore.storage.blobfile.open_blob`, or the writer's `after_rename` fault point); the free-running
test starts warmers, fetchers, gc and verify in separate processes on a store none of them has
created yet, each with several threads, for a bounded time (longer with `pytest --soak`).
"""

from __future__ import annotations

import threading
import time

from faultproc import Child, prompts
from kvtest import logits_diff, prefill

import kvstore
from kvstore import faults
from kvstore.storage import blobfile, blobtree

C = 16
TOL = 1e-4


def test_processes_and_threads_share_one_store(tmp_path, llama, request):
    model_path, model = llama
    seconds = 60 if request.config.getoption("--soak") else 4
    store = tmp_path / "new" / "store"  # nobody has made it yet: they all race to create it
    roles = [("warm", 1, 2), ("warm", 2, 2), ("fetch", 1, 2), ("gc", 0, 1), ("verify", 0, 1)]
    children = [Child("worker", store, model_path, C, seed, role, seconds, threads)
                for role, seed, threads in roles]
    summaries = []
    for child, (role, seed, _) in zip(children, roles):
        code = child.wait(timeout=300 + seconds)
        assert code == 0, child.stderr[-3000:]
        summary = child.lines[-1]
        assert summary["errors"] == [], f"{role}:\n" + "\n".join(summary["errors"][:3])
        assert summary["ops"] > 0, role
        summaries.append((role, seed, summary))
    for role, _, s in summaries:
        if role == "fetch":
            assert s["max_diff"] <= TOL  # every restore while the others ran equalled a recompute
        if role == "warm":
            assert s["writer"]["write_errors"] == 0 and s["writer"]["dropped_jobs"] == 0
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        assert s.verify() == []  # clean at the end, without repair
        mc = s.bind(model, model_path)
        for role, seed, summary in summaries:
            if role != "warm":
                continue
            pool = prompts(seed, 24, C)
            for i in sorted(set(summary["flushed"])):
                if i % 3 == 0:  # pinned, so gc may not take them: all must be there
                    assert mc.stored_length(pool[i]) == len(pool[i]), f"pinned prompt {seed}/{i} lost"
            for p in pool[:6]:
                query = p + [4]
                cache, rest = mc.fetch(query)
                assert logits_diff(model, cache, rest, query) <= TOL
        assert s.stats()["quarantined"] == 0
    if request.config.getoption("--soak"):
        print("\nSOAK concurrency:", {f"{r}{sd}": (s["ops"], len(s["errors"])) for r, sd, s in summaries})


def test_gc_deletes_a_blob_while_fetch_is_reading_it(tmp_path, llama, monkeypatch):
    model_path, model = llama
    tokens = prompts(30, 1, C)[0][: 2 * C] + list(range(10, 10 + C + 4))  # 3 chunks and a tail
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        rows = sorted(store.index.rows(), key=lambda r: r.depth)
        target = rows[1].hash  # the reader stops just before reading the second chunk's file
        reached, go = threading.Event(), threading.Event()

        def paused(real):
            def read(root, h, **kw):
                if h == target:
                    reached.set()
                    assert go.wait(60)
                return real(root, h, **kw)
            return read

        # every read of a blob by fetch opens it with `blobfile.open_blob`
        monkeypatch.setattr(blobfile, "open_blob", paused(blobfile.open_blob))
        out: dict = {}
        query = tokens + [2]
        reader = threading.Thread(target=lambda: out.update(result=mc.fetch(query)))
        reader.start()
        assert reached.wait(60)
        result = store.gc(max_bytes=0)  # rows and then files, all of them, under the reader
        assert result["evicted"] == len(rows)
        assert not blobtree.blob_path(store.blob_root, target).exists()
        go.set()
        reader.join(60)
        cache, rest = out["result"]
        assert len(query) - len(rest) in (0, C)  # a miss, or the chunk it had read before
        assert logits_diff(model, cache, rest, query) <= TOL
        assert store.stats()["quarantined"] == 0  # evicted is not damaged: nothing to quarantine
        assert store.stats()["quarantined_total"] == 0
        assert store.verify() == []


def test_repair_never_deletes_a_blob_whose_row_is_on_its_way(tmp_path, llama, monkeypatch):
    """A writer between `rename` and its row insert, and `verify --repair` in another store
    object (as another process would): the blob is not an orphan, it must survive."""
    model_path, model = llama
    tokens = prompts(31, 1, C)[0]
    reached, go = threading.Event(), threading.Event()
    real_hit = faults.hit

    def hold(point):
        if point == "after_rename" and not reached.is_set():
            reached.set()
            assert go.wait(60)
        real_hit(point)

    monkeypatch.setattr(faults, "hit", hold)
    with kvstore.open(tmp_path / "s", chunk_size=C) as writer_side:
        mc = writer_side.bind(model, model_path)
        mc.insert(tokens, prefill(model, tokens))
        assert reached.wait(60)  # the first blob is in place, its row is not
        repaired: dict = {}
        other = kvstore.open(tmp_path / "s", chunk_size=C)
        repair = threading.Thread(target=lambda: repaired.update(problems=other.verify(repair=True)))
        repair.start()
        time.sleep(0.5)  # give the repair every chance to run into the half-done write
        go.set()
        repair.join(60)
        assert not repair.is_alive()
        writer_side.flush()
        other.close()
        assert [p for p in repaired["problems"] if p.kind != "orphan_file"] == []
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        cache, rest = mc.fetch(tokens)
        assert rest == tokens[-1:]  # everything written is there
        assert s.verify() == [] and s.stats()["quarantined"] == 0


def test_storing_a_quarantined_record_again_heals_it(tmp_path, llama):
    model_path, model = llama
    tokens = prompts(32, 1, C)[0][: 2 * C] + list(range(20, 25))
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:
        mc = s.bind(model, model_path)
        mc.insert(tokens, prefill(model, tokens))
        s.flush()
        row = sorted(s.index.rows(), key=lambda r: r.depth)[1]
    path = blobtree.blob_path(tmp_path / "s" / "blobs", row.hash)
    path.write_bytes(b"\0" * 64)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        assert len(mc.fetch(tokens)[1]) == len(tokens) - C  # quarantined at the second chunk
        mc.insert(tokens, prefill(model, tokens))  # the same prompt again, no repair in between
        s.flush()
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        cache, rest = mc.fetch(tokens + [1])
        assert rest == [1]
        assert logits_diff(model, cache, rest, tokens + [1]) <= TOL
        assert s.verify() == []


def test_gc_evicts_the_parent_of_a_queued_insert(tmp_path, llama):
    """`insert` saw the prefix stored and queued only the new records; gc evicted the prefix
    before the writer got to them. The writer stores the prefix again, never an orphan chain."""
    model_path, model = llama
    base = prompts(33, 1, C)[0][: 2 * C]
    longer = base + list(range(30, 30 + C + 5))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        mc.insert(base, prefill(model, base))
        store.flush()
        store.writer.pause()
        try:
            assert mc.insert(longer, prefill(model, longer)) == 2  # a chunk and a tail, no prefix
            assert store.gc(max_bytes=0)["evicted"] == 2  # the prefix, under the queued job
        finally:
            store.writer.resume()
        store.flush()
        assert store.verify() == []
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        query = longer + [1]
        cache, rest = mc.fetch(query)
        assert rest == [1] and logits_diff(model, cache, rest, query) <= TOL
