"""The SQLite index: which records exist, where their chain goes, and their bookkeeping.

This module knows SQL and nothing about blobs or caches. One connection per thread (and so per
process); WAL mode so readers never wait for the writer; `BEGIN IMMEDIATE` for every write so two
writers queue on the busy timeout instead of failing half-way.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from kvstore import faults
from kvstore.errors import CorruptIndexError, SchemaTooNewError, StoreOpenError

BUSY_TIMEOUT_S = 60.0
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# SQLite's limit on host parameters is 32766 on current builds; stay well below it.
_MAX_PARAMS = 900

CHUNK, TAIL, CHECKPOINT = 0, 1, 2


def migrations_dir() -> Path:
    """Where the numbered schema files are: inside the wheel, or at the top of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "migrations", here.parent.parent / "migrations"):
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
    first_token: int | None  # the record's first token id (None for a checkpoint): its ids are in its blob
    size: int
    checksum: int
    created: float = 0.0
    last_access: float = 0.0
    hits: int = 0
    pinned: int = 0
    bad: int = 0


_ROW_COLUMNS = ", ".join(Row.__dataclass_fields__)
_ROW_COLUMNS_R = ", ".join(f"r.{c}" for c in Row.__dataclass_fields__)  # of `records r` in a join


def _u64_to_i64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _i64_to_u64(v: int) -> int:
    return v + (1 << 64) if v < 0 else v


def sqlite_uri(path: Path, **params: str) -> str:
    """A `file:` URI for `path`: escaped, so a `#` or `?` in it never names another file."""
    return f"file:{urllib.parse.quote(str(Path(path).absolute()))}?{urllib.parse.urlencode(params)}"


def connect_read_only(path: Path, timeout: float = BUSY_TIMEOUT_S, *,
                      journal: bool = False) -> sqlite3.Connection:
    """A connection that never writes `path` nor makes a file beside it. With no -wal and -shm
    there (no writer has the index open) SQLite would create them even read-only, so the index
    is read as an immutable snapshot; with them there, their changes are read too. `journal`:
    the caller may write the store, so SQLite may make them (and reads a -wal left alone)."""
    live = journal or (os.path.exists(f"{path}-wal") and os.path.exists(f"{path}-shm"))
    params = {"mode": "ro"} if live else {"mode": "ro", "immutable": "1"}
    conn = sqlite3.connect(sqlite_uri(path, **params), uri=True, timeout=timeout,
                           isolation_level=None, check_same_thread=False)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.Error as e:
        conn.close()
        # READONLY or CANTOPEN: this user cannot use the writer's -shm; read the snapshot.
        if not live or journal or getattr(e, "sqlite_errorcode", 0) & 0xFF not in (8, 14):
            raise
    return sqlite3.connect(sqlite_uri(path, mode="ro", immutable="1"), uri=True, timeout=timeout,
                           isolation_level=None, check_same_thread=False)


