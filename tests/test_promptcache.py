"""`PersistentPromptCache` keeps mlx-lm's `LRUPromptCache` contract.

mlx-lm's own `TestLRUPromptCache` (tests/test_server.py in ml-explore/mlx-lm), rewritten with
real caches of the tiny demo model instead of `MockCache` (which cannot be stored), on a RAM-only
store and on a disk store. Where kvstore differs on purpose, the test says so:
- an exact hit leaves one token to process (LRUPromptCache returns `[]`);
- a sequence RAM evicted is still on disk, so on a disk store it is a disk hit, not a miss;
- an empty sequence holds no K/V: it is neither stored nor counted.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvtest import logits_diff, prefill
from mlx_lm.models.cache import make_prompt_cache

import kvstore
from kvstore import PersistentPromptCache

KEY = ("test", None, None)
CHUNK = 16


@pytest.fixture(params=["ram", "disk"])
def tier(request):
    return request.param


@pytest.fixture
def setup(llama, tmp_path, tier):
    path, model = llama
    store = kvstore.open(kvstore.MEMORY if tier == "ram" else tmp_path / "store", chunk_size=CHUNK)
    pc = PersistentPromptCache(store, 10)  # in place, as mlx_lm.server makes LRUPromptCache(prompt_cache_size)
    pc.register(KEY, store.bind(model, str(path)))
    yield pc, model, tier == "disk"
    store.close()


def same_kv(model, cache, tokens) -> bool:
    """The restored cache holds the K/V a recompute of `tokens` gives: bit for bit on the bundled
    BLAS, within 1e-5 on OpenBLAS (preloaded), whose rounding follows the shapes computed."""
    ref = prefill(model, tokens)
    if len(cache) != len(ref) or any(c.offset != len(tokens) for c in cache):
        return False
    n = len(tokens)
    return all(mx.allclose(getattr(c, name)[..., :n, :], getattr(r, name)[..., :n, :], atol=1e-5, rtol=1e-5).item()
               for c, r in zip(cache, ref) for name in ("keys", "values"))


def insert(pc, model, tokens, **kw):
    pc.insert_cache(KEY, tokens, prefill(model, tokens), **kw)


def fetch(pc, model, tokens):
    """(tokens reused, rest), checking that what was reused is exactly a recompute's K/V."""
    cache, rest = pc.fetch_nearest_cache(KEY, tokens)
    reused = len(tokens) - len(rest)
    assert rest == tokens[reused:]
    if cache is None:
        assert reused == 0
    else:
        assert reused > 0 and same_kv(model, cache, tokens[:reused])
    return reused, rest


def hit_or_miss(disk: bool, tokens):
    """What fetching a sequence RAM evicted gives: a miss, or (disk) a hit leaving one token."""
    return (len(tokens) - 1, tokens[-1:]) if disk else (0, tokens)


def test_caching(setup):
    pc, model, _ = setup
    tokens = [10] * 24
    assert pc.fetch_nearest_cache(KEY, tokens) == (None, tokens)
    insert(pc, model, tokens)

    # Fetching a cache that is strictly a prefix does not remove it.
    tokens = tokens + [20] * 5
    assert fetch(pc, model, tokens) == (24, [20] * 5)
    assert len(pc) == 1

    # Inserting a trimmable cache with a shared prefix removes the prefix.
    tokens = tokens + [30] * 3
    insert(pc, model, tokens)
    assert len(pc) == 1

    # Fetching with a shared prefix does not remove it either; it reuses the common part.
    tokens = tokens[:26] + [40] * 8
    assert fetch(pc, model, tokens) == (26, [40] * 8)
    assert len(pc) == 1

    # A diverged sequence is another entry.
    insert(pc, model, tokens)
    assert len(pc) == 2


def test_lru(setup):
    pc, model, disk = setup
    pc.max_size = 2
    insert(pc, model, [1, 2])
    insert(pc, model, [2, 3])

    # Deliberate: an exact hit leaves one token (LRUPromptCache: the whole cache and []).
    assert fetch(pc, model, [1, 2]) == (1, [2])
    # LRUPromptCache trims [1, 2] to nothing here and returns an empty cache; a miss is the same.
    assert fetch(pc, model, [1]) == (0, [1])
    assert fetch(pc, model, [1, 3, 4]) == (1, [3, 4])
    assert fetch(pc, model, [2, 3, 4]) == (2, [4])
    assert fetch(pc, model, [2, 4, 5]) == (1, [4, 5])

    insert(pc, model, [1, 2])
    insert(pc, model, [2, 3])
    insert(pc, model, [3, 4])
    assert len(pc) == 2
    pc.store.flush()
    # Deliberate: on a disk store what RAM evicted is still a (disk) hit.
    disk_before = pc.counters["reused_by_tier"]["disk"]
    assert fetch(pc, model, [1, 2]) == hit_or_miss(disk, [1, 2])
    assert pc.counters["reused_by_tier"]["disk"] == disk_before + (1 if disk else 0)
    memory_before = pc.counters["reused_by_tier"]["memory"]
    assert fetch(pc, model, [2, 3]) == (1, [3])
    assert fetch(pc, model, [3, 4]) == (1, [4])
    assert pc.counters["reused_by_tier"]["memory"] == memory_before + 2

    # A "user" sequence outlives assistant ones while there are more of those.
    insert(pc, model, [4, 5], cache_type="user")
    assert len(pc) == 2
    assert fetch(pc, model, [2, 3]) == hit_or_miss(disk, [2, 3])
    assert fetch(pc, model, [3, 4]) == (1, [4])
    assert fetch(pc, model, [4, 5]) == (1, [5])

    insert(pc, model, [5, 6])
    insert(pc, model, [6, 7])
    assert len(pc) == 2
    assert fetch(pc, model, [5, 6]) == hit_or_miss(disk, [5, 6])
    assert fetch(pc, model, [6, 7]) == (1, [7])
    assert fetch(pc, model, [4, 5]) == (1, [5])


