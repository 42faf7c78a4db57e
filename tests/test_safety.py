"""The store touches only what is its own; hostile files never hang, crash or mislead it.

Every test breaks a store (or a folder that is not one) on purpose and asserts what the user
keeps: files outside the store unchanged, nothing created where nothing should be, blobs still
there after a lost index, commands finishing within a bound (a subprocess timeout is the hang
detector, never a timing assertion), and an error that says what is wrong.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from faultproc import prompts
from kvtest import logits_diff, prefill

import kvstore
from kvstore import keys
from kvstore.errors import BlobError, IndexLostError, NotAStoreError, StoreOpenError
from kvstore.restore.arrays import decode
from kvstore.storage import blobformat, blobtree
from kvstore.upkeep.rebuild import rebuild_index

C = 16
TOL = 1e-4
REPO = Path(__file__).resolve().parents[1]
HANG_S = 120  # a command that takes longer than this is taken to hang


# -- helpers ----------------------------------------------------------------------------------

def snapshot(path: Path) -> dict[str, tuple]:
    """Every entry under `path` (links not followed): its kind, mode and bytes or link target."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(path))] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(path))] = ("file", stat.S_IMODE(st.st_mode), p.read_bytes())
            else:
                out[str(p.relative_to(path))] = ("other", st.st_mode)
    return out


