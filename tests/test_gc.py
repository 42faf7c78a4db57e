"""gc: the set-based eviction evicts exactly what the leaf-by-leaf LRU rule would (with retention
by role: tests/test_retention_roles.py has it on a real store), the DELETE
itself refuses parents and pinned records, and readers in other processes restore correctly
while gc runs."""

from __future__ import annotations

import heapq
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtest import prefill, readers

import kvstore
from kvstore.sizes import format_size
from kvstore.storage import blobtree
from kvstore.upkeep import evict

C = 4  # tiny chunks: short prompts make long chains of small records


def leaf_by_leaf(rows, total: int, max_bytes: int | None, cutoff: float | None) -> list[bytes]:
    """The reference rule (the product's rule before set-based eviction): pop the unpinned leaf
    of the smallest (class, last access, hash), until within budget and nothing is too old; a
    parent whose last child went becomes a leaf. The class is -1 for a record last used before
    `cutoff`, else its role (row[7], 0 when the rows have none): with one role, plain LRU."""
    children: dict[bytes, int] = {}
    info = {}
    for h, parent, size, last, pinned, *rest in rows:
        role = rest[2] if len(rest) > 2 else 0
        info[h] = (parent, size, (-1 if cutoff is not None and last < cutoff else role, last, h), pinned)
        children[parent] = children.get(parent, 0) + 1
    heap = [key for h, (_, _, key, pinned) in info.items() if not pinned and h not in children]
    heapq.heapify(heap)
    out = []
    while heap:
        cls, _, h = heap[0]
        if not ((max_bytes is not None and total > max_bytes) or cls < 0):
            break
        heapq.heappop(heap)
        parent, size, _, _ = info[h]
        out.append(h)
        total -= size
        children[parent] -= 1
        if children[parent] == 0 and parent in info and not info[parent][3]:
            heapq.heappush(heap, info[parent][2])
    return out


def random_forest(rng: np.random.Generator, n: int, ties: int, pin_share: float, roles: bool = False,
                  one_half: bool = False) -> list[tuple]:
    """Records under a few roots, each a child of a random earlier record (or a root); access
    times drawn from `ties` values so many tie. With `roles`, each gets a role class no
    stronger than its parent's (an insert that reaches a record reaches its ancestors). With
    `one_half`, every hash starts with the same 8 bytes (the planner sorts by the first half
    alone unless two repeat)."""
    roots = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(3)]
    hashes: list[bytes] = []
    rows = []
    role_of: dict[bytes, int] = {root: 2 for root in roots}
    for _ in range(n):
        h = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
        h = roots[0][:8] + h[8:] if one_half else h
        parent = roots[int(rng.integers(0, 3))] if not hashes or rng.random() < 0.1 else \
            hashes[int(rng.integers(max(0, len(hashes) - 20), len(hashes)))]
        row = (h, parent, int(rng.integers(1, 100)), float(rng.integers(0, ties)), int(rng.random() < pin_share), 0)
        if roles:
            role_of[h] = int(rng.integers(0, role_of[parent] + 1))
            row += (True, role_of[h])
        rows.append(row)
        hashes.append(h)
    return rows


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 300), ties=st.sampled_from([1, 3, 50, 10**6]),
       pin_share=st.sampled_from([0.0, 0.02, 0.2]), budget=st.floats(0, 1.1), age=st.none() | st.integers(0, 60),
       roles=st.booleans(), one_half=st.booleans())
def test_plan_equals_the_leaf_by_leaf_rule(seed, n, ties, pin_share, budget, age, roles, one_half):
    rows = random_forest(np.random.default_rng(seed), n, ties, pin_share, roles, one_half)
    total = sum(r[2] for r in rows)
    max_bytes = int(total * budget)
    cutoff = None if age is None else float(age)
    want = leaf_by_leaf(rows, total, max_bytes, cutoff)
    got = evict.choose_victims(evict.Graph.from_rows(rows), max_bytes=max_bytes, cutoff=cutoff, stale=False)
    assert got.hashes == want  # the same records, in the same order
    # The deleter takes them in the table's order: the same records, sorted by hash.
    order = evict.in_key_order(got)
    assert order == sorted(got.hashes)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 300), cut=st.integers(0, 299))
