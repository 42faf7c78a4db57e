"""Keeping a store whole: `verify` (behind `LocalStore.verify`, and so `kvstore verify`).

Every row is checked against its blob (size, checksums, and through `records.check` that the
blob is the record the row names), the chains against each other, every file against the rows,
and the index's bookkeeping against the records (`tables`). Repair deletes only what kvstore
wrote: blob files (named for their hash, in their own `ab/cd/` folder, with a header that names
that hash) and its writers' temporary files. Anything else in the blob tree is moved aside to
`<store>/quarantine/`, never deleted. Unless forced, it deletes orphans only while few of them
are unexplained (`ORPHAN_SHARE` of the blobs, or `ORPHAN_FEW` files, whichever is more): orphan
rows whose first record's model is gone, and orphan files of models the index does not know, are
what a lost or replaced index leaves, and then the index is what is wrong and the blobs are the
cache. (An interrupted gc or writer leaves orphan files of models the index knows, and rows
under a record gc deleted: those are always cleaned up.)
"""

from __future__ import annotations

import functools
import os
import stat
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvstore import records
from kvstore.errors import BlobError, WrongKeyError
from kvstore.storage import blobfile, blobformat, blobtree
from kvstore.storage.index import Index
from kvstore.storage.pins import read_pins_file
from kvstore.storage.storedir import PINS_NAME, QUARANTINE_NAME
from kvstore.trust import Trust
from kvstore.upkeep import rows as rowcheck
from kvstore.upkeep.adopt import adopt
from kvstore.upkeep.anchors import trusted_before
from kvstore.upkeep.tables import repair_tables, table_problems

ORPHAN_SHARE = 0.10
ORPHAN_FEW = 8
#: How an orphan file repair took back reads (`_take_back`).
TAKEN_BACK = ": taken back (a whole record: its row is written again)"


@dataclass(frozen=True)
class Problem:
    """One thing `verify` found wrong."""

    # missing_blob, corrupt_blob, quarantined, bad_row, orphan_row, orphan_file, temp_file,
    # foreign_file, repair_refused, bad_totals, bad_model_row, bad_write_log, bad_role, bad_setting,
    # bad_seen_row, bad_model_file, bad_digest, bad_edge, bad_log_row, wrong_key
    kind: str
    path: str
    detail: str
    hash: str = ""

    def __str__(self) -> str:
        return f"{self.kind}: {self.path}: {self.detail}"

    def to_dict(self) -> dict:
        return asdict(self)