def test_insert_trimmable_cache_removes_immediate_prefix(setup):
    pc, model, disk = setup
    insert(pc, model, [1, 2])
    pc.store.flush()
    assert len(pc) == 1
    two = pc.nbytes
    assert two == pc.store.memory.nbytes > 0

    insert(pc, model, [1, 2, 3])
    pc.store.flush()
    assert len(pc) == 1
    # RAM holds the longer sequence only: exactly what a store holding just [1, 2, 3] holds.
    with kvstore.open(kvstore.MEMORY, chunk_size=CHUNK) as alone:
        served = pc._keys.registered[KEY].plain
        mc = alone.bind(model, served.model_id, fingerprint=served.fingerprint)
        mc.insert([1, 2, 3], prefill(model, [1, 2, 3]))
        alone.flush()
        assert pc.nbytes == alone.memory.nbytes > two
    assert len(pc.store.memory) == 1
    # The prefix is still served (from the longer record, or from disk).
    assert fetch(pc, model, [1, 2, 9]) == (2, [9])


def test_insert_empty_tokens_does_not_self_destruct(setup):
    pc, model, _ = setup
    pc.insert_cache(KEY, [], make_prompt_cache(model))
    # Deliberate: an empty sequence holds no K/V, so nothing is stored or counted (LRUPromptCache:
    # one sequence of the empty cache's bytes). Nothing raised, and nothing else is disturbed.
    assert pc.counters["errors"] == 0
    assert len(pc) == 0 and pc.nbytes == 0
    # LRUPromptCache gives back the empty cache; the server makes the same empty cache on a miss.
    assert pc.fetch_nearest_cache(KEY, []) == (None, [])
    insert(pc, model, [1, 2])
    assert len(pc) == 1


def test_fetch_empty_tokens_after_root_eviction(setup):
    pc, model, _ = setup
    pc.insert_cache(KEY, [], make_prompt_cache(model))
    insert(pc, model, [1])
    assert pc.fetch_nearest_cache(KEY, []) == (None, [])
    assert len(pc) == 1


