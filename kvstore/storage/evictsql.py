"""The SQL of gc: the eviction graph it plans from, the deletes that carry the plan out, and the
totals a budget is checked against: the store's (the `totals` table, per namespace) and each
tenant's, which its quota (`tenant_max_bytes`) is checked against.

Mixed into `Index` (which gives it `conn`, this thread's connection): these statements are the
index's, kept apart only because they are one job. The `children` edges gc walks and deletes are
checked here too (`damaged_edges`, `edgeless`) and rewritten from the records (`mend_edges`). What to evict is `upkeep/evict.py`'s choice.
"""

from __future__ import annotations

import contextlib
import sqlite3
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

from kvstore.records import CHECKPOINT, CHUNK, TAIL
from kvstore.storage import schema

_MAX_PARAMS = schema.MAX_PARAMS
#: The columns of `totals` (per namespace).
TOTALS = ("bytes", "chunks", "tails", "checkpoints")
_TOTALS_SQL = ", ".join(TOTALS)
# The sums of `totals` and how many of its values are not whole numbers of 0 or more, in one scan.
_TOTALS_SUMS = ("SELECT " + ", ".join(f"coalesce(sum({c}), 0)" for c in TOTALS) + ", coalesce(sum("
                + " OR ".join(f"typeof({c}) != 'integer' OR {c} < 0" for c in TOTALS) + "), 0) FROM totals")
# Of `records r`: its parent is neither stored nor a model's root (nothing reaches it).
_PARENT_GONE = ("NOT EXISTS (SELECT 1 FROM records p WHERE p.hash = r.parent) "
                "AND NOT EXISTS (SELECT 1 FROM models m WHERE m.ns = r.parent)")
#: The strongest role class (`upkeep.evict.ROLES`: 0 assistant, 1 user, 2 system).
MAX_ROLE = 2
#: A record's role as gc may trust it: a damaged one (text, NULL, out of range) is the weakest,
#: so gc can always evict it and the disk budget holds.
ROLE_OK = f"(typeof(role) = 'integer' AND role BETWEEN 0 AND {MAX_ROLE})"
_ROLE = f"(CASE WHEN {ROLE_OK} THEN role ELSE 0 END)"
#: A record's bookkeeping as gc may trust it: a damaged value never keeps a record. A size that is
#: not a whole number of 0 or more counts 0 (gc then evicts more, never less), a last access that
#: is not a time is the epoch (it goes first), a pin flag that is not a whole number is no pin,
#: and a quarantine flag of the wrong type is a quarantine (readers never serve it).
SIZE = "(CASE WHEN typeof(size) = 'integer' AND size >= 0 THEN size ELSE 0 END)"
_LAST = "(CASE WHEN typeof(last_access) IN ('integer', 'real') THEN last_access ELSE 0 END)"
PINNED = "(typeof(pinned) = 'integer' AND pinned != 0)"
#: Of `records r`: a row whose identity a lookup can use (verify deletes or mends any other).
_RECORD_OK = ("typeof(r.hash) = 'blob' AND length(r.hash) = 16 AND typeof(r.parent) = 'blob' AND length(r.parent) = 16 "
              "AND (r.first_token IS NULL OR typeof(r.first_token) = 'integer') AND (r.tenant IS NULL OR "
              "(typeof(r.tenant) = 'text' AND length(r.tenant) = 16 AND r.tenant NOT GLOB '*[^0-9a-f]*'))")
#: Of `children c` and `records r`: `c` is the edge of `r` as a lookup reads it (`Index.children`).
EDGE_OF = "c.parent = r.parent AND c.first_token = coalesce(r.first_token, -1) AND c.hash = r.hash AND c.tenant IS r.tenant"


