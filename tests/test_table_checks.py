"""The store's own tables as damage leaves them: every reader checks its rows, and a damaged one
never turns a limit off. A bad `role` is the weakest (gc still holds its byte budget), a bad
`write_log` hour is a full budget until it leaves the window (the write budget still holds, and
comes back after), a bad seen mark is not seen, and a bad kept setting reads as its default (or,
for the write budget, as 0) with one warning: the store always opens. `verify` reports each and
`verify --repair` rewrites it.

Every test breaks a real store on purpose (SQL written by hand into its index) and uses the
real store, `kvstore gc` and `kvstore verify`.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
from kvtest import prefill

import kvstore
from kvstore.cli.main import main
from kvstore.storage.index import MENDABLE
from kvstore.storage.writesql import HOUR_S, hour_of
from kvstore.upkeep.rows import MENDED

C = 16


def prompt(i: int) -> list[int]:
    return [1 + (i * 7 + j) % 250 for j in range(64)]  # 4 chunks, no prefix shared with another


def sql(store: Path, statement: str, rows=((),)) -> list:
    """Run `statement` once per parameter row of `rows`; what the last one returned."""
    con = sqlite3.connect(store / "index.sqlite")
    try:
        with con:
            out = []
            for params in rows:
                out = con.execute(statement, params).fetchall()
            return out
    finally:
        con.close()


def fill(store: Path, llama, n: int = 4, **kw) -> list[list]:
    """A store holding prompts 0..n-1; the rows each prompt added."""
    path, model = llama
    added, seen = [], set()
    with kvstore.open(store, chunk_size=C, **kw) as s:
        mc = s.bind(model, path)
        for i in range(n):
            mc.insert(prompt(i), prefill(model, prompt(i)))
            s.flush()
            rows = [r for r in s.index.rows() if r.hash not in seen]
            seen |= {r.hash for r in rows}
            added.append(rows)
    return added


def verify(store: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["verify", "--store", str(store), *extra])
    return code, capsys.readouterr().out


def repaired(store: Path, capsys, kind: str) -> None:
    """`verify` reports `kind`, `--repair` fixes it, and `verify` is clean afterwards."""
    code, out = verify(store, capsys)
    assert code == 1 and f"{kind}:" in out, out
    code, out = verify(store, capsys, "--repair")
    assert f"{kind}:" in out, out
    code, out = verify(store, capsys)
    assert code == 0, out


@pytest.mark.parametrize("role", ["'system'", "7", "-1", "1.5"])
def test_a_damaged_role_is_the_weakest_so_gc_holds_its_byte_budget(tmp_path, llama, capsys, role):
    store = tmp_path / "s"
    added = fill(store, llama)
    victim = {r.hash for r in added[0]}
    held = sum(r.size for rows in added for r in rows)
    budget = held - sum(r.size for r in added[0])
    # The others are system prompts, and the damaged prompt the one used last: only a damaged
    # role read as the weakest makes it go first.
    sql(store, "UPDATE records SET role = 2")
    sql(store, f"UPDATE records SET role = {role}, last_access = last_access + 1000 WHERE hash = ?",
        [(h,) for h in victim])
    code, out = verify(store, capsys)
    assert code == 1 and out.count("bad_role:") == len(victim), out

    assert main(["gc", "--store", str(store), "--max-bytes", f"{budget}B"]) == 0
    with kvstore.open(store, chunk_size=C) as s:
        left = {r.hash for r in s.index.rows()}
        assert s.stats()["bytes"] <= budget
    assert not victim & left and len(left) == sum(len(rows) for rows in added[1:])

    other = tmp_path / "t"
    fill(other, llama, 1)
    sql(other, f"UPDATE records SET role = {role}")
    repaired(other, capsys, "bad_role")
    assert sql(other, "SELECT DISTINCT role, typeof(role) FROM records") == [(0, "integer")]


def one_prompt_bytes(tmp_path: Path, llama) -> int:
    return sum(r.size for r in fill(tmp_path / "one", llama, 1)[0])


@pytest.mark.parametrize("value", ["-1000000000000", "'many'", "2.5", "1 << 55"])
def test_a_damaged_write_log_hour_keeps_the_budget_closed_and_repair_keeps_it_so(tmp_path, llama, capsys, value):
    path, model = llama
    limit = int(2.5 * one_prompt_bytes(tmp_path, llama))
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C, max_write_rate=limit):
        pass
    hour = hour_of(time.time())
    sql(store, f"INSERT INTO write_log (hour, bytes) VALUES (?, {value})", [(hour - 1,)])
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, path)
        for i in range(6):
            mc.insert(prompt(i), prefill(model, prompt(i)))
        s.flush()
        writes = s.stats()["writes"]
        assert s.stats()["bytes"] == 0 and writes["over_budget"] > 0, writes
        assert writes["budget_left"] == 0
    repaired(store, capsys, "bad_write_log")
    # The hour is still in the window: repaired, it still closes the budget, but no bytes are
    # logged that were never written (the lifetime counter is an SSD's written-bytes counter).
    assert sql(store, "SELECT bytes FROM write_log WHERE hour = ?", [(hour - 1,)]) == [(0,)]
    with kvstore.open(store, chunk_size=C) as s:
        writes = s.stats()["writes"]
        assert writes["budget_left"] == 0
        assert writes["bytes_lifetime"] == writes["bytes_last_day"] == 0, writes
        mc = s.bind(model, path)
        mc.insert(prompt(7), prefill(model, prompt(7)))
        s.flush()
        assert s.stats()["bytes"] == 0
    # `kvstore stats` says why nothing is left of a budget nothing was written under
    capsys.readouterr()
    assert main(["stats", "--store", str(store)]) == 0
    said = capsys.readouterr().out
    assert "0 B left (an hour of the write log was damaged: it counts as the whole budget" in said, said


def test_a_damaged_write_log_count_the_budget_does_not_read_leaves_it_open(tmp_path, llama, capsys):
    """A bad `records`, `explicit` or `over_budget` value is said for what it does (stats leaves
    it out), not as a closed budget, and repair sets it to 0 and closes nothing."""
    path, model = llama
    limit = int(2.5 * one_prompt_bytes(tmp_path, llama))
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C, max_write_rate=limit):
        pass
    hour = hour_of(time.time())
    sql(store, "INSERT INTO write_log (hour, bytes, records, explicit, over_budget) VALUES (?, 10, -1, 'x', 2.5)",
        [(hour - 2,)])
    code, out = verify(store, capsys)
    lines = [line for line in out.splitlines() if line.startswith("bad_write_log:")]
    assert code == 1 and len(lines) == 3, out
    for line in lines:
        assert "stats leaves it out of its counts (the budget does not read it); repair sets it to 0" in line, line
        assert "whole budget" not in line and "closed" not in line, line
    verify(store, capsys, "--repair")
    assert verify(store, capsys)[0] == 0
    assert sql(store, "SELECT bytes, records, explicit, over_budget FROM write_log") == [(10, 0, 0, 0)]
    with kvstore.open(store, chunk_size=C) as s:
        assert s.stats()["writes"]["budget_left"] == limit - 10
        s.bind(model, path).insert(prompt(0), prefill(model, prompt(0)))
        s.flush()
        assert s.stats()["bytes"] > 0


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("value", ["-1000000000000", "'many'", "2.5"])
def test_a_damaged_write_log_hour_closes_the_budget_only_while_it_is_in_the_window(tmp_path, llama, value):
    path, model = llama
    limit = int(2.5 * one_prompt_bytes(tmp_path, llama))
    store = tmp_path / "s"
    clock = Clock(hour_of(time.time()) * HOUR_S + 60.0)
    with kvstore.open(store, chunk_size=C, max_write_rate=limit):
        pass
    sql(store, f"INSERT INTO write_log (hour, bytes) VALUES (?, {value})", [(hour_of(clock.t),)])
    with kvstore.open(store, chunk_size=C) as s:
        s.gate.use_clock(clock)
        mc = s.bind(model, path)
        for i, step in enumerate((0, 24 * HOUR_S, HOUR_S)):  # now, 24 hours on, 25 hours on
            clock.t += step
            mc.insert(prompt(i), prefill(model, prompt(i)))
            s.flush()
            if i < 2:
                assert s.stats()["bytes"] == 0, f"written {step} s on"
        assert 0 < s.stats()["bytes"] <= limit  # the hour left the window: the budget is whole again


def test_a_damaged_seen_mark_is_not_seen(tmp_path, llama):
    """Under admit="reused" a record is written once its key is seen again; a mark whose
    `reused` is not 0 or 1 is no sight at all."""
    path, model = llama
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C, admit="reused") as s:
        s.bind(model, path).insert(prompt(0), prefill(model, prompt(0)))
        s.flush()
    assert sql(store, "SELECT count(*) FROM seen_prefixes")[0][0] > 0
    sql(store, "UPDATE seen_prefixes SET reused = 'yes'")
    with kvstore.open(store, chunk_size=C) as s:
        s.bind(model, path).insert(prompt(0), prefill(model, prompt(0)))
        s.flush()
        assert s.stats()["bytes"] == 0
    code = main(["verify", "--store", str(store)])
    assert code == 1
    assert main(["verify", "--store", str(store), "--repair"]) == 1
    assert main(["verify", "--store", str(store)]) == 0
    assert sql(store, "SELECT count(*) FROM seen_prefixes")[0][0] == 0


@pytest.mark.parametrize("name,value", [("admit", "'bogus'"), ("admit", "x'00'"), ("disk_kv_bits", "'eight'"),
                                        ("max_write_rate", "'fast'")])
def test_a_damaged_kept_setting_opens_the_store_with_one_warning(tmp_path, llama, capsys, caplog, name, value):
    """With no right copy of it beside the index (index.settings): a limit fails closed, the others
    read as their defaults; the next test reads them from the copy."""
    path, model = llama
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C, admit="reused", max_write_rate="1GB/day"):
        pass
    (store / "index.settings").unlink()
    sql(store, "INSERT OR REPLACE INTO meta (key, value) VALUES (?, " + value + ")", [(f"setting.{name}",)])
    caplog.clear()  # (the first open said what it kept)
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.open(store, chunk_size=C) as s:
            mc = s.bind(model, path)
            mc.insert(prompt(0), prefill(model, prompt(0)), durable=True)
            s.flush()
            stats = s.stats()
    warned = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warned) == 1 and "damaged" in warned[0], warned
    if name == "admit":
        assert stats["writes"]["admit"] == "all" and stats["bytes"] > 0
    if name == "disk_kv_bits":
        assert stats["disk_kv_bits"] is None and stats["bytes"] > 0
    if name == "max_write_rate":  # a limit: it fails closed
        assert stats["writes"]["max_write_rate"] == 0
    repaired(store, capsys, "bad_setting")
    # A limit stays closed (0, kept) until a value is kept; the others are forgotten.
    left = [("0",)] if name == "max_write_rate" else []
    assert sql(store, "SELECT value FROM meta WHERE key = ?", [(f"setting.{name}",)]) == left
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.open(store, chunk_size=C):
            pass
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]


@pytest.mark.parametrize("name,value,kept", [("admit", "'bogus'", "reused"), ("max_write_rate", "x'00'", 10**9)])
def test_a_damaged_kept_setting_is_read_from_its_copy_and_repaired_from_it(tmp_path, capsys, caplog, name, value, kept):
    """The copy beside the index holds the right value: it is what the store uses (said once),
    and what `verify --repair` writes back (an SSD-sparing admit was lifted to all)."""
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C, admit="reused", max_write_rate="1GB/day"):
        pass
    sql(store, "INSERT OR REPLACE INTO meta (key, value) VALUES (?, " + value + ")", [(f"setting.{name}",)])
    with caplog.at_level(logging.WARNING, logger="kvstore"), kvstore.open(store, chunk_size=C) as s:
        assert s.settings[name] == (kept, "kept")
    said = [r.getMessage() for r in caplog.records if "index.settings" in r.getMessage()]
    assert len(said) == 1 and f"the kept {name} is damaged in the index: read from index.settings" in said[0]
    repaired(store, capsys, "bad_setting")
    assert sql(store, "SELECT value FROM meta WHERE key = ?", [(f"setting.{name}",)]) == [
        ("reused" if name == "admit" else "1000000000",)]


@pytest.mark.parametrize("value", ["'garbage'", "x'00'"])
def test_keeping_another_setting_keeps_the_right_copy_of_a_damaged_one(tmp_path, capsys, value):
    """`kvstore settings admit=...` rewrites the copy beside the index: a write budget damaged in
    the index keeps the copy's right value there (copying the damage over it read the budget as 0 from then on, and repair could not bring it back)."""
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C, max_write_rate="1GB/day"):
        pass
    sql(store, "UPDATE meta SET value = " + value + " WHERE key = 'setting.max_write_rate'")
    assert main(["settings", "--store", str(store), "admit=reused"]) == 0
    with kvstore.open(store, chunk_size=C) as s:
        assert s.settings["max_write_rate"] == (10**9, "kept") and s.gate.per_day == 10**9
    repaired(store, capsys, "bad_setting")
    assert sql(store, "SELECT value FROM meta WHERE key = 'setting.max_write_rate'") == [("1000000000",)]


