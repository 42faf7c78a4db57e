"""The SQLite machinery under the index: connections, WAL mode, transactions and migrations.

Schema changes are numbered files in `migrations/`, each applied once in its own transaction
with its own row in `schema_migrations`; an index written by a newer kvstore is refused with a
clear message. Which errors mean a damaged file (rebuild it) and which a passing one (busy, full,
read-only) is told here too.
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvstore.errors import SchemaTooNewError, StoreOpenError

BUSY_TIMEOUT_S = 60.0
# SQLite's limit on host parameters is 32766 on current builds; stay well below it.
MAX_PARAMS = 900
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# SQLite result codes of a file that is fine but cannot be used right now: PERM, BUSY, LOCKED,
# NOMEM, READONLY, INTERRUPT, IOERR, FULL, CANTOPEN, PROTOCOL, AUTH.
_NOT_DAMAGE = {3, 5, 6, 7, 8, 9, 10, 13, 14, 15, 23}


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


def is_corruption(e: sqlite3.DatabaseError) -> bool:
    """The index file is damaged or not a kvstore index (CORRUPT, NOTADB, a missing table...),
    as opposed to busy, full, read-only or unreachable: only then is rebuilding it the answer."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF not in _NOT_DAMAGE
    return not isinstance(e, sqlite3.OperationalError)


# -- connections --------------------------------------------------------------------------------

def sqlite_uri(path: Path, **params: str) -> str:
    """A `file:` URI for `path`: escaped, so a `#` or `?` in it never names another file."""
    return f"file:{urllib.parse.quote(str(Path(path).absolute()))}?{urllib.parse.urlencode(params)}"


WAL_SIZE_LIMIT = 4 << 20  # bytes the WAL file is cut back to after a checkpoint


def connect(path: Path) -> sqlite3.Connection:
    """A connection that writes `path`: WAL mode, a busy timeout, autocommit (transactions are
    `transaction`'s)."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
    # Only takes effect on a new, empty file. With 4 KiB pages a row (its 1 KiB of token
    # ids) overflows into a page of its own: 4x the size, and a page read more per lookup.
    conn.execute("PRAGMA page_size = 16384")
    _set_wal(conn)
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = OFF")
    # After a checkpoint the WAL file is cut back to this: else it keeps the largest size it
    # ever reached (on a disk that was full, the space freed since).
    conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
    return conn


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
        # READONLY or CANTOPEN: this user cannot use the writer's -shm; IOERR or FULL: a full disk
        # left an empty -shm (no writer made it) that cannot grow. Read the snapshot.
        if not live or journal or getattr(e, "sqlite_errorcode", 0) & 0xFF not in (8, 10, 13, 14):
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


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """`BEGIN IMMEDIATE ... COMMIT`, rolled back on any exception."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


# -- migrations ---------------------------------------------------------------------------------

def applied(conn: sqlite3.Connection) -> list[int]:
    """Versions of the migrations the index has (read-only)."""
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
    ).fetchone()
    if not exists:
        return []
    return [v for (v,) in conn.execute("SELECT version FROM schema_migrations ORDER BY 1")]


def check(conn: sqlite3.Connection, path: Path, *, read_only: bool) -> list[tuple[int, str, str]]:
    """The known migrations; raises if the index was written by a newer kvstore (or, read-only,
    needs an upgrade that only a writer may make)."""
    known = available_migrations()
    newest_known = known[-1][0] if known else 0
    done = applied(conn)
    if done and done[-1] > newest_known:
        raise SchemaTooNewError(
            f"the index {path} has schema version {done[-1]}, but this kvstore only "
            f"knows up to {newest_known}: upgrade kvstore to open it (nothing was changed)"
        )
    if read_only and set(v for v, _, _ in known) - set(done):
        raise StoreOpenError(
            f"the index {path} has an older schema (version {done[-1] if done else 0}) "
            "that this kvstore upgrades when it opens the store to write; it cannot read it "
            f"read-only (open it once with write access, e.g. `kvstore verify --repair --store {path.parent}`)")
    return known


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Apply the migrations the index lacks, each in its own transaction (another process may
    be applying the same ones: each is applied once)."""
    known = check(conn, path, read_only=False)
    done = applied(conn)
    ran = False
    for version, name, sql in known:
        if version in done:
            continue
        ran = True
        with transaction(conn):
            conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at REAL NOT NULL)"
            )
            # Another process may have applied it while we waited for the write lock.
            if conn.execute("SELECT 1 FROM schema_migrations WHERE version = ?", (version,)).fetchone():
                continue
            for statement in split_sql(sql):
                conn.execute(statement)
            conn.execute(
                "INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)",
                (version, name, time.time()),
            )
    if ran and done:
        _compact_after_migration(conn)


def _compact_after_migration(conn: sqlite3.Connection) -> None:
    """A migration that rebuilt a table (0016) leaves the old one's pages free in the file
    and a WAL as big: give the space back when that is most of the file. Best effort: another
    process using the index makes VACUUM fail, and the free pages are reused anyway."""
    try:
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
        if free > pages // 2 and free * size > 64 << 20:
            conn.execute("VACUUM")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    except sqlite3.OperationalError:
        pass


def split_sql(sql: str) -> list[str]:
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
