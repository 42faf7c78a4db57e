"""The `children` edges as damage leaves them: a lookup finds a record only through its edge from
its parent, so a missing edge, or one of the wrong types or values, hides the record. `verify`
reports it (the record's own parent, first token and tenant say what the edge must be),
`verify --repair` writes it again, and a lookup never reads an edge its record disagrees with.

Every test breaks a real store on purpose (SQL written by hand into its index) and uses the real
store and `kvstore verify`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtest import index_sql as sql
from kvtest import prefill

import kvstore
from kvstore.cli.main import main

C = 16
TOKENS = [1 + (j * 7) % 250 for j in range(70)]  # 4 chunks and a tail of 6


def stored(store: Path, llama) -> bytes:
    """A store holding TOKENS; the hash of its deepest record (the tail)."""
    path, model = llama
    with kvstore.open(store, chunk_size=C) as s:
        s.bind(model, path).insert(TOKENS, prefill(model, TOKENS))
        s.flush()
        return max(s.index.rows(), key=lambda r: r.depth).hash


def uncovered(store: Path, llama) -> int:
    """How many tokens of TOKENS + [1] a fresh store with no RAM tier leaves to compute."""
    path, model = llama
    with kvstore.open(store, chunk_size=C, memory_bytes=0) as s:
        return len(s.bind(model, path).fetch(TOKENS + [1])[1])


def verify(store: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["verify", "--store", str(store), *extra])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("damage", [
    "DELETE FROM children WHERE hash = ?",
    "UPDATE children SET first_token = 'x' WHERE hash = ?",
    "UPDATE children SET hash = 'abc' WHERE hash = ?",
    "UPDATE children SET tenant = 5 WHERE hash = ?",
    "UPDATE children SET parent = x'00112233445566778899aabbccddeeff' WHERE hash = ?",
])
def test_a_damaged_or_missing_edge_is_reported_and_written_again(tmp_path, llama, capsys, damage):
    store = tmp_path / "s"
    tail = stored(store, llama)
    assert uncovered(store, llama) == 1
    sql(store, damage, (tail,))
    assert uncovered(store, llama) > 1  # the tail is hidden (and no lookup crashed on its edge)

    code, out = verify(store, capsys)
    assert code == 1 and "bad_edge:" in out and tail.hex() in out, out
    assert "corrupt_blob" not in out and "orphan" not in out, out
    code, out = verify(store, capsys, "--repair")
    assert "bad_edge:" in out, out
    assert verify(store, capsys)[0] == 0
    assert uncovered(store, llama) == 1  # found again: repair wrote the edge, and deleted nothing
    assert sql(store, "SELECT count(*) FROM children") == sql(store, "SELECT count(*) FROM records")


def test_an_edge_to_no_record_is_reported_and_deleted(tmp_path, llama, capsys):
    store = tmp_path / "s"
    stored(store, llama)
    sql(store, "INSERT INTO children VALUES (x'00112233445566778899aabbccddeeff', 'abc', 'zz', 5)")
    sql(store, "INSERT INTO children VALUES (x'00112233445566778899aabbccddeeff', 3, "
               "x'ffeeddccbbaa99887766554433221100', NULL)")
    code, out = verify(store, capsys)
    assert code == 1 and out.count("bad_edge:") == 2 and "an edge to no record" in out, out
    verify(store, capsys, "--repair")
    assert verify(store, capsys)[0] == 0
    assert sql(store, "SELECT count(*) FROM children") == sql(store, "SELECT count(*) FROM records")
    assert uncovered(store, llama) == 1
