"""Stale model versions: K/V stored for model files that are gone or changed since."""

from __future__ import annotations

import shutil

import mlx.core as mx
from kvtest import prefill
from mlx_lm import load

import kvstore
from kvstore.cli import main as cli
from kvstore.storage.stale import NOT_RECHECKED
from kvstore.upkeep.local import LocalStore

C = 16
PROMPT = list(range(1, 60))
PINNED = list(range(100, 140))


def rewrite_weights(folder) -> None:
    """Change the weights as a new download would: a new file renamed over the old one."""
    path = next(folder.glob("*.safetensors"))
    weights = mx.load(str(path))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1
    tmp = path.with_name("rewritten.safetensors")
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    tmp.rename(path)


def store_one_version(tmp_path, demo_model_path):
    """(model folder, store) of a copy of the demo model with PROMPT and a pinned PINNED stored;
    its namespace."""
    folder = shutil.copytree(demo_model_path, tmp_path / "model")
    path = tmp_path / "s"
    model, _ = load(str(folder))
    with kvstore.open(path, chunk_size=C) as store:
        mc = store.bind(model, folder)
        mc.insert(PROMPT, prefill(model, PROMPT))
        mc.insert(PINNED, prefill(model, PINNED), pin=True)
        store.flush()
        [m] = store.stats()["models"]
        assert m["stale"] is False and m["stale_reason"] is None
    return folder, path, mc.ns


def store_two_versions(tmp_path, demo_model_path):
    folder, path, old_ns = store_one_version(tmp_path, demo_model_path)
    rewrite_weights(folder)
    model, _ = load(str(folder))
    with kvstore.open(path, chunk_size=C) as store:
        models = {bytes.fromhex(m["namespace"]): m for m in store.stats()["models"]}
        assert models[old_ns]["stale"] is True and "changed" in models[old_ns]["stale_reason"]
        mc = store.bind(model, folder)  # the new version: another namespace, not stale
        assert mc.ns != old_ns
        mc.insert(PROMPT, prefill(model, PROMPT))
        store.flush()
        models = {bytes.fromhex(m["namespace"]): m for m in store.stats()["models"]}
        assert models[mc.ns]["stale"] is False and models[old_ns]["stale"] is True
        new_ns = mc.ns
    return path, folder, old_ns, new_ns


def by_ns(path):
    with kvstore.open(path, chunk_size=C) as store:
        return {bytes.fromhex(m["namespace"]): m for m in store.stats()["models"]}


def test_stale_version_is_reported_and_evicted_by_gc_stale(tmp_path, demo_model_path, capsys):
    path, folder, old_ns, new_ns = store_two_versions(tmp_path, demo_model_path)
    assert cli.main(["stats", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "STALE" in out and "gc --stale" in out
    before = by_ns(path)
    assert cli.main(["gc", "--stale", "--store", str(path)]) == 0
    capsys.readouterr()
    after = by_ns(path)
    # The old version goes, its pinned prompt too (no lookup can use it); the current one stays.
    assert after[old_ns]["chunks"] + after[old_ns]["tails"] == 0
    assert before[old_ns]["chunks"] + before[old_ns]["tails"] > len(PINNED) // C + 1
    assert {k: after[new_ns][k] for k in ("chunks", "tails", "bytes")} == \
        {k: before[new_ns][k] for k in ("chunks", "tails", "bytes")}
    with kvstore.open(path, chunk_size=C) as store:
        assert store.verify() == []


def test_a_budget_evicts_stale_versions_first(tmp_path, demo_model_path):
    path, folder, old_ns, new_ns = store_two_versions(tmp_path, demo_model_path)
    before = by_ns(path)
    with kvstore.open(path, chunk_size=C) as store:
        total = store.stats()["bytes"]
        # The current version was used last (LRU alone would evict the old one first anyway):
        # touch the old version's records so that LRU alone would take the new one first.
        rows = [r for r in store.index.rows() if r.ns == old_ns]
        store.index.touch({r.hash: (1e12, 1) for r in rows})
        store.gc(max_bytes=total - 1)
    after = by_ns(path)
    assert after[new_ns]["bytes"] == before[new_ns]["bytes"]
    assert after[old_ns]["bytes"] < before[old_ns]["bytes"]


def test_gone_model_folder_is_stale(tmp_path, demo_model_path):
    folder = shutil.copytree(demo_model_path, tmp_path / "model")
    model, _ = load(str(folder))
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, folder).insert(PROMPT, prefill(model, PROMPT))
        store.flush()
    shutil.rmtree(folder)
    [m] = by_ns(tmp_path / "s").values()
    assert m["stale"] is True and "gone" in m["stale_reason"]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        result = store.gc(stale=True)
        assert result["evicted"] == len(PROMPT) // C + 1 and store.stats()["bytes"] == 0


def test_version_bound_with_a_fingerprint_only_is_unknown(tmp_path, llama):
    _, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, "some/repo", fingerprint=b"x" * 16).insert(PROMPT, prefill(model, PROMPT))
        store.flush()
        [m] = store.stats()["models"]
        assert m["stale"] is None
        assert store.gc(stale=True)["evicted"] == 0