def verify(index: Index, root: Path, *, repair: bool = False, force: bool = False,
           read_only: bool = False, trust: Trust | None = None) -> list[Problem]:
    """Check every row against its blob, the chain, and every file against the rows.

    The reading needs no lock. What looks wrong is looked at again holding the tree lock
    exclusively (no writer between its blob and its row, no gc between its row and its file), so
    work in flight in other processes is neither reported nor repaired away. `force` lets repair
    delete more orphans than `ORPHAN_SHARE`; `read_only` takes the lock only if it exists.
    `trust`: blob tags are checked with it too (`kvstore.trust`): one that is refused is damage;
    but under fleet keys that are not the store's (`Trust.mismatch`), one `wrong_key` problem.
    """
    rows, bad_rows, mended = [], [], []
    moved, sizes = [], {}  # (tenant, tenant its blob's header states, size as read) of the rows retagged
    pinned = None  # the pins file's hashes, read once a pin flag is damaged
    for row in index.rows():  # one snapshot: no read transaction stays open below
        damaged = rowcheck.damaged_columns(row)
        if pinned is None and any(name == "pinned" for name, _, _ in damaged):
            pinned = _pins_file(index)
        fixed = rowcheck.as_read(row, root, damaged, pinned or ()) if damaged else row
        if fixed is None:
            bad_rows.append((row.hash, rowcheck.said(row, damaged)))
            continue
        rows.append(fixed)
        if damaged:  # checked below as repair rewrites it
            mended.append((fixed, [name for name, _, _ in damaged], rowcheck.said(row, damaged)))
            moved += [(row.tenant, fixed.tenant, row.size) for name, _, _ in damaged if name == "tenant"]
            sizes[row.hash] = row.size
    known = {row.hash: row.parent for row in rows}
    chunk_sizes = {bytes.fromhex(m["namespace"]): m["chunk_size"] for m in index.models()}
    check = functools.partial(check_blob, trust=trust, epoch=trusted_before(trust, index) if trust else 0.0)
    suspects, unchecked = _read_rows(root, rows, chunk_sizes, check, mended, moved, sizes)
    strays = [path for path in blobtree.walk(root) if blobtree.hash_of(path, root) not in known]
    with blobtree.gc_lock(root, exclusive=True), blobtree.tree_lock(root, exclusive=True, create=not read_only):
        problems: list[Problem] = [
            Problem("bad_row", str(index.path), why, h.hex() if isinstance(h, bytes) else "") for h, why in bad_rows]
        problems += [Problem("bad_row", str(index.path), why) for _, _, why in mended]
        if trust is not None and trust.mismatch is not None:  # one problem, of the key: no record is dropped for it
            problems.append(Problem("wrong_key", str(index.path), f"{trust.mismatch} ({unchecked} records "
                                    "tagged under another key not checked; --repair deletes none of them)"))
        for row in suspects:
            problem = _confirm(index, root, row, chunk_sizes.get(row.ns), check)
            if problem is not None:
                problems.append(problem)
        bad = {bytes.fromhex(p.hash) for p in problems if p.kind != "bad_row" and p.hash}
        # Rows whose chain is broken (parent gone or bad) can never be reached: orphans.
        orphans = _unreachable(index, known, bad)
        for h in sorted(orphans):  # the same order on every run (a set's varies from process to process)
            problems.append(Problem("orphan_row", str(blobtree.blob_path(root, h)),
                                    "its parent record is missing or damaged", h.hex()))
        for path in strays:
            problem = _stray(index, root, path)
            if problem is not None:
                problems.append(problem)
        tables = table_problems(index, {h for h, _ in bad_rows} | {row.hash for row, _, _ in mended}, moved)
        problems += [Problem(kind, str(index.path), f"{where}: {why}") for kind, where, why in tables]
        if repair and problems:
            blob_files = sum(1 for p in strays if blobtree.hash_of(p, root) is not None) + len(rows)
            fields: dict[bytes, dict] = {}  # (a row retagged after its bookkeeping was mended is in twice)
            for row, names, _ in mended:
                if row.hash not in bad:
                    fields.setdefault(row.hash, {}).update({name: getattr(row, name) for name in names})
            index.mend_rows(fields)
            problems = _take_back(index, root, problems, {r.hash: r for r in rows if r.hash not in bad | orphans},
                                  check)
            problems += _repair(index, root, problems, bad, orphans, known, {r.hash: r.depth for r in rows},
                                [h for h, _ in bad_rows], blob_files, force)
            good: dict[bytes, list[bytes]] = {}
            for row in rows:
                if row.hash not in bad and row.hash not in orphans:
                    good.setdefault(row.ns, []).append(row.hash)
            repair_tables(index, root, good, tables)
    return problems


def _read_rows(root: Path, rows: list, chunk_sizes: dict, check, mended: list, moved: list,
               sizes: dict) -> tuple[list, int]:
    """(the rows whose blob did not read, how many were not checked for a wrong key): each row
    whose tenant alone is wrong is mended in `rows` (and told in `mended` and `moved`)."""
    suspects, unchecked = [], 0  # (unchecked: tagged under the store's fleet key, which was not given)
    for i, row in enumerate(rows):
        try:
            if not row.bad:
                check(root, row, chunk_sizes.get(row.ns))
                continue
        except WrongKeyError:
            unchecked += 1
            continue
        except BlobError:
            retag = _retagged(root, row, chunk_sizes.get(row.ns), check)
            if retag is not None:  # the row's tenant is what is wrong, not the blob
                rows[i] = retag
                mended.append((retag, ["tenant"], rowcheck.said(row, rowcheck.retagged(row, retag.tenant))))
                moved.append((row.tenant, retag.tenant, sizes.get(row.hash, row.size)))
                continue
        suspects.append(row)
    return suspects, unchecked


