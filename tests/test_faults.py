"""Fault suite, part 1: crashes at any point, and damaged blobs and indexes.

Every check after a fault ends the same way: the store opens, `verify` is clean or `verify
--repair` makes it clean, nothing partial is left, nothing that was flushed is lost, and every
restore gives the logits of a recompute. Crashes are real: a child process (tests/faultproc.py)
is killed with SIGKILL, at a random moment or at a fault point armed through KVSTORE_FAULT
(kvstore/faults.py). `pytest --soak` runs many more crash points (tests/README.md).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from faultproc import Child, prompts
from kvtest import logits_diff
from mlx_lm.models.cache import make_prompt_cache

import kvstore
from kvstore.errors import CorruptIndexError, StoreOpenError
from kvstore.storage import blobtree
from kvstore.upkeep.rebuild import rebuild_index

HERE = Path(__file__).parent
C = 16
TOL = 1e-4


@pytest.fixture
def soak(request):
    return request.config.getoption("--soak"), request.config.getoption("--soak-runs")


# -- helpers ----------------------------------------------------------------------------------

def temp_files(root: Path) -> list[Path]:
    return [p for p in blobtree.walk(root) if p.name.startswith(blobtree.TMP_PREFIX)]


def recover_and_check(store_dir: Path, model_path: str, model, all_prompts: list[list[int]],
                      flushed: list[list[int]], allowed: set[str]) -> list[str]:
    """Open after a fault; only `allowed` problems; repair to clean; nothing flushed lost;
    every restore equals a recompute. Returns the kinds of problem found."""
    with kvstore.open(store_dir, chunk_size=C, memory_bytes=0) as store:
        problems = store.verify()
        kinds = sorted(p.kind for p in problems)
        assert set(kinds) <= allowed, [str(p) for p in problems]
        if problems:
            store.verify(repair=True)
        assert store.verify() == []
        assert temp_files(store.blob_root) == []
        mc = store.bind(model, model_path)
        for p in flushed:
            assert mc.stored_length(p) == len(p), "a flushed prompt was lost"
        for i, p in enumerate(all_prompts):
            query = p + [7]
            cache, rest = mc.fetch(query)
            assert logits_diff(model, cache, rest, query) <= TOL, f"prompt {i}: restore != recompute"
        assert store.stats()["quarantined"] == 0
    return kinds


def warm_in_process(store_dir, model_path, model, ps, pin=False):
    with kvstore.open(store_dir, chunk_size=C) as store:
        mc = store.bind(model, model_path)
        for p in ps:
            mc.prefill(p, pin=pin)
        store.flush()
        assert store.stats()["writer"]["write_errors"] == 0


# -- crashes ----------------------------------------------------------------------------------

CRASH_POINTS = [  # (point, action, n-th hit): what each leaves behind is in `allowed`
    ("blob_write", "kill", 3),
    ("blob_temp", "kill", 7),
    ("after_rename", "kill", 5),
    ("in_transaction", "kill", 4),
    ("in_transaction", "exit", 1),
]
LEFTOVERS = {"blob_write": {"temp_file"}, "blob_temp": {"temp_file"}, "after_rename": {"orphan_file"},
             "in_transaction": {"orphan_file"}}


@pytest.mark.parametrize("point,action,nth", CRASH_POINTS, ids=[f"{p}-{a}-{n}" for p, a, n in CRASH_POINTS])
def test_crash_at_a_write_point(tmp_path, llama, point, action, nth):
    model_path, model = llama
    store = tmp_path / "s"
    warm_in_process(store, model_path, model, prompts(1, 3, C))  # something durable before
    child = Child("warm", store, model_path, C, 2, 8, fault=f"{point}:{action}:{nth}")
    code = child.wait()
    assert code in (-signal.SIGKILL, 137), child.stderr  # it died at the point, not of an error
    flushed = [prompts(2, 8, C)[i] for i in child.flushed()]
    kinds = recover_and_check(store, model_path, model, prompts(1, 3, C) + prompts(2, 8, C),
                              prompts(1, 3, C) + flushed, LEFTOVERS[point])
    assert kinds, "the crash should have left something for verify to find"


def _gc_killed_after_its_commit(tmp_path, llama) -> tuple:
    """A warmed store (2 pinned prompts, 8 others) whose gc down to a third of its bytes was
    killed right after its first commit: (store, its bytes before, the pinned prompts, the rest)."""
    model_path, model = llama
    store = tmp_path / "s"
    pinned, rest = prompts(3, 2, C), prompts(4, 8, C)
    warm_in_process(store, model_path, model, pinned, pin=True)
    warm_in_process(store, model_path, model, rest)
    with kvstore.open(store, chunk_size=C) as s:
        total = s.stats()["bytes"]
    child = Child("gc", store, model_path, C, total // 3, fault="gc_deleted:kill:1")
    assert child.wait() == -signal.SIGKILL, child.stderr
    return store, total, pinned, rest


def test_crash_in_gc_between_row_and_file_deletion(tmp_path, llama):
    model_path, model = llama
    store, total, pinned, rest = _gc_killed_after_its_commit(tmp_path, llama)
    # gc deletes rows in hash order: a kill between two of its transactions may also leave
    # children of deleted rows, unreachable (`orphan_row`), and edges into deleted rows that its
    # second sweep had not dropped yet (`bad_edge`, which readers ignore), which repair drops.
    kinds = recover_and_check(store, model_path, model, pinned + rest, pinned,
                              {"orphan_file", "orphan_row", "bad_edge"})
    assert "orphan_file" in kinds
    # The store goes on: gc finishes the job and stays within budget.
    with kvstore.open(store, chunk_size=C) as s:
        s.gc(max_bytes=total // 3)
        assert s.stats()["bytes"] <= total // 3 or s.stats()["bytes"] == sum(
            r.size for r in s.index.rows() if r.pinned)
        assert s.verify() == []


def test_the_next_gc_unlinks_the_files_a_killed_gc_left(tmp_path, llama):
    """A gc killed between a commit and its unlinks leaves files no row counts (and edges into the
    rows it deleted); the next gc (the disk budget's, or `kvstore gc`) unlinks them and drops the
    edges, with no `verify --repair` needed, and says how many files; the pinned prompts stay whole."""
    model_path, model = llama
    store, total, pinned, _ = _gc_killed_after_its_commit(tmp_path, llama)
    with kvstore.open(store, chunk_size=C) as s:
        left = [p for p in s.verify() if p.kind == "orphan_file"]
        assert left
        done = s.gc(max_bytes=total // 3)
        assert done["leftover_files"] == len(left)
        assert s.verify() == []  # no file, edge or row the killed gc left
        assert s.gc(max_bytes=total // 3)["leftover_files"] == 0
        mc = s.bind(model, model_path)
        for tokens in pinned:
            assert mc.stored_length(tokens) == len(tokens)


def _random_kills(tmp_path, llama, runs: int, max_delay: float) -> dict:
    model_path, model = llama
    store = tmp_path / "s"
    rng = random.Random(20240601)
    figures = {"runs": 0, "killed": 0, "problems": {}}
    all_flushed: list[list[int]] = []
    all_prompts: list[list[int]] = []
    for run in range(runs):
        seed = 100 + run
        ps = prompts(seed, 40, C)  # more than a child can warm before the kill
        child = Child("warm", store, model_path, C, seed, len(ps), 3)
        child.ready.wait(timeout=120)
        time.sleep(rng.uniform(0, max_delay))
        child.kill()
        code = child.wait()
        assert code in (0, -signal.SIGKILL), child.stderr
        figures["runs"] += 1
        figures["killed"] += code == -signal.SIGKILL and not any(item.get("done") for item in child.lines)
        all_flushed += [ps[i] for i in child.flushed()]
        reached = ps[: len(child.flushed()) + 1]  # the flushed ones and the one in flight
        all_prompts += reached
        check = all_prompts if run == runs - 1 else reached  # restores of everything at the end
        kinds = recover_and_check(store, model_path, model, check, all_flushed,
                                  {"temp_file", "orphan_file"})
        for k in kinds:
            figures["problems"][k] = figures["problems"].get(k, 0) + 1
    return figures


def test_kill_at_random_moments(tmp_path, llama, soak):
    runs = 3 if not soak[0] else max(3, soak[1])
    figures = _random_kills(tmp_path, llama, runs, max_delay=0.3)
    # Every child was killed in the middle of its warm: a run that finished tested no crash.
    assert figures["killed"] == runs, figures
    if soak[0]:
        print(f"\nSOAK random kills: {json.dumps(figures)}")


@pytest.mark.soak
def test_soak_every_write_point(tmp_path, llama, soak):
    """Every fault point at many n-th hits, on one store that lives through all of them."""
    if not soak[0]:
        pytest.skip("soak only (pytest --soak)")
    model_path, model = llama
    store = tmp_path / "s"
    runs = failures = injected = 0
    all_prompts: list[list[int]] = []
    flushed: list[list[int]] = []
    for point in LEFTOVERS:
        for action in ("kill", "exit"):
            for nth in range(1, 40, 4):
                seed = 1000 + runs
                ps = prompts(seed, 24, C)
                child = Child("warm", store, model_path, C, seed, len(ps), fault=f"{point}:{action}:{nth}")
                code = child.wait()
                runs += 1
                failures += code not in (0, -signal.SIGKILL, 137)  # 0: fewer hits than n
                injected += code in (-signal.SIGKILL, 137)
                flushed += [ps[i] for i in child.flushed()]
                all_prompts += ps
                recover_and_check(store, model_path, model, ps, flushed, LEFTOVERS[point])
    recover_and_check(store, model_path, model, all_prompts, flushed, set())
    print(f"\nSOAK fault points: runs={runs} injected={injected} failures={failures}")
    assert failures == 0


# -- damaged blobs ----------------------------------------------------------------------------

def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _header_end(path: Path) -> int:
    return 8 + struct.unpack_from("<Q", path.read_bytes(), 0)[0]


DAMAGE = {
    "header-byte": lambda p: _flip(p, 40),
    "length-prefix": lambda p: _flip(p, 2),
    "payload-byte": lambda p: _flip(p, _header_end(p) + 100),
    "last-byte": lambda p: _flip(p, p.stat().st_size - 1),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "deleted": lambda p: p.unlink(),
    "replaced-by-folder": lambda p: (p.unlink(), p.mkdir()),
    "other-record": None,  # filled in the test: the bytes of another record's blob
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_blob_is_a_shorter_correct_prefix_quarantined_and_repaired(tmp_path, llama, damage):
    model_path, model = llama
    tokens = prompts(5, 1, C)[0][: 2 * C] + list(range(1, 2 * C + 6))  # 4 chunks and a tail
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        mc.prefill(tokens)
        store.flush()
        rows = sorted((r for r in store.index.rows()), key=lambda r: r.depth)
        target = blobtree.blob_path(store.blob_root, rows[2].hash)  # the third chunk
        other = blobtree.blob_path(store.blob_root, rows[3].hash)
    if damage == "other-record":
        target.write_bytes(other.read_bytes())
    else:
        DAMAGE[damage](target)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        query = tokens + [3]
        cache, rest = mc.fetch(query)  # never raises
        assert len(query) - len(rest) == 2 * C  # up to where the damaged record starts
        assert logits_diff(model, cache, rest, query) <= TOL
        assert store.stats()["quarantined"] == 1
        assert store.stats()["quarantined_total"] == 1
        kinds = sorted(p.kind for p in store.verify())
        assert kinds == ["orphan_row", "orphan_row", "quarantined"]  # its descendants are unreachable
        store.verify(repair=True)
        assert store.verify() == []
        assert not os.path.lexists(target) and store.stats()["chunks"] == 2
        # The store heals: the prompt stored again restores whole.
        mc.prefill(tokens)
        store.flush()
        cache, rest = mc.fetch(query)
        assert rest == [3] and logits_diff(model, cache, rest, query) <= TOL
        assert store.verify() == []


def test_gc_drops_quarantined_records_and_what_hangs_below_them(tmp_path, llama):
    """A quarantined record is never served, nor is anything below it: any gc, even one well
    within its budget, frees their bytes; a pinned prompt's records stay."""
    model_path, model = llama
    a = prompts(7, 1, C)[0][: 2 * C] + list(range(1, 2 * C + 6))  # 4 chunks and a tail
    b = list(range(100, 100 + 3 * C))  # pinned: its 3 chunks (no tail: a multiple of C)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        mc.prefill(a)
        mc.prefill(b, pin=True)
        store.flush()
        chain = {r.hash: r for r in store.index.rows()}
        by_depth = sorted((r for r in chain.values() if not r.pinned), key=lambda r: r.depth)
        bad = by_depth[2]  # a's third chunk: below it its fourth chunk and its tail
        pinned_bad = min((r for r in chain.values() if r.pinned), key=lambda r: r.depth)
        for r in (bad, pinned_bad):
            _flip(blobtree.blob_path(store.blob_root, r.hash), _header_end(blobtree.blob_path(store.blob_root, r.hash)) + 1)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        for tokens in (a, b):
            mc.fetch(tokens + [3])
        held = store.stats()
        assert held["quarantined_now"] == {"records": 2, "bytes": bad.size + pinned_bad.size}
        result = store.gc(max_bytes=10 * held["bytes"])
        below = [r for r in by_depth if r.depth >= bad.depth]
        assert result["evicted"] == len(below) == 3
        assert result["freed_bytes"] == sum(r.size for r in below)
        left = {r.hash for r in store.index.rows()}
        assert left == set(chain) - {r.hash for r in below}  # the pinned prompt stays whole
        assert store.stats()["quarantined_now"] == {"records": 1, "bytes": pinned_bad.size}
        assert store.gc(max_bytes=10 * held["bytes"])["evicted"] == 0
        cache, rest = mc.fetch(a + [3])
        assert len(a) + 1 - len(rest) == 2 * C and logits_diff(model, cache, rest, a + [3]) <= TOL
        # Stored again, the prompt heals.
        mc.prefill(a)
        store.flush()
        cache, rest = mc.fetch(a + [3])
        assert rest == [3] and logits_diff(model, cache, rest, a + [3]) <= TOL


def test_foreign_and_stray_files_in_the_blob_tree(tmp_path, llama):
    model_path, model = llama
    tokens = prompts(6, 1, C)[0]
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        store.bind(model, model_path).prefill(tokens)
        store.flush()
        root = store.blob_root
        good = sorted(blobtree.walk(root))
    strays = {
        root / "README.txt": b"not a blob",
        root / "ab" / "cd" / ("abcd" + "c" * 28 + ".safetensors"): b"",  # blob-named, empty, no row
        root / "ab" / ("abcd" + "0" * 28 + ".safetensors"): b"x" * 10,  # a blob name in the wrong folder
        root / "ab" / "cd" / ".tmp.abcd.999999999.0000": b"half",  # a dead writer's temporary
    }
    for p, data in strays.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "ef").mkdir()  # an empty folder is harmless
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        cache, rest = mc.fetch(tokens)
        assert rest == tokens[-1:]
        kinds = sorted(p.kind for p in store.verify())
        # The empty blob-named file names no hash of its own in a header: moved aside, not deleted.
        assert kinds == ["foreign_file", "foreign_file", "foreign_file", "temp_file"]
        assert store.stats()["quarantine_folder"] == {"files": 0, "bytes": 0}
        store.verify(repair=True)
        assert store.verify() == []
        assert sorted(blobtree.walk(root)) == good
        # The foreign files were moved aside, whole, and stats counts them.
        assert store.stats()["quarantine_folder"] == {"files": 3, "bytes": 20}