def test_a_kept_exact_prefill_of_no_whole_chunks_is_refused_and_a_planted_one_never_stops_an_open(
        tmp_path, llama, capsys, caplog):
    path, model = llama
    store = tmp_path / "s"
    assert main(["settings", "--store", str(store), "exact_prefill=100"]) == 2
    err = capsys.readouterr().err
    assert "exact_prefill (to keep) is 100 tokens, not a multiple of the chunk size (256)" in err, err
    assert main(["settings", "--store", str(store), "exact_prefill=512"]) == 0  # a whole number of chunks is kept
    (store / "index.settings").unlink()  # (with no right copy beside the index: see the test above)
    sql(store, "UPDATE meta SET value = '100' WHERE key = 'setting.exact_prefill'")  # planted
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.open(store, chunk_size=C) as s:  # opens, in the default mode
            assert s.exact_prefill is None and s.settings["exact_prefill"] == (None, "default")
            s.bind(model, path).insert(prompt(0), prefill(model, prompt(0)))
    warned = [r.getMessage() for r in caplog.records if "exact_prefill" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "kept exact_prefill '100' is damaged (100 tokens, not a multiple of the chunk size (16))" in warned[0]
    code, out = verify(store, capsys)
    assert code == 1 and (f"bad_setting: {store / 'index.sqlite'}: meta setting.exact_prefill: the kept value '100' "
                          "is 100 tokens, not a multiple of the chunk size (256): it reads as its default (off)") in out, out
    repaired(store, capsys, "bad_setting")
    assert sql(store, "SELECT count(*) FROM meta WHERE key = 'setting.exact_prefill'") == [(0,)]


@pytest.mark.parametrize("name, value, says", [
    ("admit", "sometimes", "the kept value 'sometimes' is not one of all, reused, pinned: it reads as its default (all)"),
    ("max_write_rate", "12 parsecs", "the kept value '12 parsecs' is not a rate above 0 such as 20GB/day or 500MB/h, "
                                     "or off: it reads as 0 B/day (no automatic writes)"),
    ("disk_kv_bits", "eight", "the kept value 'eight' is not 4 or 8 (bits), or 0 for off: it reads as its default (off)"),
])
def test_a_damaged_kept_setting_is_said_in_one_sentence(tmp_path, capsys, caplog, name, value, says):
    store = tmp_path / "s"
    with kvstore.open(store):
        pass
    sql(store, "INSERT INTO meta (key, value) VALUES (?, ?)", [(f"setting.{name}", value)])
    code, out = verify(store, capsys)
    assert f"meta setting.{name}: {says}" in out, out
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        kvstore.open(store).close()
    [warned] = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert f"the store's kept {name} {value!r} is damaged (not " in warned and " is is " not in warned, warned


def test_repair_keeps_a_damaged_write_budget_closed_and_says_how_to_set_one(tmp_path, llama, capsys):
    """Damage and repair never turn a write budget off: the repaired store keeps 0 (no
    automatic writes), and verify, stats and settings say which command sets a rate."""
    path, model = llama
    store = tmp_path / "s"
    with kvstore.open(store, max_write_rate="1GB/day"):
        pass
    (store / "index.settings").unlink()  # (a right copy beside the index is read instead: see above)
    sql(store, "UPDATE meta SET value = '12 parsecs' WHERE key = 'setting.max_write_rate'")
    code, out = verify(store, capsys, "--repair")
    assert f"`kvstore settings --store {store} max_write_rate=VALUE` keeps one" in out, out
    assert verify(store, capsys)[0] == 0
    with kvstore.open(store, chunk_size=C) as s:
        assert s.settings["max_write_rate"] == (0, "kept")
        s.bind(model, path).insert(prompt(0), prefill(model, prompt(0)))
        s.flush()
        assert s.stats()["bytes"] == 0 and s.stats()["writes"]["over_budget"] > 0
    assert main(["settings", "--store", str(store)]) == 0
    said = capsys.readouterr().out
    assert f"`kvstore settings --store {store} max_write_rate=20GB/day` (or another rate) sets a budget" in said, said


def test_every_column_repair_mends_is_one_the_index_rewrites():
    assert set(MENDED) == set(MENDABLE)


@pytest.mark.parametrize("column, value", [("last_access", "yesterday"), ("pinned", "no"), ("size", "big"),
                                           ("created", "then"), ("hits", -3), ("bad", "maybe")])
def test_damaged_bookkeeping_never_hides_a_record_from_gc_and_repair_mends_the_row(tmp_path, llama, capsys,
                                                                                  column, value):
    store = tmp_path / "s"
    added = fill(store, llama)
    victim = added[0]
    sql(store, f"UPDATE records SET {column} = ? WHERE hash = ?", [(value, r.hash) for r in victim])
    code, out = verify(store, capsys)
    assert code == 1, out
    for r in victim:  # the index file, the hash in hex, the column and its value
        assert f"bad_row: {store / 'index.sqlite'}: records {r.hash.hex()}: its {column} is {value!r}, not " in out, out

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    assert main(["gc", "--store", str(copy), "--max-bytes", "0"]) == 0
    err = capsys.readouterr().err
    with kvstore.open(copy, chunk_size=C) as s:
        assert list(s.index.rows()) == []  # nothing was hidden from gc
    assert "pinned records" not in err, err
    if column == "size":  # the totals still count the damaged sizes: said, with what mends them
        assert "held by no record gc could read (damaged rows): `kvstore verify --repair" in err, err

    verify(store, capsys, "--repair")
    with kvstore.open(store, chunk_size=C) as s:
        rows = {r.hash: r for r in s.index.rows()}
        assert {r.hash for rows_ in added for r in rows_} == set(rows)  # rewritten, not deleted
        for r in victim:
            mended = getattr(rows[r.hash], column)
            if column == "created":
                assert type(mended) is float and abs(mended - time.time()) < 600
            else:
                assert mended == {"last_access": 0.0, "pinned": 0, "size": r.size, "hits": 0, "bad": 0}[column]
    assert verify(store, capsys)[0] == 0


def test_repair_of_a_damaged_pin_flag_takes_the_pins_files_word(tmp_path, llama, capsys):
    """A pinned record whose flag was damaged is pinned again by repair (the pins file beside the
    index lists it), so the flags and the file agree and gc keeps it; an unpinned one stays
    unpinned."""
    path, model = llama
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, path)
        mc.prefill(prompt(0), pin=True)
        mc.prefill(prompt(1))
        s.flush()
        pinned = {r.hash for r in s.index.rows() if r.pinned}
        loose = {r.hash for r in s.index.rows() if not r.pinned}
    assert pinned and loose
    sql(store, "UPDATE records SET pinned = 'no'")
    verify(store, capsys, "--repair")
    with kvstore.open(store, chunk_size=C) as s:
        rows = list(s.index.rows())
        assert {r.hash for r in rows if r.pinned == 1} == pinned
        assert {r.hash for r in rows if r.pinned == 0} == loose
    assert verify(store, capsys)[0] == 0
    assert main(["gc", "--store", str(store), "--max-bytes", "0"]) == 0
    with kvstore.open(store, chunk_size=C) as s:
        assert {r.hash for r in s.index.rows()} == pinned