def check_blob(root: Path, row, chunk_size: int | None = None, *, trust: Trust | None = None,
               epoch: float = 0.0) -> None:
    """Raise BlobError unless the blob of `row` is whole (its size and checksums) and is the
    record the row names (`records.check`: its header, and that its token ids hash to its key),
    and (`trust`) its tag is not refused (`Trust.refuse`: WrongKeyError under a wrong secret)."""
    checked_record(root, row, chunk_size, trust=trust, epoch=epoch)


def checked_record(root: Path, row, chunk_size: int | None = None, *, trust: Trust | None = None,
                   epoch: float = 0.0, where: object = None) -> tuple[bytes, blobfile.BlobFile, object]:
    """`check_blob`, returning what it read: (the blob's bytes, the blob, its record as
    `blobformat.read_record` reads it). `where`: how the record is named in errors (else its path)."""
    buf, blob = blobfile.read_checked(root, row.hash, size=row.size, checksum=row.checksum)
    where = blob.path if where is None else where
    stored = blobformat.read_record(buf, where)
    records.check(row, stored.metadata, stored.tokens, chunk_size=chunk_size, where=where)
    sums = blobformat.tensor_checksums(stored.metadata, blob.path)
    if trust is not None and sums is not None:
        verdict = trust.check(stored.metadata, blobformat.trust_table(stored.entries, sums))
        trust.refuse(verdict, row.created, epoch, blob.path)
    return buf, blob, stored


def _retagged(root: Path, row, chunk_size: int | None, check=check_blob):
    """`row` with the tenant its blob's header states, if that one differs and the blob is whole
    and the record under it (only the row's tenant was wrong); else None."""
    readable, tag = rowcheck.header_tenant(root, row.hash)
    if not readable or tag == row.tenant:
        return None
    fixed = replace(row, tenant=tag)
    try:
        check(root, fixed, chunk_size)
    except BlobError:
        return None
    return fixed


def _pins_file(index: Index) -> set[bytes]:
    """The hashes the pins file beside the index lists (none if it cannot be read)."""
    got = read_pins_file(index.path.parent / PINS_NAME)
    return got.hashes if got is not None else set()


def _confirm(index: Index, root: Path, row, chunk_size: int | None, check=check_blob) -> Problem | None:
    """The problem of a row whose blob did not read, if it still has one now."""
    now = index.get(row.hash)
    path = blobtree.blob_path(root, row.hash)
    if now is None:
        return None  # evicted since
    damaged = rowcheck.damaged_columns(now)
    now = rowcheck.as_read(now, root, damaged) if damaged else now
    if now is None:
        return None  # damaged since: the next verify says how
    if now.bad:
        return Problem("quarantined", str(path), "record was quarantined after a failed read", row.hash.hex())
    try:
        check(root, now, chunk_size)
        return None  # written again since
    except BlobError as e:
        kind = "missing_blob" if not os.path.lexists(path) else "corrupt_blob"
        return Problem(kind, str(path), str(e).split(": ", 1)[-1], row.hash.hex())