def test_records_under_a_lost_parent_go_first_and_all_of_them(seed, n, cut):
    """A record whose parent is gone (and everything below it) can never be reached: every gc
    that runs takes them all first, the pinned aside, then follows the rule for the rest."""
    rows = random_forest(np.random.default_rng(seed), n, 10**6, 0.05)
    roots = {r[1] for r in rows} - {r[0] for r in rows}
    lost_parent = rows[cut % n][0]
    rows = [r for r in rows if r[0] != lost_parent]
    parents = {r[0]: r[1] for r in rows}

    def reachable(h):
        while h in parents:
            h = parents[h]
        return h in roots

    lost = {r[0] for r in rows if not reachable(r[0])}
    graph = evict.Graph.from_rows([(*r, r[1] in roots) for r in rows])
    p = evict.choose_victims(graph, max_bytes=None, cutoff=None, stale=False)
    pinned_below = set()  # lost records kept: pinned, or above a pinned one
    for r in rows:
        if r[4] and r[0] in lost:
            h = r[0]
            while h in parents:
                pinned_below.add(h)
                h = parents[h]
    assert set(p.hashes) == lost - pinned_below
    total = sum(r[2] for r in rows)
    p = evict.choose_victims(graph, max_bytes=total // 2, cutoff=None, stale=False)
    assert set(p.hashes[: len(lost - pinned_below)]) == lost - pinned_below


def test_stale_versions_go_first_and_all_of_them_with_stale():
    rng = np.random.default_rng(1)
    fresh = random_forest(rng, 200, 10**6, 0.0)
    old = [(*r[:5], 1) for r in random_forest(rng, 100, 10**6, 0.05)]
    rows = fresh + old
    g = evict.Graph.from_rows(rows)
    stale_bytes = sum(r[2] for r in old)
    total = sum(r[2] for r in rows)
    # A budget takes stale records first, even the most recently used of them.
    p = evict.choose_victims(g, max_bytes=total - stale_bytes // 2, cutoff=None, stale=False)
    stale_hashes = {r[0] for r in old}
    assert p.hashes and set(p.hashes) <= stale_hashes
    # A budget keeps stale pins; --stale takes every stale record, pinned ones too (no lookup can
    # use them again), and nothing else without a budget.
    assert any(r[4] for r in old) and not {r[0] for r in old if r[4]} & set(p.hashes)
    p = evict.choose_victims(g, max_bytes=None, cutoff=None, stale=True)
    unpinned = [(*r[:4], 0, 1) for r in old]
    assert set(p.hashes) == set(leaf_by_leaf(unpinned, stale_bytes, -1, None)) == stale_hashes


# -- on a real store ----------------------------------------------------------------------------

def build_store(path: Path, model_path, model, prompts: int = 40, seed: int = 0) -> list[list[int]]:
    """Many small records: prompts that share prefixes of random lengths and branch anywhere,
    some pinned, some fetched again later (so access times differ and many tie)."""
    rng = np.random.default_rng(seed)
    sequences: list[list[int]] = []
    with kvstore.open(path, chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        for i in range(prompts):
            if sequences and rng.random() < 0.8:
                base = sequences[int(rng.integers(0, len(sequences)))]
                cut = int(rng.integers(1, len(base)))
                tokens = base[:cut] + rng.integers(1, 200, int(rng.integers(1, 14))).tolist()
            else:
                tokens = rng.integers(1, 200, int(rng.integers(3, 30))).tolist()
            mc.insert(tokens, prefill(model, tokens), pin=bool(i % 13 == 5))
            sequences.append(tokens)
            if i % 4 == 3:
                store.flush()
                time.sleep(0.002)  # the next batch gets later access times
                for j in rng.integers(0, len(sequences), 3):
                    mc.fetch(sequences[int(j)])
        store.flush()
    return sequences


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, llama):
    path, model = llama
    root = tmp_path_factory.mktemp("gc-store")
    prompts = build_store(root / "s", path, model)
    return root / "s", prompts


def _hashes(store) -> set[bytes]:
    return {r.hash for r in store.index.rows()}


@pytest.mark.parametrize("share, age", [(0.0, None), (0.3, None), (0.6, None), (0.9, None), (1.0, 0.5), (None, 0.0)])
def test_gc_evicts_what_the_leaf_by_leaf_rule_would(tmp_path, small_store, share, age):
    src, _ = small_store
    path = tmp_path / "s"
    shutil.copytree(src, path)
    with kvstore.open(path, chunk_size=C, memory_bytes=0) as store:
        rows = [(hp[:16], hp[16:], sf >> 6, last, sf & 1, 0)  # (size * 4 + role) * 16 + flags; 1: pinned
                for part in store.index.eviction_graph() for hp, last, sf in part]
        before = {r[0] for r in rows}
        total = store.stats()["bytes"]
        max_bytes = None if share is None else int(total * share)
        cutoff = age_s = None
        if age is not None:  # in the middle of a wide gap between access times, so that the
            times = sorted({r[3] for r in rows})  # few microseconds until gc reads the clock move no record
            lo = int(len(times) * age)
            k = max(range(lo, len(times) - 1), key=lambda i: times[i + 1] - times[i])
            cutoff = (times[k] + times[k + 1]) / 2
            age_s = time.time() - cutoff
        want = leaf_by_leaf(rows, total, max_bytes, cutoff)
        assert want or share == 0.0 or age is not None
        dry = store.gc(max_bytes=max_bytes, max_age=age_s, dry_run=True)
        result = store.gc(max_bytes=max_bytes, max_age=age_s)
        assert dry["evicted"] == result["evicted"] == len(want)
        left = _hashes(store)
        pinned = {r[0] for r in rows if r[4]}
        assert pinned <= left
        assert before - left == set(want)
        for h in before - left:  # files went with their rows
            assert not blobtree.blob_path(store.blob_root, h).exists()
        # no record lost its parent
        parents = {r.hash: r.parent for r in store.index.rows()}
        roots = store.index.namespaces()
        assert all(p in parents or p in roots for p in parents.values())
        assert store.verify() == []


@contextmanager
def _copy_of(tmp_path, small_store) -> Iterator[tuple]:
    """A copy of the small store, open (memory tier off): (store, its rows by hash, the hashes of
    each parent's children)."""
    src, _ = small_store
    shutil.copytree(src, tmp_path / "s")
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        rows = {r.hash: r for r in store.index.rows()}
        kids_of: dict[bytes, list[bytes]] = {}
        for r in rows.values():
            kids_of.setdefault(r.parent, []).append(r.hash)
        yield store, rows, kids_of


def test_evict_refuses_a_pinned_record_and_one_with_a_child_it_was_not_given(tmp_path, small_store):
    with _copy_of(tmp_path, small_store) as (store, rows, kids_of):
        index = store.index
        parent = next(h for h, r in rows.items() if h in kids_of and not r.pinned)
        pinned_leaf = next(h for h, r in rows.items() if r.pinned and h not in kids_of)
        leaf = next(h for h, r in rows.items() if not r.pinned and h not in kids_of)

        def evict(victims, batch=None):
            batch = sorted(victims if batch is None else batch)
            with index.victims(victims):
                return index.evict(batch[0], batch[-1])

        # A child not among the victims (gc did not choose it, or another process added it
        # since gc chose): the parent stays. A pinned record stays.
        assert evict({parent}) == []
        assert evict({pinned_leaf}) == []
        assert evict({parent, pinned_leaf}) == []
        assert {parent, pinned_leaf} <= _hashes(store)
        r = rows[leaf]
        assert evict({leaf}) == [(leaf, r.size, r.parent, -1 if r.first_token is None else r.first_token)]
        assert leaf not in _hashes(store)
        # A parent whose children are all victims may go first: its children are unreachable
        # from then on (no lookup finds them), and go in a later transaction.
        only = next(p for p, kids in kids_of.items() if p in rows and not rows[p].pinned and leaf not in kids
                    and all(k not in kids_of and not rows[k].pinned for k in kids))
        kids = kids_of[only]
        victims = {only, *kids}
        assert [h for h, *_ in evict(victims, [only])] == [only]
        assert all(k in _hashes(store) for k in kids)
        assert {h for h, *_ in evict(victims, kids)} == set(kids)
        # Edges: the edges out of a record go with it (no lookup walks them once their parent
        # is gone); the edges into the records evicted, from parents still stored, are kept
        # until forgotten, ignored by readers meanwhile, then gone; an edge whose record is
        # stored is never forgotten.
        edges = lambda: set(index.conn.execute("SELECT parent, hash FROM children"))  # noqa: E731
        before = edges()
        assert not any(p == only for p, _ in before)
        gone = {(rows[h].parent, h) for h in (leaf, only)}
        assert gone <= before
        first = lambda h: -1 if rows[h].first_token is None else rows[h].first_token  # noqa: E731
        stored = next(r for h, r in rows.items() if h == parent)  # stored: its edge stays
        assert index.forget_edges(sorted((p, first(h), h) for p, h in gone | {(stored.parent, parent)})) == len(gone)
        assert edges() == before - gone
        assert {(r.parent, r.hash) for r in index.rows()} == edges()
        for h in (leaf, only, *kids):  # gc deletes the files after each commit
            blobtree.remove(store.blob_root, h)
        assert store.verify() == []


def test_readers_in_other_processes_restore_correctly_during_gc(tmp_path, small_store, llama):
    src, prompts = small_store
    model_path, _ = llama
    path = tmp_path / "s"
    shutil.copytree(src, path)
    with readers(path, model_path, prompts, C, tmp_path, n=2, min_fetches=2 * len(prompts)) as finish:
        with kvstore.open(path, chunk_size=C, memory_bytes=0) as store:
            total = store.stats()["bytes"]
            for share in (0.8, 0.6, 0.4, 0.2, 0.0):  # rows and files go while the readers read them
                store.gc(max_bytes=int(total * share))
                time.sleep(0.2)
            assert store.verify() == []
        results = finish()
    for res in results:
        assert res["fetches"] >= 2 * len(prompts) and res["reused"] > 0
        assert res["wrong"] == 0, res


def test_index_writes_wait_for_gc_on_the_tree_lock_not_in_sqlites_busy_handler(tmp_path):
    """Every index transaction of a store (the write budget, settings, access times, pins) takes
    the blob tree's lock shared first. While gc holds it exclusive, a write waits on the lock,
    whose release wakes it, instead of sleeping in SQLite's busy handler between gc's
    transactions; the thread that holds the lock writes without waiting for itself."""
    import threading

    with kvstore.open(tmp_path / "s", memory_bytes=0) as store:
        index = store.index
        done = threading.Event()

        def write():
            index.set_setting("admit", "reused")
            done.set()

        with blobtree.tree_lock(store.blob_root, exclusive=True):  # as gc holds it
            index.set_setting("admit", "all")  # this thread holds it: no wait for itself
            t = threading.Thread(target=write)
            t.start()
            # SQLite is free (no transaction is open), so only the tree lock can hold it back.
            assert not done.wait(0.3)
            assert index.setting("admit") == "all"
        t.join(timeout=30)
        assert done.is_set() and index.setting("admit") == "reused"


def test_only_the_tops_of_what_gc_evicts_are_checked_for_new_children_and_one_below_is_dropped(
        tmp_path, small_store):
    """A top (a victim whose parent stays) that has a stored child outside the victims stays; below
    a top the check is not made (once the top goes, nothing below it is reachable): a child stored
    there is then found without its parent, and dropped with all below it."""
    with _copy_of(tmp_path, small_store) as (store, rows, kids_of):
        index = store.index
        # p -> k -> kk, none pinned: as if kk had come in after gc chose p and k
        p, k = next((rows[k].parent, k) for k in rows if k in kids_of and rows[k].parent in rows
                    and kids_of[rows[k].parent] == [k] and not rows[k].pinned and not rows[rows[k].parent].pinned)
        below, todo = set(), list(kids_of[k])
        while todo:
            below.add(h := todo.pop())
            todo += kids_of.get(h, [])

        def evict(victims, tops):
            with index.victims(victims, tops):
                batch = sorted(victims)
                return {h for h, *_ in index.evict(batch[0], batch[-1])}

        assert evict({k}, {k}) == set()  # a top with a child outside the victims stays
        assert evict({p, k}, {p}) == {p, k}  # below the top p, k's child is not looked for
        assert set(index.lost_since(0.0)) == set(kids_of[k])  # k's children have lost their parent
        assert {h for h, *_ in index.drop_lost(index.lost_since(0.0))} == below  # and go, with all below
        assert index.lost_since(0.0) == [] and not ({p, k} | below) & _hashes(store)
        left = {r.hash: r for r in store.index.rows()}
        assert all(r.depth == 1 or r.parent in left for r in left.values())  # no row lost its parent


def test_a_record_stored_below_a_branch_gc_evicts_while_it_runs_goes_too(tmp_path, llama, monkeypatch):
    """Another process extends a branch after gc chose it and before gc deletes it: the new record
    hangs from a victim below the branch's top, which no check keeps. gc drops it once its parent
    is gone, file and all, and `verify` finds nothing (it used to find the new row, an orphan)."""
    path, model = llama
    rng = np.random.default_rng(7)
    base = rng.integers(1, 200, 3 * C).tolist()  # three chunks: the top, then two below it
    longer = base + rng.integers(1, 200, C).tolist()  # one chunk more, under the third
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store, \
            kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as other:
        store.bind(model, path).insert(base, prefill(model, base))
        store.flush()
        assert len(_hashes(store)) == 3
        planned = evict.in_key_order

        def then_extend(p):  # gc has planned: the other store writes the longer prompt now
            out = planned(p)
            assert other.bind(model, path).insert(longer, prefill(model, longer)) == 1
            other.flush()
            assert len(_hashes(store)) == 4
            return out

        monkeypatch.setattr(evict, "in_key_order", then_extend)
        result = store.gc(max_bytes=0)
        assert result["evicted"] == 4 and _hashes(store) == set()
        assert store.verify() == []  # no orphan row, and the new record's file is gone too


def test_warming_a_stored_prompt_again_counts_as_a_use(tmp_path, llama):
    """A prompt warmed again (nothing to compute) is used now: a budget that holds one of two
    prompts keeps it, and evicts the other, warmed once since."""
    path, model = llama
    first, second = [list(range(100 + k, 100 + k + 40)) for k in (0, 100)]  # (ids of the vocabulary: 262)
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        mc = store.bind(model, str(path))
        mc.prefill(first)
        time.sleep(0.05)
        mc.prefill(second)
        time.sleep(0.05)
        assert mc.prefill(first)[1:] == (40, 0)  # stored already: reused, nothing computed
        store.flush()
        rows = {r.hash: r for r in store.index.rows()}
        keep = [rows[h] for h in mc.record_hashes(first)]
        store.gc(max_bytes=sum(r.size for r in keep))
        assert set(mc.record_hashes(first)) <= {r.hash for r in store.index.rows()}
        assert not set(mc.record_hashes(second)) & {r.hash for r in store.index.rows()}


def test_gc_of_a_store_in_ram_says_what_it_evicted_and_a_dry_run_evicts_nothing(llama):
    """A RAM-only store's gc trimmed its records even with `dry_run=True`, and said 0 evicted,
    0 bytes freed either way. It says what it evicts (or would), as a disk gc does."""
    path, model = llama
    tokens = list(range(1, 4 * C + 1))
    with kvstore.open(kvstore.MEMORY, chunk_size=C) as store:
        mc = store.bind(model, str(path))
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        held = store.stats()["bytes"]
        plan = store.gc(max_bytes=0, dry_run=True)
        assert (plan["evicted"], plan["freed_bytes"], plan["bytes_before"], plan["bytes"]) == (4, held, held, 0)
        assert store.stats()["bytes"] == held and mc.stored_length(tokens) == len(tokens)
        done = store.gc(max_bytes=held // 2)
        assert done["evicted"] == 2 and done["freed_bytes"] == held - store.stats()["bytes"] > 0
        assert store.gc()["evicted"] == 0


def test_gc_says_what_the_store_holds_after_another_process_stored_meanwhile(tmp_path, llama, monkeypatch, capsys):
    """Another process stores a prompt while gc deletes: gc's "the store holds" is what the store
    holds when gc is done, read from the index, not its total before minus what it freed (which
    went below zero: `the store holds -1.2 MiB`), and its line says what the others stored."""
    from kvstore.cli.main import main

    path, model = llama
    rng = np.random.default_rng(11)
    old, new = (rng.integers(1, 200, 3 * C).tolist() for _ in range(2))
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        store.bind(model, path).insert(old, prefill(model, old))
    planned = evict.in_key_order
    added = []

    def then_store(p):  # gc has planned: another process stores an unrelated prompt now
        out = planned(p)
        with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as other:
            before = other.stats()["bytes"]
            other.bind(model, path).insert(new, prefill(model, new))
            other.flush()
            added.append(other.stats()["bytes"] - before)
        return out

    monkeypatch.setattr(evict, "in_key_order", then_store)
    assert main(["gc", "--store", str(tmp_path / "s"), "--max-bytes", "0B"]) == 0
    line = capsys.readouterr().out
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        held = store.stats()["bytes"]
        mc = store.bind(model, path)
        assert mc.stored_length(old) == 0 and mc.stored_length(new) == len(new)
    assert held == added[0] > 0
    assert f"the store holds {format_size(held)} (was " in line, line
    assert f"other processes stored {format_size(held)} while gc ran" in line, line


def test_verify_waits_for_a_running_gc_instead_of_reporting_its_edges(tmp_path, llama, monkeypatch):
    """Between gc's two sweeps the index holds edges into the rows it deleted (readers ignore
    them; its second sweep drops them). A `verify` run then, from another process on a host where
    gc runs beside servers, reported them as damage (`bad_edge: ... an edge to no record`, exit 1):
    it waits for the running gc instead, and finds the store clean."""
    import threading

    from kvstore.upkeep import gc as gcmod

    path, model = llama
    rng = np.random.default_rng(5)
    base = rng.integers(1, 200, 2 * C).tolist()
    old, new = (base + rng.integers(1, 200, C).tolist() for _ in range(2))
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        for tokens in (old, new):  # two branches of one prefix: gc evicts the older leaf, its parent stays
            mc.insert(tokens, prefill(model, tokens))
            store.flush()
            time.sleep(0.05)
        total = store.stats()["bytes"]
    paused, go, found = threading.Event(), threading.Event(), {}
    sweep_two = gcmod._forget_edges

    def pause_then_forget(index, root, edges):  # gc between its sweeps: the edge into its victim is left
        paused.set()
        go.wait(60)
        return sweep_two(index, root, edges)

    monkeypatch.setattr(gcmod, "_forget_edges", pause_then_forget)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as gc_store, \
            kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as other:
        gc_thread = threading.Thread(target=lambda: found.update(gc=gc_store.gc(max_bytes=total - 1)))
        gc_thread.start()
        assert paused.wait(60)
        verify_thread = threading.Thread(target=lambda: found.update(verify=other.verify()))
        verify_thread.start()
        verify_thread.join(2)  # (time for a verify that does not wait to finish and report)
        go.set()
        gc_thread.join(60)
        verify_thread.join(60)
        assert found["gc"]["evicted"] == 1 and found["verify"] == [], found
        assert other.verify() == []