# -- damaged index ----------------------------------------------------------------------------

def _stored(tmp_path, llama, ps, **kw):
    model_path, model = llama
    store = tmp_path / "s"
    warm_in_process(store, model_path, model, ps, **kw)
    return store


def _assert_restores(store, llama, ps, expect_full=True):
    model_path, model = llama
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        for p in ps:
            query = p + [9]
            cache, rest = mc.fetch(query)
            if expect_full:
                assert rest == [9]
            assert logits_diff(model, cache, rest, query) <= TOL


def test_index_with_a_garbage_header_is_detected_on_open_and_rebuilt(tmp_path, llama):
    ps = prompts(7, 6, C)
    store = _stored(tmp_path, llama, ps, pin=True)
    with kvstore.open(store, chunk_size=C) as s:
        before = s.stats()
    db = store / "index.sqlite"
    data = bytearray(db.read_bytes())
    data[:100] = os.urandom(100)
    db.write_bytes(bytes(data))
    with pytest.raises(CorruptIndexError, match=r"verify --repair"):
        kvstore.open(store, chunk_size=C)
    result = rebuild_index(store)
    assert result["records"] == before["chunks"] + before["tails"] and result["skipped"] == []
    assert Path(result["damaged_index"]).exists()  # kept, not deleted
    with kvstore.open(store, chunk_size=C) as s:
        after = s.stats()
        assert (after["chunks"], after["tails"], after["bytes"]) == (before["chunks"], before["tails"], before["bytes"])
        assert s.verify() == []
    _assert_restores(store, llama, ps)
    assert (store / "index.sqlite").stat().st_mode & 0o777 == 0o600


