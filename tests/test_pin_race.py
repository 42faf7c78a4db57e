"""A pin leaves the prompt on disk and pinned, whatever other processes did to it before.

The race the concurrency soak found ("pinned prompt lost"): process A prefills a prompt; process B
evicts it; A's `prefill(prompt, pin=True)` then trusted its own memory tier, reported everything
reused, stored nothing and pinned nothing. Both orders are made deterministic here: B's gc runs to
completion in its own process before A pins, or in the middle of A's pin (held by an event).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
from kvtest import logits_diff

import kvstore

C = 16


def gc_in_another_process(store_dir) -> None:
    code = ("import kvstore, sys\n"
            "with kvstore.open(sys.argv[1], chunk_size=16) as s:\n"
            "    r = s.gc(max_bytes=0)\n"
            "    assert r['evicted'] > 0, r\n")
    subprocess.run([sys.executable, "-c", code, str(store_dir)], check=True, timeout=120)


def assert_pinned_and_whole(store_dir, model, model_path, prompt) -> None:
    """A fresh store (no RAM of its own) finds the prompt whole, every record pinned, kept by gc."""
    with kvstore.open(store_dir, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        assert mc.stored_length(prompt) == len(prompt)
        rows = [s.index.get(h) for h in mc.record_hashes(np.asarray(prompt, dtype=np.int32))]
        assert all(r is not None and r.pinned for r in rows)
        s.gc(max_bytes=0)
        assert mc.stored_length(prompt) == len(prompt)
        cache, rest = mc.fetch(prompt + [7])
        assert len(rest) == 1
        assert logits_diff(model, cache, rest, prompt + [7]) <= 1e-4


def test_pin_after_another_process_evicted_the_prompt(tmp_path, llama):
    model_path, model = llama
    prompt = [(i * 7 + 3) % 250 for i in range(3 * C + 5)]
    with kvstore.open(tmp_path, chunk_size=C) as a:
        mc = a.bind(model, model_path)
        mc.prefill(prompt)
        a.flush()
        gc_in_another_process(tmp_path)  # A's memory tier still holds every record
        _, reused, computed = mc.prefill(prompt, pin=True)
        assert computed > 0 and reused + computed == len(prompt)  # it stored the prompt again
        a.flush()
    assert_pinned_and_whole(tmp_path, model, model_path, prompt)


def test_eviction_in_the_middle_of_a_pin_is_noticed(tmp_path, llama):
    model_path, model = llama
    prompt = [(i * 11 + 1) % 250 for i in range(2 * C + 9)]
    with kvstore.open(tmp_path, chunk_size=C) as a:
        mc = a.bind(model, model_path)
        mc.prefill(prompt)
        a.flush()
        real_pin = a.index.pin
        evicted = threading.Event()

        def pin_after_gc(hashes, pinned=True):
            if not evicted.is_set():  # the first pin finds B's gc done between check and pin
                gc_in_another_process(tmp_path)
                evicted.set()
            return real_pin(hashes, pinned)

        a.index.pin = pin_after_gc
        _, reused, computed = mc.prefill(prompt, pin=True)
        assert evicted.is_set() and computed > 0
        a.flush()
        a.index.pin = real_pin
    assert_pinned_and_whole(tmp_path, model, model_path, prompt)


def test_pin_of_a_prompt_still_stored_computes_nothing(tmp_path, llama):
    model_path, model = llama
    prompt = [(i * 5 + 2) % 250 for i in range(2 * C + 3)]
    with kvstore.open(tmp_path, chunk_size=C) as a:
        mc = a.bind(model, model_path)
        mc.prefill(prompt)
        assert mc.prefill(prompt, pin=True)[1:] == (len(prompt), 0)
    assert_pinned_and_whole(tmp_path, model, model_path, prompt)
