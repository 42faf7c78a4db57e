"""The index's bookkeeping as damage leaves it: a `totals` table or `models` rows holding values of
the wrong type never crash `stats`, never make gc think the store is empty, are reported by
`verify` and rewritten by its repair. And a folder whose index was lost keeps every file that
is not kvstore's, even one named like a blob, and its `remote-node-id`.

Every test breaks a real store on purpose (SQL written by hand into its index, files planted in
its blob tree) and runs the real commands in-process (`kv`, through `kvtest.run_cli`: what a
command prints and returns, as a `kvstore` process of its own would; none of these is about a
hang or what a process does at exit).
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from faultproc import prompts
from kvtest import prefill, run_cli

import kvstore
from kvstore.errors import IndexLostError
from kvstore.remote.pins import node_id
from kvstore.storage import blobtree

C = 16


def warm(store: Path, llama, n: int = 4, seed: int = 61) -> list:
    model_path, model = llama
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, model_path)
        for t in prompts(seed, n, C):
            mc.insert(t, prefill(model, t))
        s.flush()
        return list(s.index.rows())


def kv(*args, home: Path):
    """`kvstore ARGS...` in this process, with HOME and KVSTORE_DIR as `test_safety.kv` gives its
    process; a traceback fails the test, as there."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.delenv("KVSTORE_DIR", raising=False)
        result = run_cli(*args, check=False)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def sql(store: Path, *statements: str) -> None:
    con = sqlite3.connect(store / "index.sqlite")
    with con:
        for statement in statements:
            con.execute(statement)
    con.close()


def model_rows(store: Path) -> list[tuple]:
    con = sqlite3.connect(store / "index.sqlite")
    try:
        return con.execute("SELECT ns, fingerprint, model_id, layout, chunk_size, created, last_used "
                           "FROM models").fetchall()
    finally:
        con.close()


@pytest.mark.parametrize("damage", ["bytes = 'many'", "bytes = 5", "chunks = -3", "tails = 2.5"])
def test_damaged_totals_never_crash_stats_or_empty_gc_and_repair_counts_them_again(tmp_path, llama, damage):
    store = tmp_path / "s"
    rows = warm(store, llama)
    held = sum(r.size for r in rows)
    sql(store, f"UPDATE totals SET {damage}")

    out = kv("stats", "--store", store, "--json", home=tmp_path)
    assert out.returncode == 0, out.stderr
    if damage != "bytes = 5":  # a whole number is taken as it is, until verify counts it again
        stats = json.loads(out.stdout)
        assert stats["bytes"] == held and stats["chunks"] + stats["tails"] == len(rows), stats
        assert stats["models"][0]["bytes"] == held
    # gc sees what the store holds: a budget below it evicts (a dry run says how much).
    out = kv("gc", "--store", store, "--max-bytes", f"{held // 2}B", "--dry-run", home=tmp_path)
    assert out.returncode == 0, out.stderr
    if damage != "bytes = 5":
        assert "would free 0 B" not in out.stdout, out.stdout
    out = kv("verify", "--store", store, home=tmp_path)
    assert out.returncode == 1 and "bad_totals:" in out.stdout, out.stdout
    assert kv("verify", "--repair", "--store", store, home=tmp_path).returncode == 1
    assert kv("verify", "--store", store, home=tmp_path).returncode == 0
    with kvstore.open(store, chunk_size=C) as s:
        assert s.stats()["bytes"] == held and s.index.stored_totals() == s.index.counted_totals()
        assert len(list(s.index.rows())) == len(rows)  # nothing was deleted to mend it


@pytest.mark.parametrize("damage, field", [
    ("last_used = 'yesterday'", "last_used"),
    ("created = x'00'", "created"),
    ("chunk_size = 'x'", "chunk_size"),
    ("fingerprint = x'0102', model_id = x'ff'", "fingerprint"),
])
def test_damaged_models_rows_never_crash_stats_and_repair_mends_them(tmp_path, llama, damage, field):
    store = tmp_path / "s"
    rows = warm(store, llama)
    before = model_rows(store)
    sql(store, f"UPDATE models SET {damage}")

    out = kv("stats", "--store", store, home=tmp_path)
    assert out.returncode == 0 and "chunks:" in out.stdout, out.stderr
    out = kv("stats", "--store", store, "--json", home=tmp_path)
    assert out.returncode == 0, out.stderr
    out = kv("verify", "--store", store, home=tmp_path)
    assert out.returncode == 1 and "bad_model_row:" in out.stdout and f"its {field} is" in out.stdout, out.stdout
    # A chunk size it cannot read is no reason to call every blob corrupt.
    assert "corrupt_blob" not in out.stdout, out.stdout
    assert kv("verify", "--repair", "--store", store, home=tmp_path).returncode == 1
    assert kv("verify", "--store", store, home=tmp_path).returncode == 0
    after = model_rows(store)
    with kvstore.open(store, chunk_size=C) as s:
        assert len(list(s.index.rows())) == len(rows)
    # What the blobs' headers say (fingerprint, model id, chunk size) is taken back exactly.
    assert after[0][:5] == before[0][:5], (before, after)
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(llama[1], llama[0])
        t = prompts(61, 4, C)[0]
        assert mc.fetch(t + [1])[1] == [1]