def test_index_damaged_inside_never_breaks_fetch_and_is_rebuilt(tmp_path, llama):
    model_path, model = llama
    ps = prompts(8, 16, C)
    store = _stored(tmp_path, llama, ps)
    db = store / "index.sqlite"
    assert not Path(f"{db}-wal").exists()  # everything is in the main file
    # The pages of the records table and of its indexes (SQLite's own map of the file), and the
    # page size from the file's header: the rest (schema, meta, models) stays readable, so the
    # store opens and the damage is met by fetch and insert, later.
    with sqlite3.connect(db) as con:
        pages = [n for (n,) in con.execute(
            "SELECT pageno FROM dbstat WHERE name IN "
            "(SELECT name FROM sqlite_master WHERE tbl_name = 'records')")]
    con.close()
    data = bytearray(db.read_bytes())
    page = struct.unpack_from(">H", data, 16)[0]
    page = 65536 if page == 1 else page
    assert page == 16384 and len(pages) >= 2
    for n in pages:
        off = (n - 1) * page
        data[off : off + 400] = bytes(400)  # the b-tree page header and its first cells
    db.write_bytes(bytes(data))
    s = kvstore.open(store, chunk_size=C, memory_bytes=0)  # the damage is inside: open succeeds
    with s:
        mc = s.bind(model, model_path)
        for i, p in enumerate(ps[:4]):
            query = p + [9]
            cache, rest = mc.fetch(query)  # a miss (or what still reads), never an exception
            assert logits_diff(model, cache, rest, query) <= TOL
            if i == 0:  # the damage was met: nothing readable on disk (later ones may reuse the queue)
                assert rest == query
            fresh = make_prompt_cache(model)
            model(mx.array([p]), cache=fresh)
            mc.insert(p, fresh)  # never raises either: the writer counts what it cannot write
        with pytest.raises(CorruptIndexError, match="verify --repair"):
            s.verify()
    result = rebuild_index(store)
    assert result["records"] > 0 and result["skipped"] == []
    with kvstore.open(store, chunk_size=C) as s:
        assert s.verify() == []
    _assert_restores(store, llama, ps)


