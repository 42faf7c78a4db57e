"""The index's bookkeeping, checked by `verify` and rewritten by its repair: the `totals` table
(counted again from the records) and the `models` rows (every field of the type it must have).

Nothing here deletes a record or a file. A damaged total is counted again. A damaged field of a
models row is taken again from the header of one of its blobs (fingerprint, model id, chunk
size), or set to now (when it was made), to 0 (its last use: its records' access times say it)
or to "{}" (a layout, which the next bind writes again). A row that names no namespace, or whose
fields no blob can give back, is deleted: its records are then orphans, which the next `verify`
reports.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from kvstore import keys
from kvstore.storage import blobfile, blobtree
from kvstore.storage.index import MODEL_FIELDS, TOTALS, Index


def _hash(text: str) -> bytes:
    value = bytes.fromhex(text)
    if len(value) != keys.HASH_BYTES:
        raise ValueError(text)
    return value


#: Fields of a models row that only a blob's header can give back, and how the header says them.
_FROM_HEADER = {"fingerprint": _hash, "model_id": str, "chunk_size": int}
#: What each field of a models row must be.
_WANT = {"ns": "a 16-byte hash", "fingerprint": "a 16-byte hash", "model_id": "text", "layout": "text",
         "chunk_size": "a positive whole number", "created": "a time", "last_used": "a time"}


def table_problems(index: Index) -> list[tuple[str, str, str]]:
    """(kind, namespace in hex or "", what is wrong) for the totals and the models rows."""
    out = []
    raw = index.stored_totals()
    counted = index.counted_totals()
    for ns in sorted(set(raw) | set(counted), key=repr):
        have = tuple(raw.get(ns, (0, 0, 0, 0)))
        want = counted.get(ns, (0, 0, 0, 0))
        if have != want:
            said = ", ".join(f"{name} {v!r:.40}" for name, v in zip(TOTALS, have))
            real = ", ".join(f"{name} {v}" for name, v in zip(TOTALS, want))
            out.append(("bad_totals", ns.hex() if isinstance(ns, bytes) else "",
                        f"the totals table says {said}; the records hold {real}"))
    for row in index.model_rows():
        fields = dict(zip(MODEL_FIELDS, row))
        ns = fields["ns"].hex() if isinstance(fields["ns"], bytes) else ""
        out += [("bad_model_row", ns, f"its {name} is {fields[name]!r:.60}, not {_WANT[name]}")
                for name in _wrong(fields)]
    return out


def _wrong(fields: dict) -> list[str]:
    """The fields of a models row that do not have the type they must have."""
    return [name for name in MODEL_FIELDS if not _good(name, fields[name])]


def _good(name: str, value: object) -> bool:
    if name in ("ns", "fingerprint"):
        return isinstance(value, bytes) and len(value) == keys.HASH_BYTES
    if name in ("model_id", "layout"):
        return isinstance(value, str)
    if name == "chunk_size":
        return type(value) is int and value > 0
    return type(value) in (int, float)


def repair_tables(index: Index, root: Path, records_of: dict[bytes, list[bytes]],
                  problems: Iterable[tuple[str, str, str]]) -> None:
    """Rewrite what `table_problems` found: the totals counted again, each damaged models row
    mended from the header of one of its blobs (`records_of`: ns -> hashes of good records)."""
    kinds = {kind for kind, _, _ in problems}
    if "bad_model_row" in kinds:
        for row in index.model_rows():
            fields = dict(zip(MODEL_FIELDS, row))
            wrong = _wrong(fields)
            if wrong:
                index.rewrite_model(fields["ns"], _mended(root, fields["ns"], wrong, records_of))
    if "bad_totals" in kinds:
        index.rewrite_totals()


def _mended(root: Path, ns: object, wrong: list[str], records_of: dict[bytes, list[bytes]]) -> dict:
    """The values that replace the `wrong` fields of the models row `ns`; {} to delete it."""
    if "ns" in wrong:
        return {}
    # A last use of 0: stats then shows its records' last access instead.
    defaults = {"created": time.time(), "last_used": 0.0, "layout": "{}"}
    out: dict[str, object] = {name: defaults[name] for name in wrong if name in defaults}
    needed = [name for name in wrong if name in _FROM_HEADER]
    if needed:
        meta = _header_of(root, records_of.get(ns, []))
        try:
            out.update({name: _FROM_HEADER[name](meta[name]) for name in needed})
        except (KeyError, TypeError, ValueError):
            return {}
    return out if all(_good(name, value) for name, value in out.items()) else {}


def _header_of(root: Path, hashes: list[bytes]) -> dict:
    """The header metadata of the first of these blobs that has one."""
    for h in hashes[:8]:
        meta = blobfile.peek_metadata(blobtree.blob_path(root, h))
        if meta is not None:
            return meta
    return {}

