"""Rebuild a lost or damaged index (`index.sqlite`) from the blob files.

Every blob carries its own metadata in its safetensors header (format, ns, fingerprint, model_id,
chunk_size, hash, parent, depth, kind) and its token ids, so the records can be found again
without the index. A blob is taken back only if everything about it agrees: its name, the hash in
its header, the hash recomputed from its parent and tokens (records are content-addressed), its
kind and token count, and a parent chain that reaches its namespace. Anything else is left where
it is, and reported (a planted or hostile file is skipped, never a crash nor a hang): `verify`
then lists it, and `verify --repair` deletes it only if its header names its own hash (an orphan
blob); anything else named like a blob (a user's file) is moved to `quarantine/`.

The damaged index is moved aside (`index.sqlite.damaged-<time>`, with its -wal/-shm), not
deleted. What the blobs do not carry is read from it when it still can be (pins, access times,
hit counts, model layouts, the kept settings and the write log); otherwise access times become
the files' mtimes, and pins come from the pins file the store keeps beside the index
(`storage.pins`; a damaged one gives what it still holds, and the result says what was wrong
with it). A limit never opens because its row was lost: when the damaged index's kept settings
cannot be read, the write budget is kept closed (`max_write_rate` 0) until a value is kept again;
when only its write log cannot be read, the hour of the rebuild counts as the whole budget.
The result says what was kept and what was lost.

Run it with no other process using the store (`kvstore verify --repair` does, when the index
cannot be read): a process that still has the old index open keeps writing to the moved file.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import xxhash

from kvstore import keys, records, settings, tenants
from kvstore.errors import BlobError, CorruptIndexError, InvalidInputError, NotAStoreError
from kvstore.records import CHECKPOINT, CHUNK, TAIL
from kvstore.storage import blobfile, blobformat, blobtree
from kvstore.storage.index import Index, _u64_to_i64
from kvstore.storage.pins import PinsFile, read_pins_file, write_pins_file
from kvstore.storage.schema import connect_read_only
from kvstore.storage.storedir import (
    BLOBS_NAME,
    INDEX_FILES,
    INDEX_NAME,
    PINS_NAME,
    SETTINGS_NAME,
    has_blob_files,
    open_dir,
    read_settings_copy,
)
from kvstore.storage.writesql import LOG_COLUMNS, hour_of


def rebuild_index(path: str | os.PathLike) -> dict:
    """Rebuild the index of the store at `path` from its blob files.

    Returns what was done: `records`, `chunks`, `tails`, `checkpoints`, `bytes`, `models`,
    `skipped` (a list of {"path", "reason"} for blob-named files that were not taken back),
    `salvaged` (records whose pin and access times came from the old index), `pinned` (records
    pinned again), `pins` (where their pins came from, and what was lost, in words), `settings`
    (which kept settings and write-log hours were kept, and what was lost, in words) and
    `damaged_index` (where the old index was moved, or None if there was none).
    """
    store = Path(path).expanduser().resolve()
    root = store / BLOBS_NAME
    try:
        open_dir(store, create=False, read_only=False)  # a store, its entries no links, writable
    except CorruptIndexError:
        pass  # a damaged or lost index is why we are here; anything else stops the rebuild
    if not root.is_dir():
        raise NotAStoreError(f"{store} is not a kvstore store (it has no {BLOBS_NAME}/ folder)")
    if not has_blob_files(root) and not any(os.path.lexists(store / n) for n in INDEX_FILES):
        raise NotAStoreError(f"{store} holds neither a kvstore index nor kvstore blobs: nothing to rebuild")
    index_file = store / INDEX_NAME
    # Exclusive of writers and gc (that keep the lock) while the blobs are read.
    with blobtree.tree_lock(root, exclusive=True):
        aside = _move_aside(index_file)
        # After a rebuild that crashed, the index moved aside last time is the one to read.
        earlier = sorted(store.glob(f"{INDEX_NAME}.damaged-*[0-9]"), key=lambda p: os.lstat(p).st_mtime)
        old = _salvage(aside or (earlier[-1] if earlier else None))
        old.pins_file = read_pins_file(store / PINS_NAME)
        kept, log, closed, settings_note = _kept_settings(old, store)

        found, skipped = _scan(root)
        accepted = _chain(found, skipped)

        # Built aside and renamed into place whole: a crash never leaves an empty index (whose
        # blobs `verify --repair` would all delete as orphans) where the old one was.
        building = store / f"{INDEX_NAME}.rebuilding"
        for suffix in ("", "-wal", "-shm"):
            if os.path.lexists(f"{building}{suffix}"):
                os.unlink(f"{building}{suffix}")
        os.close(os.open(building, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        index = Index(building)
        try:
            _write(index, accepted, old)
            _write_kept(index, kept, log)
            if closed is not None:
                index.close_hour(closed)
        finally:
            index.close()
        os.replace(building, index_file)
        pinned = {r["hash"] for r in accepted if old.pinned(r["hash"])}
        pins = _pins_note(old, len(pinned), store / PINS_NAME)
        try:  # the file now holds what the new index pins (a damaged one is made whole)
            write_pins_file(store / PINS_NAME, pinned)
        except OSError as e:
            pins += f"; the pins file could not be rewritten ({e.strerror or e})"
    kinds = [r["kind"] for r in accepted]
    return {
        "records": len(accepted),
        "chunks": kinds.count(CHUNK),
        "tails": kinds.count(TAIL),
        "checkpoints": kinds.count(CHECKPOINT),
        "bytes": sum(r["size"] for r in accepted),
        "models": len({r["ns"] for r in accepted}),
        "salvaged": sum(1 for r in accepted if r["hash"] in old.records),
        "pinned": len(pinned),
        "pins": pins,
        "settings": settings_note,
        "skipped": [{"path": str(p), "reason": why} for p, why in skipped],
        "damaged_index": str(aside) if aside is not None else None,
    }


def _move_aside(index_file: Path) -> Path | None:
    """Move the old index and its -wal/-shm aside (kept, never deleted). A -wal left without
    its index is moved too: SQLite would otherwise replay it into the new index."""
    if not os.path.lexists(index_file):
        for suffix in ("-wal", "-shm", "-journal"):
            if os.path.lexists(f"{index_file}{suffix}"):
                os.replace(f"{index_file}{suffix}",
                           f"{index_file}{suffix}.stale-{time.strftime('%Y%m%d-%H%M%S')}")
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = index_file.with_name(f"{index_file.name}.damaged-{stamp}")
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = index_file.with_name(f"{index_file.name}.damaged-{stamp}.{n}")
    for suffix in ("", "-wal", "-shm"):
        src = Path(f"{index_file}{suffix}")
        if os.path.lexists(src):
            os.replace(src, f"{aside}{suffix}")
    return aside


class _Salvage:
    def __init__(self, found: bool = False):
        self.found = found  # there was an old index to read
        self.records: dict[bytes, tuple[float, float, int, int]] = {}  # created, last_access, hits, pinned
        self.layouts: dict[bytes, str] = {}
        self.pins_file: PinsFile | None = None
        self.settings: dict[str, object] | None = None  # name -> kept value as stored; None: unreadable
        self.write_log: list[tuple] | None = None  # (hour, *LOG_COLUMNS) as stored; None: unreadable

    def pinned(self, h: bytes) -> int:
        """The old index's pin of a record where it could tell, else the pins file's."""
        if h in self.records:
            return int(self.records[h][3] != 0)
        return int(self.pins_file is not None and h in self.pins_file.hashes)


def _pins_note(old: _Salvage, pinned: int, path: Path) -> str:
    """Where the pins of a rebuilt index came from, and what may have been lost, in words."""
    told = f"{pinned} pinned record{'s' if pinned != 1 else ''} kept"
    f = old.pins_file
    if f is None:
        if old.records:
            return f"{told} (from the old index; there was no pins file {path}, so pins it could not tell are lost)"
        return (f"{told}: the old index could not be read and there was no pins file {path}, so any "
                "pins are lost (warm the prompts again with \"pin\": true)")
    if f.problem is not None:
        return (f"{told}; the pins file {path} was damaged ({f.problem}): what it no longer held is "
                "not pinned (warm those prompts again with \"pin\": true)")
    return told


def _salvage(old_file: Path | None) -> _Salvage:
    """What the old index can still tell, read-only and best effort (it is damaged)."""
    if old_file is None or old_file.is_symlink() or not old_file.is_file():
        return _Salvage()
    out = _Salvage(found=True)
    try:
        conn = connect_read_only(old_file, timeout=1.0)  # an escaped URI: `#` or `?` in the path
    except sqlite3.Error:
        return out
    try:
        for query, keep in (
            ("SELECT hash, created, last_access, hits, pinned FROM records",
             lambda r: out.records.__setitem__(r[0], (float(r[1]), float(r[2]), int(r[3]), int(r[4])))),
            ("SELECT ns, layout FROM models", lambda r: out.layouts.__setitem__(r[0], str(r[1]))),
        ):
            try:
                for row in conn.execute(query):
                    if isinstance(row[0], bytes) and len(row[0]) == keys.HASH_BYTES:
                        try:
                            keep(row)
                        except (TypeError, ValueError):
                            pass
            except sqlite3.Error:
                pass  # keep whatever was read before the damaged page
        try:  # all or nothing: a part of them would read as the rest being defaults
            out.settings = {key.removeprefix("setting."): value for key, value in conn.execute(
                "SELECT key, value FROM meta WHERE key LIKE 'setting.%'")}
        except sqlite3.Error:
            pass
        try:
            out.write_log = conn.execute(f"SELECT hour, {', '.join(LOG_COLUMNS)} FROM write_log").fetchall()
        except sqlite3.Error:
            pass
    finally:
        conn.close()
    return out


def _kept_settings(old: _Salvage, store: Path) -> tuple[dict[str, object], list[tuple], int | None, str]:
    """(the kept settings, the write-log rows, the hour to count as the whole budget or None,
    what was kept and lost in words) for the new index. Unreadable kept settings keep every limit closed (each reads as its `damaged`
    value: a lost index counts as one whose settings cannot be read, since a budget it may have
    had is never lifted); an unreadable write log with a budget counts this hour as the whole of it."""
    kept = dict(old.settings or {})
    said = []
    whence = "from the damaged index" if old.found else "(there was no old index to read them from)"
    copy = read_settings_copy(store) if old.settings is None else None
    if copy is not None:  # the copy kept beside the index
        kept = copy
        shown = [_shown(name, value) for name, value in sorted(kept.items())]
        said.append(f"the kept settings could not be read {whence}: read back from {SETTINGS_NAME}: "
                    + (", ".join(shown) or "none kept (every one its default)"))
    elif old.settings is None:
        closed = {s.name: s.damaged for s in settings.KEPT_SETTINGS if s.damaged is not None}
        kept.update(closed)
        said.append(f"the kept settings could not be read {whence}: " + ", ".join(
            f"{name} is kept as {settings.damaged_reads(settings.BY_NAME[name])} until "
            f"{settings.keep_one(settings.BY_NAME[name], store)}" for name in closed) + "; the others are their defaults")
    else:
        shown = [_shown(name, value) for name, value in sorted(kept.items())]
        said.append(f"settings kept: {', '.join(shown)}" if shown else "no kept settings (every one its default)")
    log = [row for row in old.write_log or [] if type(row[0]) is int]  # (the table's key)
    closed = None
    if old.write_log is None:
        limit = settings.resolve({}, {k: v for k, v in kept.items() if isinstance(v, str)})["max_write_rate"][0]
        if limit:  # the window's use is unknown: this hour holds the whole budget, as a damaged hour does
            closed = hour_of(time.time())  # (logging it as written would count bytes never written)
            said.append(f"the write log could not be read: this hour counts as the whole write budget "
                        f"({settings.BY_NAME['max_write_rate'].show(limit)}) until it leaves the day")
        else:
            said.append("the write log could not be read (its counts of past writes are lost)")
    else:
        said.append(f"write log kept ({len(log)} hour{'s' if len(log) != 1 else ''})")
    return kept, log, closed, "; ".join(said)


def _shown(name: str, value: object) -> str:
    """`admit=reused`; a damaged value is copied as it is, for verify to report."""
    s = settings.BY_NAME.get(name)
    try:
        return f"{name}={s.show(s.decode(value))}" if s is not None and s.kept else f"{name} (no setting kvstore keeps)"
    except InvalidInputError:
        return f"{name} (damaged, kept as it was: `kvstore verify` reports it)"


def _write_kept(index: Index, kept: dict[str, object], log: list[tuple]) -> None:
    """The kept settings and write-log rows, as they were stored (a damaged one stays damaged:
    its readers read past it, fail closed, and verify reports it)."""
    with index.transaction() as conn:
        conn.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                         [(f"setting.{name}", value) for name, value in kept.items()])
        conn.executemany(f"INSERT OR REPLACE INTO write_log (hour, {', '.join(LOG_COLUMNS)}) "
                         f"VALUES (?{', ?' * len(LOG_COLUMNS)})", log)


def _scan(root: Path) -> tuple[dict[bytes, dict], list[tuple[Path, str]]]:
    """Every blob file whose contents agree with its name: hash -> record fields."""
    found: dict[bytes, dict] = {}
    skipped: list[tuple[Path, str]] = []
    for path in blobtree.walk(root):
        h = blobtree.hash_of(path, root)
        if h is None:
            continue  # temporaries and foreign files: verify reports them
        if path.is_symlink():
            skipped.append((path, "a symbolic link, not a blob file"))
            continue
        try:
            found[h] = read_record(path, h)
        except BlobError as e:
            skipped.append((path, str(e).split(": ", 1)[-1]))
        except Exception as e:  # whatever a planted file does, the rest are still taken back
            skipped.append((path, f"cannot be read as a blob ({type(e).__name__}: {e})"))
    return found, skipped


def read_record(path: Path, h: bytes) -> dict:
    """The record of blob file `path` (named for `h`) as a row needs it, if everything about it
    agrees (BlobError otherwise): what a rebuild, and repair's taking back of a file, insert."""
    buf = blobfile.read_file(path)  # a regular file, no link, no FIFO, size checked first
    try:
        mtime = os.lstat(path).st_mtime
    except OSError as e:
        raise BlobError(f"{path}: cannot read ({e.strerror or e})") from e
    stored = blobformat.read_record(buf, path)  # BlobError unless it is a record's blob
    entries, meta, tokens = stored.entries, stored.metadata, stored.tokens
    if meta.get("format") != str(keys.FORMAT_VERSION):
        raise BlobError(f"{path}: format {meta.get('format')!r}, this kvstore writes {keys.FORMAT_VERSION}")
    rid = stored.identity  # the record its header describes
    try:
        owner = tenants.stated_owner(meta) if rid.tenant is not None else None  # (whose quota it shares)
    except ValueError as e:
        raise BlobError(f"{path}: its owner field is not valid ({e})") from None
    fingerprint = blobformat.meta_field(meta, "fingerprint", blobformat.hash16, path)
    chunk_size = blobformat.meta_field(meta, "chunk_size", int, path)
    model_id = meta.get("model_id")  # none in a record from the bucket or a pack (`blobformat.portable`)
    ns, parent, depth, kind, n = rid.ns, rid.parent, rid.depth, rid.kind, rid.ntokens
    if depth < 1 or kind not in (CHUNK, TAIL, CHECKPOINT) or chunk_size < 1:
        raise BlobError(f"{path}: depth {depth}, kind {kind} or chunk size {chunk_size} is impossible")
    # Named as the file is: the one check every reader makes.
    rid.hash = h
    records.check(rid, meta, tokens, chunk_size=chunk_size, where=path)
    for name, entry in entries.items():
        shape = entry["shape"]
        if kind != CHECKPOINT and name != "tokens" and (len(shape) < 3 or shape[2] > n):
            raise BlobError(f"{path}: tensor {name!r} of shape {shape} does not fit {n} tokens")
    return {"hash": h, "ns": ns, "parent": parent, "depth": depth, "kind": kind, "ntokens": n,
            "tokens": tokens.tobytes(), "size": len(buf), "checksum": xxhash.xxh3_64_intdigest(buf),
            "path": path, "mtime": mtime, "fingerprint": fingerprint, "model_id": model_id, "chunk_size": chunk_size,
            "tenant": rid.tenant, "owner": owner}