def flip_a_byte(folder) -> None:
    """Other weights of the same size, in a new file renamed over the old one: only hashing the
    bytes again tells."""
    path = next(folder.glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # in the last tensor's data
    tmp = path.with_name("rewritten.safetensors")
    tmp.write_bytes(bytes(data))
    tmp.rename(path)


def copy_away_and_back(folder) -> None:
    """The same bytes at new inodes with new times (`shutil.copy` keeps no times)."""
    away = shutil.move(str(folder), str(folder) + ".away")
    shutil.copytree(away, folder, copy_function=shutil.copy)
    shutil.rmtree(away)


def test_identical_files_at_new_inodes_are_not_stale(tmp_path, demo_model_path, capsys):
    """A model folder copied away and back holds the same bytes: `stats` says its files changed
    (not re-checked), never STALE; `gc --stale` hashes them again, evicts nothing, and records
    the new stamps, so `stats` then says "no"."""
    folder = shutil.copytree(demo_model_path, tmp_path / "model")
    path = tmp_path / "s"
    model, _ = load(str(folder))
    with kvstore.open(path, chunk_size=C) as store:
        store.bind(model, folder).insert(PROMPT, prefill(model, PROMPT))
        store.flush()
    copy_away_and_back(folder)
    [m] = by_ns(path).values()
    assert m["stale"] is None and NOT_RECHECKED in m["stale_reason"]
    assert cli.main(["stats", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "STALE" not in out and "\\x0a" not in out
    assert "changed since bound (not re-checked)" in out and "gc --stale" in out
    assert cli.main(["gc", "--stale", "--store", str(path)]) == 0
    assert "(0 bytes, 0 records)" in capsys.readouterr().out
    [after] = by_ns(path).values()
    assert after["stale"] is False and after["bytes"] == m["bytes"] > 0
    assert cli.main(["stats", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "changed" not in out and "STALE" not in out


def test_changed_bytes_of_the_same_size_are_evicted_after_a_rehash(tmp_path, demo_model_path, capsys):
    """Weights rewritten with the same size and no new version bound: `gc --stale` hashes the
    file again, finds other bytes, and evicts (pins too); once hashed again, `stats` says STALE,
    on a line of its own."""
    folder, path, _ = store_one_version(tmp_path, demo_model_path)
    flip_a_byte(folder)
    [m] = by_ns(path).values()
    assert m["stale"] is None and NOT_RECHECKED in m["stale_reason"]  # until hashed again
    every = len(PROMPT) // C + 1 + len(PINNED) // C + 1
    assert cli.main(["gc", "--stale", "--dry-run", "--store", str(path)]) == 0
    assert f"{every} records" in capsys.readouterr().out
    with LocalStore(path) as files:  # hashed again and recorded, as a gc over its budget does
        files.model_status(rehash=True, record=True)
    assert cli.main(["stats", "--store", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\nSTALE: " in out and "\\x0a" not in out
    assert cli.main(["gc", "--stale", "--store", str(path)]) == 0
    assert f"{every} records" in capsys.readouterr().out
    [m] = by_ns(path).values()
    assert m["stale"] is True and m["chunks"] + m["tails"] == 0


def test_a_version_bound_from_two_copies_is_stale_only_when_both_changed(tmp_path, demo_model_path, capsys):
    """The same model in two folders (a hub cache and a local copy) is one version: changing one
    copy's weights leaves the other serving the records, so gc --stale keeps them (pins too);
    when the second copy changes too, the version is stale."""
    folder, path, ns = store_one_version(tmp_path, demo_model_path)
    other = shutil.copytree(folder, tmp_path / "copy")
    model, _ = load(str(other))
    with kvstore.open(path, chunk_size=C) as store:
        assert store.bind(model, other).ns == ns  # the same bytes: the same version
        store.bind(model, folder)  # bound last from the first folder again
    rewrite_weights(folder)  # the folder bound last changes; the other does not
    assert by_ns(path)[ns]["stale"] is False
    assert cli.main(["gc", "--stale", "--store", str(path)]) == 0
    assert by_ns(path)[ns]["chunks"] + by_ns(path)[ns]["tails"] > 0
    with kvstore.open(path, chunk_size=C) as store:
        assert len(store.bind(model, other).fetch(PROMPT)[1]) == 1  # still served, to the copy
    rewrite_weights(other)
    assert by_ns(path)[ns]["stale"] is True
    assert cli.main(["gc", "--stale", "--store", str(path)]) == 0
    capsys.readouterr()
    assert by_ns(path)[ns]["chunks"] + by_ns(path)[ns]["tails"] == 0
