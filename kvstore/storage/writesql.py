"""The SQL of what the store writes: the hourly write log the write budget and `stats` read, the
seen marks of `admit="reused"`, the store's own settings, what computed its exact-mode records,
and the deletion and insertion logs (what the index stopped and started serving, which servers
that publish KV events read).

Mixed into `Index` (which gives it `conn` and `transaction`), as `evictsql` is. A store opened
read-only whose index predates these tables reads them as empty.

Every row is checked where it is read, and a damaged one never turns a limit off: a write-log
value that is not a whole number of 0 to `MAX_HOUR_BYTES` reads as None, and its hour as the
whole budget (`window_bytes`), and so does the hour verify's repair set to 0 (`closed_hour`: the
log keeps only what was written, so the lifetime counts stay true); a seen mark of the wrong
type is not seen; a kept setting that its row of `kvstore.settings` does not parse reads as that
row says a damaged one reads (the default, or no automatic writes for `max_write_rate`), with
one warning. `verify` reports each
(`damaged_log`, `damaged_seen`, `damaged_settings`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import time
from typing import Iterable, Sequence

from kvstore import settings
from kvstore.errors import InvalidInputError
from kvstore.storage import schema
from kvstore.storage.storedir import SETTINGS_FORMAT, SETTINGS_NAME, read_settings_copy, write_own_file

log = logging.getLogger("kvstore")

_MAX_PARAMS = schema.MAX_PARAMS
_LOGS = {"deletion_log": "deletion_log", "insertion_log": "insertion_log"}  # the only tables a log name may be
#: An entry of those logs as their readers take it: numbered as the triggers number them (one up
#: per change: no store reaches 2**62), naming a 16-byte record and namespace. Any other is skipped.
MAX_LOG_SEQ = 1 << 62
_LOG_OK = (f"seq BETWEEN 1 AND {MAX_LOG_SEQ} AND typeof(hash) = 'blob' AND length(hash) = 16 "
           "AND typeof(ns) = 'blob' AND length(ns) = 16")
HOUR_S = 3600
#: Hours of the write log the write budget sums: the current one and the 24 before it. A row of
#: a later hour (logged by a clock that was ahead) counts too, up to this many hours ahead.
WINDOW_HOURS = 25
#: More than any disk writes in an hour (about 300 GB/s): a write-log value above it is damage.
MAX_HOUR_BYTES = 1 << 50


def hour_of(t: float) -> int:
    """The write log's hour of unix time `t`."""
    return int(t // HOUR_S)


#: The columns of `write_log` a caller may add to.
LOG_COLUMNS = ("bytes", "records", "downloaded", "not_admitted", "not_admitted_bytes", "over_budget",
               "over_budget_bytes", "explicit")
_SETTING = "setting."
_SAID_COPY: set = set()  # (index, setting) read from the copy beside it: said once a process
#: The last hour whose log `mend_log` set to 0 (or a rebuild could not read): the budget counts it
#: as full while it is in the window, with no bytes logged that were never written.
_CLOSED = "write_log.closed"
_COMPUTED = "computed_with."  # + a namespace's hex: a JSON list of what computed its exact-mode records
_MAX_COMPUTED = 4
#: The columns of `seen_prefixes` as a reader may trust them.
_SEEN_OK = ("typeof(hash) = 'blob' AND length(hash) = 16 AND typeof(seen) IN ('integer', 'real') "
            "AND typeof(reused) = 'integer' AND reused IN (0, 1)")


def count_ok(value: object) -> bool:
    """Whether a write-log value is what the writer logs: a whole number of 0 to `MAX_HOUR_BYTES`."""
    return type(value) is int and 0 <= value <= MAX_HOUR_BYTES


def window_bytes(rows: Iterable[Sequence], hour: int, window: int, limit: int | None,
                 closed: int | None = None) -> int:
    """Bytes written and downloaded in the `window` hours up to `hour` (and as many ahead), from
    (hour, bytes, downloaded) rows. An hour whose values are damaged (None, or not `count_ok`),
    and the hour `closed` (`closed_hour`: one whose damage repair set to 0), count as the whole
    `limit` (0 without one): it keeps the budget closed until it leaves the window, and no longer."""
    used = 0
    for h, nbytes, downloaded in rows:
        if hour - window < h <= hour + window:
            used += nbytes + downloaded if count_ok(nbytes) and count_ok(downloaded) else limit or 0
    if closed is not None and hour - window < closed <= hour + window:
        used += limit or 0
    return used


def kept_problem(name: str, value: object, chunk_sizes: Iterable[int] = ()) -> str | None:
    """What is wrong with `value` as the kept form of setting `name`, as a clause (`is not one
    of all, reused, pinned`; None: nothing, or not a setting the store keeps). A setting counted
    in chunks is right if it fits the commands' chunk size or one of `chunk_sizes` (the store's
    models'). The one definition is `kvstore.settings`."""
    s = settings.BY_NAME.get(name)
    if s is None or not s.kept:
        return None
    if not isinstance(value, str):
        return f"is not text but {'a blob' if isinstance(value, bytes) else type(value).__name__}"
    problems = []
    for size in (settings.CHUNK_SIZE, *chunk_sizes):
        try:
            s.decode(value, size)
            return None
        except InvalidInputError as e:
            problems.append(str(e))
    return problems[0]


def _missing_table(e: sqlite3.OperationalError) -> bool:
    return "no such table" in str(e)


class WriteLogSQL:
    """The write log, the seen marks and the settings (`Index` mixes this in)."""

    conn: sqlite3.Connection
    transaction: "contextlib.AbstractContextManager"

    # -- the write log ----------------------------------------------------------------------

    def log_writes(self, hour: int, deltas: dict[str, int]) -> None:
        """Add `deltas` (columns of `write_log`) to the row of `hour`."""
        deltas = {k: v for k, v in deltas.items() if v}
        if not deltas:
            return
        with self.transaction() as conn:
            _add(conn, hour, deltas)

    def reserve_writes(self, sizes: Sequence[int], hour: int, window_hours: int, limit: int | None) -> int:
        """Count as written the leading `sizes` that keep the bytes written (and downloaded) in
        the last `window_hours` hours at or under `limit`; how many. In one transaction, so two
        processes never both take the last of the budget."""
        with self.transaction() as conn:
            k = len(sizes)
            if limit is not None:
                used = window_bytes(conn.execute(
                    "SELECT hour, bytes, downloaded FROM write_log WHERE hour > ? AND hour <= ?",
                    (hour - window_hours, hour + window_hours)), hour, window_hours, limit, _closed(conn))
                k = 0
                for n in sizes:
                    if used + n > limit:
                        break
                    used += n
                    k += 1
            if k:
                _add(conn, hour, {"bytes": sum(sizes[:k]), "records": k})
        return k

    def write_hours(self, since_hour: int) -> list[tuple]:
        """(hour, *LOG_COLUMNS) of every logged hour from `since_hour` on, in order; a damaged
        value is None (see `window_bytes`)."""
        try:
            rows = self.conn.execute(f"SELECT hour, {', '.join(LOG_COLUMNS)} FROM write_log WHERE hour >= ? "
                                     "ORDER BY hour", (since_hour,)).fetchall()
        except sqlite3.OperationalError as e:
            if _missing_table(e):
                return []
            raise
        return [(h, *(v if count_ok(v) else None for v in values)) for h, *values in rows]

    def write_totals(self) -> dict[str, int]:
        """Every column of `write_log` summed over the store's life (damaged values left out)."""
        ok = "typeof({0}) = 'integer' AND {0} BETWEEN 0 AND " + str(MAX_HOUR_BYTES)
        try:
            row = self.conn.execute("SELECT " + ", ".join(
                f"coalesce(sum(CASE WHEN {ok.format(c)} THEN {c} END), 0)" for c in LOG_COLUMNS)
                + " FROM write_log").fetchone()
        except sqlite3.OperationalError as e:
            if not _missing_table(e):
                raise
            row = (0,) * len(LOG_COLUMNS)
        return dict(zip(LOG_COLUMNS, row))

    def closed_hour(self) -> int | None:
        """The hour the budget counts as full while it is in the window (see `window_bytes`)."""
        return _closed(self.conn)

    def close_hour(self, hour: int) -> None:
        """Count `hour` as the whole budget while it is in the window (the latest such hour is
        kept), logging no bytes: the lifetime counts stay what was written."""
        with self.transaction() as conn:
            _close(conn, hour)

    def damaged_log(self) -> list[tuple[int, str, object]]:
        """(hour, column, value) of every write-log value that is not `count_ok`, (hour, "hour",
        hour) of every row before 1970 or more than a window ahead of now, and (now, "closed",
        value) of a closed hour that is not one (for verify: a full scan, a few thousand rows a year)."""
        now_hour = hour_of(time.time())
        out: list[tuple[int, str, object]] = []
        try:
            rows = self.conn.execute(f"SELECT hour, {', '.join(LOG_COLUMNS)} FROM write_log ORDER BY hour").fetchall()
        except sqlite3.OperationalError as e:
            if _missing_table(e):
                return []
            raise
        for h, *values in rows:
            if not 0 <= h <= now_hour + WINDOW_HOURS:
                out.append((h, "hour", h))
            out += [(h, c, v) for c, v in zip(LOG_COLUMNS, values) if not count_ok(v)]
            row = dict(zip(LOG_COLUMNS, values))
            if count_ok(row["bytes"]) and count_ok(row["explicit"]) and row["explicit"] > row["bytes"]:
                out.append((h, "explicit", row["explicit"]))  # (a part of the bytes, never more)
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (_CLOSED,)).fetchone()
        if row is not None and not _an_hour(row[0]):
            out.append((now_hour, "closed", row[0]))
        return out

    def mend_log(self) -> None:
        """Rewrite `damaged_log`'s rows, in one transaction: a row of an impossible hour goes;
        every damaged value becomes 0 (nothing is known to have been written), and the latest
        hour of the budget's window whose bytes or downloads were damaged is closed
        (`close_hour`: full until it leaves the window, as it read before)."""
        hour = hour_of(time.time())
        damaged = self.damaged_log()
        with self.transaction() as conn:
            for h, column, _ in damaged:
                if column == "hour":
                    conn.execute("DELETE FROM write_log WHERE hour = ?", (h,))
                elif column != "closed":
                    conn.execute(f"UPDATE write_log SET {column} = 0 WHERE hour = ?", (h,))
            full = [h for h, column, _ in damaged
                    if column in ("bytes", "downloaded", "closed") and h > hour - WINDOW_HOURS]
            if full:
                _close(conn, max(full))

    # -- seen marks (admit="reused") --------------------------------------------------------

    def seen_marks(self, hashes: Sequence[bytes]) -> dict[bytes, bool]:
        """hash -> whether it was seen again (`reused`), for the `hashes` seen at all."""
        out: dict[bytes, bool] = {}
        hashes = list(hashes)
        try:
            for i in range(0, len(hashes), _MAX_PARAMS):
                part = hashes[i : i + _MAX_PARAMS]
                out.update((h, bool(r)) for h, r in self.conn.execute(
                    f"SELECT hash, reused FROM seen_prefixes WHERE hash IN ({','.join('?' * len(part))}) "
                    f"AND {_SEEN_OK}", part))
        except sqlite3.OperationalError as e:
            if not _missing_table(e):
                raise
        return out

    def mark_seen(self, seen: Sequence[bytes], reused: Sequence[bytes], now: float) -> None:
        """Mark `seen` as seen (once) and `reused` as seen again, in one transaction."""
        if not seen and not reused:
            return
        with self.transaction() as conn:
            conn.executemany("INSERT OR IGNORE INTO seen_prefixes (hash, seen) VALUES (?, ?)",
                             [(h, now) for h in seen])
            conn.executemany("INSERT INTO seen_prefixes (hash, seen, reused) VALUES (?, ?, 1) "
                             "ON CONFLICT (hash) DO UPDATE SET reused = 1", [(h, now) for h in reused])

    def prune_seen(self, before: float, keep: int) -> int:
        """Forget marks older than `before`, and the oldest beyond `keep`; how many."""
        with self.transaction() as conn:
            gone = conn.execute("DELETE FROM seen_prefixes WHERE seen < ?", (before,)).rowcount
            extra = conn.execute("SELECT count(*) FROM seen_prefixes").fetchone()[0] - keep
            if extra > 0:
                gone += conn.execute("DELETE FROM seen_prefixes WHERE hash IN (SELECT hash FROM seen_prefixes "
                                     "ORDER BY seen LIMIT ?)", (extra,)).rowcount
        return gone

    def damaged_seen(self) -> list[tuple[object, object, object]]:
        """(hash, seen, reused) of every seen mark a reader ignores (for verify: a full scan)."""
        try:
            return self.conn.execute(f"SELECT hash, seen, reused FROM seen_prefixes WHERE NOT ({_SEEN_OK})").fetchall()
        except sqlite3.OperationalError as e:
            if _missing_table(e):
                return []
            raise

    def forget_damaged_seen(self) -> int:
        """Delete the seen marks `damaged_seen` finds (the key is merely seen afresh); how many."""
        with self.transaction() as conn:
            return conn.execute(f"DELETE FROM seen_prefixes WHERE NOT ({_SEEN_OK})").rowcount

    # -- the deletion and insertion logs (filled by triggers on `records`: migrations 0023, 0026) --

    def deletions_end(self) -> int:
        """The number of the last deletion logged (0: none yet)."""
        return self._log_end("deletion_log")

    def deletions_since(self, seq: int, limit: int = 10_000) -> list[tuple[int, bytes, bytes]]:
        """(number, hash, namespace) of the records deleted or quarantined after deletion `seq`,
        oldest first, at most `limit`. The log keeps the last 100,000: when the first number is
        past `seq + 1`, some were forgotten."""
        return self._log_since("deletion_log", seq, limit)

    def logged_deleted(self, hashes: list[bytes]) -> set[bytes]:
        """Which of `hashes` the deletion log holds: their rows were deleted (by a gc, say), so a
        file of one left behind is a leftover of that, not of a lost index."""
        out: set[bytes] = set()
        try:
            for i in range(0, len(hashes), 500):
                part = hashes[i:i + 500]
                out |= {h for (h,) in self.conn.execute(
                    f"SELECT hash FROM deletion_log WHERE hash IN ({', '.join('?' * len(part))})", part)}
        except sqlite3.OperationalError as e:
            if not _missing_table(e):
                raise
        return out

    def insertions_end(self) -> int:
        """The number of the last insertion logged (0: none yet)."""
        return self._log_end("insertion_log")

    def insertions_since(self, seq: int, limit: int = 10_000) -> list[tuple[int, bytes, bytes]]:
        """(number, hash, namespace) of the rows inserted after insertion `seq`, by any process,
        oldest first, at most `limit` (the last 100,000 are kept, as deletions are)."""
        return self._log_since("insertion_log", seq, limit)

    def _log_end(self, table: str) -> int:
        try:
            return self.conn.execute(f"SELECT coalesce(max(seq), 0) FROM {_LOGS[table]} WHERE {_LOG_OK}").fetchone()[0]
        except sqlite3.OperationalError as e:  # a read-only index from before the log
            if _missing_table(e):
                return 0
            raise

    def _log_since(self, table: str, seq: int, limit: int) -> list[tuple[int, bytes, bytes]]:
        try:
            return self.conn.execute(f"SELECT seq, hash, ns FROM {_LOGS[table]} WHERE seq > ? AND {_LOG_OK} "
                                     "ORDER BY seq LIMIT ?", (seq, limit)).fetchall()
        except sqlite3.OperationalError as e:
            if _missing_table(e):
                return []
            raise

    def damaged_log_entries(self) -> list[tuple[str, object, object, object]]:
        """(log, number, hash, namespace) of the entries of the deletion and insertion logs that
        their readers skip (for verify)."""
        out = []
        for table in _LOGS:
            try:
                out += [(table, *r) for r in self.conn.execute(
                    f"SELECT seq, hash, ns FROM {_LOGS[table]} WHERE NOT ({_LOG_OK}) ORDER BY seq")]
            except sqlite3.OperationalError as e:
                if not _missing_table(e):
                    raise
        return out

    def forget_damaged_log_entries(self) -> None:
        """Delete what `damaged_log_entries` finds."""
        with self.transaction() as conn:
            for table in _LOGS:
                try:
                    conn.execute(f"DELETE FROM {_LOGS[table]} WHERE NOT ({_LOG_OK})")
                except sqlite3.OperationalError as e:
                    if not _missing_table(e):
                        raise

    # -- marks: whole numbers in `meta` that only rise (pins' serials, a tenants' server's mark) ---

    def marks(self, prefix: str) -> dict[str, int]:
        """The whole-number `meta` values under `prefix` (high-water marks, see `raise_mark`)."""
        rows = self.conn.execute("SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))
        return {k: int(v) for k, v in rows if str(v).isdigit()}

    def raise_mark(self, key: str, value: int) -> None:
        """Set the `meta` value `key` to `value` unless it holds a larger one (a mark only rises)."""
        with self.transaction() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            if row is None or not str(row[0]).isdigit() or int(row[0]) < value:
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, str(int(value))))

    def drop_mark(self, key: str) -> None:
        """Forget the mark `key` (a node's pins taken as retired: a mark only rises, but for this)."""
        with self.transaction() as conn:
            conn.execute("DELETE FROM meta WHERE key = ?", (key,))

    # -- settings kept in the store ---------------------------------------------------------

    def damaged_settings(self) -> list[tuple[str, object, str]]:
        """(name, value, what is wrong) of every kept setting not in its kept form."""
        rows = self.conn.execute("SELECT key, value FROM meta WHERE key LIKE 'setting.%'").fetchall()
        sizes = [n for (n,) in self.conn.execute("SELECT DISTINCT chunk_size FROM models") if type(n) is int and n > 0]
        out = [(key[len(_SETTING):], value, kept_problem(key[len(_SETTING):], value, sizes)) for key, value in rows]
        return [row for row in out if row[2] is not None]

    def setting(self, name: str) -> str | None:
        """The text a setting is kept as (`set_setting`), or None; `kvstore.settings` checks it."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (_SETTING + name,)).fetchone()
        return row[0] if row else None

    def settings(self) -> dict[str, str]:
        """Every setting the store keeps, by name (as text: the reader checks it). A damaged one
        is read from the copy beside the index (`index.settings`) when the copy's is right."""
        rows = self.conn.execute("SELECT key, value FROM meta WHERE key LIKE ?", (_SETTING + "%",)).fetchall()
        # Not text is damage: it is handed on in a form no setting parses, so it reads as damaged.
        kept = {key[len(_SETTING):]: value if isinstance(value, str) else f"\0{value!r}" for key, value in rows}
        bad = [name for name, value in kept.items() if kept_problem(name, value) is not None]
        copy = read_settings_copy(self.path.parent) if bad else None
        for name in (n for n in bad if copy and n in copy and kept_problem(n, copy[n]) is None):
            kept[name], s = copy[name], settings.BY_NAME[name]
            if (self.path, name) not in _SAID_COPY:
                _SAID_COPY.add((self.path, name))
                log.warning("kvstore: the kept %s is damaged in the index: read from %s (%s); `kvstore verify "
                            "--repair` writes it back", name, SETTINGS_NAME, s.show(s.decode(copy[name])))
        return kept

    def set_setting(self, name: str, value: str | None) -> None:
        """Keep a setting in the store for later opens (None forgets it). The kept settings are
        copied to the file beside the index (`index.settings`), which a rebuild reads them back from."""
        with self.transaction() as conn:
            if value is None:
                conn.execute("DELETE FROM meta WHERE key = ?", (_SETTING + name,))
            else:
                conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                             "SET value = excluded.value", (_SETTING + name, value))
            try:  # (in the transaction: two processes never leave the older copy last)
                self._write_settings_copy(conn)
            except OSError as e:  # kept in the index all the same; a rebuild then closes the limits
                log.warning("kvstore: the copy of the kept settings (%s) was not written: %s", SETTINGS_NAME, e)

    def keep_settings_copy(self, *, missing_only: bool = False) -> None:
        """Write the copy of the kept settings beside the index (`missing_only`: if there is none)."""
        if missing_only and os.path.lexists(self.path.parent / SETTINGS_NAME):
            return
        with self.transaction() as conn:
            self._write_settings_copy(conn)

    def _write_settings_copy(self, conn) -> None:
        kept = {k[len(_SETTING):]: v if isinstance(v, str) else f"\0{v!r}" for k, v in conn.execute(
            "SELECT key, value FROM meta WHERE key LIKE ?", (_SETTING + "%",))}
        copy = read_settings_copy(self.path.parent) or {}  # (a value damaged in the index keeps the copy's right one)
        kept.update({n: copy[n] for n, v in kept.items()
                     if kept_problem(n, v) and n in copy and not kept_problem(n, copy[n])})
        write_own_file(self.path.parent / SETTINGS_NAME, json.dumps({SETTINGS_FORMAT: kept}, sort_keys=True))

    # -- what computed a model's exact-mode records (`kvstore.model.blas`) ------------------

    def computed_with(self, ns: bytes) -> list[str]:
        """What computed the exact-mode records of namespace `ns` (mlx, device, BLAS), first first."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (_COMPUTED + ns.hex(),)).fetchone()
        try:
            got = json.loads(row[0]) if row else []
        except (TypeError, ValueError):
            return []
        return [str(k) for k in got if isinstance(k, str)][:_MAX_COMPUTED] if isinstance(got, list) else []

    def add_computed_with(self, ns: bytes, what: str) -> None:
        """Add `what` to `computed_with(ns)` (at most a few are kept: the first ones)."""
        with self.transaction() as conn:
            row = conn.execute("SELECT value FROM meta WHERE key = ?", (_COMPUTED + ns.hex(),)).fetchone()
            try:
                known = json.loads(row[0]) if row else []
            except (TypeError, ValueError):
                known = []
            known = [k for k in known if isinstance(k, str)] if isinstance(known, list) else []
            if what not in known and len(known) < _MAX_COMPUTED:
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                             (_COMPUTED + ns.hex(), json.dumps(known + [what])))


def _an_hour(value: object) -> bool:
    return isinstance(value, str) and value.isdigit() and len(value) < 12


def _closed(conn: sqlite3.Connection) -> int | None:
    """The closed hour (`WriteLogSQL.closed_hour`); a damaged one is this hour (it fails closed)."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (_CLOSED,)).fetchone()
    except sqlite3.OperationalError as e:
        if _missing_table(e):
            return None
        raise
    if row is None:
        return None
    return int(row[0]) if _an_hour(row[0]) else hour_of(time.time())