def _chain(found: dict[bytes, dict], skipped: list[tuple[Path, str]]) -> list[dict]:
    """The records whose parent chain reaches their namespace, parents before children."""
    ok: dict[bytes, bool] = {}

    def fits(r: dict) -> bool:
        h = r["hash"]
        if h in ok:
            return ok[h]
        ok[h] = False  # a cycle (impossible with real hashes) stays rejected
        parent = found.get(r["parent"])
        if r["kind"] == CHECKPOINT:
            good = (parent is not None and parent["kind"] != CHECKPOINT and parent["ns"] == r["ns"]
                    and parent["depth"] == r["depth"] and fits(parent))
        elif r["depth"] == 1:
            good = r["parent"] == r["ns"]
        else:
            good = (parent is not None and parent["kind"] == CHUNK and parent["ns"] == r["ns"]
                    and parent["depth"] == r["depth"] - 1 and fits(parent))
        ok[h] = good
        return good

    accepted = []
    for r in sorted(found.values(), key=lambda r: (r["depth"], r["kind"] == CHECKPOINT)):
        if fits(r):
            accepted.append(r)
        else:
            skipped.append((r["path"], "its parent record is missing or does not match"))
    return accepted


def _write(index: Index, records: list[dict], old: _Salvage) -> None:
    models: dict[bytes, dict] = {}
    for r in records:
        m = models.get(r["ns"])
        if m is None or (r["model_id"] is not None, r["mtime"]) > (m["model_id"] is not None, m["mtime"]):
            models[r["ns"]] = r
    with index.transaction() as conn:
        for ns, r in models.items():
            first = min(x["mtime"] for x in records if x["ns"] == ns)
            conn.execute(
                "INSERT OR IGNORE INTO models (ns, fingerprint, model_id, layout, chunk_size, created, "
                "last_used) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (ns, r["fingerprint"], r["model_id"] or "", old.layouts.get(ns, "{}"), r["chunk_size"],
                 first, r["mtime"]))
        conn.executemany(
            "INSERT OR IGNORE INTO records (hash, ns, parent, depth, kind, ntokens, first_token, size, "
            "checksum, created, last_access, hits, pinned, bad, tenant) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, ?)",
            [(r["hash"], r["ns"], r["parent"], r["depth"], r["kind"], r["ntokens"],
              keys.first_token(r["tokens"]), r["size"], _u64_to_i64(r["checksum"]),
              *old.records.get(r["hash"], (r["mtime"], r["mtime"], 0, 0))[:3], old.pinned(r["hash"]), r["tenant"])
             for r in records])
        conn.executemany("INSERT OR IGNORE INTO tenant_owners (tenant, owner) VALUES (?, ?)",
                         sorted({(r["tenant"], r["owner"]) for r in records if r["owner"] is not None}))
