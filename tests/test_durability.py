"""The write path's ordering promises, observed directly rather than by pulling the power:

- a blob is fsynced before the rename that publishes it, and the rename (and its folder) is
  durable before the index transaction that makes a row point at it commits;
- after a failed blob write the writer inserts no row that hangs from the missing record;
- the schema migrations are applied exactly once when many processes open a new store at once.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import threading
import traceback
from pathlib import Path

import numpy as np
from kvtest import prefill

import kvstore
from kvstore import keys
from kvstore.storage import blobfile, blobtree, blobwrite
from kvstore.storage.schema import available_migrations

C = 16


def rand_tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


# -- fsync before rename, rename before commit -----------------------------------------------

def test_blobs_are_fsynced_and_renamed_before_the_commit_that_publishes_them(tmp_path, llama, monkeypatch):
    path, model = llama
    events: list[tuple] = []
    lock = threading.Lock()

    def log(*event):
        with lock:
            events.append(event)

    real_open, real_fsync, real_replace, real_connect = os.open, os.fsync, os.replace, sqlite3.connect
    paths: dict[int, str] = {}  # fd -> the path os.open opened (portable: no /proc)

    def open_(path, flags, *args, **kw):
        fd = real_open(path, flags, *args, **kw)
        paths[fd] = str(path)
        return fd

    def fsync(fd):
        real_fsync(fd)
        log("fsync", paths.get(fd, str(fd)))

    def replace(src, dst, **kw):
        real_replace(src, dst, **kw)
        log("replace", str(src), str(dst))

    def connect(*args, **kw):
        conn = real_connect(*args, **kw)
        conn.set_trace_callback(lambda sql: log("sql", sql.strip().split()[0].upper(), sql))
        return conn

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(sqlite3, "connect", connect)
    tokens = rand_tokens(3 * C + 5, 1)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, path).insert(tokens, prefill(model, tokens))
        store.flush()
        files = list(blobtree.walk(store.blob_root))
    assert len(files) == 4
    for f in files:
        [(i_replace, src)] = [(i, e[1]) for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(f)]
        assert Path(src).parent == f.parent and Path(src).name.startswith(blobtree.TMP_PREFIX)
        fsyncs = [i for i, e in enumerate(events) if e[0] == "fsync" and e[1] == src]
        assert fsyncs and fsyncs[0] < i_replace, f"{f.name}: not fsynced before its rename"
        # The row that points at the file: inserted and committed after the rename, and the
        # folder holding the new name fsynced in between (else the name may not survive a crash).
        insert = next(i for i, e in enumerate(events) if i > i_replace and e[0] == "sql"
                      and e[1] == "INSERT" and "INTO records" in e[2])
        commit = next(i for i, e in enumerate(events) if i > insert and e[0] == "sql" and e[1] == "COMMIT")
        folder = [i for i, e in enumerate(events) if e[0] == "fsync" and e[1] == str(f.parent)]
        assert any(i_replace < i < commit for i in folder), f"{f.name}: its folder is not fsynced before the commit"


# -- a failed blob write leaves no row hanging from it ---------------------------------------

def test_after_a_failed_blob_write_no_row_hangs_from_it(tmp_path, llama, monkeypatch):
    """One insert of 4 chunks and a tail; the 2nd blob write fails. Only the first chunk may get a
    row: the later records hang from the missing one, and rows for them would be unreachable."""
    path, model = llama
    real_stage = blobwrite.stage  # the writer's blob write: temporary file and fsync (then a rename)
    calls = {"n": 0}

    def write_failing_once(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error (injected)")
        return real_stage(*args, **kw)

    monkeypatch.setattr(blobwrite, "stage", write_failing_once)
    tokens = rand_tokens(4 * C + 5, 2)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, path)
        chain = keys.chain(mc.ns, np.asarray(tokens), C)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        assert store.stats()["writer"]["write_errors"] == 1
        rows = {r.hash: r for r in store.index.rows()}
        assert set(rows) == {chain[0]}, "rows were inserted under the record whose write failed"
        assert [p.kind for p in store.verify()] == []  # no row without a file, no file without a row
        cache, rest = mc.fetch(tokens)
        assert len(tokens) - len(rest) == C
        # The writer goes on: the same insert again stores everything.
        monkeypatch.setattr(blobwrite, "stage", real_stage)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        assert mc.stored_length(tokens) == len(tokens)
        assert store.verify() == []


# -- migrations under a crowd of processes ---------------------------------------------------

def _open_many(path: str, barrier, opens: int, results) -> None:
    errors = []

    def one() -> None:
        try:
            barrier.wait(timeout=120)
            kvstore.open(path).close()
        except BaseException as e:  # reported to the test, which fails on any
            errors.append(f"{type(e).__name__}: {e}" + traceback.format_exc())

    threads = [threading.Thread(target=one) for _ in range(opens)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put(errors)


def test_migrations_are_applied_once_when_many_processes_open_a_new_store(tmp_path):
    # 30 opens at one barrier, each on a connection of its own (threads race through SQLite's
    # locks as processes do), in 3 processes: each costs ~2.5 s of CPU (opening a store imports
    # mlx-lm), and 3 still race across processes as well as within one.
    procs, opens = 3, 10
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(procs * opens)  # every open of every process starts at the same moment
    results = ctx.Queue()
    path = tmp_path / "new-store"
    workers = [ctx.Process(target=_open_many, args=(str(path), barrier, opens, results)) for _ in range(procs)]
    for w in workers:
        w.start()
    errors = [e for _ in workers for e in results.get(timeout=300)]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert errors == [], "\n".join(errors)
    with sqlite3.connect(path / "index.sqlite") as db:
        applied = db.execute("SELECT version, name FROM schema_migrations ORDER BY version").fetchall()
    assert applied == [(v, name) for v, name, _ in available_migrations()]
    with kvstore.open(path) as store:  # and the store works
        assert store.stats()["chunks"] == 0 and store.verify() == []


# -- migration 0016 on a store that has rows ------------------------------------------------

def test_a_schema_15_store_migrates_to_narrow_rows_and_still_restores_exactly(tmp_path, llama):
    """Migration 0016 moves a store's token ids out of the index and its edges into `children`:
    a store with schema 15 (token ids in every row) keeps every record, and a prompt that
    branches inside a stored chunk still restores exactly the common prefix."""
    from kvtest import logits_diff

    from kvstore.storage.schema import split_sql

    model_path, model = llama
    base = rand_tokens(3 * C + 5, seed=160)
    branch = base[: 2 * C + 7] + rand_tokens(C, seed=161)
    new = tmp_path / "new"
    with kvstore.open(new, chunk_size=C) as store:
        mc = store.bind(model, model_path)
        for t in (base, base[: C + 3]):
            mc.insert(t, prefill(model, t))
        store.flush()
        rows = list(store.index.rows())
    # The same store with an index made by migrations 0001-0015, rows holding their token ids.
    old = tmp_path / "old"
    old.mkdir(mode=0o700)
    os.rename(new / "blobs", old / "blobs")
    con = sqlite3.connect(old / "index.sqlite", isolation_level=None)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)")
    for version, name, sql in available_migrations():
        if version > 15:
            break
        for statement in split_sql(sql):
            con.execute(statement)
        con.execute("INSERT INTO schema_migrations VALUES (?, ?, 0)", (version, name))
    con.execute("ATTACH ? AS new", (str(new / "index.sqlite"),))
    for table, columns in (("meta", "*"), ("models", "*"), ("file_digests", "path, size, mtime_ns, digest, dev, inode, ctime_ns"),
                           ("model_files", "ns, path, size, mtime_ns, ino, ctime_ns")):  # no digest before 0017
        con.execute(f"INSERT OR REPLACE INTO {table} SELECT {columns} FROM new.{table}")
    for r in rows:
        with blobfile.open_blob(old / "blobs", r.hash, size=r.size, checksum=r.checksum) as blob:
            ids = blob.array("tokens").astype("<i4").tobytes()
        con.execute("INSERT INTO records (hash, ns, parent, depth, kind, ntokens, tokens, size, checksum, created, "
                    "last_access, hits, pinned, bad, first_token) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, ids, r.size, r.checksum - (1 << 64)
                     if r.checksum >= 1 << 63 else r.checksum, r.created, r.last_access, r.hits, r.pinned, r.bad,
                     r.first_token))
    con.execute("DETACH new")
    con.close()
    with kvstore.open(old, chunk_size=C) as store:
        assert store.index.applied() == [v for v, *_ in available_migrations()]
        assert sorted(r.hash for r in store.index.rows()) == sorted(r.hash for r in rows)
        assert store.index.conn.execute("SELECT count(*) FROM children").fetchone()[0] == len(rows)
        # 0017 took each model file's digest from the memo: a changed stamp can be re-checked.
        digests = store.index.conn.execute("SELECT digest FROM model_files").fetchall()
        assert digests and all(d is not None for (d,) in digests)
        assert store.verify() == []
        mc = store.bind(model, model_path)
        assert mc.stored_length(branch) == 2 * C + 7  # the ids of the branched chunk, from its blob
        cache, rest = mc.fetch(branch)
        assert len(branch) - len(rest) == 2 * C + 7
        assert logits_diff(model, cache, rest, branch) <= 1e-4