def test_a_busy_index_is_never_taken_for_a_damaged_one(tmp_path, monkeypatch):
    """Only a damaged index is reported as one (and so rebuilt): a locked one is not."""
    import kvstore.storage.schema

    monkeypatch.setattr(kvstore.storage.schema, "BUSY_TIMEOUT_S", 0.2)
    store = tmp_path / "s"
    (store / "blobs").mkdir(parents=True, mode=0o700)
    con = sqlite3.connect(store / "index.sqlite", isolation_level=None)
    con.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreOpenError, match="locked") as info:
            kvstore.open(store)
        assert not isinstance(info.value, CorruptIndexError)
    finally:
        con.execute("ROLLBACK")
        con.close()
    kvstore.open(store).close()  # and it opens once the lock is gone


def test_lost_index_is_detected_and_rebuilt(tmp_path, llama):
    ps = prompts(9, 5, C)
    store = _stored(tmp_path, llama, ps)
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        if (store / name).exists():
            (store / name).unlink()
    # Without its index the blobs look like orphans: `verify --repair` would delete them all.
    with pytest.raises(CorruptIndexError, match="verify --repair"):
        kvstore.open(store, chunk_size=C)
    result = rebuild_index(store)
    assert result["damaged_index"] is None and result["records"] > 0
    _assert_restores(store, llama, ps)


