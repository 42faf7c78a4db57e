"""Taking back whole blobs whose rows are missing (`verify --repair`).

An index rolled back (its -wal damaged past its first frames) or a writer killed between
renaming its files and committing their rows leaves blob files no row points to. Each is a
complete record (written, fsynced and renamed before any row of it), so repair takes it back as a
rebuild would, with the same checks (`rebuild.read_record`: its name, header, token hash and
shapes; then the caller's `check`, `verify.check_blob` with the store's trust), when its model is one the index knows,
with the same chunk size, and its parent is in the index or taken back with it. A file whose row
a gc deleted (the deletion log names it) is not taken back: gc meant it gone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvstore import keys
from kvstore.errors import BlobError, WrongKeyError
from kvstore.records import CHECKPOINT, CHUNK
from kvstore.storage import blobtree
from kvstore.storage.index import Index, Row
from kvstore.upkeep.rebuild import read_record


def adopt(index: Index, root: Path, paths: list[Path], present: dict[bytes, Row],
          check: Callable[[Path, Row, int], None]) -> set[Path]:
    """Insert rows for the blob files `paths` that can be taken back (`present`: the index's
    rows that stay, by hash; `check(root, row, chunk_size)` raises BlobError or WrongKeyError for
    a blob the store refuses); returns the paths taken back."""
    named = {h: p for p in paths if (h := blobtree.hash_of(p, root)) is not None}
    if not named:
        return set()
    gone = index.logged_deleted(list(named))
    chunk_sizes = {bytes.fromhex(m["namespace"]): m["chunk_size"] for m in index.models()}
    found = []
    for h, path in named.items():
        if h in gone:
            continue
        try:
            r = read_record(path, h)
        except Exception:  # (whatever a planted file does: left for the orphan rules)
            continue
        if chunk_sizes.get(r["ns"]) == r["chunk_size"]:
            found.append(r)
    taken: dict[bytes, Row] = {}
    for r in sorted(found, key=lambda r: (r["depth"], r["kind"] == CHECKPOINT)):
        parent = present.get(r["parent"]) or taken.get(r["parent"])
        if r["kind"] == CHECKPOINT:
            fits = parent is not None and parent.kind != CHECKPOINT and parent.depth == r["depth"]
        elif r["depth"] == 1:
            fits = r["parent"] == r["ns"]
        else:
            fits = parent is not None and parent.kind == CHUNK and parent.depth == r["depth"] - 1
        if not fits or (parent is not None and parent.ns != r["ns"]):
            continue
        row = Row(r["hash"], r["ns"], r["parent"], r["depth"], r["kind"], r["ntokens"],
                  None if r["kind"] == CHECKPOINT else keys.first_token(r["tokens"]), r["size"], r["checksum"],
                  created=r["mtime"], last_access=r["mtime"], tenant=r["tenant"])
        try:
            check(root, row, r["chunk_size"])
        except (BlobError, WrongKeyError):
            continue
        taken[row.hash] = row
    if taken:
        index.insert(list(taken.values()), {r["tenant"]: r["owner"] for r in found if r["hash"] in taken and r["owner"]})
    return {named[h] for h in taken}