def _stray(index: Index, root: Path, path: Path) -> Problem | None:
    """The problem of a file no row pointed to, if it still has one now."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None  # renamed into place or deleted since
    h = blobtree.hash_of(path, root)
    in_hex_folder = len(path.relative_to(root).parts) == 3
    if in_hex_folder and blobtree.is_temp_name(path.name):
        if blobtree.stale_temp(path, min_age_s=3600):
            return Problem("temp_file", str(path), "left by a writer that stopped")
        if stat.S_ISREG(mode):
            return None  # a writer at work
    if h is not None and stat.S_ISREG(mode):
        if index.get(h) is not None:
            return None
        # Deleted only if it is kvstore's: a file that merely has a blob's name is moved aside.
        if (blobfile.peek_metadata(path) or {}).get("hash") != h.hex():
            return Problem("foreign_file", str(path), "named like a blob, but its header does not "
                           "name that record (not kvstore's)")
        return Problem("orphan_file", str(path), "no index row points to it")
    if stat.S_ISLNK(mode):
        return Problem("foreign_file", str(path), "a symbolic link (kvstore never follows it)")
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        return Problem("foreign_file", str(path), "not a regular file (a FIFO, socket or device)")
    return Problem("foreign_file", str(path), "not a kvstore blob")


def _unreachable(index: Index, known: dict[bytes, bytes], bad: set[bytes]) -> set[bytes]:
    """Good rows that no chain of good rows reaches from a namespace root."""
    namespaces = index.namespaces()
    ok: dict[bytes, bool] = {}

    def reachable(h: bytes) -> bool:
        trail = []
        while h not in ok:
            if h in bad:
                ok[h] = False
                break
            parent = known.get(h)
            if parent is None:
                ok[h] = h in namespaces
                break
            trail.append(h)
            h = parent
        result = ok[h]
        for t in trail:
            ok[t] = result
        return result

    return {h for h in known if h not in bad and not reachable(known[h])}


def _rootless(orphans: set[bytes], known: dict[bytes, bytes], bad: set[bytes], depths: dict[bytes, int]) -> int:
    """Orphan rows whose chain climbs, through no damaged record, to a first record (depth 1)
    whose model is gone: what a lost or replaced index leaves. A chain that stops below a
    missing record of depth 2 or more lost that record to a gc (one stopped half way, or one
    that took a parent before its children): explained, and repair drops them."""
    n = 0
    for h in orphans:
        seen = set()
        top = h
        while h in known and h not in bad and h not in seen:
            seen.add(h)
            top, h = h, known[h]
        n += h not in bad and depths.get(top, 1) == 1
    return n


def _take_back(index: Index, root: Path, problems: list[Problem], present: dict, check) -> list[Problem]:
    """Repair's first step: orphan files that are whole records of the index's models, under a
    record that stays, get their rows back (`upkeep.adopt`) instead of being deleted; their
    problems say so."""
    taken = adopt(index, root, [Path(p.path) for p in problems if p.kind == "orphan_file"], present, check)
    return [replace(p, detail=p.detail + TAKEN_BACK) if p.kind == "orphan_file" and Path(p.path) in taken else p
            for p in problems]


def _repair(index: Index, root: Path, problems: list[Problem], bad: set[bytes], orphans: set[bytes],
            known: dict[bytes, bytes], depths: dict[bytes, int], bad_rows: list, blob_files: int,
            force: bool) -> list[Problem]:
    """Fix what verify found, under its lock; returns the problems it would not fix."""
    orphan_files = [p for p in problems if p.kind == "orphan_file" and not p.detail.endswith(TAKEN_BACK)]
    n_orphans = len(orphans) + len(orphan_files)
    refused: list[Problem] = []
    # An orphan file is explained when its row's deletion was logged (a gc stopped between its
    # rows and its files) and otherwise counts: a crashed writer leaves one batch of them at most,
    # a lost or rolled-back index most of the store (whole blobs: a rebuild takes them back).
    named = [h for p in orphan_files if (h := blobtree.hash_of(Path(p.path), root)) is not None]
    unexplained = _rootless(orphans, known, bad, depths) + len(orphan_files) - len(index.logged_deleted(named))
    if unexplained > max(ORPHAN_FEW, ORPHAN_SHARE * blob_files) and not force:
        refused.append(Problem(
            "repair_refused", str(root),
            f"{n_orphans} of {blob_files} blobs would be deleted as orphans, more than "
            f"{ORPHAN_SHARE:.0%}: the index looks lost or replaced, so they were kept. Move "
            "index.sqlite away and run `kvstore verify --repair` to rebuild the index from them, "
            "or run `kvstore verify --repair --force` to delete them"))
        orphans, orphan_files = set(), []
    drop = sorted(bad | orphans)
    if drop or bad_rows:
        rows = index.delete(drop + bad_rows)
        for row in rows:  # after the commit
            blobtree.remove(root, row.hash)
    # Edges of `children` left by a gc stopped between its two sweeps (readers ignore them).
    index.forget_lost_edges()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for p in problems:
        if p.kind not in ("orphan_file", "temp_file", "foreign_file"):
            continue
        if p.kind == "orphan_file" and p not in orphan_files:
            continue
        parts = Path(p.path).relative_to(root).parts
        # Only kvstore's own names are deleted; anything else is moved aside, whole.
        if p.kind in ("orphan_file", "temp_file") and blobtree.remove_entry(root, parts, directory_too=False):
            continue
        if os.path.lexists(p.path):
            blobtree.move_entry(root, parts, root.parent / QUARANTINE_NAME, f"{stamp}.{'_'.join(parts)}")
    return refused