class EvictionSQL:
    """gc's statements, and the transactions every statement of the index writes in."""

    conn: sqlite3.Connection
    #: Entered around every transaction before it begins (`LocalStore` sets the blob tree's
    #: `write_turn`, so that writes queue behind gc on its lock); None: none.
    write_gate: Callable[[], contextlib.AbstractContextManager] | None = None

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """`BEGIN IMMEDIATE ... COMMIT` on this thread's connection, rolled back on any exception."""
        gate = self.write_gate
        with gate() if gate is not None else contextlib.nullcontext(), schema.transaction(self.conn) as conn:
            yield conn

    def eviction_graph(self, stale: Sequence[bytes] = (), tenants: bool = False,
                       batch: int = 1 << 16) -> Iterator[list[tuple]]:
        """(hash + parent, last access, (size * 4 + role) * 16 + flags) of every record, for
        planning an eviction (`evict.Graph.from_index`), in lists of up to `batch` rows; flags: 1
        pinned, 2 of a namespace in `stale`, 4 hangs from its namespace, 8 quarantined. Three
        columns, two of them numbers: at a million rows making the Python values is most of the
        time this takes, and in lists of a batch they take 10 MB at a time, not 180 MB (gc runs
        inside servers, for their disk budget). With `tenants`, a fourth: the record's tenant tag
        (None: shared), for the tenants' quota. One statement: one read of the table as it was."""
        stale = list(stale)[:_MAX_PARAMS]
        marks = ",".join("?" * len(stale))
        flag = f"(ns IN ({marks})) * 2" if stale else "0"
        rows = self.conn.execute(
            f"SELECT CAST(hash || parent AS BLOB), {_LAST}, "
            f"{SIZE} * 64 + {_ROLE} * 16 + {PINNED} + {flag} + (parent = ns) * 4 + (bad != 0) * 8"
            f"{', tenant' if tenants else ''} FROM records"
            # A row whose hash or parent is of the wrong type is never planned: verify reports it.
            " WHERE typeof(hash) = 'blob' AND length(hash) = 16 AND typeof(parent) = 'blob'"
            " AND length(parent) = 16",
            stale)
        try:
            while part := rows.fetchmany(batch):
                yield part
        finally:
            rows.close()

    def damaged_roles(self) -> list[tuple[bytes, object]]:
        """(hash, role) of every record whose role gc reads as the weakest because it is
        damaged (for verify: a full scan)."""
        return self.conn.execute(f"SELECT hash, role FROM records WHERE NOT {ROLE_OK}").fetchall()

    def reset_damaged_roles(self) -> int:
        """Set every damaged role to the weakest (0), as gc already reads it; how many."""
        with self.transaction() as conn:
            return conn.execute(f"UPDATE records SET role = 0 WHERE NOT {ROLE_OK}").rowcount

    @contextmanager
    def victims(self, hashes: Iterable[bytes], tops: Iterable[bytes] | None = None) -> Iterator[None]:
        """What gc evicts, held for `evict` in a table of this connection's own (in memory), with
        which of them are `tops` (their parent stays; None: all of them are)."""
        conn = self.conn
        conn.execute("PRAGMA temp_store = MEMORY")
        conn.execute("DROP TABLE IF EXISTS temp.victims")
        conn.execute("CREATE TEMP TABLE victims (hash BLOB PRIMARY KEY, top INTEGER NOT NULL) WITHOUT ROWID")
        try:
            hashes = sorted(hashes)
            top = None if tops is None else set(tops)
            rows = [(h, 1 if top is None or h in top else 0) for h in hashes]
            step = _MAX_PARAMS // 2
            conn.execute("BEGIN")  # (of the temporary table only: no lock on the index)
            try:
                for start in range(0, len(rows), step):
                    part = rows[start : start + step]
                    conn.execute("INSERT OR IGNORE INTO temp.victims VALUES " + ",".join(["(?, ?)"] * len(part)),
                                 [v for r in part for v in r])
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            yield
        finally:
            conn.execute("DROP TABLE IF EXISTS temp.victims")

    def evict(self, lo: bytes, hi: bytes) -> list[tuple[bytes, int, bytes, int]]:
        """Delete, in one transaction, the records of `victims` from `lo` to `hi` (hashes,
        inclusive: neighbours in the table) that are unpinned and, for the tops, have no stored
        child outside the victims. The checks are made here, so a record pinned since gc chose
        it stays, and so does the top of a branch that another process gave a new child. (Below
        a top a new child would be lost whatever this did: the top goes, and every lookup walks
        down through it. Checking only the tops took 3.5 s instead of 4.5 s at half of 1M rows.
        Such a child is left without its parent: `lost_since` finds it, `drop_lost` deletes it.)
        The edges out of the records deleted go in the same transaction: they are neighbours in
        `children` too (its key starts with the parent), and no lookup can walk them once their
        parent is gone. Returns (hash, size, parent, first token or -1) of the rows deleted:
        delete their files only now that this has committed, and then the edges into them whose
        parent is still stored (`forget_edges`)."""
        with self.transaction() as conn:
            deleted = conn.execute(
                "DELETE FROM records WHERE hash IN (SELECT hash FROM temp.victims v WHERE hash BETWEEN ? AND ? "
                "AND (v.top = 0 OR NOT EXISTS (SELECT 1 FROM children c WHERE c.parent = v.hash "
                "AND c.hash NOT IN (SELECT hash FROM temp.victims) "
                f"AND EXISTS (SELECT 1 FROM records k WHERE k.hash = c.hash)))) AND NOT {PINNED} "
                f"RETURNING hash, {SIZE}, parent, coalesce(first_token, -1)", (lo, hi)).fetchall()
            if deleted:  # (the edge of a child stored meanwhile stays: its parent may be stored again)
                conn.execute(
                    "DELETE FROM children WHERE parent IN (SELECT hash FROM temp.victims WHERE hash BETWEEN ? AND ?) "
                    "AND NOT EXISTS (SELECT 1 FROM records r WHERE r.hash = children.parent) "
                    "AND (children.hash IN (SELECT hash FROM temp.victims) "
                    "OR NOT EXISTS (SELECT 1 FROM records k WHERE k.hash = children.hash))", (lo, hi))
            return deleted

    def lost_since(self, since: float) -> list[bytes]:
        """Records stored since `since` (a time) whose parent is neither stored nor a model's
        root: another process stored them under a record that gc then deleted. One scan of the
        table (the creation time is read first: the parent is looked up only for new rows), in
        no transaction: nothing waits for it."""
        return [h for (h,) in self.conn.execute(
            "SELECT hash FROM records r WHERE created >= ? AND " + _PARENT_GONE, (since,))]

    def drop_lost(self, hashes: Sequence[bytes]) -> list[tuple[bytes, int, bytes, int]]:
        """Delete, in one transaction, these records if their parent is still neither stored
        nor a root (`lost_since`), with everything below them and the edges out of them;
        pinned ones stay. Returns (hash, size, parent, first token or -1) of the rows deleted:
        delete their files once this has committed."""
        gone: list[tuple[bytes, int, bytes, int]] = []
        with self.transaction() as conn:
            for start in range(0, len(hashes), _MAX_PARAMS):
                seeds = list(hashes[start : start + _MAX_PARAMS])
                gone += conn.execute(
                    "WITH RECURSIVE lost(hash) AS ("
                    " SELECT r.hash FROM records r WHERE r.hash IN (" + ",".join("?" * len(seeds)) + ")"
                    " AND " + _PARENT_GONE +
                    " UNION SELECT c.hash FROM children c JOIN lost l ON c.parent = l.hash) "
                    f"DELETE FROM records WHERE hash IN (SELECT hash FROM lost) AND NOT {PINNED} "
                    f"RETURNING hash, {SIZE}, parent, coalesce(first_token, -1)", seeds).fetchall()
            conn.executemany("DELETE FROM children WHERE parent = ?", [(row[0],) for row in gone])
            conn.executemany("DELETE FROM children WHERE parent = ? AND first_token = ? AND hash = ?",
                             [(row[2], row[3], row[0]) for row in gone])  # (and the edges into them)
        return gone

    def forget_edges(self, edges: Sequence[tuple[bytes, int, bytes]]) -> int:
        """Delete, in one transaction, these (parent, first token or -1, hash) edges of
        `children` (give them in that order: neighbours in the table), each unless its record is
        stored (again: another process may have written it since). Returns how many went.
        gc gives it the edges `evict` left: those whose parent is still stored."""
        with self.transaction() as conn:
            before = conn.total_changes
            conn.executemany(
                "DELETE FROM children WHERE parent = ? AND first_token = ? AND hash = ? "
                "AND NOT EXISTS (SELECT 1 FROM records r WHERE r.hash = ?3)", edges)
            return conn.total_changes - before

    def forget_lost_edges(self) -> int:
        """Delete every edge whose record is gone (a gc stopped between its two sweeps leaves
        some; readers ignore them). A scan of the whole table: for `verify --repair`."""
        with self.transaction() as conn:
            return conn.execute(
                "DELETE FROM children WHERE NOT EXISTS "
                "(SELECT 1 FROM records r WHERE r.hash = children.hash)").rowcount

    def damaged_edges(self) -> list[tuple]:
        """(parent, first token, hash, tenant, whether a record has that hash) of every edge of
        `children` that is no record's edge: a lookup never reads it (for verify: a full scan)."""
        return self.conn.execute(
            "SELECT parent, first_token, hash, tenant, EXISTS (SELECT 1 FROM records k WHERE k.hash = c.hash) "
            f"FROM children c WHERE NOT EXISTS (SELECT 1 FROM records r WHERE r.hash = c.hash AND {_RECORD_OK} "
            f"AND {EDGE_OF})").fetchall()

    def edgeless(self) -> list[tuple[bytes, bytes, int, str | None]]:
        """(hash, parent, first token or -1, tenant) of every record whose edge from its parent
        is missing or wrong: no lookup finds it under its parent (for verify: a full scan)."""
        return self.conn.execute(
            f"SELECT hash, parent, coalesce(first_token, -1), tenant FROM records r WHERE {_RECORD_OK} "
            f"AND NOT EXISTS (SELECT 1 FROM children c WHERE {EDGE_OF})").fetchall()

    def mend_edges(self) -> int:
        """Make `children` the records' edges again, in one transaction: every edge that is no
        record's goes, and every record's missing one is written from its row; how many changed."""
        with self.transaction() as conn:
            before = conn.total_changes
            conn.execute(f"DELETE FROM children AS c WHERE NOT EXISTS (SELECT 1 FROM records r WHERE "
                         f"r.hash = c.hash AND {_RECORD_OK} AND {EDGE_OF})")
            conn.execute("INSERT OR REPLACE INTO children (parent, first_token, hash, tenant) SELECT r.parent, "
                         f"coalesce(r.first_token, -1), r.hash, r.tenant FROM records r WHERE {_RECORD_OK} "
                         f"AND NOT EXISTS (SELECT 1 FROM children c WHERE {EDGE_OF})")
            return conn.total_changes - before

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

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the database as far as readers allow; never waits for
        a writer or blocks one (SQLite's PASSIVE checkpoint)."""
        try:
            self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.OperationalError:  # busy: a later one does it
            pass

    # -- totals (what a budget checks, and stats read) -----------------------------------------------------------------------------

    def totals(self) -> dict[str, int]:
        """The store's totals: `bytes`, `chunks`, `tails`, `checkpoints` (counted from the
        records when the `totals` table is damaged, as `namespace_totals` says)."""
        *sums, damaged = self.conn.execute(_TOTALS_SUMS).fetchone()
        if damaged:
            sums = [sum(column) for column in zip(*self.counted_totals().values())] or [0, 0, 0, 0]
        return dict(zip(TOTALS, sums))

    def namespace_totals(self) -> dict[bytes, tuple[int, ...]]:
        """ns -> its totals (in `TOTALS` order). When a value in the `totals` table is not a
        whole number of 0 or more, the table is damaged: they are counted from the records
        instead (`verify` reports it, `verify --repair` rewrites the table)."""
        stored = self.stored_totals()
        if all(whole(v) for values in stored.values() for v in values):
            return stored
        return self.counted_totals()

    def stored_totals(self) -> dict[object, tuple]:
        """ns -> its row of the `totals` table as stored, whatever its types (for verify)."""
        return {ns: tuple(values) for ns, *values in self.conn.execute(f"SELECT ns, {_TOTALS_SQL} FROM totals")}

    def counted_totals(self) -> dict[bytes, tuple[int, ...]]:
        """ns -> its totals (in `TOTALS` order) counted from the records (one scan of them)."""
        return {ns: tuple(values) for ns, *values in self.conn.execute(
            "SELECT ns, coalesce(sum(CASE WHEN typeof(size) = 'integer' THEN size END), 0), "
            f"sum(kind = {CHUNK}), sum(kind = {TAIL}), sum(kind = {CHECKPOINT}) FROM records GROUP BY ns")}

    def rewrite_totals(self) -> None:
        """The `totals` table counted again from the records, in one transaction."""
        with self.transaction() as conn:
            conn.execute("DELETE FROM totals")
            conn.executemany(f"INSERT INTO totals (ns, {_TOTALS_SQL}) VALUES (?, ?, ?, ?, ?)",
                             [(ns, *values) for ns, values in self.counted_totals().items()])

    def quarantined(self) -> tuple[int, int]:
        """(records, bytes) of the records quarantined now: never served, held until a gc (one
        scan of the table: 0.08 s at a million rows)."""
        n, size = self.conn.execute(
            "SELECT count(*), coalesce(sum(size), 0) FROM records WHERE bad != 0").fetchone()
        return n, size

    # -- per tenant (`tenant_totals` is kept by the triggers of migration 0022) ---------------

    def tenant_totals(self) -> dict[str, tuple[int, int]]:
        """tag -> (records, bytes) of every tenant that has records (from `tenant_totals`). A row
        that does not hold two counts (damage: verify reports it, its repair counts again) is
        counted from the records meanwhile, so that no reader (stats, gc, /metrics, a server's
        start) gets text for a number, or a wrong total."""
        rows = self.conn.execute("SELECT tenant, records, bytes FROM tenant_totals").fetchall()
        bad = [tag for tag, n, size in rows if not (whole(n) and whole(size))]
        counted = self.counted_tenant_totals() if bad else {}
        out = {}
        for tag, n, size in rows:
            if not isinstance(tag, str):  # (a tag no record can have)
                continue
            if tag in counted:
                n, size = counted[tag]
            elif tag in bad:
                n, size = 0, 0
            if n > 0:
                out[tag] = (n, size)
        return dict(sorted(out.items(), key=lambda item: (-item[1][1], item[0])))

    def tenants_over(self, max_bytes: int) -> list[str]:
        """The tags of the owners (`tenant_owners`) whose tenants hold more than `max_bytes` together."""
        return sorted(tag for tag, (_, size) in self.quota_totals().items() if size > max_bytes)

    def tenant_owners(self) -> dict[str, str]:
        """tag -> the tag of the tenant whose quota it shares (migration 0027): the salted tenants
        `kvstore serve --trust-client-salt` made. A tenant not in it is its own owner; a row that
        does not hold two tags (damage) is left out, so that tenant counts alone."""
        return {tag: owner for tag, owner in self.conn.execute("SELECT tenant, owner FROM tenant_owners")
                if _is_tag(tag) and _is_tag(owner) and tag != owner}

    def quota_totals(self) -> dict[str, tuple[int, int]]:
        """owner tag -> (records, bytes) of its tenants together (itself and those it owns): what
        `tenant_max_bytes` bounds."""
        owners, out = self.tenant_owners(), {}
        for tag, (n, size) in self.tenant_totals().items():
            was = out.get(owners.get(tag, tag), (0, 0))
            out[owners.get(tag, tag)] = (was[0] + n, was[1] + size)
        return out

    def stored_tenant_totals(self) -> dict[object, tuple]:
        """tag -> (records, bytes) of `tenant_totals` as stored, whatever their types (for verify)."""
        return {tag: (n, size) for tag, n, size in self.conn.execute("SELECT tenant, records, bytes FROM tenant_totals")}

    def counted_tenant_totals(self) -> dict[str, tuple[int, int]]:
        """tag -> (records, bytes) counted from the records (one scan: for verify)."""
        return {tag: (n, size) for tag, n, size in self.conn.execute(
            "SELECT tenant, count(*), coalesce(sum(CASE WHEN typeof(size) = 'integer' THEN size END), 0) "
            "FROM records WHERE tenant IS NOT NULL GROUP BY tenant")}

    def rewrite_tenant_totals(self) -> None:
        """`tenant_totals` counted again from the records, in one transaction."""
        with self.transaction() as conn:
            conn.execute("DELETE FROM tenant_totals")
            conn.executemany("INSERT INTO tenant_totals (tenant, records, bytes) VALUES (?, ?, ?)",
                             [(tag, n, size) for tag, (n, size) in self.counted_tenant_totals().items()])


def _is_tag(value: object) -> bool:
    return isinstance(value, str) and len(value) == 16 and all(c in "0123456789abcdef" for c in value)


def whole(value: object) -> bool:
    """A whole number of 0 or more, as SQLite hands back an integer column that holds one."""
    return type(value) is int and value >= 0
