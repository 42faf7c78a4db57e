"""`max_bytes="auto"`: a disk budget from the free space of the store's disk."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
from kvtest import prefill

import kvstore
from kvstore.errors import InvalidInputError
from kvstore.serve.server import _parser
from kvstore.upkeep.local import AUTO_SHARE

Usage = namedtuple("Usage", "total used free")


def test_auto_budget_is_a_quarter_of_held_plus_free(tmp_path):
    before = shutil.disk_usage(tmp_path).free
    with kvstore.open(tmp_path / "s", max_bytes="auto") as store:
        after = shutil.disk_usage(tmp_path).free
        stats = store.stats()
    assert stats["max_bytes_auto"] is True
    slack = 256 << 20  # other processes write to the same disk meanwhile
    low, high = min(before, after) - slack, max(before, after) + slack
    assert low // AUTO_SHARE <= stats["max_bytes"] <= high // AUTO_SHARE
    assert str(stats["max_bytes"]) in stats["max_bytes_rule"]
    with kvstore.open(tmp_path / "s2", max_bytes=1000) as store:
        assert store.stats()["max_bytes"] == 1000
        assert store.stats()["max_bytes_auto"] is False


def test_auto_budget_is_enforced_and_counts_what_the_store_holds(tmp_path, llama, monkeypatch):
    path, model = llama
    tokens = list(range(1, 200))
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        store.bind(model, path).insert(tokens, prefill(model, tokens))
        store.flush()
        held = store.stats()["bytes"]
    assert held > 0
    # A disk with almost no free space left: the budget is a quarter of what the store could use,
    # which is less than it holds now, so the next write evicts down to it.
    free = held // 2
    monkeypatch.setattr("kvstore.upkeep.local.shutil.disk_usage", lambda p: Usage(10 * held, 10 * held - free, free))
    with kvstore.open(tmp_path / "s", chunk_size=16, max_bytes="auto") as store:
        budget = store.stats()["max_bytes"]
        assert budget == (held + free) // AUTO_SHARE
        more = list(range(300, 400))
        store.bind(model, path).insert(more, prefill(model, more))
        store.flush()
        assert 0 < store.stats()["bytes"] <= budget


def test_ram_only_auto_has_no_disk_budget():
    with kvstore.open(kvstore.MEMORY, max_bytes="auto") as store:
        stats = store.stats()
    assert stats["max_bytes"] is None and stats["max_bytes_auto"] is True


@pytest.mark.parametrize("bad", ["automatic", "-1", -1, 1.5, True])
def test_bad_max_bytes_is_refused(tmp_path, bad):
    with pytest.raises(InvalidInputError, match="max_bytes"):
        kvstore.open(tmp_path / "s", max_bytes=bad)


def test_serve_accepts_auto():
    assert _parser().parse_args(["--store-max-bytes", "auto"]).store_max_bytes == "auto"
    assert _parser().parse_args(["--store-max-bytes", "2GiB"]).store_max_bytes == 2 << 30