def test_corrupt_wal_loses_only_unflushed_rows_and_never_serves_wrong_data(tmp_path, llama):
    model_path, model = llama
    early, late = prompts(10, 4, C), prompts(11, 4, C)
    store = _stored(tmp_path, llama, early)  # closed: checkpointed into the main file
    copy = tmp_path / "copy"
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, model_path)
        for p in late:
            mc.prefill(p)
        s.flush()
        # A crash now leaves the late rows only in the WAL: copy the files as a crash would.
        shutil.copytree(store, copy)
    wal = copy / "index.sqlite-wal"
    assert wal.stat().st_size > 32
    _flip(wal, 32 + 24 + 200)  # a byte in the first frame's page: that frame and all after fail
    shm = copy / "index.sqlite-shm"
    if shm.exists():
        shm.write_bytes(os.urandom(shm.stat().st_size))
    with kvstore.open(copy, chunk_size=C, memory_bytes=0) as s:
        mc = s.bind(model, model_path)
        for p in early + late:
            query = p + [9]
            cache, rest = mc.fetch(query)
            assert logits_diff(model, cache, rest, query) <= TOL
        for p in early:
            assert mc.stored_length(p) == len(p)
        assert {p.kind for p in s.verify()} <= {"orphan_file"}
    twin = tmp_path / "twin"
    shutil.copytree(copy, twin)
    # The rows the WAL lost are still in their blobs: a rebuild brings them back.
    rebuild_index(copy)
    _assert_restores(copy, llama, early + late)
    with kvstore.open(copy, chunk_size=C) as s:
        assert s.verify() == []
    # And so does `verify --repair` on the index as it is: it took them back, where it deleted
    # them as orphans (all of them in a store with few files, below its guard against a lost index).
    with kvstore.open(twin, chunk_size=C) as s:
        found = s.verify(repair=True)
        assert found and all(p.kind == "orphan_file" and p.detail.endswith("taken back (a whole record: its row is "
                                                                           "written again)") for p in found), found
        assert s.verify() == []
    _assert_restores(twin, llama, early + late)