def _set_wal(conn: sqlite3.Connection) -> None:
    """WAL mode. Switching a new file to it needs an exclusive lock, and while other processes
    open (and switch) the same new file SQLite may answer "database is locked" at once, without
    its busy handler, or even "disk I/O error": both pass once the first switch is done."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    io_errors = 0
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL").fetchone()
            return
        except sqlite3.OperationalError as e:
            io_errors += "disk I/O" in str(e)
            if not ("locked" in str(e) or "disk I/O" in str(e)) or io_errors > 50 \
                    or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


class Index:
    """The index of one store directory (`index.sqlite`), shared by threads and processes.

    `read_only=True` never writes (nor migrates) the index: for a store this user may only read.
    """

    def __init__(self, path: Path, *, read_only: bool = False):
        self.path = Path(path)
        self.read_only = read_only
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[sqlite3.Connection] = []
        self._closed = False
        try:
            if read_only:
                self._check_schema()
            else:
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
            if self.read_only:
                conn = connect_read_only(self.path)
                conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
                self._local.conn = conn
                with self._lock:
                    self._connections.append(conn)
                return conn
            conn = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            # Only takes effect on a new, empty file. With 4 KiB pages a row (its 1 KiB of token
            # ids) overflows into a page of its own: 4x the size, and a page read more per lookup.
            conn.execute("PRAGMA page_size = 16384")
            _set_wal(conn)
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

    def _check_schema(self) -> list[tuple[int, str, str]]:
        """The known migrations; raises if the index was written by a newer kvstore."""
        known = available_migrations()
        newest_known = known[-1][0] if known else 0
        applied = self.applied()
        if applied and applied[-1] > newest_known:
            raise SchemaTooNewError(
                f"the index {self.path} has schema version {applied[-1]}, but this kvstore only "
                f"knows up to {newest_known}: upgrade kvstore to open it (nothing was changed)"
            )
        if self.read_only and set(v for v, _, _ in known) - set(applied):
            raise StoreOpenError(
                f"the index {self.path} has an older schema (version {applied[-1] if applied else 0}) "
                "that this kvstore upgrades when it opens the store to write; it cannot read it "
                "read-only (open it once with write access, e.g. `kvstore verify --repair`)")
        return known

    def _migrate(self) -> None:
        known = self._check_schema()
        applied = self.applied()
        ran = False
        for version, name, sql in known:
            if version in applied:
                continue
            ran = True
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
        if ran and applied:
            self._compact_after_migration()

    def _compact_after_migration(self) -> None:
        """A migration that rebuilt a table (0016) leaves the old one's pages free in the file
        and a WAL as big: give the space back when that is most of the file. Best effort: another
        process using the index makes VACUUM fail, and the free pages are reused anyway."""
        conn = self.conn
        try:
            (free,) = conn.execute("PRAGMA freelist_count").fetchone()
            (pages,) = conn.execute("PRAGMA page_count").fetchone()
            (size,) = conn.execute("PRAGMA page_size").fetchone()
            if free > pages // 2 and free * size > 64 << 20:
                conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.OperationalError:
            pass

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

    def bump_counters(self, deltas: dict[str, int]) -> None:
        """`bump_counter` for several keys in one transaction."""
        with self.transaction() as conn:
            for key, by in deltas.items():
                conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, '0')", (key,))
                conn.execute("UPDATE meta SET value = CAST(value AS INTEGER) + ? WHERE key = ?", (by, key))

    # -- model fingerprints -----------------------------------------------------------------

    def file_digest(self, path: Path, st: "os.stat_result") -> bytes | None:
        """The memoised digest of a model file, if it is the same file as when it was hashed:
        same size, mtime, device, inode and ctime (ctime cannot be set back by a user)."""
        row = self.conn.execute(
            "SELECT digest FROM file_digests WHERE path = ? AND size = ? AND mtime_ns = ? "
            "AND dev = ? AND inode = ? AND ctime_ns = ?",
            (str(path), st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns),
        ).fetchone()
        return row[0] if row else None

    def remember_file_digest(self, path: Path, st: "os.stat_result", digest: bytes) -> None:
        with self.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO file_digests (path, size, mtime_ns, dev, inode, ctime_ns, "
                "digest) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (str(path), st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns, digest),
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

    def record_model_files(self, ns: bytes, stamps: Iterable[tuple[str, int, int, int, int]]) -> None:
        """The files a model version was fingerprinted from, as they are now: (path, size,
        mtime_ns, inode, ctime_ns). Replaces what was recorded for `ns`."""
        with self.transaction() as conn:
            conn.execute("DELETE FROM model_files WHERE ns = ?", (ns,))
            conn.executemany(
                "INSERT INTO model_files (ns, path, size, mtime_ns, ino, ctime_ns) VALUES (?, ?, ?, ?, ?, ?)",
                [(ns, *stamp) for stamp in stamps])

    def model_files(self) -> dict[bytes, list[tuple[str, int, int, int, int]]]:
        """ns -> the files recorded for it by `record_model_files`."""
        out: dict[bytes, list[tuple[str, int, int, int, int]]] = {}
        for ns, *stamp in self.conn.execute(
                "SELECT ns, path, size, mtime_ns, ino, ctime_ns FROM model_files ORDER BY ns, path"):
            out.setdefault(ns, []).append(tuple(stamp))
        return out

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
        that start with it (the others share no token with what follows) and checkpoints."""
        where = "" if first_token is None else " AND c.first_token IN (?, -1)"  # -1: not known
        rows = self.conn.execute(
            f"SELECT {_ROW_COLUMNS_R} FROM children c JOIN records r ON r.hash = c.hash "
            f"WHERE c.parent = ?{where} AND r.bad = 0",
            (parent,) if first_token is None else (parent, first_token))
        return [_row(r) for r in rows]

    def insert(self, rows: Iterable[Row]) -> int:
        """Add records (a record that exists already is left as it is). Returns how many."""
        now = time.time()
        values = [
            (r.hash, r.ns, r.parent, r.depth, r.kind, r.ntokens, r.first_token, r.size,
             _u64_to_i64(r.checksum), now, now, 0, r.pinned, 0)
            for r in rows
        ]
        with self.transaction() as conn:
            # A quarantined record stored again is healed: its new blob has replaced the bad one.
            conn.executemany("DELETE FROM records WHERE hash = ? AND bad = 1", [(v[0],) for v in values])
            before = conn.total_changes
            conn.executemany(
                f"INSERT OR IGNORE INTO records ({_ROW_COLUMNS}) "
                f"VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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

    def pin(self, hashes: Sequence[bytes], pinned: bool = True) -> int:
        """Set the pin flag of these records; returns how many of them exist (and so were set)."""
        with self.transaction() as conn:
            cur = conn.executemany(
                "UPDATE records SET pinned = ? WHERE hash = ?", [(int(pinned), h) for h in hashes]
            )
            return cur.rowcount

    def pinned(self, ns: bytes) -> set[bytes]:
        """Hashes of the pinned records of a namespace (published to a remote tier)."""
        return {h for (h,) in self.conn.execute("SELECT hash FROM records WHERE ns = ? AND pinned = 1", (ns,))}

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
            _drop_edges(conn, [(r.parent, -1 if r.first_token is None else r.first_token, r.hash)
                               for r in deleted])
        return deleted

    def rows(self) -> Iterator[Row]:
        """Every record (for verify)."""
        for r in self.conn.execute(f"SELECT {_ROW_COLUMNS} FROM records"):
            yield _row(r)

    def namespaces(self) -> set[bytes]:
        """The namespace of every bound model version (the roots of every chain)."""
        return {ns for (ns,) in self.conn.execute("SELECT ns FROM models")}

    # -- eviction ---------------------------------------------------------------------------

    def eviction_graph(self, stale: Sequence[bytes] = ()) -> list[tuple]:
        """(hash + parent, last access, size * 16 + flags) of every record, for planning an
        eviction (`evict.Graph.from_index`); flags: 1 pinned, 2 of a namespace in `stale`, 4 hangs
        from its namespace, 8 quarantined. Three columns, two of them numbers: at a million rows
        making the Python values is most of the time this takes."""
        stale = list(stale)[:_MAX_PARAMS]
        marks = ",".join("?" * len(stale))
        flag = f"(ns IN ({marks})) * 2" if stale else "0"
        return self.conn.execute(
            f"SELECT CAST(hash || parent AS BLOB), last_access, "
            f"size * 16 + (pinned != 0) + {flag} + (parent = ns) * 4 + (bad != 0) * 8 FROM records"
            # A row of the wrong type (a TEXT hash, say) is never planned: verify reports it.
            " WHERE typeof(hash) = 'blob' AND length(hash) = 16 AND typeof(parent) = 'blob'"
            " AND length(parent) = 16 AND typeof(size) = 'integer'"
            " AND typeof(last_access) IN ('integer', 'real') AND typeof(pinned) = 'integer'"
            " AND typeof(bad) = 'integer'",
            stale).fetchall()

    @contextmanager
    def victims(self, hashes: Iterable[bytes]) -> Iterator[None]:
        """What gc evicts, held for `evict` in a table of this connection's own (in memory)."""
        conn = self.conn
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("DROP TABLE IF EXISTS temp.victims")
        conn.execute("CREATE TEMP TABLE victims (hash BLOB PRIMARY KEY) WITHOUT ROWID")
        try:
            hashes = sorted(hashes)
            conn.execute("BEGIN")  # (of the temporary table only: no lock on the index)
            try:
                for start in range(0, len(hashes), _MAX_PARAMS):
                    part = hashes[start : start + _MAX_PARAMS]
                    conn.execute("INSERT OR IGNORE INTO temp.victims VALUES " + ",".join(["(?)"] * len(part)), part)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            yield
        finally:
            conn.execute("DROP TABLE IF EXISTS temp.victims")

    def evict(self, lo: bytes, hi: bytes) -> list[tuple[bytes, int, bytes]]:
        """Delete, in one transaction, the records of `victims` from `lo` to `hi` (hashes,
        inclusive: neighbours in the table) that are unpinned and have no stored child outside
        the victims. The check is made here, so a record pinned, or given a new child by another
        process, since gc chose it stays. Returns (hash, size, first 2 bytes of its parent) of
        the rows deleted: delete their files only now that this has committed, and then their
        edges (`forget_edges`)."""
        with self.transaction() as conn:
            return conn.execute(
                "DELETE FROM records WHERE hash IN (SELECT hash FROM temp.victims WHERE hash BETWEEN ? AND ?) "
                "AND pinned = 0 AND NOT EXISTS (SELECT 1 FROM children c JOIN records k ON k.hash = c.hash "
                "WHERE c.parent = records.hash AND c.hash NOT IN (SELECT hash FROM temp.victims)) "
                "RETURNING hash, size, substr(parent, 1, 2)", (lo, hi)).fetchall()

    def forget_edges(self, lo: bytes, hi: bytes | None) -> int:
        """Delete, in one transaction, the edges of `children` from parents `lo` (a hash prefix,
        inclusive) to `hi` (exclusive; None: to the end) to the records of `victims` that are not
        stored (any more). Returns how many went."""
        with self.transaction() as conn:
            bound = "" if hi is None else " AND parent < ?"
            return conn.execute(
                f"DELETE FROM children WHERE parent >= ?{bound} "
                "AND hash IN (SELECT hash FROM temp.victims) AND NOT EXISTS "
                "(SELECT 1 FROM records r WHERE r.hash = children.hash)",
                (lo,) if hi is None else (lo, hi)).rowcount

    def forget_lost_edges(self) -> int:
        """Delete every edge whose record is gone (a gc stopped between its two sweeps leaves
        some; readers ignore them). A scan of the whole table: for `verify --repair`."""
        with self.transaction() as conn:
            return conn.execute(
                "DELETE FROM children WHERE NOT EXISTS "
                "(SELECT 1 FROM records r WHERE r.hash = children.hash)").rowcount

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
        return True

    def drop_redundant(self, pairs: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, int]]:
        """Delete, in one transaction, the old tail of each (old, newer) pair whose tokens the
        newer record holds, if it is still an unpinned leaf and the newer record is still stored
        and usable. Returns (hash, size) of the rows deleted: delete their files after this."""
        deleted: list[tuple[bytes, int]] = []
        with self.transaction() as conn:
            for old, newer in pairs:
                gone = conn.execute(
                    f"DELETE FROM records WHERE hash = ? AND kind = {TAIL} AND pinned = 0 AND NOT EXISTS "
                    "(SELECT 1 FROM children c JOIN records k ON k.hash = c.hash WHERE c.parent = ?) "
                    "AND EXISTS (SELECT 1 FROM records n WHERE n.hash = ? AND n.bad = 0) "
                    "RETURNING hash, size, parent, coalesce(first_token, -1)", (old, old, newer)).fetchall()
                _drop_edges(conn, [(parent, first, h) for h, _, parent, first in gone])
                deleted += [(h, size) for h, size, _, _ in gone]
        return deleted

    @contextmanager
    def bulk(self, cache_kib: int = 256 << 10) -> Iterator[None]:
        """For a long job of many transactions (gc) on this thread's connection: a bigger page
        cache, and no checkpoint inside its commits (it calls `checkpoint` between them, when
        it holds no lock); then the defaults again."""
        conn = self.conn
        (before,) = conn.execute("PRAGMA cache_size").fetchone()
        (every,) = conn.execute("PRAGMA wal_autocheckpoint").fetchone()
        conn.execute(f"PRAGMA cache_size = -{int(cache_kib)}")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        try:
            yield
        finally:
            conn.execute(f"PRAGMA cache_size = {int(before)}")
            conn.execute(f"PRAGMA wal_autocheckpoint = {int(every)}")
            self.checkpoint()

    def file_bytes(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the database as far as readers allow; never waits for
        a writer or blocks one (SQLite's PASSIVE checkpoint)."""
        try:
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.OperationalError:  # busy: a later one does it
            pass

    # -- totals -----------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        row = self.conn.execute(
            "SELECT coalesce(sum(bytes), 0), coalesce(sum(chunks), 0), coalesce(sum(tails), 0), "
            "coalesce(sum(checkpoints), 0) FROM totals"
        ).fetchone()
        return {"bytes": row[0], "chunks": row[1], "tails": row[2], "checkpoints": row[3]}

    def quarantined(self) -> tuple[int, int]:
        """(records, bytes) of the records quarantined now: never served, held until a gc (one
        scan of the table: 0.08 s at a million rows)."""
        n, size = self.conn.execute(
            "SELECT count(*), coalesce(sum(size), 0) FROM records WHERE bad != 0").fetchone()
        return n, size

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


def _drop_edges(conn: sqlite3.Connection, edges: Iterable[tuple[bytes, int, bytes]]) -> None:
    """Delete these (parent, first token or -1, hash) edges of `children`, in the caller's transaction."""
    conn.executemany("DELETE FROM children WHERE parent = ? AND first_token = ? AND hash = ?", edges)


def _row(r: tuple) -> Row:
    values = list(r)
    if isinstance(values[8], int):  # a row of the wrong type is left for verify to report
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
