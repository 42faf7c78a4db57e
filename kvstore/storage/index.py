"""The SQLite index: which records exist, where their chain goes, and their bookkeeping.

This module knows SQL and nothing about blobs or caches. One connection per thread (and so per
process); WAL mode so readers never wait for the writer; `BEGIN IMMEDIATE` for every write so two
writers queue on the busy timeout instead of failing half-way.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from kvstore import faults
from kvstore.errors import CorruptIndexError, StoreOpenError
from kvstore.records import CHECKPOINT, CHUNK, TAIL, RecordId  # noqa: F401 -- the kinds' home is records
from kvstore.storage import schema
from kvstore.storage.evictsql import EDGE_OF, MAX_ROLE, PINNED, ROLE_OK, TOTALS, EvictionSQL, whole  # noqa: F401 -- TOTALS: read from here
from kvstore.storage.pins import PinSQL
from kvstore.storage.schema import available_migrations, connect_read_only, is_corruption
from kvstore.storage.writesql import WriteLogSQL

_MAX_PARAMS = schema.MAX_PARAMS
#: The columns of `totals` (per namespace), and of `models`.
MODEL_FIELDS = ("ns", "fingerprint", "model_id", "layout", "chunk_size", "created", "last_used")
_MODEL_COLUMNS = ", ".join(f"m.{c}" for c in MODEL_FIELDS)
# A model_files row as `storage.stale` may read it, and a memoised digest: a damaged one is left
# out (the file is checked on its other stamps, or hashed again); verify reports it.
_FILE_OK = ("typeof(ns) = 'blob' AND typeof(path) = 'text' AND typeof(size) = 'integer' AND typeof(mtime_ns) = "
            "'integer' AND typeof(ino) = 'integer' AND typeof(ctime_ns) = 'integer' AND (digest IS NULL OR "
            "(typeof(digest) = 'blob' AND length(digest) = 16))")
_DIGEST_OK = "typeof(digest) = 'blob' AND length(digest) = 16"
_MEMOS = {"xxh3": ("file_digests", 16), "sha256": ("file_sha256", 32)}  # file digest memos: table, bytes


@dataclass(slots=True)
class Row(RecordId):
    """One record of the index: its identity (its token ids are in its blob) and bookkeeping."""

    size: int
    checksum: int
    created: float = 0.0
    last_access: float = 0.0
    hits: int = 0
    pinned: int = 0
    bad: int = 0
    role: int = 0  # the strongest role class that reached it (`upkeep.evict.ROLES`)


# The columns of a row: its fields, the tenant's tag last (a record's link is in its blob only).
_ROW_FIELDS = (*(f for f in Row.__dataclass_fields__ if f not in ("tenant", "link")), "tenant")
_ROW_COLUMNS = ", ".join(_ROW_FIELDS)
MENDABLE = ("size", "created", "last_access", "hits", "pinned", "bad", "tenant")  # `mend_rows`: bookkeeping, tenant
_ROW_COLUMNS_R = ", ".join(f"r.{c}" for c in _ROW_FIELDS)  # of `records r` in a join


def _u64_to_i64(v: int) -> int:  # (SQLite's integers are signed: a checksum is stored as one)
    return v - (1 << 64) if v >= 1 << 63 else v


def _i64_to_u64(v: int) -> int:
    return v + (1 << 64) if v < 0 else v


class Index(EvictionSQL, WriteLogSQL, PinSQL):
    """The index of one store directory (`index.sqlite`), shared by threads and processes.

    `read_only=True` never writes (nor migrates) the index: for a store this user may only read."""

    def __init__(self, path: Path, *, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._closed = False
        try:
            if read_only:
                schema.check(self.conn, self.path, read_only=True)
            else:
                schema.migrate(self.conn, self.path)
            # Reading one page of every table catches a file that is not a database at all.
            self.conn.execute("SELECT count(*) FROM meta").fetchone()
        except sqlite3.DatabaseError as e:
            self.close()
            if not is_corruption(e):  # busy, full, read-only: the file is fine, do not rebuild it
                raise StoreOpenError(f"the index {self.path} cannot be opened ({e})") from e
            raise self.corrupt(e) from e

    def corrupt(self, e: BaseException) -> CorruptIndexError:
        """The error for a damaged index file, with what to do about it."""
        return CorruptIndexError(
            f"the index {self.path} cannot be read ({e}); run `kvstore verify --repair "
            f"--store {self.path.parent}` to rebuild it from the blob files"
        )

    # -- connections and transactions -------------------------------------------------------

    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's connection (made on first use)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreOpenError("the store is closed")
            if self.read_only:
                conn = connect_read_only(self.path)
                conn.execute(f"PRAGMA busy_timeout = {int(schema.BUSY_TIMEOUT_S * 1000)}")
            else:
                conn = schema.connect(self.path)
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    def release(self) -> None:
        """Close this thread's connection, for a thread about to end (kept, it would hold two open
        files for as long as the store is open)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            return
        self._local.conn = None
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        try:
            conn.close()
        except sqlite3.Error:
            pass

    def close(self) -> None:
        self._closed = True
        with self._lock:
            for conn in self._connections:
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            self._connections.clear()
        self._local = threading.local()

    def applied(self) -> list[int]:
        """Versions of the migrations this index has (read-only)."""
        return schema.applied(self.conn)

    def pending(self) -> list[tuple[int, str, str]]:
        """Migrations not yet applied (read-only)."""
        done = set(self.applied())
        return [m for m in available_migrations() if m[0] not in done]

    def bump_counter(self, key: str, by: int = 1) -> None:
        self.bump_counters({key: by})

    def bump_counters(self, deltas: dict[str, int]) -> None:
        """`bump_counter` for several keys in one transaction."""
        with self.transaction() as conn:
            for key, by in deltas.items():
                conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, '0')", (key,))
                conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + ? WHERE key = ?", (by, key))

    # -- model fingerprints -----------------------------------------------------------------

    def file_digest(self, path: Path, st: "os.stat_result", kind: str = "xxh3") -> tuple[bytes, str | None] | None:
        """The memoised digest (`kind`: xxh3 for fingerprints, sha256 for packs) of a model file
        and its trust tag, if it is the same file as when it was hashed: same size, mtime, device,
        inode and ctime (ctime cannot be set back by a user). The caller checks the tag
        (`kvstore.trust`): a row is only a claim."""
        table, n = _MEMOS[kind]
        row = self.conn.execute(
            f"SELECT digest, tag FROM {table} WHERE path = ? AND size = ? AND mtime_ns = ? AND dev = ? "
            f"AND inode = ? AND ctime_ns = ? AND typeof(digest) = 'blob' AND length(digest) = {n}",
            (str(path), st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns),
        ).fetchone()
        return (row[0], row[1] if isinstance(row[1], str) else None) if row else None

    def remember_file_digest(self, path: Path, st: "os.stat_result", digest: bytes, tag: str | None = None,
                             kind: str = "xxh3") -> None:
        with self.transaction() as conn:
            conn.execute(
                f"INSERT OR REPLACE INTO {_MEMOS[kind][0]} (path, size, mtime_ns, dev, inode, ctime_ns, "
                "digest, tag) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (str(path), st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns, digest, tag),
            )

    def trust_epoch(self) -> float:
        """When this index got trust tags (migration 0024): every record created since was
        written with a tagged blob. 0.0 if unknown (read as: no record is from before)."""
        row = self.conn.execute("SELECT applied_at FROM schema_migrations WHERE version = 24").fetchone()
        return float(row[0]) if row and isinstance(row[0], (int, float)) else 0.0

    def register_model(
        self, ns: bytes, fingerprint: bytes, model_id: str, layout: str, chunk_size: int
    ) -> None:
        now = time.time()
        with self.transaction() as conn:
            conn.execute(
                "INSERT INTO models (ns, fingerprint, model_id, layout, chunk_size, created, "
                "last_used) VALUES (?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (ns) DO UPDATE SET model_id = excluded.model_id, "
                "last_used = excluded.last_used, layout = excluded.layout",  # a rebuild left "{}"
                (ns, fingerprint, model_id, layout, chunk_size, now, now),
            )

    def record_model_files(self, ns: bytes, files: Iterable[tuple]) -> None:
        """The files a model version was fingerprinted from, as they are now: (path, size, mtime_ns, inode,
        ctime_ns, digest or None). Replaces what was recorded of those paths (another copy's stay)."""
        files = list(files)
        with self.transaction() as conn:
            conn.executemany("DELETE FROM model_files WHERE ns = ? AND path = ?", [(ns, f[0]) for f in files])
            conn.executemany(
                "INSERT INTO model_files (ns, path, size, mtime_ns, ino, ctime_ns, digest) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(ns, *f) for f in files])

    def model_files(self, damaged: bool = False) -> dict[bytes, list[tuple]]:
        """ns -> the files recorded for it by `record_model_files` (`damaged`: only the rows
        that are left out, for verify)."""
        out: dict[bytes, list[tuple]] = {}
        for ns, *f in self.conn.execute("SELECT ns, path, size, mtime_ns, ino, ctime_ns, digest FROM model_files "
                                        f"WHERE {'NOT' if damaged else ''} ({_FILE_OK}) ORDER BY ns, path"):
            out.setdefault(ns, []).append(tuple(f))
        return out

    def damaged_digests(self) -> list[object]:
        """Paths of the memoised digests that are not a file's digest (for verify)."""
        return [p for (p,) in self.conn.execute(f"SELECT path FROM file_digests WHERE NOT ({_DIGEST_OK})")]

    def forget_damaged_files(self) -> None:
        """Delete the damaged rows of `model_files` and of the digest memo (the next bind records
        its files again; a file is hashed again)."""
        with self.transaction() as conn:
            conn.execute(f"DELETE FROM model_files WHERE NOT ({_FILE_OK})")
            conn.execute(f"DELETE FROM file_digests WHERE NOT ({_DIGEST_OK})")

    # -- records ----------------------------------------------------------------------------

    def present(self, hashes: Sequence[bytes]) -> set[bytes]:
        """Which of `hashes` have a usable (not quarantined) record."""
        found: set[bytes] = set()
        for start in range(0, len(hashes), _MAX_PARAMS):
            part = hashes[start : start + _MAX_PARAMS]
            marks = ",".join("?" * len(part))
            found.update(h for (h,) in self.conn.execute(
                f"SELECT hash FROM records WHERE hash IN ({marks}) AND bad = 0", part))
        return found

    def rows_of(self, hashes: Sequence[bytes]) -> dict[bytes, Row]:
        """The usable (not quarantined) rows of `hashes`, in one query per 900 hashes (a fetch
        reads its whole chain's rows at once)."""
        found: dict[bytes, Row] = {}
        for start in range(0, len(hashes), _MAX_PARAMS):
            part = hashes[start : start + _MAX_PARAMS]
            marks = ",".join("?" * len(part))
            for r in self.conn.execute(
                f"SELECT {_ROW_COLUMNS} FROM records WHERE hash IN ({marks}) AND bad = 0", part
            ):
                row = _row(r)
                found[row.hash] = row
        return found

    def get(self, h: bytes) -> Row | None:
        row = self.conn.execute(f"SELECT {_ROW_COLUMNS} FROM records WHERE hash = ?", (h,)).fetchone()
        return _row(row) if row else None

    def children(self, parent: bytes, first_token: int | None = None,
                 tenants: Sequence[str | None] | None = None) -> list[Row]:
        """Usable records directly under `parent`; with `first_token`, only the chunks and tails
        that start with it (the others share no token with what follows) and checkpoints; with
        `tenants`, only those of these tenants (None: shared), each read by its own index range."""
        # An edge is read only where its record agrees with it (a damaged one is verify's to mend).
        where = f" AND {EDGE_OF}" + ("" if first_token is None else " AND c.first_token IN (?, -1)")  # -1: not known
        args = (parent,) if first_token is None else (parent, first_token)
        if tenants is None:
            rows = self.conn.execute(f"SELECT {_ROW_COLUMNS_R} FROM children c JOIN records r ON r.hash = c.hash "
                                     f"WHERE c.parent = ?{where} AND r.bad = 0", args)
            return [_row(r) for r in rows]
        out = []
        for tag in tenants:
            rows = self.conn.execute(
                f"SELECT {_ROW_COLUMNS_R} FROM children c INDEXED BY children_by_tenant JOIN records r ON "
                f"r.hash = c.hash WHERE c.parent = ? AND c.tenant IS ?{where} AND r.bad = 0 AND r.tenant IS ?",
                (parent, tag, *args[1:], tag))
            out += [_row(r) for r in rows]
        return out

    def insert(self, rows: Iterable[Row], owners: Mapping[str, str] | None = None) -> int:
        """Add records (one stored already stays as it is) and `owners` (`tenant_owners`). Returns how many records."""
        now = time.time()
        values = [
            (r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, r.size,
             _u64_to_i64(r.checksum), now, now, 0, r.pinned, 0, r.role, r.tenant)
            for r in rows
        ]
        with self.transaction() as conn:
            # A quarantined record stored again is healed: its new blob has replaced the bad one.
            # A pinned one stays pinned (its tokens are the same; a pin outlives a bad read).
            healed = [(v[0],) for v in values]
            kept_pins = {h for h, in healed
                         if conn.execute(f"SELECT 1 FROM records WHERE hash = ? AND bad = 1 AND {PINNED}",
                                         (h,)).fetchone()}
            if kept_pins:
                values = [(*v[:12], 1, *v[13:]) if v[0] in kept_pins else v for v in values]
            conn.executemany("DELETE FROM records WHERE hash = ? AND bad = 1", healed)
            before = conn.total_changes
            conn.executemany(
                f"INSERT OR IGNORE INTO records ({_ROW_COLUMNS}) "
                f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                values,
            )
            # A record stored again with pin=True gets pinned.
            conn.executemany("UPDATE records SET pinned = 1 WHERE hash = ? AND pinned = 0",
                             [(v[0],) for v in values if v[12]])
            inserted = conn.total_changes - before
            conn.executemany("INSERT OR IGNORE INTO tenant_owners (tenant, owner) VALUES (?, ?)", (owners or {}).items())
            faults.hit("in_transaction")
            if any(v[12] for v in values):  # the pins file follows these pins too, as every other
                self._keep_pins_file(conn)
            return inserted

    def touch(self, accesses: dict[bytes, tuple[float, int]]) -> None:
        """Apply batched last-access times and hit counts."""
        if not accesses:
            return
        with self.transaction() as conn:
            conn.executemany(
                "UPDATE records SET last_access = max(last_access, ?), hits = hits + ? "
                "WHERE hash = ?",
                [(t, n, h) for h, (t, n) in accesses.items()],
            )

    def raise_role(self, hashes: Sequence[bytes], role: int) -> None:
        """Raise these records' role class to `role` where it is lower (never lowers one)."""
        if not hashes:
            return
        with self.transaction() as conn:
            for start in range(0, len(hashes), _MAX_PARAMS):
                part = list(hashes[start : start + _MAX_PARAMS])
                conn.execute(f"UPDATE records SET role = ? WHERE hash IN ({','.join('?' * len(part))}) "
                             f"AND (role < ? OR NOT {ROLE_OK})", [role, *part, role])  # damaged: the weakest

    def mark_bad(self, h: bytes) -> bool:
        """Quarantine a record whose blob failed to read; True if it was usable until now."""
        with self.transaction() as conn:
            cur = conn.execute("UPDATE records SET bad = 1 WHERE hash = ? AND bad = 0", (h,))
            return cur.rowcount > 0

    def delete(self, hashes: Sequence[bytes]) -> list[Row]:
        """Delete records in one transaction; returns the rows deleted (delete files after)."""
        deleted: list[Row] = []
        with self.transaction() as conn:
            for start in range(0, len(hashes), _MAX_PARAMS):
                part = list(hashes[start : start + _MAX_PARAMS])
                marks = ",".join("?" * len(part))
                deleted += [_row(r) for r in conn.execute(
                    f"SELECT {_ROW_COLUMNS} FROM records WHERE hash IN ({marks})", part)]
                conn.execute(f"DELETE FROM records WHERE hash IN ({marks})", part)
            _drop_edges(conn, [(r.parent, -1 if r.first_token is None else r.first_token, r.hash)
                               for r in deleted])
            if any(r.pinned for r in deleted):  # (a rebuild would pin them again were they restored)
                self._keep_pins_file(conn)
        return deleted

    def mend_rows(self, fields: dict[bytes, dict[str, object]]) -> None:
        """Rewrite records' bookkeeping or tenant (hash -> {column: value}) in one transaction; ValueError for others."""
        if other := {c for values in fields.values() for c in values} - set(MENDABLE):
            raise ValueError(f"mend_rows rewrites only bookkeeping columns {MENDABLE}, not {sorted(other)}")
        with self.transaction() as conn:
            for h, values in fields.items():
                if values:
                    conn.execute(f"UPDATE records SET {', '.join(f'{c} = ?' for c in values)} WHERE hash = ?",
                                 (*values.values(), h))

    def rows(self, ns: bytes | None = None) -> Iterator[Row]:
        """Every record (for verify); with `ns`, those of one namespace, parents before children."""
        where = " WHERE ns = ? ORDER BY depth, kind" if ns is not None else ""
        for r in self.conn.execute(f"SELECT {_ROW_COLUMNS} FROM records{where}", () if ns is None else (ns,)):
            yield _row(r)

    def newest(self, n: int) -> list[Row]:
        """The `n` usable records created last."""
        return [_row(r) for r in self.conn.execute(
            f"SELECT {_ROW_COLUMNS} FROM records WHERE bad = 0 ORDER BY created DESC LIMIT ?", (n,))]

    def namespaces(self) -> set[bytes]:
        """The namespace of every bound model version (the roots of every chain)."""
        return {ns for (ns,) in self.conn.execute("SELECT ns FROM models")}

    def replace_blob(self, h: bytes, size: int, checksum: int) -> bool:
        """A record's blob was written again with more of its K/V (same tokens): its new size
        and checksum, and the store's totals moved by the difference, in one transaction."""
        with self.transaction() as conn:
            row = conn.execute("SELECT ns, size FROM records WHERE hash = ?", (h,)).fetchone()
            if row is None:
                return False
            conn.execute("UPDATE records SET size = ?, checksum = ? WHERE hash = ?",
                         (size, _u64_to_i64(checksum), h))
            conn.execute("UPDATE totals SET bytes = bytes + ? WHERE ns = ?", (size - row[1], row[0]))
            conn.execute("UPDATE tenant_totals SET bytes = bytes + ? WHERE tenant = "
                         "(SELECT tenant FROM records WHERE hash = ?)", (size - row[1], h))
        return True

    def drop_redundant(self, pairs: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, int]]:
        """Delete, in one transaction, the old tail of each (old, newer) pair whose tokens the
        newer record holds, if it is still an unpinned leaf and the newer record is still stored
        and usable; the newer record takes its role if stronger (it now serves those tokens).
        Returns (hash, size) of the rows deleted: delete their files after this."""
        deleted: list[tuple[bytes, int]] = []
        with self.transaction() as conn:
            for old, newer in pairs:
                gone = conn.execute(
                    f"DELETE FROM records WHERE hash = ? AND kind = {TAIL} AND pinned = 0 AND NOT EXISTS "
                    "(SELECT 1 FROM children c JOIN records k ON k.hash = c.hash WHERE c.parent = ?) "
                    "AND EXISTS (SELECT 1 FROM records n WHERE n.hash = ? AND n.bad = 0) "
                    "RETURNING hash, size, parent, coalesce(first_token, -1), role", (old, old, newer)).fetchall()
                _drop_edges(conn, [(parent, first, h) for h, _, parent, first, _ in gone])
                for role in [r for *_, r in gone if type(r) is int and 0 < r <= MAX_ROLE]:
                    conn.execute(f"UPDATE records SET role = ? WHERE hash = ? AND (role < ? OR NOT {ROLE_OK})",
                                 (role, newer, role))
                deleted += [(h, size) for h, size, _, _, _ in gone]
        return deleted

    def file_bytes(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def models(self) -> list[dict]:
        """One dict per bound model version, with its record totals and use. A field of the
        wrong type (damage, which `verify` reports) is None, or "?" for a hash; a row whose
        namespace is not a hash is left out."""
        per_ns = self.namespace_totals()
        rows = self.conn.execute(
            f"SELECT {_MODEL_COLUMNS}, "
            "(SELECT coalesce(sum(CASE WHEN typeof(hits) = 'integer' THEN hits END), 0) FROM records r "
            "WHERE r.ns = m.ns), (SELECT max(CASE WHEN typeof(last_access) IN ('integer', 'real') "
            "THEN last_access END) FROM records r WHERE r.ns = m.ns) FROM models m ORDER BY m.last_used DESC")
        out = []
        for ns, fingerprint, model_id, layout, chunk_size, created, last_used, hits, last_access in rows:
            if not isinstance(ns, bytes):
                continue
            used = [t for t in (last_used, last_access) if type(t) in (int, float)]
            stored, chunks, tails, checkpoints = per_ns.get(ns, (0, 0, 0, 0))
            out.append({
                "namespace": ns.hex(),
                "fingerprint": fingerprint.hex() if isinstance(fingerprint, bytes) else "?",
                "model_id": str(model_id),
                "layout": _layout(layout),
                "chunk_size": chunk_size if whole(chunk_size) and chunk_size > 0 else None,
                "created": created if type(created) in (int, float) else None,
                "last_used": max(used) if used else None,
                "chunks": chunks, "tails": tails, "bytes": stored, "hits": hits, "checkpoints": checkpoints,
            })
        return out

    def model_rows(self) -> list[tuple]:
        """Every row of `models` as stored, in `MODEL_FIELDS` order (for verify)."""
        return self.conn.execute(f"SELECT {_MODEL_COLUMNS} FROM models m").fetchall()

    def rewrite_model(self, ns, fields: dict) -> None:
        """Set these `MODEL_FIELDS` of the models row `ns`; no fields: delete the row."""
        with self.transaction() as conn:
            if not fields:
                conn.execute("DELETE FROM models WHERE ns = ?", (ns,))
                return
            if not set(fields) <= set(MODEL_FIELDS):
                raise ValueError(f"not columns of models: {sorted(set(fields) - set(MODEL_FIELDS))}")
            sets = ", ".join(f"{name} = ?" for name in fields)
            conn.execute(f"UPDATE models SET {sets} WHERE ns = ?", (*fields.values(), ns))

    def counters(self) -> dict[str, int]:
        """The `count.` keys of `meta` (a value that is not a whole number is left out)."""
        rows = self.conn.execute("SELECT key, value FROM meta WHERE key LIKE 'count.%'")
        return {k: int(v) for k, v in rows if str(v).lstrip("-").isdigit()}


def _drop_edges(conn: sqlite3.Connection, edges: Iterable[tuple[bytes, int, bytes]]) -> None:
    """Delete these (parent, first token or -1, hash) edges of `children`, in the caller's transaction."""
    conn.executemany("DELETE FROM children WHERE parent = ? AND first_token = ? AND hash = ?", edges)


def _row(r: tuple) -> Row:
    values = list(r)
    tenant = values.pop()
    if isinstance(values[8], int):  # a row of the wrong type is left for verify to report
        values[8] = _i64_to_u64(values[8])
    return Row(*values, tenant=tenant)


def _layout(text: str) -> object:
    """A stored cache layout (JSON) as the object it is; text that is not JSON as it is."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text