def test_rebuild_skips_blobs_that_do_not_agree_with_their_name(tmp_path, llama):
    model_path, model = llama
    ps = prompts(12, 3, C)
    store = _stored(tmp_path, llama, ps)
    with kvstore.open(store, chunk_size=C) as s:
        rows = sorted(s.index.rows(), key=lambda r: (r.depth, r.hash))
        root = s.blob_root
    # A copy of a real blob under another valid-looking name, and a damaged one.
    a, b = blobtree.blob_path(root, rows[0].hash), blobtree.blob_path(root, rows[-1].hash)
    fake = blobtree.blob_path(root, bytes.fromhex("ee" * 16))
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_bytes(a.read_bytes())
    _flip(b, _header_end(b) - 3)  # inside the header JSON
    nested = blobtree.blob_path(root, bytes.fromhex("dd" * 16))  # a header no JSON parser can nest
    nested.parent.mkdir(parents=True, exist_ok=True)
    deep = b"[" * 100_000 + b"]" * 100_000
    nested.write_bytes(struct.pack("<Q", len(deep)) + deep)
    (store / "index.sqlite").unlink()
    result = rebuild_index(store)
    reasons = {Path(s["path"]).name: s["reason"] for s in result["skipped"]}
    assert set(reasons) == {fake.name, b.name, nested.name}, reasons
    with kvstore.open(store, chunk_size=C) as s:
        kinds = sorted(p.kind for p in s.verify())
        # None of the three names its own hash in a readable header: all moved aside, none deleted.
        assert kinds == ["foreign_file"] * 3, kinds
        s.verify(repair=True)
        assert s.verify() == []
    _assert_restores(store, llama, ps, expect_full=False)


