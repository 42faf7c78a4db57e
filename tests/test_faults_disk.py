"""Fault suite, part 4: a full disk.

A store on a tmpfs of 8 MB that the test mounts (we may be root; otherwise that case is skipped)
and fills, and the same through the `enospc` fault point: writes are dropped and counted, never
raised; reads, fetches and a fresh bind go on; nothing partial is left; once there is space again,
writes resume and what they store restores exactly.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from faultproc import prompts
from kvtest import logits_diff, prefill

import kvstore
from kvstore import faults
from kvstore.storage import blobtree

C = 16
TOL = 1e-4


class TmpfsFull:
    """An 8 MB tmpfs; `fill()` takes every free byte with a filler file, `free()` gives it back."""

    def __init__(self, mount: Path):
        self.mount, self.filler = mount, mount / "filler"

    def fill(self) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 16, 4096, 512, 64, 8, 1):  # down to the last byte
                while True:
                    try:
                        os.write(fd, b"\0" * size)
                    except OSError as e:
                        assert e.errno == errno.ENOSPC
                        break
        finally:
            os.close(fd)

    def free(self) -> None:
        self.filler.unlink()


class InjectedFull:
    """The `enospc` fault at every blob write (kvstore/faults.py), for when no tmpfs can be made."""

    def __init__(self, mount: Path):
        self.mount = mount

    def fill(self) -> None:
        faults.arm("blob_write", "enospc")

    def free(self) -> None:
        faults.disarm()


@pytest.fixture(params=["tmpfs", "injected"])
def full_disk(request, tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    if request.param == "injected":
        try:
            yield InjectedFull(mount)
        finally:
            faults.disarm()
        return
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); the injected case covers it")
    try:
        yield TmpfsFull(mount)
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_full_disk_drops_and_counts_writes_and_serving_goes_on(llama, full_disk):
    model_path, model = llama
    store_dir = full_disk.mount / "s"
    kept, later = prompts(40, 3, C), prompts(41, 6, C)
    with kvstore.open(store_dir, chunk_size=C) as store:
        mc = store.bind(model, model_path)
        for p in kept:
            mc.insert(p, prefill(model, p))
        store.flush()
        assert store.stats()["writer"]["write_errors"] == 0
        before = store.stats()

        full_disk.fill()
        for p in later:
            mc.insert(p, prefill(model, p))  # never raises
        store.flush()
        w = store.stats()["writer"]
        assert w["write_errors"] >= 1, w
        assert "No space left" in w["last_error"] or "full" in w["last_error"], w
        # Serving goes on: from this store, and from a store opened (and bound) on the full disk.
        for p in kept:
            query = p + [3]
            cache, rest = mc.fetch(query)
            assert rest == [3] and logits_diff(model, cache, rest, query) <= TOL
        with kvstore.open(store_dir, chunk_size=C, memory_bytes=0) as reader:
            rmc = reader.bind(model, model_path)
            for p in kept:
                query = p + [3]
                cache, rest = rmc.fetch(query)
                assert rest == [3] and logits_diff(model, cache, rest, query) <= TOL
                assert reader.stats()["quarantined"] == 0
            if isinstance(full_disk, TmpfsFull):  # the index could not even record the model
                assert not rmc.registered
                assert rmc.insert(later[0], prefill(model, later[0])) == 0
                assert reader.stats()["skipped_inserts"] == 1
        # Nothing partial: no temporary file, no row without its complete blob.
        assert [p for p in blobtree.walk(store.blob_root) if p.name.startswith(blobtree.TMP_PREFIX)] == []
        assert store.verify() == []

        full_disk.free()
        for p in later:
            mc.insert(p, prefill(model, p))
        store.flush()
        assert store.stats()["writer"]["records_written"] > before["writer"]["records_written"]
        assert store.verify() == []
    with kvstore.open(store_dir, chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        for p in kept + later:  # writes resumed: everything is stored and restores exactly
            query = p + [3]
            cache, rest = mc.fetch(query)
            assert rest == [3] and logits_diff(model, cache, rest, query) <= TOL
        assert store.verify() == []


def test_a_store_no_process_holds_open_opens_read_only_on_a_full_disk(llama, full_disk, caplog):
    """SQLite cannot make the index's -wal and -shm on a full disk: a store that no process has
    open then opens read-only (said), restores as before and stores nothing; once space is freed,
    it opens to write again. (It would not open at all: stats, verify and serving stopped.)"""
    if not isinstance(full_disk, TmpfsFull):
        pytest.skip("needs a real full disk")
    model_path, model = llama
    store_dir = full_disk.mount / "s"
    kept = prompts(42, 2, C)
    with kvstore.open(store_dir, chunk_size=C) as store:
        mc = store.bind(model, model_path)
        for p in kept:
            mc.insert(p, prefill(model, p))
    full_disk.fill()
    with caplog.at_level("WARNING", logger="kvstore"), kvstore.open(store_dir, chunk_size=C, memory_bytes=0) as s:
        assert s.read_only and "is full" in caplog.text and "open read-only" in caplog.text
        mc = s.bind(model, model_path)
        for p in kept:
            query = p + [3]
            cache, rest = mc.fetch(query)
            assert rest == [3] and logits_diff(model, cache, rest, query) <= TOL
        assert s.stats()["chunks"] > 0 and s.verify() == []
    full_disk.free()
    with kvstore.open(store_dir, chunk_size=C) as s:
        assert not s.read_only


def test_a_pack_import_that_fills_the_disk_says_what_it_stored_and_leaves_no_orphan(tmp_path, demo_model):
    """The disk fills part way through `kvstore pack import` (the index's insert of its third
    record fails): the command says which records stayed and which were not imported, exits 1,
    leaves no blob without its row, and the import run again stores only the rest."""
    import re

    from kvtest import run_cli
    model = demo_model("llama")
    pack, store = tmp_path / "pack", tmp_path / "b"
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", "Notes on the build: " * 30,
            "--unsigned", "--out", pack)
    faults.arm("in_transaction", "enospc", 3)
    try:
        cut = run_cli("pack", "import", pack, "--store", store, "--model", model, check=False)
    finally:
        faults.disarm()
    assert cut.returncode == 1 and "Traceback" not in cut.stderr, cut.stderr
    said = re.search(r"the import stopped at record (\d+) of (\d+) \(No space left on device \(injected at "
                     r"in_transaction\)\): the (\d+) stored before it \(.+\) stays?, pinned, the other (\d+) (?:is|are) "
                     r"not imported; free some space", cut.stderr)
    assert said, cut.stderr
    at, total, kept, rest = map(int, said.groups())
    assert kept == at - 1 >= 1 and kept + rest == total
    with kvstore.open(store) as s:
        assert len(list(s.index.rows())) == kept and len(s.index.pinned()) == kept
        assert s.verify() == []  # the blob of the record whose row failed is gone with it
    again = run_cli("pack", "import", pack, "--store", store, "--model", model)
    assert re.search(rf"; {rest} records? stored on disk \(.+\), {kept} (?:was|were) stored already", again.stdout)
    with kvstore.open(store) as s:
        assert s.verify() == [] and len(list(s.index.rows())) == total


def test_a_full_disk_is_said_once_not_once_per_failed_write(tmp_path, llama, caplog):
    """Every write fails on a full disk: each is counted, but the log says it once (a server's log,
    or `kvstore warm`'s stderr, is not flooded with a line per record); the next time it is said,
    it says how many went unsaid."""
    import logging

    from kvstore.write import jobs
    model_path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        faults.arm("blob_write", "enospc")
        try:
            with caplog.at_level(logging.WARNING, logger="kvstore"):
                for p in prompts(42, 5, C):
                    mc.insert(p, prefill(model, p))
                store.flush()
                failed = store.stats()["writer"]["write_errors"]
                assert failed >= 5
                said = [r.getMessage() for r in caplog.records if "a write was dropped" in r.getMessage()]
                assert len(said) == 1 and "No space left on device" in said[0], said
                with pytest.MonkeyPatch.context() as mp:  # the quiet time is over: said again, with the count
                    mp.setattr(jobs, "ERROR_QUIET_S", 0.0)
                    mc.insert(prompts(43, 1, C)[0], prefill(model, prompts(43, 1, C)[0]))
                    store.flush()
        finally:
            faults.disarm()
        said = [r.getMessage() for r in caplog.records if "a write was dropped" in r.getMessage()]
        assert f"; {failed - 1} more like it since it was last said" in said[1], said


def test_what_a_failed_write_left_out_is_said_in_tokens(tmp_path, llama, caplog):
    """`kvstore serve` logs a request's cache as "N queued for disk"; when a write fails, the
    writer's line says how many of those tokens were not stored, and whether RAM holds them: with
    a memory tier they stay there (as on a server with no store at all) and are served, and the
    next insert of the prompt writes them once the disk takes them; without one they are lost."""
    import logging

    model_path, model = llama
    first, second = prompts(44, 2, C)
    for memory in (None, 0):
        opts = {} if memory is None else {"memory_bytes": 0}
        caplog.clear()
        with kvstore.open(tmp_path / f"s{memory}", chunk_size=C, **opts) as store:
            mc = store.bind(model, model_path)
            faults.arm("blob_write", "enospc")
            try:
                with caplog.at_level(logging.WARNING, logger="kvstore"):
                    for p in (first, second):
                        mc.insert(p, prefill(model, p))
                        store.flush()
            finally:
                faults.disarm()
            said = "stay in RAM only, not written" if memory is None else "not stored (neither on disk nor in RAM)"
            lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
            assert len(lines) == 2, [r.getMessage() for r in caplog.records]
            for p, line in zip((first, second), lines):
                assert line.startswith(f"kvstore: {len(p)} tokens "), line
                assert "OSError: [Errno 28] No space left on device" in line, line
                cache, served = mc.fetch(p + [3])
                if memory is None:  # from RAM, and exactly
                    assert served == [3] and logits_diff(model, cache, served, p + [3]) <= TOL
                else:
                    assert served == p + [3]  # nothing of it is served
            assert store.stats()["writer"]["records_written"] == 0
            mc.insert(first, prefill(model, first))  # the disk takes it now
            store.flush()
        with kvstore.open(tmp_path / f"s{memory}", chunk_size=C, **opts) as store:  # a new process
            mc = store.bind(model, model_path)
            assert mc.fetch(first + [3])[1] == [3]
            assert mc.fetch(second + [3])[1] == second[len(os.path.commonprefix([first, second])) // C * C:] + [3]


def test_a_write_that_cannot_reach_the_store_says_what_it_left_out(tmp_path, llama, caplog):
    """The store's folder removed under a running process: the write fails before any record is
    placed (the store's lock), and the same line says the job's tokens were not stored."""
    import logging
    import shutil

    model_path, model = llama
    first, second = prompts(45, 2, C)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_path)
        mc.insert(first, prefill(model, first))
        store.flush()
        shutil.rmtree(tmp_path / "s")
        with caplog.at_level(logging.WARNING, logger="kvstore"):
            mc.insert(second, prefill(model, second))
            store.flush()
        assert store.stats()["writer"]["write_errors"] >= 1
    lost = [r.getMessage() for r in caplog.records if "not stored" in r.getMessage()]
    shared = len(os.path.commonprefix([first, second])) // C * C  # the system prompt's chunks, stored before
    assert len(lost) == 1 and lost[0].startswith(f"kvstore: {len(second) - shared} tokens up to record "), lost
    assert "(neither on disk nor in RAM): a write failed (FileNotFoundError: " in lost[0], lost


def test_a_batch_the_index_cannot_take_whole_stores_the_start_of_its_chain(tmp_path, llama, monkeypatch):
    """When the disk fills under a batch's commit (its files took the room the index needed:
    SQLite's "database or disk is full", injected here for batches of more than 2 rows), the
    writer stores the longest first part of the chain it can and removes the rest's files, instead
    of nothing; what it stored restores exactly in a fresh store, and verify finds nothing left."""
    import sqlite3

    from kvstore.storage.index import Index

    model_path, model = llama
    real = Index.insert

    def insert(self, rows, owners=None):
        rows = list(rows)
        if len(rows) > 2:
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, rows, owners)

    tokens = [1 + (i * 7) % 250 for i in range(6 * C + 5)]  # 6 chunks and a tail: 7 rows
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        monkeypatch.setattr(Index, "insert", insert)
        mc.insert(tokens, prefill(model, tokens))
        store.flush()
        monkeypatch.setattr(Index, "insert", real)
        assert mc.stored_length(tokens) == C  # 7 rows, then the first 3, then the first 1
        w = store.stats()["writer"]
        assert w["records_written"] == 1 and w["write_errors"] == 1 and "full" in w["last_error"], w
        assert store.verify() == []  # no file of a row that did not go in
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_path)
        query = tokens[:C] + [3]
        cache, rest = mc.fetch(query)
        assert rest == [3] and logits_diff(model, cache, rest, query) <= TOL


def test_a_store_made_on_a_full_disk_says_the_disk_is_full_and_works_once_freed(tmp_path, demo_model, full_disk):
    """The disk fills while a new store's index is made (SQLite left a file with no tables yet):
    every command says the disk is full and to free space, not that the index has "an older
    schema" to open with `verify --repair` (which cannot help); once space is freed, warm makes
    the store as if nothing happened."""
    if not isinstance(full_disk, TmpfsFull):
        pytest.skip("needs a real full disk")
    from kvtest import run_cli
    model, store = demo_model("llama"), full_disk.mount / "s"
    prompts_file = tmp_path / "p.jsonl"
    prompts_file.write_text('{"prompt": "A prompt for a full disk."}\n')
    full_disk.fill()
    for args in (["warm", "--prompts", prompts_file, "--model", model], ["verify"], ["stats"]):
        ran = run_cli(*args, "--store", store, check=False)
        assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
        assert f"the disk of the store {store} is full" in ran.stderr and "until space is freed" in ran.stderr
        assert "older schema" not in ran.stderr and "verify --repair" not in ran.stderr, ran.stderr
    full_disk.free()
    warmed = run_cli("warm", "--prompts", prompts_file, "--model", model, "--store", store)
    assert "on disk: 1 of 1 warmed prompts whole" in warmed.stdout, warmed.stdout
    assert run_cli("verify", "--store", store).returncode == 0