def test_lru_bytes(setup):
    pc, model, disk = setup
    pc.max_size = 100
    insert(pc, model, [1, 2])
    pc.store.flush()
    one = pc.nbytes  # every two-token sequence of this model takes as much
    pc.max_bytes = 3 * one + one // 2
    insert(pc, model, [3, 4])
    insert(pc, model, [4, 5])
    insert(pc, model, [6, 7])
    # Bounded within the insert that went over (not one insert later), before and after the writer.
    assert len(pc) == 3 and pc.nbytes == 3 * one
    pc.store.flush()
    assert len(pc) == 3 and pc.nbytes == 3 * one

    pc.trim_to(n_bytes=2 * one + one // 2)
    assert len(pc) == 2 and pc.nbytes == 2 * one
    assert fetch(pc, model, [1, 2]) == hit_or_miss(disk, [1, 2])
    assert fetch(pc, model, [3, 4]) == hit_or_miss(disk, [3, 4])

    pc.max_bytes = None
    for i in range(10, 16):
        insert(pc, model, [i, i + 1])
    pc.trim_to(n_sequences=2)
    assert len(pc) == 2
    assert fetch(pc, model, [15, 16]) == (1, [16])
    assert fetch(pc, model, [10, 11]) == hit_or_miss(disk, [10, 11])


def test_inserted_tokens_are_trimmed_to_what_the_cache_holds(setup):
    """mlx_lm.server inserts the prompt and every generated token, the last of which its cache
    never processed. That sequence is stored as the tokens the cache holds, and restores exactly."""
    pc, model, _ = setup
    tokens = list(range(40, 70))
    cache = prefill(model, tokens[:-1])  # one token short, as after generation
    pc.insert_cache(KEY, tokens, cache)
    assert pc.counters["errors"] == 0 and pc.counters["inserts"] == 1
    query = tokens[:-1] + [5, 6]
    restored, rest = pc.fetch_nearest_cache(KEY, query)
    assert rest == [5, 6]
    assert same_kv(model, restored, tokens[:-1])
    assert logits_diff(model, restored, rest, query) < 1e-4


def test_sequences_over_the_cap_are_served_not_stored(llama, tmp_path):
    path, model = llama
    with kvstore.open(tmp_path / "store", chunk_size=CHUNK) as store:
        pc = PersistentPromptCache(store, max_insert_tokens=8)
        pc.register(KEY, store.bind(model, str(path)))
        insert(pc, model, list(range(1, 10)))  # 9 tokens
        store.flush()
        assert pc.counters["not_stored_too_long"] == 1 and pc.counters["inserts"] == 0
        assert store.stats()["tails"] == 0 and len(pc) == 0
        insert(pc, model, list(range(1, 9)))  # 8 tokens
        store.flush()
        assert pc.counters["inserts"] == 1 and store.stats()["tails"] == 1


def test_tokens_that_are_not_a_sequence_of_ids_are_refused_or_missed_saying_why(setup, caplog):
    """None, a number or text (a caller's bug) is refused naming what tokens must be; ids that
    are not ints are a miss, logged as such, and the store keeps serving."""
    pc, model, _ = setup
    for bad, what in ((None, "NoneType"), (5, "int"), ("abc", "str: tokenize first")):
        with pytest.raises(kvstore.InvalidInputError, match=f"tokens must be a sequence of token ids, got {what}"):
            pc.fetch_nearest_cache(KEY, bad)
        with pytest.raises(kvstore.InvalidInputError, match="tokens must be a sequence of token ids"):
            pc.insert_cache(KEY, bad, prefill(model, [1, 2]))
    for bad in (["a", "b"], [1.5, 2]):
        assert pc.fetch_nearest_cache(KEY, bad) == (None, bad)
    assert "token ids must be ints" in caplog.text and "'<' not supported" not in caplog.text
    tokens = list(range(1, 40))
    insert(pc, model, tokens)
    assert fetch(pc, model, tokens + [5])[0] == 39


def test_reuse_is_counted_by_tier(llama, tmp_path):
    path, model = llama
    tokens = list(range(100, 140))
    with kvstore.open(tmp_path / "store", chunk_size=CHUNK) as store:
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        insert(pc, model, tokens)
        store.flush()
        assert fetch(pc, model, tokens + [7]) == (40, [7])
        assert pc.counters["reused_by_tier"] == {"memory": 40, "disk": 0, "remote": 0}
    with kvstore.open(tmp_path / "store", chunk_size=CHUNK) as store:  # a fresh process's RAM
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        assert fetch(pc, model, tokens + [7]) == (40, [7])
        assert pc.counters["reused_by_tier"] == {"memory": 0, "disk": 40, "remote": 0}
        assert pc.counters["reused_tokens"] == 40


def test_a_prompt_restored_from_disk_stays_in_ram_after_its_request(llama, tmp_path):
    """After a restart, a stored prompt asked for again restores all but its last token from the
    disk, ending inside its last record; the server then stores prompt and answer (the records it
    restored from). That sequence is held in RAM, so its next request is served from RAM: it was
    dropped from RAM at once, its last record being on disk only."""
    path, model = llama
    tokens = list(range(100, 138))  # 2 chunks and a tail of 6
    with kvstore.open(tmp_path / "store", chunk_size=CHUNK) as store:
        store.bind(model, str(path)).insert(tokens, prefill(model, tokens))
    with kvstore.open(tmp_path / "store", chunk_size=CHUNK) as store:  # a fresh process's RAM
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        cache, rest = pc.fetch_nearest_cache(KEY, tokens)
        assert rest == tokens[-1:]
        model(mx.array([rest]), cache=cache)  # the first step: the cache now holds the whole prompt
        mx.eval([c.state for c in cache])
        pc.insert_cache(KEY, tokens + [9], cache)  # prompt and answer, as mlx_lm.server inserts them
        store.flush()
        assert len(pc) == 1 and store.stats()["memory"]["records"] == 3
        assert fetch(pc, model, tokens + [9]) == (len(tokens), [9])
        assert pc.counters["reused_by_tier"]["memory"] == len(tokens)  # from RAM, not read again


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_inserted_tokens_are_trimmed_for_hybrid_and_sliding_window_caches(demo_model, tmp_path, tier, arch):
    """The same one-token-short insert with recurrent layers (no offset of their own) and sliding
    windows: stored, and restored with the logits of a recompute."""
    from mlx_lm import load

    path = demo_model(arch)
    model, _ = load(str(path))
    with kvstore.open(kvstore.MEMORY if tier == "ram" else tmp_path / "store", chunk_size=CHUNK) as store:
        pc = PersistentPromptCache(store)
        pc.register(KEY, store.bind(model, str(path)))
        tokens = list(range(40, 80))
        pc.insert_cache(KEY, tokens, prefill(model, tokens[:-1]))
        assert pc.counters["errors"] == 0 and pc.counters["inserts"] == 1
        store.flush()
        query = tokens[:-1] + [5, 6]
        restored, rest = pc.fetch_nearest_cache(KEY, query)
        assert rest == [5, 6]
        assert logits_diff(model, restored, rest, query) < 1e-4
