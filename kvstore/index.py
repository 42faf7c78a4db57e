"""The SQLite index: which records exist, where their chain goes, and their bookkeeping.

This module knows SQL and nothing about blobs or caches. One connection per thread (and so per
process); WAL mode so readers never wait for the writer; `BEGIN IMMEDIATE` for every write so two
writers queue on the busy timeout instead of failing half-way.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from . import faults
from .errors import CorruptIndexError, SchemaTooNewError, StoreOpenError

BUSY_TIMEOUT_S = 60.0
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# SQLite's limit on host parameters is 32766 on current builds; stay well below it.
_MAX_PARAMS = 900

CHUNK, TAIL, CHECKPOINT = 0, 1, 2


def migrations_dir() -> Path:
    """Where the numbered schema files are: inside the wheel, or at the top of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "migrations", here.parent / "migrations"):
        if candidate.is_dir():
            return candidate
    raise StoreOpenError(f"kvstore's migrations/ folder is missing (looked beside {here})")


def available_migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every migration file, in order."""
    found = []
    for p in sorted(migrations_dir().iterdir()):
        m = _MIGRATION_NAME.match(p.name)
        if m:
            found.append((int(m.group(1)), p.name, p.read_text()))
    return found


@dataclass(frozen=True)
class Row:
    """One record of the index."""

    hash: bytes
    ns: bytes
    parent: bytes
    depth: int
    kind: int
    ntokens: int
    tokens: bytes
    size: int
    checksum: int
    created: float = 0.0
    last_access: float = 0.0
    hits: int = 0
    pinned: int = 0
    bad: int = 0


_ROW_COLUMNS = ", ".join(Row.__dataclass_fields__)


def _u64_to_i64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _i64_to_u64(v: int) -> int:
    return v + (1 << 64) if v < 0 else v


class Index:
    """The index of one store directory (`index.sqlite`), shared by threads and processes."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._closed = False
        try:
            self._migrate()
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
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreOpenError("the store is closed")
            conn = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            # Only takes effect on a new, empty file. With 4 KiB pages a row (its 1 KiB of token
            # ids) overflows into a page of its own: 4x the size, and a page read more per lookup.
            conn.execute("PRAGMA page_size = 16384")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.execute("PRAGMA foreign_keys = OFF")
            self._local.conn = conn
            with self._lock:
                self._connections.append(conn)
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """`BEGIN IMMEDIATE ... COMMIT`, rolled back on any exception."""
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

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

    # -- schema -----------------------------------------------------------------------------

    def applied(self) -> list[int]:
        """Versions of the migrations this index has (read-only)."""
        conn = self.conn
        exists = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
        ).fetchone()
        if not exists:
            return []
        return [v for (v,) in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]

    def pending(self) -> list[tuple[int, str, str]]:
        """Migrations not yet applied (read-only)."""
        done = set(self.applied())
        return [m for m in available_migrations() if m[0] not in done]

    def _migrate(self) -> None:
        known = available_migrations()
        newest_known = known[-1][0] if known else 0
        applied = self.applied()
        if applied and applied[-1] > newest_known:
            raise SchemaTooNewError(
                f"the index {self.path} has schema version {applied[-1]}, but this kvstore only "
                f"knows up to {newest_known}: upgrade kvstore to open it (nothing was changed)"
            )
        for version, name, sql in known:
            if version in applied:
                continue
            with self.transaction() as conn:
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations "
                    "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
                )
                # Another process may have applied it while we waited for the write lock.
                if conn.execute(
                    "SELECT 1 FROM schema_migrations WHERE version = ?", (version,)
                ).fetchone():
                    continue
                for statement in _split_sql(sql):
                    conn.execute(statement)
                conn.execute(
                    "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                    (version, name, time.time()),
                )

    # -- settings ---------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def bump_counter(self, key: str, by: int = 1) -> None:
        with self.transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, '0')", (key,))
            conn.execute(
                "UPDATE meta SET value = CAST(value AS INTEGER) + ? WHERE key = ?", (by, key)
            )

    # -- model fingerprints -----------------------------------------------------------------

    def file_digest(self, path: Path, size: int, mtime_ns: int) -> bytes | None:
        row = self.conn.execute(
            "SELECT digest FROM file_digests WHERE path = ? AND size = ? AND mtime_ns = ?",
            (str(path), size, mtime_ns),
        ).fetchone()
        return row[0] if row else None

    def remember_file_digest(self, path: Path, size: int, mtime_ns: int, digest: bytes) -> None:
        with self.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO file_digests (path, size, mtime_ns, digest) "
                "VALUES (?, ?, ?, ?)",
                (str(path), size, mtime_ns, digest),
            )

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

    # -- records ----------------------------------------------------------------------------

    def present(self, hashes: Sequence[bytes]) -> set[bytes]:
        """Which of `hashes` have a usable (not quarantined) record."""
        found: set[bytes] = set()
        for start in range(0, len(hashes), _MAX_PARAMS):
            part = hashes[start : start + _MAX_PARAMS]
            marks = ",".join("?" * len(part))
            found.update(
                h
                for (h,) in self.conn.execute(
                    f"SELECT hash FROM records WHERE hash IN ({marks}) AND bad = 0", part
                )
            )
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
        row = self.conn.execute(
            f"SELECT {_ROW_COLUMNS} FROM records WHERE hash = ?", (h,)
        ).fetchone()
        return _row(row) if row else None

    def children(self, parent: bytes, first_token: int | None = None) -> list[Row]:
        """Usable records directly under `parent`; with `first_token`, only the chunks and tails
        that start with it (the others share no token with what follows)."""
        if first_token is None:
            rows = self.conn.execute(
                f"SELECT {_ROW_COLUMNS} FROM records WHERE parent = ? AND bad = 0", (parent,)
            )
        else:
            rows = self.conn.execute(
                f"SELECT {_ROW_COLUMNS} FROM records WHERE parent = ? "
                "AND (first_token = ? OR first_token IS NULL) AND bad = 0", (parent, first_token)
            )
        return [_row(r) for r in rows]

    def insert(self, rows: Iterable[Row]) -> int:
        """Add records (a record that exists already is left as it is). Returns how many."""
        now = time.time()
        values = [
            (r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.tokens, r.size,
             _u64_to_i64(r.checksum), now, now, 0, r.pinned, 0,
             int.from_bytes(r.tokens[:4], "little", signed=True) if len(r.tokens) >= 4 else None)
            for r in rows
        ]
        with self.transaction() as conn:
            # A quarantined record stored again is healed: its new blob has replaced the bad one.
            conn.executemany("DELETE FROM records WHERE hash = ? AND bad = 1", [(v[0],) for v in values])
            before = conn.total_changes
            conn.executemany(
                f"INSERT OR IGNORE INTO records ({_ROW_COLUMNS}, first_token) "
                f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                values,
            )
            # A record stored again with pin=True gets pinned.
            conn.executemany(
                "UPDATE records SET pinned = 1 WHERE hash = ? AND pinned = 0",
                [(v[0],) for v in values if v[12]],
            )
            inserted = conn.total_changes - before
            faults.hit("in_transaction")
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

    def pin(self, hashes: Sequence[bytes], pinned: bool = True) -> None:
        with self.transaction() as conn:
            conn.executemany(
                "UPDATE records SET pinned = ? WHERE hash = ?", [(int(pinned), h) for h in hashes]
            )

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
                deleted += [
                    _row(r)
                    for r in conn.execute(
                        f"SELECT {_ROW_COLUMNS} FROM records WHERE hash IN ({marks})", part
                    )
                ]
                conn.execute(f"DELETE FROM records WHERE hash IN ({marks})", part)
        return deleted

    def rows(self) -> Iterator[Row]:
        """Every record (for verify)."""
        for r in self.conn.execute(f"SELECT {_ROW_COLUMNS} FROM records"):
            yield _row(r)

    def namespaces(self) -> set[bytes]:
        """The namespace of every bound model version (the roots of every chain)."""
        return {ns for (ns,) in self.conn.execute("SELECT ns FROM models")}

    # -- eviction ---------------------------------------------------------------------------

    def eviction_graph(self) -> list[tuple[bytes, bytes, int, float, int]]:
        """(hash, parent, size, last access, pinned) of every record, for planning an eviction."""
        return self.conn.execute("SELECT hash, parent, size, last_access, pinned FROM records").fetchall()

    def delete_leaves(self, hashes: Sequence[bytes]) -> list[Row]:
        """Delete, in order and in one transaction, those of `hashes` that are unpinned and still
        leaves (another process may have added a child since they were chosen). Returns the rows
        deleted: delete their files only now that this has committed."""
        deleted: list[Row] = []
        with self.transaction() as conn:
            for h in hashes:
                row = conn.execute(
                    f"SELECT {_ROW_COLUMNS} FROM records WHERE hash = ? AND pinned = 0 AND NOT EXISTS "
                    "(SELECT 1 FROM records c WHERE c.parent = ?)", (h, h)).fetchone()
                if row is not None:
                    conn.execute("DELETE FROM records WHERE hash = ?", (h,))
                    deleted.append(_row(row))
        return deleted

    # -- totals -----------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        row = self.conn.execute(
            "SELECT coalesce(sum(bytes), 0), coalesce(sum(chunks), 0), coalesce(sum(tails), 0), "
            "coalesce(sum(checkpoints), 0) FROM totals"
        ).fetchone()
        return {"bytes": row[0], "chunks": row[1], "tails": row[2], "checkpoints": row[3]}

    def models(self) -> list[dict]:
        """One dict per bound model version, with its record totals and use."""
        rows = self.conn.execute(
            "SELECT m.ns, m.fingerprint, m.model_id, m.layout, m.chunk_size, m.created, "
            "m.last_used, coalesce(t.chunks, 0), coalesce(t.tails, 0), coalesce(t.bytes, 0), "
            "(SELECT coalesce(sum(hits), 0) FROM records r WHERE r.ns = m.ns), "
            "(SELECT max(last_access) FROM records r WHERE r.ns = m.ns), coalesce(t.checkpoints, 0) "
            "FROM models m LEFT JOIN totals t ON t.ns = m.ns ORDER BY m.last_used DESC"
        )
        return [
            {
                "namespace": r[0].hex(),
                "fingerprint": r[1].hex(),
                "model_id": r[2],
                "layout": r[3],
                "chunk_size": r[4],
                "created": r[5],
                "last_used": max(r[6], r[11] or 0),
                "chunks": r[7],
                "tails": r[8],
                "bytes": r[9],
                "hits": r[10],
                "checkpoints": r[12],
            }
            for r in rows
        ]

    def counters(self) -> dict[str, int]:
        return {
            k: int(v)
            for k, v in self.conn.execute(
                "SELECT key, value FROM meta WHERE key LIKE 'count.%'"
            )
        }


# SQLite result codes of a file that is fine but cannot be used right now: PERM, BUSY, LOCKED,
# NOMEM, READONLY, INTERRUPT, IOERR, FULL, CANTOPEN, PROTOCOL, AUTH.
_NOT_DAMAGE = {3, 5, 6, 7, 8, 9, 10, 13, 14, 15, 23}


def is_corruption(e: sqlite3.DatabaseError) -> bool:
    """The index file is damaged or not a kvstore index (CORRUPT, NOTADB, a missing table...),
    as opposed to busy, full, read-only or unreachable: only then is rebuilding it the answer."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF not in _NOT_DAMAGE
    return not isinstance(e, sqlite3.OperationalError)


def _row(r: tuple) -> Row:
    values = list(r)
    values[8] = _i64_to_u64(values[8])
    return Row(*values)


def _split_sql(sql: str) -> list[str]:
    """Statements of a migration file; trigger bodies (BEGIN ... END;) stay whole."""
    statements, current = [], []
    for line in sql.splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("--")):
            continue
        current.append(line)
        text = "\n".join(current)
        if stripped.endswith(";") and sqlite3.complete_statement(text):
            statements.append(text)
            current = []
    if current and "\n".join(current).strip():
        statements.append("\n".join(current))
    return statements
