"""A `records` row as damage leaves it, for `verify`: what is wrong with each column, what gc and
the readers make of it, and what repair writes instead.

A column that names the record (hash, namespace, parent, depth, kind, token count, first token,
checksum) cannot be rewritten: the record is deleted, file and all. A column of bookkeeping is
rewritten to a safe value, as gc already reads it, so a damaged row never hides its bytes from
gc: a size that is not a whole number becomes the blob file's size (its checksum is then checked
as any other row's), a last access time the epoch (gc evicts it first), a creation time now,
hits 0, a quarantine flag 0 once the blob checks out, and a pin flag as the pins file beside the
index has it (`storage.pins`: pinned if it lists the record, else not, said so that the prompt
can be pinned again), so that the flags and the file agree.

A record's tenant is its blob's: the header states it (`x-tenant`), and the row's checksum
vouches for the header. A row whose tenant is not NULL or a tag (16 hex digits), or is another
tag than its header's, takes the header's (`as_read`, `retagged`); its blob is never deleted
for it. Until then no lookup serves it: a tier shows a lookup no record of a tenant it is not,
and a record whose header states another tenant than its row is a miss (`records.check`).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Collection

from kvstore import keys, tenants
from kvstore.storage import blobfile, blobformat, blobtree

#: Bookkeeping columns: what gc (and a reader) reads a damaged value as, and what repair writes.
MENDED = {
    "size": "gc counts it as 0 bytes and can evict it; repair sets the blob file's size",
    "last_access": "gc reads it as never used and evicts it first; repair sets it to 0",
    "created": "repair sets it to now",
    "hits": "repair sets it to 0",
    "pinned": "gc reads it as not pinned and may evict it; repair takes the pins file's word (pinned if "
              "it lists the record, else unpinned: warm its prompt again with \"pin\": true to keep it)",
    "bad": "readers take it as quarantined and never serve it; repair clears it if the blob checks out",
    "tenant": "no lookup is served the record (a miss); repair sets the tenant its blob's header states",
}
#: What a row's tenant must be.
TENANT_FORM = "NULL (shared) or a tenant tag of 16 hex digits"


def damaged_columns(row) -> list[tuple[str, object, str]]:
    """(column, value, what it must be) of every column of `row` of the wrong type or range."""
    out = []
    for name in ("hash", "ns", "parent"):
        v = getattr(row, name)
        if not isinstance(v, bytes) or len(v) != keys.HASH_BYTES:
            out.append((name, v, f"a {keys.HASH_BYTES}-byte hash"))
    for name, low, high in (("depth", 1, None), ("kind", 0, 2), ("ntokens", 0, None), ("checksum", None, None),
                            ("hits", 0, None), ("pinned", None, None), ("bad", None, None)):
        v = getattr(row, name)
        if type(v) is not int or (low is not None and v < low) or (high is not None and v > high):
            want = "a whole number" + (f" of {low} to {high}" if high is not None else f" of {low} or more"
                                       if low is not None else "")
            out.append((name, v, want))
    if row.first_token is not None and type(row.first_token) is not int:
        out.append(("first_token", row.first_token, "a token id"))
    if type(row.size) is not int:
        out.append(("size", row.size, "a whole number of bytes"))
    elif not 0 <= row.size <= blobformat.MAX_BLOB_BYTES:
        out.append(("size!", row.size, "a size a blob can have"))  # (a whole number: not mended)
    for name in ("created", "last_access"):
        if type(getattr(row, name)) not in (int, float):
            out.append((name, getattr(row, name), "a time"))
    if row.tenant is not None and not _is_tag(row.tenant):  # (TEXT affinity: a planted 5 reads '5')
        out.append(("tenant", row.tenant, TENANT_FORM))
    return out


def _is_tag(value: object) -> bool:
    try:
        tenants.parse_tag(value)
        return True
    except ValueError:
        return False


def header_tenant(root: Path, h: bytes) -> tuple[bool, str | None]:
    """(whether it could be read, the tenant tag) the header of record `h`'s blob states."""
    meta = blobfile.peek_metadata(blobtree.blob_path(root, h)) if isinstance(h, bytes) else None
    try:
        return (True, tenants.stated(meta)[0]) if meta is not None else (False, None)
    except ValueError:
        return False, None


def retagged(row, tag: str | None) -> list[tuple[str, object, str]]:
    """The damage of a row whose tenant is not the `tag` its blob's header states (a well-formed
    one, which only the blob can tell wrong), as `damaged_columns` says it."""
    return [("tenant", row.tenant, f"{tag or 'none (shared)'}, the tenant its blob's header states")]


def as_read(row, root: Path, damaged: list[tuple[str, object, str]], pinned: Collection[bytes] = ()):
    """`row` with its damaged bookkeeping columns as repair rewrites them (None if a column
    that names the record is damaged: it cannot be mended); `pinned`: the pins file's hashes."""
    if any(name not in MENDED for name, _, _ in damaged):
        return None
    safe = {"last_access": 0.0, "created": time.time(), "hits": 0, "pinned": int(row.hash in pinned), "bad": 0}
    fields = {name: safe[name] for name, _, _ in damaged if name in safe}
    if any(name == "size" for name, _, _ in damaged):
        try:
            fields["size"] = os.lstat(blobtree.blob_path(root, row.hash)).st_size
        except OSError:
            fields["size"] = 0  # no file: the blob check says so, and repair deletes the record
    if any(name == "tenant" for name, _, _ in damaged):
        # A header that cannot be read: the blob check says so, and repair deletes the record.
        fields["tenant"] = header_tenant(root, row.hash)[1]
    return replace(row, **fields)


def said(row, damaged: list[tuple[str, object, str]]) -> str:
    """`records 0982…: its size is 'big', not a whole number of bytes: ...`: what verify says."""
    h = row.hash.hex() if isinstance(row.hash, bytes) else f"{row.hash!r:.40}"
    if all(name in MENDED for name, _, _ in damaged):
        return f"records {h}: " + "; ".join(f"its {name} is {value!r:.40}, not {want}: {MENDED[name]}"
                                            for name, value, want in damaged)
    return (f"records {h}: " + "; ".join(f"its {name.rstrip('!')} is {value!r:.40}, not {want}"
                                        for name, value, want in damaged)
            + ": no lookup or gc can use it; repair deletes the record")
