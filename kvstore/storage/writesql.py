"""The SQL of what the store writes: the hourly write log the write budget and `stats` read, the
seen marks of `admit="reused"`, and the store's own settings.

Mixed into `Index` (which gives it `conn` and `transaction`), as `evictsql` is. A store opened
read-only whose index predates these tables reads them as empty.
"""

from __future__ import annotations

import contextlib
import sqlite3
from typing import Sequence

from kvstore.storage import schema

_MAX_PARAMS = schema.MAX_PARAMS
HOUR_S = 3600


def hour_of(t: float) -> int:
    """The write log's hour of unix time `t`."""
    return int(t // HOUR_S)


#: The columns of `write_log` a caller may add to.
LOG_COLUMNS = ("bytes", "records", "downloaded", "not_admitted", "not_admitted_bytes", "over_budget",
               "over_budget_bytes", "explicit")
_SETTING = "setting."


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
                used = conn.execute("SELECT coalesce(sum(bytes + downloaded), 0) FROM write_log WHERE hour > ?",
                                    (hour - window_hours,)).fetchone()[0]
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
        """(hour, *LOG_COLUMNS) of every logged hour from `since_hour` on, in order."""
        try:
            return self.conn.execute(f"SELECT hour, {', '.join(LOG_COLUMNS)} FROM write_log WHERE hour >= ? "
                                     "ORDER BY hour", (since_hour,)).fetchall()
        except sqlite3.OperationalError as e:
            if _missing_table(e):
                return []
            raise

    def write_totals(self) -> dict[str, int]:
        """Every column of `write_log` summed over the store's life."""
        try:
            row = self.conn.execute(
                f"SELECT {', '.join(f'coalesce(sum({c}), 0)' for c in LOG_COLUMNS)} FROM write_log").fetchone()
        except sqlite3.OperationalError as e:
            if not _missing_table(e):
                raise
            row = (0,) * len(LOG_COLUMNS)
        return dict(zip(LOG_COLUMNS, row))

    # -- seen marks (admit="reused") --------------------------------------------------------

    def seen_marks(self, hashes: Sequence[bytes]) -> dict[bytes, bool]:
        """hash -> whether it was seen again (`reused`), for the `hashes` seen at all."""
        out: dict[bytes, bool] = {}
        hashes = list(hashes)
        try:
            for i in range(0, len(hashes), _MAX_PARAMS):
                part = hashes[i : i + _MAX_PARAMS]
                out.update((h, bool(r)) for h, r in self.conn.execute(
                    f"SELECT hash, reused FROM seen_prefixes WHERE hash IN ({','.join('?' * len(part))})", part))
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

    # -- settings kept in the store ---------------------------------------------------------

    def setting(self, name: str) -> str | None:
        """A setting the store keeps (`set_setting`), or None."""
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (_SETTING + name,)).fetchone()
        return row[0] if row else None

    def settings(self) -> dict[str, str]:
        """Every setting the store keeps, by name (as text: the reader checks it)."""
        rows = self.conn.execute("SELECT key, value FROM meta WHERE key LIKE ?", (_SETTING + "%",)).fetchall()
        return {key[len(_SETTING):]: value for key, value in rows if isinstance(value, str)}

    def set_setting(self, name: str, value: str | None) -> None:
        """Keep a setting in the store for later opens (None forgets it)."""
        with self.transaction() as conn:
            if value is None:
                conn.execute("DELETE FROM meta WHERE key = ?", (_SETTING + name,))
            else:
                conn.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE "
                             "SET value = excluded.value", (_SETTING + name, value))


def _add(conn: sqlite3.Connection, hour: int, deltas: dict[str, int]) -> None:
    """Add to the row of `hour`, in the caller's transaction."""
    bad = set(deltas) - set(LOG_COLUMNS)
    if bad:
        raise ValueError(f"write_log has no column {sorted(bad)[0]!r}")
    conn.execute("INSERT OR IGNORE INTO write_log (hour) VALUES (?)", (hour,))
    conn.execute(f"UPDATE write_log SET {', '.join(f'{c} = {c} + ?' for c in deltas)} WHERE hour = ?",
                 (*deltas.values(), hour))
