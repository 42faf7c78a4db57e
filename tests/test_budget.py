"""`max_bytes="auto"`: a disk budget from the free space of the store's disk."""

from __future__ import annotations

import json
import re
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
        more = list(range(150, 250))
        store.bind(model, path).insert(more, prefill(model, more))
        store.flush()
        assert 0 < store.stats()["bytes"] <= budget


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs of its own (skipped where none can be mounted): its free space is the
    test's to take, whatever else the machine's disks do."""
    import subprocess

    mount = tmp_path / "mnt"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_an_auto_budget_shrinks_when_other_files_fill_the_disk_while_the_store_is_open(small_disk, llama,
                                                                                        monkeypatch, caplog):
    """The budget is derived again as writes are checked against it (here at every check: the
    interval is set to 0, so nothing waits on a clock): another process's file that takes most of
    the free space brings it down, and the next write evicts down to the new budget."""
    monkeypatch.setattr("kvstore.tiers.disk.AUTO_EVERY_S", 0.0)
    path, model = llama
    with kvstore.open(small_disk / "s", chunk_size=16, max_bytes="auto") as store:
        mc = store.bind(model, path)
        for first_token in (1, 2, 3):  # three prompts that share nothing
            tokens = [first_token] + list(range(100, 219))
            mc.insert(tokens, prefill(model, tokens))
        store.flush()
        first, held = store.stats()["max_bytes"], store.stats()["bytes"]
        assert held > 0 and first > 10 * held  # (about 16 MiB: 64 MiB free / 4)
        # Another process's file takes the disk down to about what the store holds free.
        filler = shutil.disk_usage(small_disk).free - held
        with open(small_disk / "other-file", "wb") as f:
            f.truncate(0)
            f.write(b"\0" * filler)
        more = [4] + list(range(100, 219))
        with caplog.at_level("WARNING", logger="kvstore"):
            mc.insert(more, prefill(model, more))
            store.flush()
            store.backing.budget.settle()
        stats = store.stats()
    assert stats["max_bytes"] < held < first, (stats["max_bytes"], held, first)
    assert 0 < stats["bytes"] <= stats["max_bytes"]
    assert "free on the store's disk at " in stats["max_bytes_rule"] and "at open" not in stats["max_bytes_rule"]
    assert any("the automatic disk budget is now" in r.getMessage() for r in caplog.records)


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


def test_the_disk_budget_runs_one_gc_at_a_time_for_batches_and_downloads_alike(tmp_path, llama):
    # One object, one trigger: the writer's batches and the disk tier's downloads both call
    # `DiskBudget.check`; checks that come while a gc runs make it run once more, never twice at once.
    import threading

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=16, max_bytes=10**12) as store:
        budget = store.disk.budget
        assert budget is not None and budget.check in store.writer.on_commit
        mc = store.bind(model, path)
        first = list(range(1, 100))
        mc.insert(first, prefill(model, first))
        assert store.flush(60) and store.stats()["bytes"] > 0
        running, most, runs, release = [0], [0], [0], threading.Event()
        real = store.files.gc

        def gc(**kw):
            running[0] += 1
            most[0] = max(most[0], running[0])
            runs[0] += 1
            release.wait(30)
            try:
                return real(**kw)
            finally:
                running[0] -= 1

        store.files.gc = gc
        budget.max_bytes = 0  # over budget from now on: every check evicts everything
        for _ in range(20):
            budget.check()  # from the writer's thread, or a download's: the same call
        threads = [threading.Thread(target=budget.check) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        release.set()
        assert budget.settle(60)
        assert most[0] == 1 and 1 <= runs[0] <= 2  # the one running, then once more for the rest
        assert store.stats()["bytes"] == 0
        more = list(range(150, 250))
        before = runs[0]
        mc.insert(more, prefill(model, more))
        assert store.flush(60)  # flush lets the budget settle: the batch's check has run
        assert store.stats()["bytes"] == 0 and runs[0] > before


def test_the_budgets_checks_leave_no_open_files_behind(tmp_path, llama):
    """Each check of the disk budget runs on a thread of its own, which used the index through a
    connection of its own: kept open with the store, two files a check, until a server that had
    stored a few hundred prompts could open no more (`Too many open files`)."""
    import os

    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=16, max_bytes="1GB") as store:
        mc = store.bind(model, path)
        mc.insert(list(range(1, 40)), prefill(model, list(range(1, 40))))
        store.flush()
        before = len(os.listdir("/proc/self/fd"))
        for i in range(40):
            tokens = [i + 1] + list(range(2, 40))
            mc.insert(tokens, prefill(model, tokens))
            store.flush()  # each batch is checked against the budget, on a thread that then ends
        assert len(os.listdir("/proc/self/fd")) - before < 10


def test_a_budget_smaller_than_one_record_says_so_once(tmp_path, llama, caplog):
    """A disk with a few MB free gives an automatic budget below one record: each record written
    is evicted again at once, and that is said (once) when the model is bound, not left to be
    found out, nor said only at a first write."""
    path, model = llama
    with caplog.at_level("WARNING", logger="kvstore"), kvstore.open(tmp_path / "s", chunk_size=16,
                                                                    max_bytes=1000) as store:
        mc = store.bind(model, path)
        said = [r.getMessage() for r in caplog.records if "more than the disk budget" in r.getMessage()]
        per_token = mc.check.bound().per_token
        assert said == [f"kvstore: a chunk (16 tokens) of this model takes about {16 * per_token} bytes on disk, "
                        f"more than the disk budget (max_bytes 1000): no prompt of it can stay on disk; raise the "
                        "budget"]  # (below one token's bytes: it said "longer than about 0 tokens")
        assert 1000 // per_token == 0
        for start in (1, 200):
            tokens = list(range(start, start + 40))
            mc.insert(tokens, prefill(model, tokens))
            store.flush()
            store.backing.budget.settle()
        assert store.stats()["bytes"] <= 1000
    said = [r.getMessage() for r in caplog.records if "than the disk budget" in r.getMessage()]
    assert len(said) == 1, said


def test_records_the_budget_evicts_as_soon_as_written_are_counted_and_said_once(tmp_path, llama, caplog):
    """A budget that pinned records nearly fill: every other prompt's records are evicted by the
    gc their own write called, a write wasted each time. Said once (with what to do), counted,
    and `kvstore warm`'s budget line says how many; a budget with room wastes none."""
    from kvstore.cli.output import disk_budget

    path, model = llama
    pinned = list(range(1, 101))
    with kvstore.open(tmp_path / "sized", chunk_size=16) as store:
        mc = store.bind(model, path)
        mc.insert(pinned, prefill(model, pinned), pin=True)
        store.flush()
        held = store.stats()["bytes"]
    for budget, wasted in ((held + held // 10, True), (held * 3, False)):
        caplog.clear()
        shutil.rmtree(tmp_path / "s", ignore_errors=True)
        with caplog.at_level("WARNING", logger="kvstore"), \
                kvstore.open(tmp_path / "s", chunk_size=16, max_bytes=budget) as store:
            mc = store.bind(model, path)
            mc.insert(pinned, prefill(model, pinned), pin=True)
            for start in (120, 200):
                tokens = list(range(start, start + 40))
                mc.insert(tokens, prefill(model, tokens))
                store.flush()
                store.backing.budget.settle()
            said = [r.getMessage() for r in caplog.records if "as soon as" in r.getMessage()]
            counted = store.backing.budget.wasted_records
            line = disk_budget(store)
            again = None
            if wasted:  # the same prompt again at once: not written again, to be evicted again
                before = store.stats()["writer"]["records_written"]
                mc.insert(tokens, prefill(model, tokens))
                store.flush()
                store.backing.budget.settle()
                again = store.stats()["writer"]["records_written"] - before
                assert mc.placement(tokens).text() == "0 on disk, 40 not stored (evicted since written)"
                longer = tokens + list(range(5, 25))  # what hangs below them is not written either
                mc.insert(longer, prefill(model, longer))
                store.flush()
                again = store.stats()["writer"]["records_written"] - before
                assert mc.placement(longer).text() == ("0 on disk, 60 not stored (evicted since written: 32, not "
                                                       "written, below an evicted record: 28)")
        if wasted:
            assert counted >= 4 and len(said) == 1 and "raise the budget, or unpin" in said[0], said
            assert f", {counted} of them as soon as written" in line, line
            assert again == 0  # (it wrote them, and the gc evicted them, once more each time)
            assert store.backing.budget.wasted_records == counted
        else:
            assert counted == 0 and said == [] and "nothing evicted" in line, line


def test_a_store_opened_past_its_budget_is_brought_within_it_without_a_write(tmp_path, llama):
    path, model = llama
    with kvstore.open(tmp_path / "s", chunk_size=16) as store:
        for start in (1, 70, 140):
            tokens = list(range(start, start + 100))
            store.bind(model, path).insert(tokens, prefill(model, tokens))
        store.flush()
        held = store.stats()["bytes"]
    with kvstore.open(tmp_path / "s", chunk_size=16, max_bytes=held // 2) as store:
        store.backing.budget.settle()  # (its gc runs on a thread of its own)
        assert 0 < store.stats()["bytes"] <= held // 2
        assert store.backing.budget.evicted_bytes >= held - held // 2
        assert store.backing.budget.evicted_records > 0


def test_warm_says_what_its_budget_came_to_and_evicted(tmp_path, demo_model_path):
    from kvtest import run_cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{word} " * 100}) + "\n" for word in ("alpha", "bravo", "charlie")))
    store = tmp_path / "s"
    first = run_cli("warm", "--store", store, "--model", demo_model_path, "--prompts", prompts,
                    "--store-max-bytes", "auto")
    assert re.search(r"^disk budget: .* held of .* \(auto: 1/4 of what the store held plus its disk's free "
                     r"space at open\); nothing evicted$", first.stdout, re.M), first.stdout
    held = kvstore.open(store, read_only=True).stats()["bytes"]
    second = run_cli("warm", "--store", store, "--model", demo_model_path, "--prompts", prompts,
                     "--store-max-bytes", f"{held // 3}B")
    line = re.search(r"^disk budget: (.*) held of (.*); its gc evicted (\d+) records? \((.*)\) to stay within it"
                     r"(, \d+ of them as soon as written \(their writes wasted: what it holds is kept ahead of them\))?$",
                     second.stdout, re.M)
    assert line, second.stdout
    assert int(line.group(3)) > 0
    assert kvstore.open(store, read_only=True).stats()["bytes"] <= held // 3
