"""What a long-running process keeps: the memory tier holds no more than it counts, the store's
remembered sets stay within their bounds while eviction runs all the time, and open/close cycles
leave no thread, file descriptor or store behind."""

from __future__ import annotations

import gc
import os
import threading

import mlx.core as mx
import numpy as np
from kvtest import prefill

import kvstore
from kvstore.restore import plan
from kvstore.storage import blobfile
from kvstore.tiers import disk
from kvstore.write import jobs

C = 16  # a small chunk size: short prompts span many records


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts over a few shared prefixes, each with a suffix of its own."""
    rng = np.random.default_rng(seed)
    prefixes = [[int(t) for t in rng.integers(0, 250, 3 * C)] for _ in range(3)]
    return [prefixes[i % 3] + [int(t) for t in rng.integers(0, 250, int(rng.integers(C, 3 * C)))]
            for i in range(n)]


def _serve(mc, model, tokens: list[int]) -> None:
    cache, rest = mc.fetch(tokens)
    model(mx.array(rest)[None], cache=cache)
    mx.eval([c.state for c in cache])
    mc.insert(tokens, cache)


def _open_in(path) -> list[str]:
    """What this process holds open under `path`."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def test_memory_tier_counts_every_byte_its_records_keep(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=1 << 20) as store:
        mc = store.bind(model, str(path))
        for tokens in _prompts(6):
            mc.insert(tokens, prefill(model, tokens))
        store.flush()
        for tokens in _prompts(6):
            mc.fetch(tokens)  # records restored from disk are kept in the tier too
        held = list(store.memory._records.values())
        assert held
        # A record's token ids that are a view of its whole prompt's keep the prompt alive,
        # past the bytes the tier counts for the record.
        assert [r.hash for r in held if r.tokens.base is not None] == []
        assert store.memory.nbytes == sum(r.tokens.nbytes + sum(a.nbytes for a in r.arrays.values())
                                          for r in held)
        assert store.memory.nbytes <= store.memory.capacity


def test_remembered_sets_stay_within_their_bounds_while_eviction_runs(tmp_path, llama, monkeypatch):
    """Small bounds, so that a few dozen requests go past each of them."""
    path, model = llama
    monkeypatch.setattr(jobs, "COMPLETE_REMEMBERED", 20)
    monkeypatch.setattr(disk, "FRESH_REMEMBERED", 20)
    monkeypatch.setattr(blobfile, "_HEADERS_MAX", 10)
    monkeypatch.setattr(plan, "_PLANS_MAX", 4)
    root = tmp_path / "s"
    with kvstore.open(root, chunk_size=C, memory_bytes=64 << 10, max_bytes=256 << 10) as store:
        mc = store.bind(model, str(path))
        for i, tokens in enumerate(_prompts(60)):
            _serve(mc, model, tokens)
            if i % 20 == 19:
                store.flush()
                store.gc(max_bytes=128 << 10)
        store.flush()
        assert store.writer.stats.records_written > 20  # each bound was gone past
        assert len(store.writer._dest.complete) <= 20
        assert len(store.writer._dest.left_out) <= 20
        assert len(mc.backing.budget._fresh) <= 20 and len(mc.backing.budget._wasted_at) <= 20
        assert len(blobfile._HEADERS) <= 10 and len(plan._PLANS) <= 4
        assert store.memory.nbytes <= store.memory.capacity
        assert [t for t in _open_in(root) if "(deleted)" in t] == []  # no blob gc deleted is held open
        assert {os.path.basename(t) for t in _open_in(root)} == {"index.sqlite", "index.sqlite-shm", "index.sqlite-wal"}


def test_open_close_cycles_leave_nothing_behind(tmp_path, llama):
    path, model = llama
    root = tmp_path / "s"
    tokens = _prompts(1)[0]

    def cycle(i: int) -> None:
        options = dict(chunk_size=C, memory_bytes=64 << 10, max_bytes=256 << 10)
        if i % 2:
            with kvstore.open(root, **options) as store:
                _serve(store.bind(model, str(path)), model, tokens + [i % 250])
                store.gc(max_bytes=64 << 10)
        else:
            store = kvstore.open(root, **options)
            _serve(store.bind(model, str(path)), model, tokens + [i % 250])
            store.close()

    cycle(0)
    gc.collect()
    threads, fds = {t.ident for t in threading.enumerate()}, len(os.listdir("/proc/self/fd"))
    for i in range(1, 41):
        cycle(i)
    gc.collect()
    assert {t.name for t in threading.enumerate() if t.ident not in threads} == set()
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert _open_in(root) == []
    assert [o for o in gc.get_objects() if isinstance(o, kvstore.Store)] == []