def _close(conn: sqlite3.Connection, hour: int) -> None:
    """Keep `hour` as the closed hour unless a later one is."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (_CLOSED,)).fetchone()
    if row is None or not _an_hour(row[0]) or int(row[0]) < hour:
        conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (_CLOSED, str(int(hour))))


def _add(conn: sqlite3.Connection, hour: int, deltas: dict[str, int]) -> None:
    """Add to the row of `hour`, in the caller's transaction. What is given back (a negative
    delta: taken, then not written) comes off this hour and the one before, never below 0 (what
    is left stays counted), so no row is ever negative: a negative row is damage."""
    bad = set(deltas) - set(LOG_COLUMNS)
    if bad:
        raise ValueError(f"write_log has no column {sorted(bad)[0]!r}")
    up = {c: n for c, n in deltas.items() if n > 0}
    if up:
        conn.execute("INSERT OR IGNORE INTO write_log (hour) VALUES (?)", (hour,))
        conn.execute(f"UPDATE write_log SET {', '.join(f'{c} = {c} + ?' for c in up)} WHERE hour = ?",
                     (*up.values(), hour))
    for c, n in deltas.items():
        rows = conn.execute(f"SELECT hour, {c} FROM write_log WHERE hour IN (?, ?) ORDER BY hour DESC",
                            (hour, hour - 1)).fetchall() if n < 0 else []
        for h, have in rows:
            off = min(-n, have) if count_ok(have) else 0
            if off:
                conn.execute(f"UPDATE write_log SET {c} = {c} - ? WHERE hour = ?", (off, h))
                n += off