@pytest.mark.parametrize("value", ["'yes'", "1.5", "x'01'"])
def test_pins_reads_a_damaged_pin_flag_as_gc_does(tmp_path, llama, value):
    """What `pins` lists (and a remote is told is pinned) is what gc keeps: a flag gc reads as
    no pin is no pin."""
    path, model = llama
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C) as s:
        mc = s.bind(model, path)
        mc.prefill(prompt(0), pin=True)
        s.flush()
        damaged = {r.hash for r in s.index.rows()}
        mc.prefill(prompt(1), pin=True)
        s.flush()
    sql(store, f"UPDATE records SET pinned = {value} WHERE hash = ?", [(h,) for h in damaged])
    with kvstore.open(store, chunk_size=C) as s:
        listed = s.pins()[0]["records"]
        published = s.index.pinned()
    assert main(["gc", "--store", str(store), "--max-bytes", "0"]) == 0
    with kvstore.open(store, chunk_size=C) as s:
        kept = {r.hash for r in s.index.rows()}
    assert kept and not damaged & kept
    assert listed == len(kept) and published == kept


def test_explicit_bytes_past_the_hours_bytes_are_damage_stats_caps_and_repair_clears(tmp_path, capsys):
    """Explicit writes are a part of an hour's bytes: a row saying more (damage, or a row whose
    bytes were mended to 0) is reported, never shown as more explicit bytes than bytes, and repaired."""
    store = tmp_path / "s"
    with kvstore.open(store, chunk_size=C):
        pass
    hour = hour_of(time.time())
    sql(store, "INSERT INTO write_log (hour, bytes, explicit) VALUES (?, 100, 7000000)", [(hour - 1,)])
    with kvstore.open(store, chunk_size=C) as s:
        writes = s.stats()["writes"]
        assert writes["bytes_last_day"] == 100 and writes["explicit_last_day"] == 100, writes
    code, out = verify(store, capsys)
    lines = [line for line in out.splitlines() if line.startswith("bad_write_log:")]
    assert code == 1 and len(lines) == 1 and "explicit bytes (7000000) are more than the hour's bytes" in lines[0], out
    verify(store, capsys, "--repair")
    assert verify(store, capsys)[0] == 0
    assert sql(store, "SELECT bytes, explicit FROM write_log") == [(100, 0)]