def test_a_models_row_naming_no_namespace_is_dropped_and_a_bad_counter_is_ignored(tmp_path, llama):
    store = tmp_path / "s"
    warm(store, llama)
    sql(store, "INSERT INTO models SELECT 'zz', fingerprint, model_id, layout, 'big', created, 'x' FROM models",
        "INSERT INTO meta (key, value) VALUES ('count.quarantined', 'lots')")
    out = kv("stats", "--store", store, home=tmp_path)
    assert out.returncode == 0 and "models: 1" in out.stdout, out.stdout + out.stderr
    out = kv("verify", "--repair", "--store", store, home=tmp_path)
    assert out.returncode == 1 and "its ns is 'zz'" in out.stdout, out.stdout
    assert kv("verify", "--store", store, home=tmp_path).returncode == 0
    assert len(model_rows(store)) == 1


def test_a_lost_index_never_costs_a_users_file_named_like_a_blob(tmp_path, llama):
    """Repair deletes an orphan only when its header names the hash it is named for: a user's
    file at `blobs/ab/cd/<hash>.safetensors` goes to quarantine/, whole."""
    store = tmp_path / "s"
    rows = warm(store, llama)
    root = store / "blobs"
    mine = {}
    for i in range(3):
        name = f"{0xa0 + i:02x}" * 16
        path = root / name[:2] / name[2:4] / (name + blobtree.SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f"my notes, file {i}".encode())
        mine[path.name] = path.read_bytes()
    # One real orphan: a blob of this store (its header names its hash) whose row is gone.
    leaf = next(r for r in rows if not any(c.parent == r.hash for c in rows))
    orphan = blobtree.blob_path(root, leaf.hash)
    for suffix in ("", "-wal", "-shm"):
        if os.path.lexists(f"{store / 'index.sqlite'}{suffix}"):
            os.unlink(f"{store / 'index.sqlite'}{suffix}")
    with pytest.raises(IndexLostError):
        kvstore.open(store).close()
    out = kv("verify", "--repair", "--store", store, home=tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert kv("verify", "--store", store, home=tmp_path).returncode == 0
    kept = {p.name.split(".", 1)[1]: p.read_bytes() for p in (store / "quarantine").iterdir()}
    for name, data in mine.items():
        assert kept[f"{name[:2]}_{name[2:4]}_{name}"] == data
    assert orphan.exists()  # taken back by the rebuild: it was a whole record with its parent
    with kvstore.open(store, chunk_size=C) as s:
        assert len(list(s.index.rows())) == len(rows)
        s.index.delete([leaf.hash])  # now its row is lost: a real orphan, which repair deletes
        assert [p.kind for p in s.verify(repair=True)] == ["orphan_file"]
    assert not orphan.exists()


@pytest.mark.parametrize("lost", ["missing", "damaged"])
def test_remote_node_id_is_one_of_the_stores_own_names(tmp_path, lost):
    """A store that once had a remote tier (it keeps `remote-node-id`) and lost its index is a
    store with a lost index, not "a folder with files kvstore did not write"."""
    store = tmp_path / "s"
    kvstore.open(store).close()
    node = node_id(store)
    assert (store / "remote-node-id").read_text().strip() == node
    if lost == "missing":
        os.unlink(store / "index.sqlite")
        kvstore.open(store).close()  # no blobs: a fresh index, and the node keeps its name
        assert node_id(store) == node
        return
    (store / "index.sqlite").write_bytes(b"not a database, " * 64)
    out = kv("stats", "--store", store, home=tmp_path)
    assert out.returncode == 1 and "not a kvstore store" not in out.stderr, out.stderr
    assert "verify --repair" in out.stderr, out.stderr
    out = kv("verify", "--repair", "--store", store, home=tmp_path)
    assert out.returncode == 1 and "rebuilt" in out.stdout + out.stderr, out.stdout + out.stderr
    assert kv("stats", "--store", store, home=tmp_path).returncode == 0
    assert node_id(store) == node


@pytest.mark.parametrize("drop", ["totals", "meta", "write_log, totals", "lost", "lost, no copy"])
def test_a_rebuilt_index_keeps_the_kept_settings_and_the_write_log_or_keeps_the_budget_closed(tmp_path, llama, drop,
                                                                                              capsys):
    """What the damaged index still holds of its kept settings and write log is kept; what it
    cannot give back never turns the write budget off, and the rebuild says which."""
    store = tmp_path / "s"
    path, model = llama
    with kvstore.open(store, chunk_size=C, admit="reused", max_write_rate="1GB/day"):
        pass
    rows = warm(store, llama)  # written under the budget, into the write log
    written = sum(r.size for r in rows)
    assert json.loads((store / "index.settings").read_text()) == {
        "kvstore kept settings 1": {"admit": "reused", "max_write_rate": "1000000000"}}  # the copy beside it
    if drop.startswith("lost"):  # the index deleted (with blobs to rebuild it from): nothing of it is left to read
        with kvstore.open(store, chunk_size=C) as s:
            s.bind(model, path).prefill(prompts(7, 1, C)[0])  # explicit: written
        (store / "index.sqlite").unlink()
        if drop == "lost, no copy":
            (store / "index.settings").write_text("{not json")  # nothing to read back: limits stay closed
    else:
        sql(store, *[f"DROP TABLE {table}" for table in drop.split(", ")])  # a store kvstore can no longer open
    from kvstore.cli.main import main

    assert main(["verify", "--repair", "--store", str(store)]) == 1
    out = capsys.readouterr()
    assert "rebuilt the index" in out.err, out.err
    with kvstore.open(store, chunk_size=C) as s:
        kept = {name: v for name, v in s.settings.items() if v[1] == "kept"}
        writes = s.stats()["writes"]
    if drop == "totals":
        assert "settings kept: admit=reused, max_write_rate=1 GB/day; write log kept (1 hour)" in out.err
        assert kept == {"admit": ("reused", "kept"), "max_write_rate": (10**9, "kept")}
        assert writes["bytes_last_day"] == written
    elif drop in ("meta", "lost"):  # read back from the copy; a lost write log closes the budget's day
        assert "read back from index.settings: admit=reused, max_write_rate=1 GB/day" in out.err, out.err
        assert kept == {"admit": ("reused", "kept"), "max_write_rate": (10**9, "kept")}
        assert writes["budget_left"] == (0 if drop == "lost" else 10**9 - written)
    elif drop == "lost, no copy":
        assert "the kept settings could not be read (there was no old index to read them from)" in out.err
        assert (f"max_write_rate is kept as 0 B/day (no automatic writes) until `kvstore settings --store "
                f"{store} max_write_rate=VALUE` keeps one") in out.err, out.err
        assert kept == {"max_write_rate": (0, "kept")} and writes["budget_left"] == 0
    else:
        assert "the write log could not be read: this hour counts as the whole write budget" in out.err
        assert kept["max_write_rate"] == (10**9, "kept") and writes["budget_left"] == 0


def test_a_rebuilt_index_of_a_store_that_kept_no_setting_keeps_writing(tmp_path, llama):
    """A store with no kept setting has a copy that says so: the rebuild of its lost index keeps
    the defaults (no budget to keep closed), and automatic writes go on."""
    store = tmp_path / "s"
    path, model = llama
    warm(store, llama)
    assert json.loads((store / "index.settings").read_text()) == {"kvstore kept settings 1": {}}
    (store / "index.sqlite").unlink()
    from kvstore.cli.main import main

    assert main(["verify", "--repair", "--store", str(store)]) == 1
    with kvstore.open(store, chunk_size=C) as s:
        assert {name for name, v in s.settings.items() if v[1] == "kept"} == set()
        tokens = prompts(9, 1, C)[0]
        s.bind(model, path).insert(tokens, prefill(model, tokens))  # automatic: written
        s.flush()
        assert s.stats()["writes"]["max_write_rate"] is None and s.stats()["writer"]["records_written"] > 0


@pytest.mark.parametrize("damage", ["settings stale", "settings garbage", "pins stale", "pins cut"])
def test_a_copy_beside_the_index_that_a_rebuild_would_read_wrong_is_reported_and_rewritten(tmp_path, llama, damage):
    """`index.settings` and `index.pins` are what a rebuild of a lost index reads the kept settings
    and the pins back from. One whose write failed (a full disk, a crash) is found by verify, and
    repair writes it from the index, so the rebuild after it keeps the budget and the pins."""
    store = tmp_path / "s"
    rows = warm(store, llama)
    assert kv("settings", "--store", store, "max_write_rate=5GB/day", home=tmp_path).returncode == 0
    with kvstore.open(store, chunk_size=C) as s:
        s.index.pin([rows[0].hash])
    name = "index.settings" if damage.startswith("settings") else "index.pins"
    good = (store / name).read_text()
    if damage == "settings stale":  # as when the copy's write failed after the index kept the value
        (store / name).write_text(json.dumps({"kvstore kept settings 1": {}}))
    elif damage == "pins stale":
        (store / name).write_text("kvstore pins 1\nend 0\n")
    else:
        (store / name).write_text(good[: len(good) // 2])

    out = kv("verify", "--store", store, home=tmp_path)
    assert out.returncode == 1 and f"stale_copy: {store / 'index.sqlite'}: {name}: " in out.stdout, out.stdout
    assert kv("verify", "--repair", "--store", store, home=tmp_path).returncode == 1
    assert (store / name).read_text() == good
    assert kv("verify", "--store", store, home=tmp_path).returncode == 0
    # The rebuild of a lost index now reads both back.
    for f in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (store / f).unlink(missing_ok=True)
    assert kv("verify", "--repair", "--store", store, home=tmp_path).returncode == 1
    with kvstore.open(store, chunk_size=C) as s:
        assert s.index.pinned() == {rows[0].hash}
        assert s.index.settings() == {"max_write_rate": good_rate(store)}


def good_rate(store: Path) -> str:
    return json.loads((store / "index.settings").read_text())["kvstore kept settings 1"]["max_write_rate"]


def damage_index(db: Path, damage: str) -> None:
    """Break the index file `db` (its WAL checkpointed into it first) as damage does."""
    sql(db.parent, "PRAGMA wal_checkpoint(TRUNCATE)")
    if damage == "children dropped":
        sql(db.parent, "DROP TABLE children")
        return
    con = sqlite3.connect(db)
    page = con.execute("PRAGMA page_size").fetchone()[0]
    table = "models" if damage == "models page reads empty" else "records"
    pages = [n for (n,) in con.execute("SELECT pageno FROM dbstat WHERE name = ?", (table,))]
    con.close()
    data = bytearray(db.read_bytes())
    for n in pages:
        at = (n - 1) * page
        if damage == "models page reads empty":  # a leaf of a table with no cells: well formed, no rows
            data[at : at + page] = bytes(page)
            data[at] = 13
            data[at + 5 : at + 7] = page.to_bytes(2, "big") if page < 65536 else bytes(2)
        else:
            data[at : at + 400] = bytes(400)  # the b-tree page header and its first cells
    db.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["models page reads empty", "children dropped", "records pages zeroed"])
def test_stats_gc_and_verify_refuse_a_damaged_index_and_change_nothing_and_repair_rebuilds_it(tmp_path, llama, damage):
    """A damaged index is an error naming `verify --repair` for every maintenance command (stats
    said "models: 0", exit 0, for a models page that reads as empty; gc evicted through it);
    none of them writes the index or deletes a blob; the repair gives back every record."""
    store = tmp_path / "s"
    rows = warm(store, llama)
    db = store / "index.sqlite"
    damage_index(db, damage)
    damaged, files = db.read_bytes(), sorted(blobtree.walk(store / "blobs"))
    for args in (["stats"], ["stats", "--json"], ["gc", "--max-bytes", "0"], ["gc", "--max-age", "1s"], ["verify"]):
        out = kv(*args, "--store", store, home=tmp_path)
        assert out.returncode == 1 and f"`kvstore verify --repair --store {store}`" in out.stderr, (args, out)
        assert "models:" not in out.stdout and out.stdout == "", (args, out.stdout)
    assert db.read_bytes() == damaged and sorted(blobtree.walk(store / "blobs")) == files
    out = kv("verify", "--repair", "--store", store, home=tmp_path)
    assert out.returncode == 1 and "rebuilt the index from the blob files" in out.stderr, out
    assert kv("verify", "--store", store, home=tmp_path).returncode == 0
    stats = json.loads(kv("stats", "--json", "--store", store, home=tmp_path).stdout)
    assert len(stats["models"]) == 1 and stats["chunks"] + stats["tails"] + stats["checkpoints"] == len(rows)