@pytest.mark.parametrize("how", ["garbage", "lost", "table-dropped"])
def test_kvstore_verify_repair_rebuilds_an_unreadable_index(tmp_path, llama, how):
    try:
        import kvstore.cli.main  # noqa: F401
    except ImportError:
        pytest.skip("the kvstore command line is not there yet")
    ps = prompts(13, 4, C)
    store = _stored(tmp_path, llama, ps, pin=True)
    db = store / "index.sqlite"
    if how == "garbage":
        db.write_bytes(b"this is not a database" * 200)
    elif how == "lost":
        db.unlink()
    else:  # a valid SQLite file that is no longer a whole index: its records can still be read
        with sqlite3.connect(db) as con:
            con.execute("DROP TABLE meta")
        con.close()

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--store", str(store)],
                              capture_output=True, text=True, timeout=300)

    out = cli("stats")
    assert out.returncode == 1 and "verify --repair" in out.stderr and "Traceback" not in out.stderr
    out = cli("verify")
    assert out.returncode == 1 and "verify --repair" in out.stderr and "Traceback" not in out.stderr
    out = cli("verify", "--repair")
    assert out.returncode == 1 and "rebuilt the index" in out.stderr, out.stderr
    # What it prints agrees with its exit code: a problem, repaired; not "clean".
    assert "1 problem found (the index could not be read" in out.stdout and "is clean" not in out.stdout, out.stdout
    out = cli("verify")
    assert out.returncode == 0 and "clean" in out.stdout, (out.stdout, out.stderr)
    _assert_restores(store, llama, ps)
    with kvstore.open(store, chunk_size=C) as s:  # pins come back: from the old index, else the pins file
        rows = list(s.index.rows())
        assert rows and all(r.pinned for r in rows)


def test_a_rebuild_that_fails_half_way_can_be_run_again(tmp_path, llama, monkeypatch):
    import kvstore.upkeep.rebuild as rebuild

    ps = prompts(14, 3, C)
    store = _stored(tmp_path, llama, ps, pin=True)
    with sqlite3.connect(store / "index.sqlite") as con:
        con.execute("DROP TABLE meta")  # readable, but not an index kvstore can use
    con.close()

    def crash(*args):
        raise OSError("the machine went down here")

    monkeypatch.setattr(rebuild, "_write", crash)
    with pytest.raises(OSError):
        rebuild.rebuild_index(store)
    monkeypatch.undo()
    with pytest.raises(CorruptIndexError):  # no index: still an error, never an empty new one
        kvstore.open(store, chunk_size=C)
    result = rebuild.rebuild_index(store)
    assert result["records"] > 0 and result["salvaged"] == result["records"]  # from the first aside
    with kvstore.open(store, chunk_size=C) as s:
        assert all(r.pinned for r in s.index.rows()) and s.verify() == []
    _assert_restores(store, llama, ps)
