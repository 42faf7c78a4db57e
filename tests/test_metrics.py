"""`kvstore.serve.metrics`: the Prometheus exposition of a `PersistentPromptCache`, in process (the
served `/metrics` endpoint is tested end to end in test_server.py)."""

from __future__ import annotations

from kvtest import prefill
from prometheus_client.parser import text_string_to_metric_families

import kvstore
from kvstore import PersistentPromptCache
from kvstore.serve.metrics import ServerMetrics

KEY = ("test", None, None)


def samples(metrics: ServerMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_counts_follow_requests_and_registries_are_separate(llama, tmp_path):
    path, model = llama
    tokens = list(range(30, 60))
    with kvstore.open(tmp_path / "store", chunk_size=16) as store:
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        metrics, other = ServerMetrics(pc), ServerMetrics(PersistentPromptCache(store))
        pc.fetch_nearest_cache(KEY, tokens)
        pc.insert_cache(KEY, tokens, prefill(model, tokens))
        store.flush()
        pc.fetch_nearest_cache(KEY, tokens + [1, 2])
        got = samples(metrics)
        assert got[("kvstore_requests_total", ())] == 2
        assert got[("kvstore_prompt_tokens_total", ())] == 30 + 32
        assert got[("kvstore_reused_tokens_total", (("tier", "memory"),))] == 30
        assert got[("kvstore_inserts_total", ())] == 1
        assert got[("kvstore_fetch_seconds_count", ())] == 2
        assert got[("kvstore_restored_tokens_sum", ())] == 30
        assert got[("kvstore_records", (("kind", "chunk"),))] == 1
        assert got[("kvstore_records", (("kind", "tail"),))] == 1
        assert got[("kvstore_store_bytes", ())] == store.stats()["bytes"] > 0
        assert got[("kvstore_memory_bytes", ())] == store.memory.nbytes
        assert not any(name.startswith("kvstore_remote") for name, _ in got)
        assert ("kvstore_reused_tokens_total", (("tier", "remote"),)) not in got
        assert samples(other)[("kvstore_requests_total", ())] == 0  # its own registry


def test_ram_only_store(llama):
    path, model = llama
    with kvstore.open(kvstore.MEMORY, chunk_size=16) as store:
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        pc.insert_cache(KEY, [5, 6, 7], prefill(model, [5, 6, 7]))
        store.flush()
        got = samples(ServerMetrics(pc))
        assert got[("kvstore_store_bytes", ())] == store.memory.nbytes > 0
        assert got[("kvstore_records", (("kind", "tail"),))] == 1
        assert ("kvstore_reused_tokens_total", (("tier", "memory"),)) in got
        assert ("kvstore_reused_tokens_total", (("tier", "disk"),)) not in got


def test_a_fetch_that_hits_an_index_error_counts_one_fetch_error(llama, tmp_path):
    """The lookup's index read fails (as a damaged or unreachable index makes it): the request is
    served as a miss, and `kvstore_fetch_errors_total` goes up by exactly one."""
    import sqlite3

    path, model = llama
    tokens = list(range(30, 70))
    with kvstore.open(tmp_path / "store", chunk_size=16, memory_bytes=0) as store:
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        metrics = ServerMetrics(pc)
        pc.insert_cache(KEY, tokens, prefill(model, tokens))
        store.flush()
        assert samples(metrics)[("kvstore_fetch_errors_total", ())] == 0

        def broken(hashes):
            raise sqlite3.DatabaseError("database disk image is malformed")

        store.index.rows_of = broken
        try:
            cache, rest = pc.fetch_nearest_cache(KEY, tokens + [1])
        finally:
            del store.index.rows_of
        assert cache is None and rest == tokens + [1]  # a miss, never an error into generation
        assert samples(metrics)[("kvstore_fetch_errors_total", ())] == 1
        _, rest = pc.fetch_nearest_cache(KEY, tokens + [1])  # the index answers again: a hit, no error
        assert rest == [1] and samples(metrics)[("kvstore_fetch_errors_total", ())] == 1
        metrics.close()


def test_remote_counters_appear_with_a_remote_tier(llama, tmp_path, s3):
    """With a remote tier (a real SeaweedFS), its counters are exported, and the tokens it filled
    in during a fetch count as reused from `remote`."""
    path, model = llama
    tokens = list(range(30, 70))  # two 16-token chunks and a tail
    url = s3.url()
    with kvstore.open(tmp_path / "a", chunk_size=16, remote=url) as a:  # another machine
        a.bind(model, str(path)).insert(tokens, prefill(model, tokens))
        assert a.flush(timeout=60)
    with kvstore.open(tmp_path / "b", chunk_size=16, remote=url) as store:  # an empty local store
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        metrics = ServerMetrics(pc)
        got = samples(metrics)
        assert got[("kvstore_reused_tokens_total", (("tier", "remote"),))] == 0
        _, rest = pc.fetch_nearest_cache(KEY, tokens + [1])
        assert rest == [1]
        got = samples(metrics)
        filled = store.remote.counters["remote_tokens"]
        assert filled == len(tokens)
        assert got[("kvstore_reused_tokens_total", (("tier", "remote"),))] == filled
        assert got[("kvstore_remote_events_total", (("event", "downloads"),))] == store.remote.counters["downloads"] > 0
        assert got[("kvstore_remote_events_total", (("event", "uploads"),))] == 0  # never re-uploads


def test_scrapes_from_many_threads_use_one_index_connection(tmp_path):
    """Every HTTP request runs on a new thread, and the index keeps a connection per thread that
    used it: scrapes read the index from one thread of their own, so connections do not pile up."""
    import threading

    with kvstore.open(tmp_path / "store") as store:
        metrics = ServerMetrics(PersistentPromptCache(store))
        before = len(store.index._connections)
        for _ in range(20):
            t = threading.Thread(target=metrics.render)
            t.start()
            t.join()
        assert len(store.index._connections) <= before + 1
        metrics.close()