def kv(*args, home: Path, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """`kvstore ARGS...` in a new process (a hang fails the test through the timeout)."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_DIR"}
    env.update(HOME=str(home), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, "-m", "kvstore.cli", *map(str, args)], capture_output=True,
                            text=True, env=env, cwd=REPO, timeout=timeout)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def warm(store: Path, llama, seqs, **kw) -> list:
    """A store holding `seqs`; its rows."""
    model_path, model = llama
    with kvstore.open(store, chunk_size=C, **kw) as s:
        mc = s.bind(model, model_path)
        for t in seqs:
            mc.insert(t, prefill(model, t))
        s.flush()
        assert s.stats()["writer"]["write_errors"] == 0
        return list(s.index.rows())


def restores(store: Path, llama, seqs) -> None:
    model_path, model = llama
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        for t in seqs:
            query = t + [3]
            cache, rest = mc.fetch(query)
            assert rest == [3]
            assert logits_diff(model, cache, rest, query) <= TOL


def hf_cache_folder(tmp_path: Path) -> Path:
    """A Hugging Face hub cache folder of one model, as `huggingface_hub` lays it out."""
    repo = tmp_path / "hub" / "models--org--name"
    weights = {"a" * 64: os.urandom(4096), "b" * 64: b'{"model_type": "llama"}'}
    for name, data in weights.items():
        (repo / "blobs").mkdir(parents=True, exist_ok=True)
        (repo / "blobs" / name).write_bytes(data)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    snap = repo / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/" + "a" * 64)
    (snap / "config.json").symlink_to("../../blobs/" + "b" * 64)
    return repo


@pytest.fixture
def home(tmp_path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    return h


# -- 1. never delete or write outside the store -----------------------------------------------

@pytest.mark.parametrize("command", [["verify", "--repair"], ["verify", "--repair", "--force"],
                                     ["gc", "--max-bytes", "0"], ["stats"], ["verify"]])
def test_a_hugging_face_cache_folder_is_not_a_store(tmp_path, home, command):
    repo = hf_cache_folder(tmp_path)
    before = snapshot(tmp_path / "hub")
    result = kv(*command, "--store", repo, home=home)
    assert result.returncode != 0
    assert "not a kvstore store" in result.stderr and str(repo) in result.stderr
    assert snapshot(tmp_path / "hub") == before  # every file unchanged, nothing created
    with pytest.raises(NotAStoreError, match="not a kvstore store"):
        kvstore.open(repo)
    with pytest.raises(NotAStoreError):
        rebuild_index(repo)
    assert snapshot(tmp_path / "hub") == before


def test_stats_verify_gc_create_nothing(tmp_path, home):
    missing = tmp_path / "nothing" / "here"
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (["stats"], ["verify"], ["verify", "--repair"], ["gc", "--max-bytes", "0"]):
        for where in (missing, empty):
            result = kv(*command, "--store", where, home=home)
            assert result.returncode != 0 and "no kvstore store" in result.stderr, result.stderr
    assert not (tmp_path / "nothing").exists() and os.listdir(empty) == []
    assert os.listdir(home) == []
    with pytest.raises(NotAStoreError):
        kvstore.open(missing, create=False)
    kvstore.open(empty).close()  # an empty folder becomes a store when asked to
    assert {"index.sqlite", "blobs"} <= set(os.listdir(empty))


def test_a_folder_with_other_files_is_refused_with_what_is_in_it(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "thesis.txt").write_text("years of work")
    with pytest.raises(NotAStoreError, match="thesis.txt"):
        kvstore.open(folder)
    assert os.listdir(folder) == ["thesis.txt"]
    # A file named like the index that is not kvstore's is never taken for (or rebuilt as) one.
    (folder / "index.sqlite").write_bytes(b"not a database at all" * 10)
    with pytest.raises(NotAStoreError, match="not kvstore's index"):
        kvstore.open(folder)
    sqlite3.connect(folder / "other.sqlite").execute("CREATE TABLE t (x)").connection.close()
    os.replace(folder / "other.sqlite", folder / "index.sqlite")
    with pytest.raises(NotAStoreError, match="no file_digests, meta, models"):
        kvstore.open(folder)
    assert sorted(os.listdir(folder)) == ["index.sqlite", "thesis.txt"]


def test_a_path_inside_a_store_is_refused_naming_the_store(tmp_path, home):
    # A store made in another's blob tree would be moved to quarantine/ by that store's repair.
    store = tmp_path / "kv"
    kvstore.open(store).close()
    before = snapshot(store)
    for inside in (store / "blobs", store / "blobs" / "new", store / "blobs" / "ab" / "cd" / "s"):
        with pytest.raises(NotAStoreError, match=f"inside the store {store}"):
            kvstore.open(inside)
    for name in ("index.sqlite", "blobs/new"):  # the obvious mistakes: the index file, a folder in blobs/
        result = kv("stats", "--store", store / name, home=home)
        assert result.returncode == 1 and f"inside the store {store} " in result.stderr, result.stderr
    assert snapshot(store) == before  # nothing made inside it
    kvstore.open(tmp_path / "elsewhere" / "blobs").close()  # a folder named blobs in no store is fine


def test_symlinked_blob_tree_is_refused_and_never_emptied(tmp_path, llama, home):
    store = tmp_path / "s"
    warm(store, llama, prompts(40, 2, C))
    outside = tmp_path / "outside"
    (store / "blobs").rename(outside)  # the user's files now sit where the link points
    (outside / "precious.txt").write_text("keep me")
    (store / "blobs").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    for command in (["verify", "--repair"], ["verify", "--repair", "--force"], ["gc", "--max-bytes", "0"],
                    ["stats"]):
        result = kv(*command, "--store", store, home=home)
        assert result.returncode != 0 and "symbolic link" in result.stderr, result.stderr
    with pytest.raises(StoreOpenError, match="symbolic link"):
        kvstore.open(store)  # so `warm` never writes its blobs into the linked folder
    with pytest.raises(StoreOpenError, match="symbolic link"):
        rebuild_index(store)
    assert snapshot(outside) == before
    # And what walks the tree never goes through a link either.
    assert list(blobtree.walk(store / "blobs")) == []


def test_symlinked_hex_folder_is_never_entered_by_gc_verify_or_writes(tmp_path, llama):
    model_path, model = llama
    seqs = prompts(41, 6, C)
    store = tmp_path / "s"
    rows = warm(store, llama, seqs)
    root = store / "blobs"
    victim = rows[0].hash.hex()
    outside = tmp_path / "outside"
    # Same-named files outside: gc used to delete them through a symlinked `blobs/ab`.
    os.replace(root / victim[:2], outside)
    (root / victim[:2]).symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    with kvstore.open(store, chunk_size=C) as s:
        result = s.gc(max_bytes=0)
        assert snapshot(outside) == before
        assert result["evicted"] > 0
        problems = s.verify(repair=True)
        assert any(p.kind == "foreign_file" and "symbolic link" in p.detail for p in problems)
        mc = s.bind(model, model_path)
        for t in seqs:
            mc.insert(t, prefill(model, t))
        s.flush()
    assert snapshot(outside) == before  # neither deleted nor written through the link
    assert not (root / victim[:2]).is_symlink()  # the link itself was moved aside, kept;
    restores(store, llama, seqs)  # and the records are written again in a real folder
    assert [p.name for p in (store / "quarantine").iterdir()][0].endswith(victim[:2])


def test_dangling_index_symlink_never_creates_an_index_outside(tmp_path, home):
    store = tmp_path / "s"
    kvstore.open(store).close()
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        if os.path.lexists(store / name):
            os.unlink(store / name)
    target = tmp_path / "elsewhere" / "index.sqlite"
    target.parent.mkdir()
    (store / "index.sqlite").symlink_to(target)
    for command in (["stats"], ["verify", "--repair"], ["gc", "--max-bytes", "0"]):
        result = kv(*command, "--store", store, home=home)
        assert result.returncode != 0 and "symbolic link" in result.stderr, result.stderr
    with pytest.raises(StoreOpenError, match="symbolic link"):
        kvstore.open(store)
    assert os.listdir(target.parent) == []
    # The index's companions too: a -wal link would have SQLite write through it.
    os.unlink(store / "index.sqlite")
    kvstore.open(store).close()
    (store / "index.sqlite-wal").symlink_to(tmp_path / "elsewhere" / "wal")
    with pytest.raises(StoreOpenError, match="index.sqlite-wal is a symbolic link"):
        kvstore.open(store)
    assert os.listdir(target.parent) == []


@pytest.mark.parametrize("name,make", [("index.sqlite", "fifo"), ("index.sqlite-wal", "fifo"),
                                       ("blobs.lock", "fifo"), ("blobs", "file"), ("index.sqlite", "folder")])
def test_own_entries_of_the_wrong_kind_are_refused_without_hanging(tmp_path, home, name, make):
    store = tmp_path / "s"
    kvstore.open(store).close()
    for n in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "blobs.lock"):
        if os.path.lexists(store / n) and n != "index.sqlite":
            os.unlink(store / n)
    target = store / name
    if os.path.isdir(target):
        os.rmdir(target)
    elif os.path.lexists(target):
        os.unlink(target)
    {"fifo": os.mkfifo, "file": lambda p: Path(p).write_bytes(b"x"), "folder": os.mkdir}[make](target)
    for command in (["stats"], ["verify", "--repair"], ["gc", "--max-bytes", "0"]):
        result = kv(*command, "--store", store, home=home)  # the timeout catches a hang
        assert result.returncode != 0 and f"{target} is not a" in result.stderr, result.stderr
    with pytest.raises(StoreOpenError, match="is not a (regular file|folder)"):
        kvstore.open(store)


def test_store_path_with_hash_and_question_mark(tmp_path, llama, home):
    seqs = prompts(42, 3, C)
    store = tmp_path / "a#b?c=d"
    model_path, model = llama
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, model_path)
        for t in seqs:
            mc.prefill(t, pin=True)
        s.flush()
        n = len(list(s.index.rows()))
    # A decoy where an unescaped `file:` URI would point (`a`, up to the `#`).
    decoy = tmp_path / "a"
    decoy.write_bytes(b"decoy")
    result = rebuild_index(store)  # reads the pins back from the index it moved aside
    assert result["records"] == n and result["salvaged"] == n
    with kvstore.open(store, chunk_size=C) as s:
        assert all(r.pinned for r in s.index.rows())
    result = kv("stats", "--json", "--store", store, home=home)
    assert result.returncode == 0 and json.loads(result.stdout)["chunks"] > 0
    assert decoy.read_bytes() == b"decoy" and sorted(os.listdir(tmp_path)) == ["a", "a#b?c=d", "home"]
    restores(store, llama, seqs)


def test_repair_deletes_only_kvstore_names_and_moves_the_rest_aside(tmp_path, llama):
    store = tmp_path / "s"
    seqs = prompts(43, 2, C)
    warm(store, llama, seqs)
    root = store / "blobs"
    name = "ab" + "cd" + "e" * 28 + blobtree.SUFFIX
    planted = {
        root / "notes.txt": b"mine",
        root / "ab" / "cd" / "photo.jpg": b"\xff\xd8 photo",
        root / "ab" / name: b"blob name in the wrong folder",
        root / "ab" / "cd" / "deep" / "x.bin": b"deeper than blobs go",
    }
    for p, data in planted.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    lookalike = root / "ab" / "cd" / name
    lookalike.write_bytes(b"a blob name, no row, no header naming it")
    os.mkfifo(root / "ab" / "cd" / ("abcd" + "f" * 28 + blobtree.SUFFIX))
    with kvstore.open(store, chunk_size=C) as s:
        kinds = sorted(p.kind for p in s.verify(repair=True))
        assert kinds == ["foreign_file"] * 6, kinds
        assert s.verify() == []
    kept = {p.name.split(".", 1)[1]: p for p in (store / "quarantine").iterdir()}
    # A name kvstore writes, in its place, but no header naming its hash: moved aside, not deleted.
    assert kept[f"ab_cd_{name}"].read_bytes() == b"a blob name, no row, no header naming it"
    assert kept["notes.txt"].read_bytes() == b"mine"
    assert kept["ab_cd_photo.jpg"].read_bytes() == b"\xff\xd8 photo"
    assert kept[f"ab_{name}"].read_bytes() == b"blob name in the wrong folder"
    assert (kept["ab_cd_deep"] / "x.bin").read_bytes() == b"deeper than blobs go"
    assert stat.S_ISFIFO(os.lstat(kept["ab_cd_abcd" + "f" * 28 + blobtree.SUFFIX]).st_mode)
    restores(store, llama, seqs)


# -- 2. a lost index never wipes the cache ----------------------------------------------------

def _lose_index_keep_wal(store: Path, llama, seqs) -> None:
    """The state a crash leaves: a store whose index is gone but whose -wal is still there."""
    model_path, model = llama
    script = (
        "import os, sys, kvstore\n"
        "from mlx_lm import load\n"
        "from kvtest import prefill\n"
        f"model, _ = load({str(model_path)!r})\n"
        f"s = kvstore.open({str(store)!r}, chunk_size={C})\n"
        "mc = s.bind(model, " + repr(str(model_path)) + ")\n"
        f"for t in {seqs!r}:\n"
        "    mc.insert(t, prefill(model, t))\n"
        "s.flush()\n"
        f"os.unlink({str(store / 'index.sqlite')!r})\n"
        "os._exit(0)  # no checkpoint: the -wal stays\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=HANG_S)
    assert (store / "index.sqlite-wal").stat().st_size > 0 and not (store / "index.sqlite").exists()


def test_lost_index_with_its_wal_left_is_lost_and_never_wipes_the_blobs(tmp_path, llama, home):
    seqs = prompts(44, 6, C)
    store = tmp_path / "s"
    _lose_index_keep_wal(store, llama, seqs)
    blob_files = sorted(p for p in blobtree.walk(store / "blobs"))
    assert len(blob_files) >= 6
    with pytest.raises(IndexLostError, match=rf"kvstore verify --repair --store {store}"):
        kvstore.open(store, chunk_size=C)
    result = kv("stats", "--store", store, home=home)
    assert result.returncode != 0 and "verify --repair" in result.stderr
    result = kv("gc", "--max-bytes", "0", "--store", store, home=home)
    assert result.returncode != 0 and "verify --repair" in result.stderr
    assert sorted(blobtree.walk(store / "blobs")) == blob_files  # still all there
    assert not (store / "index.sqlite").exists()
    result = kv("verify", "--repair", "--store", store, home=home)
    assert "rebuilt the index" in result.stderr, result.stderr
    assert sorted(blobtree.walk(store / "blobs")) == blob_files
    # The old -wal was kept aside, never replayed into the rebuilt index.
    assert any(n.startswith("index.sqlite-wal.stale-") for n in os.listdir(store))
    restores(store, llama, seqs)


def test_repair_never_deletes_most_blobs_as_orphans_without_force(tmp_path, llama):
    seqs = prompts(45, 6, C)
    store = tmp_path / "s"
    rows = warm(store, llama, seqs)
    blob_files = sorted(blobtree.walk(store / "blobs"))
    # An index replaced by an empty one (of another kvstore, say): every blob looks orphaned.
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        if (store / name).exists():
            (store / name).unlink()
    from kvstore.storage.index import Index

    os.close(os.open(store / "index.sqlite", os.O_CREAT | os.O_WRONLY, 0o600))
    Index(store / "index.sqlite").close()
    with kvstore.open(store, chunk_size=C) as s:
        problems = s.verify(repair=True)
        refused = [p for p in problems if p.kind == "repair_refused"]
        assert len(refused) == 1 and "--force" in refused[0].detail and "rebuild" in refused[0].detail
        assert sorted(blobtree.walk(store / "blobs")) == blob_files  # kept
        assert len(s.verify()) == len(rows)  # still reported, as orphan files
        s.verify(repair=True, force=True)  # asked for explicitly: then they go
        assert list(blobtree.walk(store / "blobs")) == [] and s.verify() == []


def test_repair_keeps_the_blobs_of_an_index_rolled_back_to_an_older_copy(tmp_path, llama):
    """The index as it was before most of the store was written (a backup put back, a WAL lost
    with the rows it held): the blobs it does not know are whole records of a model it knows,
    and no gc deleted their rows, so repair keeps them and takes them back (their rows written
    again, as a rebuild would); before, it refused, or under its guard deleted them."""
    import shutil

    store = tmp_path / "s"
    warm(store, llama, prompts(46, 1, C))
    old = shutil.copy(store / "index.sqlite", tmp_path / "old.sqlite")  # (warm closed it: no WAL left)
    warm(store, llama, prompts(47, 16, C))  # more than 8 blobs, most of the store
    blob_files = sorted(blobtree.walk(store / "blobs"))
    for name in ("index.sqlite-wal", "index.sqlite-shm"):
        if (store / name).exists():
            (store / name).unlink()
    shutil.copy(old, store / "index.sqlite")
    with kvstore.open(store, chunk_size=C) as s:
        problems = s.verify(repair=True)
        assert problems and {p.kind for p in problems} == {"orphan_file"}, problems
        assert all(p.detail.endswith("taken back (a whole record: its row is written again)") for p in problems)
        assert sorted(blobtree.walk(store / "blobs")) == blob_files  # every blob kept
        assert s.verify() == [] and len(list(s.index.rows())) == len(blob_files)


def test_repair_after_a_stopped_gc_drops_the_rows_it_left_unreachable_without_force(tmp_path, llama):
    # gc may delete a parent before its children (they go later in the same gc); stopped in
    # between, it leaves rows no chain reaches. That is not a lost index: repair drops them,
    # however many, and keeps what is reachable.
    from kvstore.upkeep.verify import ORPHAN_FEW, ORPHAN_SHARE

    store = tmp_path / "s"
    seqs = prompts(47, 6, C)
    rows = warm(store, llama, seqs)
    first = [r for r in rows if r.depth == 1]
    below = [r for r in rows if r.depth > 1]
    assert len(below) > max(ORPHAN_FEW, ORPHAN_SHARE * len(rows))
    with kvstore.open(store, chunk_size=C) as s:
        for r in s.index.delete([r.hash for r in first]):  # what a gc does, row then file
            blobtree.blob_path(store / "blobs", r.hash).unlink()
        found = s.verify()
        assert {p.kind for p in found} == {"orphan_row"} and len(found) == len(below)
        problems = s.verify(repair=True)
        assert not [p for p in problems if p.kind == "repair_refused"]
        assert s.verify() == [] and list(s.index.rows()) == []
        assert list(blobtree.walk(store / "blobs")) == []


def test_repair_keeps_rows_whose_model_is_gone_from_the_index_without_force(tmp_path, llama):
    # The other kind of unreachable row: the first records' model row is missing, as in an index
    # that is lost or not this store's. Then the index is what is wrong: nothing is deleted.
    store = tmp_path / "s"
    rows = warm(store, llama, prompts(48, 6, C))
    with kvstore.open(store, chunk_size=C) as s:
        with s.index.conn:
            s.index.conn.execute("DELETE FROM models")
        problems = s.verify(repair=True)
        assert [p.kind for p in problems if p.kind == "repair_refused"] == ["repair_refused"]
        assert len(list(s.index.rows())) == len(rows) and len(list(blobtree.walk(store / "blobs"))) == len(rows)


def test_a_few_orphans_are_still_cleaned_up_without_force(tmp_path, llama):
    store = tmp_path / "s"
    rows = warm(store, llama, prompts(46, 20, C))
    with kvstore.open(store, chunk_size=C) as s:
        leaf = next(r for r in rows if not any(c.parent == r.hash for c in rows))
        s.index.delete([leaf.hash])  # one record's row lost: its file is an orphan
        assert [p.kind for p in s.verify(repair=True)] == ["orphan_file"]
        assert s.verify() == []


# -- 3. hostile files are errors, never hangs or crashes ---------------------------------------

def _rewrite(store: Path, h: bytes, edit) -> None:
    """Rewrite a blob's header and give its row the new size and checksum (and the store's totals
    the new size: the index's triggers count inserts and deletes, not an UPDATE of a size): only
    what the header says can tell it from a good record."""
    path = blobtree.blob_path(store / "blobs", h)
    buf = path.read_bytes()
    (n,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(buf[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    new = struct.pack("<Q", len(raw)) + raw + buf[8 + n :]
    path.write_bytes(new)
    checksum = xxhash.xxh3_64_intdigest(new)
    con = sqlite3.connect(store / "index.sqlite")
    with con:
        con.execute("UPDATE totals SET bytes = bytes + ? - (SELECT size FROM records WHERE hash = ?) "
                    "WHERE ns = (SELECT ns FROM records WHERE hash = ?)", (len(new), h, h))
        con.execute("UPDATE records SET size = ?, checksum = ? WHERE hash = ?",
                    (len(new), checksum - (1 << 64) if checksum >= 1 << 63 else checksum, h))
    con.close()


@pytest.mark.parametrize("relabel", ["copied", "header-rewritten"])
def test_verify_finds_a_blob_of_another_record_and_repair_drops_it(tmp_path, llama, home, relabel):
    """A whole, valid blob of one record in the place of another's, with the row's size and
    checksum made to match: checksums cannot tell, the record check can (its header names the
    other record, or, rewritten to name this one, its token ids hash to the other key)."""
    store = tmp_path / "s"
    shared = [int(t) for t in np.random.default_rng(61).integers(0, 250, C)]
    a = shared + [int(t) for t in np.random.default_rng(62).integers(0, 250, C)]
    b = shared + [int(t) for t in np.random.default_rng(63).integers(0, 250, C)]
    rows = warm(store, llama, [a, b])
    ns = rows[0].ns
    chain_a, chain_b = keys.chain(ns, np.array(a), C), keys.chain(ns, np.array(b), C)
    victim, other = chain_a[1], chain_b[1]  # same parent, same depth: only the tokens differ
    root = store / "blobs"
    blobtree.blob_path(root, victim).write_bytes(blobtree.blob_path(root, other).read_bytes())

    def edit(header):
        if relabel == "header-rewritten":
            header["__metadata__"]["hash"] = victim.hex()

    _rewrite(store, victim, edit)
    result = kv("verify", "--json", "--store", store, home=home)
    assert result.returncode == 1, result.stdout + result.stderr
    problems = json.loads(result.stdout)["problems"]
    assert [(p["kind"], p["hash"]) for p in problems] == [("corrupt_blob", victim.hex())], problems
    result = kv("verify", "--repair", "--store", store, home=home)
    assert result.returncode == 1 and "; repaired" in result.stdout, result.stdout + result.stderr
    assert kv("verify", "--store", store, home=home).returncode == 0
    with kvstore.open(store, chunk_size=C) as s:
        left = {r.hash for r in s.index.rows()}
    assert victim not in left and {chain_a[0], other} <= left
    restores(store, llama, [b])


def _header(entries: dict, meta: dict | None = None, payload: int = 64) -> bytes:
    header = dict(entries)
    if meta is not None:
        header["__metadata__"] = meta
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(payload)


BAD_ENTRIES = {
    "negative-dim": {"dtype": "F32", "shape": [-1, -4], "data_offsets": [0, 16]},
    "float-dim": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]},
    "bool-dim": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]},
    "huge-dims": {"dtype": "F32", "shape": [1 << 62, 1 << 62, 0], "data_offsets": [0, 0]},
    "overflowing-product": {"dtype": "U8", "shape": [1 << 32, 1 << 32], "data_offsets": [0, 16]},
    "dim-beyond-json-ints": {"dtype": "F32", "shape": [10 ** 400], "data_offsets": [0, 16]},
    "bool-offset": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]},
    "float-offset": {"dtype": "U8", "shape": [4], "data_offsets": [0.0, 4.0]},
    "negative-offset": {"dtype": "U8", "shape": [4], "data_offsets": [-4, 0]},
    "product-mismatch": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]},
    "past-the-end": {"dtype": "U8", "shape": [100], "data_offsets": [0, 100]},
    "unknown-dtype": {"dtype": "F8_E4M3", "shape": [4], "data_offsets": [0, 4]},
    "dtype-not-a-string": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
    "shape-not-a-list": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]},
    "entry-not-an-object": [1, 2, 3],
    "extra-field": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4], "x": 1},
}


@pytest.mark.parametrize("bad", list(BAD_ENTRIES))
def test_parse_header_refuses_every_bad_field_with_a_blob_error(bad):
    buf = _header({"t": BAD_ENTRIES[bad]})
    with pytest.raises(BlobError, match="bad header entry"):
        blobformat.parse_header(buf, "f")
    with pytest.raises(BlobError):
        decode(buf, "f")


@pytest.mark.parametrize("meta", [{"hash": 1}, ["x"], {"depth": None}, "text"])
def test_parse_header_refuses_metadata_that_is_not_strings(meta):
    with pytest.raises(BlobError, match="metadata"):
        blobformat.parse_header(_header({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, meta), "f")


def test_parse_header_accepts_what_kvstore_writes():
    head, pieces = blobformat.encode({"a": ("F32", np.zeros((1, 2, 3, 4), np.float32)),
                                 "e": ("I32", np.zeros((0,), np.int32))}, {"hash": "ab"})
    buf = head + b"".join(p.tobytes() for p in pieces)
    entries, base = blobformat.parse_header(buf, "f")
    assert entries["a"]["shape"] == [1, 2, 3, 4] and base == len(head)
    assert blobformat.header_metadata(buf) == {"hash": "ab"}


def test_a_fifo_in_place_of_a_blob_never_hangs_verify_or_generate(tmp_path, demo_model_path, home):
    store = tmp_path / "s"
    prompt = "the same long system prompt, " * 30  # > 2 chunks of 256 byte-level tokens
    result = kv("generate", "--store", store, "--model", demo_model_path, "--prompt", prompt,
                "--max-tokens", "2", home=home)
    assert result.returncode == 0, result.stderr
    with kvstore.open(store, read_only=True) as s:
        rows = sorted(s.index.rows(), key=lambda r: (r.kind, r.depth))
    fifo = blobtree.blob_path(store / "blobs", rows[1].hash)  # the second chunk
    fifo.unlink()
    os.mkfifo(fifo, 0o600)
    result = kv("verify", "--store", store, home=home)
    assert result.returncode != 0 and "not a regular file" in result.stdout, result.stdout
    result = kv("generate", "--store", store, "--model", demo_model_path, "--prompt", prompt,
                "--max-tokens", "2", home=home)
    assert result.returncode == 0, result.stderr
    assert "256 reused" in result.stderr  # the first chunk still served; the FIFO a miss
    # ... quarantined, and stored again by that same generate: healed.
    assert stat.S_ISREG(os.lstat(fifo).st_mode)
    assert kv("verify", "--store", store, home=home).returncode == 0
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    result = kv("verify", "--repair", "--store", store, home=home)
    assert result.returncode != 0 and "repaired" in result.stdout
    assert not os.path.lexists(fifo)
    assert kv("verify", "--store", store, home=home).returncode == 0


def test_rebuild_skips_and_reports_planted_files(tmp_path, llama):
    seqs = prompts(47, 4, C)
    store = tmp_path / "s"
    rows = warm(store, llama, seqs)
    root = store / "blobs"

    def planted(i: int) -> Path:
        name = f"{i:02x}" * 16
        p = root / name[:2] / name[2:4] / (name + blobtree.SUFFIX)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    planted(1).write_bytes(_header({"t": BAD_ENTRIES["overflowing-product"]}))
    planted(2).write_bytes(_header({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}},
                                   {"hash": "02" * 16, "depth": "1e999", "format": "1"}))
    planted(3).write_bytes(b"\xff" * 8 + b"x" * 100)
    os.mkfifo(planted(4))
    with open(planted(5), "wb") as f:  # a 30 GB blob-named file (sparse: no disk used)
        f.truncate(30 << 30)
    planted(6).symlink_to(blobtree.blob_path(root, rows[0].hash))
    os.unlink(store / "index.sqlite")
    result = rebuild_index(store)
    assert result["records"] == len(rows)
    reasons = {Path(s["path"]).name[:2]: s["reason"] for s in result["skipped"]}
    assert sorted(reasons) == ["01", "02", "03", "04", "05", "06"], reasons
    assert "larger than any blob" in reasons["05"] and "not a regular file" in reasons["04"]
    assert "symbolic link" in reasons["06"]
    restores(store, llama, seqs)


def test_negative_shape_blob_whose_row_matches_is_a_miss_not_a_crash(tmp_path, llama):
    model_path, model = llama
    seqs = prompts(48, 1, C)
    t = seqs[0][: 2 * C]
    store = tmp_path / "s"
    rows = sorted(warm(store, llama, [t]), key=lambda r: r.depth)

    def negative(header):
        shape = header["0.keys"]["shape"]
        header["0.keys"]["shape"] = [-shape[0], -shape[1]] + shape[2:]

    _rewrite(store, rows[1].hash, negative)
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        query = t + [5]
        cache, rest = mc.fetch(query)
        assert len(query) - len(rest) == C and logits_diff(model, cache, rest, query) <= TOL
        assert s.stats()["quarantined"] == 1
        kinds = [p.kind for p in s.verify()]
        assert kinds == ["quarantined"]
        s.verify(repair=True)
        assert s.verify() == []


def test_rows_of_the_wrong_type_never_crash_verify_or_gc(tmp_path, llama):
    seqs = prompts(49, 4, C)
    store = tmp_path / "s"
    rows = warm(store, llama, seqs)
    con = sqlite3.connect(store / "index.sqlite")
    with con:
        cols = "hash, ns, parent, depth, kind, ntokens, first_token, size, checksum, created, last_access, hits, pinned, bad"
        r = rows[0]
        con.execute(f"INSERT INTO records ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    ("not-a-hash", r.ns, r.ns, 1, 0, r.ntokens, r.first_token, 10, 0, 0.0, 0.0, 0, 0, 0))
        con.execute(f"INSERT INTO records ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (b"\x01" * 16, r.ns, r.ns, 1, 0, r.ntokens, r.first_token, "ten", "x", "now", 0.0, 0, 0, 0))
        con.execute(f"INSERT INTO records ({cols}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (b"\x02" * 16, r.ns, r.ns, 1, 0, r.ntokens, r.first_token, 30 << 30, 5, 0.0, 0.0, 0, 0, 0))
    con.close()
    model_path, model = llama
    with kvstore.open(store, chunk_size=C) as s:
        problems = s.verify()  # (the insertion log took the row of the wrong type too)
        assert sorted(p.kind for p in problems) == ["bad_log_row"] + ["bad_row"] * 3, [str(p) for p in problems]
        result = s.gc(max_bytes=0)  # finishes: every good record evicted, files after the commit
        assert result["evicted"] >= len(rows)
        left = s.verify()
        assert left and {p.kind for p in left} <= {"bad_row", "bad_log_row"}  # and no orphan file left behind
        assert list(blobtree.walk(store / "blobs")) == []
        s.verify(repair=True)
        assert s.verify() == []
        mc = s.bind(model, model_path)
        assert mc.fetch(seqs[0] + [1])[1] == seqs[0] + [1]  # a miss, never an exception


def test_a_blob_row_claiming_30_gb_is_never_read(tmp_path, llama):
    model_path, model = llama
    t = prompts(50, 1, C)[0][: 2 * C]
    store = tmp_path / "s"
    rows = sorted(warm(store, llama, [t]), key=lambda r: r.depth)
    path = blobtree.blob_path(store / "blobs", rows[1].hash)
    with open(path, "r+b") as f:
        f.truncate(30 << 30)  # sparse
    con = sqlite3.connect(store / "index.sqlite")
    with con:
        con.execute("UPDATE records SET size = ? WHERE hash = ?", (30 << 30, rows[1].hash))
    con.close()
    script = (
        "import kvstore\n"
        "from mlx_lm import load\n"
        f"model, _ = load({str(model_path)!r})\n"
        f"with kvstore.open({str(store)!r}, chunk_size={C}, memory_bytes=0) as s:\n"
        f"    mc = s.bind(model, {str(model_path)!r})\n"
        f"    cache, rest = mc.fetch({t + [5]!r})\n"
        f"    assert len(rest) == {C + 1}, len(rest)\n"
        "    print(sorted(p.kind for p in s.verify()))\n")
    # Reading it would take minutes and 30 GB of RAM: the timeout and rlimit catch that.
    result = subprocess.run([sys.executable, "-c", f"import resource; resource.setrlimit("
                             f"resource.RLIMIT_AS, (8 << 30, 8 << 30))\n{script}"],
                            capture_output=True, text=True, timeout=HANG_S,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    # (The size was changed behind the index's back, so its totals no longer add up either.)
    assert result.stdout.strip() == "['bad_row', 'bad_totals']"


# -- 5. smaller holes: the fingerprint memo, the store's mode and owner -------------------------

def test_weights_changed_in_place_with_their_mtime_put_back_get_a_new_fingerprint(tmp_path, llama):
    import shutil

    from mlx_lm import load

    src, _ = llama
    path = tmp_path / "model"
    shutil.copytree(src, path)
    model, _ = load(str(path))
    tokens = prompts(51, 1, C)[0]
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:
        mc = s.bind(model, path)
        mc.insert(tokens, prefill(model, tokens))
        s.flush()
        old_fp = mc.fingerprint
    weights = path / "model.safetensors"
    st = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64 - i for i in range(64))  # other weights, the same size
    with open(weights, "r+b") as f:  # in place: the same inode
        f.write(data)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back
    assert os.stat(weights).st_size == st.st_size and os.stat(weights).st_mtime_ns == st.st_mtime_ns
    model2, _ = load(str(path))
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:
        mc = s.bind(model2, path)
        assert mc.fingerprint != old_fp
        assert mc.fetch(tokens)[1] == tokens  # the old K/V is never reused
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:  # and the memo still works when nothing changed
        assert s.bind(model2, path).fingerprint == mc.fingerprint
        rows = s.index.conn.execute("SELECT inode, ctime_ns FROM file_digests WHERE path = ?",
                                    (str(weights.resolve()),)).fetchall()
        assert rows == [(os.stat(weights).st_ino, os.stat(weights).st_ctime_ns)]


def test_a_fifo_among_the_weight_files_never_hangs_bind(tmp_path, llama):
    import shutil

    src, model = llama
    path = tmp_path / "model"
    shutil.copytree(src, path)
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:
        fingerprint = s.bind(model, path).fingerprint
    os.mkfifo(path / "extra.safetensors")
    with kvstore.open(tmp_path / "s", chunk_size=C) as s:  # not a weight file: never opened
        assert s.bind(model, path).fingerprint == fingerprint
    with pytest.raises(OSError, match="not a regular file"):
        keys.file_digest(path / "extra.safetensors")


def test_a_loose_store_directory_is_tightened_and_said(tmp_path, caplog):
    store = tmp_path / "s"
    kvstore.open(store).close()
    os.chmod(store, 0o777)
    with caplog.at_level("WARNING", logger="kvstore"):
        kvstore.open(store).close()
    assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
    assert "had mode 777" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the store to another user")
def test_a_store_owned_by_another_user_is_only_read(tmp_path, llama, caplog):
    seqs = prompts(52, 2, C)
    store = tmp_path / "s"
    warm(store, llama, seqs)
    os.chmod(store, 0o755)
    os.chown(store, 65534, 65534)
    with pytest.raises(StoreOpenError, match="belongs to user id 65534"):
        kvstore.open(store)
    before = snapshot(store)
    with caplog.at_level("WARNING", logger="kvstore"):
        with kvstore.open(store, read_only=None) as s:
            assert s.read_only and s.stats()["chunks"] > 0
    assert "other users can read" in caplog.text
    assert snapshot(store) == before


# -- a store the user may read but not write ----------------------------------------

def _as_reader(args: list[str], home: Path) -> subprocess.CompletedProcess:
    """`kvstore ARGS` as a user who may read the store but not write it (nobody, under root)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": str(REPO)}
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    result = subprocess.run([*prefix, sys.executable, "-m", "kvstore.cli", *map(str, args)],
                            capture_output=True, text=True, env=env, cwd="/", timeout=HANG_S)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_a_read_only_store_answers_stats_and_verify_and_refuses_writes(tmp_path_factory, llama, demo_model_path):
    import shutil
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="kvstore-shared-"))  # outside pytest's 0700 folders
    try:
        os.chmod(shared, 0o755)
        store = shared / "s"
        seqs = prompts(53, 3, C)
        warm(store, llama, seqs)
        model = shared / "model"
        shutil.copytree(demo_model_path, model)
        home = shared / "home"
        home.mkdir()
        os.chmod(home, 0o777)
        # Shared as a read-only folder: readable by all, writable by nobody but its owner.
        for dirpath, dirs, files in os.walk(shared):
            for d in dirs:
                os.chmod(Path(dirpath) / d, 0o777 if Path(dirpath) / d == home else 0o555)
            for f in files:
                os.chmod(Path(dirpath) / f, 0o444)
        os.chmod(store, 0o555)
        if os.geteuid() != 0:
            os.chmod(shared, 0o555)
        before = snapshot(store)
        result = _as_reader(["stats", "--json", "--store", store], home)
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)
        assert stats["read_only"] and stats["chunks"] > 0
        result = _as_reader(["verify", "--store", store], home)
        assert result.returncode == 0 and "clean" in result.stdout, result.stdout + result.stderr
        for command in (["gc", "--max-bytes", "0"], ["verify", "--repair"],
                        ["warm", "--model", model, "--prompts", REPO / "examples" / "prompts.jsonl"]):
            result = _as_reader([*command, "--store", store], home)
            assert result.returncode != 0, result.stdout
            assert "not writable by this user" in result.stderr or "belongs to user" in result.stderr, result.stderr
        assert snapshot(store) == before  # nothing written, nothing created
    finally:
        for dirpath, dirs, files in os.walk(shared):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(shared, ignore_errors=True)


def test_processes_creating_one_new_store_at_once_all_open_it(tmp_path):
    """A store being made by one process (its index has no tables yet) is not a damaged one."""
    store = tmp_path / "new"
    script = (f"import kvstore\nkvstore.open({str(store)!r}).close()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=HANG_S)
        assert p.returncode == 0, err
    with kvstore.open(store, create=False) as s:
        assert s.verify() == [] and s.stats()["chunks"] == 0
